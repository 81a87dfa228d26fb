#!/usr/bin/env bash
# Scale: the background paths against a large once.attempts history (issue 25).
#
#   bench/scale.sh        HISTORY_ROWS (2,000,000) rows of history, on a throwaway cluster
#
# Prints, for an empty history and for HISTORY_ROWS rows:
#   - a reap_stale round with nothing to purge (every row younger than the retention):
#     median and max of ROUNDS (20) calls, in ms;
#   - the purge: the same number of rows, all past the retention, deleted by reap_stale
#     calls of their own transaction each, as the worker makes them: rows per call (the
#     worker makes one call per once.reaper_naptime, 1 s by default), and rows/s while
#     the calls run back to back.
# The cluster is not preloaded: no worker reaps meanwhile. Uses the pg_once installed in
# PG_ONCE_PG_BIN's PostgreSQL (scripts/lib.sh's install_extension).
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"
HISTORY_ROWS=${HISTORY_ROWS:-2000000}
ROUNDS=${ROUNDS:-20}
PORT=${PG_ONCE_SCALE_PORT:-$((${PG_ONCE_TEST_PORT:-25400} + 5))}
NAME=scale-bench
trap 'cluster_stop $NAME' EXIT
cluster_start $NAME "$PORT" >/dev/null
q() { cluster_psql $NAME "$PORT" -qAt "$@"; }
q -c "CREATE EXTENSION pg_once" -c "SET client_min_messages = warning" -c "
CREATE FUNCTION reap_round_ms(rounds int, OUT median float8, OUT worst float8) LANGUAGE plpgsql AS \$\$
DECLARE t timestamptz; ms float8[] := '{}';
BEGIN
    FOR i IN 1..rounds LOOP
        t := clock_timestamp();
        PERFORM * FROM once.reap_stale();
        ms := ms || extract(epoch FROM clock_timestamp() - t) * 1000;
    END LOOP;
    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY m), max(m) INTO median, worst FROM unnest(ms) m;
END \$\$;
CREATE PROCEDURE purge_all(INOUT rows bigint, INOUT calls int, INOUT secs float8) LANGUAGE plpgsql AS \$\$
DECLARE t timestamptz := clock_timestamp(); n bigint;
BEGIN
    rows := 0; calls := 0;
    LOOP
        SELECT history INTO n FROM once.reap_stale();
        COMMIT;
        EXIT WHEN n = 0;
        rows := rows + n; calls := calls + 1;
    END LOOP;
    secs := extract(epoch FROM clock_timestamp() - t);
END \$\$;"

fill() { # fill AGE: HISTORY_ROWS rows that finished over the hour before now() - AGE
    q -c "TRUNCATE once.attempts" -c "
INSERT INTO once.attempts (key_hash, key, queue, token, worker, started_at, finished_at, outcome)
SELECT once.key_hash('job-' || i), 'job-' || i, 'default', i, 'w', f - interval '10 ms', f, 'completed'
  FROM generate_series(1, $HISTORY_ROWS) i,
       LATERAL (SELECT now() - interval '$1' - interval '1 hour' + i * interval '1 hour' / $HISTORY_ROWS AS f) x" \
      -c "VACUUM ANALYZE once.attempts"
}
round() { q -F ' ' -c "SELECT round(median::numeric, 2), round(worst::numeric, 2) FROM reap_round_ms($ROUNDS)"; }

echo "reap_stale round, nothing to purge, empty history (median, max ms): $(round)"
fill '0'
echo "reap_stale round, nothing to purge, $HISTORY_ROWS history rows (median, max ms): $(round)"
echo "sizes: $(q -c "SELECT pg_size_pretty(pg_table_size('once.attempts')) || ' table, ' || pg_size_pretty(pg_indexes_size('once.attempts')) || ' indexes'")"
fill '8 days'
echo "purge of $HISTORY_ROWS rows past retention (rows, calls, rows per call, s, rows/s): $(q -F ' ' -c "CALL purge_all(0, 0, 0)" | awk '{printf "%d %d %.0f %.1f %.0f", $1, $2, $1 / $2, $3, $1 / $3}')"

# Monitoring: once.queue_stats and once.stats over KEYS (1,000,000) done keys in two queues,
# plus 1,000 queued (half due tomorrow), 100 running and 100 failed: median of 5 reads, in
# ms, against the view once.queue_stats had before issue 25 (a join of once.entries on the
# queue, kept here as a query) in the same run.
KEYS=${KEYS:-1000000}
q -o /dev/null -c "TRUNCATE once.attempts" -c "SELECT once.create_queue('qa'), once.create_queue('qb')" -c "
INSERT INTO once.entries (key_hash, key, state, token, result, queue, run_at, owner, owner_pid, lease_expires_at, claimed_at)
SELECT once.key_hash('k' || i), 'k' || i, s::once.key_state, i, CASE WHEN s = 'done' THEN '1'::jsonb END,
       CASE WHEN i % 2 = 0 THEN 'qa' ELSE 'qb' END,
       CASE WHEN s = 'queued' AND i % 4 < 2 THEN now() + interval '1 day' ELSE now() END,
       CASE WHEN s = 'running' THEN 'w' END, CASE WHEN s = 'running' THEN 1 END,
       CASE WHEN s = 'running' THEN now() + interval '1 hour' END, CASE WHEN s = 'running' THEN now() END
  FROM generate_series(1, $KEYS + 1200) i,
       LATERAL (SELECT CASE WHEN i <= 1000 THEN 'queued' WHEN i <= 1100 THEN 'running'
                            WHEN i <= 1200 THEN 'failed' ELSE 'done' END AS s) x" -c "VACUUM ANALYZE once.entries"
time_ms() { # time_ms SQL: median of 5 runs in ms
    q -c "DO \$\$ DECLARE t timestamptz; ms float8[] := '{}'; BEGIN
        FOR i IN 1..5 LOOP t := clock_timestamp(); PERFORM * FROM ($1) s; ms := ms || extract(epoch FROM clock_timestamp() - t) * 1000; END LOOP;
        RAISE NOTICE '%', (SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY m)::numeric, 1) FROM unnest(ms) m); END \$\$" 2>&1 | grep -o '[0-9.]*$'
}
old_queue_stats="SELECT q.name AS queue,
       count(e.key) FILTER (WHERE e.state = 'queued') AS depth,
       count(e.key) FILTER (WHERE e.state = 'queued' AND e.run_at <= clock_timestamp()) AS due,
       count(e.key) FILTER (WHERE e.state = 'running') AS running,
       count(e.key) FILTER (WHERE e.state = 'failed') AS dead
  FROM once.queues q LEFT JOIN once.entries e ON e.queue = q.name AND once_internal.may_use_key(e.key)
 WHERE q.namespace IS NULL OR once_internal.may_use_key(q.namespace) GROUP BY q.name"
echo "once.queue_stats at $KEYS done keys (ms): $(time_ms 'SELECT * FROM once.queue_stats'); the view before issue 25: $(time_ms "$old_queue_stats")"
echo "once.stats at $KEYS done keys (ms): $(time_ms 'SELECT * FROM once.stats')"

# The queue: FUTURE_JOBS (200,000) jobs due tomorrow in queue qf (priorities 0 to 2), and
# none due: claim_next(wait => 0), which finds nothing, and the look an idle claim_next
# takes at when the next job is due; next to the statements as they were before issue 25
# (run as queries, their row locking and all), in the same run. Median of 5, ms.
FUTURE_JOBS=${FUTURE_JOBS:-200000}
q -o /dev/null -c "SELECT once.create_queue('qf')" -c "
INSERT INTO once.entries (key_hash, key, state, token, queue, priority, run_at, enqueued_at)
SELECT once.key_hash('f' || i), 'f' || i, 'queued', i, 'qf', i % 3, now() + interval '1 day' + i * interval '1 ms', now()
  FROM generate_series(1, $FUTURE_JOBS) i" -c "VACUUM ANALYZE once.entries"
echo "claim_next(wait => 0) with $FUTURE_JOBS jobs not due (ms): $(time_ms "SELECT * FROM once.claim_next('qf')"); its scan before issue 25: $(time_ms "SELECT ctid FROM once.entries WHERE state = 'queued' AND queue = 'qf' AND run_at <= clock_timestamp() ORDER BY errors, priority, run_at LIMIT 1 FOR UPDATE SKIP LOCKED")"
echo "next due time of the queue (ms): $(time_ms "WITH RECURSIVE firsts AS (
         (SELECT errors, priority, run_at FROM once.entries WHERE state = 'queued' AND queue = 'qf' ORDER BY errors, priority, run_at LIMIT 1)
         UNION ALL
         SELECT n.errors, n.priority, n.run_at FROM firsts f,
                LATERAL (SELECT errors, priority, run_at FROM once.entries WHERE state = 'queued' AND queue = 'qf'
                            AND (errors, priority) > (f.errors, f.priority) ORDER BY errors, priority, run_at LIMIT 1) n)
     SELECT min(run_at) FROM firsts"); before issue 25: $(time_ms "SELECT min(run_at) FROM once.entries WHERE state = 'queued' AND queue = 'qf'")"
