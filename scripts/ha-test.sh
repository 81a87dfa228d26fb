#!/usr/bin/env bash
# pg_once under a real HA manager (issue 37): Patroni with etcd and three PostgreSQL 15
# nodes preloading pg_once, on loopback ports; the three client libraries under load
# through multi-host connection strings; kill -9 of the leader's postmaster, a planned
# switchover, synchronous then asynchronous replication, and the zombie scenario
# (pg_test/ha/README.md says what it asserts; pg_test/ha/harness.py does it).
#
#   ./scripts/ha-test.sh            as root, after `cargo pgrx install` into $PG_ONCE_PG_BIN's
#                                   PostgreSQL 15 (step 4 of scripts/test.sh runs it so)
#
# PG_ONCE_PG_BIN: the bin directory of the PostgreSQL 15 with pg_once installed (default
# the system's); PG_ONCE_WORK: where the nodes live ($PG_ONCE_WORK/ha, as postgres);
# PG_ONCE_HA_PORT: the first of the 20 ports it uses (default 40 above PG_ONCE_TEST_PORT,
# 25472): etcd's client and peer ports, the three servers at +10, their REST APIs at +15.
# HA_MODES="sync" (or "async") runs one mode; HA_ZOMBIE=0 skips the zombie scenario.
# Figures: printed, and in $PG_ONCE_WORK/ha/figures.json.
set -euo pipefail
PG_MAJOR=15 source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
port=${PG_ONCE_HA_PORT:-$((${PG_ONCE_TEST_PORT:-25432} + 40))}

for program in patroni etcd; do
    command -v "$program" >/dev/null ||
        { echo "$program is missing: apt-get install patroni etcd-server (test.sh's step 1 does)" >&2; exit 1; }
done

# The Python load and the checker: the client from this tree, psycopg 3.
venv=$PG_ONCE_WORK/ha-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check ./clients/python "psycopg[binary]"
# The Node load: the client from this tree and its dependencies (step 6 installs them too).
[ -d clients/node/node_modules/pg ] || (cd clients/node && npm ci --silent --no-audit --no-fund)
# The Rust load.
cargo build --quiet -p pg_once_tools --bin ha_load
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

mkdir -p "$PG_ONCE_WORK"
chown postgres "$PG_ONCE_WORK"
"$venv/bin/python" pg_test/ha/harness.py --bin "$PG_BIN" --work "$PG_ONCE_WORK/ha" \
    --port "$port" --repo "$REPO_ROOT" --python "$venv/bin/python" \
    --rust-load "$target/debug/ha_load" --modes "${HA_MODES:-sync async}" \
    --zombie "${HA_ZOMBIE:-1}"
