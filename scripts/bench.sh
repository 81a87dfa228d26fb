#!/usr/bin/env bash
# The benchmark command: sets up throwaway clusters, measures pg_once against its
# baselines side by side, and writes BENCHMARKS.md plus plots in bench/results/. Each
# section appends its figures to bench/results/results.jsonl as JSON lines; every table
# and plot is rendered from those by bench/report.py (`render`), and this script writes
# the prose around them.
#
#   1. claim+complete cycles/s on distinct keys vs the hand-made protocol, at 1, 8 and 32
#      clients (pgbench), and over TCP with RTT_US of added round trip; cache hits
#      (claim_key, and get) vs a primary-key SELECT and vs SELECT 1, and inside a namespace
#      vs outside.
#   2. stampede: many callers on one cold key: computations, and time from the owner's
#      complete_key to each caller's answer, by how callers wait.
#   3. failover: time until a killed owner's key is claimed by a waiting caller, and the
#      same for a lease-only design.
#   4. complete commits/s with 100 LISTEN connections, by once.notify.
#   5. queue: claim_next + complete jobs/s vs workers (n = 1 and 10) vs a plain SKIP
#      LOCKED table, and vs pgmq when PGMQ_SQL names a copy of its pgmq.sql (PGMQ_LABEL
#      names it in the report); table and index sizes over a million cycles on 10,000 keys.
#   6. pooled callers: 100 and 1,000 callers on 3 keys with the Python client, directly,
#      through PgBouncer (transaction mode, pool 6) and psycopg_pool, vs the raw SQL loop
#      on a connection per caller; takeover of a killed pooled owner.
#   7. freshness: open-loop Poisson traffic on 100 keys whose results expire, for today's
#      expiry with waiting, stale-while-revalidate, XFetch and a plain table cache:
#      computations per expiry, latency, stale answers; XFetch against its model.
#   8. growth and memory: the queue while another session holds a REPEATABLE READ snapshot
#      for 60 s (jobs/s and sizes before, during and after, vs the plain table); memory of
#      a backend that used pg_once vs a plain application connection, at 100 and 1,000
#      connections, and pg_once's shared memory.
#
#   9. index growth (only when named: SECTIONS="9", about 45 minutes): sizes of once.entries
#      and each of its indexes every 250,000 of CURVE_CYCLES (5,000,000) queue cycles on
#      10,000 keys, to show where they level off.
#
# QUICK=1: a smoke run in under 5 minutes: the headline row of each section (with the
# baseline its ratio needs), one short round each. Its report goes to the terminal and to
# $PG_ONCE_WORK/quick.md, never to BENCHMARKS.md or results.jsonl: one round is not a
# figure to publish. Use it to check the harness and to see a change's direction.
#
# SECTIONS="6" (for example) runs only those sections: their tables replace the same
# sections of BENCHMARKS.md and their rows in bench/results/results.jsonl, each marked
# with the day of its run; the rest stays as the last run left it.
#
# Comparisons alternate (A B A B ...) so both sides see the same machine state; figures
# are the median and the range over ROUNDS. Settings: ROUNDS (3), QUEUE_ROUNDS (3),
# SECONDS_PER_RUN (6), RTT_US (500), BLOAT_CYCLES (500000), FRESHNESS_SECONDS (60 per
# mode of section 7), CURVE_CYCLES (5000000). A full run (sections 1 to 8) should take
# about 45 minutes, and says how long it took at the end. (On 2026-12-01, with 10 s runs, 5
# queue rounds and 1,000,000 bloat cycles, sections 1, 2, 4 and 5 took 10, 1.3, 4.2 and 26
# minutes and a full run about an hour; the defaults were cut to these to fit.)
source "$(dirname "$0")/lib.sh"
QUICK=${QUICK:-0}
quick() { [ "$QUICK" = 1 ]; }
if quick; then
    : "${ROUNDS:=1}" "${QUEUE_ROUNDS:=1}" "${SECONDS_PER_RUN:=3}" "${FRESHNESS_SECONDS:=4}"
fi
PORT=${PG_ONCE_BENCH_PORT:-25534}
PLAIN_PORT=$((PORT + 1))
PROXY_PORT=$((PORT + 2))
BOUNCER_PORT=$((PORT + 3))
SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
ROUNDS=${ROUNDS:-3}
QUEUE_ROUNDS=${QUEUE_ROUNDS:-3}
POOL=$((2 * $(nproc)))
RTT_US=${RTT_US:-500}
BLOAT_CYCLES=${BLOAT_CYCLES:-500000}
CURVE_CYCLES=${CURVE_CYCLES:-5000000}
SQL=$REPO_ROOT/bench/pgbench
BIN=${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release
OUT=$REPO_ROOT/bench/results
REPORT=$REPO_ROOT/BENCHMARKS.md
RESULTS=$OUT/results.jsonl
if quick; then
    REPORT=$PG_ONCE_WORK/quick.md
    RESULTS=$PG_ONCE_WORK/quick-results.jsonl
fi
SECTIONS=${SECTIONS:-1 2 3 4 5 6 7 8}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
ALL_SECTIONS=no
[ "$SECTIONS" = "1 2 3 4 5 6 7 8" ] && ALL_SECTIONS=yes
FRESHNESS_SECONDS=${FRESHNESS_SECONDS:-60}

ensure_toolchain
install_extension release
# Sections 1 to 5 use the Rust tools (6 and 7 are Python): build them only for those.
if want 1 || want 2 || want 3 || want 4 || want 5 || want 8; then
    say "building the benchmark tools"
    (cd "$REPO_ROOT" && cargo build --release --quiet -p pg_once_tools --bin bench --bin latency_proxy)
fi
# Huge pages. With 4 kB pages a backend takes a page fault the first time it touches each
# shared buffer; 64 freshly connected queue workers spent 10% of all CPU there, a cost a
# long-lived connection pool pays once. Servers with large shared_buffers run on huge
# pages, and so do the benchmark clusters when the kernel lets us reserve them (2 clusters
# of 256 MB need about 300 pages of 2 MB). The reservation is given back at exit.
HUGE_PAGES=off
# The preloaded cluster allows 1,100 connections (section 8), which adds about 80 MB.
HUGE_PAGES_NEEDED=400
HUGE_PAGES_BEFORE=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)
enough_huge_pages() {
    [ "$(awk '/HugePages_Free/ {print $2}' /proc/meminfo 2>/dev/null)" -ge "$HUGE_PAGES_NEEDED" ] 2>/dev/null
}
if enough_huge_pages ||
    { sysctl -qw vm.nr_hugepages=$((HUGE_PAGES_BEFORE + HUGE_PAGES_NEEDED)) 2>/dev/null &&
        enough_huge_pages; }; then
    HUGE_PAGES=on
fi
restore_huge_pages() {
    [ "$(cat /proc/sys/vm/nr_hugepages)" = "$HUGE_PAGES_BEFORE" ] ||
        sysctl -qw vm.nr_hugepages="$HUGE_PAGES_BEFORE" 2>/dev/null || true
}
trap restore_huge_pages EXIT
say "starting throwaway clusters on 127.0.0.1:$PORT (preloaded) and :$PLAIN_PORT (not), huge pages $HUGE_PAGES"
cluster_start bench "$PORT" "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres,queue,hold'" \
    "huge_pages = $HUGE_PAGES" "max_connections = 1100"
cluster_start bench-plain "$PLAIN_PORT" "huge_pages = $HUGE_PAGES"
proxy=""
if want 1; then
    "$BIN/latency_proxy" --listen "127.0.0.1:$PROXY_PORT" --upstream "127.0.0.1:$PORT" \
        --delay-us $((RTT_US / 2)) &
    proxy=$!
fi
trap '[ -z "$proxy" ] || kill $proxy 2>/dev/null; pgbouncer_stop bench-bouncer; cluster_stop bench; cluster_stop bench-plain; restore_huge_pages' EXIT
cluster_psql bench "$PORT" -q -c "CREATE EXTENSION pg_once" \
    -f "$SQL/handmade_setup.sql" -f "$SQL/hot_setup.sql" >/dev/null
cluster_psql bench-plain "$PLAIN_PORT" -q -c "CREATE EXTENSION pg_once" >/dev/null
DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"
PLAIN_DSN="host=127.0.0.1 port=$PLAIN_PORT user=postgres dbname=postgres"
mkdir -p "$OUT"
# The "bench" field of each section's rows in results.jsonl.
section_rows() {
    case $1 in
    1) echo pgbench ;; 2) echo stampede ;; 3) echo takeover ;; 4) echo listeners ;;
    5) echo queue bloat ;; 6) echo pooled ;; 7) echo freshness ;; 8) echo hold memory ;;
    9) echo curve ;;
    esac
}
if [ "$ALL_SECTIONS" = yes ] || quick; then
    : >"$RESULTS"
else
    # Keep the other sections' rows; this run writes its own anew.
    python3 - "$RESULTS" $(for n in $SECTIONS; do section_rows "$n"; done) <<'PY'
import json, sys
path, dropped = sys.argv[1], set(sys.argv[2:])
try:
    rows = [l for l in open(path) if l.strip() and json.loads(l)["bench"] not in dropped]
except FileNotFoundError:
    rows = []
open(path, "w").writelines(rows)
PY
fi

# tps WORKLOAD CLIENTS [LINK [ROLE]]: one pgbench run (LINK socket or rtt, as ROLE,
# postgres by default); prints transactions/s.
tps() {
    local target=(-h "$PG_ONCE_WORK/bench" -p "$PORT")
    [ "${3:-socket}" = rtt ] && target=(-h 127.0.0.1 -p "$PROXY_PORT")
    "$PG_BIN/pgbench" "${target[@]}" -U "${4:-postgres}" -n -M prepared -c "$2" -j 2 \
        -T "$SECONDS_PER_RUN" -f "$SQL/$1.sql" postgres 2>&1 |
        sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

# render TABLE: one table of the report, in markdown, from the JSON lines the sections
# appended to $RESULTS (bench/report.py is the one renderer; this script writes the prose).
render() { python3 "$REPO_ROOT/bench/report.py" table "$1" "$RESULTS"; }
progress() { printf '\r  %-60s' "$*" >&2; }
progress_done() { printf '\r%70s\r' '' >&2; }

# compare A B CLIENTS LABEL [LINK [ROLE]]: alternate A and B; log JSON (table cycles).
compare() {
    local a=$1 b=$2 clients=$3 label=$4 link=${5:-socket} role=${6:-postgres} runs_a="" runs_b=""
    for ((r = 1; r <= ROUNDS; r++)); do
        progress "$label, round $r/$ROUNDS"
        runs_a+=" $(tps "$a" "$clients" "$link" "$role")"
        runs_b+=" $(tps "$b" "$clients" "$link" "$role")"
    done
    progress_done
    printf '{"bench":"pgbench","label":"%s","a":"%s","b":"%s","clients":%s,"link":"%s","a_tps":[%s],"b_tps":[%s]}\n' \
        "$label" "$a" "$b" "$clients" "$link" "$(tr ' ' ',' <<<"${runs_a# }")" "$(tr ' ' ',' <<<"${runs_b# }")" >>"$RESULTS"
}

harness() { "$BIN/bench" --rounds "${HARNESS_ROUNDS:-$ROUNDS}" --json-out "$RESULTS" "$@"; }

# Section 6: the Python client's benchmark (bench/pooled.py) on the preloaded cluster,
# directly and through a PgBouncer in transaction mode with 6 server connections.
pooled_section() {
    say "6/7 pooled callers"
    local venv=$PG_ONCE_WORK/bench-py-venv
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$REPO_ROOT/clients/python"
    pgbouncer_start bench-bouncer "$BOUNCER_PORT" "$PORT" 6
    local rows=$PG_ONCE_WORK/pooled.jsonl
    local only=()
    quick && only=(--setups pgbouncer --rows 100x4)
    "$venv/bin/python" "$REPO_ROOT/bench/pooled.py" --dsn "$DSN" "${only[@]}" \
        --bouncer-dsn "host=127.0.0.1 port=$BOUNCER_PORT user=postgres dbname=postgres" >"$rows"
    pgbouncer_stop bench-bouncer
    sed 's/^{/{"bench":"pooled",/' "$rows" >>"$RESULTS"
    echo "## 6. Pooled callers: 3 keys, 1 s computation"
    echo
    echo "Callers (threads) in several processes ask at the same moment for 3 keys whose"
    echo "computation takes 1 s, with the Python client (\`clients/python\`): each process has"
    echo "its pool and one LISTEN connection that owns its claims. direct: a pool of 10 direct"
    echo "connections per process; PgBouncer: the pool goes through PgBouncer in transaction"
    echo "mode, 6 server connections in all, the LISTEN connection directly to the server;"
    echo "psycopg_pool: the application's own pool of 4 connections per process, handed to the"
    echo "client. Baselines, on a connection per caller with no client library: the raw SQL"
    echo "loop of docs/concepts.md (\`claim_key(key, '30 s', wait => '10 s')\` until answered, then"
    echo "\`complete_key\`) on direct connections, and through the same PgBouncer; a raw caller"
    echo "still unanswered after 30 s counts as not answered. Answer times"
    echo "count from the common start; \"db calls\" are statements per caller (the client's"
    echo "through its pool, not counting its LISTEN connection). One run of each row."
    echo
    render pooled
    echo
}

# built_commit: the commit the installed extension was built from, and whether the
# extension's sources differed from it.
built_commit() {
    local commit
    commit=$(git -C "$REPO_ROOT" rev-parse --short HEAD)
    git -C "$REPO_ROOT" diff --quiet HEAD -- src sql Cargo.toml pg_once.control ||
        commit+=" with local changes to the extension"
    echo "$commit"
}
# machine_ticks: CPU time of the whole machine, busy and in all, in clock ticks, and the
# microseconds in which some task waited for a core (/proc/pressure/cpu; 0 without it).
machine_ticks() {
    awk '/^cpu / {printf "%d %d ", $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat
    awk -F'total=' '/^some/ {printf "%.0f\n", $2; found = 1} END {if (!found) print 0}' /proc/pressure/cpu 2>/dev/null || echo 0
}
# bench_ticks: CPU ticks used by the preloaded cluster's processes (with the exited
# backends its postmaster reaped) and by the children this shell waited for.
bench_ticks() {
    local postmaster
    postmaster=$(head -1 "$PG_ONCE_WORK/bench/data/postmaster.pid")
    {
        sed 's/^.*) //' "/proc/$postmaster/stat" | awk '{print $12 + $13 + $14 + $15}'
        for child in $(pgrep -P "$postmaster"); do
            sed 's/^.*) //' "/proc/$child/stat" 2>/dev/null | awk '{print $12 + $13}'
        done
        sed 's/^.*) //' "/proc/$$/stat" | awk '{print $14 + $15}'
    } | awk '{sum += $1} END {print sum}'
}

# Section 7: bench/freshness.py on the preloaded cluster, modes (a) to (d) one after the
# other, FRESHNESS_SECONDS each.
freshness_section() {
    say "7/7 freshness ($FRESHNESS_SECONDS s per mode)"
    local venv=$PG_ONCE_WORK/freshness-venv rows=$PG_ONCE_WORK/freshness.jsonl
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check asyncpg uvloop
    # How busy the machine was meanwhile, and how much of it was this benchmark: the
    # server's processes (the postmaster's own children's time includes its backends that
    # exited) and the clients (this shell's children's time, the client processes'
    # included). The rest is other work on a shared machine.
    local before after load_before machine
    before="$(machine_ticks) $(bench_ticks)"
    load_before=$(cut -d' ' -f1 /proc/loadavg)
    local short=(--rounds 4)
    quick && short=(--rounds 1 --warmup 2 --cooldown 1)
    "$venv/bin/python" "$REPO_ROOT/bench/freshness.py" run --dsn "$DSN" \
        --duration "$FRESHNESS_SECONDS" "${short[@]}" >"$rows"
    after="$(machine_ticks) $(bench_ticks)"
    machine=$(awk -v b="$before" -v a="$after" -v l0="$load_before" -v l1="$(cut -d' ' -f1 /proc/loadavg)" -v n="$(nproc)" \
        -v version="$(grep -m1 '^version' "$REPO_ROOT/Cargo.toml" | cut -d'"' -f2)" \
        -v commit="$(built_commit)" 'BEGIN {
        split(b, x, " "); split(a, y, " "); t = y[2] - x[2]; busy = y[1] - x[1]; ours = y[4] - x[4]
        # t ticks of 1/100 s over n cores; the pressure total is in microseconds.
        waited = (y[3] - x[3]) / (t / n * 10000)
        printf "Release build of pg_once %s (commit %s). While it ran, the %d cores were %.0f%% busy: %.0f%% this benchmark (server and clients), %.0f%% other work on this shared machine; some task waited for a core %.0f%% of the time; load average %s before, %s after.", version, commit, n, 100 * busy / t, 100 * ours / t, 100 * (busy - ours) / t, 100 * waited, l0, l1 }')
    sed 's/^{/{"bench":"freshness",/' "$rows" >>"$RESULTS"
    cat <<EOF
## 7. Freshness: 100 keys expiring under steady traffic

Simulated traffic (\`bench/freshness.py\`: asyncpg on uvloop, 2 client processes): 100 keys,
2,000 requests/s in all with Poisson arrivals, results that live 2 s (ttl) and take 300 ms
to compute, on the preloaded cluster. Each mode is measured for $FRESHNESS_SECONDS s in all, in 4
rounds in which the modes take turns (a b c d, then d c b a, ...); each turn runs on keys
of its own with fresh client processes, starts from keys filled with their first expiries
spread evenly over one ttl, and is measured for a quarter of the time after 5 s of the
same traffic, followed by 2 s more. Open loop: a request's latency counts from its scheduled
arrival, so time spent behind a computation, a busy pool or a late client loop all shows.
Each process has a pool of 100 connections for callers and one of 8 for completions (from
the callers' pool a completion queues behind the callers that wait inside claim_key for
it, and in (a) the pool then stays jammed until their waits time out). The computation is
a sleep holding no connection: claim on a pooled connection, give it back, sleep,
complete on one.

- (a) today's expiry: \`claim_key(wait => '5 s')\`; the claimant computes and completes
  with \`ttl => '2 s'\`, every other caller of that key waits inside claim_key.
- (b) stale-while-revalidate: \`claim_key(serve_stale => true)\`,
  \`complete_key(ttl => '2 s', stale => '10 s')\`; \`refresh\` answers the old result at once
  and recomputes in the background, \`stale\` answers it at once.
- (c) XFetch: \`claim_key(serve_stale => true)\`, \`complete_key(ttl => '2 s', beta => 1.0)\`;
  \`refresh\` (drawn early by the server) answers the still-fresh result at once and
  recomputes in the background. No stale window: past its expiry a key waits as in (a),
  which happens when the refresh was drawn less than a computation's time before the
  expiry (by the model below, at about 11% of the expiries here).
- (d) no coordination: a plain table; \`SELECT\`, and on a missing or expired row every
  such caller computes and upserts (\`INSERT ... ON CONFLICT DO UPDATE\`).

Computations per key per ttl: computations / (100 keys x $FRESHNESS_SECONDS s / 2 s). Computations
per refresh: computations over refreshes, a refresh being a run of overlapping computations
of one key (in (d) the stampede at an expiry). Stale: a result served past its expiry;
largest staleness: how far past. Ratios divide a mode's p99 and its computations by those
of (a) and (d) in the same run (one run of 4 rounds). Under the table, per mode: the
outcomes, the latency of all rounds together, the time the answering statement spent in
the server (waiting included: \`clock_timestamp() - statement_timestamp()\` at its end), and
the client's own share (start lag: from a request's scheduled arrival until its process
starts it) and CPU. What lies between the server's time and the caller's is the client,
the connection and the machine's scheduling, on 2 cores that the server, the clients and
other work share.

$machine

EOF
    render freshness
    cat <<EOF

**XFetch against its model.** The paper's rule makes one read that comes s before the
expiry draw an early refresh with probability exp(-s / (beta delta)), delta being the last
computation's length (pg_once's \`compute_time\`, claim to completion). That is a statement
about a single read, and the left plot checks it as one: of the reads that could draw
(hits on a result before its refresh was drawn, and the read that drew it), the share that
drew, by s / (beta delta). It is not the distribution of when a refresh happens, because
with many readers the first draw wins: with Poisson reads at rate lambda per key from the result's
completion (ttl before its expiry) on, the time S before expiry of the first draw has
P(S <= s) = exp(-lambda beta delta (exp(-s / (beta delta)) - exp(-ttl / (beta delta)))),
with S = 0 standing for "none drawn" (then the first caller past the expiry recomputes
while the others wait). Its median lies near beta delta ln(lambda beta delta / ln 2) before
the expiry (0.65 s for delta = 300 ms), where the single-read curve gives a read only a
12% chance. The right plot compares that distribution (averaged over the results) with
the measured S of every result that lived its whole ttl inside a measured window. Each
result is taken with its own delta, the \`compute_time\` the server stored with it (300 ms
and what the machine adds; the draws on it use that one); nothing is fitted.

EOF
    render xfetch
    echo
    echo "![XFetch early refreshes against the model](bench/results/freshness.png)"
    echo
}

# Section 9: the bloat measurement of section 5, five times longer, with each index's size.
index_curve_section() {
    say "9 index growth over $CURVE_CYCLES cycles"
    cluster_psql bench "$PORT" -q -c "DROP DATABASE IF EXISTS curve" -c "CREATE DATABASE curve" >/dev/null
    cluster_psql bench "$PORT" -q -d curve -c "CREATE EXTENSION pg_once" \
        -c "ALTER DATABASE curve SET once.history_retention = '1min'" >/dev/null
    echo "## 9. Index growth over $CURVE_CYCLES queue cycles"
    echo
    echo "Section 5's bloat run, longer: claim_next + complete_key + enqueue_key(refresh) cycles"
    echo "on 10,000 keys, 8 workers, in a database of their own, autovacuum on (its defaults, and"
    echo "the table's own settings), reap_stale every second, once.history_retention = 1 minute."
    echo "Sizes of once.entries, its indexes and once.attempts every 250,000 cycles:"
    echo
    echo "What bounds them: a claim, a completion and a re-enqueue each leave a dead row version"
    echo "and dead index entries, which vacuum removes, and autovacuum visits a database at"
    echo "most once per autovacuum_naptime (1 minute by default; once.entries asks for it at 2% dead"
    echo "rows). So each index levels off at its live entries plus about a naptime's worth of dead"
    echo "ones: entries_queue_idx, whose keys (run_at) only grow, holds the most; the primary key"
    echo "stays small because PostgreSQL removes duplicate versions from its pages as they fill"
    echo "(bottom-up deletion). Pages a vacuum empties are reused, not returned to the file"
    echo "system. A lower autovacuum_naptime lowers the level."
    echo
    "$BIN/bench" --dsn "host=127.0.0.1 port=$PORT user=postgres dbname=curve" bloat --keys 10000 \
        --cycles "$CURVE_CYCLES" --workers 8 --every 250000 2>/dev/null |
        sed 's/"bench":"bloat"/"bench":"curve"/' >>"$RESULTS"
    render curve
}

# Section 8: the queue under a held snapshot, in a database of its own that the pg_once
# worker serves (once.databases), then memory per backend and shared memory.
growth_and_memory_section() {
    say "8/8 growth under a held snapshot, memory"
    local warmup=30 before=30 hold=60 after=45 sides="once plain"
    quick && warmup=0 before=5 hold=15 after=20 sides=once
    cluster_psql bench "$PORT" -q -c "DROP DATABASE IF EXISTS hold" -c "CREATE DATABASE hold" >/dev/null
    cluster_psql bench "$PORT" -q -d hold -c "CREATE EXTENSION pg_once" \
        -c "ALTER DATABASE hold SET once.history_retention = '1min'" >/dev/null
    local hold_dsn="host=127.0.0.1 port=$PORT user=postgres dbname=hold" with
    for with in $sides; do
        progress "held snapshot, $with"
        HARNESS_ROUNDS=1 harness --dsn "$hold_dsn" --label "$with" hold --with "$with" \
            --workers 4 --batch 10 --keys 10000 --warmup "$warmup" --before "$before" \
            --hold "$hold" --after "$after" --interval 5 >/dev/null 2>&1
    done
    progress_done
    echo "## 8. Growth under a held snapshot; memory"
    echo
    echo "A queue in steady state: 10,000 keys cycled by 4 workers through claim_next (n = 10),"
    echo "complete_keys and enqueue_key(refresh) (the plain table: the same statements as in"
    echo "section 5, and an UPDATE back to queued), in a database the pg_once worker serves,"
    echo "autovacuum on. After ${warmup} s of warm-up and ${before} s measured, another session opens a"
    echo "REPEATABLE READ transaction, reads once and keeps it open for ${hold} s (the usual way a"
    echo "queue table bloats in production), then commits; the run goes on for ${after} s. Jobs/s are"
    echo "medians of 5 s intervals (after: the last 30 s); the sizes below are at the end of each phase."
    echo
    render hold
    echo
    echo "Sizes of the queue table (heap / indexes) at the end of each phase:"
    echo
    render hold_sizes
    echo
    ulimit -n 4096
    local counts="100 1000"
    quick && counts=100
    echo "Memory of one server process after a pg_once workload (a hit, a claim+complete cycle"
    echo "and a claim_next+complete_key on a queued job) vs a plain application connection (a"
    echo "primary-key SELECT, an INSERT and an UPDATE), all connections open and idle, from"
    echo "/proc/<pid>/smaps_rollup: private (clean + dirty) and proportional set size, median and"
    echo "largest over the connections. Shared memory: pg_once's segment and the server's total"
    echo "(shared_memory_size) with max_connections = 1100; pg_once's grows with max_connections"
    echo "(a slot per backend), not with the connections open."
    echo
    local n
    for n in $counts; do
        progress "memory, $n connections"
        HARNESS_ROUNDS=1 harness --dsn "$DSN" --label "pg_once, $n" memory --connections "$n" 2>/dev/null
        HARNESS_ROUNDS=1 harness --dsn "$DSN" --label "plain connection, $n" memory --connections "$n" --baseline 2>/dev/null
    done
    progress_done
    render memory
    echo
}

report() {
cat <<EOF
# pg_once benchmarks

Written by \`scripts/bench.sh\` on $(date -u +%Y-%m-%d): $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB,
PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') (fsync off, shared_buffers 256MB, huge pages $HUGE_PAGES), pg_once $(grep -m1 '^version' "$REPO_ROOT/Cargo.toml" | cut -d'"' -f2) release build,
clients on the same machine. Every figure is the median of $ROUNDS runs ($QUEUE_ROUNDS in section 5; one in sections 6 and 8; 4 rounds in section 7), with the range in
parentheses; ratios compare medians from the same run. Comparisons (sections 1, 4 and 5)
alternate their two sides run by run; stampede and failover rows run their rounds back to
back. Raw figures:
\`bench/results/results.jsonl\`.

![claim+complete cycles per second by clients](bench/results/cycles.png)
![queue jobs per second by workers](bench/results/queue.png)
![stampede answer latency](bench/results/stampede.png)

EOF

if want 1; then
say "1/7 cycles and hits"
echo "## 1. Cycles and hits"
echo
echo "pgbench, prepared statements, ${SECONDS_PER_RUN} s runs. A claim+complete cycle is two round trips"
echo "with pg_once (claim_key, complete_key) and three with the hand-made protocol (SELECT,"
echo "INSERT ... ON CONFLICT DO NOTHING, UPDATE with a NOTIFY trigger). The proxy adds ${RTT_US} us of"
echo "round-trip time, as between a pod and its database."
echo
if quick; then
    compare once_hit pk_select 8 "claim_key hit vs primary-key SELECT, 8 clients"
fi
if ! quick; then
for c in 1 8 32; do
    compare once_cycle handmade_cycle "$c" "claim+complete vs hand-made, $c clients, local socket"
done
for c in 1 8 32; do
    compare once_cycle handmade_cycle "$c" "claim+complete vs hand-made, $c clients, ${RTT_US} us RTT" rtt
done
compare once_hit pk_select 8 "claim_key hit vs primary-key SELECT, 8 clients"
compare once_get pk_select 8 "get hit vs primary-key SELECT, 8 clients"
compare once_hit select1 8 "claim_key hit vs SELECT 1, 8 clients"
compare once_hit pk_select 8 "claim_key hit vs primary-key SELECT, 8 clients, ${RTT_US} us RTT" rtt
# Namespaces: the same hit by an application role (not a superuser, which every check
# lets through at once), on a key inside a namespace it belongs to vs a key outside.
cluster_psql bench "$PORT" -q -f "$SQL/namespace_setup.sql" >/dev/null
compare once_hit_namespace once_hit 8 "claim_key hit in a namespace vs outside, 8 clients, as an application role" socket bench_app
fi
render cycles
echo

fi

if want 2; then
say "2/7 stampede"
echo "## 2. Stampede: callers on one cold key, 500 ms computation"
echo
echo "Milliseconds by the server's clock from the owner's complete_key to each other caller's"
echo "answer. Everything runs on the same $(nproc) cores, so 200 callers answered at once queue for CPU."
echo
echo "The last column divides the time until the last caller was answered by the same figure"
echo "for callers that retry claim_key every 100 ms (the usual \"timeout and retry\" answer)."
echo "The advisory-lock rows use no pg_once: as many sessions block on an advisory lock that one"
echo "session holds while it computes (the usual way to make callers wait for one computation in"
echo "plain PostgreSQL); its commit releases them all at once, and each then reads a row by"
echo "primary key in the same statement. PostgreSQL's lock manager wakes them."
echo
stampede_callers="20 200"
quick && stampede_callers=200
for callers in $stampede_callers; do
    progress "stampede, $callers callers"
    # The table (bench/report.py) orders the rows by how callers wait, whatever the order
    # they ran in, and divides by the retry every 100 ms.
    harness --dsn "$DSN" --label "$callers callers, retry claim_key every 100 ms" stampede --strategy poll100 --callers "$callers"
    harness --dsn "$DSN" --label "$callers callers, claim_key(wait), preloaded: woken" stampede --strategy server --callers "$callers"
    quick || harness --dsn "$PLAIN_DSN" --label "$callers callers, claim_key(wait), not preloaded: polls every 20 ms" stampede --strategy server --callers "$callers"
    if [ "$callers" = 200 ] && ! quick; then
        harness --dsn "$DSN" --label "200 callers, LISTEN first, preloaded: relayed NOTIFY" stampede --strategy listen
        harness --dsn "$PLAIN_DSN" --label "200 callers, LISTEN first, not preloaded: direct NOTIFY" stampede --strategy listen
    fi
    # PostgreSQL's own wake-up of as many sessions at one commit, without pg_once.
    harness --dsn "$PLAIN_DSN" --label "$callers callers, no pg_once: blocked on an advisory lock, released by a commit" stampede --strategy lock --callers "$callers"
    [ "$callers" = 200 ] && ! quick && harness --dsn "$DSN" --label "200 callers, retry claim_key every 1 s" stampede --strategy poll1000
    progress_done
done
render stampede
echo

fi

if want 3; then
say "3/7 failover"
echo "## 3. Failover: a killed owner"
echo
echo "Milliseconds from pg_terminate_backend of the owner to a waiting caller holding the claim."
echo
progress "failover"
harness --dsn "$DSN" --label "lease only (once.backend_liveness = off), 5 s lease" takeover --lease-s 5 --lease-only
harness --dsn "$DSN" --label "pg_once preloaded, 30 s lease" takeover
quick || harness --dsn "$PLAIN_DSN" --label "pg_once not preloaded, 30 s lease" takeover
progress_done
render takeover
echo

fi

if want 4; then
say "4/7 listeners"
echo "## 4. Commits with 100 LISTEN connections, by once.notify"
echo
echo "claim+complete cycles/s, 8 clients. Idle listeners LISTEN and then never read (the server"
echo "still delivers to their sockets); reading listeners receive every notification, on this"
echo "same machine."
echo
listener_kinds="idle reading" notify_modes="off relay direct"
quick && listener_kinds=reading notify_modes="off relay"
for kind in $listener_kinds; do
    flag=() runs_off="" runs_relay="" runs_direct=""
    [ "$kind" = idle ] && flag=(--idle)
    for ((r = 1; r <= ROUNDS; r++)); do
        for mode in $notify_modes; do
            progress "$kind listeners, once.notify = $mode, round $r/$ROUNDS"
            # Fresh listeners for every run, so idle ones start with empty socket buffers.
            exec 3> >("$BIN/bench" --dsn "$DSN" listeners --count 100 "${flag[@]}" >/dev/null 2>&1)
            sleep 3
            t=$(PGOPTIONS="-c once.notify=$mode" tps once_cycle 8)
            exec 3>&-
            sleep 1
            printf -v "runs_$mode" '%s %s' "$(eval echo \$runs_$mode)" "$t"
        done
    done
    progress_done
    for mode in $notify_modes; do
        runs_var="runs_$mode"
        printf '{"bench":"listeners","kind":"%s","notify":"%s","tps":[%s]}\n' "$kind" "$mode" "$(tr ' ' ',' <<<"$(echo ${!runs_var})")" >>"$RESULTS"
    done
done
render listeners
echo

fi

if want 5; then
say "5/7 queue"
echo "## 5. Queue"
echo
echo "Jobs/s for workers taking jobs with claim_next (n jobs at a time) and completing them"
echo "(complete_key, or complete_keys for n = 10), vs a plain table with the same index and"
echo "UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n), draining a backlog"
echo "of queued jobs. Workers keep their connections, as long-lived workers do: each run counts"
echo "the jobs of 4 s that start after every worker has worked for 1 s. $QUEUE_ROUNDS rounds; each"
echo "round runs every worker count, pg_once and plain alternating. \"of peak\" is the median"
echo "at this many workers over the best median for the same n with one connection per worker."
echo "Two more rows per n: 64 workers sharing $POOL connections (2 per core, the usual pool size;"
echo "each statement has a connection to itself, as from a pool or through PgBouncer in"
echo "transaction mode), and 64 workers with a connection each, of which at most $POOL are in a"
echo "claim+complete cycle at once (64 server processes still take turns on the CPUs, but only"
echo "$POOL claims run together)."
echo
# The queue rounds run in a database of their own: the harness empties pg_once's tables
# after each round there (the plain side drops its table), so that no round inherits the
# dead index entries of the ones before it.
cluster_psql bench "$PORT" -q -c "CREATE DATABASE queue" >/dev/null
cluster_psql bench "$PORT" -q -d queue -c "CREATE EXTENSION pg_once" >/dev/null
# Its pg_once worker (once.databases) relays the completions' notifications; until it runs,
# every commit would send them itself, which costs far more.
for ((i = 0; i < 300; i++)); do
    [ "$(cluster_psql bench "$PORT" -Atc "SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'pg_once worker' AND datname = 'queue'")" = 1 ] && break
    sleep 0.2
done
QUEUE_DSN="host=127.0.0.1 port=$PORT user=postgres dbname=queue"
# pgmq, the queue most often compared with pg_once, joins the rounds when PGMQ_SQL names a
# copy of its plain-SQL install (pgmq-extension/sql/pgmq.sql of github.com/pgmq/pgmq; none
# is shipped here): pgmq.read with a 30 s visibility timeout, then pgmq.delete.
if [ -n "${PGMQ_SQL:-}" ]; then
    cluster_psql bench "$PORT" -q -d queue -v ON_ERROR_STOP=1 -f "$PGMQ_SQL" >/dev/null
fi
# queue_round IMPL WORKERS N [bench options]: one 4 s round (a JSON line: table queue).
queue_round() {
    HARNESS_ROUNDS=1 harness --dsn "$QUEUE_DSN" --label x queue --with "$1" --workers "$2" --batch "$3" --seconds 4 "${@:4}"
}
# Worker setups: a count (one connection each), COUNTcPOOL (sharing POOL connections) or
# COUNTfPOOL (POOL in flight).
setup_options() {
    case $1 in
    *c*) echo "--connections ${1#*c}" ;;
    *f*) echo "--in-flight ${1#*f}" ;;
    esac
}
setup_label() {
    case $1 in
    *c*) echo "${1%c*} over ${1#*c} connections" ;;
    *f*) echo "${1%f*}, ${1#*f} in flight" ;;
    *) echo "$1" ;;
    esac
}
SETUPS="1 4 16 64 64c$POOL 64f$POOL" QUEUE_BATCHES="1 10"
quick && SETUPS=4 QUEUE_BATCHES=10
# Each round visits every setup, so that a slow spell of the machine (a checkpoint,
# autovacuum of what earlier sections left) lands on several of them rather than on all
# rounds of one.
for n in $QUEUE_BATCHES; do
    for ((r = 1; r <= QUEUE_ROUNDS; r++)); do
        for w in $SETUPS; do
            progress "queue, n = $n, round $r/$QUEUE_ROUNDS, workers: $(setup_label "$w")"
            # shellcheck disable=SC2046 # the options are words
            queue_round once "${w%%[cf]*}" "$n" $(setup_options "$w")
            # shellcheck disable=SC2046
            queue_round plain "${w%%[cf]*}" "$n" $(setup_options "$w")
            if [ -n "${PGMQ_SQL:-}" ]; then
                # shellcheck disable=SC2046
                queue_round pgmq "${w%%[cf]*}" "$n" $(setup_options "$w")
            fi
        done
    done
done
progress_done
render queue
echo
pgmq_table=$(render pgmq)
if [ -n "$pgmq_table" ]; then
    echo "The same rounds with ${PGMQ_LABEL:-pgmq} (its plain-SQL install): pgmq.read (30 s visibility timeout) and pgmq.delete, no history kept."
    echo
    echo "$pgmq_table"
    echo
fi
if ! quick; then
echo "Sizes of once.entries over $BLOAT_CYCLES claim_next + complete_key + enqueue_key(refresh)"
echo "cycles on 10,000 keys, 8 workers, in a database of their own, autovacuum on, reap_stale"
echo "every second with once.history_retention = 1 minute:"
echo
cluster_psql bench "$PORT" -q -c "CREATE DATABASE bloat" >/dev/null
cluster_psql bench "$PORT" -q -d bloat -c "CREATE EXTENSION pg_once" \
    -c "ALTER DATABASE bloat SET once.history_retention = '1min'" >/dev/null
"$BIN/bench" --dsn "host=127.0.0.1 port=$PORT user=postgres dbname=bloat" bloat --keys 10000 --cycles "$BLOAT_CYCLES" --workers 8 --every $((BLOAT_CYCLES / 10)) 2>/dev/null >>"$RESULTS"
render bloat
fi
fi

if want 6; then
pooled_section
fi

if want 7; then
freshness_section
fi

if want 8; then
growth_and_memory_section
fi

if want 9; then
index_curve_section
fi
}

if quick; then
    report >"$REPORT"
else
    # Replace the sections this run measured; keep the others as the last run left them
    # (section 9 is never part of a full run). A full run writes the header too; a partial
    # one marks each section it wrote with the day of its run.
    report >"$PG_ONCE_WORK/partial.md"
    python3 - "$REPORT" "$PG_ONCE_WORK/partial.md" "$(date -u +%Y-%m-%d)" "$SECTIONS" "$ALL_SECTIONS" <<'PY'
import re, sys
report, partial, day, sections, full = sys.argv[1:]
def split(text):
    parts = re.split(r"(?m)^(?=## \d+\. )", text)
    return parts[0], {p.split(".", 1)[0][3:]: p for p in parts[1:]}
try:
    head, old = split(open(report).read())
except FileNotFoundError:
    head, old = "", {}
new_head, new = split(open(partial).read())
for n, body in new.items():
    if full == "yes":
        old[n] = body
        continue
    title, rest = body.split("\n", 1)
    old[n] = f"{title}\n\n_Measured on {day} by `SECTIONS=\"{sections}\" scripts/bench.sh`._\n{rest}"
if full == "yes":
    head = new_head
open(report, "w").write(head + "".join(old[n] for n in sorted(old, key=int)))
PY
fi
if quick; then
    say "quick run: not published; wrote $REPORT"
    cat "$REPORT"
    exit 0
fi
say "plotting"
venv=$PG_ONCE_WORK/plot-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check matplotlib
"$venv/bin/python" "$REPO_ROOT/bench/report.py" plots "$RESULTS" "$OUT"
say "wrote $REPORT and plots in $OUT ($((SECONDS / 60)) minutes)"
cat "$REPORT"
