-- For scripts/test-sql-edition-more.sh on a branch without sql/edition/namespaces.sql
-- (namespaces are another part of issue 28): the four functions of it that the views
-- and counts call, answering as they do when no namespace exists, so that the views can
-- be tested alone. Never part of the edition; not loaded where namespaces.sql exists.
CREATE SCHEMA IF NOT EXISTS once_internal;
CREATE OR REPLACE FUNCTION once_internal.cached_key_role(key text) RETURNS oid
    LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp
    RETURN (SELECT m[1]::oid FROM regexp_match(key, '#cached:([0-9]{1,10}):(.{64})$') m);
CREATE OR REPLACE FUNCTION once_internal.administers() RETURNS boolean
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
    RETURN pg_has_role(session_user, 'admin', 'USAGE');
CREATE OR REPLACE FUNCTION once_internal.may_use_key(key text) RETURNS boolean
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
    RETURN coalesce(once_internal.cached_key_role(key)
                    = (SELECT oid FROM pg_roles WHERE rolname = session_user), true)
           OR once_internal.administers();
CREATE OR REPLACE FUNCTION once_internal.key_namespace(key text) RETURNS text
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
    RETURN NULL;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA once_internal FROM PUBLIC;
