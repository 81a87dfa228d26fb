#!/usr/bin/env bash
# Install whatever is missing, then run every pg_once test. Run as root on Debian bookworm.
#
#   1. formatting and lints         cargo fmt --check, cargo clippy -D warnings
#   2. single-session unit tests    cargo pgrx test (#[pg_test], in src/tests.rs)
#   3. SQL regression tests         pg_regress, pg_test/regress
#   4. multi-connection tests       cargo test -p pg_once_multi, pg_test/multi
#
# Steps 3 and 4 run against a throwaway cluster on 127.0.0.1:$PG_ONCE_TEST_PORT.
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_TEST_PORT:-55432}
started=$SECONDS

ensure_toolchain
cd "$REPO_ROOT"

say "1/4 formatting and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

say "2/4 unit tests: cargo pgrx test"
cargo pgrx test pg15 --runas postgres --pgdata "$PG_ONCE_WORK/pgrx-test"

install_extension debug
cluster_start test "$PORT"
trap 'cluster_stop test' EXIT
export PG_ONCE_DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"

say "3/4 SQL regression tests: pg_regress"
regress_out=$PG_ONCE_WORK/regress
rm -rf "$regress_out"
if ! "$($PG_CONFIG --pkglibdir)/pgxs/src/test/regress/pg_regress" \
        --bindir="$PG_BIN" --inputdir=pg_test/regress --outputdir="$regress_out" \
        --host=127.0.0.1 --port="$PORT" --user=postgres --dbname=pg_once_regress \
        $(cd pg_test/regress/sql && ls *.sql | sed 's/\.sql$//'); then
    cat "$regress_out/regression.diffs" >&2
    exit 1
fi

say "4/4 multi-connection tests"
cluster_psql test "$PORT" -q -c "CREATE EXTENSION pg_once"
cargo test -p pg_once_multi --quiet

say "all tests passed in $((SECONDS - started)) s"
