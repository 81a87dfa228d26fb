-- once.cached in the SQL edition (docs/sql-edition.md). once.cached and the procedure
-- once.cached are PL/pgSQL in the extension too: scripts/sql_edition_tle.py takes them,
-- and their comments, from sql/functions.sql as they are. What is C there is
-- once.cached_key (src/protocol/cached.rs), declared here.

-- once.cached_key(key, query): key, '#cached:', the calling role's OID, ':', and the hex
-- SHA-256 of the OIDs of the schemas the caller's search_path resolves to (pg_temp and
-- pg_catalog included, as current_schemas(true) lists them), a newline, and the query
-- trimmed of white space (Rust's str::trim: Unicode White_Space). The same text as the
-- extension's, so a key computed by either edition names the same entry.
--
-- SECURITY INVOKER and no pinned search_path, like once.cached: the schemas are the
-- caller's own, and the query is checked as the caller would run it. So every name here
-- is schema-qualified and every operator written OPERATOR(pg_catalog.x): the caller's
-- search_path may put its own operators first. It cannot call once_internal (the caller
-- has no USAGE on it), so the key's checks are once_internal.usable_key's, written out.
--
-- The role is the current user, which in this SECURITY INVOKER function is the calling
-- context's, as once.claim_key judges it (once_internal.vouch): the role whose keys
-- require_key lets it use.
--
-- "Exactly one SELECT": the extension asks PostgreSQL's raw parser, which PL/pgSQL cannot
-- call. Here the query is planned twice (EXPLAIN: nothing runs), as a statement and as
-- the FROM item of a SELECT: a text that parses as both is one statement whose
-- parentheses balance (a text like 'SELECT 1) AS x, (SELECT 2' parses only as a
-- subquery) and a SELECT, VALUES or TABLE without INTO (a DELETE parses only as a
-- statement). Anything else is a syntax error there, answered with the extension's
-- 42601. An error after parsing (a missing table, a missing privilege) means the text
-- parsed, as the raw parser would have said: it is let through, and raised when
-- once.cached runs the query, as in the extension. Trailing semicolons are dropped for
-- the subquery (the raw parser accepts them; once.cached itself then fails on them, as
-- the extension's does). Two plans cost more than a parse: a fraction of a millisecond
-- for a simple query, on every call, as the extension's once.cached plans it again on
-- every hit.
CREATE OR REPLACE FUNCTION once.cached_key(key text, query text) RETURNS text
    LANGUAGE plpgsql STABLE CALLED ON NULL INPUT SECURITY INVOKER PARALLEL RESTRICTED
    AS $$
DECLARE
    white constant text := E'[\\t\\n\\u000b\\f\\r \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]';
    trimmed text;
    schemas text;
    role_oid pg_catalog.oid;
BEGIN
    {{text_check:key key}}
    IF query IS NULL THEN
        RAISE EXCEPTION 'query must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass the query whose rows are to be cached, e.g. ''SELECT ... FROM ...''.';
    END IF;
    -- Two plans, each its own block: a failure of one to plan says nothing of the other.
    -- As a statement of its own: one statement, its parentheses balanced.
    BEGIN
        EXECUTE 'EXPLAIN (COSTS OFF) ' OPERATOR(pg_catalog.||) query;
    EXCEPTION
        WHEN syntax_error THEN
            RAISE EXCEPTION 'query must be exactly one SELECT statement' USING ERRCODE = 'syntax_error',
                HINT = 'once.cached caches the rows of one query: pass one SELECT (or VALUES, TABLE) without a trailing second statement or SELECT INTO.';
        WHEN OTHERS THEN
            NULL;  -- parsed. Its own error is raised when it runs.
    END;
    -- As a subquery: a SELECT, VALUES or TABLE, without INTO.
    BEGIN
        EXECUTE 'EXPLAIN (COSTS OFF) SELECT FROM (' OPERATOR(pg_catalog.||) E'\n'
                OPERATOR(pg_catalog.||) pg_catalog.regexp_replace(query, '(;|' OPERATOR(pg_catalog.||) white
                                                                  OPERATOR(pg_catalog.||) ')+$', '')
                OPERATOR(pg_catalog.||) E'\n) AS q';
    EXCEPTION
        WHEN syntax_error THEN
            RAISE EXCEPTION 'query must be exactly one SELECT statement' USING ERRCODE = 'syntax_error',
                HINT = 'once.cached caches the rows of one query: pass one SELECT (or VALUES, TABLE) without a trailing second statement or SELECT INTO.';
        WHEN OTHERS THEN
            NULL;
    END;
    trimmed := pg_catalog.regexp_replace(query, '^' OPERATOR(pg_catalog.||) white OPERATOR(pg_catalog.||) '+|'
                                         OPERATOR(pg_catalog.||) white OPERATOR(pg_catalog.||) '+$', '', 'g');
    SELECT pg_catalog.string_agg(s.name::pg_catalog.regnamespace::pg_catalog.oid::pg_catalog.text, ','
                                 ORDER BY s.n)
      INTO schemas
      FROM pg_catalog.unnest(pg_catalog.current_schemas(true)) WITH ORDINALITY AS s(name, n);
    SELECT r.oid INTO role_oid FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER;
    RETURN key OPERATOR(pg_catalog.||) '#cached:' OPERATOR(pg_catalog.||) role_oid::pg_catalog.text
           OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||)
           pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
               COALESCE(schemas, '') OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) trimmed,
               pg_catalog.getdatabaseencoding())), 'hex');
END
$$;
-- Its COMMENT is sql/functions.sql's, taken from there with once.cached's.
