-- Only the functions may write once.entries; roles get pg_once as the README shows.
CREATE EXTENSION pg_once;
CREATE ROLE regress_once_app LOGIN;
SET ROLE regress_once_app;
SELECT once.claim_key('k');                -- no privilege yet
SELECT * FROM once.entries;
RESET ROLE;

-- README, "Granting access":
GRANT USAGE ON SCHEMA once TO regress_once_app;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO regress_once_app;
GRANT SELECT ON once.stats TO regress_once_app;

SET ROLE regress_once_app;
SELECT outcome FROM once.claim_key('k');
SELECT running FROM once.stats;
-- The table itself stays closed: the functions are the only way in.
SELECT * FROM once.entries;
UPDATE once.entries SET state = 'done';
DELETE FROM once.entries;
-- Nor is pg_once's internal schema (claim_next's per-row filter, the trigger functions,
-- the token sequence): no role has USAGE on it. claim_next itself, which calls the filter
-- as the owner, works for the role, and once.stats, which calls once_internal functions,
-- worked above.
SELECT once_internal.row_taken('(0,1)');
SELECT nextval('once_internal.token_seq');
SELECT once.enqueue_key('job');
SELECT key, attempt FROM once.claim_next();
-- A caller's search_path cannot change what the functions run: an operator that would
-- hijack "=" on bytea in the caller's schema is ignored.
RESET ROLE;
GRANT CREATE ON SCHEMA public TO regress_once_app;
SET ROLE regress_once_app;
CREATE FUNCTION public.always_true(bytea, bytea) RETURNS boolean
    LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR public.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = public.always_true);
SET search_path = public, pg_catalog;
SELECT outcome, token AS another_token FROM once.claim_key('another key') \gset
SELECT :'outcome' AS outcome;
-- invalidate_key's statement compares digests with "=": hijacked, invalidating an absent
-- key would delete every key that is not running ('another key', once completed).
SELECT once.complete_key('another key', :another_token, '"kept"') AS completed;
SELECT once.invalidate_key('absent key') AS invalidated;
RESET search_path;
RESET ROLE;
SELECT key, state FROM once.entries ORDER BY key;

DROP OPERATOR public.= (bytea, bytea);
DROP FUNCTION public.always_true(bytea, bytea);
REVOKE CREATE ON SCHEMA public FROM regress_once_app;
DROP EXTENSION pg_once;
DROP OWNED BY regress_once_app;
DROP ROLE regress_once_app;
