#!/usr/bin/env bash
# How autovacuum keeps up with a busy queue: the figures of docs/operations.md,
# "Autovacuum". Run as root, after pg_once is installed:
#
#   bench/autovacuum.sh NAPTIME SECONDS      e.g. bench/autovacuum.sh 60s 180, then 10s 180
#
# A throwaway preloaded cluster on $PG_ONCE_TEST_PORT + 9 with autovacuum_naptime =
# NAPTIME: 10,000 keys in a queue, cycled for SECONDS (claim_next 100 at a time,
# complete_keys, and about 100 keys enqueued again with refresh per round). Every 5 s it
# prints once.entries' table and index bytes, its dead row versions and how many times
# autovacuum has run on it; at the end the same and the rows updated in all.
source "$(dirname "$0")/../scripts/lib.sh"
naptime=${1:?NAPTIME, e.g. 10s} seconds=${2:?SECONDS}
port=$((${PG_ONCE_TEST_PORT:-25432} + 9))
cluster_start bench-autovacuum "$port" "shared_preload_libraries = 'pg_once'" \
    "autovacuum_naptime = $naptime"
sampler=
trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null; cluster_stop bench-autovacuum' EXIT
q() { cluster_psql bench-autovacuum "$port" -q -At "$@"; }
q -c "CREATE EXTENSION pg_once" -c "SELECT once.create_queue('t')" >/dev/null
q -c "SELECT count(once.enqueue_key('img/' || i, '{\"w\": 128}', 't'))
        FROM generate_series(1, 10000) i" >/dev/null
stats="SELECT pg_table_size(relid), pg_indexes_size(relid), n_dead_tup, autovacuum_count
         FROM pg_stat_user_tables WHERE relid = 'once.entries'::regclass"
end=$((SECONDS + seconds))
echo "time|table_bytes|index_bytes|dead_rows|autovacuums"
(while [ $SECONDS -lt $end ]; do echo "$(date +%T)|$(q -c "$stats")"; sleep 5; done) &
sampler=$!
while [ $SECONDS -lt $end ]; do
    q -c "WITH c AS (SELECT * FROM once.claim_next('t', worker => 'w', n => 100))
          SELECT count(*) FROM once.complete_keys(
              ARRAY(SELECT key FROM c ORDER BY key), ARRAY(SELECT token FROM c ORDER BY key),
              ARRAY(SELECT '{\"url\": \"s3://thumbs\"}'::jsonb FROM c ORDER BY key))" >/dev/null
    q -c "SELECT count(once.enqueue_key('img/' || i, '{\"w\": 128}', 't', refresh => true))
            FROM generate_series(1, 10000) i WHERE random() < 0.01" >/dev/null
done
wait "$sampler"
sampler=
echo "end|$(q -c "$stats")|updated $(q -c "SELECT n_tup_upd FROM pg_stat_user_tables
                                          WHERE relid = 'once.entries'::regclass") rows"
