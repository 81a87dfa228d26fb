-- CREATE EXTENSION trusts no schema "once" that someone else could have filled, and the
-- installing role's default privileges give nobody anything (docs/security.md). Each case
-- runs in a database of its own, made here.
CREATE ROLE regress_once_dbowner LOGIN;
CREATE ROLE regress_once_other;
CREATE DATABASE regress_once_install OWNER regress_once_dbowner;
\c regress_once_install

-- The database's owner, no superuser, makes schema once first and plants an operator
-- int[] < int[] in it: it matches the install's version check better than pg_catalog's
-- anyarray < anyarray, so an install that resolved it would run the owner's function as
-- the installing superuser (which here records that it ran).
SET ROLE regress_once_dbowner;
CREATE SCHEMA once;
CREATE TABLE once.sprung (ran_as name);
CREATE FUNCTION once.trap(int[], int[]) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO once.sprung VALUES (current_user);
    RETURN false;
END
$$;
CREATE OPERATOR once.< (LEFTARG = int[], RIGHTARG = int[], FUNCTION = once.trap);
RESET ROLE;
\set VERBOSITY default
CREATE EXTENSION pg_once;
SELECT count(*) AS planted_code_ran FROM once.sprung;
SELECT count(*) AS installed FROM pg_extension WHERE extname = 'pg_once';

-- Owned by a superuser, but another role may create objects in it: refused too.
ALTER SCHEMA once OWNER TO CURRENT_USER;
GRANT CREATE ON SCHEMA once TO regress_once_dbowner;
CREATE EXTENSION pg_once;
SELECT count(*) AS planted_code_ran FROM once.sprung;
DROP SCHEMA once CASCADE;

-- Default privileges of the installing role, set before the install, reach none of
-- pg_once's objects.
ALTER DEFAULT PRIVILEGES GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES TO regress_once_other;
ALTER DEFAULT PRIVILEGES GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO regress_once_other;
ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON ROUTINES TO regress_once_other;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO regress_once_other;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON TYPES TO regress_once_other;
CREATE EXTENSION pg_once;
-- What the role may do with anything in pg_once's two schemas: nothing.
SELECT c.oid::regclass::text AS object, a.privilege_type
  FROM pg_class c, aclexplode(c.relacl) a
 WHERE c.relnamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
   AND a.grantee = 'regress_once_other'::regrole
UNION ALL
SELECT p.oid::regprocedure::text, a.privilege_type
  FROM pg_proc p, aclexplode(p.proacl) a
 WHERE p.pronamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
   AND a.grantee = 'regress_once_other'::regrole
UNION ALL
SELECT 'schema ' || n.nspname, a.privilege_type
  FROM pg_namespace n, aclexplode(n.nspacl) a
 WHERE n.nspname = 'once_internal' AND a.grantee = 'regress_once_other'::regrole;
-- (schema once itself is made by CREATE EXTENSION before the script runs: USAGE on it is
-- harmless, everything in it is closed.)
SET ROLE regress_once_other;
SELECT * FROM once.entries;
UPDATE once.entries SET state = 'done';
SELECT nextval('once_internal.token_seq');
SELECT once.claim_key('k');
RESET ROLE;

\c postgres
DROP DATABASE regress_once_install;
DROP ROLE regress_once_other;
DROP ROLE regress_once_dbowner;
