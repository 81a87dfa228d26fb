#!/usr/bin/env python3
"""Check that the SQL reference cannot drift from the server:
- every ```psql block of docs/sql-reference.md appears verbatim in the expected output of
  the docs regression test (pg_test/regress/expected/docs.out), which pg_regress in turn
  checks against the server: change either, and scripts/test.sh fails until both agree;
- every function sql/functions.sql creates has its signature on that page, and, unless
  the page lists it under "Internal functions", a row in the README's SQL reference table.
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

functions = re.findall(r"^CREATE FUNCTION once\.(\w+)\(",
                       (root / "sql/functions.sql").read_text(), flags=re.M)
internal_section = page.split("\n## Internal functions", 1)[1] if "\n## Internal functions" in page else ""
readme = (root / "README.md").read_text()
readme_table = readme.split("\n## SQL reference", 1)[1].split("\n## ", 1)[0]
undocumented = [f for f in functions if not re.search(rf"^\s*once\.{f}\(", page, flags=re.M)]
unlisted = [f for f in functions
            if f"once.{f}(" not in internal_section
            and not re.search(rf"`{f}[`(]", readme_table)]
for f in undocumented:
    print(f"docs/sql-reference.md: once.{f} has no signature line (once.{f}(...) in a code block)")
for f in unlisted:
    print(f"README.md: once.{f} has no row in the SQL reference table "
          "(or list it under \"Internal functions\" in docs/sql-reference.md)")
if missing or undocumented or unlisted:
    sys.exit(1)
print(f"docs/sql-reference.md: all {len(blocks)} psql transcripts match the server; "
      f"all {len(functions)} functions documented")
