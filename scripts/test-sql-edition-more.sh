#!/usr/bin/env bash
# ./scripts/test-sql-edition-more.sh: the SQL edition's views, once.cached and pg_tle form
# (docs/sql-edition.md), on a plain PostgreSQL 15 without pg_once, installed by a
# database owner who is not a superuser (CREATEROLE, pg_read_all_stats,
# pg_signal_backend), as scripts/test-sql-edition.sh does for the rest:
# 1. the script (scripts/sql-edition.sh) installs, twice, keeping grants;
# 2. pg_test/regress docs.sql and queue.sql, whole, against the extension's output;
# 3. once.stats: its counts equal a count of once.entries after each kind of write
#    (autocommit, rollback, savepoint, REPEATABLE READ, TRUNCATE, purge), a transaction
#    sees its own changes, writers do not wait for each other's counts, the counts' rows
#    stay few, and a reader sees only what it may (last_token, once.cached keys);
# 4. once.cached and once.cached_key: the key's text (against a digest computed here),
#    42601 for what is not one SELECT, privileges checked on hits, failures shared by
#    the procedure;
# 5. pg_tle: pg_once_tle.sql run against a stand-in of pg_tle (pg_test/edition/
#    pgtle_standin.sql) in a private copy of the PostgreSQL installation, CREATE
#    EXTENSION pg_once by the non-superuser, the same smoke checks, a prepared
#    transaction, and ALTER EXTENSION UPDATE to a newer version keeping the rows;
# 6. with PG_ONCE_TEST_CRON=1 (a minute more) and pg_cron installed, reap_stale
#    scheduled with pg_cron by the owner reaps a gone owner's claim;
# 7. with PG_ONCE_PY_VENV (test.sh sets it when step 6 runs too) and clients/node's
#    node_modules, the Python (sync), Node and Rust clients' suites, as the owner.
# PG_ONCE_PG_BIN and PG_ONCE_WORK as for test.sh; ports PG_ONCE_TEST_PORT (default 28010)
# and the one after it.
set -euo pipefail
PG_MAJOR=15
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_TEST_PORT:-28010}
TLE_PORT=$((PORT + 1))
NAME=sql-edition-more
TLE_NAME=sql-edition-tle
OUT=$PG_ONCE_WORK/$NAME-build
"$REPO_ROOT/scripts/sql-edition.sh" "$OUT"
chmod -R a+rX "$OUT" "$REPO_ROOT/pg_test/edition"
SYSTEM_PG_BIN=$PG_BIN
trap 'PG_BIN=$SYSTEM_PG_BIN; cluster_stop $NAME; PG_BIN=$PG_ONCE_WORK/$TLE_NAME-pg/usr/lib/postgresql/15/bin; cluster_stop $TLE_NAME' EXIT
# What managed services default to (RDS, Cloud SQL, Azure: 0): the counts' per-backend
# slots. The pg_tle server below allows prepared transactions, for the other case.
cluster_start "$NAME" "$PORT" "max_prepared_transactions = 0"

expect() {  # expect WHAT WANTED GOT
    if [ "$2" != "$3" ]; then echo "$1: expected [$2], got [$3]" >&2; exit 1; fi
}
# setup_db PORT DIR: the managed service's roles and database.
setup_db() {
    "$PG_BIN/psql" -h "$2" -p "$1" -U postgres -X -q -v ON_ERROR_STOP=1 \
        -c "CREATE ROLE admin LOGIN CREATEROLE IN ROLE pg_read_all_stats, pg_signal_backend" \
        -c "CREATE DATABASE app OWNER admin"
}
setup_db "$PORT" "$PG_ONCE_WORK/$NAME"
as_admin() { "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d app -X -v ON_ERROR_STOP=1 "$@"; }
as() { local role=$1; shift; "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U "$role" -d app -X -At -v ON_ERROR_STOP=1 "$@"; }
# The namespaces (sql/edition/namespaces.sql) are another part of issue 28: without
# them, stand-ins of the four functions the views and counts call.
namespaces=true
if [ ! -f "$REPO_ROOT/sql/edition/namespaces.sql" ]; then
    namespaces=false
    as_admin -q -f "$REPO_ROOT/pg_test/edition/namespace_stubs.sql"
fi

say "SQL edition (views, cached): install as a non-superuser owner, twice"
as_admin -q -f "$OUT/pg_once_sql.sql"
c_functions=$(as_admin -Atc "SELECT count(*) FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
                               WHERE p.pronamespace::regnamespace::text IN ('once', 'once_internal')
                                 AND l.lanname IN ('c', 'internal')")
expect "C or internal functions declared" 0 "$c_functions"
as_admin -q -c "CREATE ROLE app_user LOGIN; CREATE ROLE other_user LOGIN; CREATE ROLE monitor LOGIN IN ROLE pg_monitor;
                GRANT USAGE ON SCHEMA once TO app_user, other_user, monitor;
                GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO app_user, other_user;
                GRANT SELECT ON once.stats, once.queue_stats, once.dead_letters, once.keys, once.namespaces TO app_user, monitor;"
privileges="SELECT has_table_privilege('app_user', 'once.stats', 'SELECT'),
                   has_function_privilege('app_user', 'once.cached(text,text,jsonb,interval,interval,float8,float8,interval,interval,interval)', 'EXECUTE'),
                   has_function_privilege('public', 'once.cached(text,text,interval,interval,float8,float8,interval,interval)', 'EXECUTE'),
                   has_function_privilege('public', 'once.cached_key(text,text)', 'EXECUTE'),
                   has_function_privilege('public', 'once_internal.view_may_use_key(text)', 'EXECUTE'),
                   has_function_privilege('public', 'once_internal.recount_keys()', 'EXECUTE'),
                   has_table_privilege('public', 'once.stats', 'SELECT'),
                   has_schema_privilege('public', 'once_internal', 'USAGE')"
# USAGE on once_internal for PUBLIC: the wrappers of once call their implementations there
# as the calling role (docs/sql-edition.md, "Who is judged"); recount_keys stays closed.
expect "privileges after the install" "t|t|f|f|t|f|f|t" "$(as_admin -Atc "$privileges")"
as_admin -q -f "$OUT/pg_once_sql.sql"
expect "privileges after a rerun" "t|t|f|f|t|f|f|t" "$(as_admin -Atc "$privileges")"

say "SQL edition (views, cached): pg_test/regress docs.sql and queue.sql, views and all"
work=$PG_ONCE_WORK/$NAME-regress
mkdir -p "$work"
# The whole transcripts (but CREATE and DROP EXTENSION: the install is the script): with
# the views and once.cached, the edition prints what the extension prints. Without the
# edition's queue mode (sql/edition/queue.sql, another part of issue 28), docs.sql but
# for "-- queue mode" up to "-- stats" (it leaves no key behind), and no queue.sql.
queues=true
[ -f "$REPO_ROOT/sql/edition/queue.sql" ] || queues=false
transcript() {
    awk -v queues="$queues" '/^-- queue mode$/ && queues == "false" { on = 0 } /^-- stats$/ { on = 1 }
         NR == 1 { on = 1 } on && !/^(CREATE|DROP) EXTENSION pg_once;$/' "$1"
}
regress() {  # regress NAME DATABASE
    transcript "$REPO_ROOT/pg_test/regress/sql/$1.sql" >"$work/$1.sql"
    transcript "$REPO_ROOT/pg_test/regress/expected/$1.out" >"$work/$1.out"
    "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d "$2" -X -a -q -v ON_ERROR_STOP=0 \
        -v SHOW_CONTEXT=never <"$work/$1.sql" >"$work/$1.result" 2>&1 || true
    if ! diff -u "$work/$1.out" "$work/$1.result" >"$work/$1.diff"; then
        cat "$work/$1.diff" >&2
        echo "$1.sql differs on the SQL edition: $work/$1.diff" >&2
        exit 1
    fi
}
regress docs app
if $queues; then
    cluster_psql "$NAME" "$PORT" -q -c "CREATE DATABASE queue OWNER admin"
    "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d queue -X -q -v ON_ERROR_STOP=1 -f "$OUT/pg_once_sql.sql"
    regress queue queue
fi
as_admin -q -c "TRUNCATE once.entries, once.attempts"

say "SQL edition: once.stats counts what once.entries holds"
truth="SELECT count(*) FILTER (WHERE state = 'queued'), count(*) FILTER (WHERE state = 'running'),
              count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state = 'failed'),
              coalesce(sum(errors), 0), coalesce(sum(attempts), 0) FROM once.entries"
stats="SELECT queued, running, done, failed, errors, attempts FROM once.stats"
check_counts() {  # check_counts WHEN
    expect "once.stats $1 (queued|running|done|failed|errors|attempts)" \
        "$(as_admin -Atc "$truth")" "$(as_admin -Atc "$stats")"
}
expect "once.stats after TRUNCATE" "0|0|0|0|0|0" "$(as_admin -Atc "$stats")"
for i in 1 2 3 4 5; do
    as app_user -c "SELECT once.complete_key('done/$i', token, '{}') FROM once.claim_key('done/$i')" >/dev/null
done
as app_user -c "SELECT once.claim_key('running/1')" >/dev/null
for i in 1 2; do
    as app_user -c "SELECT once.fail_key('failed/$i', token, 'boom', retry_after => '1 hour') FROM once.claim_key('failed/$i')" >/dev/null
done
check_counts "after completions, a claim and failures"
expect "once.stats' first counts" "0|1|5|2|2|8" "$(as_admin -Atc "$stats")"
as app_user -c "SELECT once.invalidate_key('done/1')" >/dev/null
as app_user -c "SELECT once.release_key('failed/1', token) FROM once.claim_key('failed/1', wait => '0')" >/dev/null || true
check_counts "after an invalidation and a failure claimed again"
# A transaction sees its own changes, and a rollback takes them back.
own=$(as app_user -q -c "BEGIN" -c "SELECT once.complete_key('done/rolled', token, '{}') FROM once.claim_key('done/rolled')" \
         -c "SAVEPOINT s" -c "SELECT once.invalidate_key('done/2')" -c "ROLLBACK TO s" \
         -c "SELECT done FROM once.stats" -c "ROLLBACK" | tail -1)
expect "done as seen inside the transaction" 5 "$own"
check_counts "after a rolled back transaction and savepoint"
# REPEATABLE READ writes into a slot of its own.
as app_user -c "BEGIN ISOLATION LEVEL REPEATABLE READ" \
    -c "SELECT once.complete_key('done/rr', token, '{}') FROM once.claim_key('done/rr')" -c "COMMIT" >/dev/null
check_counts "after a REPEATABLE READ transaction"
# Expired results purged by reap_stale.
as app_user -c "SELECT once.complete_key('done/expiring', token, '{}', ttl => '1 millisecond') FROM once.claim_key('done/expiring')" >/dev/null
sleep 0.05
as_admin -q -c "SELECT once.reap_stale()" >/dev/null
check_counts "after reap_stale purged an expired result"
# Writers never wait for each other's counts: one transaction holds its counts' row while
# another session completes keys under a statement timeout, even one that names the first
# one's slot in the setting that keeps a transaction's slot (anyone may SET it).
coproc HOLD { as app_user -c "SELECT pg_backend_pid()" -c "BEGIN" \
                 -c "SELECT once.complete_key('done/held', token, '{}') FROM once.claim_key('done/held')" \
                 -c "SELECT pg_sleep(3)" -c "COMMIT"; }
read -r hold_pid <&"${HOLD[0]}"
sleep 0.5
as app_user -c "SET statement_timeout = '2s'" -c "SET once_internal.counts_slot = '$hold_pid'" \
    -c "SELECT once.complete_key('done/beside', token, '{}') FROM once.claim_key('done/beside')" >/dev/null
wait "$HOLD_PID"
check_counts "after two writers at once"
# Each new session folds the counts of sessions that ended into its own: the rows
# once.stats sums stay about one per session running.
for i in $(seq 1 25); do
    as app_user -c "SELECT once.complete_key('done/s$i', token, '{}') FROM once.claim_key('done/s$i')" >/dev/null
done
rows=$(as_admin -Atc "SELECT count(*) FROM once_internal.key_counts")
if [ "$rows" -gt 3 ]; then
    echo "once_internal.key_counts has $rows rows after 25 sessions one after another" >&2
    exit 1
fi
check_counts "after 25 sessions"
as_admin -q -c "SELECT once_internal.recount_keys()" >/dev/null
check_counts "after recount_keys"
# A TRUNCATE forgets the counts.
as_admin -q -c "TRUNCATE once.entries"
expect "once.stats after TRUNCATE" "0|0|0|0|0|0" "$(as_admin -Atc "$stats")"
as app_user -c "SELECT once.complete_key('done/after', token, '{}') FROM once.claim_key('done/after')" >/dev/null
check_counts "after a TRUNCATE and a completion"

say "SQL edition: once.stats reads no more than the extension's (not every key)"
# The buffers a read of the view touches, read once first in the same session (a new
# session's first read loads the catalogs it needs).
buffers_of() {
    as_admin -At -c "SELECT count(*) FROM $1" -c "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM $1" |
        tail -n +2 | python3 -c 'import json, sys; p = json.load(sys.stdin)[0]["Plan"]; print(p.get("Shared Hit Blocks", 0) + p.get("Shared Read Blocks", 0))'
}
before_stats=$(buffers_of once.stats)
before_queues=$(buffers_of once.queue_stats)
as_admin -q -c "INSERT INTO once.entries (key_hash, key, state, result, token, attempts, updated_at)
                SELECT once.key_hash('bulk/' || i), 'bulk/' || i, 'done', '{}', i, 1, now()
                  FROM generate_series(1, 20000) i" -c "ANALYZE once.entries"
check_counts "after 20,000 keys inserted in one statement"
pages=$(as_admin -Atc "SELECT relpages FROM pg_class WHERE oid = 'once.entries'::regclass")
for view in "once.stats $before_stats" "once.queue_stats $before_queues"; do
    set -- $view
    after=$(buffers_of "$1")
    if [ "$after" -gt "$(($2 + 10))" ]; then
        echo "$1 read $2 buffers, then $after with 20,000 more keys done ($pages pages)" >&2
        exit 1
    fi
done
as_admin -q -c "DELETE FROM once.entries WHERE key LIKE 'bulk/%'"
check_counts "after 20,000 keys deleted in one statement"

say "SQL edition: what the views show to whom"
expect "last_token to app_user, admin, a pg_monitor member" "t|f|f" \
    "$(as app_user -c "SELECT last_token IS NULL FROM once.stats")|$(as_admin -Atc "SELECT last_token IS NULL FROM once.stats")|$(as monitor -c "SELECT last_token IS NULL FROM once.stats")"
# once.cached's rows are counted under their role: another role does not see them.
as_admin -q -c "SELECT once.cached('admin report', 'SELECT 1 AS one')" >/dev/null
expect "done as admin and as app_user (admin's cached rows counted for admin only)" \
    "$(( $(as app_user -c "SELECT done FROM once.stats") + 1 ))" "$(as_admin -Atc "SELECT done FROM once.stats")"
# (Every role has USAGE on once_internal, for once.*'s implementations; the views'
# helpers, granted to PUBLIC, answer only for the caller, and nothing else is granted.)
for what in "SELECT * FROM once_internal.key_counts" "SELECT once_internal.recount_keys()" \
            "SELECT * FROM once.entries"; do
    if out=$(as app_user -c "$what" 2>&1); then
        echo "app_user ran $what: $out" >&2
        exit 1
    fi
    case "$out" in *"permission denied"*) ;; *) echo "app_user's $what: $out" >&2; exit 1 ;; esac
done
if out=$(as other_user -c "SELECT * FROM once.stats" 2>&1); then
    echo "other_user read once.stats without being granted it: $out" >&2
    exit 1
fi
expect "once.namespaces without namespaces" 0 "$(as app_user -c "SELECT count(*) FROM once.namespaces")"
if $namespaces; then
    as_admin -q -c "CREATE ROLE team NOLOGIN; CREATE ROLE member_user LOGIN IN ROLE team;
                    GRANT USAGE ON SCHEMA once TO member_user; GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO member_user;
                    GRANT SELECT ON once.stats, once.namespaces TO member_user;
                    SELECT once.create_namespace('team:', 'team')" >/dev/null
    as member_user -c "SELECT once.complete_key('team:1', token, '{}') FROM once.claim_key('team:1')" >/dev/null
    expect "team:'s member column for app_user, member_user" "f|t" \
        "$(as app_user -c "SELECT member FROM once.namespaces")|$(as member_user -c "SELECT member FROM once.namespaces")"
    expect "done of a namespace's key counted for its members only" \
        "$(( $(as app_user -c "SELECT done FROM once.stats") + 1 ))" "$(as member_user -c "SELECT done FROM once.stats")"
    # The installing role is not a member of team, and sees its counts no more than the
    # extension's owner would: a superuser sees them all.
    expect "once.stats to a superuser after a namespace was created (recounted) and used" \
        "$(as_admin -Atc "$truth")" "$(cluster_psql "$NAME" "$PORT" -d app -Atc "$stats")"
fi

say "SQL edition: once.cached and once.cached_key"
uid=$(as_admin -Atc "SELECT oid FROM pg_roles WHERE rolname = 'app_user'")
digest=$(printf '11,2200\nSELECT 1 AS a' | sha256sum | cut -d' ' -f1)
expect "once.cached_key with search_path public" "k#cached:$uid:$digest" \
    "$(as app_user -c "SET search_path = public" -c "SELECT once.cached_key('k', 'SELECT 1 AS a')" | tail -1)"
expect "once.cached_key of a trimmed query" "k#cached:$uid:$digest" \
    "$(as app_user -c "SET search_path = public" -c "SELECT once.cached_key('k', E' \n SELECT 1 AS a\t\n')" | tail -1)"
temp=$(as app_user -c "SET search_path = public" -c "CREATE TEMP TABLE t (a int)" \
          -c "SELECT pg_my_temp_schema()::oid || ' ' || once.cached_key('k', 'SELECT 1 AS a')" | tail -1)
digest=$(printf '%s,11,2200\nSELECT 1 AS a' "${temp%% *}" | sha256sum | cut -d' ' -f1)
expect "once.cached_key with a temporary schema" "k#cached:$uid:$digest" "${temp#* }"
for query in "SELECT 1; SELECT 2" "SELECT 1 INTO t" "DELETE FROM once.entries" "SELEC 1" \
             "SELECT 1) AS x, (SELECT 2"; do
    out=$(as app_user -v VERBOSITY=verbose -c "SELECT once.cached_key('k', \$q\$$query\$q\$)" 2>&1 || true)
    case "$out" in *"42601: query must be exactly one SELECT statement"*) ;;
        *) echo "once.cached_key('k', '$query'): $out" >&2; exit 1 ;; esac
done
expect "NULL query" "22004" "$(as app_user -v VERBOSITY=verbose -c "SELECT once.cached('k', NULL)" 2>&1 | grep -o 22004 | head -1)"
# Parsed but not runnable: the key is given, and once.cached raises the query's error.
as app_user -c "SELECT once.cached_key('k', 'SELECT * FROM no_such_table')" >/dev/null
expect "a missing table" "42P01" \
    "$(as app_user -v VERBOSITY=verbose -c "SELECT once.cached('k', 'SELECT * FROM no_such_table')" 2>&1 | grep -o 42P01 | head -1)"
# Privileges revoked after the rows were cached are honoured on the next hit.
as_admin -q -c "CREATE TABLE public.secret AS SELECT 42 AS answer; GRANT SELECT ON public.secret TO app_user"
expect "cached rows" '[{"answer": 42}]' "$(as app_user -c "SELECT once.cached('s', 'SELECT answer FROM public.secret')")"
expect "a hit" '[{"answer": 42}]' "$(as app_user -c "SELECT once.cached('s', 'SELECT answer FROM public.secret')")"
as_admin -q -c "REVOKE SELECT ON public.secret FROM app_user"
expect "a hit after REVOKE" "42501" \
    "$(as app_user -v VERBOSITY=verbose -c "SELECT once.cached('s', 'SELECT answer FROM public.secret')" 2>&1 | grep -o 42501 | head -1)"
# The procedure commits its claim, records a failing query and shares the failure (a
# query that fails when it runs: 1/0 would fail in the planner, which a hit runs too).
expect "CALL of a failing query" "22012" \
    "$(as app_user -v VERBOSITY=verbose -c "CALL once.cached('f', 'SELECT 1 / (random() * 0)::int', NULL::jsonb, retry_after => '1 hour')" 2>&1 | grep -o 22012 | head -1)"
out=$(as app_user -v VERBOSITY=verbose -c "CALL once.cached('f', 'SELECT 1 / (random() * 0)::int', NULL::jsonb, retry_after => '1 hour')" 2>&1 || true)
case "$out" in *'38000: the last computation of key "f" failed: division by zero'*) ;;
    *) echo "the second CALL: $out" >&2; exit 1 ;; esac
expect "CALL in autocommit" '{"result": [{"x": 7}]}' \
    "$(as app_user -c "CALL once.cached('p', 'SELECT 7 AS x', NULL::jsonb)" | sed 's/^/{"result": /; s/$/}/')"
if $namespaces; then
    # Another role that names the key gets 42501 (the key is app_user's alone).
    key=$(as app_user -c "SELECT once.cached_key('p', 'SELECT 7 AS x')")
    expect "another role claiming a once.cached key" "42501" \
        "$(as other_user -v VERBOSITY=verbose -c "SELECT once.claim_key(\$k\$$key\$k\$)" 2>&1 | grep -o 42501 | head -1)"
fi

say "SQL edition for pg_tle: a stand-in of pg_tle in a private copy of PostgreSQL"
# The installation is copied (a copy finds its share/ and lib/ relative to bin/), without
# pg_once's own files, so that the stand-in can write extension files into it.
root=$(cd "$SYSTEM_PG_BIN/../../../../.." && pwd)
copy=$PG_ONCE_WORK/$TLE_NAME-pg
rm -rf "$copy"
mkdir -p "$copy/usr/lib/postgresql" "$copy/usr/share/postgresql"
cp -a "$root/usr/lib/postgresql/15" "$copy/usr/lib/postgresql/"
cp -a "$root/usr/share/postgresql/15" "$copy/usr/share/postgresql/"
rm -f "$copy"/usr/share/postgresql/15/extension/pg_once* "$copy"/usr/lib/postgresql/15/lib/pg_once*
chown -R postgres "$copy/usr/share/postgresql/15/extension"
PG_BIN=$copy/usr/lib/postgresql/15/bin
cluster_start "$TLE_NAME" "$TLE_PORT"
setup_db "$TLE_PORT" "$PG_ONCE_WORK/$TLE_NAME"
tle_su() { "$PG_BIN/psql" -h "$PG_ONCE_WORK/$TLE_NAME" -p "$TLE_PORT" -U postgres -d app -X -At -v ON_ERROR_STOP=1 "$@"; }
tle() { local role=$1; shift; "$PG_BIN/psql" -h "$PG_ONCE_WORK/$TLE_NAME" -p "$TLE_PORT" -U "$role" -d app -X -At -v ON_ERROR_STOP=1 "$@"; }
tle_su -q -f "$REPO_ROOT/pg_test/edition/pgtle_standin.sql" -c "GRANT pgtle_admin TO admin"
# The stand-in refuses what pg_tle refuses.
for bad in "'pg-once-', '1.0', 'd', 'SELECT 1'" "'x', '1--2', 'd', 'SELECT 1'" \
           "'x', '1.0', 'd', 'SELECT \$_pgtle_i_\$ \$_pgtle_i_\$'"; do
    if tle admin -c "SELECT pgtle.install_extension($bad)" >/dev/null 2>&1; then
        echo "the stand-in of pg_tle took install_extension($bad)" >&2
        exit 1
    fi
done
if [ "$namespaces" = false ]; then
    # The stand-ins of the namespace functions, as members of no extension: created in
    # schema once_internal before CREATE EXTENSION (which then refuses CREATE SCHEMA IF
    # NOT EXISTS of a schema it does not own: so here once_internal's stand-ins are
    # created by the extension script's first statements instead).
    cp "$OUT/pg_once_tle.sql" "$work/pg_once_tle.sql"
    python3 - "$work/pg_once_tle.sql" "$REPO_ROOT/pg_test/edition/namespace_stubs.sql" <<'EOF'
import re, sys
path, stubs = sys.argv[1], open(sys.argv[2]).read()
stubs = "\n".join(l for l in stubs.splitlines() if not l.startswith("CREATE SCHEMA") and not l.startswith("REVOKE"))
text = open(path).read()
anchor = "-- ---- from sql/schema.sql: trigger functions and triggers ----"
assert text.count(anchor) == 1
open(path, "w").write(text.replace(anchor, stubs + "\n" + anchor))
EOF
    tle_file=$work/pg_once_tle.sql
else
    tle_file=$OUT/pg_once_tle.sql
fi
tle admin -q -f "$tle_file"
tle admin -q -f "$tle_file"   # a second run changes nothing
expect "versions installed" "0.3.0" "$(tle admin -c "SELECT string_agg(version, ',') FROM pgtle.available_extension_versions()")"
tle admin -q -c "CREATE EXTENSION pg_once"
expect "the extension and its owner" "pg_once|0.3.0|admin" \
    "$(tle admin -c "SELECT extname, extversion, extowner::regrole FROM pg_extension WHERE extname = 'pg_once'")"
expect "objects of once and once_internal that are not members of pg_once" 0 \
    "$(tle admin -c "SELECT count(*) FROM pg_class c WHERE c.relnamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
                        AND c.relkind IN ('r', 'v', 'S')
                        AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                                           AND d.deptype = 'e')")"
expect "tables pg_dump dumps with their rows" "5" "$(tle admin -c "SELECT cardinality(extconfig) FROM pg_extension WHERE extname = 'pg_once'")"
expect "C functions, PUBLIC's EXECUTE on claim_key" "0|f" \
    "$(tle admin -c "SELECT count(*) FILTER (WHERE l.lanname IN ('c', 'internal')),
                            bool_or(has_function_privilege('public', p.oid, 'EXECUTE')) FILTER (WHERE p.proname = 'claim_key' AND p.pronamespace = 'once'::regnamespace)
                       FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
                      WHERE p.pronamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)")"
tle admin -q -c "CREATE ROLE app_user LOGIN; GRANT USAGE ON SCHEMA once TO app_user;
                 GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO app_user; GRANT SELECT ON once.stats TO app_user"
expect "a claim and completion, then a hit, through the extension" "t|hit" \
    "$(tle app_user -c "SELECT once.complete_key('tle', token, '1') FROM once.claim_key('tle')")|$(tle app_user -c "SELECT outcome FROM once.claim_key('tle')")"
expect "once.cached through the extension" '[{"a": 1}]' "$(tle app_user -c "SELECT once.cached('c', 'SELECT 1 AS a')")"
# Prepared transactions are allowed here: counts go to each transaction's own slot, and a
# session's next write does not wait for the transaction it prepared.
# (A transaction that resolves a running key cannot be prepared in the edition: its NOTIFY
# is the transaction's own. Forgetting a result sends none.)
tle app_user -c "SELECT once.complete_key('prepared', token, '1') FROM once.claim_key('prepared')" >/dev/null
tle app_user -c "BEGIN" -c "SELECT once.invalidate_key('prepared')" \
    -c "PREPARE TRANSACTION 'p1'" -c "SET statement_timeout = '3s'" \
    -c "SELECT once.complete_key('after', token, '1') FROM once.claim_key('after')" >/dev/null
tle_su -c "COMMIT PREPARED 'p1'" >/dev/null
expect "once.stats through the extension, after a prepared transaction" \
    "$(tle admin -c "$truth")" "$(tle admin -c "$stats")"
# With prepared transactions allowed and none prepared, a READ COMMITTED transaction
# still counts into its backend's row, updated in place: 200 of them insert no row each
# (they did once, and the dead rows slowed every later fold: BENCHMARKS.md section 13).
counts_inserted() {
    tle admin -c "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relid = 'once_internal.key_counts'::regclass"
}
inserted_before=$(counts_inserted)
for i in $(seq 200); do echo "SELECT once.complete_key('rc/$i', token, '1') FROM once.claim_key('rc/$i');"; done |
    tle app_user -q >/dev/null
sleep 1   # the session's statistics reach the shared counters as it exits
inserted=$(($(counts_inserted) - inserted_before))
if [ "$inserted" -gt 5 ]; then
    echo "200 READ COMMITTED completions inserted $inserted rows into once_internal.key_counts" >&2
    exit 1
fi
tle admin -q -c "DELETE FROM once.entries WHERE key LIKE 'rc/%'"
# An upgrade: a newer version's file adds an update path, ALTER EXTENSION UPDATE runs it.
sed "s/this constant text := '0.3.0';/this constant text := '0.3.1-test';/" "$tle_file" >"$work/pg_once_tle_next.sql"
tle admin -q -f "$work/pg_once_tle_next.sql"
tle admin -q -c "ALTER EXTENSION pg_once UPDATE"
expect "after ALTER EXTENSION UPDATE: version, keys kept" "0.3.1-test|3" \
    "$(tle admin -c "SELECT extversion, (SELECT count(*) FROM once.entries) FROM pg_extension WHERE extname = 'pg_once'")"
expect "app_user's EXECUTE kept by the update" "hit" "$(tle app_user -c "SELECT outcome FROM once.claim_key('tle')")"
tle admin -q -c "DROP EXTENSION pg_once"
expect "schemas left after DROP EXTENSION" 0 \
    "$(tle admin -c "SELECT count(*) FROM pg_namespace WHERE nspname IN ('once', 'once_internal')")"

# 6. (PG_ONCE_TEST_CRON=1, a minute more) pg_cron runs once.reap_stale() for the edition,
# scheduled by the non-superuser owner as docs/sql-edition.md says. Debian's pg_cron
# (1.4) takes cron schedules only, every minute at most; '1 second' needs pg_cron 1.5.
cron_lib=$(ls "$SYSTEM_PG_BIN/../lib/pg_cron.so" /usr/lib/postgresql/15/lib/pg_cron.so 2>/dev/null | head -1 || true)
if [ "${PG_ONCE_TEST_CRON:-0}" = 1 ] && [ -n "$cron_lib" ]; then
    say "SQL edition: reap_stale scheduled with pg_cron"
    cluster_stop "$TLE_NAME"
    cp "$cron_lib" "$copy/usr/lib/postgresql/15/lib/"
    cp "$(dirname "$cron_lib")"/../../../share/postgresql/15/extension/pg_cron* "$copy/usr/share/postgresql/15/extension/" 2>/dev/null ||
        cp /usr/share/postgresql/15/extension/pg_cron* "$copy/usr/share/postgresql/15/extension/"
    cluster_start "$TLE_NAME" "$TLE_PORT" "shared_preload_libraries = 'pg_cron'" "cron.database_name = 'app'"
    setup_db "$TLE_PORT" "$PG_ONCE_WORK/$TLE_NAME"
    $namespaces || tle admin -q -f "$REPO_ROOT/pg_test/edition/namespace_stubs.sql"
    tle admin -q -f "$OUT/pg_once_sql.sql"
    # What a managed service's administrator has done: pg_cron created, its schema usable.
    tle_su -q -c "CREATE EXTENSION pg_cron" -c "GRANT USAGE ON SCHEMA cron TO admin"
    version=$(tle admin -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'")
    case "$version" in 1.[0-4]*) schedule='* * * * *' ;; *) schedule='1 second' ;; esac
    tle admin -c "SELECT cron.schedule('pg_once-reap', '$schedule', 'SELECT once.reap_stale()')" >/dev/null
    tle admin -c "SELECT outcome FROM once.claim_key('gone owner', lease => '1 hour')" >/dev/null
    for i in $(seq 1 75); do
        [ "$(tle admin -c "SELECT state FROM once.entries WHERE key = 'gone owner'")" = failed ] && break
        sleep 1
    done
    expect "a gone owner's claim after pg_cron's reap_stale (pg_cron $version)" "failed|succeeded|admin" \
        "$(tle admin -c "SELECT state FROM once.entries WHERE key = 'gone owner'")|$(tle admin -c "SELECT status FROM cron.job_run_details ORDER BY runid LIMIT 1")|$(tle admin -c "SELECT username FROM cron.job")"
fi
# 7. The three client libraries' suites against the edition (what scripts/test.sh step 6
# runs against the extension), when test.sh runs steps 3 and 6 together and so has made
# their dependencies: PG_ONCE_PY_VENV (a virtualenv with clients/python[test] and
# psycopg) and clients/node/node_modules (npm ci). A database of their own, the edition
# installed by the owner who is not a superuser, and the suites connected as that owner
# over TCP: direct only (PgBouncer and TLS are between client and server, the same for
# both editions, and tested against the extension), and
# Python's sync flavour only (the async one runs the same SQL; CI's time).
py_venv=${PG_ONCE_PY_VENV:-}
if [ -z "$py_venv" ] || [ ! -x "$py_venv/bin/python" ] || [ ! -d "$REPO_ROOT/clients/node/node_modules" ]; then
    say "SQL edition: the client suites are skipped (run with test.sh's steps 3 and 6 together, or set PG_ONCE_PY_VENV and run npm ci in clients/node)"
else
    cluster_psql "$NAME" "$PORT" -q -c "CREATE DATABASE clients OWNER admin"
    "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d clients -X -q -v ON_ERROR_STOP=1 -f "$OUT/pg_once_sql.sql"
    dsn="host=127.0.0.1 port=$PORT user=admin dbname=clients"
    direct_only=(env -u PG_ONCE_BOUNCER_DSN -u PG_ONCE_SESSION_BOUNCER_DSN -u PG_ONCE_TLS_DSN -u PG_ONCE_TLS_URL)
    say "SQL edition: the Python client's suite (sync), as the owner"
    suite_started=$SECONDS
    py_log=$PG_ONCE_WORK/$NAME-python.log
    if ! (cd "$REPO_ROOT" && "${direct_only[@]}" PG_ONCE_DSN="$dsn" PG_ONCE_FLAVOURS=sync \
            PG_ONCE_PY_VENV="$py_venv" ./scripts/suite.sh python -rs >"$py_log" 2>&1); then
        cat "$py_log" >&2
        exit 1
    fi
    tail -1 "$py_log"
    say "SQL edition: the Python suite took $((SECONDS - suite_started)) s"
    say "SQL edition: the Node client's suite, as the owner"
    suite_started=$SECONDS
    (cd "$REPO_ROOT" && "${direct_only[@]}" PG_ONCE_DSN="$dsn" ./scripts/suite.sh node)
    say "SQL edition: the Node suite took $((SECONDS - suite_started)) s"
    say "SQL edition: the Rust client's suite, as the owner"
    suite_started=$SECONDS
    # One test says it is skipped (in its output, shown with -- --nocapture): old_server
    # needs a role that may create databases.
    (cd "$REPO_ROOT" && "${direct_only[@]}" PG_ONCE_DSN="$dsn" ./scripts/suite.sh rust)
    say "SQL edition: the Rust suite took $((SECONDS - suite_started)) s"
fi
say "SQL edition (views, cached, pg_tle): all checks passed"
