-- pg_once: the durable state. Hand-written; loaded first by CREATE EXTENSION.
--
-- The API lives in schema "once" (created by CREATE EXTENSION from the control file); what
-- only pg_once itself calls or reads (trigger functions, the token sequence, the namespace
-- table, helpers of the views and statements) lives in schema "once_internal", created
-- here and so dropped with the extension, so that \df once.* and \d once.* show what a
-- person may use. once_internal grants no USAGE to anyone: the SECURITY DEFINER functions
-- and the views reach into it as their owner (a function a view calls is checked for
-- EXECUTE only, never for USAGE on its schema).
-- Nothing here is granted to PUBLIC: applications call the SECURITY DEFINER functions in
-- functions.sql, which are the only writers of once.entries (see README, "Granting access").

-- Before anything else: the schema "once" must be trustworthy. CREATE EXTENSION adopts an
-- existing schema of that name, and this script runs with search_path = once: whoever owns
-- it, or may create objects in it, could plant operators or functions that match what the
-- script names better than pg_catalog's, and so run code as the installing superuser. So
-- the schema must belong to the installing role (CREATE EXTENSION creates it so) or to a
-- superuser, and no other role may create objects in it. This block names nothing that
-- such a role could plant; every operator in the scripts is pg_catalog's too
-- (scripts/check-sql.py). The upgrade scripts begin with the same block.
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

COMMENT ON SCHEMA once IS
    'pg_once: claim_key and the other functions, the once.stats, once.queue_stats, once.dead_letters, once.keys and once.namespaces views, and the tables they read. Grant USAGE on it (and EXECUTE on its functions) to the roles that use pg_once.';

CREATE SCHEMA once_internal;
COMMENT ON SCHEMA once_internal IS
    'pg_once''s own machinery (trigger functions, the fencing-token sequence, namespace table, helpers of the views): not an API, may change in any release. Grant nothing on it.';

-- First, the library this session runs must be at least the version being installed: with
-- an older one (a server that preloaded it before the package was upgraded, or a session
-- that loaded it earlier), the declarations below would call code written for other
-- ones. Every upgrade script begins with this same block (CONTRIBUTING.md, "Upgrades").
-- Declaring the function also makes every backend check its library against the
-- installed version again (storage/installed.rs).
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
COMMENT ON FUNCTION once_internal.library_version() IS
    'The version of the pg_once library loaded in this session. It differs from the installed extension''s (pg_extension.extversion) after a package upgrade until ALTER EXTENSION pg_once UPDATE and, where pg_once is preloaded, a restart.';

-- The four states of a key. A key with no row is "absent".
CREATE TYPE once.key_state AS ENUM ('queued', 'running', 'done', 'failed');

-- What one claim_key call decided. outcome is one of hit | claimed | wait | failed, and,
-- for a caller that passes serve_stale => true, refresh | stale.
CREATE TYPE once.claim AS (
    outcome          text,         -- hit | claimed | wait | failed | refresh | stale | mismatch
    token            bigint,       -- claimed/refresh: your fencing token; wait/stale: the owner's
    result           jsonb,        -- hit, refresh, stale: the (previous) result
    error            text,         -- failed: the last attempt's error; stale: a failed refresh's
    owner            text,         -- wait/claimed/refresh/stale: who holds the claim
    lease_expires_at timestamptz,  -- wait/claimed/refresh/stale: when the owner's lease runs out
    attempts         integer,      -- claims of this key since its last result
    retry_at         timestamptz,  -- failed: when the key may be claimed again
    expires_at       timestamptz   -- hit, refresh, stale: when result stops/stopped being fresh
);
COMMENT ON TYPE once.claim IS
    'What one once.claim_key call decided (outcome) and what goes with it.';
COMMENT ON COLUMN once.claim.outcome IS
    'What the call decided: hit (result is set), claimed (you own the key: compute, then complete_key with token), failed (error is set, until retry_at) or wait (someone else computes it). With serve_stale => true also refresh (you own the key and result is the previous one: serve it, recompute, complete_key) and stale (result is the previous one, served while someone refreshes it). With a fingerprint also mismatch (the key runs or its result is served for a request of another fingerprint: nothing was changed, every other column is NULL).';
COMMENT ON COLUMN once.claim.token IS
    'claimed or refresh: your fencing token, to pass to complete_key, fail_key, heartbeat_key or release_key. NULL for every other outcome: a token is its owner''s alone.';
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

-- Fencing tokens come from one sequence, not from a per-key counter, so that a key whose row
-- is deleted (invalidated, released, purged after expiry) can never hand out a token that a
-- zombie owner still holds. CACHE 1 (the default) keeps tokens strictly increasing in the
-- order claims happen, so a token is also a valid fencing token for external storage.
--
-- Tokens are never reused, not even after DROP EXTENSION and CREATE EXTENSION, a
-- restore, a crash or a failover: a token kept outside the database (a fencing check in
-- object storage, another service) must never be matched by a later, unrelated claim, and
-- a sequence created afresh would start again at 1. So the sequence is anchored to the
-- server's clock (src/storage/tokens.rs, docs/concepts.md "Fencing tokens"): it starts at
-- the current time in microseconds since 2000-01-01, above every token handed out before
-- (claims come fewer than one a microsecond), and a draw more than 10 ms behind the clock,
-- or the first on a new timeline, sets it to the clock before a token is handed out.
-- pg_dump saves its value (pg_extension_config_dump below), which a restore sets back:
-- the first draw after it anchors. There is no MINVALUE, so that the restore's setval
-- succeeds and pg_restore, --single-transaction included, reports no error.
-- once_internal.token_history records the timeline of the last anchor: a sequence, so that
-- it changes outside transactions as the token sequence does.
DO $$
DECLARE
    -- The timeline WAL is written on: the first 8 hex digits of the current segment's name.
    timeline bigint := ('x' OPERATOR(pg_catalog.||) pg_catalog.left(pg_catalog.pg_walfile_name(
        pg_catalog.pg_current_wal_insert_lsn()), 8))::pg_catalog.bit(32)::bigint;
    clock bigint := pg_catalog.date_part('epoch', pg_catalog.clock_timestamp()
        OPERATOR(pg_catalog.-) '2000-01-01 00:00:00+00'::pg_catalog.timestamptz)
        OPERATOR(pg_catalog.*) 1000000;
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE SEQUENCE once_internal.token_seq AS bigint START WITH %s CACHE 1', clock);
    EXECUTE pg_catalog.format(
        'CREATE SEQUENCE once_internal.token_history AS bigint START WITH %s CACHE 1', timeline);
    PERFORM pg_catalog.setval('once_internal.token_history', timeline, true);
END
$$;

-- SHA-256 of a key. Keys may be up to 7,500 bytes, far beyond a btree entry's limit (~2,700
-- bytes), so the primary key is the key's digest rather than the key itself. It is the
-- server's own sha256(bytea), applied to the text's bytes (text and bytea share a layout);
-- the C functions compute the same digest in Rust (src/key.rs, with the sha2 crate; checked
-- against this function by src/tests/keys.rs), without a call into the server per key.
CREATE FUNCTION once.key_hash(key text) RETURNS bytea
    LANGUAGE internal IMMUTABLE STRICT PARALLEL SAFE
    AS 'sha256_bytea';
COMMENT ON FUNCTION once.key_hash(text) IS
    'SHA-256 digest of a key: the primary key of once.entries. Look a key up with WHERE key_hash = once.key_hash(''...'').';

-- Queues for queue mode, with their retry policy. Keys name their queue; there is no
-- foreign key, because its check would run on every write of every cached key: the
-- functions check queue names instead, and drop_queue refuses to orphan keys.
CREATE TABLE once.queues (
    name         text PRIMARY KEY,
    max_attempts integer NOT NULL DEFAULT 5,            -- claims before a key stays failed
    backoff      interval NOT NULL DEFAULT '1 second',  -- delay before the 2nd attempt
    max_backoff  interval NOT NULL DEFAULT '1 hour',    -- the doubling stops here
    created_at   timestamptz NOT NULL DEFAULT now(),
    namespace    text                                   -- NULL: shared by every role
);
INSERT INTO once.queues (name) VALUES ('default');
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

-- Namespaces: every key that starts with prefix (the longest registered prefix wins), and
-- every queue whose namespace is prefix, belongs to owner: only its members and superusers
-- may use them (src/protocol/namespace.rs). Written only by once.create_namespace and
-- once.drop_namespace; read through the once.namespaces view.
CREATE TABLE once_internal.namespace_owners (
    prefix     text PRIMARY KEY,
    owner      regrole NOT NULL,
    notify     text NOT NULL DEFAULT 'digest',   -- NOTIFY payload: key | digest
    created_at timestamptz NOT NULL DEFAULT now()
);
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

-- Every backend keeps the namespaces in memory (every call checks them); a change sends a
-- relcache invalidation of this table, which makes every backend read them again.
CREATE FUNCTION once_internal.namespaces_changed() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'namespaces_changed_wrapper';
COMMENT ON FUNCTION once_internal.namespaces_changed() IS
    'Trigger function: make every backend read the namespaces again (once_internal.namespace_owners, and the queues'' namespaces in once.queues).';
CREATE TRIGGER namespace_owners_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON once_internal.namespace_owners
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.namespaces_changed();
-- Every backend keeps each queue's namespace in memory too (every claim_next checks it).
CREATE TRIGGER queues_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON once.queues
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.namespaces_changed();

CREATE TABLE once.entries (
    key_hash         bytea NOT NULL,   -- once.key_hash(key), computed by the functions
    key              text NOT NULL,
    state            once.key_state NOT NULL,
    token            bigint NOT NULL,
    owner            text,
    owner_pid        integer,
    owner_started    timestamptz,
    lease_only       boolean NOT NULL DEFAULT false,
    lease_expires_at timestamptz,
    result           jsonb,
    expires_at       timestamptz,
    error            text,
    errors           integer NOT NULL DEFAULT 0,
    attempts         integer NOT NULL DEFAULT 0,
    retry_at         timestamptz,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    claimed_at       timestamptz,
    completed_at     timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- queue mode (NULL for keys that were never enqueued)
    queue            text,
    payload          jsonb,
    priority         integer NOT NULL DEFAULT 0,   -- smaller runs first
    run_at           timestamptz,                  -- due from (queued keys)
    max_attempts     integer,                      -- NULL: the queue's
    enqueued_at      timestamptz,
    -- Columns added after 0.1.0 come last, in the order of their releases: an upgrade can
    -- only append a column, and a fresh install must have the same table (CONTRIBUTING.md,
    -- "Upgrades").
    -- 0.2.0: how the key's last attempt ended: completed | failed | released | abandoned
    -- (its owner was gone and a reaper took the claim back) | taken_over (its owner was
    -- gone and a caller took the claim); NULL until an attempt has ended
    last_outcome     text,
    -- 0.2.0, freshness (docs/sql-reference.md, "Freshness"): after expires_at the result
    -- is still served, as stale, until stale_until while one caller refreshes it; beta
    -- and compute_time drive early refreshes (XFetch); rerun is a recompute requested
    -- while the key ran, carried out when the run ends: keep | stale | discard, what
    -- becomes of the run's result meanwhile (rerun_stale: how long it is served as stale)
    stale_until      timestamptz,
    beta             double precision,
    compute_time     interval,
    rerun            text,
    rerun_stale      interval,
    -- 0.2.0: the role that made the running claim; only it (or an administrator) may end
    -- or extend the claim with its token (protocol/sql/rules/token_holder.sql). NULL for claims of 0.1.0.
    owner_role       oid,
    -- 0.3.0: the fingerprint of the request that made the key's current attempt (claim_key's
    -- fingerprint: a digest, at most 64 bytes); a claim with another one is answered
    -- mismatch while the key runs or its result is served. NULL: claimed without one.
    fingerprint      bytea,
    CONSTRAINT entries_pkey PRIMARY KEY (key_hash)
)
-- No CHECK constraints and no generated column, on purpose: PostgreSQL re-reads and
-- re-plans both from the catalog for every INSERT and UPDATE, which measured as ~15% of a
-- claim/complete cycle. The functions are the only writers (see functions.sql) and keep
-- the invariants themselves: key_hash = once.key_hash(key); a running key has an owner
-- and a lease; a done key has a result.
--
-- Why these storage settings:
-- * fillfactor 80 leaves room on each page so that an UPDATE which changes no indexed
--   column is a HOT update: the new row version goes on the same page and no index entry
--   is written. heartbeat_key (the write a long computation repeats) changes only the
--   unindexed lease_expires_at and so is always HOT-eligible. A cache hit writes nothing.
-- * claim and complete move a key into or out of the "running" partial index below, so
--   they cannot be HOT; the primary key does not bloat from them because PostgreSQL 14+
--   removes such duplicate versions bottom-up when a page fills, and the partial index
--   only ever holds the few keys being computed right now.
-- * a claim/complete cycle leaves two dead versions per key, so autovacuum is told to come
--   at 2% dead rows instead of 20%, and never to sleep while cleaning this table.
WITH (fillfactor = 80,
      autovacuum_vacuum_scale_factor = 0.02,
      autovacuum_vacuum_insert_scale_factor = 0.05,
      autovacuum_analyze_scale_factor = 0.05,
      autovacuum_vacuum_cost_delay = 0);

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
COMMENT ON COLUMN once.entries.owner_role IS
    'The role that made the current or last claim: only it, or an administrator, may complete, fail, heartbeat or release the claim with its token. NULL for claims made before 0.2.0.';
COMMENT ON COLUMN once.entries.fingerprint IS
    'The fingerprint (claim_key''s, a digest of the request) the current or last claim was made with: while the key runs or its result is served, a claim with another one is answered mismatch. NULL: claimed without one (then any claim is compared with nothing).';
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

-- The claims being computed right now, for reap_stale(). Small by construction: it holds
-- only running keys. Keyed by key_hash so that a lookup of one running key may use it as
-- well as the primary key; keyed by anything else, the planner (trusting statistics that
-- say few keys run) could pick a scan of every running key to find one.
CREATE INDEX entries_running_idx ON once.entries (key_hash) WHERE state OPERATOR(pg_catalog.=) 'running';

-- Results with a time to live, for purging once they expire.
CREATE INDEX entries_expires_idx ON once.entries (expires_at) WHERE expires_at IS NOT NULL;

-- Failed keys: what once.stats, once.queue_stats and once.dead_letters count or list,
-- without reading the done ones.
CREATE INDEX entries_failed_idx ON once.entries (queue) WHERE state OPERATOR(pg_catalog.=) 'failed';

-- claim_next's order within a queue: fewest errors, then priority, then due time. Holds
-- only queued keys, so workers never scan running, done or failed ones.
CREATE INDEX entries_queue_idx ON once.entries (queue, errors, priority, run_at)
    WHERE state OPERATOR(pg_catalog.=) 'queued';

-- Every attempt at a queued key, once it ends: append-only, trimmed by reap_stale after
-- once.history_retention.
CREATE TABLE once.attempts (
    key_hash    bytea NOT NULL,
    key         text NOT NULL,
    queue       text,
    token       bigint NOT NULL,
    worker      text,
    started_at  timestamptz,
    finished_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    outcome     text NOT NULL,   -- completed | failed | released | abandoned | taken_over | cancelled
    error       text
);
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
CREATE INDEX attempts_key_idx ON once.attempts (key_hash, finished_at);
-- reap_stale's purge reads the oldest rows past the retention from the left end of this
-- index, and finds that there are none with one probe. (0.1.0 had a BRIN index here,
-- cheaper per insert, but a BRIN scan reads every range not yet summarized: the newest
-- rows, between two vacuums, on every round; src/protocol/reap.rs, PURGE_HISTORY.)
CREATE INDEX attempts_finished_idx ON once.attempts (finished_at);

-- Cached results and queue work survive pg_dump / pg_restore.
SELECT pg_catalog.pg_extension_config_dump('once.entries', '');
SELECT pg_catalog.pg_extension_config_dump('once_internal.token_seq', '');
SELECT pg_catalog.pg_extension_config_dump('once.queues', 'WHERE name <> ''default''');
SELECT pg_catalog.pg_extension_config_dump('once.attempts', '');
SELECT pg_catalog.pg_extension_config_dump('once_internal.namespace_owners', '');

-- Tell listeners on channel "once" that a key left the running state (completed, failed,
-- released, reaped or invalidated). The payload is the key itself, passed to
-- Async_Notify as a value; no SQL text is ever built from a key.
CREATE FUNCTION once_internal.notify_key_resolved() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'notify_key_resolved_wrapper';
COMMENT ON FUNCTION once_internal.notify_key_resolved() IS
    'Trigger function: pg_notify(''once'', key) when a key leaves the running state.';

CREATE TRIGGER entries_notify_resolved
    AFTER UPDATE ON once.entries
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'running' AND NEW.state OPERATOR(pg_catalog.<>) 'running')
    EXECUTE FUNCTION once_internal.notify_key_resolved();

CREATE TRIGGER entries_notify_deleted
    AFTER DELETE ON once.entries
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'running')
    EXECUTE FUNCTION once_internal.notify_key_resolved();

-- Wake the workers waiting in claim_next(wait => ...) for a queue when a running key goes
-- back to it (a failure with retries left, a release, a reaped claim); enqueue_key wakes
-- them itself. They are woken after commit, and only when pg_once is preloaded.
CREATE FUNCTION once_internal.wake_queue() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'wake_queue_wrapper';
COMMENT ON FUNCTION once_internal.wake_queue() IS
    'Trigger function: wake the workers waiting for work in the queue a key went back to.';

CREATE TRIGGER entries_wake_queue
    AFTER UPDATE ON once.entries
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'running' AND NEW.state OPERATOR(pg_catalog.=) 'queued')
    EXECUTE FUNCTION once_internal.wake_queue();

-- Record how each attempt at a queued key ended: as the statement that ended it says in
-- last_outcome, or cancelled when the key was deleted (invalidated). Completions are the
-- exception: the statements that complete keys append their history themselves, one
-- INSERT per batch instead of one per key (completions_recorded in src/protocol/rules.rs).
CREATE FUNCTION once_internal.record_attempt() RETURNS trigger
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
COMMENT ON FUNCTION once_internal.record_attempt() IS
    'Trigger function: append to once.attempts when an attempt at a queued key ends.';

CREATE TRIGGER entries_record_attempt
    AFTER UPDATE ON once.entries
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'running' AND OLD.queue IS NOT NULL
          AND (NEW.state OPERATOR(pg_catalog.<>) 'running' OR NEW.token OPERATOR(pg_catalog.<>) OLD.token)
          AND (NEW.last_outcome IS NULL OR NEW.last_outcome OPERATOR(pg_catalog.<>) 'completed'))
    EXECUTE FUNCTION once_internal.record_attempt();

CREATE TRIGGER entries_record_cancelled_attempt
    AFTER DELETE ON once.entries
    FOR EACH ROW
    WHEN (OLD.state OPERATOR(pg_catalog.=) 'running' AND OLD.queue IS NOT NULL)
    EXECUTE FUNCTION once_internal.record_attempt();

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
