#!/usr/bin/env python3
"""Check that every ```psql block of docs/sql-reference.md appears verbatim in the
expected output of the docs regression test (pg_test/regress/expected/docs.out), which
pg_regress in turn checks against the server. So the page cannot drift from what the
server does: change either, and scripts/test.sh fails until both agree.
"""

import re
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
page = (root / "docs/sql-reference.md").read_text()
transcript = (root / "pg_test/regress/expected/docs.out").read_text()

blocks = re.findall(r"^```psql\n(.*?)^```$", page, flags=re.S | re.M)
missing = [b for b in blocks if b not in transcript]
for block in missing:
    print("docs/sql-reference.md: this block is not in pg_test/regress/expected/docs.out:")
    print(block)
if not blocks:
    print("docs/sql-reference.md has no psql blocks")
    sys.exit(1)
if missing:
    sys.exit(1)
print(f"docs/sql-reference.md: all {len(blocks)} psql transcripts match the server")
