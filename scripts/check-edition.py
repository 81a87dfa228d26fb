#!/usr/bin/env python3
"""Fail when the SQL edition (sql/edition/) drifts from the extension it restates (src/).

The edition does in PL/pgSQL what the extension does in Rust, and says so: its comments
name the Rust function each piece follows (`args::lease`, `claim::attempt`,
`Entry::fresh`, `reap.rs`), and its errors carry the extension's hints word for word, so
that a caller sees the same advice from either. Nothing but this check keeps them so:

1. Every Rust item an edition comment names exists: `module::item` an item of that
   module (src/**/module.rs or src/**/module/mod.rs), `Type::method` a method of that
   type, a bare `name.rs` or `dir/name.sql` a file of the tree.
2. Every hint the edition raises (`HINT = '...'`, or a hint variable's `'...'`) is a hint
   the extension raises: the same text in a Rust string of src/, where a Rust format's
   placeholder (`{}`, `{0}`, `{name}`) stands for any text, the SQL's `%s` too. Hints
   only the edition has, for what only it does, are listed in EDITION_ONLY with why.

Run by step 1 of scripts/test.sh.
"""

import functools
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
EDITION = ROOT / "sql" / "edition"
SRC = ROOT / "src"

# A Rust path in a comment: two or more identifiers joined by ::.
RUST_PATH = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)+)\b")
# A file named in a comment.
FILE_NAME = re.compile(r"\b((?:[a-z_]+/)*[a-z_]+\.(?:rs|sql))\b")
EDITION_ONLY = {
    # once_internal.vouch: how the edition learns which role called it (the extension
    # asks the server; docs/sql-edition.md, "Who is judged").
    "Call %s itself: pg_once judges the role it is called as.",
    # The once.max_*_size settings: the extension declares them as settings with units,
    # whose values PostgreSQL itself parses and refuses with this hint; the edition parses
    # them in core.sql.
    'Valid units are "kB", "MB", "GB" and "TB".',
}
ITEM = r"(?:pub(?:\([a-z]+\))?\s+)?(?:const\s+|unsafe\s+|async\s+)*(?:fn|const|static|struct|enum|trait|type|mod)\s+{}\b"
# Variants of an enum are items too (`Seen::mismatches` names a method, but
# `Outcome::Claimed` would name a variant).
VARIANT = r"^\s*{}\b\s*[({{,]"


def rust_files():
    return {p: p.read_text() for p in SRC.rglob("*.rs")}


def comments(sql):
    """The comment text of an SQL file, with line numbers: `-- ...` to the end of a line."""
    for number, line in enumerate(sql.splitlines(), 1):
        # Not inside a string: good enough for these files, whose strings hold no `--`.
        at = line.find("--")
        if at >= 0:
            yield number, line[at + 2 :]


def module_files(files, module):
    return [p for p in files if p.stem == module or (p.name == "mod.rs" and p.parent.name == module)]


def item_defined(text, name):
    return re.search(ITEM.format(re.escape(name)), text) or re.search(
        VARIANT.format(re.escape(name)), text, re.M
    )


def resolves(files, path):
    parts = path.split("::")
    # Rust's own (str::trim) and pgrx's are not ours to check.
    if parts[0] in {"str", "std", "pg_sys", "pgrx", "serde_json", "String", "Vec", "Option"}:
        return True
    name = parts[-1]
    owner = parts[-2]
    if owner[0].isupper():
        # Type::method: an impl of the type holds it.
        for text in files.values():
            if re.search(rf"\b(?:impl(?:<[^>]*>)?\s+(?:[A-Za-z_:]+\s+for\s+)?{re.escape(owner)}\b|enum\s+{re.escape(owner)}\b)", text) and item_defined(text, name):
                return True
        return False
    # module::item, where the first segments may be the crate's own modules.
    candidates = module_files(files, owner)
    return any(item_defined(files[p], name) for p in candidates)


@functools.cache
def tracked_files():
    """The files of the tree, as git tracks them (not build output)."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def file_exists(name):
    return any(path == name or path.endswith("/" + name) for path in tracked_files())


def sql_strings_after(sql, pattern):
    """Each SQL string literal right after `pattern`, '' unescaped, with its line."""
    for m in re.finditer(pattern + r"\s*(?:format\(\s*)?'((?:[^']|'')*)'", sql, re.I | re.S):
        yield sql.count("\n", 0, m.start()) + 1, m.group(1).replace("''", "'")


def normalise(text):
    text = re.sub(r"\{[A-Za-z_0-9]*(?::[^}]*)?\}", "{}", text)
    return re.sub(r"\s+", " ", text).strip()


def raised_by_extension(hint, strings, patterns):
    hint = normalise(hint)
    return hint in strings or any(p.fullmatch(hint) for p in patterns)


def rust_strings(files):
    strings = set()
    for text in files.values():
        for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', text, re.S):
            s = m.group(1)
            s = re.sub(r"\\\n\s*", "", s)  # a line continuation
            s = s.replace('\\"', '"').replace("\\\\", "\\").replace("\\n", "\n")
            strings.add(normalise(s))
    # A format: each placeholder stands for any text. Only formats with words of their
    # own: "{}: {}" would match any hint.
    patterns = [
        re.compile(".+?".join(re.escape(part) for part in s.split("{}")))
        for s in strings
        if "{}" in s and len(re.sub(r"\W", "", s.replace("{}", ""))) >= 12
    ]
    return strings, patterns


def main():
    files = rust_files()
    strings, patterns = rust_strings(files)
    problems = []
    named = hints = 0
    for path in sorted(EDITION.glob("*.sql")):
        sql = path.read_text()
        rel = path.relative_to(ROOT)
        for number, comment in comments(sql):
            for m in RUST_PATH.finditer(comment):
                named += 1
                if not resolves(files, m.group(1)):
                    problems.append(f"{rel}:{number}: names {m.group(1)}, which src/ does not define")
            for m in FILE_NAME.finditer(comment):
                named += 1
                if not file_exists(m.group(1)):
                    problems.append(f"{rel}:{number}: names {m.group(1)}, which is not in the tree")
        for pattern in (r"\bHINT\s*=", r"\b[a-z_]*hint\s+(?:constant\s+)?text\s*:="):
            for number, hint in sql_strings_after(sql, pattern):
                hints += 1
                if hint not in EDITION_ONLY and not raised_by_extension(hint, strings, patterns):
                    problems.append(f"{rel}:{number}: a hint the extension does not raise: {hint!r}")
    if problems:
        print("check-edition: the SQL edition drifted from src/:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 1
    print(f"check-edition: {named} names of Rust items and files resolve, {hints} hints are the extension's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
