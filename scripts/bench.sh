#!/usr/bin/env bash
# Benchmarks pg_once against its baselines, on throwaway clusters, and prints markdown.
#
#   1. claim+complete cycles and hits, with pgbench, against the hand-made protocol, a
#      primary-key SELECT and SELECT 1: over the local socket (server CPU is the limit)
#      and over TCP through tools' latency_proxy adding RTT_US of round trip (a pod).
#   2. a stampede: 200 callers on one cold key, the owner computing for 500 ms: how many
#      computations, and how long after the result was sent each caller had it.
#   3. takeover: time until a killed owner's key is claimed by a waiting caller.
#   4. complete commits/s with 100 LISTEN connections on channel once, by once.notify.
#
# Comparisons run alternately (A B A B ...) so both sides see the same machine state;
# figures are the median and the range over ROUNDS. Settings: CLIENTS (8),
# SECONDS_PER_RUN (10), ROUNDS (3), RTT_US (500).
source "$(dirname "$0")/lib.sh"
PORT=${PG_ONCE_BENCH_PORT:-55434}
PLAIN_PORT=$((PORT + 1))
PROXY_PORT=$((PORT + 2))
CLIENTS=${CLIENTS:-8}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
ROUNDS=${ROUNDS:-3}
RTT_US=${RTT_US:-500}
SQL=$REPO_ROOT/bench/pgbench
BIN=$REPO_ROOT/target/release

ensure_toolchain
install_extension release
say "building the benchmark tools"
(cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin bench --bin latency_proxy)
say "starting throwaway clusters on 127.0.0.1:$PORT (preloaded) and :$PLAIN_PORT (not)"
cluster_start bench "$PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres'"
cluster_start bench-plain "$PLAIN_PORT"
"$BIN/latency_proxy" --listen "127.0.0.1:$PROXY_PORT" --upstream "127.0.0.1:$PORT" \
    --delay-us $((RTT_US / 2)) &
proxy=$!
trap 'kill $proxy 2>/dev/null; cluster_stop bench; cluster_stop bench-plain' EXIT
cluster_psql bench "$PORT" -q -c "CREATE EXTENSION pg_once" \
    -f "$SQL/handmade_setup.sql" -f "$SQL/hot_setup.sql" >/dev/null
cluster_psql bench-plain "$PLAIN_PORT" -q -c "CREATE EXTENSION pg_once" >/dev/null
DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"
PLAIN_DSN="host=127.0.0.1 port=$PLAIN_PORT user=postgres dbname=postgres"

# tps WORKLOAD [LINK]: one pgbench run (LINK socket or rtt); prints transactions/s.
tps() {
    local target=(-h "$PG_ONCE_WORK/bench" -p "$PORT")
    [ "${2:-socket}" = rtt ] && target=(-h 127.0.0.1 -p "$PROXY_PORT")
    "$PG_BIN/pgbench" "${target[@]}" -U postgres -n -M prepared -c "$CLIENTS" -j 2 \
        -T "$SECONDS_PER_RUN" -f "$SQL/$1.sql" postgres 2>&1 |
        sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

# stats "v1 v2 ...": median min max
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{a[NR]=$1} END {printf "%.0f %.0f %.0f", a[int((NR+1)/2)], a[1], a[NR]}'; }

# row LABEL RUNS_A RUNS_B: a markdown row comparing two series of tps figures.
row() {
    local ma mina maxa mb minb maxb
    read -r ma mina maxa <<<"$(stats "$2")"
    read -r mb minb maxb <<<"$(stats "$3")"
    printf '| %s | %s (%s-%s) | %s (%s-%s) | %.2fx |\n' "$1" "$ma" "$mina" "$maxa" "$mb" "$minb" \
        "$maxb" "$(awk -v a="$ma" -v b="$mb" 'BEGIN {print a / b}')"
}

# compare A B LABEL [LINK]
compare() {
    local runs_a="" runs_b=""
    for ((r = 1; r <= ROUNDS; r++)); do
        printf '\r  %-50s round %d/%d ' "$3" "$r" "$ROUNDS" >&2
        runs_a+=" $(tps "$1" "${4:-socket}")"
        runs_b+=" $(tps "$2" "${4:-socket}")"
    done
    printf '\r%70s\r' '' >&2
    row "$3" "$runs_a" "$runs_b"
}

harness() { "$BIN/bench" --rounds "${HARNESS_ROUNDS:-$ROUNDS}" "$@"; }

say "1/4 pgbench: claim+complete cycles and hits"
echo "### 1. Cycles and hits (pgbench, $CLIENTS clients, prepared, ${SECONDS_PER_RUN} s runs)"
echo
echo "| A vs B | A tx/s | B tx/s | A / B |"
echo "|---|---|---|---|"
compare once_cycle handmade_cycle "claim+complete vs hand-made, local socket"
compare once_hit pk_select "claim_key hit vs primary-key SELECT, local socket"
compare once_hit select1 "claim_key hit vs SELECT 1, local socket"
compare once_cycle handmade_cycle "claim+complete vs hand-made, ${RTT_US} us RTT" rtt
compare once_hit pk_select "claim_key hit vs primary-key SELECT, ${RTT_US} us RTT" rtt
echo

say "2/4 stampede: many callers on one cold key"
echo "### 2. Stampede: 200 callers on one cold key, 500 ms computation"
echo
echo "Milliseconds (server clock) from the owner's complete_key to each other caller's answer."
echo
echo "| how callers wait | computations | p50 ms | p99 ms | max ms |"
echo "|---|---|---|---|---|"
harness --dsn "$DSN" --label "20 callers, claim_key(wait), preloaded: woken" stampede --strategy server --callers 20
harness --dsn "$PLAIN_DSN" --label "20 callers, claim_key(wait), not preloaded: polls every 20 ms" stampede --strategy server --callers 20
harness --dsn "$DSN" --label "claim_key(wait), preloaded: woken" stampede --strategy server
harness --dsn "$PLAIN_DSN" --label "claim_key(wait), not preloaded: polls every 20 ms" stampede --strategy server
harness --dsn "$DSN" --label "LISTEN first, preloaded: relayed NOTIFY" stampede --strategy listen
harness --dsn "$PLAIN_DSN" --label "LISTEN first, not preloaded: direct NOTIFY" stampede --strategy listen
harness --dsn "$DSN" --label "retry claim_key every 100 ms" stampede --strategy poll100
harness --dsn "$DSN" --label "retry claim_key every 1 s" stampede --strategy poll1000
echo

say "3/4 takeover after a killed owner"
echo "### 3. Takeover: ms from pg_terminate_backend of the owner to a waiter holding the claim"
echo
echo "| design | takeover ms |"
echo "|---|---|"
harness --dsn "$DSN" --label "pg_once preloaded (30 s lease)" takeover
harness --dsn "$PLAIN_DSN" --label "pg_once not preloaded (30 s lease)" takeover
HARNESS_ROUNDS=1 harness --dsn "$DSN" --label "lease only, 5 s lease (once.backend_liveness = off)" takeover --lease-s 5 --lease-only
echo

say "4/4 complete commits with 100 listeners, by once.notify"
echo "### 4. claim+complete cycles/s with 100 LISTEN connections on channel once"
echo
echo "Idle listeners LISTEN and then never read (the server still delivers to their sockets);"
echo "reading listeners receive every notification, on this same machine."
echo
echo "| listeners | once.notify | tx/s | vs off |"
echo "|---|---|---|---|"
# listeners_table idle|reading
listeners_table() {
    local flag=() runs_off="" runs_relay="" runs_direct=""
    [ "$1" = idle ] && flag=(--idle)
    for ((r = 1; r <= ROUNDS; r++)); do
        for mode in off relay direct; do
            printf '\r  %s listeners, %s, round %d/%d ' "$1" "$mode" "$r" "$ROUNDS" >&2
            # Fresh listeners for every run, so idle ones start with empty socket buffers.
            exec 3> >("$BIN/bench" --dsn "$DSN" listeners --count 100 "${flag[@]}" >/dev/null 2>&1)
            sleep 3
            local t
            t=$(PGOPTIONS="-c once.notify=$mode" tps once_cycle)
            exec 3>&-
            sleep 1
            printf -v "runs_$mode" '%s %s' "$(eval echo \$runs_$mode)" "$t"
        done
    done
    printf '\r%60s\r' '' >&2
    local off m min max
    read -r off _ _ <<<"$(stats "$runs_off")"
    for mode in off relay direct; do
        local runs_var="runs_$mode"
        read -r m min max <<<"$(stats "${!runs_var}")"
        printf '| 100 %s | %s | %s (%s-%s) | %.0f%% |\n' "$1" "$mode" "$m" "$min" "$max" \
            "$(awk -v a="$m" -v b="$off" 'BEGIN {print 100 * a / b}')"
    done
}
listeners_table idle
listeners_table reading
echo
echo "Machine: $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB; PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}'), fsync off; $(date -u +%Y-%m-%d)."
