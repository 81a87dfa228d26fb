-- Namespaces in the SQL edition: src/protocol/namespace.rs in PL/pgSQL. A namespace is a
-- row of once_internal.namespace_owners (sql/schema.sql's table): every key that starts
-- with its prefix (the longest registered prefix wins) belongs to it, and only members of
-- its owner role (and superusers) may use those keys and the namespace's queues. Every
-- function of the API with a key or a queue asks require_key (or require_named) first, as
-- the extension's do, with the caller judged as once_internal.caller(): the current user
-- of the context that called once.* (once_internal.vouch), as in the extension.
--
-- The extension keeps the namespaces in each backend's memory; the edition reads the
-- table on each check (an index probe per namespace at most: the table is small and
-- keyed by prefix). Its writes are create_namespace's and drop_namespace's statements,
-- spliced from src/protocol/sql/ as the extension runs them.

-- The extension reads the namespaces with the latest snapshot, so that a REPEATABLE READ
-- or SERIALIZABLE transaction that began before a namespace was created is still refused
-- its keys; SQL reads with the transaction's snapshot. So create_namespace and
-- drop_namespace also update this one row, and a check in such a transaction tries to
-- lock it FOR SHARE first (and lets go at once): a change committed since the snapshot
-- then fails the call with PostgreSQL's serialization error (40001), rather than letting
-- the transaction use keys of a namespace it cannot see (require_key); one in progress is
-- waited for. READ COMMITTED reads each statement with a new snapshot, and needs neither.
CREATE TABLE IF NOT EXISTS once_internal.namespaces_stamp (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO once_internal.namespaces_stamp DEFAULT VALUES ON CONFLICT DO NOTHING;

-- The namespace `key` (or a queue's namespace name) belongs to: the longest registered
-- prefix it starts with. STABLE and not SECURITY DEFINER: called by the functions below
-- and by the SECURITY DEFINER API, which own or may read the table.
CREATE OR REPLACE FUNCTION once_internal.namespace_of(key text)
    RETURNS once_internal.namespace_owners
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    RETURN (SELECT n FROM once_internal.namespace_owners n
                 WHERE left(namespace_of.key, length(n.prefix)) = n.prefix
                 ORDER BY length(n.prefix) DESC, n.prefix
                 LIMIT 1);
END
$$;

-- Whether the calling role may use the keys of a namespace owned by `owner`
-- (Namespace::admits_caller: has_privs_of_role, which is true for a superuser).
CREATE OR REPLACE FUNCTION once_internal.admits(owner oid) RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    RETURN pg_has_role(once_internal.caller(), owner, 'USAGE');
END
$$;

-- Whether the calling role administers pg_once: a superuser, or a member of the role that
-- installed it (the owner of schema once), as namespace::caller_administers. Called from
-- another role's SECURITY DEFINER code, an index expression or a materialized view, the
-- calling role is that code's owner, as in the extension.
CREATE OR REPLACE FUNCTION once_internal.administers() RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    RETURN once_internal.token_holder() IS NULL;
END
$$;

-- The role whose once.cached key `key` is (namespace::cached_key_role: a key ending in
-- `#cached:<role oid>:<64 characters>`, the oid as Rust's u32 parses it), else NULL.
CREATE OR REPLACE FUNCTION once_internal.cached_key_role(key text) RETURNS oid
    LANGUAGE sql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    RETURN (SELECT m[1]::oid FROM regexp_match(key, '#cached:(\+?[0-9]{1,10}):(.{64})$') m
             WHERE m[1]::bigint <= 4294967295);

-- namespace::admits_cached: a once.cached key is its role's alone (and administrators').
-- The administrator test (a few hundred microseconds: pg_roles and role membership) is
-- asked only of a once.cached key of another role, never on the common path.
CREATE OR REPLACE FUNCTION once_internal.admits_cached(key text) RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    role oid := once_internal.cached_key_role(key);
BEGIN
    RETURN role IS NULL OR role = once_internal.caller() OR once_internal.administers();
END
$$;

-- namespace::require_key: 42501 unless the caller may use `key`; `what` names the call.
-- VOLATILE, as every function that calls it: it may lock (see namespaces_stamp).
CREATE OR REPLACE FUNCTION once_internal.require_key(key text, what text) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    n once_internal.namespace_owners;
    owner text;
BEGIN
    -- (Not on a standby, where nothing is locked, nor written: reads of keys are all a
    -- standby serves, and they plant nothing.)
    IF current_setting('transaction_isolation') <> 'read committed' AND NOT pg_is_in_recovery() THEN
        BEGIN
            PERFORM FROM once_internal.namespaces_stamp FOR SHARE;
            -- Checked: let go of the lock at once (the subtransaction is undone), so that
            -- no create_namespace waits for this transaction.
            RAISE EXCEPTION USING ERRCODE = 'no_data_found';
        EXCEPTION WHEN no_data_found THEN
            NULL;
        END;
    END IF;
    -- namespace_of, written out: this runs on every call (a cache hit's path).
    SELECT * INTO n FROM once_internal.namespace_owners o
     WHERE left(require_key.key, length(o.prefix)) = o.prefix
     ORDER BY length(o.prefix) DESC, o.prefix
     LIMIT 1;
    IF n.prefix IS NOT NULL AND NOT once_internal.admits(n.owner) THEN
        owner := coalesce((SELECT r.rolname::text FROM pg_roles r WHERE r.oid = n.owner),
                          format('role %s', n.owner::oid));
        RAISE EXCEPTION 'permission denied for namespace "%": %', n.prefix, what
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('Keys and queues of namespace "%s" belong to role %s: call as a member of it (GRANT %s TO ...).',
                                n.prefix, owner, owner);
    END IF;
    IF strpos(key, '#cached:') > 0 AND NOT once_internal.admits_cached(key) THEN
        RAISE EXCEPTION 'permission denied for key "%": %', key, what
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'once.cached keeps a query''s rows under a key of the role that ran the query: only that role (or an administrator) may use it. Call once.cached with your own query.';
    END IF;
END
$$;

-- namespace::require_named: the namespace named exactly `prefix`, which must exist (42704)
-- and which the caller must be allowed to use (42501).
CREATE OR REPLACE FUNCTION once_internal.require_named(prefix text, what text) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM once_internal.namespace_owners n WHERE n.prefix = require_named.prefix) THEN
        RAISE EXCEPTION 'namespace "%" does not exist', prefix
            USING ERRCODE = 'undefined_object',
                  HINT = 'Create it first with once.create_namespace(prefix, owner), or pass NULL for a queue shared by every role.';
    END IF;
    PERFORM once_internal.require_key(prefix, what);
END
$$;

-- The filters the extension's statements and views call (sql/functions.sql): whether the
-- caller may use `key`, and the prefix of its namespace. Not SECURITY DEFINER: they
-- answer for the calling role, whatever runs them.
CREATE OR REPLACE FUNCTION once_internal.may_use_key(key text) RETURNS boolean
    LANGUAGE plpgsql STABLE PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    owner oid;
BEGIN
    IF key IS NULL THEN
        RETURN NULL;
    END IF;
    -- namespace_of, written out as in require_key: this runs for every row of a view.
    SELECT o.owner INTO owner FROM once_internal.namespace_owners o
     WHERE left(may_use_key.key, length(o.prefix)) = o.prefix
     ORDER BY length(o.prefix) DESC, o.prefix
     LIMIT 1;
    RETURN (owner IS NULL OR once_internal.admits(owner))
           AND (strpos(key, '#cached:') = 0 OR once_internal.admits_cached(key));
END
$$;

CREATE OR REPLACE FUNCTION once_internal.key_namespace(key text) RETURNS text
    LANGUAGE plpgsql STABLE PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    RETURN (once_internal.namespace_of(key)).prefix;
END
$$;

-- What LISTENers on channel once receive for `key` (namespace::payload): its hex SHA-256
-- for a namespace that announces digests, else the key.
CREATE OR REPLACE FUNCTION once_internal.notify_payload(key text, key_hash bytea) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    RETURN CASE (once_internal.namespace_of(key)).notify WHEN 'digest' THEN encode(key_hash, 'hex')
                                                              ELSE key END;
END
$$;

-- storage::entry::try_lock_against_writes, retried every 5 ms for up to 10 s
-- (namespace::lock_against_writes): a request left waiting in the lock queue would stop
-- every pg_once write behind it.
CREATE OR REPLACE FUNCTION once_internal.lock_against_writes() RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + '10 seconds';
BEGIN
    LOOP
        BEGIN
            LOCK TABLE once.entries IN SHARE ROW EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= deadline THEN
                RAISE EXCEPTION 'create_namespace could not lock once.entries against writes for 10 s'
                    USING ERRCODE = 'lock_not_available',
                          HINT = 'A transaction that wrote keys is still open (see pg_stat_activity, state ''idle in transaction''): end it, then call create_namespace again.';
            END IF;
            PERFORM pg_sleep(0.005);
        END;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION once_internal.require_administrator(what text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF NOT once_internal.administers() THEN
        RAISE EXCEPTION 'permission denied: %', what
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Namespaces are defined by a superuser or a member of the role that owns the pg_once extension, calling the function itself (not from a SECURITY DEFINER function, an index expression or a materialized view).';
    END IF;
END
$$;

-- args::namespace_prefix.
CREATE OR REPLACE FUNCTION once_internal.usable_prefix(prefix text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    {{text_check:prefix prefix}}
    RETURN prefix;
END
$$;

-- once.create_namespace (namespace::create). Race-free against writers as in the
-- extension: once.entries is locked against writes before the keys that would change
-- hands are counted, and every call that inserts a key checks its namespace again after
-- the insert (which waited for this lock).
CREATE OR REPLACE FUNCTION once.create_namespace(
    prefix   text,
    owner    regrole,
    notify   text DEFAULT 'digest',
    existing text DEFAULT 'refuse')
RETURNS void
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    prefix text := once_internal.usable_prefix(create_namespace.prefix);
    owner regrole := create_namespace.owner;
    notify text := create_namespace.notify;
    owner_changes boolean;
    keys bigint;
BEGIN
    IF owner IS NULL THEN
        RAISE EXCEPTION 'owner must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass the role whose members may use the namespace''s keys, e.g. ''app2''.';
    END IF;
    IF notify IS NULL OR notify NOT IN ('digest', 'key') THEN
        RAISE EXCEPTION '%', CASE WHEN notify IS NULL THEN 'notify must not be NULL'
                                  ELSE format('notify must be ''digest'' or ''key'', got ''%s''', notify) END
            USING ERRCODE = CASE WHEN notify IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'Pass ''digest'' (the key''s hex SHA-256: listeners without rights learn nothing) or ''key'' (the key itself).';
    END IF;
    IF existing IS NULL OR existing NOT IN ('refuse', 'purge', 'adopt') THEN
        RAISE EXCEPTION '%', CASE WHEN existing IS NULL THEN 'existing must not be NULL'
                                  ELSE format('existing must be ''refuse'', ''purge'' or ''adopt'', got ''%s''', existing) END
            USING ERRCODE = CASE WHEN existing IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'Pass ''refuse'' (the default: fail while any key under the prefix would change hands), ''purge'' (delete them) or ''adopt'' (give them to the namespace).';
    END IF;
    PERFORM once_internal.require_administrator('once.create_namespace');
    PERFORM once_internal.refuse_writes('create_namespace');
    PERFORM once_internal.lock_against_writes();
    owner_changes := EXISTS (SELECT 1 FROM once_internal.namespace_owners n
                              WHERE n.prefix = param.prefix AND n.owner <> param.owner);
    -- namespace.rs's HANDED_OVER (a read, not a rule): keys under the prefix outside
    -- every namespace or in a shorter one, or all of them when the owner changes.
    SELECT count(*) INTO keys FROM once.entries e
     WHERE left(e.key, length(param.prefix)) = param.prefix
       AND (length(coalesce(once_internal.key_namespace(e.key), '')) < length(param.prefix)
            OR param.owner_changes);
    IF keys > 0 THEN
        IF existing = 'refuse' THEN
            RAISE EXCEPTION '% key% under "%" would become the namespace''s', keys,
                            CASE WHEN keys = 1 THEN '' ELSE 's' END, prefix
                USING ERRCODE = 'object_in_use',
                      HINT = 'Any role may have written them. Pass existing => ''purge'' to delete them first, or existing => ''adopt'' to give them to the namespace once you have checked them (SELECT key, state FROM once.entries WHERE key LIKE ...).';
        ELSIF existing = 'purge' THEN
            {{sql:purge_handed_over}};
        END IF;
    END IF;
    {{sql:upsert_namespace}};
    UPDATE once_internal.namespaces_stamp SET at = clock_timestamp();
END
$$;

-- once.drop_namespace (namespace::remove): refused while it owns keys or queues, which
-- would silently become shared by every role.
CREATE OR REPLACE FUNCTION once.drop_namespace(prefix text)
RETURNS void
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    prefix text := once_internal.usable_prefix(drop_namespace.prefix);
    keys bigint;
    queues text;
BEGIN
    PERFORM once_internal.require_administrator('once.drop_namespace');
    PERFORM once_internal.refuse_writes('drop_namespace');
    PERFORM once_internal.lock_against_writes();
    -- namespace::lock_against_new_queues: no queue is created in it before this commits.
    LOCK TABLE once.queues IN SHARE ROW EXCLUSIVE MODE;
    SELECT count(*) INTO keys FROM once.entries e
     WHERE left(e.key, length(param.prefix)) = param.prefix
       AND once_internal.key_namespace(e.key) = param.prefix;
    SELECT string_agg(q.name, ', ' ORDER BY q.name) INTO queues FROM once.queues q
     WHERE q.namespace = param.prefix;
    IF keys > 0 OR queues IS NOT NULL THEN
        RAISE EXCEPTION '%', CASE WHEN queues IS NOT NULL
                                  THEN format('namespace "%s" still has %s keys and queues %s', prefix, keys, queues)
                                  ELSE format('namespace "%s" still has %s keys', prefix, keys) END
            USING ERRCODE = 'object_in_use',
                  HINT = format('Remove them first (once.invalidate_keys(prefix => ''%s''), once.drop_queue), so that they do not become shared by every role.',
                                replace(prefix, '''', ''''''));
    END IF;
    {{sql:delete_namespace}};
    IF NOT FOUND THEN
        RAISE EXCEPTION 'namespace "%" does not exist', prefix
            USING ERRCODE = 'undefined_object', HINT = 'See SELECT prefix FROM once.namespaces;';
    END IF;
    UPDATE once_internal.namespaces_stamp SET at = clock_timestamp();
END
$$;

COMMENT ON FUNCTION once.create_namespace(text, regrole, text, text) IS
    'Make every key that starts with prefix (the longest registered prefix wins) belong to owner: only its members and superusers may use such keys (42501 for anyone else). notify: digest or key, what LISTENers on channel once receive. existing: refuse, purge or adopt keys already under prefix. Only for superusers and members of the role that installed pg_once.';
COMMENT ON FUNCTION once.drop_namespace(text) IS
    'Forget a namespace. Refused (55006) while it still has keys or queues. Only for superusers and members of the role that installed pg_once.';
