-- pg_once: the SQL surface. Hand-written; loaded after schema.sql by CREATE EXTENSION.
--
-- Every function:
-- * is SECURITY DEFINER, so callers need EXECUTE on it but no privilege on once.entries;
-- * pins search_path to pg_catalog, pg_temp, so nothing a caller puts on their path can
--   change what the function's statements mean;
-- * is CALLED ON NULL INPUT, so a NULL argument raises 22004 instead of returning NULL;
-- * is VOLATILE (each reads and writes shared state) and PARALLEL UNSAFE (each writes).
-- EXECUTE is revoked from PUBLIC at the end; see README "Granting access".

CREATE FUNCTION once.claim_key(
    key   text,
    lease interval DEFAULT '30 seconds',
    wait  interval DEFAULT '0')
RETURNS once.claim
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'claim_key_wrapper';

COMMENT ON FUNCTION once.claim_key(text, interval, interval) IS
$$Claim a key or get its cached result, in one round trip. outcome is:
hit (result is set), claimed (you own the key: compute, then complete_key with token),
failed (the last attempt failed and retry_at is in the future: error is set), or
wait (someone else is computing it: owner, lease_expires_at are set).
With wait > 0 the call blocks, holding no lock, until the key resolves, its owner is gone
(then you are given the claim) or wait elapses (then it returns wait).
Call it in its own transaction: a claim is only visible to others once committed.$$;

CREATE FUNCTION once.complete_key(
    key    text,
    token  bigint,
    result jsonb,
    ttl    interval DEFAULT NULL)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'complete_key_wrapper';

COMMENT ON FUNCTION once.complete_key(text, bigint, jsonb, interval) IS
$$Store the result of your claim (served for ttl, or until invalidated if ttl is NULL) and
wake everyone waiting for the key. Returns false, changing nothing, if token is no longer
the key's current claim (taken over, reaped, released or invalidated).$$;

CREATE FUNCTION once.fail_key(
    key         text,
    token       bigint,
    error       text,
    retry_after interval DEFAULT '0')
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'fail_key_wrapper';

COMMENT ON FUNCTION once.fail_key(text, bigint, text, interval) IS
$$Record that your claim failed with error, and wake waiters. Until retry_after has passed,
claim_key returns outcome failed with this error (callers share the failure instead of
stampeding); after it, the next caller claims the key again. Counts once.entries.errors.
Returns false, changing nothing, if token is no longer the key's current claim.$$;

CREATE FUNCTION once.heartbeat_key(
    key   text,
    token bigint,
    lease interval DEFAULT '30 seconds')
RETURNS timestamptz
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'heartbeat_key_wrapper';

COMMENT ON FUNCTION once.heartbeat_key(text, bigint, interval) IS
$$Extend your claim's lease to now + lease and return the new expiry. Returns NULL,
changing nothing, if token is no longer the key's current claim: stop computing.$$;

CREATE FUNCTION once.release_key(
    key   text,
    token bigint)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'release_key_wrapper';

COMMENT ON FUNCTION once.release_key(text, bigint) IS
$$Give your claim back without recording a failure (e.g. on shutdown); the key becomes
absent and one waiter claims it at once. Returns false if token is no longer current.$$;

CREATE FUNCTION once.invalidate_key(key text)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'invalidate_key_wrapper';

COMMENT ON FUNCTION once.invalidate_key(text) IS
$$Forget a key in any state: drop its cached result or failure, or cancel its claim (the
owner's later complete_key returns false; waiters are woken and one claims it anew).
Returns false if the key was absent.$$;

CREATE FUNCTION once.reap_stale()
RETURNS TABLE (reclaimed bigint, expired bigint)
LANGUAGE c VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'reap_stale_wrapper';

COMMENT ON FUNCTION once.reap_stale() IS
$$Take back claims whose owner is gone (lease expired, or backend exited) as failures that
may be retried at once, waking their waiters; and delete up to 10,000 expired results.
Returns how many of each. Never waits for a lock, so it is safe to run from many sessions
at once, e.g. every second from pg_cron or a worker.$$;

CREATE FUNCTION once.backend_alive(pid integer, started timestamptz)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'backend_alive_wrapper';

COMMENT ON FUNCTION once.backend_alive(integer, timestamptz) IS
$$Whether the backend with this pid that started at this time is still running (the
pid alone could have been reused). NULL if either argument is NULL.$$;

CREATE FUNCTION once.runtime()
RETURNS TABLE (shared_memory boolean, notify text, workers integer, counters bigint[])
LANGUAGE c VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'runtime_wrapper';

COMMENT ON FUNCTION once.runtime() IS
$$How pg_once runs here: shared_memory (preloaded: wake-ups, exact liveness, counters),
notify (relay, direct or off, as in effect for this session), workers (pg_once workers
running), and the counters since server start (NULL without shared memory). See once.stats.$$;

CREATE VIEW once.stats AS
SELECT k.queued, k.running, k.done, k.failed, k.running_past_lease, k.expired_unpurged,
       k.oldest_claimed_at, k.errors, k.attempts, k.last_token,
       r.shared_memory, r.notify, r.workers,
       r.counters[1]  AS claims,
       r.counters[2]  AS hits,
       r.counters[3]  AS waits,
       r.counters[4]  AS wakeups,
       r.counters[5]  AS takeovers,
       r.counters[6]  AS completions,
       r.counters[7]  AS failures,
       r.counters[8]  AS releases,
       r.counters[9]  AS invalidations,
       r.counters[10] AS reaped,
       r.counters[11] AS purged,
       r.counters[12] AS notified_direct,
       r.counters[13] AS notified_relayed
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
          FROM once.entries) AS k,
       once.runtime() AS r;

COMMENT ON VIEW once.stats IS
    'Keys per state, claims past their lease, expired results not yet purged, the oldest running claim and error/attempt totals (a scan of once.entries); how pg_once runs (shared memory, notify mode, workers); and counters of calls since server start (NULL unless preloaded).';

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA once FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA once FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA once FROM PUBLIC;
-- The digest function is harmless and handy for looking keys up by hand.
GRANT EXECUTE ON FUNCTION once.key_hash(text) TO PUBLIC;
