#!/usr/bin/env bash
# The dashboard's load on the database: KEYS (1,000,000) done keys plus keys in every
# state, inserted directly as bench/scale.sh does; VIEWERS (10) server-sent-events
# connections open on pg-once-ui's pages; keys completing at about RATE (50) a second
# meanwhile; for DURATION (60) seconds. Counts the statements the dashboard ran and their time
# with pg_stat_statements. Its own preloaded PostgreSQL 15 cluster ("uiload", on
# PG_ONCE_TEST_PORT + 20, the dashboard on + 21), stopped at the end.
#
#   PG_ONCE_PG_BIN=... PG_ONCE_WORK=... ./ui/bench/load.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib.sh
KEYS=${KEYS:-1000000} VIEWERS=${VIEWERS:-10} RATE=${RATE:-50} SECONDS_=${DURATION:-60}
port=$((${PG_ONCE_TEST_PORT:-25432} + 20)) ui_port=$((${PG_ONCE_TEST_PORT:-25432} + 21))
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; cluster_stop uiload' EXIT
cluster_start uiload "$port" "shared_preload_libraries = 'pg_once, pg_stat_statements'" \
    "once.databases = 'postgres'" "pg_stat_statements.track = 'top'"
q() { cluster_psql uiload "$port" -Atq "$@"; }
# The dashboard connects as a role of its own (a superuser, to read once.entries), so that
# its statements are told from the worker's and the writer's.
q -c "CREATE EXTENSION pg_once" -c "CREATE EXTENSION pg_stat_statements" \
  -c "CREATE ROLE ui_bench LOGIN SUPERUSER"
say "inserting $KEYS done keys (and 1,000 queued, 100 running, 100 failed)"
q -c "SELECT once.create_queue('qa'), once.create_queue('qb')" -c "
INSERT INTO once.entries (key_hash, key, state, token, result, queue, run_at, owner, owner_pid, lease_only, lease_expires_at, claimed_at, error, retry_at)
SELECT once.key_hash('k' || i), 'k' || i, s::once.key_state, i, CASE WHEN s = 'done' THEN '1'::jsonb END,
       CASE WHEN i % 2 = 0 THEN 'qa' ELSE 'qb' END,
       CASE WHEN s = 'queued' AND i % 4 < 2 THEN now() + interval '1 day' ELSE now() END,
       CASE WHEN s = 'running' THEN 'w' END, CASE WHEN s = 'running' THEN 0 END,
       s = 'running',
       CASE WHEN s = 'running' THEN now() + interval '1 hour' END, CASE WHEN s = 'running' THEN now() END,
       CASE WHEN s = 'failed' THEN 'boom' END, CASE WHEN s = 'failed' THEN 'infinity'::timestamptz END
  FROM generate_series(1, $KEYS + 1200) i,
       LATERAL (SELECT CASE WHEN i <= 1000 THEN 'queued' WHEN i <= 1100 THEN 'running'
                            WHEN i <= 1200 THEN 'failed' ELSE 'done' END AS s) x" -c "VACUUM ANALYZE once.entries"
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
cargo build --quiet -p pg_once_ui
"$target/debug/pg-once-ui" --dsn "host=127.0.0.1 port=$port user=ui_bench dbname=postgres" \
    --bind "127.0.0.1:$ui_port" >"$PG_ONCE_WORK/uiload-ui.log" 2>&1 &
pids+=($!)
sleep 2
pages=("page=overview" "page=keys&state=running" "page=queues" "page=dead" "page=keys"
       "page=overview" "page=keys&prefix=k99" "page=key&key=k5000" "page=overview" "page=queues")
heard() { # notifications the dashboard's LISTEN connection received so far
    curl -s "http://127.0.0.1:$ui_port/api/overview" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["listener"]["notifications"])'
}
run() { # run LABEL NVIEWERS [PAGE]: statements and time of the dashboard over SECONDS_
    local label=$1 n=$2 only=${3:-} viewers=() i tag=$RANDOM$RANDOM
    for ((i = 0; i < n; i++)); do
        curl -sN "http://127.0.0.1:$ui_port/events?${only:-${pages[i % ${#pages[@]}]}}" >"$PG_ONCE_WORK/uiload-viewer-$i.log" &
        viewers+=($!)
    done
    sleep 1
    local done0 heard0
    heard0=$(heard)   # (its query, if any, before the counting starts)
    q -c "SELECT pg_stat_statements_reset()" >/dev/null
    done0=$(q -c "SELECT (counters ->> 'completions')::bigint FROM once_internal.runtime()")
    # Keys completing (each its own transaction, so each is announced) at about RATE/s.
    PGAPPNAME=uiload-writer q -c "DO \$\$ BEGIN FOR i IN 1..$((RATE * SECONDS_)) LOOP
            PERFORM once.complete_key('new-$tag-' || i, (once.claim_key('new-$tag-' || i)).token, '1');
            COMMIT; PERFORM pg_sleep(1.0 / $RATE); END LOOP; END \$\$" 2>/dev/null &
    local writer=$!
    sleep "$SECONDS_"
    # (killing psql would leave its DO block running in the server)
    q -c "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = 'uiload-writer'" >/dev/null
    wait "$writer" 2>/dev/null || true
    local events
    events=$(cat "$PG_ONCE_WORK"/uiload-viewer-*.log 2>/dev/null | grep -c "^event: update" || true)
    local completed
    completed=$(( $(q -c "SELECT (counters ->> 'completions')::bigint FROM once_internal.runtime()") - done0 ))
    for i in "${viewers[@]}"; do kill "$i"; wait "$i" 2>/dev/null || true; done
    rm -f "$PG_ONCE_WORK"/uiload-viewer-*.log
    local stats
    stats=$(statements)
    printf '%s: %s viewers, %s s, %s keys completed, %s notifications heard, %s events sent to viewers\n%s\n' \
        "$label" "$n" "$SECONDS_" "$completed" "$(($(heard) - heard0))" "$events" "$stats"
}
statements() { # what the dashboard's role ran since the reset
    q -c "SELECT format('  %s calls/s, %s ms/s of database time (%s%% of one backend); mean %s ms, max %s ms: %s',
                        round(sum(calls) / $SECONDS_, 1), round(sum(total_exec_time)::numeric / $SECONDS_, 1),
                        round(sum(total_exec_time)::numeric / $SECONDS_ / 10, 1),
                        round((sum(total_exec_time) / greatest(sum(calls), 1))::numeric, 2),
                        round(max(max_exec_time)::numeric, 1),
                        left(regexp_replace(min(query), '\s+', ' ', 'g'), 60))
            FROM pg_stat_statements
           WHERE userid = 'ui_bench'::regrole AND query !~* '^LISTEN'
           GROUP BY CASE WHEN query ~ 'once\.stats' THEN 'stats' WHEN query ~ 'once\.queue_stats' THEN 'queue_stats'
                         WHEN query ~ 'once\.attempts' THEN 'attempts' WHEN query ~ 'once\.dead_letters' THEN 'dead'
                         WHEN query ~ 'once\.entries' THEN 'entries' ELSE query END
           ORDER BY sum(total_exec_time) DESC"
    q -c "SELECT format('  all: %s calls/s, %s ms/s', coalesce(round(sum(calls) / $SECONDS_, 1), 0), coalesce(round(sum(total_exec_time)::numeric / $SECONDS_, 1), 0))
            FROM pg_stat_statements WHERE userid = 'ui_bench'::regrole AND query !~* '^LISTEN'"
}
run "one viewer of the overview" 1
run "$VIEWERS viewers of the overview" "$VIEWERS" page=overview
run "$VIEWERS viewers of 8 pages" "$VIEWERS"
run "nobody watching" 0
