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

-- The timeline this primary writes WAL on: the first 8 hex digits of its WAL segment's
-- name (the extension asks the server directly).
CREATE OR REPLACE FUNCTION once_internal.insert_timeline() RETURNS bigint
    LANGUAGE sql VOLATILE
    SET search_path = pg_catalog, pg_temp
    RETURN ('x' || left(pg_walfile_name(pg_current_wal_insert_lsn()), 8))::bit(32)::bigint;

-- The server's clock in microseconds since 2000-01-01, the unit of fencing tokens.
CREATE OR REPLACE FUNCTION once_internal.token_clock() RETURNS bigint
    LANGUAGE sql VOLATILE
    SET search_path = pg_catalog, pg_temp
    RETURN date_part('epoch', clock_timestamp() - '2000-01-01 00:00:00+00'::timestamptz) * 1000000;

-- Fencing tokens: a sequence anchored to the clock (sql/schema.sql and
-- src/storage/tokens.rs say why), and the record of the timeline of its last anchor, the
-- same two sequences as the extension's, created once; a rerun keeps them and their
-- values. A rerun over an install without the record creates it: its tokens, far behind
-- the clock, anchor at the first draw.
DO $seq$
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE SEQUENCE IF NOT EXISTS once_internal.token_seq AS bigint START WITH %s CACHE 1',
        once_internal.token_clock());
    IF pg_catalog.to_regclass('once_internal.token_history') IS NULL THEN
        EXECUTE pg_catalog.format(
            'CREATE SEQUENCE once_internal.token_history AS bigint START WITH %s CACHE 1',
            once_internal.insert_timeline());
    END IF;
END
$seq$;

-- Taken by the one draw that anchors the sequences (a table: LOCK TABLE refuses
-- sequences, and any role could hold an advisory lock, keeping the sequence from being
-- anchored while every claim looks again). It stays empty. The anchor takes it in SHARE
-- UPDATE EXCLUSIVE mode: every role may use schema once_internal, and the parser locks
-- the target of an INSERT, UPDATE or DELETE (ROW EXCLUSIVE) before privileges are
-- checked, so a role with no grant held that lock with `PREPARE p AS INSERT INTO
-- once_internal.token_lock ...` in an open transaction; SHARE UPDATE EXCLUSIVE conflicts
-- with no lock the parser takes, and the commands that take it need ownership first.
CREATE TABLE IF NOT EXISTS once_internal.token_lock ();

-- The next token: storage::tokens::next of the extension, step for step. The lock is
-- taken in a block that always ends in an exception: the block's subtransaction is rolled
-- back, which releases the lock at once (the extension unlocks; PL/pgSQL cannot), while
-- the setvals, made outside transactions, stay. Held to the end of a claim's transaction,
-- it would make every claim that needs an anchor look again until then.
CREATE OR REPLACE FUNCTION once_internal.next_token() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    lag constant bigint := 10000;  -- storage::tokens::LAG
    -- Every call that draws refuses a standby first (refuse_writes), where there is no
    -- timeline to write on.
    timeline bigint := once_internal.insert_timeline();
    token bigint;
    now_us bigint;
    started timestamptz := clock_timestamp();
BEGIN
    LOOP
        IF pg_sequence_last_value('once_internal.token_history') = timeline THEN
            token := nextval('once_internal.token_seq');  -- drawn after the record was read
            IF token >= once_internal.token_clock() - lag THEN
                RETURN token;
            END IF;
        END IF;
        BEGIN
            LOCK TABLE once_internal.token_lock IN SHARE UPDATE EXCLUSIVE MODE NOWAIT;
            token := nextval('once_internal.token_seq');  -- again, now that no one else anchors
            now_us := once_internal.token_clock();
            IF pg_sequence_last_value('once_internal.token_history') IS DISTINCT FROM timeline
               OR token < now_us - lag THEN
                PERFORM setval('once_internal.token_seq', greatest(token, now_us));
                PERFORM setval('once_internal.token_history', timeline);
            END IF;
            RAISE SQLSTATE 'PO1AN';  -- anchored: release the lock
        EXCEPTION
            WHEN lock_not_available THEN
                IF clock_timestamp() - started > interval '1 second' THEN  -- storage::tokens::ANCHOR_PATIENCE
                    RAISE EXCEPTION 'pg_once could not anchor its fencing tokens within 1 s: another session holds the anchor''s lock'
                        USING ERRCODE = 'lock_not_available',
                              HINT = 'Only pg_once''s owner or a superuser can hold it (LOCK TABLE, or a maintenance transaction left open): end that transaction, then call again.';
                END IF;
                PERFORM pg_sleep(0.0001);
            WHEN SQLSTATE 'PO1AN' THEN
                NULL;
        END;
    END LOOP;
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

-- Who is judged (docs/sql-edition.md, "Who is judged"): the current user of the context
-- that calls once.*, as the extension's C functions judge GetUserId(), under ANALYZE,
-- autovacuum, index expressions, materialized views and other roles' SECURITY DEFINER
-- code alike. A SECURITY DEFINER function cannot see that user (its current_user is its
-- owner; session_user and the role setting are the session's, not the calling context's),
-- so each once.* is a SECURITY INVOKER wrapper that passes its current_user to its
-- SECURITY DEFINER implementation in once_internal (scripts/sql_edition.py, invoker_api),
-- and the implementation's first act is this function's: it makes sure that it was called
-- by that wrapper, then makes the role the one once_internal.caller() answers for the
-- rest of the call.
--
-- The call stack (PG_CONTEXT) proves who called: frame 1 is this function, frame 2 the
-- implementation (initialising its first variable), frame 3 the caller of the
-- implementation, which must be the wrapper: "PL/pgSQL function once.claim_key(text,...)
-- line 3 at RETURN". Nothing else can print a frame that starts that way: PL/pgSQL prints
-- a function's signature as format_procedure does (regprocedure's output), here with
-- search_path pinned, so schema-qualified, and a name that is not a plain identifier
-- (one holding a dot or a parenthesis) is quoted; no other schema is called once; other
-- frames start with their own words ("SQL function", "SQL statement", "COPY"). The
-- wrapper calls the implementation as a simple expression (no SPI, and so no "SQL
-- statement" frame, whose query text is the caller's own and could hold a forged line),
-- with its arguments already evaluated: no code of the caller runs in between. The
-- frame's leading words are taken from frame 1, so a translated lc_messages changes
-- nothing. Only the implementations call it (EXECUTE is not granted).
CREATE OR REPLACE FUNCTION once_internal.vouch(calling_role name, wrapper regprocedure) RETURNS oid
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    stack text;
    frames text[];
    role oid;
BEGIN
    GET DIAGNOSTICS stack = PG_CONTEXT;
    frames := string_to_array(stack, E'\n');
    -- The wrapper's call is a simple expression, which shows no frame of its own; after a
    -- subtransaction that aborted in the same statement (an error a PL/pgSQL block caught)
    -- PL/pgSQL evaluates it through the executor, which adds one. Skipped only when it is
    -- the wrapper's own text whole (scripts/sql_edition.py writes it): one line, so no
    -- forged frame can follow it, and then the frame after it must still be the wrapper.
    IF starts_with(coalesce(frames[3], ''), 'SQL expression "') THEN
        IF frames[3] IN (SELECT format('SQL expression "once_internal.%s(%s)%s"', p.proname,
                                       array_to_string(ARRAY['current_user'] || ARRAY(
                                           SELECT '$' || i FROM generate_series(1, p.pronargs) i), ', '),
                                       suffix)
                           FROM pg_proc p, (VALUES (''), (' IS NULL')) v(suffix)
                          WHERE p.oid = wrapper) THEN
            frames := frames[1:2] || frames[4:];
        END IF;
    END IF;
    IF NOT starts_with(coalesce(frames[3], ''),
                       split_part(frames[1], 'once_internal.vouch(name,regprocedure)', 1)
                       || wrapper::text || ' ') THEN
        RAISE EXCEPTION 'permission denied: only % calls its implementation', wrapper
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('Call %s itself: pg_once judges the role it is called as.', wrapper);
    END IF;
    -- A session may outlive its role (DROP ROLE does not end it). No role must never
    -- read as NULL: token_holder would take that for an administrator.
    role := to_regrole(quote_ident(calling_role));
    IF role IS NULL THEN
        RAISE EXCEPTION 'role "%" does not exist', calling_role USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- Assignments of simple expressions, not PERFORM (a query through SPI each): this runs
    -- on every call, and a PERFORM of a SQL function with a SET clause here cost ~37 us a
    -- hit (5,000 hits in a DO loop, min of 12 rounds: 96.5 us against 59.1 us).
    stack := set_config('once_internal.caller', role::text, true);
    stack := set_config('once_internal.borrowed', once_internal.borrowed(calling_role), true);
    RETURN role;
END
$$;

-- 'off' when the calling role acts as itself, 'on' when its rights are borrowed, for the
-- setting once_internal.borrowed (namespace::caller_administers): only then may an
-- administrator administer (define namespaces, change shared queues, end any claim, use
-- any once.cached key). It does not when its current user is not the session's own role
-- (the role set by SET ROLE, else the session's user, which SECURITY DEFINER code, index
-- expressions under ANALYZE or autovacuum and materialized views do not change): code
-- one role wrote, running in another role's session, must not act with the rights of an
-- administrator, whichever of the two is one. The extension asks PostgreSQL
-- (InSecurityRestrictedOperation(), InLocalUserIdChange()), which PL/pgSQL cannot without
-- an error and a subtransaction per call; the one difference: an administrator's own
-- SECURITY DEFINER function or index expression, run in that administrator's own
-- session, acts as itself here, and is refused there.
CREATE OR REPLACE FUNCTION once_internal.borrowed(calling_role name) RETURNS text
    LANGUAGE sql STABLE
    -- No SET clause: a RETURN body binds its names when created (under the script's
    -- pinned search_path), and without one the function is inlined where it is called.
    RETURN CASE WHEN calling_role::text = CASE current_setting('role') WHEN 'none' THEN session_user::text
                                                                   ELSE current_setting('role') END
                THEN 'off' ELSE 'on' END;

-- The role pg_once is called as, in this call: what the implementation's vouch (or, for
-- the views, may_use_key_as and administers_as) set. A transaction-local setting, which
-- any role may SET, but everything that reads it runs after one of those set it.
CREATE OR REPLACE FUNCTION once_internal.caller() RETURNS oid
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    role oid := nullif(current_setting('once_internal.caller', true), '')::oid;
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION 'pg_once: once_internal.caller() read before any call set it';
    END IF;
    RETURN role;
END
$$;

-- The protective settings, written by administrators alone (issue 36): the extension
-- defines once.history_retention, once.max_result_size, once.max_payload_size and
-- once.max_error_size as settings only a superuser may change; here they would be custom
-- settings any role can SET, and a role that SET once.history_retention = 0 purged every
-- tenant's history. So they are rows of this table, owned by the installing role, which
-- no one else may write (nothing is granted on it), read when used; a SET (or ALTER ROLE
-- ... SET) of these names is ignored. A name without a row has the extension's default.
CREATE TABLE IF NOT EXISTS once.settings (
    name  text PRIMARY KEY
          CONSTRAINT settings_name_known CHECK (name IN ('once.history_retention', 'once.max_result_size',
                                                         'once.max_payload_size', 'once.max_error_size')),
    value text NOT NULL,
    CONSTRAINT settings_value_format CHECK (
        CASE name WHEN 'once.history_retention' THEN value ~ '^\s*[0-9]{1,10}\s*$'
                  ELSE value ~ '^\s*[0-9]{1,10}\s*(kB|MB|GB|TB)?\s*$' END)
);
COMMENT ON TABLE once.settings IS
    'pg_once''s protective settings in the SQL edition, written by administrators only: INSERT INTO once.settings VALUES (''once.max_result_size'', ''1MB''). A session''s SET of these names is ignored; a name without a row has its default (once.history_retention 604800 s, once.max_result_size 16MB, once.max_payload_size 1MB, once.max_error_size 16kB).';
COMMENT ON COLUMN once.settings.name IS
    'once.history_retention, once.max_result_size, once.max_payload_size or once.max_error_size.';
COMMENT ON COLUMN once.settings.value IS
    'Seconds for once.history_retention (e.g. ''86400''); a size for the others, in kB unless a unit (kB, MB, GB, TB) follows (e.g. ''1MB'').';

-- The $holder of rules/token_holder.sql: the caller, or NULL for an administrator (a
-- superuser, or a member of the role that installed pg_once, acting as itself), who may
-- end any claim.
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
    -- Not while borrowed (once_internal.borrowed): then the caller is no administrator.
    IF current_setting('once_internal.borrowed', true) IS DISTINCT FROM 'off' THEN
        RETURN caller;
    END IF;
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
