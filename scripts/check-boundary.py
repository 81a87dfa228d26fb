#!/usr/bin/env python3
"""Check the SQL boundary: every C function that sql/functions.sql declares is backed by a
`#[pg_extern(sql = false)]` Rust function in src/api/ with the same arguments, in the same
order, of matching types. pgrx unboxes a function's arguments in the order of its Rust
signature, while the SQL declaration is hand-written: this check is what makes the two
agree, so that a reordered or retyped argument fails here instead of reading the wrong
datum at run time.
"""

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
    "Interval": "interval",
    "TimestampWithTimeZone": "timestamptz",
    "Jsonb": "jsonb",
    "JsonbArray": "jsonb[]",
    "Vec<Option<String>>": "text[]",
    "Vec<Option<i64>>": "bigint[]",
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


def sql_functions():
    """name -> [(argument name or None, type)] for each LANGUAGE c function."""
    text = (root / "sql/functions.sql").read_text()
    found = {}
    for m in re.finditer(r"^CREATE FUNCTION once(?:_internal)?\.(\w+)\((.*?)\)\s*\nRETURNS(.*?);", text,
                         flags=re.M | re.S):
        name, args, rest = m.groups()
        if "LANGUAGE c" not in rest:
            continue
        wrapper = re.search(r"'MODULE_PATHNAME', '(\w+)_wrapper'", rest)
        if not wrapper or wrapper.group(1) != name:
            print(f"sql/functions.sql: {name} must be AS 'MODULE_PATHNAME', '{name}_wrapper'")
            sys.exit(1)
        parsed = []
        for arg in split_top_level(args):
            arg = re.sub(r"\s+DEFAULT\s+.*$", "", arg, flags=re.S)
            words = arg.split()
            parsed.append((None, words[0]) if len(words) == 1 else (words[0], words[1]))
        found[name] = parsed
    return found


def rust_functions():
    """name -> [(argument name, SQL type)] for each #[pg_extern(sql = false)] in src/api."""
    found = {}
    for path in sorted((root / "src/api").glob("*.rs")):
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
        problems.append(f"once.{name} is declared in sql/functions.sql but has no "
                        "#[pg_extern(sql = false)] fn in src/api/")
    elif name not in sql:
        problems.append(f"src/api/: {name} has no CREATE FUNCTION in sql/functions.sql")
    else:
        declared = [(n, t) for n, t in sql[name]]
        expected = rust[name]
        same = len(declared) == len(expected) and all(
            (dn is None or dn == rn) and dt == rt
            for (dn, dt), (rn, rt) in zip(declared, expected))
        if not same:
            problems.append(f"once.{name}: sql/functions.sql declares {declared}, "
                            f"the Rust function takes {expected}")
for p in problems:
    print(p)
if problems:
    sys.exit(1)
print(f"sql/functions.sql: all {len(sql)} C functions match their Rust functions in src/api/")
