#!/usr/bin/env bash
# A long run against a database pre-filled to 10M keys (issue 25's "long run"): does
# anything pg_once keeps grow beyond the level autovacuum holds it at, and does any
# per-second or per-scrape path slow down as the hour goes by?
#
#   bench/soak-scale.sh             KEYS=10000000 MINUTES=60, sizes every minute
#
# One preloaded cluster (the pg_once worker reaps every second, once.history_retention
# = 5 minutes so that the history reaches its steady size within the run; autovacuum at
# PostgreSQL's defaults), filled with KEYS done keys, then, all at once for MINUTES:
#   - the invariant soak (tools' soak: 8 clients on 24 keys, connections killed now and
#     then, pg_once's guarantees checked throughout and at the end);
#   - a queue in steady state: 10,000 keys cycled by 4 workers through claim_next,
#     complete_key and enqueue_key(refresh) (the benchmark harness's `bloat`);
#   - traffic on the big table: pgbench at 200 transactions/s, each a hit on a random one
#     of the KEYS keys, and one in four also an invalidate + claim + complete of it, so
#     that the big table gets dead rows for autovacuum to clear.
# Every minute one JSON line (in $PG_ONCE_WORK/soak-scale.jsonl and on stdout): table and
# index sizes of once.entries, once.attempts and once_internal.key_counts, live and dead
# rows, autovacuum counts, and the time of a once.stats read, a once.queue_stats read and
# a reap_stale round with nothing to purge. Uses the pg_once installed in PG_ONCE_PG_BIN's
# PostgreSQL (scripts/lib.sh's install_extension release) and the release tools.
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"
KEYS=${KEYS:-10000000}
MINUTES=${MINUTES:-60}
PORT=${PG_ONCE_SOAK_PORT:-$((${PG_ONCE_TEST_PORT:-25400} + 7))}
NAME=soak-scale
WORK=$PG_ONCE_WORK/$NAME-files
OUT=$PG_ONCE_WORK/soak-scale.jsonl
DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"
BIN=$REPO_ROOT/target/release
trap 'kill $(jobs -p) 2>/dev/null; cluster_stop $NAME' EXIT
cluster_start $NAME "$PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres'" \
    "once.history_retention = '5min'" "max_wal_size = 2GB" >/dev/null
mkdir -p "$WORK" && chmod 777 "$WORK"
q() { cluster_psql $NAME "$PORT" -qAt "$@"; }
q -c "CREATE EXTENSION pg_once"
say "filling $KEYS done keys"
q -c "INSERT INTO once.entries (key_hash, key, state, token, result, completed_at)
      SELECT once.key_hash('k' || i), 'k' || i, 'done', i, '{\"title\": \"page\"}', now()
        FROM generate_series(1, $KEYS) i" \
  -c "SELECT setval('once_internal.token_seq', $KEYS + 1)" \
  -c "SELECT once_internal.recount_keys()" -c "VACUUM ANALYZE"

cat >"$WORK/traffic.sql" <<EOF
\set k random(1, $KEYS)
\set rewrite random(1, 4)
SELECT outcome FROM once.claim_key('k' || :k);
\if :rewrite = 1
SELECT once.invalidate_key('k' || :k);
SELECT coalesce(max(token), 0) AS token FROM once.claim_key('k' || :k) WHERE outcome = 'claimed' \gset
\if :token > 0
SELECT once.complete_key('k' || :k, :token, '{"title": "page again"}');
\endif
\endif
EOF
chmod 644 "$WORK/traffic.sql"

q -c "
CREATE FUNCTION elapsed_ms(sql text) RETURNS numeric LANGUAGE plpgsql AS \$\$
DECLARE t timestamptz := clock_timestamp();
BEGIN
    EXECUTE 'SELECT count(*) FROM (' || sql || ') s';
    RETURN round(extract(epoch FROM clock_timestamp() - t)::numeric * 1000, 2);
END \$\$"
ms() { q -c "SELECT elapsed_ms(\$\$$1\$\$)"; }
sample() {
    local minute=$1
    q -c "SELECT json_build_object(
        'minute', $minute,
        'entries_heap', pg_relation_size('once.entries'),
        'entries_indexes', (SELECT json_object_agg(indexrelid::regclass::text, pg_relation_size(indexrelid))
                              FROM pg_index WHERE indrelid = 'once.entries'::regclass),
        'entries_live', (SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = 'once.entries'::regclass),
        'entries_dead', (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'once.entries'::regclass),
        'entries_autovacuums', (SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = 'once.entries'::regclass),
        'attempts_total', pg_total_relation_size('once.attempts'),
        'attempts_rows', (SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = 'once.attempts'::regclass),
        'key_counts_heap', pg_relation_size('once_internal.key_counts'),
        'key_counts_total', pg_total_relation_size('once_internal.key_counts'),
        'key_counts_dead', (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'once_internal.key_counts'::regclass),
        'key_counts_hot', (SELECT round(n_tup_hot_upd::numeric / greatest(n_tup_upd, 1), 3) FROM pg_stat_user_tables WHERE relid = 'once_internal.key_counts'::regclass),
        'key_counts_rows', (SELECT count(*) FROM once_internal.key_counts),
        'stats_ms', $(ms "SELECT * FROM once.stats"),
        'queue_stats_ms', $(ms "SELECT * FROM once.queue_stats"),
        'reap_ms', $(ms "SELECT * FROM once.reap_stale()"))" | tee -a "$OUT"
}

: >"$OUT"
say "running for $MINUTES minutes"
seconds=$((MINUTES * 60))
"$BIN/soak" --dsn "$DSN" --clients 8 --keys 24 --seconds "$seconds" >"$WORK/soak.log" 2>&1 &
soak=$!
"$BIN/bench" --dsn "$DSN" bloat --keys 10000 --cycles 1000000000 --workers 4 >"$WORK/bloat.log" 2>&1 &
pg_server pgbench -n -h 127.0.0.1 -p "$PORT" -U postgres -c 2 -j 1 -R 200 -T "$seconds" \
    -f "$WORK/traffic.sql" postgres >"$WORK/pgbench.log" 2>&1 &
for ((m = 0; m <= MINUTES; m++)); do
    sample "$m"
    [ "$m" -lt "$MINUTES" ] && sleep 60
done
wait "$soak" && soak_result=passed || soak_result=FAILED
tail -5 "$WORK/soak.log"
tail -8 "$WORK/pgbench.log"
say "invariant soak: $soak_result; samples in $OUT"
