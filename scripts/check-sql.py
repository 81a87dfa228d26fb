#!/usr/bin/env python3
"""Fail on an operator in sql/*.sql that PostgreSQL would look up by search_path.

CREATE EXTENSION and ALTER EXTENSION UPDATE run the scripts with search_path set to the
extension's schema, `once`. PostgreSQL searches pg_catalog first, but an operator whose
argument types match better (an exact `int[] < int[]` against pg_catalog's `anyarray <
anyarray`) wins from any schema on the path: whoever could create objects in `once`
would choose what an unqualified operator means, and run code as the installing
superuser. The scripts refuse a schema `once` they do not trust (schema.sql's first
block), and every operator they resolve is written `OPERATOR(pg_catalog.<)`, so that
neither defence depends on the other.

Checked: what PostgreSQL resolves while the script runs: every statement (view
definitions, index predicates, trigger conditions, defaults), the bodies of DO blocks,
`BEGIN ATOMIC` bodies, and the bodies of LANGUAGE sql functions without a pinned
search_path (validated, so resolved, at creation). Not checked: PL/pgSQL function bodies
(resolved when called: with search_path pinned to pg_catalog for SECURITY DEFINER ones,
with the caller's own for SECURITY INVOKER ones, which run with nobody's rights but the
caller's), and SQL text a DO block builds and EXECUTEs (keep it to DDL without operators).

What counts as an operator lookup by name: `a < b` and every other operator expression,
and the forms that hide one: `IN (...)`, `BETWEEN`, `LIKE`, `IS DISTINCT FROM`, `NULLIF`,
`= ANY (...)`, `IN (SELECT ...)`, `CASE x WHEN`, `JOIN ... USING`, `NATURAL JOIN`,
`ORDER BY ... USING`. Write them with a qualified operator instead (`x
OPERATOR(pg_catalog.=) ANY (ARRAY[...])`, `a.k OPERATOR(pg_catalog.=) b.k`, ...). Mind the
precedence: `OPERATOR(...)` binds like any non-builtin operator, tighter than `<` and `=`
but looser than `+` and `-`, so `a > b - c` becomes `a OPERATOR(pg_catalog.>) (b
OPERATOR(pg_catalog.-) c)`, parenthesized.

Parsing is PostgreSQL's own parser (libpg_query, through pglast), not a regular
expression: operators inside strings, comments and identifiers are never mistaken for
code. Run: scripts/check-sql.py [FILE...] (default sql/*.sql); test.sh step 1 runs it in
a virtualenv with pglast.
"""

import json
import pathlib
import re
import sys

from pglast import parser

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A_Expr kinds whose operator is looked up by the name they carry.
HIDDEN = {
    "AEXPR_IN": "IN (...)",
    "AEXPR_LIKE": "LIKE",
    "AEXPR_ILIKE": "ILIKE",
    "AEXPR_SIMILAR": "SIMILAR TO",
    "AEXPR_BETWEEN": "BETWEEN",
    "AEXPR_NOT_BETWEEN": "NOT BETWEEN",
    "AEXPR_BETWEEN_SYM": "BETWEEN SYMMETRIC",
    "AEXPR_NOT_BETWEEN_SYM": "NOT BETWEEN SYMMETRIC",
    "AEXPR_DISTINCT": "IS DISTINCT FROM",
    "AEXPR_NOT_DISTINCT": "IS NOT DISTINCT FROM",
    "AEXPR_NULLIF": "NULLIF",
}


def names(node):
    return [n["String"]["sval"] for n in node]


def qualified(name_list):
    return len(name_list) == 2 and name_list[0] == "pg_catalog"


def unqualified_in(tree):
    """Yield a description of each operator in a parse tree that is not pg_catalog's."""
    if isinstance(tree, list):
        for item in tree:
            yield from unqualified_in(item)
        return
    if not isinstance(tree, dict):
        return
    for kind, node in tree.items():
        if kind == "A_Expr":
            name = names(node["name"])
            if node["kind"] in HIDDEN:
                yield f"{HIDDEN[node['kind']]} (operator {name[-1]}, looked up by search_path)"
            elif not qualified(name):
                yield f"operator {'.'.join(name)}"
        elif kind == "SubLink" and "operName" in node and not qualified(names(node["operName"])):
            yield f"{'.'.join(names(node['operName']))} ANY/ALL/IN (SELECT ...)"
        elif kind == "CaseExpr" and "arg" in node:
            yield "CASE x WHEN (operator =)"
        elif kind == "JoinExpr" and (node.get("usingClause") or node.get("isNatural")):
            yield "JOIN ... USING / NATURAL JOIN (operator =)"
        elif kind == "SortBy" and "useOp" in node and not qualified(names(node["useOp"])):
            yield f"ORDER BY ... USING {'.'.join(names(node['useOp']))}"
        yield from unqualified_in(node)


def parse_expression(query, mode):
    # PL/pgSQL's parse modes (libpg_query): 0 a statement, 2 an expression, 3 to 5 an
    # assignment `target := expression`.
    if mode in (3, 4, 5):
        query = query.split(":=", 1)[1]
    if mode:
        query = "SELECT " + query
    return json.loads(parser.parse_sql_json(query))


def plpgsql_findings(body):
    tag = "$check_sql$"
    assert tag not in body
    wrapped = f"CREATE FUNCTION pg_temp.body() RETURNS void LANGUAGE plpgsql AS {tag}{body}{tag}"
    found = []

    def walk(tree):
        if isinstance(tree, list):
            for item in tree:
                walk(item)
        elif isinstance(tree, dict):
            for kind, node in tree.items():
                if kind == "PLpgSQL_expr":
                    found.extend(unqualified_in(parse_expression(node["query"], node.get("parseMode", 0))))
                else:
                    walk(node)

    walk(json.loads(parser.parse_plpgsql_json(wrapped)))
    return found


def options(stmt):
    return {o["DefElem"]["defname"]: o["DefElem"].get("arg") for o in stmt.get("options", [])}


def findings(stmt):
    """Unqualified operators one top-level statement would resolve by search_path."""
    if "DoStmt" in stmt:
        args = {a["DefElem"]["defname"]: a["DefElem"]["arg"] for a in stmt["DoStmt"]["args"]}
        language = args.get("language", {"String": {"sval": "plpgsql"}})["String"]["sval"]
        assert language == "plpgsql", language
        return plpgsql_findings(args["as"]["String"]["sval"])
    if "CreateFunctionStmt" in stmt:
        create = stmt["CreateFunctionStmt"]
        opts = options(create)
        pinned = any(
            o["DefElem"]["defname"] == "set" and o["DefElem"]["arg"]["VariableSetStmt"]["name"] == "search_path"
            for o in create.get("options", [])
        )
        language = opts["language"]["String"]["sval"]
        # Argument defaults and BEGIN ATOMIC bodies are resolved at creation, whatever the
        # function's settings.
        found = list(unqualified_in({k: v for k, v in create.items() if k != "options"}))
        if language == "sql" and not pinned and "as" in opts:
            body = names(opts["as"]["List"]["items"])[0]
            found += unqualified_in(json.loads(parser.parse_sql_json(body)))
        elif language not in ("sql", "plpgsql", "c", "internal"):
            raise SystemExit(f"check-sql: no rule for functions in LANGUAGE {language}")
        return found
    return list(unqualified_in(stmt))


def check(path):
    text = path.read_text()
    # psql's meta-commands (the upgrade script's \echo ... \quit) are not SQL.
    sql = re.sub(r"(?m)^\\.*$", lambda m: " " * len(m.group(0)), text)
    problems = []
    for raw in json.loads(parser.parse_sql_json(sql))["stmts"]:
        for what in findings(raw["stmt"]):
            line = text.count("\n", 0, raw.get("stmt_location", 0)) + 1
            # The statement starts after the previous one's semicolon: skip its blank lines
            # and comments to name the line a reader looks for.
            while re.match(r"\s*(--.*)?$", text.splitlines()[line - 1]) and line < text.count("\n"):
                line += 1
            problems.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    return problems


def main():
    paths = [pathlib.Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "sql").glob("*.sql"))
    problems = [p for path in paths for p in check(path)]
    for p in problems:
        print(p)
    if problems:
        print(
            f"check-sql: {len(problems)} operator(s) looked up by search_path while the install or "
            "upgrade runs: write OPERATOR(pg_catalog.<op>) (see this script's docstring)",
            file=sys.stderr,
        )
        sys.exit(1)
    print(f"check-sql: {len(paths)} scripts, every operator resolved at install is pg_catalog's")


if __name__ == "__main__":
    main()
