#!/usr/bin/env bash
# Run the test suite several times in a row with a CPU hog beside it, keep each run's log,
# and count the failures per test: a test that fails on a loaded machine blocks everyone's
# CI, so it is a bug (CONTRIBUTING.md, "Tests").
#
#   ./scripts/stress.sh                      5 runs of ./scripts/test.sh --pg 15, stress-ng --cpu 2
#   ./scripts/stress.sh -n 3 --cpu 4 -- --pg "15 17"     (arguments after -- go to test.sh)
#   STEPS="4 6" ./scripts/stress.sh -n 10    test.sh's variables pass through
#
# Logs: $PG_ONCE_WORK/stress/<date>/run-N.log. Exits non-zero if any run failed.
set -euo pipefail
runs=5 cpus=2
while [ $# -gt 0 ]; do
    case $1 in
        -n) runs=$2; shift 2 ;;
        --cpu) cpus=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "usage: $0 [-n RUNS] [--cpu WORKERS] [-- test.sh arguments]" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || set -- --pg 15
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${PG_ONCE_WORK:-/var/tmp/pg_once}
logs=$work/stress/$(date +%Y%m%d-%H%M%S)
mkdir -p "$logs"
if ! command -v stress-ng >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng >/dev/null
fi

# The hog: CPU workers at the lowest priority would yield to the tests; at the normal one
# they compete with them as another tenant's load would.
stress-ng --cpu "$cpus" --quiet &
hog=$!
trap 'kill $hog 2>/dev/null || true' EXIT

# failures LOG: one line per failed test in a test.sh log, whichever runner printed it.
failures() {
    grep -aE '^test .* \.\.\. FAILED$|^FAILED |^not ok [0-9]+ - |^# Subtest: .* failed| FAILED *\(?[0-9.]* ?m?s?\)?$' "$1" |
        sed -E 's/^test (.*) \.\.\. FAILED$/cargo: \1/; s/^FAILED ([^ ]*).*/pytest: \1/;
                s/^not ok [0-9]+ - (.*)/tap: \1/' | sort -u || true
}

declare -A failed_tests=()
results=()
for i in $(seq "$runs"); do
    log=$logs/run-$i.log
    started=$SECONDS
    if (cd "$repo" && ./scripts/test.sh "$@") >"$log" 2>&1; then
        status=passed
    else
        status=failed
        step=$(grep -a '==>' "$log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g; s/^==> //')
        while IFS= read -r t; do
            [ -n "$t" ] && failed_tests[$t]=$((${failed_tests[$t]:-0} + 1))
        done < <(failures "$log")
        [ -n "$(failures "$log")" ] || failed_tests["(no test named) in: $step"]=$((${failed_tests["(no test named) in: $step"]:-0} + 1))
    fi
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    results+=("run $i: $status in $((SECONDS - started)) s (load $load) $log")
    echo "${results[-1]}" >&2
done

echo "== $runs runs of ./scripts/test.sh $* beside stress-ng --cpu $cpus"
printf '%s\n' "${results[@]}"
if [ ${#failed_tests[@]} -eq 0 ]; then
    echo "no failures"
    exit 0
fi
echo "failures per test:"
for t in "${!failed_tests[@]}"; do printf '%4d  %s\n' "${failed_tests[$t]}" "$t"; done | sort -rn
exit 1
