#!/usr/bin/env bash
# ./scripts/test-sql-edition.sh: the SQL edition (docs/sql-edition.md) on a plain
# PostgreSQL 15 that has no pg_once library, installed by a database owner who is not a
# superuser, as a managed service's admin role is (CREATEROLE, pg_read_all_stats,
# pg_signal_backend). One server for every check:
# 1. the script installs, and a second run of it is a no-op that keeps rows and grants;
# 2. the regression transcripts docs.sql and queue.sql (pg_test/regress), but for their
#    parts of stats and once.cached and the statements reading the once.queue_stats and
#    once.dead_letters views (not in the edition yet), must print what the extension
#    prints: pg_test/regress/expected/*.out, cut at the same lines;
# 3. what takes several sessions: a dead owner taken over at once and fenced off, a
#    waiting claim answered when the owner completes, NOTIFY, another role's token
#    refused, reap_stale, early refreshes, and no direct writes by an application role;
# 4. on a hot standby of that server (the port after it): hits, wait, writes refused;
# 5. every isolation spec (pg_test/isolation), against the extension's expected output;
# 6. the extension's attack suite (pg_test/multi: attacks.rs, sweep.rs) against it, and
#    its claim decision against the extension's vectors (claim_decision.rs), its interval
#    arguments against the rules both editions read (argument_rules.rs), and the claims
#    with wait => 0 that look again while a row's lock (protocol.rs) or the table's
#    (table_locks.rs) passes.
# PG_ONCE_PG_BIN, PG_ONCE_WORK and PG_ONCE_TEST_PORT as for test.sh; test.sh step 3 runs
# it on 15. The installation may hold the extension's library (test.sh installs it for
# the other steps): this server never preloads it, and a non-superuser can declare no C
# or internal function, which the first check below makes sure of, so nothing here can load it.
set -euo pipefail
PG_MAJOR=15
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_TEST_PORT:-28000}
NAME=sql-edition
OUT=$PG_ONCE_WORK/$NAME-build
"$REPO_ROOT/scripts/sql-edition.sh" "$OUT"
chmod -R a+rX "$OUT"
trap 'cluster_stop $NAME' EXIT
# autovacuum looks every second: the autovacuum attack below waits for its analyze.
cluster_start "$NAME" "$PORT" "autovacuum_naptime = 1"
cluster_psql "$NAME" "$PORT" -q \
    -c "CREATE ROLE admin LOGIN CREATEROLE IN ROLE pg_read_all_stats, pg_signal_backend" \
    -c "CREATE DATABASE app OWNER admin"
as_admin() { "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d app -X -v ON_ERROR_STOP=1 "$@"; }

say "SQL edition: install as a non-superuser owner, twice"
as_admin -q -f "$OUT/pg_once_sql.sql"
c_functions=$(as_admin -Atc "SELECT count(*) FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
                               WHERE p.pronamespace::regnamespace::text IN ('once', 'once_internal')
                                 AND l.lanname IN ('c', 'internal')")
preloaded=$(cluster_psql "$NAME" "$PORT" -Atc "SHOW shared_preload_libraries")
if [ "$c_functions" != 0 ] || [ -n "$preloaded" ]; then
    echo "the SQL edition declared $c_functions C functions, or the server preloads a library" >&2
    exit 1
fi
as_admin -q -c "CREATE ROLE app_user LOGIN; GRANT USAGE ON SCHEMA once TO app_user;
                GRANT EXECUTE ON FUNCTION once.claim_key TO app_user;
                SELECT token FROM once.claim_key('kept', owner_pid => 0);" >/dev/null
before=$(as_admin -Atc "SELECT count(*), max(token), has_function_privilege('app_user', 'once.claim_key(text,interval,interval,integer,boolean,bytea)', 'EXECUTE')
                         FROM once.entries")
as_admin -q -f "$OUT/pg_once_sql.sql"
after=$(as_admin -Atc "SELECT count(*), max(token), has_function_privilege('app_user', 'once.claim_key(text,interval,interval,integer,boolean,bytea)', 'EXECUTE')
                        FROM once.entries")
if [ "$before" != "$after" ] || [ "$after" != "$(echo "$before" | cut -d'|' -f1-2)|t" ]; then
    echo "a rerun of the script changed rows or grants: before $before, after $after" >&2
    exit 1
fi
# An install of an edition before pg_once 0.3.0 has claim_key without fingerprint: a
# rerun replaces it, and what was granted on it is granted on its successor (and nothing
# to PUBLIC).
as_admin -q -c "DROP FUNCTION once.claim_key(text,interval,interval,integer,boolean,bytea);
                CREATE FUNCTION once.claim_key(key text, lease interval, wait interval, owner_pid integer,
                                               serve_stale boolean) RETURNS once.claim
                    LANGUAGE sql AS 'SELECT NULL::once.claim';
                REVOKE ALL ON FUNCTION once.claim_key(text,interval,interval,integer,boolean) FROM PUBLIC;
                GRANT EXECUTE ON FUNCTION once.claim_key(text,interval,interval,integer,boolean) TO app_user;"
as_admin -q -f "$OUT/pg_once_sql.sql"
got=$(as_admin -Atc "SELECT (SELECT count(*) FROM pg_proc WHERE proname = 'claim_key' AND pronamespace = 'once'::regnamespace),
                            has_function_privilege('app_user', 'once.claim_key(text,interval,interval,integer,boolean,bytea)', 'EXECUTE'),
                            has_function_privilege('public', 'once.claim_key(text,interval,interval,integer,boolean,bytea)', 'EXECUTE')")
if [ "$got" != "1|t|f" ]; then
    echo "a rerun over claim_key without fingerprint: claim_keys, app_user's and PUBLIC's EXECUTE are $got, not 1|t|f" >&2
    exit 1
fi
as_admin -q -c "DELETE FROM once.entries"

say "SQL edition: pg_test/regress docs.sql, but for its stats and cached parts"
work=$PG_ONCE_WORK/$NAME-regress
mkdir -p "$work"
# The parts the edition has: all but "-- stats" and "-- cached", and the statement of
# queue mode that reads the once.queue_stats view (with its output, up to the blank line
# after its row count). The install is the script above, not CREATE EXTENSION: that line
# (and DROP EXTENSION) is left out of both.
core_of() {
    awk '/^-- stats$/ || /^-- cached$/ { on = 0 } /^-- freshness/ || /^-- fingerprints$/ { on = 1 }
         NR == 1 { on = 1 }
         /once\.queue_stats/ { view = 1 }
         view { if (/^$/ || FILENAME ~ /\.sql$/) view = 0; next }
         on && !/^(CREATE|DROP) EXTENSION pg_once;$/' "$1"
}
core_of "$REPO_ROOT/pg_test/regress/sql/docs.sql" >"$work/core.sql"
core_of "$REPO_ROOT/pg_test/regress/expected/docs.out" >"$work/core.out"
# pg_regress's way: psql reads the file on stdin, echoing it, errors without a file prefix.
# SHOW_CONTEXT=never: an error raised in PL/pgSQL carries a CONTEXT line naming the
# function, which the extension's C errors have not; message, SQLSTATE and hint are the
# same, and no client reads the context. That is the one difference by design here.
as_admin -a -q -v ON_ERROR_STOP=0 -v SHOW_CONTEXT=never <"$work/core.sql" >"$work/core.result" 2>&1 || true
if ! diff -u "$work/core.out" "$work/core.result" >"$work/core.diff"; then
    cat "$work/core.diff" >&2
    echo "docs.sql differs on the SQL edition: $work/core.diff" >&2
    exit 1
fi
# pg_test/regress's queue.sql the same way, but for its statements that read the views
# once.queue_stats and once.dead_letters, in a database of its own.
cluster_psql "$NAME" "$PORT" -q -c "CREATE DATABASE queue OWNER admin"
"$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d queue -X -q -v ON_ERROR_STOP=1 -f "$OUT/pg_once_sql.sql"
without_views() {
    awk '/once\.(queue_stats|dead_letters)/ { view = 1 }
         view { if (/^$/ || FILENAME ~ /\.sql$/) view = 0; next }
         !/^(CREATE|DROP) EXTENSION pg_once;$/' "$1"
}
without_views "$REPO_ROOT/pg_test/regress/sql/queue.sql" >"$work/queue.sql"
without_views "$REPO_ROOT/pg_test/regress/expected/queue.out" >"$work/queue.out"
"$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d queue -X -a -q -v ON_ERROR_STOP=0 -v SHOW_CONTEXT=never \
    <"$work/queue.sql" >"$work/queue.result" 2>&1 || true
if ! diff -u "$work/queue.out" "$work/queue.result" >"$work/queue.diff"; then
    cat "$work/queue.diff" >&2
    echo "queue.sql differs on the SQL edition: $work/queue.diff" >&2
    exit 1
fi
say "SQL edition: what needs several sessions (liveness, waiting, NOTIFY, roles)"
as_user() { "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U app_user -d app -X -At -v ON_ERROR_STOP=1 "$@"; }
expect() {  # expect WHAT WANTED GOT
    if [ "$2" != "$3" ]; then echo "$1: expected $2, got $3" >&2; exit 1; fi
}
as_admin -q -c "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO app_user"
# An application role, not the installer, claims: its session ends, and the next caller
# takes the claim over at once, judged dead through pg_stat_activity (not after the lease).
first=$(as_user -c "SELECT token FROM once.claim_key('dead', lease => '1 hour')")
took=$(as_user -c "SELECT outcome || ' ' || attempts FROM once.claim_key('dead', owner_pid => 0)")
expect "a claim of an exited session" "claimed 2" "$took"
# Fencing: the first owner's token no longer completes the key (sql/complete.sql).
expect "a taken-over token's complete_key" "f" "$(as_user -c "SELECT once.complete_key('dead', $first, '1')")"
expect "the takeover recorded" "taken_over" "$(as_admin -Atc "SELECT last_outcome FROM once.entries WHERE key = 'dead'")"
# A claim made for an owner session (a pooled caller's): held while that session lives,
# taken over at once when it closes.
rm -f "$work/owner"
as_user -c "SELECT once.owner_session()" -c "SELECT pg_sleep(1.5)" >"$work/owner" &
for _ in $(seq 50); do [ -s "$work/owner" ] && break; sleep 0.1; done
owner=$(head -1 "$work/owner")
expect "a claim for owner session $owner" "claimed" "$(as_user -c "SELECT outcome FROM once.claim_key('pooled', owner_pid => $owner)")"
expect "a claim while the owner session lives" "wait" "$(as_user -c "SELECT outcome FROM once.claim_key('pooled')")"
wait
expect "a claim once the owner session closed" "claimed" "$(as_user -c "SELECT outcome FROM once.claim_key('pooled', owner_pid => 0)")"
expect "owner_pid of no backend" "no backend with pid 2147483647 is running" \
    "$(as_user -c "SELECT FROM once.claim_key('k', owner_pid => 2147483647)" 2>&1 | sed 's/.*ERROR:  //' | head -1)"
# A live owner is waited for: a claim with wait polls until the owner completes.
token=$(as_user -c "SELECT token FROM once.claim_key('slow', owner_pid => 0)")
( sleep 0.5; as_user -q -c "SELECT once.complete_key('slow', $token, '\"done\"')" >/dev/null ) &
got=$(as_user -c "SELECT outcome || ' ' || result FROM once.claim_key('slow', wait => '10 seconds')")
wait
expect "a waiting claim once the owner completed" 'hit "done"' "$got"
expect "a claim with wait => 0 of a live owner's key" "wait" \
    "$(as_user -c "SELECT token FROM once.claim_key('held', owner_pid => 0)" >/dev/null
       as_user -c "SELECT outcome FROM once.claim_key('held')")"
# A claim another transaction has not committed is not waited for (wait => 0): answered
# wait, with nothing known of it, within the lock budget (claim::attempt, busy).
as_user -q -c "BEGIN" -c "SELECT FROM once.claim_key('uncommitted')" -c "SELECT pg_sleep(3)" -c "COMMIT" >/dev/null &
sleep 0.5
started=$(date +%s%N)
got=$(as_user -c "SELECT outcome || ' ' || coalesce(owner, 'none') FROM once.claim_key('uncommitted')")
elapsed_ms=$(( ($(date +%s%N) - started) / 1000000 ))
wait
expect "a key another transaction is claiming" "wait none" "$got"
if [ "$elapsed_ms" -ge 2000 ]; then
    echo "claim_key(wait => 0) waited $elapsed_ms ms for another transaction's claim" >&2; exit 1
fi
# Another role cannot end a claim with its token (rules/token_holder.sql); the installer,
# an administrator, can.
as_admin -q -c "CREATE ROLE other_user LOGIN IN ROLE app_user" -c "GRANT USAGE ON SCHEMA once TO other_user"
token=$(as_admin -Atc "SELECT token FROM once.entries WHERE key = 'held'")
expect "another role's complete_key" "f" \
    "$("$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U other_user -d app -X -At \
        -c "SET ROLE other_user" -c "SELECT once.complete_key('held', $token, '1')" | tail -1)"
expect "the installer's complete_key" "t" "$(as_admin -Atc "SELECT once.complete_key('held', $token, '1')")"
# Waiters are told on channel once, with the key, by the trigger's pg_notify.
notified=$(as_user -c "LISTEN once" -c "SELECT once.fail_key('n/1', token, 'x') FROM once.claim_key('n/1')" 2>&1 | grep -c 'Asynchronous notification "once" with payload "n/1"' || true)
expect "a NOTIFY on channel once with the key" 1 "$notified"
# reap_stale takes back claims of sessions that exited and, the lease being the
# fallback, a lease-only claim whose lease ran out.
as_user -c "SELECT token FROM once.claim_key('exited', lease => '1 hour')" >/dev/null
as_user -c "SELECT FROM once.reap_stale()" >/dev/null
expect "the exited owner's key" "failed abandoned" "$(as_admin -Atc "SELECT state || ' ' || last_outcome FROM once.entries WHERE key = 'exited'")"
as_user -c "SELECT token FROM once.claim_key('leased', lease => '10 milliseconds', owner_pid => 0)" >/dev/null
sleep 0.1
expect "reap_stale" "1" "$(as_user -c "SELECT reclaimed FROM once.reap_stale()")"
expect "the reaped key" "failed abandoned" "$(as_admin -Atc "SELECT state || ' ' || last_outcome FROM once.entries WHERE key = 'leased'")"
# Early refresh (XFetch): a result that took an hour to compute, with a second left of
# its ttl and beta 100, is refreshed by the next hit (probability exp(-1 / 360000)); with
# beta NULL it is a plain hit.
as_admin -q -c "SELECT once.complete_key(k, token, '1', ttl => '1 hour', beta => b)
                  FROM (VALUES ('early', 100), ('plain', NULL)) v(k, b), once.claim_key(k, owner_pid => 0)" \
    -c "UPDATE once.entries SET expires_at = clock_timestamp() + '1 second', compute_time = '1 hour'
         WHERE key IN ('early', 'plain')" >/dev/null
expect "a hit that draws an early refresh" "refresh 1" "$(as_user -c "SELECT outcome || ' ' || result FROM once.claim_key('early', serve_stale => true, owner_pid => 0)")"
# No answer but claimed (and refresh, a claim) carries a token (issue 36): another
# role's hit during the refresh must not be handed the refresh's token.
expect "a hit of a key being refreshed" "hit no token" \
    "$(as_user -c "SELECT outcome || ' ' || coalesce(token::text, 'no token') FROM once.claim_key('early')")"
as_user -q -c "SELECT once.fail_key('failed/1', token, 'x', retry_after => '1 hour') FROM once.claim_key('failed/1')" >/dev/null
expect "a failed answer" "failed no token" \
    "$(as_user -c "SELECT outcome || ' ' || coalesce(token::text, 'no token') FROM once.claim_key('failed/1')")"
expect "a hit without beta" "hit" "$(as_user -c "SELECT outcome FROM once.claim_key('plain')")"
# once.get's draw is owed to the session's next claim_key, which takes the refresh even
# though its own draw could not (beta is gone by then): a second draw would refresh with
# the square of the probability.
as_admin -q -c "UPDATE once.entries SET state = 'done', expires_at = clock_timestamp() + '1 second' WHERE key = 'early'"
got=$(as_user <<SQL | paste -sd'|'
SELECT once.get('early');
\! "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d app -X -q -c "UPDATE once.entries SET beta = NULL WHERE key = 'early'"
SELECT outcome FROM once.claim_key('early', owner_pid => 0);
SQL
)
expect "get, then claim_key, of a result that drew a refresh" "|claimed" "$got"
# complete_keys completes the claims still current, and leaves out the others (b/2's
# token is not its claim's).
got=$(as_user <<'SQL' | paste -sd'|'
SELECT key FROM once.complete_keys(
    ARRAY['b/1', 'b/2'],
    ARRAY[(SELECT token FROM once.claim_key('b/1')), (SELECT 1 FROM once.claim_key('b/2'))],
    ARRAY['1', '2']::jsonb[]);
SELECT outcome FROM once.claim_key('b/1');
SQL
)
expect "complete_keys with a stale token" "b/1|hit" "$got"
# Fingerprints (claim::mismatches) beyond docs.sql's: a result in its stale window still
# answers another request mismatch; past it, that request claims the key, with its
# fingerprint; an empty fingerprint is refused (22023).
as_user -q -c "SELECT once.complete_key('fp', token, '1', ttl => '1 millisecond', stale => '1 hour')
                 FROM once.claim_key('fp', fingerprint => '\xaa')" >/dev/null
sleep 0.01
expect "another fingerprint in the stale window" "mismatch" \
    "$(as_user -c "SELECT outcome FROM once.claim_key('fp', serve_stale => true, fingerprint => '\xbb')")"
as_admin -q -c "UPDATE once.entries SET stale_until = clock_timestamp() WHERE key = 'fp'"
expect "another fingerprint past the stale window" "claimed" \
    "$(as_user -c "SELECT outcome FROM once.claim_key('fp', fingerprint => '\xbb')")"
expect "the fingerprint of that claim" "bb" "$(as_admin -Atc "SELECT encode(fingerprint, 'hex') FROM once.entries WHERE key = 'fp'")"
expect "an empty fingerprint" "22023: fingerprint must not be empty" \
    "$(as_user -v VERBOSITY=verbose -c "SELECT FROM once.claim_key('fp', fingerprint => '')" 2>&1 | sed -n 's/^ERROR:  //p')"
# Queue mode: a waiting claim_next polls until a key is enqueued; a failed attempt goes
# back to its queue with a backoff, and once.attempts keeps its history.
as_admin -q -c "SELECT once.create_queue('jobs', max_attempts => 2, backoff => '1 hour')" >/dev/null
( sleep 0.5; as_user -q -c "SELECT once.enqueue_key('job/1', '{\"n\": 1}', 'jobs')" >/dev/null ) &
got=$(as_user -c "SELECT key || ' ' || payload::text || ' ' || attempt FROM once.claim_next('jobs', worker => 'w1', wait => '10 seconds')")
wait
expect "a waiting claim_next once a key was enqueued" 'job/1 {"n": 1} 1' "$got"
token=$(as_admin -Atc "SELECT token FROM once.entries WHERE key = 'job/1'")
as_user -q -c "SELECT once.fail_key('job/1', $token, 'boom')" >/dev/null
expect "a failed queued key" "queued true" \
    "$(as_admin -Atc "SELECT state || ' ' || (run_at > clock_timestamp() + '20 minutes') FROM once.entries WHERE key = 'job/1'")"
expect "its attempt history" "w1 failed boom" \
    "$(as_admin -Atc "SELECT worker || ' ' || outcome || ' ' || error FROM once.attempts WHERE key = 'job/1'")"
expect "a claim_next with nothing due" "0" "$(as_user -c "SELECT count(*) FROM once.claim_next('jobs', wait => '50 milliseconds')")"
# The size limits, as rows of once.settings an administrator writes (54000 past them).
as_admin -q -c "INSERT INTO once.settings VALUES ('once.max_result_size', '1kB')"
expect "a result past once.max_result_size" "54000" "$(as_user -v VERBOSITY=verbose \
    -c "SELECT once.complete_key('big', token, to_jsonb(repeat('x', 2000))) FROM once.claim_key('big')" 2>&1 |
    sed -n 's/^ERROR:  \([0-9A-Z]\{5\}\):.*/\1/p')"
as_admin -q -c "DELETE FROM once.settings"
expect "once.key_hash for every role, as in the extension" "t" \
    "$(as_admin -Atc "SELECT has_function_privilege('public', 'once.key_hash(text)', 'EXECUTE')
                          AND NOT has_function_privilege('public', 'once.claim_key(text,interval,interval,integer,boolean,bytea)', 'EXECUTE')")"
say "SQL edition: namespaces, attacked by another role through every function"
# Two applications: app2 owns namespace t2/ (keys announced as digests) and its queue
# t2q; app1, granted everything in schema once as app2 is, tries to reach them through
# every function (pg_test/multi/tests/namespaces.rs does the same to the extension).
as_admin -q -c "CREATE ROLE app1 LOGIN; CREATE ROLE app2 LOGIN;
                GRANT USAGE ON SCHEMA once TO app1, app2;
                GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO app1, app2;
                SELECT once.create_namespace('t2/', 'app2')" >/dev/null
as_role() { local role=$1; shift; "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U "$role" -d app -X -At -v ON_ERROR_STOP=1 "$@"; }
# A namespace's queue is made by a member (the installer is not one of app2).
as_role app2 -q -c "SELECT once.create_queue('t2q', namespace => 't2/')" >/dev/null
secret_token=$(as_role app2 -c "SELECT token FROM once.claim_key('t2/secret')")
as_role app2 -q -c "SELECT once.complete_key('t2/secret', $secret_token, '{\"ssn\": \"078-05-1120\"}')" >/dev/null
running=$(as_role app2 -c "SELECT token FROM once.claim_key('t2/running', lease => '1 hour', owner_pid => 0)")
as_role app2 -q -c "SELECT once.enqueue_key('t2/job', '{\"api_key\": \"sk-123\"}', 't2q')" >/dev/null
refused=0
while IFS= read -r sql; do
    [ -n "$sql" ] || continue
    got=$(as_role app1 -v VERBOSITY=verbose -c "$sql" 2>&1 | sed -n 's/^ERROR:  //p' | head -1 || true)
    case "$got" in
        '42501: permission denied for namespace "t2/": '*) refused=$((refused + 1)) ;;
        *) echo "app1 was not refused t2/'s keys: $sql: ${got:-no error}" >&2; exit 1 ;;
    esac
done <<SQL
SELECT outcome FROM once.claim_key('t2/secret')
SELECT outcome FROM once.claim_key('t2/new')
SELECT once.get('t2/secret')
SELECT once.complete_key('t2/running', $running, '"forged"')
SELECT once.fail_key('t2/running', $running, 'forged')
SELECT once.heartbeat_key('t2/running', $running)
SELECT once.release_key('t2/running', $running)
SELECT * FROM once.complete_keys(ARRAY['t2/running'], ARRAY[$running::bigint], ARRAY['1'::jsonb])
SELECT once.invalidate_key('t2/secret')
SELECT once.refresh_key('t2/secret')
SELECT once.enqueue_key('t2/secret')
SELECT once.enqueue_key('t2/other', queue => 't2q')
SELECT once.enqueue_key('shared/1', queue => 't2q')
SELECT * FROM once.enqueue_keys(ARRAY['shared/2', 't2/x'])
SELECT * FROM once.enqueue_keys(ARRAY['shared/3'], queue => 't2q')
SELECT * FROM once.claim_next('t2q')
SELECT once.drop_queue('t2q')
SELECT once.create_queue('t2q', 9)
SELECT once.create_queue('mine', namespace => 't2/')
SELECT once.invalidate_keys(queue => 't2q')
SQL
expect "functions that refused app1" 20 "$refused"
expect "invalidate_keys(prefix) by app1" "0" "$(as_role app1 -c "SELECT once.invalidate_keys(prefix => 't2/')")"
expect "create_namespace by app1" "42501: permission denied: once.create_namespace" \
    "$(as_role app1 -v VERBOSITY=verbose -c "SELECT once.create_namespace('t1/', 'app1')" 2>&1 | sed -n 's/^ERROR:  //p')"
expect "drop_namespace by app1" "42501: permission denied: once.drop_namespace" \
    "$(as_role app1 -v VERBOSITY=verbose -c "SELECT once.drop_namespace('t2/')" 2>&1 | sed -n 's/^ERROR:  //p')"
# A once.cached key (`...#cached:<role oid>:<digest>`) is its role's alone
# (namespace::require_key), whatever the namespaces.
cached_key="report#cached:$(as_admin -Atc "SELECT 'app2'::regrole::oid"):$(printf '%064d' 0)"
expect "app1 using app2's once.cached key" "42501: permission denied for key \"$cached_key\": claim_key" \
    "$(as_role app1 -v VERBOSITY=verbose -c "SELECT outcome FROM once.claim_key('$cached_key')" 2>&1 | sed -n 's/^ERROR:  //p')"
expect "app2 using its own once.cached key" "claimed" "$(as_role app2 -c "SELECT outcome FROM once.claim_key('$cached_key', owner_pid => 0)")"
# A shared queue serves every role's workers: only an administrator changes or drops it
# (any role may create one).
as_role app1 -q -c "SELECT once.create_queue('app1q')" >/dev/null
expect "app1 changing the default queue" "42501: permission denied: queue \"default\" is shared by every role" \
    "$(as_role app1 -v VERBOSITY=verbose -c "SELECT once.create_queue('default', 9)" 2>&1 | sed -n 's/^ERROR:  //p')"
expect "app1 dropping a shared queue" "42501: permission denied: queue \"app1q\" is shared by every role" \
    "$(as_role app1 -v VERBOSITY=verbose -c "SELECT once.drop_queue('app1q')" 2>&1 | sed -n 's/^ERROR:  //p')"
as_admin -q -c "SELECT once.drop_queue('app1q')" >/dev/null
# A namespace's key goes only into its own queues, for its members too.
expect "app2's key into a shared queue" "42501: key \"t2/other\" belongs to namespace \"t2/\", queue \"default\" does not" \
    "$(as_role app2 -v VERBOSITY=verbose -c "SELECT once.enqueue_key('t2/other')" 2>&1 | sed -n 's/^ERROR:  //p')"
# Nothing app1 tried changed anything: app2 has its keys, its claim, its queued job.
expect "app2's result" '{"ssn": "078-05-1120"}' "$(as_role app2 -c "SELECT once.get('t2/secret')")"
expect "app2's claim" "t" "$(as_role app2 -c "SELECT once.complete_key('t2/running', $running, '2')")"
expect "app2's job" 't2/job {"api_key": "sk-123"}' "$(as_role app2 -c "SELECT key || ' ' || payload::text FROM once.claim_next('t2q')")"
# A listener without rights is told the digest of a t2/ key, never the key.
digest=$(as_admin -Atc "SELECT encode(once.key_hash('t2/told'), 'hex')")
heard=$(as_role app1 -c "LISTEN once" -c "SELECT pg_sleep(1.5)" 2>&1 &
        sleep 0.5
        as_role app2 -q -c "SELECT once.fail_key('t2/told', token, 'x') FROM once.claim_key('t2/told')" >/dev/null
        wait)
expect "the payload of a digest namespace's key" "Asynchronous notification \"once\" with payload \"$digest\" received from server process" \
    "$(echo "$heard" | grep -o 'Asynchronous notification.*server process')"
# SET ROLE to a member's role is how a member calls; a non-member cannot.
expect "app1 taking app2's role" "permission denied to set role \"app2\"" \
    "$(as_role app1 -c "SET ROLE app2" 2>&1 | sed -n 's/^ERROR:  //p')"
# drop_namespace refuses while keys or queues remain (they would become everyone's).
expect "drop_namespace of a namespace with keys" "55006" \
    "$(as_admin -v VERBOSITY=verbose -c "SELECT once.drop_namespace('t2/')" 2>&1 | sed -n 's/^ERROR:  \([0-9A-Z]\{5\}\):.*/\1/p')"
# create_namespace over keys that other roles may have planted: refused unless purged or
# adopted.
as_role app1 -q -c "SELECT once.complete_key('t3/planted', token, '\"evil\"') FROM once.claim_key('t3/planted')" >/dev/null
expect "create_namespace over a planted key" "55006: 1 key under \"t3/\" would become the namespace's" \
    "$(as_admin -v VERBOSITY=verbose -c "SELECT once.create_namespace('t3/', 'app2')" 2>&1 | sed -n 's/^ERROR:  //p')"
as_admin -q -c "SELECT once.create_namespace('t3/', 'app2', existing => 'purge')" >/dev/null
expect "the planted key, purged" "claimed" "$(as_role app2 -c "SELECT outcome FROM once.claim_key('t3/planted')")"
# A REPEATABLE READ transaction whose snapshot predates a namespace cannot use its keys
# (the extension reads the namespaces with the latest snapshot; the edition fails the call
# with 40001): it would otherwise plant a result app2 is then served as its own.
got=$(as_role app1 -v VERBOSITY=verbose 2>&1 <<SQL | sed -n 's/^ERROR:  \([0-9A-Z]\{5\}\):.*/\1/p' || true
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT once.get('shared/none');
\! "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d app -X -q -c "SELECT once.create_namespace('t4/', 'app2')"
SELECT outcome FROM once.claim_key('t4/planted');
COMMIT;
SQL
)
expect "a claim of a new namespace's key under an older snapshot" "40001" "$got"
expect "that key" "0" "$(as_admin -Atc "SELECT count(*) FROM once.entries WHERE key = 't4/planted'")"
# Nor does it reach once_internal (claim_next's filter, the token sequence): no USAGE.
expect "app_user calling once_internal.row_taken" "permission denied for function row_taken" \
    "$(as_user -c "SELECT once_internal.row_taken('(0,1)')" 2>&1 | sed -n 's/^ERROR:  //p')"
# What the edition leaves to the functions: no application role writes the table.
if as_user -c "DELETE FROM once.entries" 2>/dev/null; then
    echo "app_user could write once.entries directly" >&2; exit 1
fi
say "SQL edition: attacks judged as the current user, the install, the settings (issue 36)"
# Every check judges the current user of the calling context, as the extension does
# (docs/sql-edition.md, "Who is judged"), never the session's user: app1 gets a schema
# of its own and plants code that other roles' sessions run.
# (As the superuser: the owner, with CREATEROLE, is no member of app1.)
cluster_psql "$NAME" "$PORT" -q -d app -c "CREATE SCHEMA app1 AUTHORIZATION app1"
refused() {  # refused ROLE SQL: the SQLSTATE of the error ROLE's SQL ends with, or "none"
    local role=$1; shift
    local got
    got=$(as_role "$role" -v VERBOSITY=verbose -c "$1" 2>&1 | sed -n 's/^ERROR:  \([0-9A-Z]\{5\}\):.*/\1/p' | head -1)
    echo "${got:-none}"
}
namespace_exists() { as_admin -Atc "SELECT count(*) FROM once_internal.namespace_owners WHERE prefix = '$1'"; }
# 1. An index expression of app1's table calls once.create_namespace: the owner's ANALYZE
# (an administrator's session) and autovacuum's (the bootstrap superuser's) evaluate it as
# app1, the table's owner, whom create_namespace refuses (swallowed here, so that ANALYZE
# goes on; any other error fails it).
as_role app1 -q <<'SQL'
CREATE FUNCTION app1.grab(x int, prefix text) RETURNS int IMMUTABLE LANGUAGE plpgsql AS $$
BEGIN
    PERFORM once.create_namespace(prefix, 'app1', existing => 'adopt');
    RETURN x;
EXCEPTION WHEN insufficient_privilege THEN
    RETURN x;
END $$;
CREATE TABLE app1.bait (x int);
INSERT INTO app1.bait SELECT generate_series(1, 10);
CREATE INDEX ON app1.bait (app1.grab(x, 't5/'));
CREATE TABLE app1.autobait (x int) WITH (autovacuum_analyze_threshold = 1, autovacuum_analyze_scale_factor = 0);
CREATE INDEX ON app1.autobait (app1.grab(x, 't6/'));
GRANT USAGE ON SCHEMA app1 TO admin, app2;
SQL
as_admin -q -c "ANALYZE app1.bait"
expect "a namespace defined by app1's index expression under the owner's ANALYZE" 0 "$(namespace_exists t5/)"
as_role app1 -q -c "INSERT INTO app1.autobait SELECT generate_series(1, 100)"
for _ in $(seq 600); do
    [ "$(as_admin -Atc "SELECT last_autoanalyze IS NOT NULL FROM pg_stat_user_tables WHERE relid = 'app1.autobait'::regclass")" = t ] && break
    sleep 0.1
done
expect "autovacuum's analyze of app1.autobait, within 60 s" t \
    "$(as_admin -Atc "SELECT last_autoanalyze IS NOT NULL FROM pg_stat_user_tables WHERE relid = 'app1.autobait'::regclass")"
expect "a namespace defined by app1's index expression under autovacuum" 0 "$(namespace_exists t6/)"
# 2. SECURITY DEFINER code of app1's is judged as app1, whoever calls it: not as the
# owner who calls promote(), nor as app2, t2/'s owner, who calls steal().
as_role app1 -q <<'SQL'
CREATE FUNCTION app1.promote() RETURNS void SECURITY DEFINER LANGUAGE sql
    AS $$ SELECT once.create_namespace('t5/', 'app1') $$;
CREATE FUNCTION app1.steal() RETURNS jsonb SECURITY DEFINER LANGUAGE sql
    AS $$ SELECT once.get('t2/secret') $$;
SQL
expect "app1's SECURITY DEFINER create_namespace called by the owner" 42501 "$(refused admin "SELECT app1.promote()")"
expect "that namespace" 0 "$(namespace_exists t5/)"
expect "app1's SECURITY DEFINER get of t2/'s key called by app2" 42501 "$(refused app2 "SELECT app1.steal()")"
# Nor does the owner's own SECURITY DEFINER code, granted to app1, administer for app1
# (namespace::caller_administers: administrators administer acting as themselves): not
# a namespace, and not app2's claim with its token.
as_admin -q <<SQL
CREATE SCHEMA owner_code;
GRANT USAGE ON SCHEMA owner_code TO app1;
CREATE FUNCTION owner_code.define(prefix text) RETURNS void SECURITY DEFINER LANGUAGE sql
    AS \$\$ SELECT once.create_namespace(prefix, 'app1') \$\$;
CREATE FUNCTION owner_code.fail(key text, token bigint) RETURNS boolean SECURITY DEFINER LANGUAGE sql
    AS \$\$ SELECT once.fail_key(key, token, 'forged', retry_after => '1 year') \$\$;
SQL
expect "the owner's SECURITY DEFINER create_namespace called by app1" 42501 "$(refused app1 "SELECT owner_code.define('t5/')")"
borrowed_token=$(as_role app2 -c "SELECT token FROM once.claim_key('borrowed', owner_pid => 0)")
expect "the owner's SECURITY DEFINER fail_key of app2's claim called by app1" f \
    "$(as_role app1 -c "SELECT owner_code.fail('borrowed', $borrowed_token)")"
# 3. The implementations behind once.* act for the role they are given, and only for
# once.*'s own call: called directly, from a function that looks like once.*, or from
# a query whose text forges once.*'s line of the call stack, they refuse.
forged_frame="PL/pgSQL function once.create_namespace(text,regrole,text,text) line 3 at RETURN"
as_role app1 -q <<SQL
CREATE FUNCTION app1.create_namespace(prefix text, owner regrole, notify text, existing text)
    RETURNS void LANGUAGE plpgsql AS \$\$
BEGIN
    PERFORM once_internal.create_namespace('admin', prefix, owner, notify, existing);
END \$\$;
CREATE FUNCTION app1.forge() RETURNS void LANGUAGE plpgsql AS \$\$
BEGIN
    EXECUTE E'SELECT once_internal.create_namespace(''admin'', ''t5/'', ''app1'', ''digest'', ''refuse'')"\n$forged_frame\n"';
END \$\$;
SQL
expect "app1 calling create_namespace's implementation as admin" 42501 \
    "$(refused app1 "SELECT once_internal.create_namespace('admin', 't5/', 'app1', 'digest', 'refuse')")"
expect "app1 calling it from a function of the same name" 42501 \
    "$(refused app1 "SET search_path = app1, pg_catalog; SELECT create_namespace('t5/', 'app1', 'digest', 'refuse')")"
expect "app1 calling it under a forged call stack" 42501 "$(refused app1 "SELECT app1.forge()")"
expect "app1 calling get's implementation as app2" 42501 "$(refused app1 "SELECT once_internal.get('app2', 't2/secret')")"
expect "those namespaces" 0 "$(namespace_exists t5/)"
# 4. The protective settings are the administrator's: an application role's SET neither
# purges history (once.history_retention) nor raises a size limit.
# (The rows that were there before: reap_stale may add the history of a claim it reaps.)
history=$(as_admin -Atc "SELECT string_agg(token::text, ',' ORDER BY token) FROM once.attempts")
[ -n "$history" ] || { echo "no attempt history to attack" >&2; exit 1; }
as_user -q -c "SET once.history_retention = '0'" -c "SELECT FROM once.reap_stale()"
expect "once.attempts after app_user's reap_stale with history_retention 0" "$history" \
    "$(as_admin -Atc "SELECT string_agg(token::text, ',' ORDER BY token) FROM once.attempts WHERE token IN ($history)")"
expect "a 17 MB result under app_user's SET once.max_result_size = '1GB'" 54000 \
    "$(refused app_user "SET once.max_result_size = '1GB';
                         SELECT once.complete_key('huge', token, to_jsonb(repeat('x', 17 * 1024 * 1024))) FROM once.claim_key('huge')")"
expect "a 17 kB error under app_user's SET once.max_error_size = '1GB'" 54000 \
    "$(refused app_user "SET once.max_error_size = '1GB';
                         SELECT once.fail_key('huge-error', token, repeat('x', 17 * 1024)) FROM once.claim_key('huge-error')")"
expect "a 2 MB payload under app_user's SET once.max_payload_size = '1GB'" 54000 \
    "$(refused app_user "SET once.max_payload_size = '1GB';
                         SELECT once.enqueue_key('huge-payload', to_jsonb(repeat('x', 2 * 1024 * 1024)), 'jobs')")"
# What an administrator sets in once.settings holds, whatever a session sets; no
# application role writes once.settings.
as_admin -q -c "INSERT INTO once.settings VALUES ('once.max_result_size', '1kB')"
expect "a 2 kB result past once.settings' max_result_size, raised by app_user's SET" 54000 \
    "$(refused app_user "SET once.max_result_size = '1GB';
                         SELECT once.complete_key('big2', token, to_jsonb(repeat('x', 2000))) FROM once.claim_key('big2')")"
expect "app_user writing once.settings" 42501 "$(refused app_user "UPDATE once.settings SET value = '1GB'")"
expect "a size once.settings cannot read" 23514 "$(refused admin "INSERT INTO once.settings VALUES ('once.max_error_size', 'lots')")"
expect "a setting once.settings does not know" 23514 "$(refused admin "INSERT INTO once.settings VALUES ('once.poll_interval', '10')")"
as_admin -q -c "DELETE FROM once.settings"
# 5. The install adopts no schema it did not make: helper, a role the owner is a member
# of (the usual way an owner manages application roles), made once_internal first, to
# replace what every function of pg_once runs.
cluster_psql "$NAME" "$PORT" -q -c "CREATE DATABASE planted OWNER admin"
as_admin -q -c "CREATE ROLE helper LOGIN; GRANT helper TO admin; GRANT CREATE ON DATABASE planted TO helper"
"$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U helper -d planted -X -q -c "CREATE SCHEMA once_internal"
install_into() {  # install_into DB: the SQLSTATE the install fails with, or "none"
    local got
    got=$("$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U admin -d "$1" -X -q -v VERBOSITY=verbose \
              -f "$OUT/pg_once_sql.sql" 2>&1 | tee -a "$work/installs" | sed -n 's/.*ERROR:  \([0-9A-Z]\{5\}\):.*/\1/p' | head -1)
    echo "${got:-none}"
}
expect "an install over helper's once_internal" 42501 "$(install_into planted)"
"$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME" -p "$PORT" -U helper -d planted -X -q \
    -c "DROP SCHEMA once_internal" -c "CREATE SCHEMA once"
expect "an install over helper's once" 42501 "$(install_into planted)"
# 6. A rerun refuses a schema in which another role may create objects.
for schema in once once_internal; do
    as_admin -q -c "GRANT CREATE ON SCHEMA $schema TO app1"
    expect "a rerun while app1 may create objects in $schema" 42501 "$(install_into app)"
    as_admin -q -c "REVOKE CREATE ON SCHEMA $schema FROM app1"
done
# Nor what such a role left there when its CREATE is taken back.
as_admin -q -c "GRANT CREATE ON SCHEMA once_internal TO app1"
as_role app1 -q -c "CREATE FUNCTION once_internal.caller(x int) RETURNS oid LANGUAGE sql RETURN 10"
as_admin -q -c "REVOKE CREATE ON SCHEMA once_internal FROM app1"
expect "a rerun over app1's once_internal.caller(int)" 42501 "$(install_into app)"
cluster_psql "$NAME" "$PORT" -q -d app -c "DROP FUNCTION once_internal.caller(int)"
expect "a rerun once they may not" none "$(install_into app)"
say "SQL edition: on a hot standby of it"
# A standby serves hits and says wait for a running key without judging its owner (a
# backend of the primary); whatever would write is refused with 25006 (protocol::standby).
# 'live' is claimed for a session that lives on the primary, which the standby's
# pg_stat_activity does not show: judged there, its owner would look gone.
rm -f "$work/owner"
as_user -c "SELECT once.owner_session()" -c "SELECT pg_sleep(5)" >"$work/owner" &
for _ in $(seq 50); do [ -s "$work/owner" ] && break; sleep 0.1; done
as_user -c "SELECT FROM once.claim_key('live', owner_pid => $(head -1 "$work/owner"))" >/dev/null
trap 'cluster_stop $NAME-standby; cluster_stop $NAME' EXIT
standby_start "$NAME-standby" $((PORT + 1)) "$PORT"   # a base backup: it has every row
on_standby() { "$PG_BIN/psql" -h "$PG_ONCE_WORK/$NAME-standby" -p $((PORT + 1)) -U app_user -d app -X -At -v ON_ERROR_STOP=1 "$@"; }
expect "a hit on the standby" "hit|1" "$(on_standby -c "SELECT outcome, result FROM once.claim_key('b/1')")"
expect "a running key on the standby" "wait" "$(on_standby -c "SELECT outcome FROM once.claim_key('live')")"
expect "a claim on the standby" "cannot execute once.claim_key() during recovery" \
    "$(on_standby -c "SELECT FROM once.claim_key('absent')" 2>&1 | sed -n 's/^ERROR:  //p')"
expect "complete_key on the standby" "25006: cannot execute once.complete_key() during recovery" \
    "$(on_standby -v VERBOSITY=verbose -c "SELECT once.complete_key('live', 1, '1')" 2>&1 | sed -n 's/^ERROR:  //p')"
expect "claim_next on the standby" "25006: cannot execute once.claim_next() during recovery" \
    "$(on_standby -v VERBOSITY=verbose -c "SELECT * FROM once.claim_next('jobs')" 2>&1 | sed -n 's/^ERROR:  //p')"
expect "enqueue_key on the standby" "25006: cannot execute once.enqueue_key() during recovery" \
    "$(on_standby -v VERBOSITY=verbose -c "SELECT once.enqueue_key('job/9', queue => 'jobs')" 2>&1 | sed -n 's/^ERROR:  //p')"
cluster_stop "$NAME-standby"
wait

say "SQL edition: the isolation specs (pg_test/isolation)"
# Every spec, as it is but for its CREATE EXTENSION line, against the extension's
# expected output.
iso=$PG_ONCE_WORK/$NAME-isolation
rm -rf "$iso"; mkdir -p "$iso/specs" "$iso/expected"
specs=$(cd "$REPO_ROOT/pg_test/isolation/specs" && ls *.spec | sed 's/\.spec$//')
for spec in $specs; do
    grep -v '^ *CREATE EXTENSION IF NOT EXISTS pg_once; *$' \
        "$REPO_ROOT/pg_test/isolation/specs/$spec.spec" >"$iso/specs/$spec.spec"
    cp "$REPO_ROOT/pg_test/isolation/expected/$spec.out" "$iso/expected/"
done
if ! "$(pgxs_test_program isolation pg_isolation_regress)" --bindir="$PG_BIN" \
        --inputdir="$iso" --outputdir="$iso/out" --host=127.0.0.1 --port="$PORT" \
        --user=admin --dbname=app --use-existing $specs; then
    cat "$iso/out/regression.diffs" >&2
    exit 1
fi
say "SQL edition: the extension's attack suite (pg_test/multi attacks.rs, sweep.rs), its claim decision's vectors"
# The same tests that attack the extension (test.sh step 4), against the edition: the
# harness installs the script as the owner (PG_ONCE_EDITION_SCRIPT) in a database of its
# own; the attacks a superuser's session must not carry out go through
# PG_ONCE_SUPERUSER_DSN. PG_ONCE_EDITION_ATTACKS=0 leaves them out (they build
# pg_test/multi, minutes on a fresh machine).
if [ "${PG_ONCE_EDITION_ATTACKS:-1}" = 0 ]; then
    say "SQL edition: the attack suite skipped (PG_ONCE_EDITION_ATTACKS=0)"
else
    cluster_psql "$NAME" "$PORT" -q -c "CREATE DATABASE attacks OWNER admin"
    (cd "$REPO_ROOT" &&
        export PG_ONCE_DSN="host=127.0.0.1 port=$PORT user=admin dbname=attacks" \
            PG_ONCE_SUPERUSER_DSN="host=127.0.0.1 port=$PORT user=postgres dbname=attacks" \
            PG_ONCE_EDITION_SCRIPT="$OUT/pg_once_sql.sql" &&
        cargo test -p pg_once_multi --quiet --test attacks --test sweep --test token_draws \
            --test claim_decision --test argument_rules --test held_rows &&
        cargo test -p pg_once_multi --quiet --test protocol --test table_locks \
            a_claim_without_wait_looks_again)
    say "SQL edition: an asynchronous failover (pg_test/multi failover.rs)"
    # The extension's test of tokens on a new timeline (test.sh step 4), against the
    # edition's next_token: a standby that misses the last WAL is promoted, and the
    # primary restarted as it was.
    trap 'cluster_stop $NAME-failover; cluster_stop $NAME' EXIT
    standby_start "$NAME-failover" $((PORT + 1)) "$PORT"
    (cd "$REPO_ROOT" &&
        PG_ONCE_DSN="host=127.0.0.1 port=$PORT user=admin dbname=attacks" \
        PG_ONCE_EDITION_SCRIPT="$OUT/pg_once_sql.sql" \
        PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$NAME/data \
        PG_ONCE_PROMOTE_DATA_DIR=$PG_ONCE_WORK/$NAME-failover/data \
        PG_ONCE_PROMOTE_DSN="host=127.0.0.1 port=$((PORT + 1)) user=admin dbname=attacks" \
        cargo test -p pg_once_multi --quiet --test failover)
    cluster_stop "$NAME-failover"
fi
say "SQL edition: all passed"
