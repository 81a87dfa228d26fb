#!/usr/bin/env bash
# How much disk pg_once's tables take per key: the figures of docs/operations.md, "Table
# growth". Run as root, after pg_once is installed (e.g. by scripts/test.sh or demo.sh):
#
#   bench/sizing.sh [KEYS] [JOBS]      (defaults: 1000000 cached keys, 100000 queue jobs)
#
# A throwaway preloaded cluster on $PG_ONCE_TEST_PORT + 8 gets, in database sizing_cache,
# KEYS keys claimed and completed (URL-like keys, a ~190-byte jsonb result, ttl 1 hour),
# in batches of 10,000 keys per transaction; and in database sizing_queue, JOBS jobs
# enqueued, claimed 100 at a time with claim_next and completed with complete_keys. It
# prints each table's size as the run left it (autovacuum running as configured) and
# compacted (VACUUM FULL), per key, and what a read of once.stats and once.queue_stats
# costs.
source "$(dirname "$0")/../scripts/lib.sh"
keys=${1:-1000000} jobs=${2:-100000}
port=$((${PG_ONCE_TEST_PORT:-25432} + 8))
ensure_toolchain
cluster_start bench-sizing "$port" "shared_preload_libraries = 'pg_once'" \
    "once.databases = 'sizing_cache, sizing_queue'"
trap 'cluster_stop bench-sizing' EXIT
q() { cluster_psql bench-sizing "$port" -q "$@"; }
q -c "CREATE DATABASE sizing_cache" -c "CREATE DATABASE sizing_queue"
q -d sizing_cache -c "CREATE EXTENSION pg_once"
q -d sizing_queue -c "CREATE EXTENSION pg_once" -c "SELECT once.create_queue('thumbnails')" >/dev/null

say "sizing: $keys cached keys"
for ((s = 1; s <= keys; s += 10000)); do
    q -d sizing_cache -c "
        SELECT count(*) FILTER (WHERE once.complete_key(k, (once.claim_key(k)).token,
                   jsonb_build_object('title', 'Item ' || i, 'url', k, 'status', 200,
                                      'body', repeat('x', 120)), ttl => '1 hour'))
          FROM (SELECT i, 'https://example.com/items/' || i AS k
                  FROM generate_series($s, least($s + 9999, $keys)) i) s" >/dev/null
done

say "sizing: $jobs queue jobs"
for ((s = 1; s <= jobs; s += 10000)); do
    q -d sizing_queue -c "
        SELECT count(once.enqueue_key('img/' || i,
                   jsonb_build_object('w', 128, 'src', 's3://bucket/originals/' || i || '.jpg'),
                   'thumbnails'))
          FROM generate_series($s, least($s + 9999, $jobs)) i" >/dev/null
done
while [ "$(q -d sizing_queue -At -c "
        WITH c AS (SELECT * FROM once.claim_next('thumbnails', worker => 'w1', n => 100))
        SELECT count(*) FROM once.complete_keys(
                   ARRAY(SELECT key FROM c ORDER BY key), ARRAY(SELECT token FROM c ORDER BY key),
                   ARRAY(SELECT jsonb_build_object('url', 's3://bucket/thumbs/' || key || '.jpg')
                           FROM c ORDER BY key))")" != 0 ]; do :; done

sizes="SELECT current_database() AS db, c.relname,
              (SELECT count(*) FROM once.entries) AS keys,
              pg_table_size(c.oid) AS table_bytes, pg_indexes_size(c.oid) AS index_bytes,
              round(pg_table_size(c.oid)::numeric / greatest(count_rows, 1)) AS table_per_row,
              round(pg_indexes_size(c.oid)::numeric / greatest(count_rows, 1)) AS index_per_row
         FROM pg_class c,
              LATERAL (SELECT CASE c.relname WHEN 'entries' THEN (SELECT count(*) FROM once.entries)
                                             ELSE (SELECT count(*) FROM once.attempts) END
                       AS count_rows) n
        WHERE c.relnamespace = 'once'::regnamespace AND c.relname IN ('entries', 'attempts')
          AND n.count_rows > 0
        ORDER BY 2"
for db in sizing_cache sizing_queue; do
    say "$db: as the run left it"
    q -d "$db" -c "$sizes"
    q -d "$db" -c "SELECT avg(pg_column_size(e.*))::int AS row_bytes,
                          avg(pg_column_size(key))::int AS key_bytes,
                          avg(pg_column_size(result))::int AS result_bytes FROM once.entries e"
    q -d "$db" -c "VACUUM FULL once.entries" -c "VACUUM FULL once.attempts"
    say "$db: compacted (VACUUM FULL)"
    q -d "$db" -c "$sizes"
done
# What a monitoring read costs: both views scan once.entries.
for view in stats queue_stats; do
    say "a read of once.$view, $keys keys"
    q -d sizing_cache -c "EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON) SELECT * FROM once.$view" |
        grep -E 'Execution Time'
done
