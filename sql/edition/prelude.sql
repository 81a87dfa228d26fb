-- The SQL edition's first statements (docs/sql-edition.md): the schemas "once" and
-- "once_internal", created by the installing role, which must own them (as CREATE
-- EXTENSION would): whoever owns them, or may create objects in them, could plant
-- functions or operators that this script, run by the database's owner, would call, or
-- replace the functions every call of pg_once runs with the installer's rights. So a
-- schema of either name that exists already must be the installing role's own (not
-- merely a role it is a member of), no other role may hold CREATE on it, and nothing in
-- it may belong to another role; anything else is refused before anything is created.
-- Rerunning the script keeps everything in them.
DO $trust$
DECLARE
    me pg_catalog.oid := pg_catalog.to_regrole(pg_catalog.quote_ident(CURRENT_USER));
    s record;
    creator pg_catalog.oid;
    stranger pg_catalog.oid;
BEGIN
    FOR s IN SELECT n.oid, n.nspname, n.nspowner, n.nspacl FROM pg_catalog.pg_namespace n
              WHERE n.nspname OPERATOR(pg_catalog.=) ANY ('{once,once_internal}')
              ORDER BY n.nspname LOOP
        IF s.nspowner OPERATOR(pg_catalog.<>) me THEN
            RAISE EXCEPTION 'schema % belongs to role %, not to the role installing pg_once (%)',
                            s.nspname, s.nspowner::pg_catalog.regrole, CURRENT_USER
                USING ERRCODE = 'insufficient_privilege',
                      HINT = pg_catalog.format('If role %s installed pg_once here, run the script as it (SET ROLE %s); otherwise drop or rename schema %s first: its owner could have put anything in it.',
                                               s.nspowner::pg_catalog.regrole, s.nspowner::pg_catalog.regrole, s.nspname);
        END IF;
        SELECT a.grantee INTO creator FROM pg_catalog.aclexplode(s.nspacl) a
         WHERE a.privilege_type OPERATOR(pg_catalog.=) 'CREATE' AND a.grantee OPERATOR(pg_catalog.<>) me
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'role % may create objects in schema %',
                            CASE WHEN creator OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                 ELSE creator::pg_catalog.regrole::pg_catalog.text END, s.nspname
                USING ERRCODE = 'insufficient_privilege',
                      HINT = pg_catalog.format('REVOKE CREATE ON SCHEMA %s FROM %s, check what it created there, then run the script again.',
                                               s.nspname, CASE WHEN creator OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                                               ELSE creator::pg_catalog.regrole::pg_catalog.text END);
        END IF;
        SELECT o.owner INTO stranger FROM (
            SELECT p.proowner AS owner FROM pg_catalog.pg_proc p WHERE p.pronamespace OPERATOR(pg_catalog.=) s.oid
            UNION ALL SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.relnamespace OPERATOR(pg_catalog.=) s.oid
            UNION ALL SELECT t.typowner FROM pg_catalog.pg_type t WHERE t.typnamespace OPERATOR(pg_catalog.=) s.oid
            UNION ALL SELECT o.oprowner FROM pg_catalog.pg_operator o WHERE o.oprnamespace OPERATOR(pg_catalog.=) s.oid) o
         WHERE o.owner OPERATOR(pg_catalog.<>) me LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'schema % holds objects of role %', s.nspname, stranger::pg_catalog.regrole
                USING ERRCODE = 'insufficient_privilege',
                      HINT = pg_catalog.format('Drop what role %s owns in schema %s (or give it to the installing role once checked), then run the script again.',
                                               stranger::pg_catalog.regrole, s.nspname);
        END IF;
    END LOOP;
END
$trust$;
CREATE SCHEMA IF NOT EXISTS once;

-- The functions that exist before this run keep whatever was granted on them; those
-- this run creates are closed to PUBLIC at the end (finish.sql), as the extension's are.
CREATE TEMPORARY TABLE pg_once_sql_existing ON COMMIT DROP AS
    SELECT p.oid FROM pg_catalog.pg_proc p
     WHERE p.pronamespace OPERATOR(pg_catalog.=) ANY (ARRAY(
               SELECT n.oid FROM pg_catalog.pg_namespace n
                WHERE n.nspname OPERATOR(pg_catalog.=) ANY ('{once,once_internal}')));
