-- pg_once 0.1.0 -> 0.2.0, run by ALTER EXTENSION pg_once UPDATE. Hand-written: it must
-- leave a 0.1.0 database exactly as a fresh 0.2.0 install (scripts/upgrade-test.sh
-- compares the two), keep every row and the token sequence, and call no pg_once C
-- function but library_version() (the library may already be a later one).
-- Conventions: CONTRIBUTING.md, "Upgrades".
\echo Use "ALTER EXTENSION pg_once UPDATE" to load this file. \quit

-- The library running this script must be 0.2.0 or later (schema.sql explains the block).
DO $guard$
DECLARE
    target text := (SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'pg_once');
    loaded text;
BEGIN
    CREATE OR REPLACE FUNCTION once.library_version() RETURNS text
        LANGUAGE c VOLATILE PARALLEL SAFE
        AS 'MODULE_PATHNAME', 'library_version_wrapper';
    loaded := once.library_version();
    IF pg_catalog.string_to_array(loaded, '.')::int[] < pg_catalog.string_to_array(target, '.')::int[] THEN
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
COMMENT ON FUNCTION once.library_version() IS
    'The version of the pg_once library loaded in this session. It differs from the installed extension''s (pg_extension.extversion) after a package upgrade until ALTER EXTENSION pg_once UPDATE and, where pg_once is preloaded, a restart.';

-- Tokens: a fresh install's sequence may never be set below a floor (schema.sql). Here
-- the floor is the sequence's current value, which every token issued so far is below or
-- equal to; the next token is the one 0.1.0 would have handed out.
DO $$
DECLARE
    last bigint := (SELECT last_value FROM once.token_seq);
BEGIN
    EXECUTE pg_catalog.format('ALTER SEQUENCE once.token_seq MINVALUE %s START WITH %s', last, last);
END
$$;

-- Namespaces (issue 14).
ALTER TABLE once.queues ADD COLUMN namespace text;
CREATE TABLE once.namespace_owners (
    prefix     text PRIMARY KEY,
    owner      regrole NOT NULL,
    notify     text NOT NULL DEFAULT 'digest',   -- NOTIFY payload: key | digest
    created_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE once.namespace_owners IS
    'Namespaces: key prefixes that belong to a role, and what their keys are announced as on channel once. See the once.namespaces view.';

-- Every backend keeps the namespaces in memory (every call checks them); a change sends a
-- relcache invalidation of this table, which makes every backend read them again.
CREATE FUNCTION once.namespaces_changed() RETURNS trigger
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'namespaces_changed_wrapper';
COMMENT ON FUNCTION once.namespaces_changed() IS
    'Trigger function: make every backend read once.namespace_owners again.';
CREATE TRIGGER namespace_owners_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON once.namespace_owners
    FOR EACH STATEMENT EXECUTE FUNCTION once.namespaces_changed();

SELECT pg_catalog.pg_extension_config_dump('once.namespace_owners', '');
REVOKE ALL ON once.namespace_owners FROM PUBLIC;

-- How each attempt ended is now said by the statement that ends it.
ALTER TABLE once.entries ADD COLUMN last_outcome text;
CREATE OR REPLACE FUNCTION once.record_attempt() RETURNS trigger
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
COMMENT ON FUNCTION once.record_attempt() IS
    'Trigger function: append to once.attempts when an attempt at a queued key ends.';

-- New functions.

CREATE FUNCTION once.create_namespace(
    prefix text,
    owner  regrole,
    notify text DEFAULT 'digest')
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'create_namespace_wrapper';

COMMENT ON FUNCTION once.create_namespace(text, regrole, text) IS
$$Make every key that starts with prefix (the longest registered prefix wins) belong to
owner: only its members and superusers may claim, read, complete, fail, heartbeat,
release, invalidate or enqueue such keys (42501 for anyone else). notify: what LISTENers
on channel once receive when such a key resolves: 'digest' (its hex SHA-256, computable
from the key by whoever knows it) or 'key'. Changes an existing namespace's owner and
notify. Only for superusers and members of the extension's owner.$$;

CREATE FUNCTION once.drop_namespace(prefix text)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'drop_namespace_wrapper';

COMMENT ON FUNCTION once.drop_namespace(text) IS
$$Forget a namespace. Refused (55006) while it still has keys or queues, which would
otherwise become shared by every role. Only for superusers and members of the
extension's owner.$$;

CREATE FUNCTION once.may_use_key(key text)
RETURNS boolean
LANGUAGE c STABLE CALLED ON NULL INPUT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'may_use_key_wrapper';

COMMENT ON FUNCTION once.may_use_key(text) IS
$$Whether the calling role may use this key: true outside every namespace, else whether
it is a member of the owner of the key's namespace. NULL if the argument is NULL.$$;

CREATE FUNCTION once.key_namespace(key text)
RETURNS text
LANGUAGE c STABLE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'key_namespace_wrapper';

COMMENT ON FUNCTION once.key_namespace(text) IS
$$The prefix of the namespace this key belongs to (the longest registered prefix it
starts with), or NULL.$$;

REVOKE ALL ON FUNCTION once.create_namespace(text, regrole, text), once.drop_namespace(text),
    once.key_namespace(text), once.library_version() FROM PUBLIC;
-- The views call it as the role reading them; it only tells a role about itself.
GRANT EXECUTE ON FUNCTION once.may_use_key(text) TO PUBLIC;

-- create_queue gains namespace: a new signature, so a new function (and a new symbol).
DROP FUNCTION once.create_queue(text, integer, interval, interval);
CREATE FUNCTION once.create_queue(
    name         text,
    max_attempts integer DEFAULT 5,
    backoff      interval DEFAULT '1 second',
    max_backoff  interval DEFAULT '1 hour',
    namespace    text DEFAULT NULL)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'create_queue_0_2_wrapper';

COMMENT ON FUNCTION once.create_queue(text, integer, interval, interval, text) IS
$$Create a queue, or change the retry policy of an existing one: a failed attempt waits
backoff * 2^(attempts - 1), capped at max_backoff and jittered to between half and all of
that, until the key has been claimed max_attempts times; then it stays failed.
namespace: the queue belongs to that namespace (only its members may enqueue into it,
claim_next from it or drop it, and its keys may only go into its queues); NULL: shared.$$;

REVOKE ALL ON FUNCTION once.create_queue(text, integer, interval, interval, text) FROM PUBLIC;

COMMENT ON FUNCTION once.drop_queue(text) IS
$$Drop an empty queue. Refused (55006) while keys still name it (remove them with
once.invalidate_keys(queue => name) first), and always for the queue 'default', which
every call that names no queue uses.$$;

-- runtime() returns the counters by name (jsonb): once.stats, which reads them, goes
-- with it.
DROP VIEW once.stats;
DROP FUNCTION once.runtime();
CREATE FUNCTION once.runtime()
RETURNS TABLE (shared_memory boolean, notify text, workers integer, counters jsonb)
LANGUAGE c VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'runtime_0_2_wrapper';

COMMENT ON FUNCTION once.runtime() IS
$$How pg_once runs here: shared_memory (preloaded: wake-ups, exact liveness, counters),
notify (relay, direct or off, as in effect for this session), workers (pg_once workers
serving this database: 0 or 1), and the counters since server start, by once.stats
column (NULL without shared memory). See once.stats.$$;

REVOKE ALL ON FUNCTION once.runtime() FROM PUBLIC;

CREATE VIEW once.stats AS
SELECT k.queued, k.running, k.done, k.failed, k.running_past_lease, k.expired_unpurged,
       k.oldest_claimed_at, k.errors, k.attempts, k.last_token,
       r.shared_memory, r.notify, r.workers,
       (r.counters->>'claims')::bigint AS claims,
       (r.counters->>'hits')::bigint AS hits,
       (r.counters->>'waits')::bigint AS waits,
       (r.counters->>'wakeups')::bigint AS wakeups,
       (r.counters->>'takeovers')::bigint AS takeovers,
       (r.counters->>'completions')::bigint AS completions,
       (r.counters->>'failures')::bigint AS failures,
       (r.counters->>'releases')::bigint AS releases,
       (r.counters->>'invalidations')::bigint AS invalidations,
       (r.counters->>'reaped')::bigint AS reaped,
       (r.counters->>'purged')::bigint AS purged,
       (r.counters->>'notified_direct')::bigint AS notified_direct,
       (r.counters->>'notified_relayed')::bigint AS notified_relayed
  FROM (SELECT count(*) FILTER (WHERE state = 'queued')  AS queued,
               count(*) FILTER (WHERE state = 'running') AS running,
               count(*) FILTER (WHERE state = 'done')    AS done,
               count(*) FILTER (WHERE state = 'failed')  AS failed,
               count(*) FILTER (WHERE state = 'running' AND lease_expires_at <= clock_timestamp())
                   AS running_past_lease,
               count(*) FILTER (WHERE state = 'done' AND expires_at <= clock_timestamp())
                   AS expired_unpurged,
               min(claimed_at) FILTER (WHERE state = 'running') AS oldest_claimed_at,
               coalesce(sum(errors), 0) AS errors,
               coalesce(sum(attempts), 0) AS attempts,
               (SELECT last_value FROM once.token_seq) AS last_token
          FROM once.entries
         WHERE once.may_use_key(key)) AS k,
       once.runtime() AS r;

COMMENT ON VIEW once.stats IS
    'Keys per state, claims past their lease, expired results not yet purged, the oldest running claim and error/attempt totals (a scan of once.entries, counting only keys the reader may use); how pg_once runs (shared memory, notify mode, workers); and counters of calls since server start (NULL unless preloaded).';
REVOKE ALL ON once.stats FROM PUBLIC;

-- The other views show each role only the keys and queues it may use.
CREATE OR REPLACE VIEW once.queue_stats AS
SELECT q.name AS queue,
       count(e.key) FILTER (WHERE e.state = 'queued') AS depth,
       count(e.key) FILTER (WHERE e.state = 'queued' AND e.run_at <= clock_timestamp()) AS due,
       count(e.key) FILTER (WHERE e.state = 'running') AS running,
       count(e.key) FILTER (WHERE e.state = 'failed') AS dead,
       clock_timestamp() - min(e.run_at) FILTER (WHERE e.state = 'queued'
                                                  AND e.run_at <= clock_timestamp())
           AS oldest_due_age,
       (SELECT count(*) FROM once.attempts a
         WHERE a.queue = q.name AND a.outcome = 'completed'
           AND a.finished_at > clock_timestamp() - interval '1 minute') AS completed_last_minute,
       (SELECT count(*) FROM once.attempts a
         WHERE a.queue = q.name AND a.outcome <> 'completed'
           AND a.finished_at > clock_timestamp() - interval '1 minute') AS failed_last_minute,
       (SELECT count(*) FROM once.attempts a
         WHERE a.queue = q.name AND a.outcome = 'completed'
           AND a.finished_at > clock_timestamp() - interval '1 hour') AS completed_last_hour
  FROM once.queues q
  LEFT JOIN once.entries e ON e.queue = q.name AND once.may_use_key(e.key)
 WHERE q.namespace IS NULL OR once.may_use_key(q.namespace)
 GROUP BY q.name;

COMMENT ON VIEW once.queue_stats IS
    'Per queue the reader may use: depth (queued), due (queued and due now), running, dead (failed for good), the oldest due key''s wait, and attempts that completed or did not in the last minute / hour.';

CREATE OR REPLACE VIEW once.dead_letters AS
SELECT key, queue, payload, attempts, errors, error, updated_at AS failed_at
  FROM once.entries
 WHERE state = 'failed' AND queue IS NOT NULL AND once.may_use_key(key);

COMMENT ON VIEW once.dead_letters IS
    'Queued keys that failed their last attempt (those the reader may use). Re-enqueue one with once.enqueue_key(key, payload, queue) for a new set of attempts.';

CREATE VIEW once.namespaces AS
SELECT prefix, owner, notify, created_at, once.may_use_key(prefix) AS member
  FROM once.namespace_owners;

COMMENT ON VIEW once.namespaces IS
    'Namespaces: key prefixes that belong to a role (owner), what their keys are announced as on channel once (notify), and whether the role reading this may use them (member).';
REVOKE ALL ON once.namespaces FROM PUBLIC;
