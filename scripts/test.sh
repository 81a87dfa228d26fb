#!/usr/bin/env bash
# Install whatever is missing, then run every pg_once test. Run as root on Debian bookworm.
#
#   ./scripts/test.sh              every PostgreSQL version (14 to 18), one after the other
#   ./scripts/test.sh --pg 17      one version (or --pg "15 18"; PG_ONCE_PG works too)
#
# 15 is the host's: steps 1 to 9. 16, 17 and 18: steps 2 to 4 (3 on the plain server, 4 on
# the preloaded one: see server_step; and step 1, the extension's lints for that version,
# with PG_ONCE_LINT_EVERY_VERSION=1), and 8 (their package; installed and tested on 17 and
# 18). 17 and 18 run in Debian chroots that the run creates, or reuses from
# /var/cache/pg_once (scripts/pg-versions.sh); the tests' clients run on the host and
# reach those servers on 127.0.0.1 as they do 15's. No Debian release ships 14 or 16: 16
# comes from PyPI's pgserver wheel and runs on the host; 14 is type-checked and linted
# against pgrx's bindings, with no server.
#
#   1. formatting and lints         cargo fmt --check, cargo clippy -D warnings,
#                                   check-boundary (SQL declarations = Rust signatures),
#                                   check-cycles (no modules that import each other),
#                                   check-edition (the SQL edition names only Rust items
#                                   that exist, and raises only the extension's hints)
#                                   and check-sql (the scripts' operators are pg_catalog's)
#   2. single-session unit tests    cargo pgrx test (#[pg_test]s in src/tests/, and plain
#                                   #[test]s of code with no PostgreSQL in it)
#   3. SQL regression tests         pg_regress, pg_test/regress
#      isolation specs              pg_isolation_regress, pg_test/isolation
#      SQL edition (15 only)        scripts/test-sql-edition.sh: the plain-SQL edition
#                                   installed by a non-superuser owner, docs.sql's core
#                                   transcript and its multi-session checks, on its own
#                                   server (port 6 above $PG_ONCE_TEST_PORT, its
#                                   standby 7 above); scripts/test-sql-edition-more.sh:
#                                   the views, once.cached and the pg_tle form (8 and 9
#                                   above), and with step 6 the three client libraries'
#                                   suites against the edition (direct, as its owner)
#   4. multi-connection tests       cargo test -p pg_once_multi, pg_test/multi; on a hot
#                                   standby of the preloaded server; crash and restart
#                                   tests that kill -9 and stop -m immediate; fencing
#                                   tokens across DROP/CREATE EXTENSION and pg_restore;
#                                   pg_once's launcher and workers terminated; on 15,
#                                   failover under Patroni (scripts/ha-test.sh: three
#                                   preloaded nodes, the three clients' load, kill -9 of
#                                   the leader, a switchover, sync and async replication,
#                                   the zombie scenario; ports 40 to 59 above
#                                   $PG_ONCE_TEST_PORT)
#   5. invariant soak               tools' soak: random operations, killed connections,
#                                   guarantees checked throughout (about a minute in all)
#   6. client libraries             clients/python (psycopg 3), clients/node (pg),
#                                   clients/rust (tokio-postgres) on the preloaded
#                                   server (with step 3 also on the SQL edition's), direct
#                                   and through PgBouncer in transaction mode; on 15's
#                                   preloaded server also over TLS only, verified against a
#                                   private CA (lib.sh's cluster_tls), and the
#                                   idempotency middlewares over HTTP, each example
#                                   service under its real server (clients/conformance/http);
#                                   on the preloaded server also through a hot standby
#                                   listed first, and across a failover of a primary and
#                                   standby pair (scripts/failover.sh)
#   7. monitoring                   Debian's postgres_exporter with
#                                   monitoring/postgres_exporter.yml: the documented
#                                   metrics, moving with use; the Grafana dashboard and
#                                   alerting rules ask only for them, parse, and the rules
#                                   pass their promtool tests (scripts/check-monitoring.py); on 15's
#                                   preloaded server the dashboard (ui/, pg-once-ui) in
#                                   Debian's Chromium driven by Playwright (ui/tests)
#   8. packaging                    scripts/package.sh: the Debian package (debug build)
#                                   installed into the system PostgreSQL 15 with dpkg, a
#                                   clean preloaded cluster of it, pg_regress against it,
#                                   then dpkg -r; the PGXN distribution's META.json
#   9. upgrade from the last release  RELEASES' last line built from its commit, filled,
#                                   upgraded in place with ALTER EXTENSION UPDATE:
#                                   refusals while library and SQL differ, schema equal
#                                   to a fresh install, rows and tokens kept, step 4's
#                                   tests on the upgraded database (scripts/upgrade-test.sh)
#
# scripts/suite.sh runs one suite (regress, isolation, multi, the clients') against a
# server you already have; this script runs them through it on the servers it starts.
#
# STEPS="2 4" (for example) runs only those steps, and SERVERS="preloaded" only that
# server's run of steps 3 to 7; by default everything runs on 15, and steps 1 to 4 and 8
# on 16, 17 and 18 (the soak and the client libraries, 5 and 6, with STEPS: they add minutes a
# version and reach the server only through SQL that steps 2 to 4 already run).
#
# Steps 3 to 7 run twice, against throwaway clusters on 127.0.0.1: one without
# preloading (polling, direct NOTIFY, no worker) on $PG_ONCE_TEST_PORT, and one with
# shared_preload_libraries = 'pg_once' (wake-ups, worker, relay) on the next port. Each
# has a PgBouncer in transaction mode (pool 6) in front of it, 10 ports higher, for the
# tests of pooled clients (PG_ONCE_BOUNCER_DSN). The ports are below Linux's ephemeral
# range (32768-60999), so that no client socket of an earlier test can hold them. For step
# 4 the preloaded server also gets a hot standby (pg_basebackup -R) on the port after it
# (PG_ONCE_STANDBY_DSN); for step 7 each server gets a postgres_exporter 20 ports higher,
# and the preloaded one dashboards (pg-once-ui) on four ports from 34 above it. Every
# port a run uses is in PORT_OFFSETS below.
# Step 8 runs once the servers of steps 3 to 7 (which load the build `cargo pgrx install`
# put in place) are stopped: the package replaces those files. Its cluster listens on the
# port 5 above $PG_ONCE_TEST_PORT; step 9's on the port 4 above it (and its PgBouncer 10
# higher).
versions=${PG_ONCE_PG:-14 15 16 17 18}
if [ "${1:-}" = --pg ]; then
    versions=${2:?--pg needs a version, e.g. --pg 17}
    shift 2
fi
if [ "$(wc -w <<<"$versions")" -gt 1 ]; then
    # The chroots of 17 and 18 are made while 15 is tested.
    (
        PG_MAJOR=15 source "$(dirname "$0")/lib.sh"
        # shellcheck disable=SC2046
        pg_env_prefetch $(tr ' ' '\n' <<<"$versions" | grep -xE '17|18' || true)
    )
    # One run per version, each in its own process (its own PG_MAJOR, mounts and traps).
    summary=()
    for v in $versions; do
        started=$SECONDS
        PG_ONCE_PG=$v "$0" "$@" || exit
        summary+=("PostgreSQL $v: $((SECONDS - started)) s")
    done
    printf '\033[1m==> passed: %s\033[0m\n' "${summary[*]/%/;}" >&2
    exit 0
fi
PG_MAJOR=$versions
if [ "$PG_MAJOR" = 14 ]; then
    # Neither Debian nor any other registry we use ships it: type-checked only (README,
    # "PostgreSQL versions").
    PG_MAJOR=15 source "$(dirname "$0")/lib.sh"
    started=$SECONDS
    say "PostgreSQL $versions: type check against pgrx's bindings (no server to test here)"
    pg_typecheck "$versions"
    say "PostgreSQL $versions: type check passed in $((SECONDS - started)) s"
    exit 0
fi
source "$(dirname "$0")/lib.sh"
# Each version's servers on their own ports: 15 on PG_ONCE_TEST_PORT (25432), 16 to 18 on
# PG_ONCE_TEST_PORT_16 to _18 (100, 200 and 300 above it, unless set).
case $PG_MAJOR in
    15) PORT=${PG_ONCE_TEST_PORT:-25432} ;;
    *) port_var=PG_ONCE_TEST_PORT_$PG_MAJOR
       PORT=${!port_var:-$((${PG_ONCE_TEST_PORT:-25432} + 100 * (PG_MAJOR - 15)))} ;;
esac
# Every port a run listens on, as an offset from this version's PORT: one table, so that a
# new server takes a free offset instead of one another suite already uses. The SQL
# edition's scripts use the port after theirs for a standby or pg_tle's copy.
declare -A PORT_OFFSETS=(
    [plain]=0 [preloaded]=1 [preloaded-standby]=2 [preloaded-failover]=3
    [upgrade]=4 [package]=5 [edition]=6 [edition-standby]=7 [edition-more]=8 [edition-tle]=9
    [plain-bouncer]=10 [preloaded-bouncer]=11
    [upgrade-bouncer]=14                         # upgrade-test.sh's own, 10 above its server
    [plain-exporter]=20 [preloaded-exporter]=21
    [plain-ui]=30 [preloaded-ui]=35              # each dashboard test uses 4 from there
    [ha]=40                                      # to 59: etcd and Patroni (ha-test.sh)
    [clients-primary]=61 [clients-standby]=62    # the pair scripts/failover.sh promotes
)
# port_of NAME: the port of NAME in PORT_OFFSETS (an unknown name fails the run).
port_of() { echo $((PORT + ${PORT_OFFSETS[$1]})); }
# Servers run with Rust backtraces on, as a developer's might: no error a client sees may
# carry one (see errors::plain).
export RUST_BACKTRACE=1
started=$SECONDS
if [ "$PG_MAJOR" = 15 ]; then
    STEPS=${STEPS:-1 2 3 4 5 6 7 8 9}
else
    STEPS=${STEPS:-1 2 3 4 8}
fi
SERVERS=${SERVERS:-plain preloaded}
step() { [[ " $STEPS " == *" $1 "* ]]; }
# server_step N NAME: whether step N runs on server NAME. On 15, every step on both. On 16,
# 17 and 18, step 3 on the plain server (its isolation specs need one with no worker) and
# step 4 on the preloaded one (shared memory, the worker, a standby). What differs between
# versions is in src/pg_compat.rs, whose calls step 2's tests make on every version
# (src/tests/compat.rs those a claim does not); step 4's second run took 90 s a version
# and met nothing a version changes. BOTH_SERVERS=1 runs both steps on both servers; with
# one server (SERVERS), both run on it.
server_step() {
    step "$1" || return 1
    if [ "$PG_MAJOR" = 15 ] || [ -n "${BOTH_SERVERS:-}" ] || [ "$(wc -w <<<"$SERVERS")" = 1 ]; then
        return 0
    fi
    case $1/$2 in
        3/plain | 4/preloaded) return 0 ;;
        3/* | 4/*) return 1 ;;
    esac
}

# package_cleanup: undo test_package (step 8), also on exit, so that a failed step 8 leaves
# no package or cluster behind. Defined before the trap that calls it: a run that fails
# earlier still runs the trap.
package_pg=
package_cleanup() {
    [ -n "$package_pg" ] || return 0
    local pg=$package_pg saved=$PG_ONCE_WORK/package-saved root=
    package_pg=
    [ "$pg" = 15 ] || root=$(pg_env_root "$pg")
    (if [ "$pg" = 15 ]; then PG_BIN=/usr/lib/postgresql/15/bin; fi; cluster_stop package)
    if pg_build dpkg-query -W "postgresql-$pg-pg-once" >/dev/null 2>&1; then
        pg_build dpkg -r "postgresql-$pg-pg-once" >>"$PG_ONCE_WORK/package-dpkg.log" 2>&1
    fi
    cp -a "$saved"/lib/. "$root/usr/lib/postgresql/$pg/lib/"
    cp -a "$saved"/extension/. "$root/usr/share/postgresql/$pg/extension/"
    rm -rf "$saved"
}

# Stop what a run started, even when it fails; then unmount the chroot (for 17 and 18).
trap 'pgbouncer_stop plain-bouncer; pgbouncer_stop preloaded-bouncer; exporter_stop plain-exporter; exporter_stop preloaded-exporter; cluster_stop preloaded-standby; cluster_stop preloaded-failover; cluster_stop failover-1; cluster_stop failover-2; cluster_stop plain; cluster_stop preloaded; package_cleanup; pg_env_umount' EXIT
say "PostgreSQL $PG_MAJOR: steps $STEPS"
ensure_toolchain
cd "$REPO_ROOT"

if step 1 && [ "$PG_MAJOR" = 15 ]; then
    say "1/9 formatting and lints"
    cargo fmt --all --check
    cargo clippy --workspace --all-targets --quiet -- -D warnings
    python3 scripts/check-boundary.py
    python3 scripts/check-cycles.py
    python3 scripts/check-edition.py
    # Every operator the install and upgrade scripts resolve is pg_catalog's, checked with
    # PostgreSQL's own parser (pglast, from PyPI, in a virtualenv of its own).
    check_venv=$PG_ONCE_WORK/check-venv
    [ -x "$check_venv/bin/python" ] || python3 -m venv "$check_venv"
    "$check_venv/bin/pip" install --quiet --disable-pip-version-check 'pglast>=8,<9'
    "$check_venv/bin/python" scripts/check-sql.py
elif step 1 && [ -n "${PG_ONCE_LINT_EVERY_VERSION:-}" ]; then
    # What depends on the version: the extension's code under this version's cfg, all of
    # it in src/pg_compat.rs, whose branches step 2 compiles anyway. A build of its own
    # per version (a minute each of CI's time), so only on request.
    say "1/9 lints of the extension for PostgreSQL $PG_MAJOR"
    pg_build cargo clippy --quiet --lib --tests --no-default-features \
        --features "pg$PG_MAJOR pg_test" -- -D warnings
fi

if step 2; then
    say "2/9 unit tests: cargo pgrx test"
    # One at a time: the tests use the same keys in transactions that roll back, and a
    # claim never waits for another transaction's uncommitted claim (it is told `wait`).
    pg_build env RUST_TEST_THREADS=1 cargo pgrx test "pg$PG_MAJOR" --runas postgres \
        --pgdata "$PG_ONCE_WORK/pgrx-test-$PG_MAJOR"
fi

if step 3 || step 4 || step 5 || step 6 || step 7 || step 9; then
    install_extension debug
    cargo build --quiet -p pg_once_multi --tests
fi

# pgxs_suite SUITE PORT: scripts/suite.sh's regress or isolation against the server on
# PORT, with this version's pg_regress (in a chroot, PG_BIN's wrappers).
pgxs_suite() {
    local program=pg_regress var=PG_REGRESS
    [ "$1" = isolation ] && program=pg_isolation_regress var=PG_ISOLATION_REGRESS
    env "$var=$(pgxs_test_program "$1" "$program")" PG_BINDIR="$PG_BIN_INSIDE" \
        PG_ONCE_DSN="host=127.0.0.1 port=$2 user=postgres dbname=postgres" ./scripts/suite.sh "$1"
}

# run_server_tests NAME PORT [postgresql.conf lines...]
run_server_tests() {
    local name=$1 port=$2; shift 2
    cluster_start "$name" "$port" "max_prepared_transactions = 10" "$@"
    pgbouncer_start "$name-bouncer" $(port_of "$name-bouncer") "$port" 6
    export PG_ONCE_DSN="host=127.0.0.1 port=$port user=postgres dbname=postgres"
    export PG_ONCE_BOUNCER_DSN="host=127.0.0.1 port=$(port_of "$name-bouncer") user=postgres dbname=postgres"

    if server_step 3 "$name"; then
        say "3/9 SQL regression tests, $name server: pg_regress"
        pgxs_suite regress "$port"
        python3 scripts/check-docs.py
        # Isolation specs expire leases by hand; a worker reaping them in between would
        # make their output depend on timing, so they run on the server without one.
        if [ "$name" = plain ]; then
            say "3/9 isolation specs, $name server: pg_isolation_regress"
            pgxs_suite isolation "$port"
        fi
    fi

    cluster_psql "$name" "$port" -q -c "CREATE EXTENSION pg_once"
    if server_step 4 "$name"; then
        say "4/9 multi-connection tests, $name server"
        ./scripts/suite.sh multi
        if [ "$name" = preloaded ]; then
            say "4/9 hot standby of the $name server"
            standby_start "$name-standby" "$(port_of "$name-standby")" "$port"
            # One at a time, with nothing else writing: a waiting claim_key on a standby
            # holds back replay of the primary's cleanups, and so the change it waits for.
            PG_ONCE_STANDBY_DSN="host=127.0.0.1 port=$(port_of "$name-standby") user=postgres dbname=postgres" \
                cargo test -p pg_once_multi --quiet --test standby -- --test-threads=1
            cluster_stop "$name-standby"
        fi
        # These kill and restart the server, or drop the extension: alone, one at a time.
        PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data \
            cargo test -p pg_once_multi --quiet --test crash --test tokens -- --test-threads=1
        # Sets the sequence back, as a restore does (docs/concepts.md, "Fencing tokens").
        cargo test -p pg_once_multi --quiet --test token_draws
        # Locks once.entries, which blocks every other test's writes: alone.
        cargo test -p pg_once_multi --quiet --test table_locks
        # An asynchronous failover with a zombie of the lost WAL: on one version (the
        # token's timeline comes from one call of the server, pg_compat for 14), on the
        # preloaded server, with a standby the test stops, promotes and throws away.
        if [ "$name" = preloaded ] && [ "$PG_MAJOR" = 15 ]; then
            say "4/9 asynchronous failover, $name server"
            standby_start "$name-failover" "$(port_of "$name-failover")" "$port"
            PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data \
                PG_ONCE_PROMOTE_DATA_DIR=$PG_ONCE_WORK/$name-failover/data \
                PG_ONCE_PROMOTE_DSN="host=127.0.0.1 port=$(port_of "$name-failover") user=postgres dbname=postgres" \
                cargo test -p pg_once_multi --quiet --test failover
            cluster_stop "$name-failover"
        fi
        # These terminate pg_once's launcher and workers, create the databases it serves
        # and read the server's log: alone, one at a time, too.
        PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data PG_ONCE_SERVER_LOG=$PG_ONCE_WORK/$name/server.log \
            cargo test -p pg_once_multi --quiet --test worker -- --test-threads=1
        if [ "$name" = preloaded ] && [ "$PG_MAJOR" = 15 ]; then
            # Its own three-node cluster of the same installation, managed by Patroni
            # (pg_test/ha/README.md). 15 only: what it tests is replication and the
            # clients, which no server version changes.
            say "4/9 failover under Patroni: kill -9 of the leader, a switchover, sync and async"
            PG_ONCE_WORK=$PG_ONCE_WORK PG_ONCE_HA_PORT=$(port_of ha) ./scripts/ha-test.sh
        fi
    fi

    if step 5; then
        say "5/9 invariant soak, $name server, $soak_seconds s"
        ./scripts/suite.sh soak --seconds "$soak_seconds"
    fi

    # The client suites run against the preloaded server (direct, through PgBouncer, over
    # TLS) and, with step 3, against the SQL edition, a server with no pg_once library at
    # all (NOTIFY from each committing transaction, polling waits): what a client can tell
    # of the server without preloading is what the edition shows it, so a third run on
    # the plain server (7.5 minutes of CI's 2 cores) proved nothing more. STEPS=6 with
    # SERVERS=plain alone still runs them there.
    if step 6 && { [ "$name" = preloaded ] || [[ " $SERVERS " != *" preloaded "* ]]; }; then
        say "6/9 client libraries, $name server, direct and through PgBouncer"
        # The TLS-only case (PG_ONCE_TLS_DSN, PG_ONCE_TLS_URL): on 15's preloaded server,
        # whose role once_tls may connect only over TLS verified against a private CA
        # (cluster_tls); every suite runs its TLS tests and conformance scenarios there.
        if [ "$name" = preloaded ] && [ "$PG_MAJOR" = 15 ]; then
            say "6/9 the $name server also serves TLS (role once_tls: TLS only)"
            cluster_tls "$name" "$port" once_tls
        else
            unset PG_ONCE_TLS_DSN PG_ONCE_TLS_URL
        fi
        # Several hosts (docs/clients.md, N7): a hot standby of this server listed before
        # it, which the hosts.json scenarios reach through both forms of connection string;
        # and a primary and standby pair of their own (scripts/failover.sh), which each
        # suite's failover test kills and promotes. The preloaded server only: the SQL
        # edition's client code is the same.
        if [ "$name" = preloaded ]; then
            say "6/9 a hot standby of the $name server, and a pair to fail over"
            standby_start "$name-standby" "$(port_of "$name-standby")" "$port"
            export PG_ONCE_STANDBY_FIRST_DSN="host=127.0.0.1,127.0.0.1 port=$(port_of "$name-standby"),$port user=postgres dbname=postgres target_session_attrs=read-write"
            export PG_ONCE_STANDBY_FIRST_URL="postgresql://postgres@127.0.0.1:$(port_of "$name-standby"),127.0.0.1:$port/postgres?target_session_attrs=primary"
            PG_ONCE_WORK=$PG_ONCE_WORK ./scripts/failover.sh start "$(port_of clients-primary)" "$(port_of clients-standby)"
            export PG_ONCE_FAILOVER=$REPO_ROOT/scripts/failover.sh PG_ONCE_WORK
            export PG_ONCE_FAILOVER_DSN="host=127.0.0.1,127.0.0.1 port=$(port_of clients-primary),$(port_of clients-standby) user=postgres dbname=postgres target_session_attrs=read-write"
            export PG_ONCE_FAILOVER_URL="postgresql://postgres@127.0.0.1:$(port_of clients-primary),127.0.0.1:$(port_of clients-standby)/postgres?target_session_attrs=read-write"
        fi
        # The Python suite runs each shared test with Client or with AsyncClient, the first
        # generated from the second (clients/python/tools/generate_sync.py, checked by
        # test_generated.py): AsyncClient here, Client against the SQL edition
        # (test-sql-edition-more.sh), each flavour against one server (CI's time: each
        # takes about two minutes). STEPS=6 with SERVERS=plain runs Client there.
        local flavours=async
        [ "$name" = plain ] && flavours=sync
        PG_ONCE_FLAVOURS=$flavours PG_ONCE_PY_VENV=$py_venv ./scripts/suite.sh python
        ./scripts/suite.sh node
        ./scripts/suite.sh rust
        if [ "$name" = preloaded ]; then
            ./scripts/failover.sh stop
            cluster_stop "$name-standby"
            unset PG_ONCE_STANDBY_FIRST_DSN PG_ONCE_STANDBY_FIRST_URL PG_ONCE_FAILOVER \
                PG_ONCE_FAILOVER_DSN PG_ONCE_FAILOVER_URL
        fi
        if [ "$name" = preloaded ] && [ "$PG_MAJOR" = 15 ]; then
            # Rule I over HTTP: each middleware's example service under its real server
            # (uvicorn, gunicorn, node, hyper), two instances each, driven by one set of
            # scenarios (clients/conformance/http/README.md). 15 only: nothing in it
            # differs between server versions.
            say "6/9 idempotent HTTP requests, $name server: every middleware's example service"
            PG_ONCE_DSN="host=127.0.0.1 port=$port user=postgres dbname=postgres" \
                PG_ONCE_PY_VENV=$py_venv ./scripts/suite.sh http
        fi
    fi

    if step 7; then
        say "7/9 monitoring, $name server: postgres_exporter and the Grafana dashboard"
        # The exporter reads as a role given exactly the README's grants ("Granting
        # access"), so that those stay enough for monitoring.
        # pg_monitor too, as postgres_exporter's own documentation asks: once.stats shows
        # last_token only to it and to administrators (docs/operations.md, "Monitoring").
        cluster_psql "$name" "$port" -q -c "CREATE ROLE once_monitor LOGIN IN ROLE pg_monitor" -c "$(
            awk '/^### Granting access/ { s = 1 } s && /^```$/ { exit } s == 2 { print }
                 s && /^```sql$/ { s = 2 }' README.md | sed 's/ TO app;/ TO once_monitor;/')"
        exporter_start "$name-exporter" $(port_of "$name-exporter") "$port" once_monitor
        python3 scripts/check-monitoring.py "http://127.0.0.1:$(port_of "$name-exporter")/metrics" \
            "$PG_BIN/psql" "$PG_ONCE_DSN"
        exporter_stop "$name-exporter"
        if [ "$name" = preloaded ] && [ "$PG_MAJOR" = 15 ]; then
            say "7/9 the dashboard, $name server: pg-once-ui in Debian's Chromium (Playwright)"
            # TLS as in step 6 (which made it, unless it did not run): role once_tls only
            # over TLS verified against a private CA.
            [ -n "${PG_ONCE_TLS_DSN:-}" ] || cluster_tls "$name" "$port" once_tls
            PG_ONCE_PSQL=$PG_BIN/psql PG_ONCE_UI_PORT=$(port_of "$name-ui") ./scripts/suite.sh dashboard
        fi
    fi
    pgbouncer_stop "$name-bouncer"
    cluster_stop "$name"
}

py_venv=$PG_ONCE_WORK/py-venv
if step 6; then
    say "installing the client libraries' dependencies"
    # A fresh virtualenv each run, as a user's would be: the package installs from its
    # own pyproject.toml, with its [test] extra (pytest; unasync, for the check that the
    # sync client is generated from the async one) and the binary psycopg an application
    # would pick.
    rm -rf "$py_venv"
    python3 -m venv "$py_venv"
    "$py_venv/bin/pip" install --quiet --disable-pip-version-check "./clients/python[test]" "psycopg[binary]" \
        -r clients/conformance/http/requirements.txt
    (cd clients/node && npm ci --silent --no-audit --no-fund && npm run --silent typecheck)
fi

# test_package N DEB: install DEB (postgresql-N-pg-once) into PostgreSQL N as Debian
# installs it (/usr/lib/postgresql/N: the host's for 15, its chroot's for 17 and 18), start
# a clean preloaded cluster of that installation, run pg_regress against it, stop it and
# remove the package. pg_once files that were there before, not from a package (`cargo
# pgrx install`), are put back after.
test_package() {
    package_pg=$1
    local deb=$2 root=
    [ "$1" = 15 ] || root=$(pg_env_root "$1")
    local lib=/usr/lib/postgresql/$1/lib ext=/usr/share/postgresql/$1/extension
    local saved=$PG_ONCE_WORK/package-saved log=$PG_ONCE_WORK/package-dpkg.log
    rm -rf "$saved" && mkdir -p "$saved/lib" "$saved/extension"
    cp -a "$root$lib"/pg_once.so "$saved/lib/" 2>/dev/null || true
    cp -a "$root$ext"/pg_once* "$saved/extension/" 2>/dev/null || true
    # Gone while the package is tested: the server must find the package's files or none.
    rm -f "$root$lib/pg_once.so" "$root$ext"/pg_once*
    if ! pg_build dpkg -i "$deb" >"$log" 2>&1; then
        cat "$log" >&2
        exit 1
    fi
    local owner
    owner=$(pg_build dpkg -S "$lib/pg_once.so")
    [ "$owner" = "postgresql-$1-pg-once: $lib/pg_once.so" ] || { echo "dpkg -S: $owner" >&2; exit 1; }
    local got
    got=$(
        set -e   # not inherited by command substitution
        # 15: the system's installation, whatever PG_ONCE_PG_BIN says; 17 and 18: the
        # chroot's, which PG_BIN's wrappers already run.
        [ "$1" = 15 ] && PG_BIN=/usr/lib/postgresql/15/bin PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
        cluster_start package $(port_of package) "shared_preload_libraries = 'pg_once'" \
            "max_prepared_transactions = 10"
        pgxs_suite regress $(port_of package) >&2
        cluster_psql package $(port_of package) -Atq -c "CREATE EXTENSION pg_once" \
            -c "SELECT extversion, (SELECT shared_memory FROM once.stats)
                  FROM pg_extension WHERE extname = 'pg_once'"
    )
    [ "$got" = "$version|t" ] || { echo "the installed package says $got, not $version|t" >&2; exit 1; }
    package_cleanup
}

servers=false
step 3 || step 4 || step 5 || step 6 || step 7 && servers=true
if $servers && [[ " $SERVERS " == *" plain "* ]]; then
    soak_seconds=${SOAK_PLAIN_SECONDS:-20}
    run_server_tests plain "$(port_of plain)"
fi
if $servers && [[ " $SERVERS " == *" preloaded "* ]]; then
    soak_seconds=${SOAK_PRELOADED_SECONDS:-40}
    # pg_once_missing does not exist: pg_test/multi/tests/worker.rs checks that it is
    # logged once, and that it gets a worker once created.
    run_server_tests preloaded "$(port_of preloaded)" "shared_preload_libraries = 'pg_once'" \
        "once.databases = 'postgres, pg_once_missing'"
fi

# The SQL edition (docs/sql-edition.md) on its own server, which never loads the
# library: one server for all of it, and on 15 only, since it runs no C code that could
# differ between majors.
if step 3 && [ "$PG_MAJOR" = 15 ]; then
    say "3/9 SQL edition"
    PG_ONCE_TEST_PORT=$(port_of edition) ./scripts/test-sql-edition.sh
    # With step 6, the three client libraries' suites against it too, in the virtualenv
    # and node_modules made above.
    clients_venv=
    step 6 && clients_venv=$py_venv
    # PG_ONCE_TEST_CRON: reap_stale scheduled with Debian's pg_cron, as the docs say.
    PG_ONCE_TEST_PORT=$(port_of edition-more) PG_ONCE_PY_VENV=$clients_venv PG_ONCE_TEST_CRON=1 \
        ./scripts/test-sql-edition-more.sh
fi

if step 8; then
    say "8/9 packaging: the Debian package into a clean cluster, pg_regress against it"
    package_started=$SECONDS
    version=$(cargo_version)
    # The debug build: the one steps 3 to 7 built. A release package built from nothing
    # took 526 s on 2 busy cores (fat LTO), the debug one 335 s; the package's layout,
    # dependencies and SQL are the same either way.
    rm -rf "$PG_ONCE_WORK/dist"
    ./scripts/package.sh --pg "$PG_MAJOR" --debug --out "$PG_ONCE_WORK/dist"
    deb=$PG_ONCE_WORK/dist/postgresql-$PG_MAJOR-pg-once_${version}-1_$(dpkg --print-architecture).deb
    if [ "$PG_MAJOR" = 16 ]; then
        # No Debian postgresql-16 to install it into here (16 is PyPI's build): its files.
        # (grep reads it all: with -q it would stop early and pipefail see dpkg-deb's SIGPIPE.)
        dpkg-deb --contents "$deb" | grep "usr/lib/postgresql/16/lib/pg_once.so" >/dev/null ||
            { echo "$deb has no pg_once.so for 16" >&2; exit 1; }
    else
        test_package "$PG_MAJOR" "$deb"
    fi
    if [ "$PG_MAJOR" = 15 ]; then
        ./scripts/package.sh --pgxn --out "$PG_ONCE_WORK/dist"
        python3 scripts/check-meta.py "$PG_ONCE_WORK/dist/pg_once-$version.zip" "$version"
    fi
    say "8/9 packaging took $((SECONDS - package_started)) s"
fi

if step 9; then
    source "$REPO_ROOT/scripts/upgrade-test.sh"
    # Its own server (and PgBouncer, 10 ports higher) on a copy of the installation.
    upgrade_test "$(port_of upgrade)"
fi

say "PostgreSQL $PG_MAJOR: steps $STEPS passed in $((SECONDS - started)) s (servers: $SERVERS)"
