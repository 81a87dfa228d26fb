-- Nothing is granted to PUBLIC, as in the extension: a database's owner grants USAGE on
-- schema once and EXECUTE on its functions to the roles that use pg_once
-- (docs/sql-edition.md). PostgreSQL grants EXECUTE on a new function to PUBLIC: taken
-- back from the functions this run created, and only from them, so that a rerun keeps
-- what an administrator granted.
DO $owner_only$
DECLARE
    f pg_catalog.regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
              WHERE p.pronamespace OPERATOR(pg_catalog.=) ANY (ARRAY(
                        SELECT n.oid FROM pg_catalog.pg_namespace n
                         WHERE n.nspname OPERATOR(pg_catalog.=) ANY ('{once,once_internal}')))
                AND p.oid OPERATOR(pg_catalog.<>) ALL (ARRAY(SELECT oid FROM pg_once_sql_existing))
    LOOP
        -- The digest function is harmless and handy for looking keys up by hand: PUBLIC
        -- keeps it, as in the extension (sql/functions.sql).
        CONTINUE WHEN f OPERATOR(pg_catalog.=) 'once.key_hash(text)'::pg_catalog.regprocedure;
        EXECUTE pg_catalog.format('REVOKE ALL ON ROUTINE %s FROM PUBLIC', f);
    END LOOP;
END
$owner_only$;
-- once_internal: USAGE for every role, CREATE for none. The wrappers of schema once call
-- their implementations here as the calling role (scripts/sql_edition.py, invoker_api),
-- which needs USAGE and EXECUTE; each implementation refuses any other caller
-- (once_internal.vouch), and its tables, sequence and other functions are granted to no one.
REVOKE ALL ON SCHEMA once_internal FROM PUBLIC;
GRANT USAGE ON SCHEMA once_internal TO PUBLIC;
