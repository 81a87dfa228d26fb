#!/usr/bin/env bash
# Install whatever is missing, build and install pg_once, start a throwaway PostgreSQL 15
# cluster and run the demo: a fleet of clients asking for a few slow URLs.
# Extra arguments go to the demo, e.g. scripts/demo.sh --clients 100 --scrape-ms 3000
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_DEMO_PORT:-55433}

ensure_toolchain
install_extension release
say "building the demo"
(cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin demo)
say "starting a throwaway cluster on 127.0.0.1:$PORT, pg_once preloaded"
cluster_start demo "$PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres'"
trap 'cluster_stop demo' EXIT
cluster_psql demo "$PORT" -q -c "CREATE EXTENSION pg_once"
"$REPO_ROOT/target/release/demo" --dsn "host=127.0.0.1 port=$PORT user=postgres dbname=postgres" "$@"
