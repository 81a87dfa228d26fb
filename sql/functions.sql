-- pg_once: the SQL surface. Hand-written; loaded after schema.sql by CREATE EXTENSION.
--
-- Every C function:
-- * runs as its caller (not SECURITY DEFINER), so that the current user is the role
--   that called it, which the namespace checks judge as PostgreSQL's own checks do; it
--   runs its statements with the extension owner's rights, so callers need EXECUTE on it
--   but no privilege on once.entries (src/storage/statements.rs, docs/security.md);
-- * runs those statements with search_path pinned to pg_catalog, pg_temp, so nothing a
--   caller puts on their path can change what they mean;
-- * is CALLED ON NULL INPUT, so a NULL argument raises 22004 instead of returning NULL;
-- * is VOLATILE (each reads and writes shared state) and PARALLEL UNSAFE (each writes).
-- EXECUTE is revoked from PUBLIC at the end; see README "Granting access".

CREATE FUNCTION once.claim_key(
    key         text,
    lease       interval DEFAULT '30 seconds',
    wait        interval DEFAULT '0',
    owner_pid   integer DEFAULT NULL,
    serve_stale boolean DEFAULT false,
    fingerprint bytea DEFAULT NULL)
RETURNS once.claim
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'claim_key_0_3_wrapper';

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

CREATE FUNCTION once.get(key text)
RETURNS jsonb
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'get_wrapper';

COMMENT ON FUNCTION once.get(text) IS
$$The key's fresh cached result, or NULL: claim_key's hit alone, as cheap as a
primary-key SELECT. NULL wherever claim_key would answer anything but hit (absent,
running, failed, past its ttl even within its stale window, or a read that draws an early
refresh, which this session's next claim_key then takes): then call claim_key. Claims
nothing and writes nothing; a key of a namespace you may not use is refused as by
claim_key.$$;

CREATE FUNCTION once.owner_session()
RETURNS integer
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'owner_session_wrapper';

COMMENT ON FUNCTION once.owner_session() IS
$$Make this connection an owner session and return its pid. Claims made on other
connections (through a pool) with claim_key(..., owner_pid => that pid) or claim_next end
when this connection closes, as if made on it; when pg_once is preloaded, the pg_once
worker takes them back at once. Call it on a connection your process keeps open for its
lifetime, such as its LISTEN connection (direct or session-pooled).$$;

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
AS 'MODULE_PATHNAME', 'complete_key_0_2_wrapper';

COMMENT ON FUNCTION once.complete_key(text, bigint, jsonb, interval, interval, double precision, double precision) IS
$$Store the result of your claim and wake everyone waiting for the key. It is fresh for
ttl (NULL: until invalidated), shortened by up to jitter of it (0 to 1, drawn per key:
keys filled together do not expire together), then served as stale for stale more while
one caller refreshes it. beta > 0: hits refresh it early, the more likely the nearer its
expiry and the longer it took to compute (XFetch). Returns false, changing nothing, if
token is no longer the key's current claim (taken over, reaped or released).$$;

CREATE FUNCTION once.fail_key(
    key         text,
    token       bigint,
    error       text,
    retry_after interval DEFAULT '0')
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
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
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'heartbeat_key_wrapper';

COMMENT ON FUNCTION once.heartbeat_key(text, bigint, interval) IS
$$Extend your claim's lease to now + lease and return the new expiry. Returns NULL,
changing nothing, if token is no longer the key's current claim: stop computing.$$;

CREATE FUNCTION once.release_key(
    key   text,
    token bigint)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'release_key_wrapper';

COMMENT ON FUNCTION once.release_key(text, bigint) IS
$$Give your claim back without recording a failure (e.g. on shutdown); the key becomes
absent and one waiter claims it at once. Returns false if token is no longer current.$$;

CREATE FUNCTION once.invalidate_key(key text)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'invalidate_key_wrapper';

COMMENT ON FUNCTION once.invalidate_key(text) IS
$$Forget a key: drop its cached result or failure. A running key keeps its claim (a second
computation never starts beside it): no result of it is served, and when its run ends
the key is computed once more. Returns false if the key was absent.$$;

CREATE FUNCTION once.refresh_key(key text, stale interval DEFAULT NULL)
RETURNS text
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'refresh_key_wrapper';

COMMENT ON FUNCTION once.refresh_key(text, interval) IS
$$Have a key computed again, its current result served as stale for stale meanwhile
(NULL: not served). Returns expired (its result expires now; a queued key goes back to
its queue), rerun (it is running: when the run ends it is computed exactly once more,
however many requests arrive, and the run's result is served as stale for stale),
pending (queued: it runs anyway) or absent.$$;

CREATE FUNCTION once.reap_stale()
RETURNS TABLE (reclaimed bigint, expired bigint, history bigint)
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'reap_stale_wrapper';

COMMENT ON FUNCTION once.reap_stale() IS
$$Take back claims whose owner is gone (lease expired, or backend exited) as failures that
may be retried at once, waking their waiters (queued keys go back to their queue after a
backoff, unless that was their last attempt); delete up to 10,000 expired results and up
to 10,000 attempt-history rows older than once.history_retention. Returns how many of
each. Never waits for a lock, so it is safe to run from many sessions at once, e.g. every
second from pg_cron; when preloaded, the pg_once worker runs it.$$;

-- ---- namespaces ----------------------------------------------------------------------

CREATE FUNCTION once.create_namespace(
    prefix   text,
    owner    regrole,
    notify   text DEFAULT 'digest',
    existing text DEFAULT 'refuse')
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'create_namespace_wrapper';

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

CREATE FUNCTION once.drop_namespace(prefix text)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'drop_namespace_wrapper';

COMMENT ON FUNCTION once.drop_namespace(text) IS
$$Forget a namespace. Refused (55006) while it still has keys or queues, which would
otherwise become shared by every role. Only for superusers and members of the
extension's owner.$$;

-- ---- queue mode ----------------------------------------------------------------------

CREATE FUNCTION once.create_queue(
    name         text,
    max_attempts integer DEFAULT 5,
    backoff      interval DEFAULT '1 second',
    max_backoff  interval DEFAULT '1 hour',
    namespace    text DEFAULT NULL)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'create_queue_0_2_wrapper';

COMMENT ON FUNCTION once.create_queue(text, integer, interval, interval, text) IS
$$Create a queue, or change the retry policy of an existing one: a failed attempt waits
backoff * 2^(attempts - 1), capped at max_backoff and jittered to between half and all of
that, until the key has been claimed max_attempts times; then it stays failed.
namespace: the queue belongs to that namespace (only its members may enqueue into it,
claim_next from it or drop it, and its keys may only go into its queues); NULL: shared.$$;

CREATE FUNCTION once.drop_queue(name text)
RETURNS void
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'drop_queue_wrapper';

COMMENT ON FUNCTION once.drop_queue(text) IS
$$Drop an empty queue. Refused (55006) while keys still name it (remove them with
once.invalidate_keys(queue => name) first), and always for the queue 'default', which
every call that names no queue uses.$$;

CREATE FUNCTION once.enqueue_key(
    key          text,
    payload      jsonb DEFAULT NULL,
    queue        text DEFAULT 'default',
    priority     integer DEFAULT 0,
    run_at       timestamptz DEFAULT NULL,
    refresh      boolean DEFAULT false,
    max_attempts integer DEFAULT NULL)
RETURNS text
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'enqueue_key_wrapper';

COMMENT ON FUNCTION once.enqueue_key(text, jsonb, text, integer, timestamptz, boolean, integer) IS
$$Ask for a key to be computed by the queue's workers, due at run_at (NULL: now); smaller
priority runs first; max_attempts overrides the queue's. Idempotent per key. Returns:
queued (it was absent), requeued (it had failed, its result expired, or refresh => true
and it had a result, which is served until the new one lands), duplicate (already queued
or being computed: nothing changed) or cached (it has a fresh result: nothing changed).$$;

-- plan_cache_mode: see claim_next. enable_seqscan: each backend plans the statement once,
-- at its first call, and a plan made while once.entries was nearly empty (a new install,
-- a queue emptied and vacuumed) read the whole table with sequential scans in every later
-- call, its lookups of existing keys and its updates alike: 6 ms a call of 10 keys once
-- the table held 20,000 (pgbench), against 0.9 ms with the primary key. Off, the keys are
-- always looked up in the primary key, whatever the table held when the plan was made.
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

COMMENT ON FUNCTION once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer) IS
$$enqueue_key for many keys in one statement: payloads[i] (NULL: none) goes with keys[i],
the other arguments apply to every key. Returns each key with its outcome, as enqueue_key
would answer it, in the order given. At most 1000 distinct keys (22023 for more, or for a
key given twice); every key is checked first, and one the caller may not use refuses the
whole batch (42501). Locks, then inserts, keys in key_hash order, so it cannot deadlock
with another batch.$$;

-- plan_cache_mode: claim_next's statement has LIMIT n and complete_keys' takes arrays, and
-- for such parameters a generic plan is always estimated dearer than a custom one, so
-- PostgreSQL would plan them again on every call (9% of all CPU in the queue benchmark).
-- Their generic plans are the same index scans as the custom ones.
CREATE FUNCTION once.claim_next(
    queue     text DEFAULT 'default',
    lease     interval DEFAULT '30 seconds',
    worker    text DEFAULT NULL,
    n         integer DEFAULT 1,
    wait      interval DEFAULT '0',
    owner_pid integer DEFAULT NULL)
RETURNS TABLE (key text, token bigint, payload jsonb, attempt integer)
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'claim_next_wrapper';

COMMENT ON FUNCTION once.claim_next(text, interval, text, integer, interval, integer) IS
$$Claim up to n due keys of a queue, fewest errors first, then smallest priority, then
oldest due time, with FOR UPDATE SKIP LOCKED: workers never wait for each other and never
get the same key. Finish each with complete_key, fail_key (retried with backoff) or
release_key, and heartbeat_key meanwhile. worker names you in the history.
With wait > 0 an empty queue is waited on, holding no lock, until a key becomes due
(enqueued, a backoff ends, a key is sent back) or wait elapses (then no rows).
owner_pid: as for claim_key.$$;

CREATE FUNCTION once.invalidate_keys(queue text DEFAULT NULL, prefix text DEFAULT NULL)
RETURNS bigint
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'invalidate_keys_wrapper';

COMMENT ON FUNCTION once.invalidate_keys(text, text) IS
$$Forget every key of a queue and/or whose key starts with prefix, running ones included
(their claims are cancelled: their owners' writes return false), e.g. to empty a queue.
Locks keys in key_hash order, so it never deadlocks with workers or other batches, and
waits only for keys other transactions are writing at that moment. Returns how many.$$;

-- plan_cache_mode: see claim_next.
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
AS 'MODULE_PATHNAME', 'complete_keys_0_2_wrapper';

COMMENT ON FUNCTION once.complete_keys(text[], bigint[], jsonb[], interval, interval, double precision, double precision) IS
$$complete_key for many claims in one statement (e.g. what one claim_next(n => 10) call
handed out), each key's jitter drawn on its own. Locks keys in key_hash order, so it
cannot deadlock with another batch. Returns the keys that were completed; the others'
claims were lost.$$;

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


CREATE FUNCTION once_internal.backend_alive(pid integer, started timestamptz)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'backend_alive_wrapper';

COMMENT ON FUNCTION once_internal.backend_alive(integer, timestamptz) IS
$$Whether the backend with this pid that started at this time is still running (the
pid alone could have been reused). NULL if either argument is NULL.$$;

-- Not SECURITY DEFINER: only the claiming statements call it, as the extension's owner.
CREATE FUNCTION once_internal.next_token()
RETURNS bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'next_token_wrapper';

COMMENT ON FUNCTION once_internal.next_token() IS
$$The next fencing token: nextval of once_internal.token_seq, after setting the sequence to the
clock (microseconds since 2000-01-01) if it fell more than 10 ms behind it or the timeline
changed, as after a restore, a crash or a promotion.$$;

-- claim_next's filter; why it exists: src/storage/entry.rs, `taken`. Not SECURITY DEFINER,
-- unlike the others: claim_next calls it for every candidate row, and entering a SECURITY
-- DEFINER function with a pinned search_path costs more than the answer. It checks that
-- the caller may SELECT from once.entries (claim_next calls it as the owner) and uses no
-- search_path.
CREATE FUNCTION once_internal.row_taken(tid)
RETURNS boolean
LANGUAGE c VOLATILE CALLED ON NULL INPUT PARALLEL SAFE
AS 'MODULE_PATHNAME', 'row_taken_wrapper';

COMMENT ON FUNCTION once_internal.row_taken(tid) IS
$$Used by claim_next: whether the once.entries row version at this ctid was already
updated or deleted by a committed transaction, or is held (locked, updated or deleted) by
another transaction in progress. Either way claim_next passes over it without trying to
lock it. NULL if the argument is NULL.$$;

-- Not SECURITY DEFINER: the views call it for every row, as the role reading them, and it
-- answers for that role. It reads only pg_once's own memory of the namespaces (loading it
-- as the table's owner). PARALLEL RESTRICTED: the leader alone answers, for the role it
-- runs as.
CREATE FUNCTION once_internal.may_use_key(key text)
RETURNS boolean
LANGUAGE c STABLE CALLED ON NULL INPUT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'may_use_key_wrapper';

COMMENT ON FUNCTION once_internal.may_use_key(text) IS
$$Whether the calling role may use this key: true outside every namespace, else whether
it is a member of the owner of the key's namespace. NULL if the argument is NULL.$$;

-- Not SECURITY DEFINER, like may_use_key: once.stats calls it as its reader.
CREATE FUNCTION once_internal.caller_administers()
RETURNS boolean
LANGUAGE c STABLE PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'caller_administers_wrapper';

COMMENT ON FUNCTION once_internal.caller_administers() IS
$$Whether the calling role administers pg_once here: a superuser or a member of the
extension's owner, not running another role's code (SECURITY DEFINER, an index
expression, a materialized view). once.stats shows last_token only to them.$$;

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

COMMENT ON FUNCTION once_internal.key_namespace(text) IS
$$The prefix of the namespace this key belongs to (the longest registered prefix it
starts with), or NULL.$$;

CREATE FUNCTION once_internal.runtime()
RETURNS TABLE (shared_memory boolean, notify text, workers integer, counters jsonb)
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'runtime_0_2_wrapper';

COMMENT ON FUNCTION once_internal.runtime() IS
$$How pg_once runs here: shared_memory (preloaded: wake-ups, exact liveness, counters),
notify (relay, direct or off, as in effect for this session), workers (pg_once workers
serving this database: 0 or 1), and the counters since server start, by once.stats
column (NULL without shared memory). See once.stats.$$;

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

-- Each count reads only the keys of its state, through a partial index: entries_queue_idx
-- (queued), entries_running_idx (running), entries_failed_idx (failed); the history of
-- the last hour through attempts_finished_idx (the bound a scalar subquery, so that it is
-- an index condition). Nothing grows with the keys that are done or the history kept: a
-- join of once.entries on the queue read every key the queue ever ran, 1.1 s at 1,000,000
-- keys (issue 25). Each state is counted once for all queues, then joined to them: a
-- count per queue made the planner's estimate the number of queues (202 for a table never
-- analyzed, as once.queues, with its few rows, normally is) times a count, past
-- jit_above_cost, and JIT compiling took 360 ms of a 1 ms read.
CREATE VIEW once.queue_stats WITH (security_barrier) AS
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

CREATE VIEW once.dead_letters WITH (security_barrier) AS
SELECT key, queue, payload, attempts, errors, error, updated_at AS failed_at
  FROM once.entries
 WHERE state OPERATOR(pg_catalog.=) 'failed' AND queue IS NOT NULL AND once_internal.may_use_key(key);

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

CREATE VIEW once.namespaces WITH (security_barrier) AS
SELECT prefix, owner, notify, created_at, once_internal.may_use_key(prefix) AS member
  FROM once_internal.namespace_owners;

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

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA once FROM PUBLIC;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA once FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA once FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA once FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA once_internal FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA once_internal FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA once_internal FROM PUBLIC;
-- (PUBLIC has nothing on the schema either: this records that its owner's privileges are
-- all there is, as they are once $owner_only$ revoked what default privileges gave.)
REVOKE ALL ON SCHEMA once_internal FROM PUBLIC;
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
-- The digest function is harmless and handy for looking keys up by hand.
GRANT EXECUTE ON FUNCTION once.key_hash(text) TO PUBLIC;
-- The views call these two as the role reading them (a view's functions are checked for
-- EXECUTE as its reader, never for USAGE on their schema): may_use_key only tells a role
-- about itself, and runtime says how pg_once runs, which once.stats shows to whoever may
-- read it. Nobody has USAGE on once_internal, so the views are the only way to them.
GRANT EXECUTE ON FUNCTION once_internal.may_use_key(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.runtime() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.caller_administers() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.pending_key_counts() TO PUBLIC;
