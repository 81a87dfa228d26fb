#!/usr/bin/env bash
# Install whatever is missing, then run every pg_once test. Run as root on Debian bookworm.
#
#   1. formatting and lints         cargo fmt --check, cargo clippy -D warnings
#   2. single-session unit tests    cargo pgrx test (#[pg_test], in src/tests.rs)
#   3. SQL regression tests         pg_regress, pg_test/regress
#      isolation specs              pg_isolation_regress, pg_test/isolation
#   4. multi-connection tests       cargo test -p pg_once_multi, pg_test/multi, and crash
#                                   and restart tests that kill -9 and stop -m immediate
#   5. invariant soak               tools' soak: random operations, killed connections,
#                                   guarantees checked throughout (about a minute in all)
#   6. example clients              examples/python (psycopg 3), examples/node (pg)
#
# Steps 3 and 4 run twice, against throwaway clusters on 127.0.0.1: one without
# preloading (polling, direct NOTIFY, no worker) on $PG_ONCE_TEST_PORT, and one with
# shared_preload_libraries = 'pg_once' (wake-ups, worker, relay) on the next port.
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_TEST_PORT:-55432}
started=$SECONDS

ensure_toolchain
cd "$REPO_ROOT"

say "1/6 formatting and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

say "2/6 unit tests: cargo pgrx test"
cargo pgrx test pg15 --runas postgres --pgdata "$PG_ONCE_WORK/pgrx-test"

install_extension debug
cargo build --quiet -p pg_once_multi --tests

# run_pgxs_suite SUITE PORT OUTDIR DB TEST...: runs PostgreSQL's pg_regress (SUITE regress)
# or pg_isolation_regress (SUITE isolation) on pg_test/SUITE against the server on PORT,
# printing the diffs when a test fails.
run_pgxs_suite() {
    local suite=$1 port=$2 out=$PG_ONCE_WORK/$3 db=$4
    shift 4
    local tool=pg_regress
    [ "$suite" = isolation ] && tool=pg_isolation_regress
    rm -rf "$out"
    if ! "$($PG_CONFIG --pkglibdir)/pgxs/src/test/$suite/$tool" \
            --bindir="$PG_BIN" --inputdir="pg_test/$suite" --outputdir="$out" \
            --host=127.0.0.1 --port="$port" --user=postgres --dbname="$db" "$@"; then
        cat "$out/regression.diffs" >&2
        exit 1
    fi
}

# run_server_tests NAME PORT [postgresql.conf lines...]
run_server_tests() {
    local name=$1 port=$2; shift 2
    cluster_start "$name" "$port" "$@"
    export PG_ONCE_DSN="host=127.0.0.1 port=$port user=postgres dbname=postgres"

    say "3/6 SQL regression tests, $name server: pg_regress"
    run_pgxs_suite regress "$port" regress-$name pg_once_regress \
        $(cd pg_test/regress/sql && ls *.sql | sed 's/\.sql$//')

    if [ "$name" = plain ]; then
        python3 scripts/check-docs.py
    fi

    # Isolation specs expire leases by hand; a worker reaping them in between would make
    # their output depend on timing, so they run on the server without one.
    if [ "$name" = plain ]; then
        say "3/6 isolation specs, $name server: pg_isolation_regress"
        run_pgxs_suite isolation "$port" isolation pg_once_isolation \
            $(cd pg_test/isolation/specs && ls *.spec | sed 's/\.spec$//')
    fi

    say "4/6 multi-connection tests, $name server"
    cluster_psql "$name" "$port" -q -c "CREATE EXTENSION pg_once"
    cargo test -p pg_once_multi --quiet --test protocol --test wakeups --test queue
    # These kill and restart the server: alone, one at a time.
    PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data \
        cargo test -p pg_once_multi --quiet --test crash -- --test-threads=1

    say "5/6 invariant soak, $name server, $soak_seconds s"
    cargo run --quiet -p pg_once_tools --bin soak -- --seconds "$soak_seconds" | tail -25

    say "6/6 Python and Node clients, $name server"
    (cd examples/python && "$py_venv/bin/python" -m unittest test_client)
    (cd examples/node && PG_ONCE_DSN="postgres://postgres@127.0.0.1:$port/postgres" node --test test.js |
        grep -E '^# (pass|fail)')
    cluster_stop "$name"
}

trap 'cluster_stop plain; cluster_stop preloaded' EXIT
say "installing the example clients' dependencies"
py_venv=$PG_ONCE_WORK/py-venv
[ -x "$py_venv/bin/python" ] || python3 -m venv "$py_venv"
"$py_venv/bin/pip" install --quiet --disable-pip-version-check -r examples/python/requirements.txt
(cd examples/node && npm ci --silent --no-audit --no-fund)

soak_seconds=${SOAK_PLAIN_SECONDS:-20}
run_server_tests plain "$PORT"
soak_seconds=${SOAK_PRELOADED_SECONDS:-40}
run_server_tests preloaded $((PORT + 1)) "shared_preload_libraries = 'pg_once'" \
    "once.databases = 'postgres'"

say "all tests passed in $((SECONDS - started)) s"
