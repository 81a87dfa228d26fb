-- What a psql user sees: the objects, one key's life, and how bad input is answered.
CREATE EXTENSION pg_once;

-- \df once.* shows the API; what only pg_once calls is in once_internal, every object of
-- which belongs to the extension.
SELECT p.oid::regprocedure AS function, pg_get_function_result(p.oid) AS returns
  FROM pg_proc p WHERE p.pronamespace = 'once'::regnamespace ORDER BY p.proname, p.prokind;
SELECT pg_describe_object(d.classid, d.objid, 0) AS internal
  FROM pg_depend d
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_once')
   AND pg_describe_object(d.classid, d.objid, 0) LIKE '%once\_internal.%'
   -- not the table's row type, a member of its own since PostgreSQL 17
   AND d.classid <> 'pg_type'::regclass
 ORDER BY 1;
SELECT has_schema_privilege('public', 'once_internal', 'USAGE') AS public_may_use_internal;

-- Everything a person reads explains itself (\d+ and \dn+ show these): the schemas, every
-- column of a view, table or the claim type, and every setting (pg_settings, \dconfig+).
SELECT n.nspname AS uncommented_schema FROM pg_namespace n
 WHERE n.nspname IN ('once', 'once_internal') AND obj_description(n.oid, 'pg_namespace') IS NULL;
SELECT c.oid::regclass AS relation, a.attname AS uncommented_column
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
 WHERE c.relnamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
   AND c.relkind IN ('r', 'v', 'c') AND a.attnum > 0 AND NOT a.attisdropped
   AND col_description(c.oid, a.attnum) IS NULL
 ORDER BY 1, a.attnum;
SELECT c.relkind, count(*) AS commented_columns
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
 WHERE c.relnamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
   AND c.relkind IN ('r', 'v', 'c') AND a.attnum > 0 AND NOT a.attisdropped
   AND col_description(c.oid, a.attnum) IS NOT NULL
 GROUP BY 1 ORDER BY 1;
SELECT name AS undescribed_setting FROM pg_settings
 WHERE name LIKE 'once.%' AND (short_desc IS NULL OR extra_desc IS NULL);

-- Every function is documented, and runs its SQL with the owner's rights and search_path
-- pinned only where it should. A C function is never SECURITY DEFINER and has no SET
-- clause: it judges its caller as the current user, and runs each statement as the
-- extension's owner with the path pinned (storage/statements.rs), so that a cache hit pays
-- for neither. Any other SECURITY DEFINER function pins the path in its declaration.
SELECT p.oid::regprocedure AS undocumented FROM pg_proc p
 WHERE p.pronamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
   AND obj_description(p.oid, 'pg_proc') IS NULL;
SELECT p.oid::regprocedure AS not_as_caller FROM pg_proc p
 WHERE p.pronamespace IN ('once'::regnamespace, 'once_internal'::regnamespace)
   AND CASE WHEN p.prolang = (SELECT oid FROM pg_language WHERE lanname = 'c')
            THEN p.prosecdef
                 OR EXISTS (SELECT FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
            ELSE p.prosecdef AND NOT 'search_path=pg_catalog, pg_temp' = ANY (p.proconfig)
       END;
-- The queue functions whose statements take LIMIT n or arrays run on generic plans,
-- which PostgreSQL would otherwise never pick for them (it planned them on every call).
SELECT p.proname, c AS setting FROM pg_proc p, unnest(p.proconfig) AS c
 WHERE p.pronamespace = 'once'::regnamespace AND c LIKE 'plan_cache_mode=%' ORDER BY 1;
-- enqueue_keys' generic plan looks keys up in the primary key even when it was made while
-- once.entries was nearly empty (sql/functions.sql says why).
SELECT p.proname, c AS setting FROM pg_proc p, unnest(p.proconfig) AS c
 WHERE p.pronamespace = 'once'::regnamespace AND c LIKE 'enable_%' ORDER BY 1;

-- One key's life. Timestamps vary, so they are shown as facts about them.
\set key 'https://example.com/page?id=1'
SELECT outcome, token > 0 AS has_token, owner ~ '^pg_regress.*\(pid \d+\)$' AS owner_named,
       lease_expires_at > now() + interval '29 seconds' AS leased_30s, attempts
  FROM once.claim_key(:'key');
SELECT token AS my_token FROM once.entries WHERE key = :'key' \gset
-- The same session asking again is told to wait (for itself).
SELECT outcome FROM once.claim_key(:'key');
SELECT once.heartbeat_key(:'key', :my_token, '1 minute') > now() + interval '59 seconds' AS extended;
SELECT once.complete_key(:'key', :my_token, '{"title": "Example"}', ttl => '1 hour');
SELECT outcome, result, expires_at > now() + interval '59 minutes' AS ttl_set
  FROM once.claim_key(:'key');
-- A late or repeated completion is refused, and changes nothing.
SELECT once.complete_key(:'key', :my_token, '{"title": "Overwritten?"}');
SELECT result FROM once.claim_key(:'key');
SELECT key, state, errors, attempts FROM once.entries;
SELECT queued, running, done, failed FROM once.stats;
SELECT once.invalidate_key(:'key'), once.invalidate_key(:'key');

-- Failures are served to callers until retry_after.
SELECT token AS t FROM once.claim_key('flaky') \gset
SELECT once.fail_key('flaky', :t, 'upstream returned 503', retry_after => '1 minute');
SELECT outcome, error, retry_at > now() AS retry_later FROM once.claim_key('flaky');

-- Bad input: an error that says what to do, and nothing changes.
SELECT once.claim_key(NULL);
SELECT once.claim_key('');
SELECT once.claim_key(repeat('x', 7501));
SELECT once.claim_key('k', lease => '0');
SELECT once.claim_key('k', wait => '-1 second');
SELECT once.complete_key('flaky', NULL, '{}');
SELECT once.complete_key('flaky', 0, '{}');
SELECT once.complete_key('flaky', :t, NULL);
SELECT once.complete_key('flaky', :t, '{}', ttl => '0');
SELECT once.fail_key('flaky', :t, NULL);
SELECT once.fail_key('flaky', :t, 'e', retry_after => '-1 minute');
SELECT once.heartbeat_key('flaky', :t, '2 days');
SELECT count(*) AS keys, count(*) FILTER (WHERE state = 'failed') AS failed FROM once.entries;

-- Slips PostgreSQL refuses before pg_once runs ("function ... does not exist") get a hint
-- saying which argument is wrong (src/api/hints.rs): this session has loaded pg_once.
SELECT once.claim_key('k', wait => 10);
SELECT once.claim_key('k', '30 seconds', 5);
SELECT once.complete_key('flaky', 1, '{}', ttl => 3600);
SELECT once.create_queue('q', backoff => 10);
SELECT once.claim_next(n => 10, wait => 5.5);
SELECT once.complete_key('flaky', 1, 'done'::text);
SELECT once.claim_key('k', wiat => '1 second');
SELECT once.complete_key('flaky');
SELECT once.claim('k');
SET search_path = once, pg_catalog;
SELECT claim_key('k', lease => 30);
RESET search_path;
SELECT count(*) AS keys, count(*) FILTER (WHERE state = 'failed') AS failed FROM once.entries;

-- The once. prefix is reserved: a misspelt setting is refused, not kept as a placeholder.
SET once.poll_interval = '10ms';
SET once.poll_intervall = '10ms';
RESET once.poll_interval;

-- Waiting cannot work under a snapshot that never sees other sessions' commits.
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT once.claim_key('k', wait => '1 second');
ROLLBACK;

-- Cached plans survive the extension being dropped and created again in this session.
DROP EXTENSION pg_once;
CREATE EXTENSION pg_once;
SELECT outcome FROM once.claim_key(:'key');
DROP EXTENSION pg_once;
