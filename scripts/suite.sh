#!/usr/bin/env bash
# Run one test suite against a server you already have, as pgvector's `make installcheck`
# does: nothing is installed into PostgreSQL and no server is started. scripts/test.sh
# runs the same suites through this script, on the throwaway servers it starts.
#
#   ./scripts/suite.sh NAME [ARGUMENTS...]
#
#   regress      pg_regress, pg_test/regress (makes and drops database pg_once_regress)
#   isolation    pg_isolation_regress, pg_test/isolation (database pg_once_isolation; on a
#                server without pg_once preloaded: its worker would reap the leases the
#                specs expire by hand)
#   multi        the multi-connection tests of pg_test/multi that need no more than a
#                server (ARGUMENTS go to cargo test; the crash, standby and failover tests
#                kill, stop or promote servers: scripts/test.sh runs those)
#   python       the Python client's suite (pytest, four tests at a time, then the serial
#                ones; ARGUMENTS go to pytest)
#   node         the Node client's suite (node --test, four files at a time: PG_ONCE_NODE_FILES)
#   rust         the Rust client's suite (cargo test)
#   soak         the invariant soak (tools' soak: random operations, killed connections,
#                every invariant checked); ARGUMENTS go to it, e.g. --seconds 20
#   http         the HTTP scenarios: every idempotency middleware's example service under
#                its real server, two instances each (clients/conformance/http; python's
#                virtualenv, with the services' requirements)
#   dashboard    pg-once-ui's unit tests, then the dashboard in Chromium (Playwright for
#                Python, driving /usr/bin/chromium or PG_ONCE_CHROMIUM; port PG_ONCE_UI_PORT
#                and the three after it; PG_ONCE_TLS_DSN adds its TLS test)
#
# The server: PG_ONCE_DSN, a libpq key=value string of a superuser's connection (default:
# "host=127.0.0.1 port=5432 user=postgres dbname=postgres"), with pg_once installed
# there (`cargo pgrx install`, or the package). Optional: PG_ONCE_BOUNCER_DSN, a PgBouncer
# in transaction mode in front of it, for the tests of pooled clients (skipped without);
# the clients' other variables (TLS, standby, failover: CONTRIBUTING.md, "Tests") too.
# regress and isolation find pg_regress through PG_CONFIG (default: pg_config on PATH);
# PG_REGRESS, PG_ISOLATION_REGRESS and PG_BINDIR name them and psql's directory otherwise.
# python uses the virtualenv PG_ONCE_PY_VENV (default $PG_ONCE_WORK/py-venv, made with the
# client and its test extra if missing); node runs `npm ci` first if node_modules is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PG_ONCE_DSN=${PG_ONCE_DSN:-host=127.0.0.1 port=5432 user=postgres dbname=postgres}
suite=${1:?"usage: $0 regress|isolation|multi|python|node|rust|soak|http|dashboard [ARGUMENTS...]"}
shift

# conninfo_field DSN KEY [DEFAULT]: one field of a key=value connection string (values
# without spaces or quotes, as the test scripts write them).
conninfo_field() {
    local pair
    for pair in $1; do
        [ "${pair%%=*}" = "$2" ] && { echo "${pair#*=}"; return; }
    done
    echo "${3:-}"
}

# as_url DSN: the same server as a postgres:// URL, which the Node client's tests take.
as_url() {
    local host port user dbname
    host=$(conninfo_field "$1" host 127.0.0.1)
    port=$(conninfo_field "$1" port 5432)
    user=$(conninfo_field "$1" user postgres)
    dbname=$(conninfo_field "$1" dbname postgres)
    echo "postgres://$user@$host:$port/$dbname"
}

# pgxs SUITE PROGRAM DATABASE: PostgreSQL's pg_regress or pg_isolation_regress on
# pg_test/SUITE, every test in it, printing the diffs when one fails.
pgxs() {
    local suite=$1 program=$2 db=$3 config=${PG_CONFIG:-pg_config} tests
    local out=${PG_ONCE_WORK:-/var/tmp/pg_once}/$suite-$(conninfo_field "$PG_ONCE_DSN" port 5432)
    local tool=${4:-$("$config" --pkglibdir)/pgxs/src/test/$suite/$program}
    if [ "$suite" = regress ]; then
        tests=$(cd pg_test/regress/sql && ls *.sql | sed 's/\.sql$//')
    else
        tests=$(cd pg_test/isolation/specs && ls *.spec | sed 's/\.spec$//')
    fi
    rm -rf "$out"
    # shellcheck disable=SC2086
    if ! "$tool" --bindir="${PG_BINDIR:-$("$config" --bindir)}" --inputdir="pg_test/$suite" \
            --outputdir="$out" --host="$(conninfo_field "$PG_ONCE_DSN" host 127.0.0.1)" \
            --port="$(conninfo_field "$PG_ONCE_DSN" port 5432)" \
            --user="$(conninfo_field "$PG_ONCE_DSN" user postgres)" --dbname="$db" $tests; then
        cat "$out/regression.diffs" >&2
        exit 1
    fi
}

case $suite in
    regress)
        pgxs regress pg_regress pg_once_regress "${PG_REGRESS:-}" ;;
    isolation)
        pgxs isolation pg_isolation_regress pg_once_isolation "${PG_ISOLATION_REGRESS:-}" ;;
    multi)
        multi() {
            cargo test -p pg_once_multi --quiet --test protocol --test wakeups --test queue \
                --test pooling --test namespaces --test freshness --test announcements \
                --test attacks --test sweep --test counts --test argument_rules --test held_rows "$@"
        }
        # pooling.rs's owner-session test sends RECONNECT to PgBouncer's console, which
        # ends the server logins under way, and PgBouncer then refuses every client for
        # server_login_retry (15 s): the others failed with that in a loaded run. It runs
        # alone, after them, unless ARGUMENTS choose the tests.
        reconnects=an_owner_session_keeps_a_pooled_claim_until_its_process_goes
        if [ $# -eq 0 ]; then
            multi -- --skip "$reconnects"
            cargo test -p pg_once_multi --quiet --test pooling "$reconnects"
        else
            multi "$@"
        fi ;;
    python)
        venv=${PG_ONCE_PY_VENV:-${PG_ONCE_WORK:-/var/tmp/pg_once}/py-venv}
        [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
        # A virtualenv made before the test extra had pytest-xdist gets it too.
        "$venv/bin/python" -c "import pg_once, xdist" 2>/dev/null ||
            "$venv/bin/pip" install --quiet --disable-pip-version-check "./clients/python[test]" "psycopg[binary]"
        # The client as this tree has it: a virtualenv kept from an earlier run would
        # otherwise test the client installed then.
        installed=$("$venv/bin/python" -c "import os, pg_once; print(os.path.dirname(pg_once.__file__))")
        diff -rq -x __pycache__ "$installed" clients/python/src/pg_once >/dev/null ||
            "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall ./clients/python
        # Four at a time (PG_ONCE_PY_WORKERS): the tests mostly wait (on leases, ttls,
        # NOTIFY), so this takes a third of the time. The ones marked serial close or fail
        # over servers under the others' feet, and run alone after them. Exit 5: the
        # arguments selected no test of that half.
        pytest() { "$venv/bin/python" -m pytest -q -p no:cacheprovider clients/python/tests "$@" || [ $? = 5 ]; }
        pytest -n "${PG_ONCE_PY_WORKERS:-4}" -m "not serial" "$@"
        pytest -m serial "$@" ;;
    node)
        [ -d clients/node/node_modules ] || (cd clients/node && npm ci --silent --no-audit --no-fund)
        log=${PG_ONCE_WORK:-/var/tmp/pg_once}/node-tests-$(conninfo_field "$PG_ONCE_DSN" port 5432).log
        PG_ONCE_DSN=$(as_url "$PG_ONCE_DSN")
        [ -z "${PG_ONCE_BOUNCER_DSN:-}" ] || PG_ONCE_BOUNCER_DSN=$(as_url "$PG_ONCE_BOUNCER_DSN")
        mkdir -p "$(dirname "$log")"
        if ! (cd clients/node && npm test --silent >"$log" 2>&1); then
            cat "$log" >&2
            exit 1
        fi
        grep -E '^# (pass|fail)' "$log" ;;
    rust)
        cargo test -p pg_once_client --features http --quiet "$@" ;;
    soak)
        cargo run --quiet -p pg_once_tools --bin soak -- "$@" | tail -25 ;;
    http)
        venv=${PG_ONCE_PY_VENV:-${PG_ONCE_WORK:-/var/tmp/pg_once}/py-venv}
        [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
        "$venv/bin/python" -c "import pg_once, uvicorn, gunicorn" 2>/dev/null ||
            "$venv/bin/pip" install --quiet --disable-pip-version-check "./clients/python[test]" \
                "psycopg[binary]" -r clients/conformance/http/requirements.txt
        "$venv/bin/python" -m pytest -q -p no:cacheprovider clients/conformance/http "$@" ;;
    dashboard)
        cargo test --quiet -p pg_once_ui          # its unit tests
        cargo build --quiet -p pg_once_ui         # the binary the browser tests run
        venv=${PG_ONCE_WORK:-/var/tmp/pg_once}/ui-venv
        [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
        # Playwright drives /usr/bin/chromium: no `playwright install` of its own browsers.
        "$venv/bin/pip" install --quiet --disable-pip-version-check 'playwright>=1.40,<2' 'pytest>=7,<9'
        target=$(cargo metadata --format-version 1 --no-deps |
            python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
        # PG_ONCE_UI_SCREENSHOTS=docs/dashboard rewrites the screenshots.
        PG_ONCE_PSQL=${PG_ONCE_PSQL:-$(command -v psql || echo "${PG_BINDIR:-$("${PG_CONFIG:-pg_config}" --bindir)}/psql")} \
            PG_ONCE_UI_BIN=$target/debug/pg-once-ui \
            "$venv/bin/python" -m pytest -q -p no:cacheprovider ui/tests "$@" ;;
    *)
        echo "$0: no suite $suite (regress, isolation, multi, python, node, rust, soak, http, dashboard)" >&2
        exit 2 ;;
esac
