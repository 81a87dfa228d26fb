#!/usr/bin/env python3
"""Check that the SQL reference cannot drift from the server:
- every ```psql block of docs/sql-reference.md appears verbatim in the expected output of
  the docs regression test (pg_test/regress/expected/docs.out), which pg_regress in turn
  checks against the server: change either, and scripts/test.sh fails until both agree;
- every function sql/functions.sql creates has its signature on that page: one of schema
  once also a row in the README's SQL reference table, one of schema once_internal a
  line under "Internal functions";
- the state diagram of that page and of docs/concepts.md is docs/states.mmd, verbatim
  (GitHub draws a ```mermaid block; the file is its one source), and so is any other
  stateDiagram a page draws;
- every relative link of the Markdown pages (README.md, CONTRIBUTING.md, BENCHMARKS.md,
  docs/, the clients' READMEs) names a file that exists, and its #anchor a heading of
  that file, as GitHub spells them: text moves between pages, links must follow.
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
pages = sorted({root / "README.md", root / "CONTRIBUTING.md", root / "BENCHMARKS.md",
                *root.glob("docs/*.md"), *root.glob("clients/*/README.md")})
texts = {p.relative_to(root).as_posix(): p.read_text() for p in pages}
# The pages that must draw it, and any other that draws a state diagram.
drawing = {"docs/sql-reference.md", "docs/concepts.md"} | {
    name for name, text in texts.items() if "```mermaid\nstateDiagram" in text}
drawn = [name for name in sorted(drawing)
         if f"```mermaid\n{states}```" not in texts.get(name, "")]
for name in drawn:
    print(f"{name}: its ```mermaid block is not docs/states.mmd verbatim: paste the file in")


def prose(text):
    """The text outside fenced code blocks and code spans."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text):
    """The #anchors of a page's headings, as GitHub makes them."""
    seen, out = {}, set()
    for title in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose_keep_headings(text), flags=re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)   # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def prose_keep_headings(text):
    """Without fenced code blocks (a `# comment` in one is no heading); code spans kept."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


broken = []
for name, text in texts.items():
    here = (root / name).parent
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else root / name
        if not file.exists():
            broken.append(f"{name}: link to {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{name}: link to {target}: {file.relative_to(root)} has no heading #{anchor}")
for line in broken:
    print(line)
if missing or undocumented or unlisted or drawn or broken:
    sys.exit(1)
print(f"docs/sql-reference.md: all {len(blocks)} psql transcripts match the server; "
      f"all {len(functions)} functions documented; {len(drawing)} state diagrams drawn; "
      f"the links of {len(texts)} pages resolve")
