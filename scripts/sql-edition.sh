#!/usr/bin/env bash
# ./scripts/sql-edition.sh DIR: write DIR/pg_once_sql.sql, pg_once's SQL edition, for
# servers that load no C library (managed PostgreSQL): docs/sql-edition.md. DIR is build
# output; nothing generated is committed. scripts/sql_edition.py says how it is assembled.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
exec python3 "$(dirname "$0")/sql_edition.py" "$1"
