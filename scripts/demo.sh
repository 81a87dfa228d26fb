#!/usr/bin/env bash
# Install whatever is missing, build and install pg_once, start a throwaway PostgreSQL 15
# cluster and run the demo: a fleet of clients asking for a few slow URLs.
# Extra arguments go to the demo, e.g. scripts/demo.sh --clients 100 --scrape-ms 3000
# --pgbouncer: the clients reach the server through a PgBouncer in transaction mode (pool
# of 6) using pg_once_client, each with a direct LISTEN connection that owns its claims.
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_DEMO_PORT:-25533}
BOUNCER_PORT=${PG_ONCE_DEMO_BOUNCER_PORT:-$((PORT + 1))}

PGBOUNCER=0
ARGS=()
for arg in "$@"; do
    if [ "$arg" = --pgbouncer ]; then PGBOUNCER=1; else ARGS+=("$arg"); fi
done

ensure_toolchain
install_extension release
say "building the demo"
(cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin demo)
say "starting a throwaway cluster on 127.0.0.1:$PORT, pg_once preloaded"
cluster_start demo "$PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres'"
trap 'cluster_stop demo' EXIT
cluster_psql demo "$PORT" -q -c "CREATE EXTENSION pg_once"
DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"
if ((PGBOUNCER)); then
    say "starting PgBouncer on 127.0.0.1:$BOUNCER_PORT (transaction mode, pool of 6)"
    pgbouncer_start demo-bouncer "$BOUNCER_PORT" "$PORT" 6 transaction
    trap 'pgbouncer_stop demo-bouncer; cluster_stop demo' EXIT
    ARGS+=(--bouncer-dsn "host=127.0.0.1 port=$BOUNCER_PORT user=postgres dbname=postgres")
fi
"${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/demo" --dsn "$DSN" ${ARGS[@]+"${ARGS[@]}"}
