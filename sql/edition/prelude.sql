-- The SQL edition's first statements (docs/sql-edition.md): the schema "once", created
-- by the installing role, which must own it (as CREATE EXTENSION would): whoever owns it,
-- or may create objects in it, could plant functions or operators that this script, run
-- by the database's owner, would call. Rerunning the script keeps everything in it.
CREATE SCHEMA IF NOT EXISTS once;
DO $trust$
DECLARE
    schema_owner pg_catalog.oid := (SELECT n.nspowner FROM pg_catalog.pg_namespace n
                                     WHERE n.nspname OPERATOR(pg_catalog.=) 'once');
BEGIN
    IF NOT pg_catalog.pg_has_role(CURRENT_USER, schema_owner, 'USAGE') THEN
        RAISE EXCEPTION 'schema once belongs to role %, not to the role installing pg_once',
                        schema_owner::pg_catalog.regrole
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Install as its owner, or drop or rename schema once first.';
    END IF;
END
$trust$;

-- The functions that exist before this run keep whatever was granted on them; those
-- this run creates are closed to PUBLIC at the end (finish.sql), as the extension's are.
CREATE TEMPORARY TABLE pg_once_sql_existing ON COMMIT DROP AS
    SELECT p.oid FROM pg_catalog.pg_proc p
     WHERE p.pronamespace OPERATOR(pg_catalog.=) ANY (ARRAY(
               SELECT n.oid FROM pg_catalog.pg_namespace n
                WHERE n.nspname OPERATOR(pg_catalog.=) ANY ('{once,once_internal}')));
