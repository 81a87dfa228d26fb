-- pg_once 0.2.0 -> 0.3.0, run by ALTER EXTENSION pg_once UPDATE. Hand-written. It must
-- leave a 0.2.0 database exactly as a fresh 0.3.0 install leaves a new one (step 9 of
-- scripts/test.sh compares the two), keep every row and the token sequence, and call no
-- pg_once C function but library_version(): in a chain of updates the library may be a
-- later one. Conventions: CONTRIBUTING.md, "Upgrades".
\echo Use "ALTER EXTENSION pg_once UPDATE" to load this file. \quit

-- The schema must be trustworthy before anything resolves a name in it (schema.sql).
DO $trust$
DECLARE
    schema_owner pg_catalog.oid := (SELECT n.nspowner FROM pg_catalog.pg_namespace n
                                     WHERE n.nspname OPERATOR(pg_catalog.=) 'once');
    creator pg_catalog.text := (SELECT pg_catalog.string_agg(CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                                       ELSE a.grantee::pg_catalog.regrole::pg_catalog.text END, ', ')
                                  FROM pg_catalog.pg_namespace n,
                                       pg_catalog.aclexplode(n.nspacl) a
                                 WHERE n.nspname OPERATOR(pg_catalog.=) 'once'
                                   AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
                                   AND a.grantee OPERATOR(pg_catalog.<>) n.nspowner);
BEGIN
    IF schema_owner OPERATOR(pg_catalog.<>) (SELECT r.oid FROM pg_catalog.pg_roles r
                                               WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
       AND NOT (SELECT r.rolsuper FROM pg_catalog.pg_roles r
                 WHERE r.oid OPERATOR(pg_catalog.=) schema_owner) THEN
        RAISE EXCEPTION 'schema once belongs to role %, which is neither the role installing pg_once nor a superuser',
                        schema_owner::pg_catalog.regrole
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'Its owner could have put objects in it that the install would run as this role.',
                  HINT = 'Drop or rename schema once first; or, if you trust its owner and everything in it, ALTER SCHEMA once OWNER TO ' OPERATOR(pg_catalog.||) CURRENT_USER OPERATOR(pg_catalog.||) '.';
    END IF;
    IF creator IS NOT NULL THEN
        RAISE EXCEPTION 'roles other than the owner of schema once may create objects in it: %', creator
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'They could have put objects in it that the install would run as this role.',
                  HINT = 'REVOKE CREATE ON SCHEMA once FROM those roles, after checking what they created in it.';
    END IF;
END
$trust$;

-- What exists before this script runs: the $owner_only$ block at its end closes
-- everything else to every role but the owner.
SELECT pg_catalog.set_config('pg_once.kept_privileges', COALESCE(pg_catalog.string_agg(
           d.classid::pg_catalog.oid::pg_catalog.text OPERATOR(pg_catalog.||) ':'
           OPERATOR(pg_catalog.||) d.objid::pg_catalog.text, ','), ''), true)
  FROM pg_catalog.pg_depend d
  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid
 WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
   AND d.deptype OPERATOR(pg_catalog.=) 'e' AND e.extname OPERATOR(pg_catalog.=) 'pg_once';

-- The library running this script must be 0.3.0 or later (schema.sql explains the block).
DO $guard$
DECLARE
    target text := (SELECT extversion FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'pg_once');
    loaded text;
BEGIN
    CREATE OR REPLACE FUNCTION once_internal.library_version() RETURNS text
        LANGUAGE c VOLATILE PARALLEL SAFE
        AS 'MODULE_PATHNAME', 'library_version_wrapper';
    loaded := once_internal.library_version();
    IF pg_catalog.string_to_array(loaded, '.')::int[] OPERATOR(pg_catalog.<) pg_catalog.string_to_array(target, '.')::int[] THEN
        RAISE EXCEPTION 'pg_once % cannot be installed with the pg_once % library this session runs', target, loaded
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Start a new session; where pg_once is in shared_preload_libraries, restart the server first.';
    END IF;
EXCEPTION WHEN undefined_function THEN
    RAISE EXCEPTION 'pg_once % cannot be installed with the older pg_once library this session runs', target
        USING ERRCODE = 'object_not_in_prerequisite_state',
              DETAIL = SQLERRM,
              HINT = 'Start a new session; where pg_once is in shared_preload_libraries, restart the server first.';
END
$guard$;

-- Fingerprints (claim_key's fingerprint, issue 27): the column, last (schema.sql). Keys
-- claimed before the update have none, so they never mismatch.
ALTER TABLE once.entries ADD COLUMN fingerprint bytea;
COMMENT ON COLUMN once.entries.fingerprint IS
    'The fingerprint (claim_key''s, a digest of the request) the current or last claim was made with: while the key runs or its result is served, a claim with another one is answered mismatch. NULL: claimed without one (then any claim is compared with nothing).';
COMMENT ON COLUMN once.claim.outcome IS
    'What the call decided: hit (result is set), claimed (you own the key: compute, then complete_key with token), failed (error is set, until retry_at) or wait (someone else computes it). With serve_stale => true also refresh (you own the key and result is the previous one: serve it, recompute, complete_key) and stale (result is the previous one, served while someone refreshes it). With a fingerprint also mismatch (the key runs or its result is served for a request of another fingerprint: nothing was changed, every other column is NULL).';

-- claim_key gains fingerprint: a new signature, so a new function with a new symbol
-- (claim_key_0_3_wrapper; the library keeps claim_key_0_2_wrapper as a stub that refuses
-- until this update has run). Dropping a function drops what was granted on it, so the
-- new one gets the old one's grants, with the extension's initial privileges left as a
-- fresh install's: grant_again and replace_function, as in the 0.1.0 -> 0.2.0 script,
-- which explains them; both go again at the end.
CREATE FUNCTION once_internal.grant_again(acl aclitem[], owner oid, catalog regclass,
                                          object text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $grant$
DECLARE
    id oid := CASE WHEN catalog = 'pg_proc'::regclass THEN object::regprocedure::oid
                   ELSE object::regclass::oid END;
    initial aclitem[];
    g record;
BEGIN
    -- Also records the object's initial privileges: its owner's alone, as on install.
    EXECUTE format('REVOKE ALL ON %s %s FROM PUBLIC',
                   CASE WHEN catalog = 'pg_proc'::regclass THEN 'FUNCTION' ELSE 'TABLE' END, object);
    FOR g IN SELECT DISTINCT a.grantee
               FROM pg_class c, aclexplode(COALESCE(c.relacl, acldefault('r', c.relowner))) a
              WHERE catalog = 'pg_class'::regclass AND c.oid = id AND a.grantee <> c.relowner
             UNION
             SELECT DISTINCT a.grantee
               FROM pg_proc p, aclexplode(COALESCE(p.proacl, acldefault('f', p.proowner))) a
              WHERE catalog = 'pg_proc'::regclass AND p.oid = id AND a.grantee <> p.proowner LOOP
        EXECUTE format('REVOKE ALL ON %s %s FROM %s',
                       CASE WHEN catalog = 'pg_proc'::regclass THEN 'FUNCTION' ELSE 'TABLE' END,
                       object,
                       CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
    END LOOP;
    initial := (SELECT initprivs FROM pg_init_privs
                 WHERE objoid = id AND classoid = catalog AND objsubid = 0);
    FOR g IN SELECT a.grantee, a.privilege_type, a.is_grantable FROM aclexplode(acl) a
              WHERE a.grantee <> owner LOOP
        EXECUTE format('GRANT %s ON %s %s TO %s%s', g.privilege_type,
                       CASE WHEN catalog = 'pg_proc'::regclass THEN 'FUNCTION' ELSE 'TABLE' END,
                       object,
                       CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
                       CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    UPDATE pg_init_privs SET initprivs = initial
     WHERE objoid = id AND classoid = catalog AND objsubid = 0;
    PERFORM set_config('pg_once.kept_privileges',
                       concat_ws(',', nullif(current_setting('pg_once.kept_privileges'), ''),
                                 catalog::oid || ':' || id), true);
END
$grant$;

CREATE FUNCTION once_internal.replace_function(old regprocedure, new_signature text,
                                               create_new text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $replace$
DECLARE
    acl aclitem[] := (SELECT coalesce(proacl, acldefault('f', proowner)) FROM pg_proc
                       WHERE oid = old);
    owner oid := (SELECT proowner FROM pg_proc WHERE oid = old);
BEGIN
    EXECUTE format('DROP FUNCTION %s', old);
    EXECUTE create_new;
    PERFORM once_internal.grant_again(acl, owner, 'pg_proc', new_signature);
END
$replace$;

SELECT once_internal.replace_function(
    'once.claim_key(text, interval, interval, integer, boolean)',
    'once.claim_key(text, interval, interval, integer, boolean, bytea)',
    $create$
CREATE FUNCTION once.claim_key(
    key         text,
    lease       interval DEFAULT '30 seconds',
    wait        interval DEFAULT '0',
    owner_pid   integer DEFAULT NULL,
    serve_stale boolean DEFAULT false,
    fingerprint bytea DEFAULT NULL)
RETURNS once.claim
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'claim_key_0_3_wrapper'
$create$);

DROP FUNCTION once_internal.replace_function(regprocedure, text, text);
DROP FUNCTION once_internal.grant_again(aclitem[], oid, regclass, text);

COMMENT ON FUNCTION once.claim_key(text, interval, interval, integer, boolean, bytea) IS
$$Claim a key or get its cached result, in one round trip. outcome is:
hit (result is set), claimed (you own the key: compute, then complete_key with token),
failed (the last attempt failed and retry_at is in the future: error is set), or
wait (someone else is computing it: owner, lease_expires_at are set; all NULL while
another transaction's claim is not committed yet).
With serve_stale => true, also refresh (you own the key and result is the previous one:
serve it, recompute, complete_key) and stale (result is the previous one, served at once
while someone refreshes it); without it a refresh is answered claimed and a stale result
wait (or failed), as before pg_once 0.2.
fingerprint (1 to 64 bytes: a digest of the request, e.g. for an Idempotency-Key) is stored
with the claim it takes; while the key runs or its result is served, a call with another
fingerprint gets outcome mismatch and changes nothing. NULL on either side never mismatches.
With wait > 0 the call blocks, holding no lock, until the key resolves, its owner is gone
(then you are given the claim) or wait elapses (then it returns wait), whatever other
transactions hold; wait => 0 never waits for a lock.
owner_pid says what ends your claim besides its lease: NULL this connection (or the lease
alone if once.backend_liveness is off), 0 the lease alone, or the pid once.owner_session()
returned on a connection your process keeps open (for calls made through a pool).
Call it in its own transaction: a claim is only visible to others once committed.$$;

-- Only a claim carries a token (hit and failed carried the entry's, which during a
-- refresh was the refresher's).
COMMENT ON COLUMN once.claim.token IS
    'claimed or refresh: your fencing token, to pass to complete_key, fail_key, heartbeat_key or release_key. NULL for every other outcome: a token is its owner''s alone.';

-- What a role may see of the keys it may use (once_internal.may_use_key, as once.stats
-- counts them): the dashboard's list of keys for an application role, which cannot read
-- once.entries. Never the token, which is the owner's alone, nor the request fingerprint.
-- security_barrier: a caller's function in WHERE runs only on the rows the filter kept.
CREATE VIEW once.keys WITH (security_barrier) AS
SELECT key_hash, key, state, queue, owner, owner_pid, owner_started, lease_only,
       lease_expires_at, result, expires_at, stale_until, error, errors, attempts, retry_at,
       created_at, claimed_at, completed_at, updated_at, payload, priority, run_at,
       max_attempts, enqueued_at, last_outcome, rerun, owner_role
  FROM once.entries
 WHERE once_internal.may_use_key(key);

COMMENT ON VIEW once.keys IS
    'The keys the reader may use (its namespaces'' and the shared ones), each with its state, owner, lease, result or error and queue columns as in once.entries, but never the fencing token or the request fingerprint. Read it by key_hash (once.key_hash(key)) or a state: a scan of every key reads every key.';

-- Each column of once.keys says what the same column of once.entries says.
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN SELECT k.attname,
                    pg_catalog.col_description('once.entries'::pg_catalog.regclass, e.attnum) AS said
               FROM pg_catalog.pg_attribute k
               JOIN pg_catalog.pg_attribute e
                 ON e.attrelid OPERATOR(pg_catalog.=) 'once.entries'::pg_catalog.regclass
                AND e.attname OPERATOR(pg_catalog.=) k.attname
              WHERE k.attrelid OPERATOR(pg_catalog.=) 'once.keys'::pg_catalog.regclass
                AND k.attnum OPERATOR(pg_catalog.>) 0
    LOOP
        EXECUTE pg_catalog.format('COMMENT ON COLUMN once.keys.%I IS %L', c.attname, c.said);
    END LOOP;
END
$$;

COMMENT ON SCHEMA once IS
    'pg_once: claim_key and the other functions, the once.stats, once.queue_stats, once.dead_letters, once.keys and once.namespaces views, and the tables they read. Grant USAGE on it (and EXECUTE on its functions) to the roles that use pg_once.';

-- Fencing tokens anchored to the clock (schema.sql, src/storage/tokens.rs): the record of
-- the timeline of the last anchor. 0.2.0's tokens, which started at the WAL position, are
-- far behind the clock, so the first draw after this update sets the sequence to it.
DO $$
DECLARE
    timeline bigint := ('x' OPERATOR(pg_catalog.||) pg_catalog.left(pg_catalog.pg_walfile_name(
        pg_catalog.pg_current_wal_insert_lsn()), 8))::pg_catalog.bit(32)::bigint;
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE SEQUENCE once_internal.token_history AS bigint START WITH %s CACHE 1', timeline);
    PERFORM pg_catalog.setval('once_internal.token_history', timeline, true);
END
$$;

COMMENT ON FUNCTION once_internal.next_token() IS
$$The next fencing token: nextval of once_internal.token_seq, after setting the sequence to the
clock (microseconds since 2000-01-01) if it fell more than 10 ms behind it or the timeline
changed, as after a restore, a crash or a promotion.$$;

-- Nobody but the owner keeps a privilege on what this script created, nor on anything
-- in once_internal (schema.sql explains the block).
DO $owner_only$
DECLARE
    o record;
    role pg_catalog.text;
BEGIN
    -- Collected first: each REVOKE changes what the query reads.
    FOR o IN
        SELECT * FROM (
        SELECT m.object,
               pg_catalog.array_agg(DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                    ELSE a.grantee::pg_catalog.regrole::pg_catalog.text END) AS roles
          FROM (SELECT 'pg_catalog.pg_proc'::pg_catalog.regclass, p.oid,
                       COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner)), p.proowner,
                       p.pronamespace, 'ROUTINE ' OPERATOR(pg_catalog.||) p.oid::pg_catalog.regprocedure::pg_catalog.text
                  FROM pg_catalog.pg_proc p
                UNION ALL
                SELECT 'pg_catalog.pg_class'::pg_catalog.regclass, c.oid,
                       COALESCE(c.relacl, pg_catalog.acldefault('r', c.relowner)), c.relowner,
                       c.relnamespace,
                       CASE WHEN c.relkind OPERATOR(pg_catalog.=) 'S' THEN 'SEQUENCE ' ELSE 'TABLE ' END
                           OPERATOR(pg_catalog.||) c.oid::pg_catalog.regclass::pg_catalog.text
                  FROM pg_catalog.pg_class c
                 WHERE c.relkind OPERATOR(pg_catalog.=) ANY (ARRAY['r', 'v', 'm', 'S', 'p', 'f']::pg_catalog."char"[])
                UNION ALL
                SELECT 'pg_catalog.pg_namespace'::pg_catalog.regclass, n.oid,
                       COALESCE(n.nspacl, pg_catalog.acldefault('n', n.nspowner)), n.nspowner,
                       n.oid, 'SCHEMA ' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(n.nspname)
                  FROM pg_catalog.pg_namespace n) AS m(catalog, id, acl, owner, namespace, object)
          JOIN pg_catalog.pg_depend d
            ON d.classid OPERATOR(pg_catalog.=) m.catalog AND d.objid OPERATOR(pg_catalog.=) m.id
           AND d.deptype OPERATOR(pg_catalog.=) 'e'
           AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
          JOIN pg_catalog.pg_extension e
            ON e.oid OPERATOR(pg_catalog.=) d.refobjid AND e.extname OPERATOR(pg_catalog.=) 'pg_once'
         CROSS JOIN LATERAL pg_catalog.aclexplode(m.acl) a
         WHERE a.grantee OPERATOR(pg_catalog.<>) m.owner
           AND (m.namespace OPERATOR(pg_catalog.=) 'once_internal'::pg_catalog.regnamespace::pg_catalog.oid
                OR NOT (m.catalog::pg_catalog.oid::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                        OPERATOR(pg_catalog.||) m.id::pg_catalog.text)
                       OPERATOR(pg_catalog.=) ANY (pg_catalog.string_to_array(
                           pg_catalog.current_setting('pg_once.kept_privileges', true), ',')))
         GROUP BY 1
        OFFSET 0) AS found
    LOOP
        FOREACH role IN ARRAY o.roles LOOP
            EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM %s CASCADE', o.object, role);
        END LOOP;
    END LOOP;
END
$owner_only$;
GRANT EXECUTE ON FUNCTION once.key_hash(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.may_use_key(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.runtime() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.caller_administers() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.pending_key_counts() TO PUBLIC;
