-- Queue mode in the SQL edition: src/api/queue.rs and src/protocol/queue.rs in PL/pgSQL.
-- A queued key is a row of once.entries in state queued; workers take due keys with
-- claim_next (claim_next.sql: FOR UPDATE SKIP LOCKED over entries_queue_idx) and finish
-- them with the same complete_key / fail_key / heartbeat_key / release_key as any owner
-- (core.sql); once.attempts keeps each attempt's history through the shared trigger. Every
-- write is the extension's statement of src/protocol/sql/, spliced.
--
-- No worker wakes waiting workers here: a claim_next with wait polls, as claim_key does
-- (docs/sql-edition.md).

-- claim_next.sql's filter (storage::entry::taken): is the row version at `tid`, which
-- the call's snapshot shows queued, of no use to it: replaced by a transaction that
-- committed since (another worker claimed the key), or held by one in progress? The
-- extension reads the tuple header in C. Here: a version no transaction ever locked or
-- replaced (xmax 0: the common case) is free; any other is tried with FOR UPDATE SKIP
-- LOCKED in a subtransaction, which tells a replaced version (serialization failure under
-- REPEATABLE READ; under READ COMMITTED the lock follows the row to its new version,
-- which no longer has this tid) or a held one (skipped) from a free one. A version that
-- is of no use is left unlocked (the subtransaction is rolled back); a free one stays
-- locked by this call, which FOR UPDATE then takes anyway. Without it, a REPEATABLE READ
-- worker whose snapshot predates another's claim fails with a serialization error
-- (pg_test/isolation/specs/queue-workers.spec).
CREATE OR REPLACE FUNCTION once_internal.row_taken(tid tid) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF (SELECT e.xmax FROM once.entries e WHERE e.ctid = tid) = '0' THEN
        RETURN false;
    END IF;
    BEGIN
        PERFORM FROM once.entries e WHERE e.ctid = tid AND e.state = 'queued' FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            RETURN false;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'no_data_found';
    EXCEPTION WHEN no_data_found OR serialization_failure THEN
        RETURN true;
    END;
END
$$;

-- args::queue and queue::require: the queue named `name`, which must exist (42704) and
-- whose namespace, if any, the caller must be allowed to use (42501). Returns its
-- namespace (NULL: shared).
CREATE OR REPLACE FUNCTION once_internal.require_queue(name text, function text) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    q once.queues;
BEGIN
    {{text_check:queue name}}
    SELECT * INTO q FROM once.queues WHERE once.queues.name = require_queue.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist', name
            USING ERRCODE = 'undefined_object',
                  HINT = format('Create it first: SELECT once.create_queue(''%s'');', replace(name, '''', ''''''));
    END IF;
    IF q.namespace IS NOT NULL THEN
        PERFORM once_internal.require_key(q.namespace, function);
    END IF;
    RETURN q.namespace;
END
$$;

-- queue::require_queue_of_key: a key of a namespace goes only into a queue of the same
-- namespace (42501): a shared queue's workers could be any role, and would get its payload.
CREATE OR REPLACE FUNCTION once_internal.require_queue_of_key(key text, queue text, queue_namespace text)
    RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    prefix text := once_internal.key_namespace(key);
BEGIN
    IF prefix IS NOT NULL AND prefix IS DISTINCT FROM queue_namespace THEN
        RAISE EXCEPTION 'key "%" belongs to namespace "%", queue "%" does not', key, prefix, queue
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Enqueue a namespace''s keys into a queue of the same namespace: once.create_queue(name, namespace => ...).';
    END IF;
END
$$;

-- An earlier edition's usable_max_attempts(n), now usable_integer(n, 'max_attempts').
DROP FUNCTION IF EXISTS once_internal.usable_max_attempts(integer);

-- enqueue_key's and enqueue_keys' priority, run_at and refresh (args::required, args::run_at).
CREATE OR REPLACE FUNCTION once_internal.check_enqueue(
    priority integer, run_at timestamptz, refresh boolean, refresh_hint text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF priority IS NULL THEN
        RAISE EXCEPTION 'priority must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass an integer; smaller runs first, default 0.';
    END IF;
    IF run_at IN ('infinity', '-infinity') THEN
        RAISE EXCEPTION 'run_at must be a finite time' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass NULL to make the key due now, or a time such as now() + interval ''10 minutes''.';
    END IF;
    IF refresh IS NULL THEN
        RAISE EXCEPTION 'refresh must not be NULL' USING ERRCODE = 'null_value_not_allowed', HINT = refresh_hint;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION once_internal.payload_size(payload jsonb, what text) RETURNS void
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
    RETURN once_internal.within_limit(pg_column_size(payload), what, 'once.max_payload_size', 1024,
        'Pass a smaller payload (a reference to where large input is kept, e.g. an object''s URL), or ask an administrator to raise once.max_payload_size.');

-- once.create_queue (queue::upsert_queue): anyone granted it may create a new queue,
-- shared or in a namespace it is a member of; a namespace's queue is changed only by its
-- members, a shared one (every role's workers serve it) only by an administrator, and
-- asking for a queue exactly as it is changes nothing and is allowed to all.
CREATE OR REPLACE FUNCTION once.create_queue(
    name         text,
    max_attempts integer DEFAULT 5,
    backoff      interval DEFAULT '1 second',
    max_backoff  interval DEFAULT '1 hour',
    namespace    text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    name_hint constant text := 'Use 1 to 63 letters, digits, ''_'', ''.'', '':'' or ''-'', e.g. ''thumbnails''.';
    backoff_hint constant text := 'Use e.g. backoff => ''1 second'', max_backoff => ''1 hour''.';
    name text := create_queue.name;
    max_attempts integer := create_queue.max_attempts;
    backoff interval := create_queue.backoff;
    max_backoff interval := create_queue.max_backoff;
    namespace text := create_queue.namespace;
    current once.queues;
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL' USING ERRCODE = 'null_value_not_allowed', HINT = name_hint;
    ELSIF name !~ '^[A-Za-z0-9_.:-]{1,63}$' THEN
        RAISE EXCEPTION 'invalid queue name "%"', name USING ERRCODE = 'invalid_parameter_value', HINT = name_hint;
    END IF;
    PERFORM once_internal.usable_integer(max_attempts, 'max_attempts');
    IF max_attempts IS NULL THEN
        RAISE EXCEPTION 'max_attempts must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass how many times a key may be tried before it stays failed, e.g. 5.';
    END IF;
    IF backoff IS NULL OR max_backoff IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', CASE WHEN backoff IS NULL THEN 'backoff' ELSE 'max_backoff' END
            USING ERRCODE = 'null_value_not_allowed', HINT = backoff_hint;
    ELSIF backoff <= '0' OR backoff > '1 year' THEN
        RAISE EXCEPTION 'backoff must be positive and at most 1 year, got %', backoff
            USING ERRCODE = 'invalid_parameter_value', HINT = backoff_hint;
    ELSIF max_backoff <= '0' OR max_backoff > '1 year' THEN
        RAISE EXCEPTION 'max_backoff must be positive and at most 1 year, got %', max_backoff
            USING ERRCODE = 'invalid_parameter_value', HINT = backoff_hint;
    ELSIF max_backoff < backoff THEN
        RAISE EXCEPTION 'max_backoff (%) is shorter than backoff (%)', max_backoff, backoff
            USING ERRCODE = 'invalid_parameter_value', HINT = backoff_hint;
    END IF;
    IF namespace IS NOT NULL THEN
        PERFORM once_internal.usable_prefix(namespace);
        PERFORM once_internal.require_named(namespace, 'create_queue');
    END IF;
    SELECT * INTO current FROM once.queues q WHERE q.name = param.name;
    IF FOUND THEN
        IF current.namespace IS NOT NULL THEN
            PERFORM once_internal.require_key(current.namespace, 'create_queue');
        END IF;
        IF (current.max_attempts, current.backoff, current.max_backoff, current.namespace)
           IS NOT DISTINCT FROM (max_attempts, backoff, max_backoff, namespace) THEN
            RETURN;
        END IF;
        IF (current.namespace IS NULL OR namespace IS NULL) AND NOT once_internal.administers() THEN
            RAISE EXCEPTION 'permission denied: queue "%" is shared by every role', name
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Shared queues (namespace NULL) serve every role''s workers: a superuser or a member of the role that owns the pg_once extension changes them. Applications may create new ones, or use queues of their own namespace.';
        END IF;
    END IF;
    PERFORM once_internal.refuse_writes('create_queue');
    {{sql:upsert_queue}};
    IF namespace IS NOT NULL THEN
        -- A drop_namespace that committed meanwhile (its lock made this write wait) must
        -- not leave a queue naming a namespace that is gone, which every role could use.
        PERFORM once_internal.require_named(namespace, 'create_queue');
    END IF;
END
$$;

-- once.drop_queue (queue::drop_queue): never the default queue, nor one keys still name.
CREATE OR REPLACE FUNCTION once.drop_queue(name text)
RETURNS void
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    namespace text := once_internal.require_queue(drop_queue.name, 'drop_queue');
    name text := drop_queue.name;
    keys bigint;
BEGIN
    IF name = 'default' THEN
        RAISE EXCEPTION 'queue "default" cannot be dropped'
            USING ERRCODE = 'object_in_use',
                  HINT = 'It is the queue enqueue_key and claim_next use when none is named, and it stays. To empty it: SELECT once.invalidate_keys(queue => ''default''); to change its retry policy: SELECT once.create_queue(''default'', max_attempts => ...);';
    END IF;
    SELECT count(*) INTO keys FROM once.entries e WHERE e.queue = param.name;
    IF keys > 0 THEN
        RAISE EXCEPTION 'queue "%" still has % keys', name, keys
            USING ERRCODE = 'object_in_use',
                  HINT = format('Remove them first: SELECT once.invalidate_keys(queue => ''%s'');', replace(name, '''', ''''''));
    END IF;
    IF namespace IS NULL AND NOT once_internal.administers() THEN
        RAISE EXCEPTION 'permission denied: queue "%" is shared by every role', name
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Shared queues (namespace NULL) serve every role''s workers: a superuser or a member of the role that owns the pg_once extension changes them. Applications may create new ones, or use queues of their own namespace.';
    END IF;
    PERFORM once_internal.refuse_writes('drop_queue');
    {{sql:drop_queue}};
END
$$;

-- once.enqueue_key (queue::enqueue): enqueue_new.sql for an absent key, enqueue_again.sql
-- for one that failed, expired or (refresh) has a result, enqueue_rerun.sql for a running
-- key asked to refresh; else duplicate or cached.
CREATE OR REPLACE FUNCTION once.enqueue_key(
    key          text,
    payload      jsonb DEFAULT NULL,
    queue        text DEFAULT 'default',
    priority     integer DEFAULT 0,
    run_at       timestamptz DEFAULT NULL,
    refresh      boolean DEFAULT false,
    max_attempts integer DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(enqueue_key.key, 'enqueue_key'));
    key text := enqueue_key.key;
    payload jsonb := enqueue_key.payload;
    queue text := enqueue_key.queue;
    priority integer := enqueue_key.priority;
    run_at timestamptz := enqueue_key.run_at;
    refresh boolean := enqueue_key.refresh;
    max_attempts integer := enqueue_key.max_attempts;
    queue_namespace text;
    state text;
BEGIN
    PERFORM once_internal.payload_size(payload, 'payload');
    queue_namespace := once_internal.require_queue(queue, 'enqueue_key');
    PERFORM once_internal.usable_integer(max_attempts, 'max_attempts');
    PERFORM once_internal.check_enqueue(priority, run_at, refresh,
        'Pass true to recompute a key that has a fresh result, else false.');
    PERFORM once_internal.refuse_writes('enqueue_key');
    PERFORM once_internal.require_queue_of_key(key, queue, queue_namespace);
    {{sql:enqueue_new}};
    IF FOUND THEN
        -- namespace::recheck_key (see claim_attempt).
        PERFORM once_internal.require_key(key, 'enqueue_key');
        RETURN 'queued';
    END IF;
    {{sql:enqueue_again}};
    IF FOUND THEN
        RETURN 'requeued';
    END IF;
    {{sql:enqueue_rerun}};
    IF FOUND THEN
        RETURN 'requeued';
    END IF;
    SELECT e.state::text INTO state FROM once.entries e WHERE e.key_hash = param.key_hash;
    RETURN CASE WHEN state = 'done' THEN 'cached' ELSE 'duplicate' END;
END
$$;

-- once.enqueue_keys (queue::enqueue_many): every argument and every key checked before
-- anything is written, then enqueue_many.sql, again for the keys other transactions
-- inserted meanwhile (8 rounds at most, as ENQUEUE_ROUNDS).
CREATE OR REPLACE FUNCTION once.enqueue_keys(
    keys         text[],
    payloads     jsonb[] DEFAULT NULL,
    queue        text DEFAULT 'default',
    priority     integer DEFAULT 0,
    run_at       timestamptz DEFAULT NULL,
    refresh      boolean DEFAULT false,
    max_attempts integer DEFAULT NULL)
RETURNS TABLE (key text, outcome text)
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    hint constant text := 'Pass an array of keys, and optionally an array of as many payloads, the i-th for the i-th key.';
    keys text[] := enqueue_keys.keys;
    key_hashes bytea[];
    payloads jsonb[] := enqueue_keys.payloads;
    queue text := enqueue_keys.queue;
    priority integer := enqueue_keys.priority;
    run_at timestamptz := enqueue_keys.run_at;
    refresh boolean := enqueue_keys.refresh;
    max_attempts integer := enqueue_keys.max_attempts;
    pending bigint[];
    pending_hashes bytea[];
    outcomes text[];
    queue_namespace text;
    n integer := coalesce(cardinality(enqueue_keys.keys), 0);
    first integer;
    due boolean := false;
    r record;
    left_over bigint[];
BEGIN
    IF keys IS NULL THEN
        RAISE EXCEPTION 'keys must not be NULL' USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    END IF;
    IF n > 1000 THEN
        RAISE EXCEPTION 'keys has % elements; enqueue_keys takes at most 1000', n
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Split the keys into batches of at most 1000.';
    END IF;
    FOR i IN 1 .. n LOOP
        {{text_check:key keys[i] pg_catalog.format('keys[%s]', i)}}
    END LOOP;
    IF payloads IS NOT NULL THEN
        IF coalesce(cardinality(payloads), 0) <> n THEN
            RAISE EXCEPTION 'keys and payloads have % and % elements', n, coalesce(cardinality(payloads), 0)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass one payload per key (NULL for none), or payloads => NULL.';
        END IF;
        PERFORM once_internal.payload_size(p, 'a payload') FROM unnest(payloads) p WHERE p IS NOT NULL;
    END IF;
    FOR i IN 1 .. n LOOP
        first := array_position(keys, keys[i]);
        IF first < i THEN
            RAISE EXCEPTION 'keys[%] and keys[%] are both "%"', first, i, keys[i]
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass each key once: a key is enqueued once, with one payload.';
        END IF;
    END LOOP;
    queue_namespace := once_internal.require_queue(queue, 'enqueue_keys');
    IF priority IS NULL THEN
        RAISE EXCEPTION 'priority must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass an integer; smaller runs first, default 0.';
    END IF;
    PERFORM once_internal.check_enqueue(priority, run_at, refresh,
        'Pass true to recompute keys that have a fresh result, else false.');
    PERFORM once_internal.usable_integer(max_attempts, 'max_attempts');
    FOR i IN 1 .. n LOOP
        PERFORM once_internal.usable_key(keys[i], 'enqueue_keys');
    END LOOP;
    PERFORM once_internal.refuse_writes('enqueue_keys');
    FOR i IN 1 .. n LOOP
        PERFORM once_internal.require_queue_of_key(keys[i], queue, queue_namespace);
    END LOOP;
    IF n = 0 THEN
        RETURN;
    END IF;
    key_hashes := ARRAY(SELECT once.key_hash(k) FROM unnest(keys) k);
    outcomes := array_fill(NULL::text, ARRAY[n]);
    FOR round IN 1 .. 8 LOOP
        pending_hashes := CASE WHEN pending IS NULL THEN key_hashes
                               ELSE ARRAY(SELECT key_hashes[o] FROM unnest(pending) o) END;
        left_over := '{}';
        FOR r IN
            {{sql:enqueue_many}}
        LOOP
            due := due OR r.due;
            IF r.outcome IS NULL THEN
                left_over := left_over || r.ord;
            ELSE
                outcomes[r.ord] := r.outcome;
                IF r.outcome = 'queued' THEN
                    PERFORM once_internal.require_key(keys[r.ord], 'enqueue_keys');
                END IF;
            END IF;
        END LOOP;
        EXIT WHEN cardinality(left_over) = 0;
        pending := left_over;
    END LOOP;
    IF array_position(outcomes, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue_keys: other transactions kept writing some of its keys (8 tries)'
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Call enqueue_keys again: every key''s outcome is decided anew.';
    END IF;
    RETURN QUERY SELECT k, o FROM unnest(keys, outcomes) AS u(k, o);
END
$$;

-- One look of claim_next (queue::claim_next): claim_next.sql for this caller.
CREATE OR REPLACE FUNCTION once_internal.claim_next_look(
    queue text, lease interval, worker text, n integer, owner_pid integer,
    owner_started timestamptz, lease_only boolean)
RETURNS TABLE (key text, token bigint, payload jsonb, attempt integer)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    queue text := claim_next_look.queue;
    n bigint := claim_next_look.n;
    lease interval := claim_next_look.lease;
    owner text := coalesce(claim_next_look.worker,
                           CASE WHEN current_setting('application_name') = '' THEN format('pid %s', pg_backend_pid())
                                ELSE format('%s (pid %s)', current_setting('application_name'), pg_backend_pid()) END);
    owner_pid integer := claim_next_look.owner_pid;
    owner_started timestamptz := claim_next_look.owner_started;
    lease_only boolean := claim_next_look.lease_only;
    owner_role oid := once_internal.caller();
BEGIN
    RETURN QUERY
    WITH claimed AS (
        {{sql:claim_next}}
    )
    SELECT c.key, c.token, c.payload, coalesce(c.attempts, 1) FROM claimed c;
END
$$;

-- once.claim_next (api::queue::claim_next, waiting::claim_next): with wait, looks until a key is
-- claimed or wait runs out, sleeping between looks as claim_key does (5 ms doubling to
-- 100 ms). Each waiting look runs in a subtransaction that is rolled back unless it claimed
-- something, so that a waiting worker keeps no lock, and waits for other transactions'
-- locks at most what is left of wait.
CREATE OR REPLACE FUNCTION once.claim_next(
    queue     text DEFAULT 'default',
    lease     interval DEFAULT '30 seconds',
    worker    text DEFAULT NULL,
    n         integer DEFAULT 1,
    wait      interval DEFAULT '0',
    owner_pid integer DEFAULT NULL)
RETURNS TABLE (key text, token bigint, payload jsonb, attempt integer)
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer;
    started timestamptz;
    only_lease boolean;
    deadline timestamptz;
    nap interval := '5 milliseconds';
    old_timeout text := current_setting('lock_timeout');
    got integer;
BEGIN
    PERFORM once_internal.require_queue(queue, 'claim_next');
    PERFORM once_internal.usable_interval(lease, 'lease');
    {{text_check:worker worker}}
    PERFORM once_internal.usable_integer(n, 'n');
    PERFORM once_internal.usable_interval(wait, 'wait');
    SELECT o.pid, o.started, o.lease_only INTO pid, started, only_lease
      FROM once_internal.claim_owner(owner_pid) o;
    IF wait > '0' AND current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION 'claim_next cannot wait inside a REPEATABLE READ or SERIALIZABLE transaction'
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'Call claim_next with wait in its own READ COMMITTED transaction (autocommit), or pass wait => ''0''.';
    END IF;
    PERFORM once_internal.refuse_writes('claim_next');
    IF wait = '0' THEN
        RETURN QUERY SELECT * FROM once_internal.claim_next_look(queue, lease, worker, n, pid, started, only_lease);
        RETURN;
    END IF;
    deadline := clock_timestamp() + wait;
    LOOP
        BEGIN
            PERFORM set_config('lock_timeout',
                greatest(extract(epoch FROM deadline - clock_timestamp()) * 1000, 1)::bigint::text, true);
            RETURN QUERY SELECT * FROM once_internal.claim_next_look(queue, lease, worker, n, pid, started, only_lease);
            GET DIAGNOSTICS got = ROW_COUNT;
            PERFORM set_config('lock_timeout', old_timeout, true);
            IF got > 0 THEN
                RETURN;
            END IF;
            -- Nothing claimed: roll the look back, with whatever it locked.
            RAISE EXCEPTION USING ERRCODE = 'no_data_found';
        EXCEPTION
            WHEN no_data_found OR lock_not_available THEN
                PERFORM set_config('lock_timeout', old_timeout, true);
        END;
        EXIT WHEN clock_timestamp() >= deadline;
        PERFORM pg_sleep(extract(epoch FROM least(nap, deadline - clock_timestamp())));
        nap := least(nap * 2, '100 milliseconds');
    END LOOP;
END
$$;

-- once.invalidate_keys (queue::invalidate_many): every key of a queue and/or under a
-- prefix that the caller may use, running ones included (their claims are cancelled).
CREATE OR REPLACE FUNCTION once.invalidate_keys(queue text DEFAULT NULL, prefix text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    queue text := invalidate_keys.queue;
    prefix text := invalidate_keys.prefix;
    gone bigint;
BEGIN
    IF queue IS NULL AND prefix IS NULL THEN
        RAISE EXCEPTION 'invalidate_keys needs a queue or a key prefix'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass queue => ''name'' and/or prefix => ''https://example.com/''.';
    END IF;
    IF queue IS NOT NULL THEN
        PERFORM once_internal.require_queue(queue, 'invalidate_keys');
    END IF;
    IF prefix = '' THEN
        RAISE EXCEPTION 'prefix must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass a key prefix such as ''https://example.com/'', or only a queue.';
    END IF;
    PERFORM once_internal.refuse_writes('invalidate_keys');
    {{sql:invalidate_many}};
    GET DIAGNOSTICS gone = ROW_COUNT;
    RETURN gone;
END
$$;

COMMENT ON FUNCTION once.create_queue(text, integer, interval, interval, text) IS
    'Create a queue, or change the retry policy of an existing one: a failed attempt waits backoff * 2^(attempts - 1), capped at max_backoff and jittered, until the key has been claimed max_attempts times; then it stays failed. namespace: the queue belongs to that namespace; NULL: shared.';
COMMENT ON FUNCTION once.drop_queue(text) IS
    'Drop an empty queue. Refused (55006) while keys still name it, and always for the queue ''default''.';
COMMENT ON FUNCTION once.enqueue_key(text, jsonb, text, integer, timestamptz, boolean, integer) IS
    'Ask for a key to be computed by the queue''s workers, due at run_at (NULL: now). Returns queued, requeued, duplicate or cached.';
COMMENT ON FUNCTION once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer) IS
    'enqueue_key for many keys in one statement (at most 1000): each key with its outcome, in the order given.';
COMMENT ON FUNCTION once.claim_next(text, interval, text, integer, interval, integer) IS
    'Claim up to n due keys of a queue with FOR UPDATE SKIP LOCKED (SQL edition: wait polls). Finish each with complete_key, fail_key or release_key.';
COMMENT ON FUNCTION once.invalidate_keys(text, text) IS
    'Forget every key of a queue and/or whose key starts with prefix that the caller may use, running ones included. Returns how many.';
