"""The SQL edition's views, once.cached, and its pg_tle form (docs/sql-edition.md).

Used by scripts/sql_edition.py, which puts `extra_parts()` before sql/edition/finish.sql
and `late_parts()` after it, then calls `write_tle(DIR)` once DIR/pg_once_sql.sql is
written: DIR/pg_once_tle.sql, the same script installed through pg_tle as extension
pg_once.

What the parts take from the extension's own files, unchanged but for re-runnability
(one home per rule): from sql/schema.sql the table once_internal.key_counts and the
trigger that recounts keys when the namespaces change; from sql/functions.sql the views
once.stats, once.queue_stats, once.dead_letters, once.keys (with the DO block that
comments its columns) and once.namespaces, the PL/pgSQL
once.cached (function and procedure), and their comments. The views call
once_internal.may_use_key as their reader; the edition's may_use_key reads a table the
reader may not, so they call once_internal.view_may_use_key (sql/edition/views.sql).
"""
import re
from pathlib import Path

import sql_edition  # imported by it: the helpers below are called only once both are loaded

ROOT = sql_edition.ROOT
EDITION = ROOT / "sql/edition"
MARK = "-- ---- views and once.cached (scripts/sql_edition_tle.py) ----"
VIEWS = ("once.stats", "once.queue_stats", "once.dead_letters", "once.keys", "once.namespaces")


def head(stmt):
    """(verb, kind, name) of a statement: ('CREATE', 'VIEW', 'once.stats'),
    ('COMMENT', 'COLUMN', 'once.stats.queued'), ('CREATE', 'FUNCTION', 'once.cached')."""
    code = sql_edition.uncommented(stmt)
    m = re.match(r"SELECT\s+([\w.]+)\(", code)
    if m:
        return ("SELECT", None, m.group(1))
    # A DO block that comments a view's columns names the view it is about.
    m = re.match(r"DO\s+\$\$.*COMMENT ON COLUMN ([\w.]+)\.%I", code, re.S)
    if m:
        return ("DO", "COLUMN", m.group(1))
    m = re.match(r"(CREATE|COMMENT ON)\s+(?:OR REPLACE\s+)?(\w+)\s+([\w.]+)", code)
    return (m.group(1), m.group(2), m.group(3)) if m else (None, None, None)


def taken(path, wanted):
    """The statements of `path` that `wanted(verb, kind, name)` picks, re-runnable:
    CREATE TABLE IF NOT EXISTS, CREATE OR REPLACE for views, routines and triggers."""
    out = []
    for stmt in sql_edition.statements_of(path.read_text()):
        verb, kind, name = head(stmt)
        if verb is None or not wanted(verb, kind, name):
            continue
        if verb == "CREATE":
            if kind == "TABLE":
                stmt = stmt.replace("CREATE TABLE ", "CREATE TABLE IF NOT EXISTS ", 1)
            else:
                stmt = re.sub(r"CREATE (VIEW|FUNCTION|PROCEDURE|TRIGGER) ", r"CREATE OR REPLACE \1 ", stmt, count=1)
        out.append(stmt)
    if not out:
        raise SystemExit(f"{path}: nothing taken")
    return "\n\n".join(out)


def extra_parts():
    """What goes before sql/edition/finish.sql."""
    counts = taken(ROOT / "sql/schema.sql", lambda verb, kind, name:
                   name.startswith("once_internal.key_counts")
                   or name in ("once_internal.namespaces_recount", "namespace_owners_recount"))
    views = taken(ROOT / "sql/functions.sql", lambda verb, kind, name:
                  kind in ("VIEW", "COLUMN") and any(name == v or name.startswith(v + ".") for v in VIEWS))
    # The edition's may_use_key cannot be called by a view's reader (views.sql says why).
    views = views.replace("once_internal.may_use_key(", "once_internal.view_may_use_key(")
    cached = taken(ROOT / "sql/functions.sql", lambda verb, kind, name:
                   kind in ("FUNCTION", "PROCEDURE") and name in ("once.cached", "once.cached_key")
                   and not (verb == "CREATE" and name == "once.cached_key"))
    return [
        MARK,
        "-- ---- from sql/schema.sql: the counts of keys ----",
        counts,
        sql_edition.expand((EDITION / "views.sql").read_text()),
        "-- ---- from sql/functions.sql: the views ----",
        views,
        sql_edition.expand((EDITION / "cached.sql").read_text()),
        "-- ---- from sql/functions.sql: once.cached ----",
        cached,
    ]


def late_parts():
    """What goes after sql/edition/finish.sql, before COMMIT."""
    return [(EDITION / "views_grants.sql").read_text()]


# ---- the pg_tle form ----------------------------------------------------------------

NAME = "pg_once"
# pg_tle wraps the script in these dollar quotes and refuses a script that contains them.
PGTLE_RESERVED = ("$_pgtle_o_$", "$_pgtle_i_$")
QUOTE = "$pg_once_edition$"


def version():
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M)
    return m.group(1)


def description():
    m = re.search(r"^comment\s*=\s*'(.*)'$", (ROOT / "pg_once.control").read_text(), re.M)
    return m.group(1) + " (SQL edition, pg_tle)"


def extension_script(plain):
    """The plain script as an extension script: CREATE EXTENSION runs it in its own
    transaction, through SPI, so psql's \\set and the BEGIN/COMMIT around it go; and it
    records, as the extension does, which tables pg_dump must dump with their rows."""
    lines = plain.splitlines()
    drop = {"\\set ON_ERROR_STOP 1", "BEGIN;", "COMMIT;"}
    kept = [l for l in lines if l not in drop]
    if len(kept) != len(lines) - len(drop):
        raise SystemExit("pg_once_sql.sql: expected one each of \\set ON_ERROR_STOP 1, BEGIN; and COMMIT;")
    dumps = taken(ROOT / "sql/schema.sql", lambda verb, kind, name: verb == "SELECT"
                  and name == "pg_catalog.pg_extension_config_dump")
    script = "\n".join(kept).replace(
        "-- pg_once, SQL edition: generated",
        "-- pg_once, SQL edition as a pg_tle extension: generated", 1)
    script += "\n-- Rows that pg_dump keeps (sql/schema.sql): the extension's tables hold data.\n" + dumps + "\n"
    # The plain script's temporary tables go at its COMMIT (ON COMMIT DROP); in an
    # extension script they are members of the extension, which only the script itself
    # may drop: dropped at its end.
    temps = sorted(set(re.findall(r"CREATE TEMP(?:ORARY)? TABLE (?:IF NOT EXISTS )?(\w+)", script)))
    if temps:
        script += ("-- Temporary tables of this script, members of the extension until dropped here.\n"
                   + "".join(f"DROP TABLE IF EXISTS pg_temp.{t};\n" for t in temps))
    for bad in PGTLE_RESERVED + (QUOTE, "$pg_once_tle$"):
        if bad in script:
            raise SystemExit(f"the script contains {bad}, which pg_tle (or this file) quotes it with")
    return script


def tle_file(script):
    v = version()
    return f"""-- pg_once, SQL edition, for pg_tle: generated by scripts/sql-edition.sh. Do not edit:
-- see docs/sql-edition.md. Run by a member of pgtle_admin in a database where
-- CREATE EXTENSION pg_tle was run:
--     psql -v ON_ERROR_STOP=1 -d app -f pg_once_tle.sql
-- then, as the role that is to own pg_once (which needs CREATE on the database):
--     CREATE EXTENSION pg_once;            -- a first install
--     ALTER EXTENSION pg_once UPDATE;      -- after running a newer pg_once_tle.sql
-- A first run installs version {v}. Where pg_once is installed through pg_tle already,
-- at other versions, it adds version {v}, an update path to it from each of them (the
-- script is re-runnable: it upgrades in place) and makes it the default; where {v} is
-- installed already, it changes nothing.
\\set ON_ERROR_STOP 1
DO $pg_once_tle$
DECLARE
    ext constant text := {QUOTE}{script}{QUOTE};
    this constant text := '{v}';
    known text[] := ARRAY(SELECT v.version FROM pgtle.available_extension_versions() v
                           WHERE v.name OPERATOR(pg_catalog.=) '{NAME}');
    old text;
BEGIN
    IF pg_catalog.cardinality(known) OPERATOR(pg_catalog.=) 0 THEN
        PERFORM pgtle.install_extension('{NAME}', this, {sql_literal(description())}, ext);
    ELSIF NOT this OPERATOR(pg_catalog.=) ANY (known) THEN
        PERFORM pgtle.install_extension_version_sql('{NAME}', this, ext);
        FOREACH old IN ARRAY known LOOP
            PERFORM pgtle.install_update_path('{NAME}', old, this, ext);
        END LOOP;
        PERFORM pgtle.set_default_version('{NAME}', this);
    END IF;
END
$pg_once_tle$;
"""


def sql_literal(text):
    return "'" + text.replace("'", "''") + "'"


def write_tle(out_dir):
    out = Path(out_dir)
    plain = (out / "pg_once_sql.sql").read_text()
    (out / "pg_once_tle.sql").write_text(tle_file(extension_script(plain)))

