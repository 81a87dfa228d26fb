#!/usr/bin/env bash
# A primary and a hot standby for the client libraries' failover tests (docs/clients.md,
# N7 and L4), run by scripts/test.sh's step 6 and driven by the tests themselves, which
# find it in $PG_ONCE_FAILOVER:
#
#   failover.sh start PORT1 PORT2   a preloaded primary with pg_once on 127.0.0.1:PORT1
#                                   (cluster failover-1) and a pg_basebackup -R standby of
#                                   it on PORT2 (failover-2)
#   failover.sh ready               both running again, one primary, one standby: a server
#                                   that a test stopped comes back as a fresh standby of the
#                                   one promoted (so the next test fails over the other way)
#   failover.sh kill                the primary stopped with -m immediate, as a crash would
#   failover.sh promote             the standby promoted (pg_ctl promote -w): returns once it
#                                   takes writes
#   failover.sh stop                both stopped
#
# A client given "host=127.0.0.1,127.0.0.1 port=PORT1,PORT2 target_session_attrs=read-write"
# must follow whichever is the primary. Runs as root, like test.sh; the servers run as
# postgres.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

ports_file=$PG_ONCE_WORK/failover.ports
names=(failover-1 failover-2)

port_of() { sed -n "$(($1 + 1))p" "$ports_file"; }
running() { pg_server pg_ctl -D "$PG_ONCE_WORK/${names[$1]}/data" status >/dev/null 2>&1; }
is_standby() { [ -f "$PG_ONCE_WORK/${names[$1]}/data/standby.signal" ]; }
# The index (0 or 1) of the running primary, or of the running standby.
primary() { local i; for i in 0 1; do running "$i" && ! is_standby "$i" && { echo "$i"; return; }; done; return 1; }
standby() { local i; for i in 0 1; do running "$i" && is_standby "$i" && { echo "$i"; return; }; done; return 1; }

case ${1:-} in
    start)
        printf '%s\n%s\n' "$2" "$3" >"$ports_file"
        cluster_start "${names[0]}" "$2" "shared_preload_libraries = 'pg_once'"
        cluster_psql "${names[0]}" "$2" -q -c "CREATE EXTENSION pg_once"
        standby_start "${names[1]}" "$3" "$2"
        ;;
    ready)
        p=$(primary)
        for i in 0 1; do
            running "$i" || standby_start "${names[$i]}" "$(port_of "$i")" "$(port_of "$p")"
        done
        ;;
    kill)
        p=$(primary)
        pg_server pg_ctl -D "$PG_ONCE_WORK/${names[$p]}/data" -m immediate -w stop >/dev/null
        ;;
    promote)
        s=$(standby)
        pg_server pg_ctl -D "$PG_ONCE_WORK/${names[$s]}/data" -w -t 60 promote >/dev/null
        ;;
    stop)
        cluster_stop "${names[0]}"
        cluster_stop "${names[1]}"
        ;;
    *)
        echo "usage: $0 start PORT1 PORT2 | ready | kill | promote | stop" >&2
        exit 2
        ;;
esac
