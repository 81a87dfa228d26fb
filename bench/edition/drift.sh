#!/usr/bin/env bash
# bench/edition/drift.sh: does the SQL edition's cycle rate stay flat over a long run?
# (issue 28: a per-call path must not slow down with history.) One throwaway cluster with
# the edition installed by a non-superuser owner (as edition.sh), then pgbench
# bench/pgbench/once_cycle.sql at CLIENTS (8) clients for SECONDS (120), progress every
# 5 s, while once_internal.key_counts' live and dead rows and heap size are sampled every
# 5 s. Prints the per-5-s rates, the samples, and first vs last 20 s.
#   PG_ONCE_WORK=/var/tmp/edbench PG_ONCE_BENCH_PORT=28330 \
#   PG_ONCE_PG_BIN=/opt/pg-node/usr/lib/postgresql/15/bin nice -n 10 bench/edition/drift.sh
set -euo pipefail
PG_MAJOR=15
source "$(dirname "$0")/../../scripts/lib.sh"
PORT=${PG_ONCE_BENCH_PORT:-28330}
CLIENTS=${CLIENTS:-8}
SECONDS_RUN=${SECONDS:-120}
SQL=$REPO_ROOT/bench/pgbench
mkdir -p "$PG_ONCE_WORK"; chown postgres "$PG_ONCE_WORK"
BUILD=$PG_ONCE_WORK/drift-build
"$REPO_ROOT/scripts/sql-edition.sh" "$BUILD" >/dev/null
chmod -R a+rX "$BUILD"
trap 'cluster_stop edbench-drift' EXIT
cluster_start edbench-drift "$PORT"
cluster_psql edbench-drift "$PORT" -q -c "CREATE ROLE admin LOGIN CREATEROLE IN ROLE pg_read_all_stats, pg_signal_backend" \
    -c "CREATE ROLE bench_app LOGIN" -c "CREATE DATABASE app OWNER admin"
"$PG_BIN/psql" -h "$PG_ONCE_WORK/edbench-drift" -p "$PORT" -U admin -d app -X -q -v ON_ERROR_STOP=1 \
    -f "$BUILD/pg_once_sql.sql" -c "GRANT USAGE ON SCHEMA once TO bench_app; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO bench_app;" >/dev/null
sample() {
    cluster_psql edbench-drift "$PORT" -d app -Atc "SELECT now()::time(0), n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd,
        pg_relation_size('once_internal.key_counts'), pg_relation_size('once_internal.key_counts_pkey'),
        (SELECT count(*) FROM once_internal.key_counts)
        FROM pg_stat_user_tables WHERE relid = 'once_internal.key_counts'::regclass"
}
log=$PG_ONCE_WORK/drift-pgbench.log
"$PG_BIN/pgbench" -h "$PG_ONCE_WORK/edbench-drift" -p "$PORT" -U bench_app -n -M prepared \
    -c "$CLIENTS" -j 2 -T "$SECONDS_RUN" -P 5 -f "$SQL/once_cycle.sql" app >"$log" 2>&1 &
bench=$!
echo "time|live|dead|upd|hot_upd|heap_bytes|pkey_bytes|rows"
while kill -0 $bench 2>/dev/null; do sample; sleep 5; done
wait $bench
grep '^progress' "$log" | awk '{print $2, $4}' | tr '\n' ';'; echo
grep '^progress' "$log" | awk '{t=$2+0; r=$4+0; if (t<=20) {a+=r; na++} if (t>'"$SECONDS_RUN"'-20) {b+=r; nb++}}
    END {printf "first 20 s: %.0f cycles/s, last 20 s: %.0f cycles/s\n", a/na, b/nb}'
cluster_psql edbench-drift "$PORT" -d app -c "EXPLAIN (ANALYZE, BUFFERS) SELECT c.ctid FROM once_internal.key_counts c WHERE c.slot < -1 FOR UPDATE SKIP LOCKED"
