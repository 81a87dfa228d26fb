#!/usr/bin/env python3
"""Check the SQL boundary: every C function that sql/functions.sql declares is backed by a
`#[pg_extern(sql = false)]` Rust function in src/api/ with the same arguments, in the same
order, of matching types. pgrx unboxes a function's arguments in the order of its Rust
signature, while the SQL declaration is hand-written: this check is what makes the two
agree, so that a reordered or retyped argument fails here instead of reading the wrong
datum at run time.

It also checks that a C symbol keeps the SQL signature it had in every release (each line
of RELEASES, read from its commit): a package upgrade replaces the library before ALTER EXTENSION UPDATE replaces
the declarations, so an old declaration may call the new library by symbol name. A
function whose arguments or result change gets a new Rust name, <sql name>_<major>_<minor>
for the release of its signature, and with it a new symbol (CONTRIBUTING.md, "Upgrades").
"""

import subprocess

import re
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent

# Rust argument types of the SQL surface, and the SQL type each stands for.
RUST_TO_SQL = {
    "&str": "text",
    "String": "text",
    "i32": "integer",
    "i64": "bigint",
    "bool": "boolean",
    "f64": "float8",
    "Interval": "interval",
    "TimestampWithTimeZone": "timestamptz",
    "Jsonb": "jsonb",
    "JsonbArray": "jsonb[]",
    "Vec<Option<String>>": "text[]",
    "Vec<Option<i64>>": "bigint[]",
    "&[u8]": "bytea",
    "pg_sys::ItemPointerData": "tid",
    # An Oid argument is a role: regrole's datum is the role's oid.
    "pg_sys::Oid": "regrole",
}


def split_top_level(text):
    """Split on commas outside parentheses, brackets and quotes."""
    parts, depth, quoted, current = [], 0, False, ""
    for ch in text:
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch in "(<[":
            depth += 1
        elif not quoted and ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return [p.strip() for p in parts if p.strip()]


SQL_FILES = ("sql/schema.sql", "sql/functions.sql")
DECLARATION = re.compile(
    r"CREATE (?:OR REPLACE )?FUNCTION once(?:_internal)?\.(\w+)\((.*?)\)\s*RETURNS(.*?);", flags=re.S)


def declarations(text):
    """symbol -> (SQL name, [(argument name or None, type)], result) for each LANGUAGE c
    function declared in `text`."""
    found = {}
    for m in DECLARATION.finditer(text):
        name, args, rest = m.groups()
        if "LANGUAGE c" not in rest:
            continue
        symbol = re.search(r"'MODULE_PATHNAME', '(\w+)'", rest).group(1)
        parsed = []
        for arg in split_top_level(args):
            arg = re.sub(r"\s+DEFAULT\s+.*$", "", arg, flags=re.S)
            words = arg.split()
            parsed.append((None, words[0]) if len(words) == 1 else (words[0], words[1]))
        result = " ".join(rest.split("LANGUAGE")[0].split())
        found[symbol] = (name, parsed, result)
    return found


def sql_functions():
    """Rust function name -> [(argument name or None, type)] for each LANGUAGE c function."""
    found = {}
    for file in SQL_FILES:
        for symbol, (name, args, result) in declarations((root / file).read_text()).items():
            if result == "trigger":
                continue  # #[pg_trigger] functions in src/api/triggers.rs, no SQL arguments
            rust = re.fullmatch(r"(\w+)_wrapper", symbol)
            if not rust or not re.fullmatch(rf"{name}(_\d+_\d+)?", rust.group(1)):
                print(f"{file}: once.{name} must be AS 'MODULE_PATHNAME', '{name}_wrapper' "
                      f"(or '{name}_<major>_<minor>_wrapper' for a changed signature)")
                sys.exit(1)
            found[rust.group(1)] = args
    return found


def release_commits():
    """(version, commit) for each line of RELEASES, each commit present in this clone."""
    lines = [line.split() for line in (root / "RELEASES").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    for version, commit in lines:
        if not has_commit(commit):
            # A shallow clone: its history comes from where it was cloned.
            subprocess.run(["git", "-C", str(root), "fetch", "--quiet", "--unshallow"],
                           capture_output=True)
        if not has_commit(commit):
            print(f"check-boundary: release {version} is commit {commit}, which this clone "
                  "lacks: run `git fetch --unshallow` (a clone with --depth has no history)")
            sys.exit(1)
        yield version, commit


def has_commit(commit):
    return subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0


def released_symbols():
    """(release, symbol, signature) for each C function of each release."""
    for version, commit in release_commits():
        for file in SQL_FILES:
            shown = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{file}"],
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                for symbol, (_, args, result) in declarations(shown.stdout).items():
                    yield version, symbol, ([t for _, t in args], result)


def rust_functions():
    """name -> [(argument name, SQL type)] for each #[pg_extern(sql = false)] in src/api."""
    found = {}
    for path in sorted((root / "src/api").glob("*.rs")):
        if path.name == "retired.rs":
            continue  # checked against the releases below
        text = path.read_text()
        for m in re.finditer(r"#\[pg_extern\(sql = false\)\]\s*(?:#\[[^\]]*\]\s*)*fn (\w+)\((.*?)\)\s*(?:->|\{)",
                             text, flags=re.S):
            name, params = m.groups()
            args = []
            for param in split_top_level(params):
                arg, rust_type = (s.strip() for s in param.split(":", 1))
                if rust_type == "pg_sys::FunctionCallInfo":
                    continue  # pgrx passes the call itself; not an SQL argument
                inner = re.fullmatch(r"Option<(.*)>", rust_type)
                if not inner:
                    print(f"{path.relative_to(root)}: {name}({arg}) must be an Option, "
                          "so that NULL reaches the argument check")
                    sys.exit(1)
                sql_type = RUST_TO_SQL.get(inner.group(1))
                if sql_type is None:
                    print(f"{path.relative_to(root)}: {name}({arg}: {rust_type}): add its SQL "
                          "type to RUST_TO_SQL in scripts/check-boundary.py")
                    sys.exit(1)
                args.append((arg, sql_type))
            found[name] = args
    return found


sql, rust = sql_functions(), rust_functions()
problems = []
for name in sorted(set(sql) | set(rust)):
    if name not in rust:
        problems.append(f"{name}_wrapper is declared in {' or '.join(SQL_FILES)} but has no "
                        "#[pg_extern(sql = false)] fn in src/api/")
    elif name not in sql:
        problems.append(f"src/api/: {name} has no CREATE FUNCTION in {' or '.join(SQL_FILES)}")
    else:
        declared = [(n, t) for n, t in sql[name]]
        expected = rust[name]
        same = len(declared) == len(expected) and all(
            (dn is None or dn == rn) and dt == rt
            for (dn, dt), (rn, rt) in zip(declared, expected))
        if not same:
            problems.append(f"{name}_wrapper: sql/ declares {declared}, "
                            f"the Rust function takes {expected}")
now = {}
for file in SQL_FILES:
    for symbol, (_, args, result) in declarations((root / file).read_text()).items():
        now[symbol] = ([t for _, t in args], result)
releases = list(released_symbols())
for version, symbol, signature in releases:
    if symbol in now and now[symbol] != signature:
        problems.append(f"{symbol}: {version} declared it {signature}, now {now[symbol]}: "
                        "a changed signature needs a new Rust name, <sql name>_<major>_<minor>")
# Each symbol a release declared and the current SQL no longer does stays in the library
# as a stub in src/api/retired.rs, refusing with the version check's message.
retired_text = (root / "src/api/retired.rs").read_text()
retired = set(re.findall(r"#\[pg_extern\(sql = false\)\]\s*fn (\w+)\(", retired_text))
released = {symbol for _, symbol, _ in releases}
for symbol in sorted(released - set(now)):
    if symbol.removesuffix("_wrapper") not in retired:
        problems.append(f"{symbol}: declared by a release, gone now: add a stub for it to "
                        "src/api/retired.rs")
for name in sorted(retired):
    if f"{name}_wrapper" not in released or f"{name}_wrapper" in now:
        problems.append(f"src/api/retired.rs: {name} must be a symbol of a release that the "
                        "current SQL no longer declares")
for p in problems:
    print(p)
if problems:
    sys.exit(1)
print(f"sql/: all {len(sql)} C functions match their Rust functions in src/api/, and every "
      "released symbol keeps its signature")
