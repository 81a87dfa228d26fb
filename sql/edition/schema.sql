-- What the extension does in C, done in SQL and PL/pgSQL (docs/sql-edition.md). Every
-- function here is re-declared by each run (CREATE OR REPLACE keeps its grants).

-- SHA-256 of a key, the digest once.entries is keyed by: the same bytes as the
-- extension's (the server's sha256 of the text's bytes), which declares it LANGUAGE
-- internal, something only a superuser may do. convert_to into the database's own
-- encoding returns the text's bytes unchanged.
CREATE OR REPLACE FUNCTION once.key_hash(key text) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN pg_catalog.sha256(pg_catalog.convert_to(key, pg_catalog.getdatabaseencoding()));
COMMENT ON FUNCTION once.key_hash(text) IS
    'SHA-256 digest of a key: the primary key of once.entries. Look a key up with WHERE key_hash = once.key_hash(''...'').';

-- Fencing tokens: one sequence, started above every token this cluster has issued (its
-- WAL position: sql/schema.sql says why that bound holds). Created once; a rerun keeps it
-- and its value.
DO $seq$
DECLARE
    floor bigint := (pg_catalog.pg_current_wal_insert_lsn() OPERATOR(pg_catalog.-)
                     '0/0'::pg_catalog.pg_lsn)::bigint OPERATOR(pg_catalog.+) 1;
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE SEQUENCE IF NOT EXISTS once_internal.token_seq AS bigint START WITH %s CACHE 1', floor);
END
$seq$;

-- The next token, never below the sequence's START (a restore into this cluster may
-- have set it lower: src/storage/tokens.rs).
CREATE OR REPLACE FUNCTION once_internal.next_token() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    token bigint := nextval('once_internal.token_seq');
    floor bigint;
BEGIN
    SELECT seqstart INTO floor FROM pg_sequence WHERE seqrelid = 'once_internal.token_seq'::regclass;
    IF token < floor THEN
        PERFORM setval('once_internal.token_seq', floor);
        token := nextval('once_internal.token_seq');
    END IF;
    RETURN token;
END
$$;

-- Is the backend that made a claim still the one running with that pid? The extension
-- reads its shared memory; here pg_stat_get_activity(pid) (what pg_stat_activity shows,
-- without the view's join and its row for every backend), which shows another role's
-- backend_start only to members of pg_read_all_stats: these functions run as the
-- installing role, which should be one (docs/sql-edition.md). A backend whose start time
-- this role cannot see counts as alive, so that a missing privilege delays a takeover to
-- the lease's end rather than taking a live owner's claim. The statistics snapshot is
-- cleared first: a transaction otherwise keeps the first one it read, and a waiting
-- claim_key would never see its owner exit.
-- Each answer still copies every backend's status: 200 callers waiting in claim_key
-- kept 1.3 of 2 cores busy with it (bench/edition/edition.sh, waiting row, 2026-12-02).
-- So while a call waits (the transaction-local setting once_internal.waiting, set by
-- claim_key between its looks), an owner seen alive less than 200 ms ago is taken as
-- alive without looking: a dead owner is taken over at most that much later. A call's
-- first look always looks. Anyone may SET these settings, but only for their own
-- session's calls, and the 200 ms bound holds whatever they say.
CREATE OR REPLACE FUNCTION once_internal.backend_alive(pid integer, started timestamptz)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    waiting boolean := current_setting('once_internal.waiting', true) = 'on';
    this_owner text := pid::text || '/' || coalesce((extract(epoch FROM started) * 1000000)::bigint::text, '');
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    seen text;
    alive boolean;
BEGIN
    IF waiting THEN
        seen := current_setting('once_internal.alive_seen', true);
        IF split_part(seen, ' ', 1) = this_owner
           AND now_us - split_part(seen, ' ', 2)::bigint BETWEEN 0 AND 200000 THEN
            RETURN true;
        END IF;
    END IF;
    PERFORM pg_stat_clear_snapshot();
    alive := EXISTS (SELECT 1 FROM pg_stat_get_activity(backend_alive.pid) a
                      WHERE a.pid = backend_alive.pid
                        AND (a.backend_start = backend_alive.started OR a.backend_start IS NULL));
    IF waiting AND alive THEN
        PERFORM set_config('once_internal.alive_seen', this_owner || ' ' || now_us::text, true);
    END IF;
    RETURN alive;
END
$$;

-- The start time of a backend by pid, NULL if none runs (the claim's owner_started).
CREATE OR REPLACE FUNCTION once_internal.backend_started(pid integer) RETURNS timestamptz
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    PERFORM pg_stat_clear_snapshot();
    RETURN (SELECT a.backend_start FROM pg_stat_activity a WHERE a.pid = backend_started.pid);
END
$$;

-- The role pg_once is called by: these functions are SECURITY DEFINER, so CURRENT_USER is
-- their owner; the caller is the role set by SET ROLE, else the session's user. (The
-- extension reads the user its C function was called as, which also sees a SECURITY
-- DEFINER function of another role calling pg_once; the edition judges that call as
-- the session's role: docs/sql-edition.md.)
CREATE OR REPLACE FUNCTION once_internal.caller() RETURNS oid
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    name text := CASE current_setting('role') WHEN 'none' THEN session_user ELSE current_setting('role') END;
    -- By name through regrole, a syscache lookup (pg_roles costs several times more, and
    -- this runs on every call).
    role oid := to_regrole(quote_ident(name));
BEGIN
    -- A session may outlive its role (DROP ROLE does not end it). No role must never
    -- read as NULL: token_holder would take that for an administrator.
    IF role IS NULL THEN
        RAISE EXCEPTION 'role "%" does not exist', name USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN role;
END
$$;

-- The $holder of rules/token_holder.sql: the caller, or NULL for an administrator (a
-- superuser, or a member of the role that installed pg_once), who may end any claim.
-- One statement per question: written as one expression with subqueries, it took
-- ~200 us a call, ten times its parts.
CREATE OR REPLACE FUNCTION once_internal.token_holder() RETURNS oid
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    caller oid := once_internal.caller();
    superuser boolean;
    installer oid;
BEGIN
    SELECT r.rolsuper INTO superuser FROM pg_roles r WHERE r.oid = caller;
    SELECT n.nspowner INTO installer FROM pg_namespace n WHERE n.nspname = 'once';
    IF superuser OR pg_has_role(caller, installer, 'USAGE') THEN
        RETURN NULL;
    END IF;
    RETURN caller;
END
$$;

-- notify_key_resolved: pg_notify('once', ...) from the trigger, sent at commit by
-- PostgreSQL itself (the extension relays through its worker when preloaded): the key, or
-- its hex digest for a namespace that announces digests (sql/edition/namespaces.sql).
CREATE OR REPLACE FUNCTION once_internal.notify_key_resolved() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    PERFORM pg_notify('once', once_internal.notify_payload(OLD.key, OLD.key_hash));
    RETURN NULL;
END
$$;
