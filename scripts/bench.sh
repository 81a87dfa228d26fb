#!/usr/bin/env bash
# Benchmarks pg_once against its baselines with pgbench, on a throwaway cluster.
# Each pair of workloads runs alternately (A B A B ...), so both see the same machine
# state; the table reports median / min / max transactions per second and the ratio of
# the medians. Statements are prepared (-M prepared), as client libraries do.
# Two links: the local Unix socket (CPU-bound: what each call costs the server), and TCP
# through tools' latency_proxy adding RTT_US of round-trip time (what a pod sees).
# Settings: CLIENTS (8), SECONDS_PER_RUN (10), ROUNDS (3), RTT_US (500).
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_BENCH_PORT:-55434}
CLIENTS=${CLIENTS:-8}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
ROUNDS=${ROUNDS:-3}
RTT_US=${RTT_US:-500}
PROXY_PORT=$((PORT + 1))
SQL=$REPO_ROOT/bench/pgbench

ensure_toolchain
install_extension release
(cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin latency_proxy)
say "starting a throwaway cluster on 127.0.0.1:$PORT"
cluster_start bench "$PORT"
"$REPO_ROOT/target/release/latency_proxy" --listen "127.0.0.1:$PROXY_PORT" \
    --upstream "127.0.0.1:$PORT" --delay-us $((RTT_US / 2)) &
proxy=$!
trap 'kill $proxy; cluster_stop bench' EXIT
psql_bench() { cluster_psql bench "$PORT" -q "$@"; }
psql_bench -c "CREATE EXTENSION pg_once" -f "$SQL/handmade_setup.sql" -f "$SQL/hot_setup.sql" >/dev/null

# tps WORKLOAD: one pgbench run over $LINK, prints transactions per second.
LINK=socket
tps() {
    local target=(-h "$PG_ONCE_WORK/bench" -p "$PORT")
    [ "$LINK" = rtt ] && target=(-h 127.0.0.1 -p "$PROXY_PORT")
    "$PG_BIN/pgbench" "${target[@]}" -U postgres -n -M prepared -c "$CLIENTS" -j 2 \
        -T "$SECONDS_PER_RUN" -f "$SQL/$1.sql" postgres 2>&1 |
        sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

# stats "v1 v2 ...": median min max
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{a[NR]=$1} END {printf "%.0f %.0f %.0f", a[int((NR+1)/2)], a[1], a[NR]}'; }

# compare A B DESCRIPTION
compare() {
    local a=$1 b=$2 what=$3 runs_a="" runs_b=""
    for ((r = 1; r <= ROUNDS; r++)); do
        printf '\r  %-60s round %d/%d' "$what" "$r" "$ROUNDS" >&2
        runs_a+=" $(tps "$a")"
        runs_b+=" $(tps "$b")"
    done
    printf '\r%80s\r' '' >&2
    read -r ma mina maxa <<<"$(stats "$runs_a")"
    read -r mb minb maxb <<<"$(stats "$runs_b")"
    printf '| %-28s | %9s | %15s | %9s | %15s | %5.2fx |\n' "$what" "$ma" "$mina-$maxa" "$mb" "$minb-$maxb" \
        "$(awk -v a="$ma" -v b="$mb" 'BEGIN {print a / b}')"
}

table() {
    echo "| workload (A vs B)            |  A median |     A min-max   |  B median |     B min-max   | A / B  |"
    echo "|------------------------------|-----------|-----------------|-----------|-----------------|--------|"
    compare once_cycle handmade_cycle "claim+complete vs hand-made"
    compare once_hit pk_select "claim_key hit vs PK SELECT"
    compare once_hit select1 "claim_key hit vs SELECT 1"
}
say "pgbench: $CLIENTS clients, ${SECONDS_PER_RUN}s per run, $ROUNDS alternating rounds"
echo "Local Unix socket (server CPU is the limit):"
LINK=socket table
echo
echo "TCP with ${RTT_US} us added round-trip time (network is the limit):"
LINK=rtt table
echo "(transactions per second; one transaction = one claim+complete cycle or one lookup)"
