#!/usr/bin/env bash
# Where a hot path's server time goes: runs one workload against a throwaway preloaded
# cluster, samples every process of the cluster with perf (DWARF call graphs, so frames of
# PostgreSQL built without frame pointers unwind too), and writes a flame graph and the
# folded stacks to bench/profiles/<workload>.svg and .folded, plus a table of the frames
# that take the most time (inclusive), which the closing notes of performance work cite.
# The folded stacks (a few MB) stay in $PG_ONCE_WORK; the flame graphs are committed.
#
#   scripts/profile.sh hit|pk_select|cycle|handmade_cycle|queue|plain_queue [seconds]
#
# hit, pk_select, cycle and handmade_cycle are bench/pgbench's once_hit, pk_select,
# once_cycle and handmade_cycle with 8 clients; queue and plain_queue are the benchmark
# harness's queue (4 workers, 10 jobs per claim) on pg_once and on a plain SKIP LOCKED
# table. The extension is built with line tables so that perf names Rust frames. Compare a
# workload with its baseline (hit with pk_select, cycle with handmade_cycle): the flame
# graphs share PostgreSQL's frames, and what only one side has is what it costs more.
source "$(dirname "$0")/lib.sh"
WORKLOAD=${1:?"usage: $0 hit|pk_select|cycle|handmade_cycle|queue|plain_queue [seconds]"}
SECONDS_SAMPLED=${2:-5}
PORT=${PG_ONCE_PROFILE_PORT:-25560}
OUT=$REPO_ROOT/bench/profiles
SQL=$REPO_ROOT/bench/pgbench

ensure_toolchain
command -v perf >/dev/null || {
    say "installing perf"
    apt-get install -y -q linux-perf >/dev/null
}
command -v inferno-flamegraph >/dev/null || {
    say "installing inferno (flame graphs)"
    cargo install --quiet --locked inferno
}
export CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
install_extension release
if [[ $WORKLOAD == *queue ]]; then
    (cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin bench)
fi
cluster_start profile "$PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres'"
trap 'cluster_stop profile' EXIT
cluster_psql profile "$PORT" -q -c "CREATE EXTENSION pg_once" \
    -f "$SQL/handmade_setup.sql" -f "$SQL/hot_setup.sql" >/dev/null
DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"

# The load runs 3 s longer on each side than the sampling, so that perf sees it steady.
case $WORKLOAD in
hit | pk_select | cycle | handmade_cycle)
    file=$WORKLOAD
    [ "$WORKLOAD" = hit ] && file=once_hit
    [ "$WORKLOAD" = cycle ] && file=once_cycle
    "$PG_BIN/pgbench" -h "$PG_ONCE_WORK/profile" -p "$PORT" -U postgres -n -M prepared -c 8 -j 2 \
        -T $((SECONDS_SAMPLED + 6)) -f "$SQL/$file.sql" postgres >"$PG_ONCE_WORK/profile.load" 2>&1 &
    warmup=3
    ;;
queue | plain_queue)
    with=once
    [ "$WORKLOAD" = plain_queue ] && with=plain
    # The harness first fills the queue (for as long as the run is meant to last, which
    # takes a while) and vacuums it: sample only once its workers are at work.
    "${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/bench" --dsn "$DSN" --rounds 1 queue \
        --with "$with" --workers 4 --batch 10 --seconds $((SECONDS_SAMPLED + 10)) \
        >"$PG_ONCE_WORK/profile.load" 2>&1 &
    for ((i = 0; i < 600; i++)); do
        working=$(cluster_psql profile "$PORT" -Atc "SELECT count(*) FROM pg_stat_activity
            WHERE query LIKE '%claim_next%' OR query LIKE '%SKIP LOCKED%'")
        [ "$working" -gt 1 ] && break
        sleep 0.2
    done
    warmup=3
    ;;
*)
    echo "unknown workload $WORKLOAD" >&2
    exit 2
    ;;
esac
load=$!
sleep "$warmup"
mkdir -p "$OUT"
postmaster=$(head -1 "$PG_ONCE_WORK/profile/data/postmaster.pid")
say "sampling the cluster's processes for $SECONDS_SAMPLED s"
perf record -q -F 499 --call-graph dwarf,16384 -o "$PG_ONCE_WORK/profile.data" \
    -p "$(pgrep -d, -P "$postmaster"),$postmaster" -- sleep "$SECONDS_SAMPLED" 2>/dev/null
wait "$load"
tail -3 "$PG_ONCE_WORK/profile.load"
folded=$PG_ONCE_WORK/profile-$WORKLOAD.folded
perf script -i "$PG_ONCE_WORK/profile.data" 2>/dev/null | inferno-collapse-perf >"$folded"
inferno-flamegraph --title "pg_once: $WORKLOAD (server processes)" <"$folded" >"$OUT/$WORKLOAD.svg"
say "wrote $OUT/$WORKLOAD.svg; frames with the most server time (inclusive):"
python3 - "$folded" <<'PY'
import collections, sys
total, inclusive = 0, collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1)
    n = int(n)
    total += n
    # Rust's generic glue (closures, catch_unwind, pgrx's guards) repeats every frame
    # above it; the named functions say where the time goes.
    for frame in set(f for f in stack.split(";") if "<" not in f and "{" not in f):
        inclusive[frame] += n
for frame, n in inclusive.most_common(60):
    if n < total * 0.01:
        break
    print(f"{100 * n / total:5.1f}%  {frame[:110]}")
PY
