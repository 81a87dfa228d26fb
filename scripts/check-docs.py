#!/usr/bin/env python3
"""Check that the SQL reference cannot drift from the server:
- every ```psql block of docs/sql-reference.md appears verbatim in the expected output of
  the docs regression test (pg_test/regress/expected/docs.out), which pg_regress in turn
  checks against the server: change either, and scripts/test.sh fails until both agree;
- every function sql/functions.sql creates has its signature on that page: one of schema
  once also a row in the README's SQL reference table, one of schema once_internal a
  line under "Internal functions";
- the state diagram of that page and of the README is docs/states.mmd, verbatim (GitHub
  draws a ```mermaid block; the file is its one source).
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

declared = re.findall(r"^CREATE FUNCTION (once|once_internal)\.(\w+)\(",
                      (root / "sql/functions.sql").read_text(), flags=re.M)
functions = [f"{schema}.{name}" for schema, name in declared]
internal_section = page.split("\n## Internal functions", 1)[1] if "\n## Internal functions" in page else ""
readme = (root / "README.md").read_text()
readme_table = readme.split("\n## SQL reference", 1)[1].split("\n## ", 1)[0]
undocumented = [f for f in functions if not re.search(rf"^\s*{re.escape(f)}\(", page, flags=re.M)]
unlisted = [f for f in functions
            if (f.startswith("once_internal.") and f"{f}(" not in internal_section)
            or (f.startswith("once.") and not re.search(rf"`{f[5:]}[`(]", readme_table))]
for f in undocumented:
    print(f"docs/sql-reference.md: {f} has no signature line ({f}(...) in a code block)")
for f in unlisted:
    where = ("under \"Internal functions\" in docs/sql-reference.md" if f.startswith("once_internal.")
             else "in the README's SQL reference table")
    print(f"{f} is not listed {where}")
states = (root / "docs/states.mmd").read_text()
drawn = [name for name, text in (("docs/sql-reference.md", page), ("README.md", readme))
         if f"```mermaid\n{states}```" not in text]
for name in drawn:
    print(f"{name}: its ```mermaid block is not docs/states.mmd verbatim: paste the file in")
if missing or undocumented or unlisted or drawn:
    sys.exit(1)
print(f"docs/sql-reference.md: all {len(blocks)} psql transcripts match the server; "
      f"all {len(functions)} functions documented")
