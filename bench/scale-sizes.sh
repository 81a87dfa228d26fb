#!/usr/bin/env bash
# Scale, per size: every per-call and per-scrape path of pg_once as once.entries grows
# (issue 25's table), on one throwaway cluster that is filled step by step.
#
#   bench/scale-sizes.sh            SIZES="1000 1000000 10000000" done keys
#
# At each size N (the table is filled up to N done keys, then VACUUM ANALYZE), one line of
# JSON with:
#   - hit_p50_ms, hit_p99_ms: claim_key of a random one of the N keys (a hit), pgbench,
#     CLIENTS connections for SECS s, latencies from pgbench's per-transaction log;
#   - cycle_p50_ms, cycle_p99_ms: claim_key + complete_key of a new key (two statements);
#   - queue_p50_ms, queue_p99_ms: claim_next(n => 10) + complete_keys of those 10, in one
#     statement, from a backlog of queued jobs;
#   - reap_ms: a reap_stale round with nothing to purge (median of 20), with HISTORY rows
#     of history (added at the last size only, HISTORY_ROWS);
#   - stats_ms, queue_stats_ms: a read of once.stats, once.queue_stats (median of 5);
#   - idle_claim_next_ms: claim_next(wait => 0) on a queue with nothing due: FUTURE_JOBS
#     jobs due tomorrow at the last size, none before;
#   - besides the N done keys the table holds BACKLOG (200,000) queued jobs for the queue
#     row, refilled at each size, and the keys the cycle row added;
#   - entries_mb, entries_indexes_mb, attempts_mb: sizes.
# Not preloaded: no worker reaps meanwhile. Uses the pg_once installed in PG_ONCE_PG_BIN's
# PostgreSQL (scripts/lib.sh's install_extension).
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"
SIZES=${SIZES:-"1000 1000000 10000000"}
SECS=${SECS:-10}
CLIENTS=${CLIENTS:-2}
HISTORY_ROWS=${HISTORY_ROWS:-20000000}
FUTURE_JOBS=${FUTURE_JOBS:-1000000}
BACKLOG=${BACKLOG:-200000}
PORT=${PG_ONCE_SCALE_PORT:-$((${PG_ONCE_TEST_PORT:-25400} + 6))}
NAME=scale-sizes
WORK=$PG_ONCE_WORK/$NAME-files
trap 'cluster_stop $NAME' EXIT
cluster_start $NAME "$PORT" "max_wal_size = 8GB" "checkpoint_timeout = 30min" >/dev/null
mkdir -p "$WORK" && chmod 777 "$WORK"
q() { cluster_psql $NAME "$PORT" -qAt "$@"; }
q -c "CREATE EXTENSION pg_once" -c "SELECT once.create_queue('qs'), once.create_queue('qf')" -c "
CREATE FUNCTION median_ms(sql text, rounds int) RETURNS numeric LANGUAGE plpgsql AS \$\$
DECLARE t timestamptz; ms float8[] := '{}';
BEGIN
    FOR i IN 1..rounds LOOP
        t := clock_timestamp();
        EXECUTE 'SELECT count(*) FROM (' || sql || ') s';
        ms := ms || extract(epoch FROM clock_timestamp() - t) * 1000;
    END LOOP;
    RETURN (SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY m)::numeric, 2) FROM unnest(ms) m);
END \$\$;" >/dev/null

cat >"$WORK/hit.sql" <<'EOF'
\set k random(1, :n)
SELECT outcome, result FROM once.claim_key('k' || :k);
EOF
cat >"$WORK/cycle.sql" <<'EOF'
\set k random(1, 4000000000000)
SELECT coalesce(token, 1) AS token FROM once.claim_key('cycle:' || :client_id || ':' || :k) \gset
SELECT once.complete_key('cycle:' || :client_id || ':' || :k, :token, '{"title": "page"}');
EOF
# The 10 jobs one call claims, completed by the same statement.
cat >"$WORK/queue.sql" <<'EOF'
WITH c AS MATERIALIZED (SELECT key, token FROM once.claim_next('qs', n => 10))
SELECT count(*) FROM once.complete_keys(coalesce((SELECT array_agg(key) FROM c), '{}'),
    coalesce((SELECT array_agg(token) FROM c), '{}'), coalesce((SELECT array_agg('1'::jsonb) FROM c), '{}'));
EOF

# latencies FILE...: p50 and p99 (ms) of pgbench per-transaction logs.
latencies() {
    cat "$@" | awk '{print $3 / 1000}' | sort -n | awk '{a[NR] = $1} END {printf "%.3f %.3f\n", a[int(NR * 0.5)], a[int(NR * 0.99)]}'
}
bench() { # bench SCRIPT [-D n=N]: p50 p99
    rm -f "$WORK"/log.*
    (cd "$WORK" && "$PG_BIN/pgbench" -h 127.0.0.1 -p "$PORT" -U postgres -n -M prepared -c "$CLIENTS" -j 2 \
        -T "$SECS" -l --log-prefix=log "${@:2}" -f "$WORK/$1" postgres >/dev/null 2>&1)
    latencies "$WORK"/log.*
}

filled=0
history=0
for size in $SIZES; do
    if [ "$size" -gt "$filled" ]; then
        q -c "INSERT INTO once.entries (key_hash, key, state, token, result, completed_at)
              SELECT once.key_hash('k' || i), 'k' || i, 'done', i, '{\"title\": \"page\"}', now()
                FROM generate_series($filled + 1, $size) i" >/dev/null
        filled=$size
    fi
    last=${SIZES##* }
    if [ "$size" = "$last" ] && [ "$HISTORY_ROWS" -gt 0 ]; then
        q -c "INSERT INTO once.attempts (key_hash, key, queue, token, worker, started_at, finished_at, outcome)
              SELECT once.key_hash('job-' || i), 'job-' || i, 'qs', i, 'w', f - interval '10 ms', f, 'completed'
                FROM generate_series(1, $HISTORY_ROWS) i,
                     LATERAL (SELECT now() - interval '1 hour' + i * interval '1 hour' / $HISTORY_ROWS AS f) x" >/dev/null
        history=$HISTORY_ROWS
    fi
    # A backlog for the queue (refilled at each size: BACKLOG jobs), and, at the last size,
    # FUTURE_JOBS jobs due tomorrow in a queue of their own.
    future=0
    [ "$size" = "$last" ] && future=$FUTURE_JOBS
    q -c "DELETE FROM once.entries WHERE queue IN ('qs', 'qf')" \
      -c "INSERT INTO once.entries (key_hash, key, state, token, queue, run_at, enqueued_at)
          SELECT once.key_hash('j' || i), 'j' || i, 'queued', i, 'qs', now(), now() FROM generate_series(1, $BACKLOG) i" \
      -c "INSERT INTO once.entries (key_hash, key, state, token, queue, priority, run_at, enqueued_at)
          SELECT once.key_hash('f' || i), 'f' || i, 'queued', i, 'qf', i % 3, now() + interval '1 day', now()
            FROM generate_series(1, $future) i" \
      -c "VACUUM ANALYZE once.entries" -c "VACUUM ANALYZE once.attempts" -c "CHECKPOINT" >/dev/null
    read -r hit50 hit99 < <(bench hit.sql -D n="$size")
    read -r cyc50 cyc99 < <(bench cycle.sql)
    read -r que50 que99 < <(bench queue.sql)
    reap=$(q -c "SELECT median_ms('SELECT * FROM once.reap_stale()', 20)")
    stats=$(q -c "SELECT median_ms('SELECT * FROM once.stats', 5)")
    qstats=$(q -c "SELECT median_ms('SELECT * FROM once.queue_stats', 5)")
    idle=$(q -c "SELECT median_ms('SELECT * FROM once.claim_next(''qf'')', 5)")
    sizes=$(q -F ' ' -c "SELECT pg_table_size('once.entries') / 1048576, pg_indexes_size('once.entries') / 1048576,
                                pg_total_relation_size('once.attempts') / 1048576")
    read -r emb imb amb <<<"$sizes"
    printf '{"keys":%s,"history":%s,"future_jobs":%s,"hit_p50_ms":%s,"hit_p99_ms":%s,"cycle_p50_ms":%s,"cycle_p99_ms":%s,"queue_p50_ms":%s,"queue_p99_ms":%s,"reap_ms":%s,"stats_ms":%s,"queue_stats_ms":%s,"idle_claim_next_ms":%s,"entries_mb":%s,"entries_indexes_mb":%s,"attempts_mb":%s}\n' \
        "$size" "$history" "$future" "$hit50" "$hit99" "$cyc50" "$cyc99" "$que50" "$que99" "$reap" "$stats" "$qstats" "$idle" "$emb" "$imb" "$amb"
done
