#!/usr/bin/env bash
# bench/edition/edition.sh: the SQL edition (docs/sql-edition.md, issue 28) against the
# extension, side by side in one run, on the workloads of scripts/bench.sh sections 1 to 3:
#
#   hit       pgbench bench/pgbench/once_hit.sql (claim_key on one of 10,000 completed
#             keys, made by bench/pgbench/hot_setup.sql), 8 clients: transactions/s
#   cycle     pgbench bench/pgbench/once_cycle.sql (claim_key + complete_key on a fresh
#             key), 1 and 8 clients: transactions/s
#   stampede  the tools' harness (tools/src/bin/bench), `stampede --strategy server`:
#             20 and 200 callers on one cold key, 500 ms computation, every caller in
#             claim_key(wait => 60 s); ms from the owner's complete_key to each other
#             caller's answer, by the server's clock (p50, p99)
#   takeover  the harness, `takeover`: ms from pg_terminate_backend of a claim's owner to
#             a caller waiting in claim_key(wait) holding the claim (30 s lease)
#   waiting   the stampede of 200 callers with a 3 s computation: the server's extra CPU
#             over the 500 ms stampede of the same round, per second of the extra 2.5 s:
#             cores kept busy by 200 callers waiting (latch sleep, or polling)
#
# Two throwaway clusters run at once, with the same settings (scripts/lib.sh cluster_start):
#   extension  EXT_PG_BIN's PostgreSQL, which must already have pg_once installed (this
#              script never builds or installs it), preloaded as README.md recommends
#              (shared_preload_libraries, once.databases = 'app'), CREATE EXTENSION by the
#              superuser in database app;
#   edition    EDITION_PG_BIN's PostgreSQL (no pg_once library needed), the script of
#              scripts/sql-edition.sh installed in database app by its owner, a role that
#              is not a superuser (CREATEROLE, pg_read_all_stats, pg_signal_backend), as
#              scripts/test-sql-edition.sh does.
# On both, the 10,000 hot keys are made by pg_once's owner (postgres, admin), and every
# workload runs as the application role bench_app, granted USAGE on schema once and
# EXECUTE on its functions (README.md, Granting access): what an application on a managed
# server runs as, and a non-superuser pays each call's namespace check on both sides.
#
# Each measurement alternates the sides (extension, edition, extension, ...) for ROUNDS
# rounds, so that both see the same state of a shared machine; a ratio edition/extension
# compares medians from the same run. Rows go to bench/results/edition.jsonl (replaced by
# each run; OUT_JSONL= elsewhere), with the load average at each row; the table is
# printed at the end (bench/report.py table edition).
#
# Run (as root, as scripts/*.sh do; about 4 minutes with the defaults):
#   PG_ONCE_WORK=/var/tmp/edbench PG_ONCE_BENCH_PORT=28300 \
#   EXT_PG_BIN=/opt/pg-bench/usr/lib/postgresql/15/bin \
#   EDITION_PG_BIN=/opt/pg-node/usr/lib/postgresql/15/bin \
#   CARGO_TARGET_DIR=/var/tmp/pg_once-scale/target nice -n 10 bench/edition/edition.sh
# Settings: ROUNDS (3), SECONDS_PER_RUN (5), STAMPEDE_CALLERS ("20 200"; the waiting row
# needs 200 among them), EXT_PG_BIN (default /usr/lib/postgresql/15/bin), EDITION_PG_BIN
# (default PG_ONCE_PG_BIN, as for scripts/*.sh), PG_ONCE_BENCH_PORT (28300; the edition's
# cluster takes the next port).
#
# Until commit b99d8de the figures depended on how long a run was: with prepared
# transactions allowed (lib.sh's clusters allow 10), every edition transaction wrote a
# counts slot of its own into once_internal.key_counts, whose dead rows the next fold
# read again until autovacuum (from about 500 to 160 cycles/s at 8 clients within a
# minute). bench/edition/drift.sh runs cycles for 2 minutes and samples that table.
set -euo pipefail
PG_MAJOR=15
source "$(dirname "$0")/../../scripts/lib.sh"
EXT_PG_BIN=${EXT_PG_BIN:-/usr/lib/postgresql/15/bin}
EDITION_PG_BIN=${EDITION_PG_BIN:-$PG_BIN}
ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-5}
STAMPEDE_CALLERS=${STAMPEDE_CALLERS:-20 200}
WAIT_CALLERS=200   # also in STAMPEDE_CALLERS: the waiting rows compare with its stampede
EXT_PORT=${PG_ONCE_BENCH_PORT:-28300}
ED_PORT=$((EXT_PORT + 1))
RESULTS=${OUT_JSONL:-$REPO_ROOT/bench/results/edition.jsonl}
SQL=$REPO_ROOT/bench/pgbench
BIN=${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release

# The extension must be there already: a benchmark installs nothing into a PostgreSQL.
ext_lib=$("$EXT_PG_BIN/pg_config" --pkglibdir)/pg_once.so
ext_control=$("$EXT_PG_BIN/pg_config" --sharedir)/extension/pg_once.control
if [ ! -f "$ext_lib" ] || [ ! -f "$ext_control" ]; then
    echo "no pg_once in $EXT_PG_BIN's PostgreSQL ($ext_lib): install a release build there first" >&2
    exit 1
fi
EXT_VERSION=$(sed -n "s/^default_version = '\(.*\)'/\1/p" "$ext_control")

mkdir -p "$PG_ONCE_WORK"
chown postgres "$PG_ONCE_WORK"
say "building the benchmark harness and the SQL edition"
(cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin bench)
BUILD=$PG_ONCE_WORK/edition-build
"$REPO_ROOT/scripts/sql-edition.sh" "$BUILD" >/dev/null
chmod -R a+rX "$BUILD"

# side NAME: PG_BIN and PORT of side NAME (extension or edition); lib.sh's cluster_*
# functions run $PG_BIN's programs, so each side's calls come after this.
side() {
    case $1 in
    extension) PG_BIN=$EXT_PG_BIN PORT=$EXT_PORT ;;
    edition) PG_BIN=$EDITION_PG_BIN PORT=$ED_PORT ;;
    esac
}
stop_both() {
    side extension; cluster_stop edbench-ext
    side edition; cluster_stop edbench-edition
}
trap stop_both EXIT
# The same application role and database on both; pg_once's owner differs by design.
roles=(-c "CREATE ROLE admin LOGIN CREATEROLE IN ROLE pg_read_all_stats, pg_signal_backend"
       -c "CREATE ROLE bench_app LOGIN" -c "CREATE DATABASE app OWNER admin")
grants="GRANT USAGE ON SCHEMA once TO bench_app;
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO bench_app;"
# hot_setup.sql fills both the hand-made baseline's table and pg_once: the table is made
# first (handmade_setup.sql) so that the file runs unchanged.
say "extension ($EXT_PG_BIN, pg_once $EXT_VERSION, preloaded) on port $EXT_PORT"
side extension
cluster_start edbench-ext "$EXT_PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'app'"
cluster_psql edbench-ext "$EXT_PORT" -q "${roles[@]}"
cluster_psql edbench-ext "$EXT_PORT" -d app -q -c "CREATE EXTENSION pg_once" -c "$grants" \
    -f "$SQL/handmade_setup.sql" -f "$SQL/hot_setup.sql" >/dev/null
say "SQL edition ($EDITION_PG_BIN, installed by a non-superuser owner) on port $ED_PORT"
side edition
cluster_start edbench-edition "$ED_PORT"
cluster_psql edbench-edition "$ED_PORT" -q "${roles[@]}"
"$PG_BIN/psql" -h "$PG_ONCE_WORK/edbench-edition" -p "$ED_PORT" -U admin -d app -X -q -v ON_ERROR_STOP=1 \
    -f "$BUILD/pg_once_sql.sql" -c "$grants" -f "$SQL/handmade_setup.sql" -f "$SQL/hot_setup.sql" >/dev/null
if [ -n "$(cluster_psql edbench-edition "$ED_PORT" -Atc "SHOW shared_preload_libraries")" ] ||
    [ "$(cluster_psql edbench-edition "$ED_PORT" -d app -Atc "SELECT count(*) FROM pg_extension WHERE extname = 'pg_once'")" != 0 ]; then
    echo "the edition's cluster has the extension: it would not measure the edition" >&2
    exit 1
fi

dsn() {
    case $1 in
    extension) echo "host=127.0.0.1 port=$EXT_PORT user=bench_app dbname=app" ;;
    edition) echo "host=127.0.0.1 port=$ED_PORT user=bench_app dbname=app" ;;
    esac
}
socket_dir() { case $1 in extension) echo "$PG_ONCE_WORK/edbench-ext" ;; edition) echo "$PG_ONCE_WORK/edbench-edition" ;; esac; }
load1() { cut -d' ' -f1 /proc/loadavg; }

: >"$RESULTS"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
commit=$(git -C "$REPO_ROOT" rev-parse --short HEAD)
git -C "$REPO_ROOT" diff --quiet HEAD -- sql/edition src/protocol/sql scripts/sql-edition.sh scripts/sql_edition.py ||
    commit+=" with local changes"

# pgbench_row MEASURE WORKLOAD CLIENTS SIDE ROUND: one pgbench run, one JSON line.
pgbench_row() {
    local measure=$1 workload=$2 clients=$3 s=$4 round=$5 load tps
    side "$s"
    load=$(load1)
    tps=$("$PG_BIN/pgbench" -h "$(socket_dir "$s")" -p "$PORT" -U bench_app -n -M prepared \
        -c "$clients" -j 2 -T "$SECONDS_PER_RUN" -f "$SQL/$workload.sql" app 2>&1 |
        sed -n 's/^tps = \([0-9.]*\) .*/\1/p')
    [ -n "$tps" ] || { echo "pgbench $workload on the $s failed" >&2; exit 1; }
    printf '{"bench":"edition","measure":"%s","clients":%s,"side":"%s","round":%s,"load1":%s,"tps":%s}\n' \
        "$measure" "$clients" "$s" "$round" "$load" "$tps" >>"$RESULTS"
}

# server_ticks SIDE: CPU time of that side's cluster so far, in clock ticks: its postmaster's
# own and that of the children it reaped (exited backends), plus its running children's.
server_ticks() {
    local postmaster
    postmaster=$(head -1 "$(socket_dir "$1")/data/postmaster.pid")
    {
        sed 's/^.*) //' "/proc/$postmaster/stat" | awk '{print $12 + $13 + $14 + $15}'
        for child in $(pgrep -P "$postmaster"); do
            sed 's/^.*) //' "/proc/$child/stat" 2>/dev/null | awk '{print $12 + $13}'
        done
    } | awk '{sum += $1} END {print sum}'
}

# harness_row MEASURE SIDE ROUND HARNESS-ARGS...: one round of the tools' harness, its
# JSON line with this benchmark's fields added, and the CPU seconds its server spent
# meanwhile (server_cpu_s; the harness's 1 s pause after a round lets the backends exit).
harness_row() {
    local measure=$1 s=$2 round=$3; shift 3
    local tmp=$PG_ONCE_WORK/harness-row.jsonl load before after
    load=$(load1)
    rm -f "$tmp"
    before=$(server_ticks "$s")
    "$BIN/bench" --dsn "$(dsn "$s")" --rounds 1 --json-out "$tmp" --label "$s" "$@" >/dev/null
    after=$(server_ticks "$s")
    python3 - "$tmp" "$measure" "$s" "$round" "$load" "$(( after - before ))" "$(getconf CLK_TCK)" >>"$RESULTS" <<'PY'
import json, os, sys
path, measure, side, rnd, load, ticks, hz = sys.argv[1:]
row = json.loads(open(path).read())
harness = row.pop("bench")
if os.environ.get("LONGER_BY_S"):
    row["longer_by_s"] = float(os.environ["LONGER_BY_S"])
print(json.dumps({"bench": "edition", "measure": measure, "side": side, "round": int(rnd),
                  "load1": float(load), "harness": harness,
                  "server_cpu_s": int(ticks) / int(hz), **row}))
PY
}

for ((r = 1; r <= ROUNDS; r++)); do
    say "round $r/$ROUNDS: hit and cycle (pgbench, $SECONDS_PER_RUN s each), load $(load1)"
    for s in extension edition; do pgbench_row hit once_hit 8 "$s" "$r"; done
    for c in 1 8; do
        for s in extension edition; do pgbench_row cycle once_cycle "$c" "$s" "$r"; done
    done
done
for ((r = 1; r <= ROUNDS; r++)); do
    say "round $r/$ROUNDS: stampede ($STAMPEDE_CALLERS callers) and takeover, load $(load1)"
    for n in $STAMPEDE_CALLERS; do
        for s in extension edition; do
            harness_row stampede "$s" "$r" stampede --strategy server --callers "$n"
        done
    done
    for s in extension edition; do harness_row takeover "$s" "$r" takeover; done
    # What waiting costs the server: the stampede of WAIT_CALLERS callers again with a
    # computation 2.5 s longer; the extra CPU over the 500 ms one, per second, is what that
    # many callers waiting cost (table edition: cores busy while they wait).
    for s in extension edition; do
        LONGER_BY_S=2.5 harness_row waiting "$s" "$r" stampede --strategy server --callers "$WAIT_CALLERS" --compute-ms 3000
    done
done

side edition
printf '{"bench":"edition","measure":"run","started":"%s","finished":"%s","cores":%s,"load_before":"%s","load_after":"%s","rounds":%s,"seconds_per_run":%s,"extension_version":"%s","extension_pg":"%s","edition_commit":"%s","postgres":"%s"}\n' \
    "$started" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(nproc)" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" \
    "$ROUNDS" "$SECONDS_PER_RUN" "$EXT_VERSION" "$EXT_PG_BIN" "$commit" \
    "$("$PG_BIN/postgres" --version | awk '{print $3}')" >>"$RESULTS"
python3 "$REPO_ROOT/bench/report.py" table edition "$RESULTS"
