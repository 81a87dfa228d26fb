#!/usr/bin/env python3
"""Writes the SQL edition (docs/sql-edition.md): pg_once as a plain PL/pgSQL script for
servers that load no C library. Run through scripts/sql-edition.sh DIR.

The script is assembled, never written by hand as a whole, so that the rules exist once:
- the tables, types, indexes and their COMMENTs are taken from sql/schema.sql, made
  re-runnable (IF NOT EXISTS), so that the edition's tables are the extension's;
- the control flow is sql/edition/*.sql (PL/pgSQL), where `{{sql:NAME}}` stands for the
  statement src/protocol/sql/NAME.sql, spliced with its rules exactly as
  storage::statements::splice does for the extension (comment lines dropped, `{{rule(a=v)}}`
  replaced by the rule's text with `{a}` replaced by v), and each named parameter `$name`
  turned into `param.name`: a variable of the calling function's block labelled `param`.
  The functions declare `#variable_conflict use_column`, so a bare name in a statement is
  always a column and a parameter is always written `param.`: static SQL, planned once
  per session by PL/pgSQL like the extension's prepared plans, and readable as the file.
"""
import re
import sys
from pathlib import Path

import sql_edition_tle  # the views and once.cached (taken from sql/functions.sql), and the pg_tle form

ROOT = Path(__file__).resolve().parent.parent
STATEMENTS = ROOT / "src/protocol/sql"
RULES = STATEMENTS / "rules"


def uncommented(sql):
    """storage::statements::uncommented: the text without its `--` lines, trimmed."""
    return "\n".join(l for l in sql.splitlines() if not l.lstrip().startswith("--")).strip()


def splice(sql):
    """storage::statements::splice, line for line (its errors too)."""
    sql = uncommented(sql)
    out, rest = [], sql
    while (start := rest.find("{{")) >= 0:
        out.append(rest[:start])
        end = rest.find("}}", start)
        if end < 0:
            raise SystemExit("a {{ without its }}")
        call = rest[start + 2:end]
        name, _, given = call.partition("(")
        if given and not given.endswith(")"):
            raise SystemExit(f"rule {name}: no ) before }}}}")
        given = given[:-1] if given else ""
        path = RULES / f"{name}.sql"
        if not path.exists():
            raise SystemExit(f"no rule {name}")
        text = uncommented(path.read_text())
        for arg in (a for a in given.split(";") if a.strip()):
            param, sep, value = arg.partition("=")
            if not sep:
                raise SystemExit(f"rule {name}: {arg!r} is not param=value")
            placeholder = "{" + param.strip() + "}"
            if placeholder not in text:
                raise SystemExit(f"rule {name} has no parameter {param.strip()}")
            text = text.replace(placeholder, value)
        if "{" in text:
            raise SystemExit(f"rule {name}: a parameter not given at {text[text.find('{'):]}")
        out.append(text)
        rest = rest[end + 2:]
    out.append(rest)
    return "".join(out)


def statement(name):
    """src/protocol/sql/NAME.sql for PL/pgSQL: spliced, `$name` as `param.name`."""
    return re.sub(r"\$([a-z_][a-z0-9_]*)", r"param.\1", splice((STATEMENTS / f"{name}.sql").read_text()))


def expand(text):
    def one(m):
        indent = m.group(1)
        return indent + statement(m.group(2)).replace("\n", "\n" + indent)
    return re.sub(r"^([ \t]*)\{\{sql:([a-z_]+)\}\}", one, text, flags=re.M)


def statements_of(sql):
    """sql split into statements at top-level semicolons (quotes, dollar quotes and
    comments respected), each with the comment lines just above it."""
    out, i, start = [], 0, 0
    while i < len(sql):
        if sql.startswith("--", i):
            i = sql.find("\n", i)
            i = len(sql) if i < 0 else i
        elif sql[i] == "'":
            i = sql.find("'", i + 1) + 1
            while sql.startswith("'", i):  # '' inside a literal
                i = sql.find("'", i + 1) + 1
            continue
        elif (m := re.match(r"\$[A-Za-z_]*\$", sql[i:])):
            i = sql.find(m.group(0), i + len(m.group(0))) + len(m.group(0))
            continue
        elif sql[i] == ";":
            out.append(sql[start:i + 1].strip())
            start = i + 1
        i += 1
    return out


# The objects of schema.sql the edition shares, by the name each statement creates or
# comments on. What is left out is C (trigger functions, the library check) or belongs to
# parts of issue 28 not done yet (namespaces' caches, key counts, the token sequence's
# DO block, whose edition form is in sql/edition/schema.sql).
SHARED = ("TYPE once.key_state", "TYPE once.claim", "COLUMN once.claim.",
          "TABLE once.queues", "COLUMN once.queues.", "INDEX entries_", "INDEX attempts_",
          "TABLE once_internal.namespace_owners", "COLUMN once_internal.namespace_owners.",
          "TABLE once.entries", "COLUMN once.entries.", "TABLE once.attempts",
          "COLUMN once.attempts.", "SCHEMA once_internal", "SCHEMA once ",
          # Second pass, once sql/edition/schema.sql has declared the trigger functions
          # (record_attempt is PL/pgSQL in both editions; notify_key_resolved is C there).
          "FUNCTION once_internal.record_attempt", "FUNCTION once_internal.notify_key_resolved",
          "TRIGGER entries_notify_", "TRIGGER entries_record_")
# once.key_hash is LANGUAGE internal there, which only a superuser may declare: the
# edition declares its own (sql/edition/schema.sql).


def shared_schema(second):
    """The SHARED statements of schema.sql: tables, types and indexes (second=False), or
    the functions and triggers that need sql/edition/schema.sql first (second=True)."""
    out = []
    for stmt in statements_of((ROOT / "sql/schema.sql").read_text()):
        code = uncommented(stmt)
        head = re.match(r"(CREATE|COMMENT ON|INSERT INTO)\s+(?:UNIQUE\s+)?(\S+\s+\S+)", code)
        if not head:
            continue
        obj = head.group(2) + " "
        if re.search(r"\bLANGUAGE c\b", code):
            continue  # C: the edition declares its own, in sql/edition/schema.sql
        late = obj.startswith("FUNCTION") or obj.startswith("TRIGGER")
        if late != second:
            continue
        if not any(obj.startswith(s) or (head.group(1) == "INSERT INTO" and "once.queues" in obj)
                   for s in SHARED):
            continue
        # Re-runnable: what exists is kept, with its rows and grants (CREATE TYPE has no
        # IF NOT EXISTS: a duplicate is caught instead).
        if code.startswith("CREATE TABLE") or code.startswith("CREATE INDEX") or code.startswith("CREATE SCHEMA"):
            stmt = re.sub(r"CREATE (TABLE|INDEX|SCHEMA) ", r"CREATE \1 IF NOT EXISTS ", stmt, count=1)
        elif code.startswith("CREATE TYPE"):
            body = code.rstrip(";")
            stmt = ("DO $type$ BEGIN\n" + body + ";\nEXCEPTION WHEN duplicate_object THEN NULL;\nEND $type$;")
        elif code.startswith("CREATE FUNCTION"):
            stmt = stmt.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
        elif code.startswith("CREATE TRIGGER"):
            stmt = stmt.replace("CREATE TRIGGER", "CREATE OR REPLACE TRIGGER", 1)
        elif code.startswith("INSERT INTO"):
            stmt = stmt.rstrip(";") + "\n    ON CONFLICT DO NOTHING;"
        out.append(stmt)
    return "\n\n".join(out)


def main(out_dir):
    edition = ROOT / "sql/edition"
    parts = [
        "-- pg_once, SQL edition: generated by scripts/sql-edition.sh from sql/schema.sql,",
        "-- sql/edition/*.sql and src/protocol/sql/. Do not edit: see docs/sql-edition.md.",
        "\\set ON_ERROR_STOP 1",
        "BEGIN;",
        "-- A rerun finds every table and index: not worth a NOTICE each.",
        "SET LOCAL client_min_messages = warning;",
        "-- Every name the script creates is qualified; pg_catalog first, so that nothing a",
        "-- role could create in another schema of the installer's path (an operator, a",
        "-- function) is resolved by the statements and SQL functions it declares.",
        "SET LOCAL search_path = pg_catalog, pg_temp;",
        (edition / "prelude.sql").read_text(),
        "-- ---- from sql/schema.sql ----",
        shared_schema(False),
        expand((edition / "schema.sql").read_text()),
        "-- ---- from sql/schema.sql: trigger functions and triggers ----",
        shared_schema(True),
        expand((edition / "namespaces.sql").read_text()),
        expand((edition / "core.sql").read_text()),
        expand((edition / "queue.sql").read_text()),
        *sql_edition_tle.extra_parts(),
        (edition / "finish.sql").read_text(),
        *sql_edition_tle.late_parts(),
        "COMMIT;",
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pg_once_sql.sql").write_text("\n\n".join(parts) + "\n")
    sql_edition_tle.write_tle(out)


if __name__ == "__main__":
    main(sys.argv[1])
