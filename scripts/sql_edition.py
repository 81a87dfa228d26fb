#!/usr/bin/env python3
"""Writes the SQL edition (docs/sql-edition.md): pg_once as a plain PL/pgSQL script for
servers that load no C library. Run through scripts/sql-edition.sh DIR.

The script is assembled, never written by hand as a whole, so that the rules exist once:
- the tables, types, indexes and their COMMENTs are taken from sql/schema.sql, made
  re-runnable (IF NOT EXISTS), so that the edition's tables are the extension's;
- the rules of interval, integer and text arguments are src/api/argument_rules.json's,
  written in where `{{interval_rules}}` and `{{integer_rules}}` stand
  (once_internal.usable_interval, usable_integer), and where `{{text_check:RULE VALUE
  [SHOWN]}}` stands (the checks of the text VALUE by RULE, called SHOWN in errors: an SQL
  expression, the rule's name by default), as args.rs reads them;
- the control flow is sql/edition/*.sql (PL/pgSQL), where `{{sql:NAME}}` stands for the
  statement src/protocol/sql/NAME.sql, spliced with its rules by the extension's own
  splicer (the pg_once_splice crate in splice/, run as `splice-statements`: comment lines
  dropped, `{{rule(a=v)}}` replaced by the rule's text with `{a}` replaced by v), so the
  edition runs the text the extension prepares, and each named parameter `$name`
  turned into `param.name`: a variable of the calling function's block labelled `param`.
  The functions declare `#variable_conflict use_column`, so a bare name in a statement is
  always a column and a parameter is always written `param.`: static SQL, planned once
  per session by PL/pgSQL like the extension's prepared plans, and readable as the file.
"""
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import sql_edition_tle  # the views and once.cached (taken from sql/functions.sql), and the pg_tle form

ROOT = Path(__file__).resolve().parent.parent
STATEMENTS = ROOT / "src/protocol/sql"


def uncommented(sql):
    """The text without its `--` lines, trimmed (as pg_once_splice::uncommented): a schema
    statement, to tell code from comments."""
    return "\n".join(l for l in sql.splitlines() if not l.lstrip().startswith("--")).strip()


@functools.cache
def spliced():
    """Every statement of src/protocol/sql/, its rules spliced in, by name."""
    run = subprocess.run(
        ["cargo", "run", "--quiet", "--manifest-path", str(ROOT / "splice/Cargo.toml"),
         "--bin", "splice-statements", "--", str(STATEMENTS)],
        capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"splice-statements failed:\n{run.stderr}")
    return json.loads(run.stdout)


def statement(name):
    """src/protocol/sql/NAME.sql for PL/pgSQL: spliced, `$name` as `param.name`."""
    if name not in spliced():
        raise SystemExit(f"{{{{sql:{name}}}}}: no statement src/protocol/sql/{name}.sql")
    return re.sub(r"\$([a-z_][a-z0-9_]*)", r"param.\1", spliced()[name])


@functools.cache
def argument_rules():
    """src/api/argument_rules.json, which args.rs reads too."""
    return json.loads((ROOT / "src/api/argument_rules.json").read_text())


def rule_arm(rule, bounds):
    """One WHEN arm of usable_interval's or usable_integer's CASE: `rule`, its `bounds`
    assigned as the function names them."""
    literal = sql_edition_tle.sql_literal
    return (f"WHEN {literal(rule['name'])} THEN nullable := {str(rule['null'] == 'allowed').lower()}; "
            f"{bounds}\n    hint := {literal(rule['hint'])};")


def interval_rules():
    """The interval rules, as once_internal.usable_interval's CASE arms."""
    return [rule_arm(r, f"positive := {str(r['least'] == 'positive').lower()}; "
                        f"most := {sql_edition_tle.sql_literal(r['most'])};")
            for r in argument_rules()["intervals"]]


def integer_rules():
    """The integer rules, as once_internal.usable_integer's CASE arms."""
    number = lambda n: "NULL" if n is None else str(int(n))
    return [rule_arm(r, f"low := {number(r['least'])}; high := {number(r['most'])};")
            for r in argument_rules()["integers"]]


def text_check(rule_name, value, shown=None):
    """The checks of text argument `value` (an SQL expression without spaces) by its rule
    of argument_rules.json, as args::text makes them: an IF statement raising the rule's
    SQLSTATE, message and hint. `shown` (SQL) names the argument in messages. Operators
    and functions are schema-qualified: the SECURITY INVOKER functions that hold such a
    check run with the caller's search_path."""
    literal = sql_edition_tle.sql_literal
    rules = {r["name"]: r for r in argument_rules()["texts"]}
    if rule_name not in rules:
        raise SystemExit(f"{{{{text_check:{rule_name} ...}}}}: argument_rules.json has no text rule {rule_name}")
    rule = rules[rule_name]
    shown = shown or literal(rule_name)
    hint = lambda which: literal(rule.get(which) or rule["hint"])
    arms = []
    if rule["null"] == "refused":
        arms.append((f"{value} IS NULL",
                     f"RAISE EXCEPTION '% must not be NULL', {shown}\n"
                     f"    USING ERRCODE = 'null_value_not_allowed', HINT = {hint('hint')};"))
    if rule["empty"] == "refused":
        arms.append((f"{value} OPERATOR(pg_catalog.=) ''",
                     f"RAISE EXCEPTION '% must not be empty', {shown}\n"
                     f"    USING ERRCODE = 'invalid_parameter_value', HINT = {hint('empty_hint')};"))
    if rule["most_bytes"] is not None:
        most = int(rule["most_bytes"])
        arms.append((f"pg_catalog.octet_length({value}) OPERATOR(pg_catalog.>) {most}",
                     f"RAISE EXCEPTION '% is % bytes long; the limit is {most} bytes', {shown}, "
                     f"pg_catalog.octet_length({value})\n"
                     f"    USING ERRCODE = 'string_data_right_truncation', HINT = {hint('long_hint')};"))
    lines = []
    for i, (condition, action) in enumerate(arms):
        lines.append(f"{'IF' if i == 0 else 'ELSIF'} {condition} THEN")
        lines.extend("    " + line for line in action.split("\n"))
    lines.append("END IF;")
    return "\n".join(lines)


def expand(text):
    def one(m):
        indent = m.group(1)
        return indent + statement(m.group(2)).replace("\n", "\n" + indent)

    def rules(m):
        indent, arms = m.group(1), {"interval": interval_rules, "integer": integer_rules}[m.group(2)]()
        return "\n".join(indent + arm.replace("\n", "\n" + indent) for arm in arms)
    text = re.sub(r"^([ \t]*)\{\{(interval|integer)_rules\}\}", rules, text, flags=re.M)
    text = re.sub(r"^([ \t]*)\{\{text_check:([a-z_]+) (\S+)(?: (.+?))?\}\}$",
                  lambda m: m.group(1) + text_check(m.group(2), m.group(3), m.group(4))
                  .replace("\n", "\n" + m.group(1)), text, flags=re.M)
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


# ---- who is judged: once.* as SECURITY INVOKER wrappers (docs/sql-edition.md) --------
#
# Each function of the API is written in sql/edition/ as one SECURITY DEFINER function
# `once.NAME`, as if PL/pgSQL could see who called it. It cannot: in a SECURITY DEFINER
# function current_user is its owner, and the session's user (what the edition judged
# before) is not the current user of an index expression under ANALYZE, autovacuum, a
# materialized view or another role's SECURITY DEFINER code. So each is installed as two:
# - `once_internal.NAME(calling_role name, <its arguments>)`, the function as written,
#   SECURITY DEFINER, whose first declaration is `once_internal.vouch(...)`: it refuses
#   (42501) unless its caller's frame of the call stack is once.NAME's own, then makes
#   calling_role the role every check judges (once_internal.caller());
# - `once.NAME(<its arguments, defaults included>)`, SECURITY INVOKER with search_path
#   pinned, whose one statement passes current_user, which in a SECURITY INVOKER
#   function is the calling context's current user, exactly what the extension's C
#   functions judge (GetUserId()), to the implementation, as a simple expression (no
#   SPI call, whose "SQL statement" context line would carry query text a caller chooses:
#   once_internal.vouch says why that matters).
# A function that returns a set (RETURNS TABLE) cannot be a simple expression: its body
# becomes `once_internal.NAME(<its arguments>)` (SET-returning, not granted: it runs
# inside the implementation, as the installing role), the implementation returns its rows
# as an array of the composite type `once_internal.NAME_row`, and once.NAME unnests them.

API_FUNCTION = re.compile(
    r"(?P<head>(?:[ \t]*--[^\n]*\n|[ \t]*\n)*)CREATE OR REPLACE FUNCTION once\.(?P<name>\w+)\((?P<params>.*?)\)\s*"
    r"RETURNS (?P<returns>[^\n]+)\n(?P<language>LANGUAGE plpgsql [^\n]*?) SECURITY DEFINER\n"
    r"(?P<settings>(?:SET [^\n]*\n)*)AS \$\$\n(?P<body>.*)\$\$;\Z", re.S)

# What finish.sql must grant, after it closes to PUBLIC what this run created: the
# implementations are called by the wrappers as the caller (who therefore needs EXECUTE),
# and each refuses any other caller.
IMPLEMENTATIONS = []


def split_params(params):
    """`name type [DEFAULT expr]` items of a parameter list, split at top-level commas."""
    out, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(params):
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch in "([":
            depth += 1
        elif not quoted and ch in ")]":
            depth -= 1
        elif not quoted and depth == 0 and ch == ",":
            out.append(params[start:i])
            start = i + 1
    if params.strip():
        out.append(params[start:])
    items = []
    for item in out:
        item = " ".join(item.split())
        name, rest = item.split(" ", 1)
        typ = re.split(r"\s+DEFAULT\s+", rest, maxsplit=1)[0]
        items.append((name, typ, item))
    return items


def vouched(body, name, types):
    """`body` with once_internal.vouch as its first declaration."""
    line = (f"    vouched oid := once_internal.vouch(calling_role, "
            f"'once.{name}({','.join(types)})'::pg_catalog.regprocedure);\n")
    m = re.search(r"^(DECLARE|BEGIN)\s*$", body, re.M)
    if m is None:
        raise SystemExit(f"once.{name}: no DECLARE or BEGIN")
    if m.group(1) == "DECLARE":
        return body[:m.end()] + "\n" + line + body[m.end() + 1:]
    return body[:m.start()] + "DECLARE\n" + line + body[m.start():]


def invoker_api(text):
    """Every SECURITY DEFINER function of schema once in `text` as a SECURITY INVOKER
    wrapper and its implementation (above)."""
    out = []
    for stmt in statements_of(text):
        m = API_FUNCTION.match(stmt)
        if not m:
            if re.search(r"^CREATE OR REPLACE FUNCTION once\.\w+\(.*\bSECURITY DEFINER\b.*\bAS \$\$", stmt, re.S | re.M):
                raise SystemExit(f"a SECURITY DEFINER function of schema once not in invoker_api's form:\n{stmt[:300]}")
            out.append(stmt)
            continue
        name, returns, language, settings = m["name"], m["returns"], m["language"], m["settings"]
        params = split_params(m["params"])
        names = [p[0] for p in params]
        types = [p[1] for p in params]
        plain = ", ".join(f"{n} {t}" for n, t, _ in params)
        impl_params = ", ".join(["calling_role name"] + [f"{n} {t}" for n, t, _ in params])
        args = ", ".join(["current_user"] + [f"${i + 1}" for i in range(len(params))])
        table = re.fullmatch(r"TABLE \((.*)\)", returns)
        head = m["head"]
        wrapper_head = (f"CREATE OR REPLACE FUNCTION once.{name}({m['params']})\nRETURNS {returns}\n"
                        f"{language}\nSET search_path = pg_catalog, pg_temp\nAS $$\n")
        if table:
            row = f"once_internal.{name}_row"
            out.append(f"{head}-- once.{name}'s rows, as its implementation returns them.\n"
                       f"DO $type$ BEGIN\nCREATE TYPE {row} AS ({table[1]});\n"
                       f"EXCEPTION WHEN duplicate_object THEN NULL;\nEND $type$;")
            # The body, as written, without SECURITY DEFINER: it runs inside the
            # implementation, with the installing role's rights.
            out.append(f"CREATE OR REPLACE FUNCTION once_internal.{name}({plain})\nRETURNS {returns}\n"
                       f"{language}\n{settings}AS $$\n{m['body']}$$;")
            impl_body = vouched(
                "BEGIN\n"
                f"    RETURN ARRAY(SELECT ROW(r.*)::{row} FROM once_internal.{name}("
                + ", ".join(f"${i + 2}" for i in range(len(names))) + ") r);\nEND\n", name, types)
            out.append(f"CREATE OR REPLACE FUNCTION once_internal.{name}({impl_params})\nRETURNS {row}[]\n"
                       f"{language} SECURITY DEFINER\nSET search_path = pg_catalog, pg_temp\n"
                       f"AS $$\n{impl_body}$$;")
            out.append(wrapper_head + f"DECLARE\n    rows {row}[];\nBEGIN\n"
                       f"    rows := once_internal.{name}({args});\n"
                       f"    RETURN QUERY SELECT * FROM pg_catalog.unnest(rows);\nEND\n$$;")
            impl_types = [row + "[]"]
        else:
            out.append(f"{head}CREATE OR REPLACE FUNCTION once_internal.{name}({impl_params})\n"
                       f"RETURNS {returns}\n{language} SECURITY DEFINER\n{settings}"
                       f"AS $$\n{vouched(m['body'], name, types)}$$;")
            if returns == "void":
                # A void result cannot be RETURNed nor assigned; a condition is a simple
                # expression too (PERFORM would go through SPI).
                call = f"    IF once_internal.{name}({args}) IS NULL THEN\n    END IF;\n"
            else:
                call = f"    RETURN once_internal.{name}({args});\n"
            out.append(wrapper_head + "BEGIN\n" + call + "END\n$$;")
        IMPLEMENTATIONS.append(f"once_internal.{name}({', '.join(['name'] + types)})")
    return "\n\n".join(out)


def implementation_grants():
    """After finish.sql: EXECUTE on the implementations for every role (each refuses
    any caller but its wrapper, and the wrapper's EXECUTE is what an administrator
    grants)."""
    return "\n".join(["-- The implementations behind once.* (scripts/sql_edition.py, invoker_api)."]
                     + [f"GRANT EXECUTE ON FUNCTION {f} TO PUBLIC;" for f in IMPLEMENTATIONS])


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
        invoker_api(expand((edition / "namespaces.sql").read_text())),
        invoker_api(expand((edition / "core.sql").read_text())),
        invoker_api(expand((edition / "queue.sql").read_text())),
        *sql_edition_tle.extra_parts(),
        (edition / "finish.sql").read_text(),
        *sql_edition_tle.late_parts(),
        implementation_grants(),
        "COMMIT;",
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pg_once_sql.sql").write_text("\n\n".join(parts) + "\n")
    sql_edition_tle.write_tle(out)


if __name__ == "__main__":
    main(sys.argv[1])
