-- pg_once 0.1.0 -> 0.2.0, run by ALTER EXTENSION pg_once UPDATE. Hand-written. It must
-- leave a 0.1.0 database exactly as a fresh 0.2.0 install leaves a new one (step 9 of
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

-- What exists before this script runs (nothing, on install): the $owner_only$ block at its
-- end closes everything else to every role but the owner.
SELECT pg_catalog.set_config('pg_once.kept_privileges', COALESCE(pg_catalog.string_agg(
           d.classid::pg_catalog.oid::pg_catalog.text OPERATOR(pg_catalog.||) ':'
           OPERATOR(pg_catalog.||) d.objid::pg_catalog.text, ','), ''), true)
  FROM pg_catalog.pg_depend d
  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid
 WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
   AND d.deptype OPERATOR(pg_catalog.=) 'e' AND e.extname OPERATOR(pg_catalog.=) 'pg_once';

-- What only pg_once itself uses moves out of the way, into once_internal (schema.sql).
COMMENT ON SCHEMA once IS
    'pg_once: claim_key and the other functions, the once.stats, once.queue_stats, once.dead_letters and once.namespaces views, and the tables they read. Grant USAGE on it (and EXECUTE on its functions) to the roles that use pg_once.';
CREATE SCHEMA once_internal;

-- The library running this script must be 0.2.0 or later (schema.sql explains the block).
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

ALTER SEQUENCE once.token_seq SET SCHEMA once_internal;
ALTER FUNCTION once.notify_key_resolved() SET SCHEMA once_internal;
ALTER FUNCTION once.wake_queue() SET SCHEMA once_internal;
ALTER FUNCTION once.record_attempt() SET SCHEMA once_internal;
ALTER FUNCTION once.backend_alive(integer, timestamptz) SET SCHEMA once_internal;
ALTER FUNCTION once.row_taken(tid) SET SCHEMA once_internal;

-- Tokens: a fresh install's sequence starts at a floor that next_token() keeps it above
-- (schema.sql). Here the floor is the sequence's current value, at or above every token
-- issued so far; the next token is the one 0.1.0 would have handed out.
DO $$
DECLARE
    last bigint := (SELECT last_value FROM once_internal.token_seq);
BEGIN
    EXECUTE pg_catalog.format('ALTER SEQUENCE once_internal.token_seq START WITH %s', last);
END
$$;

-- Tokens are drawn by next_token(), which keeps the sequence above its floor.
CREATE FUNCTION once_internal.next_token()
RETURNS bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'next_token_wrapper';

-- Namespaces.
ALTER TABLE once.queues ADD COLUMN namespace text;
CREATE TABLE once_internal.namespace_owners (
    prefix     text PRIMARY KEY,
    owner      regrole NOT NULL,
    notify     text NOT NULL DEFAULT 'digest',   -- NOTIFY payload: key | digest
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE FUNCTION once_internal.namespaces_changed() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'namespaces_changed_wrapper';
CREATE TRIGGER namespace_owners_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON once_internal.namespace_owners
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.namespaces_changed();
-- Every backend keeps each queue's namespace in memory too (every claim_next checks it).
CREATE TRIGGER queues_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON once.queues
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.namespaces_changed();
SELECT pg_catalog.pg_extension_config_dump('once_internal.namespace_owners', '');

-- How an attempt ended is now said by the statement that ends it (last_outcome).
ALTER TABLE once.entries ADD COLUMN last_outcome text;

-- Freshness (docs/sql-reference.md, "Freshness"): the columns, last (schema.sql).
ALTER TABLE once.entries
    ADD COLUMN stale_until timestamptz,
    ADD COLUMN beta double precision,
    ADD COLUMN compute_time interval,
    ADD COLUMN rerun text,
    ADD COLUMN rerun_stale interval;

-- Tokens belong to the role that claimed (protocol/sql/rules/token_holder.sql); NULL for 0.1.0's claims.
ALTER TABLE once.entries ADD COLUMN owner_role oid;
COMMENT ON COLUMN once.entries.owner_role IS
    'The role that made the current or last claim: only it, or an administrator, may complete, fail, heartbeat or release the claim with its token. NULL for claims made before 0.2.0.';


CREATE OR REPLACE FUNCTION once_internal.record_attempt() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    INSERT INTO once.attempts (key_hash, key, queue, token, worker, started_at, outcome, error)
    VALUES (OLD.key_hash, OLD.key, OLD.queue, OLD.token, OLD.owner, OLD.claimed_at,
            CASE WHEN TG_OP = 'DELETE' THEN 'cancelled' ELSE NEW.last_outcome END,
            CASE WHEN TG_OP = 'UPDATE' AND NEW.errors > OLD.errors THEN NEW.error END);
    RETURN NULL;
END
$$;

-- Completions record their history themselves (completions_recorded in
-- src/protocol/rules.rs): the trigger records every other end of an attempt.
DROP TRIGGER entries_record_attempt ON once.entries;
CREATE TRIGGER entries_record_attempt
    AFTER UPDATE ON once.entries
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'running' AND OLD.queue IS NOT NULL
          AND (NEW.state OPERATOR(pg_catalog.<>) 'running' OR NEW.token OPERATOR(pg_catalog.<>) OLD.token)
          AND (NEW.last_outcome IS NULL OR NEW.last_outcome OPERATOR(pg_catalog.<>) 'completed'))
    EXECUTE FUNCTION once_internal.record_attempt();

-- Failed keys, for the views (schema.sql).
CREATE INDEX entries_failed_idx ON once.entries (queue) WHERE state OPERATOR(pg_catalog.=) 'failed';

-- reap_stale's purge probes a btree on finished_at, not a BRIN index (schema.sql).
DROP INDEX once.attempts_finished_idx;
CREATE INDEX attempts_finished_idx ON once.attempts (finished_at);

-- Keys counted by namespace and state, so that once.stats reads a few rows, not every key
-- (issue 25: a scan of 1,000,000 keys took 1.2 s, on every scrape). Kept exact by the
-- triggers below, in the transaction that changes the keys: a row trigger adds each
-- change of state (and of errors and attempts) to this backend's pending counts, which
-- are written when the transaction commits, into the rows of this backend's slot
-- (src/protocol/counts.rs). One slot per backend, so that concurrent writers never wait
-- for each other's counts; reap_stale folds the slots into slot -1 (nothing reads more
-- rows than there are namespaces and recently active backends). namespace is the key's
-- namespace's prefix when the change was counted ('' outside every namespace); when the
-- namespaces change, every key is counted again (once_internal.recount_keys). Running keys
-- are not counted here: once.stats counts them from the rows themselves, through their
-- partial index, so that a claim of a new key (an insert) changes no count.
CREATE TABLE once_internal.key_counts (
    slot      integer NOT NULL,   -- the writing backend's number; -1: folded by reap_stale; below: a prepared transaction's
    namespace text NOT NULL,      -- the keys' namespace prefix, '' for none (and role: key_count_label)
    queued    bigint NOT NULL DEFAULT 0,
    done      bigint NOT NULL DEFAULT 0,
    failed    bigint NOT NULL DEFAULT 0,
    errors    bigint NOT NULL DEFAULT 0,  -- sum of once.entries.errors of these keys
    attempts  bigint NOT NULL DEFAULT 0,  -- sum of once.entries.attempts of these keys
    PRIMARY KEY (slot, namespace)
)
-- Every write is an UPDATE of a counter: room for it on the same page (HOT).
WITH (fillfactor = 50);
COMMENT ON TABLE once_internal.key_counts IS
    'Keys that are not running, by namespace and state, and their errors and attempts, kept by triggers on once.entries: what once.stats sums. Exact in every snapshot; rebuilt by once_internal.recount_keys().';
COMMENT ON COLUMN once_internal.key_counts.slot IS
    'The backend that wrote these counts (its number); -1: folded together by reap_stale; below -1: one transaction''s own (a prepared, REPEATABLE READ or SERIALIZABLE one, numbered from its transaction id), folded in turn.';
COMMENT ON COLUMN once_internal.key_counts.namespace IS
    'The namespace prefix of the keys counted (the one they belonged to when counted); empty: keys outside every namespace.';
COMMENT ON COLUMN once_internal.key_counts.queued IS
    'Change in the number of queued keys (summed over the slots: the number).';
COMMENT ON COLUMN once_internal.key_counts.done IS
    'Change in the number of done keys (summed over the slots: the number).';
COMMENT ON COLUMN once_internal.key_counts.failed IS
    'Change in the number of failed keys (summed over the slots: the number).';
COMMENT ON COLUMN once_internal.key_counts.errors IS
    'Change in the sum of once.entries.errors over keys that are not running.';
COMMENT ON COLUMN once_internal.key_counts.attempts IS
    'Change in the sum of once.entries.attempts over keys that are not running.';

CREATE FUNCTION once_internal.count_key() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'count_key_wrapper';
COMMENT ON FUNCTION once_internal.count_key() IS
    'Trigger function: add a key''s change of state, errors or attempts to this backend''s pending counts.';
CREATE FUNCTION once_internal.write_key_counts() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'write_key_counts_wrapper';
COMMENT ON FUNCTION once_internal.write_key_counts() IS
    'Trigger function: once.entries was truncated, count again (no key is left).';

-- No WHEN clause: PostgreSQL reads a trigger's WHEN from the catalog and compiles it again
-- for every statement (it cost more than the trigger's calls); count_key passes over the
-- updates that change no count itself.
CREATE TRIGGER entries_count
    AFTER INSERT OR UPDATE OR DELETE ON once.entries
    FOR EACH ROW EXECUTE FUNCTION once_internal.count_key();
CREATE TRIGGER entries_truncated_count
    AFTER TRUNCATE ON once.entries
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.write_key_counts();

CREATE FUNCTION once_internal.namespaces_recount() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    PERFORM once_internal.recount_keys();
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION once_internal.namespaces_recount() IS
    'Trigger function: the namespaces changed, so the keys are counted again under the namespaces they now belong to.';
-- Named to fire after namespace_owners_changed (triggers fire in name order), which makes
-- this backend read the namespaces again.
CREATE TRIGGER namespace_owners_recount
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON once_internal.namespace_owners
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.namespaces_recount();

-- New functions.
CREATE FUNCTION once.create_namespace(
    prefix   text,
    owner    regrole,
    notify   text DEFAULT 'digest',
    existing text DEFAULT 'refuse')
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'create_namespace_wrapper';

CREATE FUNCTION once.drop_namespace(prefix text)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'drop_namespace_wrapper';

CREATE FUNCTION once_internal.may_use_key(key text)
RETURNS boolean
LANGUAGE c STABLE CALLED ON NULL INPUT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'may_use_key_wrapper';

CREATE FUNCTION once_internal.recount_keys()
RETURNS void
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'recount_keys_wrapper';

COMMENT ON FUNCTION once_internal.recount_keys() IS
$$Count every key of once.entries again into once_internal.key_counts (what once.stats
sums). Run by pg_once when the namespaces change; run it by hand, as an administrator,
after writing once.entries with triggers disabled. Locks once.entries against writes
until the transaction ends.$$;

-- Not SECURITY DEFINER: it tells a session only about its own transaction.
CREATE FUNCTION once_internal.pending_key_counts()
RETURNS TABLE (namespace text, queued bigint, done bigint, failed bigint, errors bigint,
               attempts bigint)
LANGUAGE c VOLATILE PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'pending_key_counts_wrapper';

COMMENT ON FUNCTION once_internal.pending_key_counts() IS
$$What this session's transaction changed in the counts of keys, not written to
once_internal.key_counts until it commits: once.stats adds it.$$;

CREATE FUNCTION once_internal.key_count_label(key text)
RETURNS text
LANGUAGE c STABLE CALLED ON NULL INPUT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'key_count_label_wrapper';

COMMENT ON FUNCTION once_internal.key_count_label(text) IS
$$What a key's counts are kept under in once_internal.key_counts (its namespace column):
the prefix of the key's namespace ('' for none), followed for a once.cached key by a
once.cached key of its role, so that once.stats' filter (may_use_key) shows them only to
whoever may use the key. NULL if the argument is NULL.$$;

CREATE FUNCTION once_internal.key_namespace(key text)
RETURNS text
LANGUAGE c STABLE CALLED ON NULL INPUT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'key_namespace_wrapper';

-- runtime() returns the counters by name (jsonb), with a new symbol; once.stats, which
-- reads them, goes with it.
-- Dropping the view drops what was granted on it: kept aside for this transaction, and
-- granted again once the view is back (below).
SELECT pg_catalog.set_config('pg_once.stats_acl',
                             COALESCE(c.relacl, pg_catalog.acldefault('r', c.relowner))::pg_catalog.text,
                             true),
       pg_catalog.set_config('pg_once.stats_owner', c.relowner::pg_catalog.text, true)
  FROM pg_catalog.pg_class c
 WHERE c.oid OPERATOR(pg_catalog.=) 'once.stats'::pg_catalog.regclass;
DROP VIEW once.stats;
DROP FUNCTION once.runtime();
CREATE FUNCTION once_internal.runtime()
RETURNS TABLE (shared_memory boolean, notify text, workers integer, counters jsonb)
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'runtime_0_2_wrapper';
CREATE FUNCTION once_internal.caller_administers()
RETURNS boolean
LANGUAGE c STABLE PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'caller_administers_wrapper';

-- Nothing here grows with the keys: the running keys (their count, errors, attempts,
-- claims past their lease) are read through their partial index (entries_running_idx);
-- the counts of the others come from once_internal.key_counts (kept by triggers, about
-- one row per namespace; sql/schema.sql) and what the reader's own transaction changed,
-- not written there until it commits; expired
-- results from those past their expiry (entries_expires_idx, the bound a scalar subquery
-- so that it is an index condition). A scan of every key took 1.2 s at 1,000,000 keys.
CREATE VIEW once.stats WITH (security_barrier) AS
SELECT k.queued, l.running, k.done, k.failed, l.running_past_lease, x.expired_unpurged,
       l.oldest_claimed_at, k.errors OPERATOR(pg_catalog.+) l.errors AS errors,
       k.attempts OPERATOR(pg_catalog.+) l.attempts AS attempts,
       -- The sequence's value tells which tokens are in use: administrators and
       -- monitoring roles (pg_monitor) only.
       CASE WHEN once_internal.caller_administers()
                 OR pg_catalog.pg_has_role('pg_monitor', 'MEMBER')
            THEN (SELECT last_value FROM once_internal.token_seq) END AS last_token,
       r.shared_memory, r.notify, r.workers,
       (r.counters OPERATOR(pg_catalog.->>) 'claims')::bigint AS claims,
       (r.counters OPERATOR(pg_catalog.->>) 'hits')::bigint AS hits,
       (r.counters OPERATOR(pg_catalog.->>) 'waits')::bigint AS waits,
       (r.counters OPERATOR(pg_catalog.->>) 'wakeups')::bigint AS wakeups,
       (r.counters OPERATOR(pg_catalog.->>) 'takeovers')::bigint AS takeovers,
       (r.counters OPERATOR(pg_catalog.->>) 'completions')::bigint AS completions,
       (r.counters OPERATOR(pg_catalog.->>) 'failures')::bigint AS failures,
       (r.counters OPERATOR(pg_catalog.->>) 'releases')::bigint AS releases,
       (r.counters OPERATOR(pg_catalog.->>) 'invalidations')::bigint AS invalidations,
       (r.counters OPERATOR(pg_catalog.->>) 'reaped')::bigint AS reaped,
       (r.counters OPERATOR(pg_catalog.->>) 'purged')::bigint AS purged,
       (r.counters OPERATOR(pg_catalog.->>) 'notified_direct')::bigint AS notified_direct,
       (r.counters OPERATOR(pg_catalog.->>) 'notified_relayed')::bigint AS notified_relayed,
       (r.counters OPERATOR(pg_catalog.->>) 'stale')::bigint AS stale,
       (r.counters OPERATOR(pg_catalog.->>) 'refreshes')::bigint AS refreshes
  FROM (SELECT coalesce(sum(c.queued), 0)::bigint AS queued,
               coalesce(sum(c.done), 0)::bigint AS done,
               coalesce(sum(c.failed), 0)::bigint AS failed,
               coalesce(sum(c.errors), 0)::bigint AS errors,
               coalesce(sum(c.attempts), 0)::bigint AS attempts
          FROM (SELECT a.namespace, sum(a.queued) AS queued, sum(a.done) AS done, sum(a.failed) AS failed, sum(a.errors) AS errors,
                       sum(a.attempts) AS attempts
                  FROM (SELECT namespace, queued, done, failed, errors, attempts
                          FROM once_internal.key_counts
                        UNION ALL
                        SELECT namespace, queued, done, failed, errors, attempts
                          FROM once_internal.pending_key_counts()) a
                 GROUP BY a.namespace) c
         WHERE once_internal.may_use_key(c.namespace)) AS k,
       (SELECT count(*) AS running,
               count(*) FILTER (WHERE e.lease_expires_at OPERATOR(pg_catalog.<=) t.now) AS running_past_lease,
               min(e.claimed_at) AS oldest_claimed_at,
               coalesce(sum(e.errors), 0) AS errors, coalesce(sum(e.attempts), 0) AS attempts
          FROM (SELECT clock_timestamp() AS now) t, once.entries e
         WHERE e.state OPERATOR(pg_catalog.=) 'running' AND once_internal.may_use_key(e.key)) AS l,
       (SELECT count(*) AS expired_unpurged
          FROM once.entries e
         WHERE e.expires_at OPERATOR(pg_catalog.<=) (SELECT clock_timestamp())
           AND e.state OPERATOR(pg_catalog.=) 'done'
           AND coalesce(e.stale_until, e.expires_at) OPERATOR(pg_catalog.<=) (SELECT clock_timestamp())
           AND once_internal.may_use_key(e.key)) AS x,
       once_internal.runtime() AS r;

-- The views show each role only the keys, queues and namespaces it may use.
-- Each count reads only the keys of its state, through a partial index: entries_queue_idx
-- (queued), entries_running_idx (running), entries_failed_idx (failed); the history of
-- the last hour through attempts_finished_idx (the bound a scalar subquery, so that it is
-- an index condition). Nothing grows with the keys that are done or the history kept: a
-- join of once.entries on the queue read every key the queue ever ran, 1.1 s at 1,000,000
-- keys (issue 25). Each state is counted once for all queues, then joined to them: a
-- count per queue made the planner's estimate the number of queues (202 for a table never
-- analyzed, as once.queues, with its few rows, normally is) times a count, past
-- jit_above_cost, and JIT compiling took 360 ms of a 1 ms read.
CREATE OR REPLACE VIEW once.queue_stats WITH (security_barrier) AS
SELECT q.name AS queue, coalesce(w.depth, 0) AS depth, coalesce(w.due, 0) AS due,
       coalesce(r.running, 0) AS running, coalesce(d.dead, 0) AS dead,
       n.now OPERATOR(pg_catalog.-) w.oldest_due AS oldest_due_age,
       coalesce(h.completed_last_minute, 0) AS completed_last_minute,
       coalesce(h.failed_last_minute, 0) AS failed_last_minute,
       coalesce(h.completed_last_hour, 0) AS completed_last_hour
  FROM (SELECT clock_timestamp() AS now) n
 CROSS JOIN once.queues q
  LEFT JOIN (
       SELECT e.queue, count(*) AS depth,
              count(*) FILTER (WHERE e.run_at OPERATOR(pg_catalog.<=) t.now) AS due,
              min(e.run_at) FILTER (WHERE e.run_at OPERATOR(pg_catalog.<=) t.now) AS oldest_due
         FROM (SELECT clock_timestamp() AS now) t, once.entries e
        WHERE e.state OPERATOR(pg_catalog.=) 'queued' AND once_internal.may_use_key(e.key)
        GROUP BY e.queue) w ON w.queue OPERATOR(pg_catalog.=) q.name
  LEFT JOIN (
       SELECT e.queue, count(*) AS running FROM once.entries e
        WHERE e.state OPERATOR(pg_catalog.=) 'running' AND once_internal.may_use_key(e.key)
        GROUP BY e.queue) r ON r.queue OPERATOR(pg_catalog.=) q.name
  LEFT JOIN (
       SELECT e.queue, count(*) AS dead FROM once.entries e
        WHERE e.state OPERATOR(pg_catalog.=) 'failed' AND once_internal.may_use_key(e.key)
        GROUP BY e.queue) d ON d.queue OPERATOR(pg_catalog.=) q.name
  LEFT JOIN (
       SELECT a.queue,
              count(*) FILTER (WHERE a.outcome OPERATOR(pg_catalog.=) 'completed'
                                 AND a.finished_at OPERATOR(pg_catalog.>) t.minute_ago) AS completed_last_minute,
              count(*) FILTER (WHERE a.outcome OPERATOR(pg_catalog.<>) 'completed'
                                 AND a.finished_at OPERATOR(pg_catalog.>) t.minute_ago) AS failed_last_minute,
              count(*) FILTER (WHERE a.outcome OPERATOR(pg_catalog.=) 'completed') AS completed_last_hour
         FROM (SELECT clock_timestamp() OPERATOR(pg_catalog.-) interval '1 minute' AS minute_ago) t,
              once.attempts a
        WHERE a.finished_at OPERATOR(pg_catalog.>) (SELECT clock_timestamp() OPERATOR(pg_catalog.-) interval '1 hour')
        GROUP BY a.queue) h ON h.queue OPERATOR(pg_catalog.=) q.name
 WHERE q.namespace IS NULL OR once_internal.may_use_key(q.namespace);
CREATE OR REPLACE VIEW once.dead_letters WITH (security_barrier) AS
SELECT key, queue, payload, attempts, errors, error, updated_at AS failed_at
  FROM once.entries
 WHERE state OPERATOR(pg_catalog.=) 'failed' AND queue IS NOT NULL AND once_internal.may_use_key(key);
CREATE VIEW once.namespaces WITH (security_barrier) AS
SELECT prefix, owner, notify, created_at, once_internal.may_use_key(prefix) AS member
  FROM once_internal.namespace_owners;

-- claim_key gains serve_stale, complete_key and complete_keys gain stale, beta and jitter:
-- new signatures, so new functions with new symbols. Dropping a function drops what was
-- granted on it, so each new one gets the old one's grants: a role that could claim and
-- complete keys before the update still can after it. A grant made while an extension
-- script runs is recorded as one of the extension's own initial privileges
-- (pg_init_privs), which pg_dump leaves out: so the initial privileges are set back to a
-- fresh install's afterwards, and the grants stay the administrator's, dumped and
-- restored like any other. (Updating pg_init_privs needs a superuser, as does running
-- this script: pg_once.control says superuser = true.)
-- grant_again(acl, owner, catalog, object): object (of catalog pg_proc or pg_class) was
-- just created in place of a dropped one whose privileges were acl: what the installing
-- role's default privileges gave on it goes, what acl granted to roles other than its
-- owner is granted again, and the extension's initial privileges are a fresh install's.
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

SELECT once_internal.grant_again(pg_catalog.current_setting('pg_once.stats_acl')::pg_catalog.aclitem[],
                                 pg_catalog.current_setting('pg_once.stats_owner')::pg_catalog.oid,
                                 'pg_catalog.pg_class', 'once.stats');

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
    'once.claim_key(text, interval, interval, integer)',
    'once.claim_key(text, interval, interval, integer, boolean)',
    $create$
CREATE FUNCTION once.claim_key(
    key         text,
    lease       interval DEFAULT '30 seconds',
    wait        interval DEFAULT '0',
    owner_pid   integer DEFAULT NULL,
    serve_stale boolean DEFAULT false)
RETURNS once.claim
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'claim_key_0_2_wrapper'
$create$);

SELECT once_internal.replace_function(
    'once.complete_key(text, bigint, jsonb, interval)',
    'once.complete_key(text, bigint, jsonb, interval, interval, double precision, double precision)',
    $create$
CREATE FUNCTION once.complete_key(
    key    text,
    token  bigint,
    result jsonb,
    ttl    interval DEFAULT NULL,
    stale  interval DEFAULT NULL,
    beta   float8 DEFAULT NULL,
    jitter float8 DEFAULT NULL)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'complete_key_0_2_wrapper'
$create$);

SELECT once_internal.replace_function(
    'once.complete_keys(text[], bigint[], jsonb[], interval)',
    'once.complete_keys(text[], bigint[], jsonb[], interval, interval, double precision, double precision)',
    $create$
CREATE FUNCTION once.complete_keys(
    keys    text[],
    tokens  bigint[],
    results jsonb[],
    ttl     interval DEFAULT NULL,
    stale   interval DEFAULT NULL,
    beta    float8 DEFAULT NULL,
    jitter  float8 DEFAULT NULL)
RETURNS TABLE (key text)
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'complete_keys_0_2_wrapper'
$create$);

-- create_queue gains namespace.
SELECT once_internal.replace_function(
    'once.create_queue(text, integer, interval, interval)',
    'once.create_queue(text, integer, interval, interval, text)',
    $create$
CREATE FUNCTION once.create_queue(
    name         text,
    max_attempts integer DEFAULT 5,
    backoff      interval DEFAULT '1 second',
    max_backoff  interval DEFAULT '1 hour',
    namespace    text DEFAULT NULL)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'create_queue_0_2_wrapper'
$create$);

DROP FUNCTION once_internal.replace_function(regprocedure, text, text);
DROP FUNCTION once_internal.grant_again(aclitem[], oid, regclass, text);

-- The C functions no longer pin search_path in their declarations: they pin it around
-- each SQL statement they run (src/storage/statements.rs), so a call that runs none, a
-- cache hit, does not pay for it. Nor are they SECURITY DEFINER: they judge their caller
-- as the current user and run only their statements with the owner's rights
-- (docs/security.md). Those kept from 0.1.0 drop both.
DO $reset$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
              WHERE p.pronamespace OPERATOR(pg_catalog.=)
                        ANY (ARRAY['once'::pg_catalog.regnamespace::pg_catalog.oid,
                                   'once_internal'::pg_catalog.regnamespace::pg_catalog.oid])
                AND p.prolang OPERATOR(pg_catalog.=) (SELECT l.oid FROM pg_catalog.pg_language l
                                                       WHERE l.lanname OPERATOR(pg_catalog.=) 'c')
                AND (p.proconfig IS NOT NULL OR p.prosecdef) LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s RESET search_path', f);
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SECURITY INVOKER', f);
    END LOOP;
END
$reset$;

-- claim_key's hit alone, as a scalar function (issue 25).
CREATE FUNCTION once.get(key text)
RETURNS jsonb
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'get_wrapper';

CREATE FUNCTION once.refresh_key(key text, stale interval DEFAULT NULL)
RETURNS text
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'refresh_key_wrapper';

-- enqueue_key for many keys (plan_cache_mode and enable_seqscan: see functions.sql).
CREATE FUNCTION once.enqueue_keys(
    keys         text[],
    payloads     jsonb[] DEFAULT NULL,
    queue        text DEFAULT 'default',
    priority     integer DEFAULT 0,
    run_at       timestamptz DEFAULT NULL,
    refresh      boolean DEFAULT false,
    max_attempts integer DEFAULT NULL)
RETURNS TABLE (key text, outcome text)
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS 'MODULE_PATHNAME', 'enqueue_keys_wrapper';

-- The key once.cached keeps a query's rows under: bound to the query, the role and the
-- search_path (src/protocol/cached.rs), and usable by that role only.
CREATE FUNCTION once.cached_key(key text, query text)
RETURNS text
LANGUAGE c STABLE CALLED ON NULL INPUT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'cached_key_wrapper';

COMMENT ON FUNCTION once.cached_key(text, text) IS
$$The key under which once.cached(key, query) keeps the query's rows for the calling role
and its search_path: key, then '#cached:', the role's OID and a digest of the
search_path and the query. Only that role (and administrators) may use it, e.g.
once.invalidate_key(once.cached_key(key, query)). 42601 unless query is exactly one
SELECT (or VALUES, TABLE).$$;

-- once.cached runs the caller's query as the caller: SECURITY INVOKER, and no pinned
-- search_path, so that the query's names resolve as they would in the caller's own
-- statement. Everything it names itself is schema-qualified. Its rows are kept under
-- once.cached_key(key, query): one entry per role, search_path and query text, so a
-- result is only ever served to the role that computed it with the same query, and, on
-- every hit, only while that role may still run the query (planning it checks the
-- role's privileges on every table it reads; row-level security that depends on session
-- settings is not: put such settings in the key).
CREATE FUNCTION once.cached(
    key         text,
    query       text,
    ttl         interval DEFAULT NULL,
    stale       interval DEFAULT NULL,
    beta        float8 DEFAULT NULL,
    jitter      float8 DEFAULT NULL,
    wait        interval DEFAULT '30 seconds',
    lease       interval DEFAULT '5 minutes')
RETURNS jsonb
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT SECURITY INVOKER PARALLEL UNSAFE
AS $cached$
DECLARE
    bound text;
    rows_of text;
    answer once.claim;
    computed jsonb;
BEGIN
    IF query IS NULL THEN
        RAISE EXCEPTION 'query must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the query whose rows are to be cached, e.g. ''SELECT ... FROM ...''.';
    END IF;
    -- 42601 unless query is one SELECT: the subquery below then cannot smuggle a second
    -- statement past the parser.
    bound := once.cached_key(key, query);
    rows_of := pg_catalog.format(
        E'SELECT COALESCE(pg_catalog.jsonb_agg(pg_catalog.to_jsonb(r)), ''[]''::jsonb) FROM (\n%s\n) r',
        query);
    -- Bad options (ttl, stale, beta, jitter) are refused by complete_key, after the query
    -- has run: the statement fails and changes nothing. (A check before it would need a
    -- function of once_internal, which the caller, running this as itself, cannot reach.)
    answer := once.claim_key(bound, lease => lease, wait => wait, serve_stale => true);
    IF answer.outcome IN ('hit', 'stale', 'failed') THEN
        -- What was computed (or how it failed) is served only while this role may still
        -- run the query: planning it checks the privileges on every table it reads.
        EXECUTE 'EXPLAIN (COSTS OFF) ' || rows_of;
    END IF;
    IF answer.outcome IN ('hit', 'stale') THEN
        RETURN answer.result;
    ELSIF answer.outcome IN ('claimed', 'refresh') THEN
        EXECUTE rows_of INTO computed;
        PERFORM once.complete_key(bound, answer.token, computed, ttl => ttl, stale => stale,
                                  beta => beta, jitter => jitter);
        RETURN computed;
    ELSIF answer.outcome = 'failed' THEN
        RAISE EXCEPTION 'the last computation of key "%" failed: %', key, answer.error
            USING ERRCODE = 'external_routine_exception',
                  HINT = pg_catalog.format('It may be retried after %s.', answer.retry_at);
    ELSE
        RAISE EXCEPTION 'key "%" is still being computed by % after waiting %', key,
                        COALESCE(answer.owner, 'another transaction'), wait
            USING ERRCODE = 'lock_not_available',
                  HINT = 'Pass a longer wait, e.g. wait => ''2 minutes''.';
    END IF;
END
$cached$;

COMMENT ON FUNCTION once.cached(text, text, interval, interval, double precision, double precision, interval, interval) IS
$$The cached rows of query (a jsonb array of one object per row, query being one SELECT),
computed once by the first caller, as that caller's role, while the others wait (at most
wait) or, within stale, are served the previous rows. ttl, stale, beta and jitter as for
complete_key. The rows are kept under once.cached_key(key, query): only the same role
with the same query text and search_path is served them, and only while it may still
run query. Everything runs in the caller's transaction: if query fails, its error is
raised and nothing is recorded, so the next caller tries it again.$$;

-- The same, called with CALL in autocommit: the claim is committed before query runs, so
-- that the others wait for it as for any claim (woken when it ends, not polling an open
-- transaction), and a failing query is recorded with fail_key and shared with them until
-- retry_after, as every pg_once failure is. A procedure may commit; a function may not.
CREATE PROCEDURE once.cached(
    key         text,
    query       text,
    INOUT result jsonb,
    ttl         interval DEFAULT NULL,
    stale       interval DEFAULT NULL,
    beta        float8 DEFAULT NULL,
    jitter      float8 DEFAULT NULL,
    wait        interval DEFAULT '30 seconds',
    lease       interval DEFAULT '5 minutes',
    retry_after interval DEFAULT '0')
LANGUAGE plpgsql SECURITY INVOKER
AS $cached$
DECLARE
    bound text;
    answer once.claim;
    failed_with text;
    failed_message text;
BEGIN
    IF query IS NULL THEN
        RAISE EXCEPTION 'query must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the query whose rows are to be cached, e.g. ''SELECT ... FROM ...''.';
    END IF;
    bound := once.cached_key(key, query);
    answer := once.claim_key(bound, lease => lease, wait => wait, serve_stale => true);
    IF answer.outcome = 'wait' THEN
        RAISE EXCEPTION 'key "%" is still being computed by % after waiting %', key,
                        COALESCE(answer.owner, 'another transaction'), wait
            USING ERRCODE = 'lock_not_available',
                  HINT = 'Pass a longer wait, e.g. wait => ''2 minutes''.';
    ELSIF answer.outcome NOT IN ('claimed', 'refresh') THEN
        -- Served from the cache, or a shared failure: answered as the function answers
        -- them (which checks the query's privileges and looks at the key once more,
        -- without waiting).
        result := once.cached(key, query, ttl, stale, beta, jitter, wait => '0', lease => lease);
        RETURN;
    END IF;
    COMMIT;
    BEGIN
        EXECUTE pg_catalog.format(
            E'SELECT COALESCE(pg_catalog.jsonb_agg(pg_catalog.to_jsonb(r)), ''[]''::jsonb) FROM (\n%s\n) r',
            query) INTO result;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- (OTHERS leaves out query_canceled: a cancel or statement_timeout must give the
        -- committed claim back too, or the others would wait for it until its lease.)
        GET STACKED DIAGNOSTICS failed_with = RETURNED_SQLSTATE, failed_message = MESSAGE_TEXT;
    END;
    IF failed_with IS NULL THEN
        PERFORM once.complete_key(bound, answer.token, result, ttl => ttl, stale => stale,
                                  beta => beta, jitter => jitter);
        RETURN;
    END IF;
    -- A role that may not run the query has found nothing out about the key, and a
    -- cancelled query says nothing about it either: neither is shared as its failure.
    IF failed_with IN ('42501', '57014') THEN
        PERFORM once.release_key(bound, answer.token);
    ELSE
        -- Cut to what fail_key takes (once.max_error_size, 16 kB by default; 4,000
        -- characters are at most 16,000 bytes): the claim is committed, and a refused
        -- fail_key would leave it running until its lease.
        PERFORM once.fail_key(bound, answer.token, pg_catalog.left(failed_message, 4000),
                              retry_after);
    END IF;
    COMMIT;
    RAISE EXCEPTION USING ERRCODE = failed_with, MESSAGE = failed_message;
END
$cached$;

COMMENT ON PROCEDURE once.cached(text, text, jsonb, interval, interval, double precision, double precision, interval, interval, interval) IS
$$CALL once.cached(key, query, NULL, ttl => ...) in autocommit: once.cached, with the claim
committed before query runs, so that a failing query is recorded (fail_key) and shared
with the other callers of the same role and query until retry_after, and the others are
woken when it ends.$$;

-- Privileges of the new objects, as a fresh install sets them (end of functions.sql). Those
-- granted again (grant_again) are not named: a REVOKE would record their grants as the
-- extension's own.
REVOKE ALL ON FUNCTION once_internal.library_version(), once.create_namespace(text, regrole, text, text),
    once.drop_namespace(text), once_internal.key_namespace(text), once_internal.runtime(),
    once_internal.may_use_key(text), once_internal.caller_administers(),
    once_internal.namespaces_changed(),
    once_internal.next_token(), once.refresh_key(text, interval), once.cached_key(text, text),
    once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer),
    once.cached(text, text, interval, interval, double precision, double precision, interval, interval)
    FROM PUBLIC;
REVOKE ALL ON PROCEDURE once.cached(text, text, jsonb, interval, interval, double precision,
                                    double precision, interval, interval, interval) FROM PUBLIC;
REVOKE ALL ON once_internal.namespace_owners, once.namespaces FROM PUBLIC;
REVOKE ALL ON SCHEMA once_internal FROM PUBLIC;
-- (end of functions.sql)
-- Nobody but the owner holds a privilege on what these scripts created, nor any privilege
-- on what only pg_once uses (once_internal). Revoking from PUBLIC is not enough: the
-- installing role's default privileges (ALTER DEFAULT PRIVILEGES ... GRANT SELECT, UPDATE
-- ON TABLES TO x) apply to every object a script creates, and would give x once.entries
-- itself. What existed before an upgrade keeps what administrators granted on it (listed
-- in pg_once.kept_privileges, set at the script's start, along with the objects an
-- upgrade recreated and granted again). The grants below are given after. Every install
-- and upgrade script ends with this same block.
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

-- Comments: every object and column, as a fresh install has them.
COMMENT ON SCHEMA once IS
    'pg_once: claim_key and the other functions, the once.stats, once.queue_stats, once.dead_letters and once.namespaces views, and the tables they read. Grant USAGE on it (and EXECUTE on its functions) to the roles that use pg_once.';
COMMENT ON SCHEMA once_internal IS
    'pg_once''s own machinery (trigger functions, the fencing-token sequence, namespace table, helpers of the views): not an API, may change in any release. Grant nothing on it.';
COMMENT ON FUNCTION once_internal.library_version() IS
    'The version of the pg_once library loaded in this session. It differs from the installed extension''s (pg_extension.extversion) after a package upgrade until ALTER EXTENSION pg_once UPDATE and, where pg_once is preloaded, a restart.';
COMMENT ON TYPE once.claim IS
    'What one once.claim_key call decided (outcome) and what goes with it.';
COMMENT ON COLUMN once.claim.outcome IS
    'What the call decided: hit (result is set), claimed (you own the key: compute, then complete_key with token), failed (error is set, until retry_at) or wait (someone else computes it). With serve_stale => true also refresh (you own the key and result is the previous one: serve it, recompute, complete_key) and stale (result is the previous one, served while someone refreshes it).';
COMMENT ON COLUMN once.claim.token IS
    'claimed or refresh: your fencing token, to pass to complete_key, fail_key, heartbeat_key or release_key. wait or stale: the owner''s token (stale: NULL when nobody refreshes right now). NULL otherwise.';
COMMENT ON COLUMN once.claim.result IS
    'hit: the cached result; refresh and stale: the previous result, served while it is recomputed; claimed: the previous result when a refresh is handed to a caller that did not ask for serve_stale. NULL otherwise.';
COMMENT ON COLUMN once.claim.error IS
    'failed: the error the last attempt recorded with fail_key (or why its owner was judged gone); stale: the same, when the last refresh failed. NULL otherwise.';
COMMENT ON COLUMN once.claim.owner IS
    'claimed, refresh, wait or stale: who holds the claim (application name, user and pid of the claiming session). NULL while another transaction''s claim is not committed yet.';
COMMENT ON COLUMN once.claim.lease_expires_at IS
    'claimed, refresh, wait or stale: when the owner''s lease runs out unless it heartbeats; a LISTEN client waits at most until then before asking again.';
COMMENT ON COLUMN once.claim.attempts IS
    'Claims of this key since its last result (a takeover counts).';
COMMENT ON COLUMN once.claim.retry_at IS
    'failed: when the key may be claimed again. NULL otherwise.';
COMMENT ON COLUMN once.claim.expires_at IS
    'hit: when the result stops being fresh (NULL: never); refresh and stale: when the previous result stopped (or stops) being fresh.';
COMMENT ON FUNCTION once.key_hash(text) IS
    'SHA-256 digest of a key: the primary key of once.entries. Look a key up with WHERE key_hash = once.key_hash(''...'').';
COMMENT ON COLUMN once.queues.name IS
    'The queue''s name, as given to create_queue, enqueue_key and claim_next.';
COMMENT ON COLUMN once.queues.max_attempts IS
    'Claims of a key (takeovers of dead workers count) before it stays failed, unless enqueue_key gave the key its own.';
COMMENT ON COLUMN once.queues.backoff IS
    'Delay after the first failed attempt; it doubles with each further failure (jittered to between half and all of it).';
COMMENT ON COLUMN once.queues.max_backoff IS
    'The doubling of backoff stops here.';
COMMENT ON COLUMN once.queues.created_at IS
    'When the queue was created.';
COMMENT ON COLUMN once.queues.namespace IS
    'The namespace (a key prefix) whose owner''s members alone may use the queue; NULL: shared by every role granted pg_once.';
COMMENT ON TABLE once.queues IS
    'Queues of queue mode and their retry policy: a failed attempt waits backoff * 2^(attempts-1) (capped at max_backoff, with jitter) until max_attempts claims, then the key stays failed.';
COMMENT ON TABLE once_internal.namespace_owners IS
    'Namespaces: key prefixes that belong to a role, and what their keys are announced as on channel once. See the once.namespaces view.';
COMMENT ON COLUMN once_internal.namespace_owners.prefix IS
    'Keys that start with this prefix (the longest registered prefix wins) belong to the namespace.';
COMMENT ON COLUMN once_internal.namespace_owners.owner IS
    'Only members of this role (and superusers) may use the namespace''s keys and queues.';
COMMENT ON COLUMN once_internal.namespace_owners.notify IS
    'What LISTENers on channel once receive when a key of the namespace resolves: digest (its hex SHA-256) or key.';
COMMENT ON COLUMN once_internal.namespace_owners.created_at IS
    'When the namespace was created.';
COMMENT ON FUNCTION once_internal.namespaces_changed() IS
    'Trigger function: make every backend read the namespaces again (once_internal.namespace_owners, and the queues'' namespaces in once.queues).';
COMMENT ON TABLE once.entries IS
    'One row per key: its state (queued, running, done, failed), fencing token, owner, lease, result and error. Written only through the once.* functions.';
COMMENT ON COLUMN once.entries.key_hash IS
    'SHA-256 of key (once.key_hash(key)): the primary key. Look a key up with WHERE key_hash = once.key_hash(''...'').';
COMMENT ON COLUMN once.entries.key IS
    'The key, verbatim (1 to 7,500 bytes).';
COMMENT ON COLUMN once.entries.state IS
    'queued (waiting for a queue worker), running (claimed: being computed), done (result is served) or failed (error is served until retry_at, or for good for a queued key out of attempts).';
COMMENT ON COLUMN once.entries.token IS
    'The fencing token of the key''s latest claim; writes with any other token change nothing.';
COMMENT ON COLUMN once.entries.owner IS
    'Who holds or last held the claim: application name, user and pid of the claiming session (claim_next: its worker argument).';
COMMENT ON COLUMN once.entries.owner_pid IS
    'The backend whose exit ends the claim (this session, or an owner_session()); NULL with owner_pid => 0.';
COMMENT ON COLUMN once.entries.owner_started IS
    'When the owner_pid backend started: a reused pid is not mistaken for the owner.';
COMMENT ON COLUMN once.entries.lease_only IS
    'true: only the lease ends the claim (owner_pid => 0, or once.backend_liveness off), not the owner backend''s exit.';
COMMENT ON COLUMN once.entries.lease_expires_at IS
    'running: when the claim ends unless heartbeat_key extends it.';
COMMENT ON COLUMN once.entries.result IS
    'done: the result complete_key stored (kept while a refresh recomputes it).';
COMMENT ON COLUMN once.entries.expires_at IS
    'When the result stops being fresh: after it, it is served as stale until stale_until, if set, and then purged (NULL: fresh until invalidated).';
COMMENT ON COLUMN once.entries.error IS
    'The last failed attempt''s error.';
COMMENT ON COLUMN once.entries.errors IS
    'Failed attempts since the key was created (takeovers of dead owners count): claim_next serves keys with fewer first.';
COMMENT ON COLUMN once.entries.attempts IS
    'Claims since the key''s last result; a queued key stays failed when it reaches max_attempts.';
COMMENT ON COLUMN once.entries.retry_at IS
    'failed: when the key may be claimed (or, queued, is due) again.';
COMMENT ON COLUMN once.entries.last_outcome IS
    'How the last attempt ended: completed, failed, released, abandoned (its owner was gone and a reaper took the claim back) or taken_over (its owner was gone and a caller took the claim); NULL until an attempt ended.';
COMMENT ON COLUMN once.entries.stale_until IS
    'Until when an expired result is still served, as stale, while one caller refreshes it (complete_key''s stale); NULL: not served past expires_at.';
COMMENT ON COLUMN once.entries.beta IS
    'complete_key''s beta: how eagerly a hit refreshes the result before it expires (XFetch); NULL: never early.';
COMMENT ON COLUMN once.entries.compute_time IS
    'How long the computation of the current result took, from its claim to complete_key: the delta of early refreshes.';
COMMENT ON COLUMN once.entries.rerun IS
    'A recompute requested while the key ran (refresh_key, invalidate_key, enqueue_key with refresh), carried out when the run ends: the key is computed once more, and the run''s result is meanwhile served as completed (keep), as stale for rerun_stale (stale) or not at all (discard). NULL: none.';
COMMENT ON COLUMN once.entries.rerun_stale IS
    'With rerun stale: how long the result of the run in progress is served as stale after it ends.';
COMMENT ON COLUMN once.entries.created_at IS
    'When the key''s row was created.';
COMMENT ON COLUMN once.entries.claimed_at IS
    'When the current or last claim was made.';
COMMENT ON COLUMN once.entries.completed_at IS
    'When the last result was stored.';
COMMENT ON COLUMN once.entries.updated_at IS
    'When the row was last written.';
COMMENT ON COLUMN once.entries.queue IS
    'Queue mode: the queue the key was enqueued in (NULL: never enqueued).';
COMMENT ON COLUMN once.entries.payload IS
    'Queue mode: the payload given to enqueue_key, handed to the worker by claim_next.';
COMMENT ON COLUMN once.entries.priority IS
    'Queue mode: smaller runs first (after fewer errors).';
COMMENT ON COLUMN once.entries.run_at IS
    'Queue mode: when the queued key is due.';
COMMENT ON COLUMN once.entries.max_attempts IS
    'Queue mode: this key''s limit of claims (NULL: its queue''s).';
COMMENT ON COLUMN once.entries.enqueued_at IS
    'Queue mode: when the key was last enqueued.';
COMMENT ON TABLE once.attempts IS
    'One row per ended attempt at a queued key: who (worker), when (started_at, finished_at), how it ended (outcome) and why (error). Look a key up with WHERE key_hash = once.key_hash(''...'').';
COMMENT ON COLUMN once.attempts.key_hash IS
    'SHA-256 of key: look a key''s history up with WHERE key_hash = once.key_hash(''...'').';
COMMENT ON COLUMN once.attempts.key IS
    'The key.';
COMMENT ON COLUMN once.attempts.queue IS
    'The queue the key was in.';
COMMENT ON COLUMN once.attempts.token IS
    'The attempt''s fencing token.';
COMMENT ON COLUMN once.attempts.worker IS
    'Who made the attempt (claim_next''s worker argument, else the claiming session).';
COMMENT ON COLUMN once.attempts.started_at IS
    'When the attempt''s claim was made.';
COMMENT ON COLUMN once.attempts.finished_at IS
    'When the attempt ended; rows older than once.history_retention are deleted by reap_stale.';
COMMENT ON COLUMN once.attempts.outcome IS
    'How the attempt ended: completed, failed, released, abandoned (reaped: owner gone), taken_over (a caller took the claim of a gone owner) or cancelled (the key was invalidated).';
COMMENT ON COLUMN once.attempts.error IS
    'failed (or abandoned, taken_over): the error recorded.';
COMMENT ON FUNCTION once_internal.notify_key_resolved() IS
    'Trigger function: pg_notify(''once'', key) when a key leaves the running state.';
COMMENT ON FUNCTION once_internal.wake_queue() IS
    'Trigger function: wake the workers waiting for work in the queue a key went back to.';
COMMENT ON FUNCTION once_internal.record_attempt() IS
    'Trigger function: append to once.attempts when an attempt at a queued key ends.';
COMMENT ON FUNCTION once.claim_key(text, interval, interval, integer, boolean) IS
$$Claim a key or get its cached result, in one round trip. outcome is:
hit (result is set), claimed (you own the key: compute, then complete_key with token),
failed (the last attempt failed and retry_at is in the future: error is set), or
wait (someone else is computing it: owner, lease_expires_at are set; all NULL while
another transaction's claim is not committed yet).
With serve_stale => true, also refresh (you own the key and result is the previous one:
serve it, recompute, complete_key) and stale (result is the previous one, served at once
while someone refreshes it); without it a refresh is answered claimed and a stale result
wait (or failed), as before pg_once 0.2.
With wait > 0 the call blocks, holding no lock, until the key resolves, its owner is gone
(then you are given the claim) or wait elapses (then it returns wait), whatever other
transactions hold; wait => 0 never waits for a lock.
owner_pid says what ends your claim besides its lease: NULL this connection (or the lease
alone if once.backend_liveness is off), 0 the lease alone, or the pid once.owner_session()
returned on a connection your process keeps open (for calls made through a pool).
Call it in its own transaction: a claim is only visible to others once committed.$$;
COMMENT ON FUNCTION once.owner_session() IS
$$Make this connection an owner session and return its pid. Claims made on other
connections (through a pool) with claim_key(..., owner_pid => that pid) or claim_next end
when this connection closes, as if made on it; when pg_once is preloaded, the pg_once
worker takes them back at once. Call it on a connection your process keeps open for its
lifetime, such as its LISTEN connection (direct or session-pooled).$$;
COMMENT ON FUNCTION once.complete_key(text, bigint, jsonb, interval, interval, double precision, double precision) IS
$$Store the result of your claim and wake everyone waiting for the key. It is fresh for
ttl (NULL: until invalidated), shortened by up to jitter of it (0 to 1, drawn per key:
keys filled together do not expire together), then served as stale for stale more while
one caller refreshes it. beta > 0: hits refresh it early, the more likely the nearer its
expiry and the longer it took to compute (XFetch). Returns false, changing nothing, if
token is no longer the key's current claim (taken over, reaped or released).$$;
COMMENT ON FUNCTION once.fail_key(text, bigint, text, interval) IS
$$Record that your claim failed with error, and wake waiters. Until retry_after has passed,
claim_key returns outcome failed with this error (callers share the failure instead of
stampeding); after it, the next caller claims the key again. Counts once.entries.errors.
Returns false, changing nothing, if token is no longer the key's current claim.$$;
COMMENT ON FUNCTION once.heartbeat_key(text, bigint, interval) IS
$$Extend your claim's lease to now + lease and return the new expiry. Returns NULL,
changing nothing, if token is no longer the key's current claim: stop computing.$$;
COMMENT ON FUNCTION once.release_key(text, bigint) IS
$$Give your claim back without recording a failure (e.g. on shutdown); the key becomes
absent and one waiter claims it at once. Returns false if token is no longer current.$$;
COMMENT ON FUNCTION once.invalidate_key(text) IS
$$Forget a key: drop its cached result or failure. A running key keeps its claim (a second
computation never starts beside it): no result of it is served, and when its run ends
the key is computed once more. Returns false if the key was absent.$$;
COMMENT ON FUNCTION once.get(text) IS
$$The key's fresh cached result, or NULL: claim_key's hit alone, as cheap as a
primary-key SELECT. NULL wherever claim_key would answer anything but hit (absent,
running, failed, past its ttl even within its stale window, or a read that draws an early
refresh, which this session's next claim_key then takes): then call claim_key. Claims
nothing and writes nothing; a key of a namespace you may not use is refused as by
claim_key.$$;
COMMENT ON FUNCTION once.refresh_key(text, interval) IS
$$Have a key computed again, its current result served as stale for stale meanwhile
(NULL: not served). Returns expired (its result expires now; a queued key goes back to
its queue), rerun (it is running: when the run ends it is computed exactly once more,
however many requests arrive, and the run's result is served as stale for stale),
pending (queued: it runs anyway) or absent.$$;
COMMENT ON FUNCTION once.reap_stale() IS
$$Take back claims whose owner is gone (lease expired, or backend exited) as failures that
may be retried at once, waking their waiters (queued keys go back to their queue after a
backoff, unless that was their last attempt); delete up to 10,000 expired results and up
to 10,000 attempt-history rows older than once.history_retention. Returns how many of
each. Never waits for a lock, so it is safe to run from many sessions at once, e.g. every
second from pg_cron; when preloaded, the pg_once worker runs it.$$;
COMMENT ON FUNCTION once.create_namespace(text, regrole, text, text) IS
$$Make every key that starts with prefix (the longest registered prefix wins) belong to
owner: only its members and superusers may claim, read, complete, fail, heartbeat,
release, invalidate or enqueue such keys (42501 for anyone else). notify: what LISTENers
on channel once receive when such a key resolves: 'digest' (its hex SHA-256, computable
from the key by whoever knows it) or 'key'. existing: what becomes of keys already under
prefix that would change hands (any role may have written them): 'refuse' (55006 while
there are any), 'purge' (delete them) or 'adopt' (give them to the namespace). Changes an
existing namespace's owner and notify. Only for superusers and members of the
extension's owner, calling it themselves (not from SECURITY DEFINER code, an index
expression or a materialized view).$$;
COMMENT ON FUNCTION once.drop_namespace(text) IS
$$Forget a namespace. Refused (55006) while it still has keys or queues, which would
otherwise become shared by every role. Only for superusers and members of the
extension's owner.$$;
COMMENT ON FUNCTION once.create_queue(text, integer, interval, interval, text) IS
$$Create a queue, or change the retry policy of an existing one: a failed attempt waits
backoff * 2^(attempts - 1), capped at max_backoff and jittered to between half and all of
that, until the key has been claimed max_attempts times; then it stays failed.
namespace: the queue belongs to that namespace (only its members may enqueue into it,
claim_next from it or drop it, and its keys may only go into its queues); NULL: shared.$$;
COMMENT ON FUNCTION once.drop_queue(text) IS
$$Drop an empty queue. Refused (55006) while keys still name it (remove them with
once.invalidate_keys(queue => name) first), and always for the queue 'default', which
every call that names no queue uses.$$;
COMMENT ON FUNCTION once.enqueue_key(text, jsonb, text, integer, timestamptz, boolean, integer) IS
$$Ask for a key to be computed by the queue's workers, due at run_at (NULL: now); smaller
priority runs first; max_attempts overrides the queue's. Idempotent per key. Returns:
queued (it was absent), requeued (it had failed, its result expired, or refresh => true
and it had a result, which is served until the new one lands), duplicate (already queued
or being computed: nothing changed) or cached (it has a fresh result: nothing changed).$$;
COMMENT ON FUNCTION once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer) IS
$$enqueue_key for many keys in one statement: payloads[i] (NULL: none) goes with keys[i],
the other arguments apply to every key. Returns each key with its outcome, as enqueue_key
would answer it, in the order given. At most 1000 distinct keys (22023 for more, or for a
key given twice); every key is checked first, and one the caller may not use refuses the
whole batch (42501). Locks, then inserts, keys in key_hash order, so it cannot deadlock
with another batch.$$;
COMMENT ON FUNCTION once.claim_next(text, interval, text, integer, interval, integer) IS
$$Claim up to n due keys of a queue, fewest errors first, then smallest priority, then
oldest due time, with FOR UPDATE SKIP LOCKED: workers never wait for each other and never
get the same key. Finish each with complete_key, fail_key (retried with backoff) or
release_key, and heartbeat_key meanwhile. worker names you in the history.
With wait > 0 an empty queue is waited on, holding no lock, until a key becomes due
(enqueued, a backoff ends, a key is sent back) or wait elapses (then no rows).
owner_pid: as for claim_key.$$;
COMMENT ON FUNCTION once.invalidate_keys(text, text) IS
$$Forget every key of a queue and/or whose key starts with prefix, running ones included
(their claims are cancelled: their owners' writes return false), e.g. to empty a queue.
Locks keys in key_hash order, so it never deadlocks with workers or other batches, and
waits only for keys other transactions are writing at that moment. Returns how many.$$;
COMMENT ON FUNCTION once.complete_keys(text[], bigint[], jsonb[], interval, interval, double precision, double precision) IS
$$complete_key for many claims in one statement (e.g. what one claim_next(n => 10) call
handed out), each key's jitter drawn on its own. Locks keys in key_hash order, so it
cannot deadlock with another batch. Returns the keys that were completed; the others'
claims were lost.$$;
COMMENT ON FUNCTION once_internal.backend_alive(integer, timestamptz) IS
$$Whether the backend with this pid that started at this time is still running (the
pid alone could have been reused). NULL if either argument is NULL.$$;
COMMENT ON FUNCTION once_internal.next_token() IS
$$The next fencing token: nextval of once_internal.token_seq, after moving the sequence up
to its START value (a floor above every token this cluster issued) if a restore set it
below.$$;
COMMENT ON FUNCTION once_internal.row_taken(tid) IS
$$Used by claim_next: whether the once.entries row version at this ctid was already
updated or deleted by a committed transaction, or is held (locked, updated or deleted) by
another transaction in progress. Either way claim_next passes over it without trying to
lock it. NULL if the argument is NULL.$$;
COMMENT ON FUNCTION once_internal.may_use_key(text) IS
$$Whether the calling role may use this key: true outside every namespace, else whether
it is a member of the owner of the key's namespace. NULL if the argument is NULL.$$;
COMMENT ON FUNCTION once_internal.caller_administers() IS
$$Whether the calling role administers pg_once here: a superuser or a member of the
extension's owner, not running another role's code (SECURITY DEFINER, an index
expression, a materialized view). once.stats shows last_token only to them.$$;
COMMENT ON FUNCTION once_internal.key_namespace(text) IS
$$The prefix of the namespace this key belongs to (the longest registered prefix it
starts with), or NULL.$$;
COMMENT ON FUNCTION once_internal.runtime() IS
$$How pg_once runs here: shared_memory (preloaded: wake-ups, exact liveness, counters),
notify (relay, direct or off, as in effect for this session), workers (pg_once workers
serving this database: 0 or 1), and the counters since server start, by once.stats
column (NULL without shared memory). See once.stats.$$;
COMMENT ON VIEW once.stats IS
    'Keys per state, claims past their lease, expired results not yet purged, the oldest running claim and error/attempt totals (of the keys the reader may use; read from counts kept as keys change, not from a scan); how pg_once runs (shared memory, notify mode, workers); and counters of calls since server start (NULL unless preloaded).';
COMMENT ON COLUMN once.stats.queued IS
    'Keys waiting in a queue for a worker (state queued).';
COMMENT ON COLUMN once.stats.running IS
    'Keys being computed now (state running).';
COMMENT ON COLUMN once.stats.done IS
    'Keys with a result (state done), expired ones not yet purged included.';
COMMENT ON COLUMN once.stats.failed IS
    'Keys whose last attempt failed (state failed): served until retry_at, or dead letters of a queue.';
COMMENT ON COLUMN once.stats.running_past_lease IS
    'Running keys whose lease has run out: taken over at the next call, or reaped by reap_stale. Growing: nothing runs reap_stale (preload pg_once, or schedule it).';
COMMENT ON COLUMN once.stats.expired_unpurged IS
    'Results past their expires_at and stale window, no longer served, waiting for reap_stale to delete them.';
COMMENT ON COLUMN once.stats.oldest_claimed_at IS
    'When the oldest running claim was made: a long-running computation, or an owner that stopped heartbeating.';
COMMENT ON COLUMN once.stats.errors IS
    'Failed attempts summed over the keys (takeovers of dead owners count).';
COMMENT ON COLUMN once.stats.attempts IS
    'Claims since each key''s last result, summed over the keys.';
COMMENT ON COLUMN once.stats.last_token IS
    'The fencing token most recently handed out (the token sequence''s value); NULL unless the reader administers pg_once (a superuser or a member of the extension''s owner) or is a member of pg_monitor, since it tells which tokens are in use.';
COMMENT ON COLUMN once.stats.shared_memory IS
    'true when pg_once is in shared_preload_libraries: waiters are woken at once, liveness is exact, and the counters below count.';
COMMENT ON COLUMN once.stats.notify IS
    'How keys leaving the running state are announced on channel once in this session: relay (through the worker), direct or off (once.notify).';
COMMENT ON COLUMN once.stats.workers IS
    'pg_once workers serving this database: 1, or 0 (not preloaded, or the database is not in once.databases): then nothing reaps stale claims unless you schedule once.reap_stale().';
COMMENT ON COLUMN once.stats.claims IS
    'Since server start: claims made (claim_key and claim_next). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.hits IS
    'Since server start: claim_key calls answered with a fresh cached result (hit). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.waits IS
    'Since server start: calls with wait (claim_key, claim_next) that went to sleep at least once. NULL unless preloaded.';
COMMENT ON COLUMN once.stats.wakeups IS
    'Since server start: sleeps of waiting calls ended by a wake-up (a key resolved or became due, an owner exited) rather than by their timer. NULL unless preloaded.';
COMMENT ON COLUMN once.stats.takeovers IS
    'Since server start: claims taken from an owner that was gone. NULL unless preloaded.';
COMMENT ON COLUMN once.stats.completions IS
    'Since server start: results stored (complete_key, complete_keys). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.failures IS
    'Since server start: failures recorded (fail_key). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.releases IS
    'Since server start: claims given back (release_key). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.invalidations IS
    'Since server start: keys forgotten (invalidate_key, invalidate_keys). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.reaped IS
    'Since server start: claims of gone owners taken back by reap_stale. NULL unless preloaded.';
COMMENT ON COLUMN once.stats.purged IS
    'Since server start: expired results deleted by reap_stale. NULL unless preloaded.';
COMMENT ON COLUMN once.stats.notified_direct IS
    'Since server start: keys announced by the committing transaction''s own NOTIFY (no worker, or its relay queue full). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.notified_relayed IS
    'Since server start: keys announced through the pg_once worker''s relay. NULL unless preloaded.';
COMMENT ON COLUMN once.stats.stale IS
    'Since server start: claim_key calls answered stale (a result past its ttl, served while it is refreshed). NULL unless preloaded.';
COMMENT ON COLUMN once.stats.refreshes IS
    'Since server start: claims that kept a result to serve meanwhile (refresh: in a stale window, an early refresh drawn by a hit, a refresh taken over). Also counted in claims. NULL unless preloaded.';
COMMENT ON VIEW once.queue_stats IS
    'Per queue the reader may use: depth (queued), due (queued and due now), running, dead (failed for good), the oldest due key''s wait, and attempts that completed or did not in the last minute / hour.';
COMMENT ON COLUMN once.queue_stats.queue IS
    'The queue''s name.';
COMMENT ON COLUMN once.queue_stats.depth IS
    'Keys waiting in the queue (queued), due or not.';
COMMENT ON COLUMN once.queue_stats.due IS
    'Queued keys due now: growing, workers cannot keep up.';
COMMENT ON COLUMN once.queue_stats.running IS
    'Keys of the queue being computed now.';
COMMENT ON COLUMN once.queue_stats.dead IS
    'Keys that failed their last attempt (see once.dead_letters); re-enqueue them with once.enqueue_key.';
COMMENT ON COLUMN once.queue_stats.oldest_due_age IS
    'How long the oldest due key has been due: the queue''s lag.';
COMMENT ON COLUMN once.queue_stats.completed_last_minute IS
    'Attempts completed in the last minute.';
COMMENT ON COLUMN once.queue_stats.failed_last_minute IS
    'Attempts that ended in the last minute without completing (failed, released, abandoned, taken over, cancelled).';
COMMENT ON COLUMN once.queue_stats.completed_last_hour IS
    'Attempts completed in the last hour.';
COMMENT ON VIEW once.dead_letters IS
    'Queued keys that failed their last attempt (those the reader may use). Re-enqueue one with once.enqueue_key(key, payload, queue) for a new set of attempts.';
COMMENT ON COLUMN once.dead_letters.key IS
    'The key.';
COMMENT ON COLUMN once.dead_letters.queue IS
    'The queue it failed in.';
COMMENT ON COLUMN once.dead_letters.payload IS
    'Its payload, to pass again to once.enqueue_key(key, payload, queue).';
COMMENT ON COLUMN once.dead_letters.attempts IS
    'Claims made since its last result (its queue''s or its own max_attempts, reached).';
COMMENT ON COLUMN once.dead_letters.errors IS
    'Failed attempts in the key''s life.';
COMMENT ON COLUMN once.dead_letters.error IS
    'The last attempt''s error.';
COMMENT ON COLUMN once.dead_letters.failed_at IS
    'When the last attempt failed.';
COMMENT ON VIEW once.namespaces IS
    'Namespaces: key prefixes that belong to a role (owner), what their keys are announced as on channel once (notify), and whether the role reading this may use them (member).';
COMMENT ON COLUMN once.namespaces.prefix IS
    'Keys that start with this prefix (the longest registered prefix wins) belong to the namespace.';
COMMENT ON COLUMN once.namespaces.owner IS
    'Only members of this role (and superusers) may use the namespace''s keys and queues.';
COMMENT ON COLUMN once.namespaces.notify IS
    'What LISTENers on channel once receive when a key of the namespace resolves: digest (its hex SHA-256) or key.';
COMMENT ON COLUMN once.namespaces.created_at IS
    'When the namespace was created.';
COMMENT ON COLUMN once.namespaces.member IS
    'Whether the role reading this may use the namespace.';

-- New functions that are another form of one 0.1.0 had go to the roles that were granted
-- that one, so that an application keeps every call it had: get, a hit of claim_key's;
-- enqueue_keys, enqueue_key for many keys.
-- (After the $owner_only$ block above, which leaves new objects to their owner.)
DO $siblings$
DECLARE
    g record;
    initial pg_catalog.aclitem[];
BEGIN
    FOR g IN
        SELECT DISTINCT v.new, CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                    ELSE pg_catalog.quote_ident(a.grantee::pg_catalog.regrole::pg_catalog.text) END AS role
          FROM (VALUES ('once.claim_key(text, interval, interval, integer, boolean)'::pg_catalog.regprocedure,
                        'once.get(text)'),
                       ('once.enqueue_key(text, jsonb, text, integer, timestamptz, boolean, integer)',
                        'once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer)'))
               AS v(old, new),
               pg_catalog.pg_proc p,
               pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid OPERATOR(pg_catalog.=) v.old
           AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
           AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        -- Granted by the administrator, as after a fresh install: the extension's initial
        -- privileges stay a fresh install's (a grant in an extension script records
        -- itself as one of them).
        initial := (SELECT i.initprivs FROM pg_catalog.pg_init_privs i
                     WHERE i.objoid OPERATOR(pg_catalog.=) g.new::pg_catalog.regprocedure::pg_catalog.oid
                       AND i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                       AND i.objsubid OPERATOR(pg_catalog.=) 0);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s', g.new, g.role);
        UPDATE pg_catalog.pg_init_privs SET initprivs = initial
         WHERE objoid OPERATOR(pg_catalog.=) g.new::pg_catalog.regprocedure::pg_catalog.oid
           AND classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
           AND objsubid OPERATOR(pg_catalog.=) 0;
    END LOOP;
END
$siblings$;

-- Count the keys there are (the triggers above count every change from now on).
SELECT once_internal.recount_keys();
