-- The core API of the SQL edition: the control flow of src/api/cache.rs and
-- src/protocol/{claim,resolve,rerun,reap,waiting}.rs in PL/pgSQL. Every write is a
-- statement of src/protocol/sql/, written `{{sql:name}}` and spliced in by
-- scripts/sql_edition.py, its parameters `$name` read from the variables of the block
-- labelled `param`. The functions are SECURITY DEFINER, owned by the installing role, so
-- that they alone write once.entries (as the extension's run their statements as its
-- owner), with search_path pinned.

-- ---- argument checks: the messages, SQLSTATEs and hints of src/api/args.rs ----------

-- An earlier edition's usable_key(key), which checked no namespace.
DROP FUNCTION IF EXISTS once_internal.usable_key(text);

-- The key a call names (api::usable_key): checked (args::key), and one the caller may
-- use (42501 for a key of a namespace whose owner the caller is not a member of:
-- namespaces.sql). `function` names the call in a refusal.
CREATE OR REPLACE FUNCTION once_internal.usable_key(key text, function text) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    {{text_check:key key}}
    PERFORM once_internal.require_key(key, function);
    RETURN key;
END
$$;

-- An integer argument checked by its rule (args::integer): src/api/argument_rules.json's
-- integers, written in where `integer_rules` stands, as for usable_interval.
CREATE OR REPLACE FUNCTION once_internal.usable_integer(value bigint, name text) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    nullable boolean;
    low bigint;
    high bigint;
    hint text;
BEGIN
    CASE name
        {{integer_rules}}
    END CASE;
    IF value IS NULL THEN
        IF nullable THEN RETURN NULL; END IF;
        RAISE EXCEPTION '% must not be NULL', name USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    ELSIF high IS NOT NULL AND value NOT BETWEEN low AND high THEN
        RAISE EXCEPTION '% must be between % and %, got %', name, low, high, value
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    ELSIF high IS NULL AND value < low THEN
        RAISE EXCEPTION '% must be positive, got %', name, value
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    END IF;
    RETURN value;
END
$$;

-- An earlier edition's usable_token(token), now usable_integer(token, 'token').
DROP FUNCTION IF EXISTS once_internal.usable_token(bigint);

-- An earlier edition's usable_interval, which took its rule as arguments.
DROP FUNCTION IF EXISTS once_internal.usable_interval(interval, text, text, boolean, interval, text, boolean);

-- An interval argument checked by its rule (args::interval): src/api/argument_rules.json,
-- which scripts/sql_edition.py writes in where `interval_rules` stands below, one WHEN a
-- rule, as the extension reads it: one table for both editions.
CREATE OR REPLACE FUNCTION once_internal.usable_interval(value interval, name text) RETURNS interval
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    nullable boolean;
    positive boolean;
    most text;
    hint text;
    months numeric;
    days numeric;
BEGIN
    CASE name
        {{interval_rules}}
    END CASE;
    IF value IS NULL THEN
        IF nullable THEN RETURN NULL; END IF;
        RAISE EXCEPTION '% must not be NULL', name USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    END IF;
    -- args::mixes_signs: months with days or time of the other sign.
    months := extract(year FROM value) * 12 + extract(month FROM value);
    IF months <> 0 THEN
        days := extract(day FROM value);
        -- The time part: what is left without the months and days.
        IF sign(days) = -sign(months)
           OR sign(extract(epoch FROM value - make_interval(months => months::integer,
                                                            days => days::integer)))
              = -sign(months) THEN
            RAISE EXCEPTION '% must not mix months with days or time of the other sign, got %', name, value
                USING ERRCODE = 'invalid_parameter_value', HINT = hint;
        END IF;
    END IF;
    IF positive AND value <= '0' THEN
        RAISE EXCEPTION '% must be positive%, got %', name, CASE WHEN nullable THEN ' or NULL' ELSE '' END, value
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    ELSIF value < '0' THEN
        RAISE EXCEPTION '% must not be negative, got %', name, value
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    ELSIF value > most::interval THEN
        RAISE EXCEPTION '% must be at most %, got %', name, most, value
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    END IF;
    RETURN value;
END
$$;

-- The once.max_*_size settings (args::within_limit): the extension defines them, here
-- they are rows of once.settings, which only administrators write (sql/edition/schema.sql
-- says why), read in kB like the extension's, with its units.
CREATE OR REPLACE FUNCTION once_internal.within_limit(
    size bigint, what text, name text, default_kb bigint, hint text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    setting text := (SELECT s.value FROM once.settings s WHERE s.name = within_limit.name);
    parts text[] := regexp_match(coalesce(setting, ''), '^\s*(\d+)\s*(kB|MB|GB|TB)?\s*$');
    limit_kb bigint := default_kb;
BEGIN
    IF setting IS NOT NULL THEN
        IF parts IS NULL THEN
            RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, setting
                USING ERRCODE = 'invalid_parameter_value', HINT = 'Valid units are "kB", "MB", "GB" and "TB".';
        END IF;
        limit_kb := parts[1]::bigint * CASE parts[2] WHEN 'MB' THEN 1024 WHEN 'GB' THEN 1024 * 1024
                                                      WHEN 'TB' THEN 1024 * 1024 * 1024 ELSE 1 END;
    END IF;
    IF size > limit_kb * 1024 THEN
        RAISE EXCEPTION '% is % bytes, more than % (% kB)', what, size, name, limit_kb
            USING ERRCODE = 'program_limit_exceeded', HINT = hint;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION once_internal.result_size(result jsonb, what text) RETURNS void
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
    -- pg_column_size of a value not yet stored: its size uncompressed, as Jsonb::size.
    RETURN once_internal.within_limit(pg_column_size(result), what, 'once.max_result_size', 16 * 1024,
        'Store a smaller result (a reference to where a large one is kept, e.g. an object''s URL), or ask an administrator to raise once.max_result_size.');

-- complete_key's ttl, stale, beta and jitter (args::policy).
CREATE OR REPLACE FUNCTION once_internal.check_policy(
    ttl interval, stale interval, beta float8, jitter float8) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    PERFORM once_internal.usable_interval(ttl, 'ttl');
    PERFORM once_internal.usable_interval(stale, 'stale');
    beta := nullif(beta, 0);
    IF beta IS NOT NULL AND NOT (beta > 0 AND beta <= 100) THEN
        RAISE EXCEPTION 'beta must be between 0 and 100, got %', beta USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Use 1.0 for the early refreshes of the XFetch paper, more to refresh earlier, 0 or NULL for none.';
    END IF;
    IF jitter IS NOT NULL AND NOT (jitter >= 0 AND jitter < 1) THEN
        RAISE EXCEPTION 'jitter must be at least 0 and less than 1, got %', jitter USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Use the fraction of the ttl by which expiries may be brought forward, e.g. 0.1 for up to 10%.';
    END IF;
    IF ttl IS NULL AND (stale IS NOT NULL OR beta IS NOT NULL OR jitter > 0) THEN
        RAISE EXCEPTION '% needs a ttl: a result without one never expires',
            CASE WHEN stale IS NOT NULL THEN 'stale' WHEN beta IS NOT NULL THEN 'beta' ELSE 'jitter' END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a ttl as well, e.g. ttl => ''1 hour'', or leave the option out.';
    END IF;
END
$$;

-- On a hot standby nothing can be written (protocol::standby): every call that would
-- write is refused before it starts, with PostgreSQL's 25006.
CREATE OR REPLACE FUNCTION once_internal.refuse_writes(function text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF pg_is_in_recovery() THEN
        RAISE EXCEPTION 'cannot execute once.%() during recovery', function
            USING ERRCODE = 'read_only_sql_transaction',
                  HINT = format('This server is a hot standby: it serves cache hits and the once.* views, and nothing that writes. Call once.%s on the primary.', function);
    END IF;
END
$$;

-- ---- taking a key: protocol/claim.rs --------------------------------------------------

-- Does this read of a fresh result draw an early refresh (freshness::draws_early_refresh,
-- XFetch: `-delta * beta * ln(u) >= time left`, u uniform in (0, 1])? Only a done key
-- may. A draw that once.get made of this very result is owed to the session's next look
-- (freshness.rs says why): kept in a session setting, since PL/pgSQL has no session
-- state; a plain set_config outlives the function, and is undone with its transaction.
CREATE OR REPLACE FUNCTION once_internal.draws_early_refresh(e once.entries) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    owed text := current_setting('once_internal.owed_early_refresh', true);
BEGIN
    IF owed IS NOT NULL AND owed <> '' THEN
        PERFORM set_config('once_internal.owed_early_refresh', '', false);
        IF owed = e.token::text AND e.state = 'done' THEN
            RETURN true;
        END IF;
    END IF;
    IF e.state <> 'done' OR e.beta IS NULL OR e.beta <= 0 OR e.compute_time IS NULL
       OR e.expires_at IS NULL THEN
        RETURN false;
    END IF;
    RETURN -extract(epoch FROM e.compute_time) * e.beta * ln(1 - random())
           >= extract(epoch FROM e.expires_at - clock_timestamp());
END
$$;

-- What one look at a key decides (decision::decide), the same table in PL/pgSQL: both
-- are held to src/protocol/claim_decisions.json (pg_test/multi/tests/claim_decision.rs).
-- `state` NULL: no row visible. The facts that cost something to observe (`owner`:
-- 'alive' or why it is gone; the early-refresh draw; another transaction holding the row)
-- are passed as NULL until the decision asks for one: it then answers 'ask:' and the
-- fact's name, and the caller observes it and asks again, as the Observe trait does.
-- It and claim_answer pin no search_path: their callers (claim_attempt, once.get) pin it,
-- and a SET here made every cache hit about 20% slower (two or three calls a look).
CREATE OR REPLACE FUNCTION once_internal.claim_decision(
    state once.key_state, fresh boolean, servable_stale boolean, retry_later boolean,
    fingerprint_differs boolean, standby boolean, serve_stale boolean,
    owner text, early_refresh_drawn boolean, held_elsewhere boolean) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    AS $$
DECLARE
    stale boolean := serve_stale AND servable_stale;
BEGIN
    IF state IS NULL THEN
        IF held_elsewhere IS NULL THEN
            RETURN 'ask:held_elsewhere';
        END IF;
        RETURN CASE WHEN held_elsewhere THEN 'busy' ELSE 'insert' END;
    END IF;
    IF fingerprint_differs AND (state = 'running' OR fresh OR servable_stale) THEN
        RETURN 'mismatch';
    END IF;
    IF fresh THEN
        IF state = 'done' AND NOT standby THEN
            IF early_refresh_drawn IS NULL THEN
                RETURN 'ask:early_refresh_drawn';
            ELSIF early_refresh_drawn THEN
                IF held_elsewhere IS NULL THEN
                    RETURN 'ask:held_elsewhere';
                ELSIF NOT held_elsewhere THEN
                    RETURN 'early_refresh';
                END IF;
            END IF;
        END IF;
        RETURN 'hit';
    END IF;
    IF state = 'failed' AND retry_later THEN
        RETURN CASE WHEN stale THEN 'stale' ELSE 'failed' END;
    ELSIF state = 'running' THEN
        IF NOT standby AND owner IS NULL THEN
            RETURN 'ask:owner';
        ELSIF standby OR owner = 'alive' THEN
            RETURN CASE WHEN stale THEN 'stale_refreshing' ELSE 'wait' END;
        END IF;
    ELSIF state = 'queued' AND stale THEN
        RETURN 'stale';
    END IF;
    IF stale AND standby THEN
        RETURN 'stale';
    ELSIF held_elsewhere IS NULL THEN
        RETURN 'ask:held_elsewhere';
    ELSIF held_elsewhere THEN
        RETURN CASE WHEN stale THEN 'stale' ELSE 'busy' END;  -- decision::when_held
    END IF;
    RETURN CASE WHEN servable_stale THEN 'take_keep' ELSE 'take' END;
END
$$;

-- claim_key's answer for what a look decided (claim::attempt's arms): `answer` is a
-- decision of claim_decision that answers at once, or 'claimed' (the claim `c` was taken)
-- or 'refreshing' (taken keeping `e`'s result: `refresh`, or `claimed` with the result to
-- a caller without serve_stale). No answer but a claim carries a token.
CREATE OR REPLACE FUNCTION once_internal.claim_answer(
    answer text, e once.entries, c once.claim, owner text, serve_stale boolean) RETURNS once.claim
    LANGUAGE plpgsql IMMUTABLE
    AS $$
BEGIN
    RETURN CASE answer
    WHEN 'busy' THEN ROW('wait', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::once.claim
    WHEN 'mismatch' THEN ROW('mismatch', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::once.claim
    WHEN 'hit' THEN ROW('hit', NULL, e.result, NULL, NULL, NULL, e.attempts, NULL, e.expires_at)::once.claim
    WHEN 'failed' THEN ROW('failed', NULL, NULL, e.error, NULL, NULL, e.attempts, e.retry_at, NULL)::once.claim
    WHEN 'wait' THEN ROW('wait', NULL, NULL, NULL, e.owner, e.lease_expires_at, e.attempts, NULL, NULL)::once.claim
    WHEN 'stale' THEN ROW('stale', NULL, e.result, e.error, NULL, NULL, e.attempts, NULL, e.expires_at)::once.claim
    WHEN 'stale_refreshing' THEN
        ROW('stale', NULL, e.result, e.error, e.owner, e.lease_expires_at, e.attempts, NULL, e.expires_at)::once.claim
    WHEN 'claimed' THEN ROW('claimed', c.token, NULL, NULL, owner, c.lease_expires_at, c.attempts, NULL, NULL)::once.claim
    WHEN 'refreshing' THEN
        ROW(CASE WHEN serve_stale THEN 'refresh' ELSE 'claimed' END, c.token, e.result, NULL,
            owner, c.lease_expires_at, c.attempts, NULL, e.expires_at)::once.claim
    END;
END
$$;

-- One look at the key, claiming it if it may be claimed (claim::attempt): never waits for
-- the owner, and for another transaction's lock at most `budget` (lock_timeout, in a
-- subtransaction: a lost race leaves no lock). claim_decision decides; this observes what
-- it asks and carries the decision out.
CREATE OR REPLACE FUNCTION once_internal.claim_attempt(
    key text, lease interval, owner_pid integer, owner_started timestamptz,
    lease_only boolean, budget interval, serve_stale boolean, fingerprint bytea) RETURNS once.claim
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(claim_attempt.key);
    key text := claim_attempt.key;
    lease interval := claim_attempt.lease;
    owner text := CASE WHEN current_setting('application_name') = '' THEN format('pid %s', pg_backend_pid())
                       ELSE format('%s (pid %s)', current_setting('application_name'), pg_backend_pid()) END;
    owner_pid integer := claim_attempt.owner_pid;
    owner_started timestamptz := claim_attempt.owner_started;
    lease_only boolean := claim_attempt.lease_only;
    fingerprint bytea := claim_attempt.fingerprint;
    owner_role oid := once_internal.caller();
    seen_token bigint;
    seen_state text;
    gone_reason text;
    keep_result boolean;
    e once.entries;
    c once.claim;
    old_timeout text := current_setting('lock_timeout');
    lock_context text;
    table_waited boolean := false;
    -- What the look saw (decision::Seen), and the facts claim_decision asked for.
    found_row boolean;
    fresh boolean;
    servable_stale boolean;
    retry_later boolean;
    differs boolean;
    standby boolean;
    owner_seen text;
    drawn boolean;
    held boolean;
    decision text;
    answer text;
BEGIN
    PERFORM set_config('lock_timeout', greatest(extract(epoch FROM budget) * 1000, 1)::bigint::text, true);
    <<look>>
    LOOP
        BEGIN
            SELECT * INTO e FROM once.entries WHERE once.entries.key_hash = param.key_hash;
            found_row := FOUND;
        EXCEPTION WHEN lock_not_available THEN
            -- The table is locked whole (VACUUM truncating it, DDL): as the table lock an
            -- insert meets below, looked at once more for up to 100 ms with wait => 0,
            -- then answered wait, as the extension's read that finds the table locked.
            -- Costs a subtransaction a look: about 1.5 us.
            IF budget = '0' AND NOT table_waited THEN
                table_waited := true;
                PERFORM set_config('lock_timeout', '100', true);
                CONTINUE look;
            END IF;
            PERFORM set_config('lock_timeout', old_timeout, true);
            RETURN once_internal.claim_answer('busy', NULL, NULL, param.owner, serve_stale);
        END;
        -- Entry::fresh, Entry::servable_stale, Entry::retry_later, Seen::of.
        fresh := e.result IS NOT NULL AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp());
        servable_stale := e.result IS NOT NULL AND NOT fresh AND e.stale_until IS NOT NULL
                          AND e.stale_until > clock_timestamp();
        retry_later := e.state = 'failed' AND e.retry_at IS NOT NULL AND e.retry_at > clock_timestamp();
        differs := e.fingerprint IS NOT NULL AND param.fingerprint IS NOT NULL
                   AND e.fingerprint <> param.fingerprint;
        standby := pg_is_in_recovery();
        owner_seen := NULL;
        drawn := NULL;
        held := NULL;
        answer := NULL;
        <<decide>>
        LOOP
            decision := once_internal.claim_decision(
                CASE WHEN found_row THEN e.state END, fresh, servable_stale, retry_later, differs,
                standby, serve_stale, owner_seen, drawn, held);
            CASE decision
            WHEN 'ask:owner' THEN
                -- claim::Look::owner, with the same rule as rules/owner_gone.sql.
                owner_seen := CASE
                    WHEN e.lease_expires_at <= clock_timestamp() THEN 'lease expired'
                    WHEN NOT e.lease_only AND NOT once_internal.backend_alive(e.owner_pid, e.owner_started)
                        THEN 'backend exited'
                    ELSE 'alive' END;
            WHEN 'ask:early_refresh_drawn' THEN
                drawn := once_internal.draws_early_refresh(e);
            WHEN 'ask:held_elsewhere' THEN
                -- SQL cannot read a row's header (entry::held_elsewhere): the write below
                -- tells, and the decision is asked again with true.
                held := false;
            WHEN 'insert' THEN
                PERFORM once_internal.refuse_writes('claim_key');
                BEGIN
                    {{sql:insert_claim}}
                    INTO c.token, c.lease_expires_at, c.attempts;
                EXCEPTION WHEN lock_not_available THEN
                    -- A wait for another transaction's row (it is inserting the key,
                    -- uncommitted) puts a line naming the row above the statement's in the
                    -- error's context; that line is translated, the statement's text and
                    -- this function's name are not. So when the first line is the
                    -- statement's or the function's, the wait was the table's (its
                    -- extension by a concurrent insert, a LOCK TABLE): it passes in
                    -- moments, and with wait => 0 the insert is tried once more for up to
                    -- 100 ms (PASSING_LOCK_MICROS), as the extension's first look waits.
                    -- Otherwise (a row, or a speculative insertion, which has no context)
                    -- the key is answered at once, as the extension, which reads the
                    -- row's header, does.
                    GET STACKED DIAGNOSTICS lock_context = PG_EXCEPTION_CONTEXT;
                    IF split_part(lock_context, E'\n', 1)
                           ~ '(INSERT INTO once\.entries|once_internal\.claim_attempt\()'
                       AND budget = '0' AND NOT table_waited THEN
                        table_waited := true;
                        PERFORM set_config('lock_timeout', '100', true);
                        CONTINUE look;
                    END IF;
                    held := true;
                    CONTINUE decide;
                END;
                IF c.token IS NULL THEN
                    CONTINUE look;  -- someone else inserted it first: look again
                END IF;
                -- namespace::recheck_key: the insert waited for a create_namespace that
                -- committed meanwhile; if the key is now another role's, the error undoes it.
                PERFORM once_internal.require_key(param.key, 'claim_key');
                answer := 'claimed';
            WHEN 'early_refresh', 'take', 'take_keep' THEN
                PERFORM once_internal.refuse_writes('claim_key');
                seen_token := e.token;
                seen_state := e.state::text;
                keep_result := decision <> 'take';
                gone_reason := CASE WHEN owner_seen <> 'alive' THEN owner_seen END;
                -- An early refresh is one the caller can do without (losing it is a hit):
                -- it never waits for another transaction's lock on the row, as the
                -- extension, which reads the row's header, never does. 1 ms, lock_timeout's
                -- least.
                IF decision = 'early_refresh' THEN
                    PERFORM set_config('lock_timeout', '1', true);
                END IF;
                c := NULL;
                -- In a subtransaction that a lost race rolls back, so that no lock stays
                -- behind (subxact::keep_if).
                BEGIN
                    -- A row to take is locked with SKIP LOCKED first, which tells at once
                    -- whether another transaction holds it: a lock wait, even of 1 ms, a
                    -- loaded machine stretched, and pg_isolation_regress saw the claim
                    -- blocked.
                    IF decision <> 'early_refresh' THEN
                        PERFORM 1 FROM once.entries WHERE once.entries.key_hash = param.key_hash
                            FOR UPDATE SKIP LOCKED;
                        IF NOT FOUND THEN
                            RAISE SQLSTATE '55P03';  -- lock_not_available
                        END IF;
                    END IF;
                    {{sql:take_claim}}
                    INTO c.token, c.lease_expires_at, c.attempts;
                    IF c.token IS NULL THEN
                        RAISE SQLSTATE 'PO1LT';  -- lost: roll the lock back
                    END IF;
                EXCEPTION
                    WHEN lock_not_available THEN
                        IF NOT EXISTS (SELECT 1 FROM once.entries
                                       WHERE once.entries.key_hash = param.key_hash) THEN
                            CONTINUE look;  -- gone since it was read: look again
                        END IF;
                        held := true;
                        CONTINUE decide;
                    WHEN SQLSTATE 'PO1LT' THEN
                        c := NULL;
                END;
                IF c.token IS NOT NULL THEN
                    answer := CASE WHEN keep_result THEN 'refreshing' ELSE 'claimed' END;
                ELSIF decision = 'early_refresh' THEN
                    answer := 'hit';  -- lost the race for it: a hit
                ELSE
                    CONTINUE look;  -- the key changed between our read and our write
                END IF;
            ELSE
                answer := decision;
            END CASE;
            EXIT decide WHEN answer IS NOT NULL;
        END LOOP;
        PERFORM set_config('lock_timeout', old_timeout, true);
        RETURN once_internal.claim_answer(answer, e, c, param.owner, serve_stale);
    END LOOP;
END
$$;
-- Who a claim_key or claim_next call claims for (api::claim_owner, liveness::Owner::from_arg):
-- this session (owner_pid NULL or its own pid), another backend (an owner session), or
-- nobody but the lease (0). On a standby nothing is claimed and a pid names a backend of
-- the primary: the argument is not judged, so that hits are served whatever it says.
CREATE OR REPLACE FUNCTION once_internal.claim_owner(
    owner_pid integer, OUT pid integer, OUT started timestamptz, OUT lease_only boolean)
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    pid_hint constant text := 'Pass the pid that once.owner_session() returned on a connection your process keeps open, 0 to end the claim only when its lease runs out, or NULL for this connection.';
BEGIN
    pid := pg_backend_pid();
    lease_only := false;
    IF pg_is_in_recovery() THEN
        lease_only := true;
        started := clock_timestamp();
        RETURN;
    END IF;
    -- Who the claim is for (liveness::Owner::from_arg).
    IF owner_pid < 0 THEN
        RAISE EXCEPTION 'owner_pid must not be negative, got %', owner_pid
            USING ERRCODE = 'invalid_parameter_value', HINT = pid_hint;
    ELSIF owner_pid = 0 THEN
        lease_only := true;
    ELSIF owner_pid IS NOT NULL AND owner_pid <> pid THEN
        pid := owner_pid;
    END IF;
    IF pid = pg_backend_pid() THEN
        -- This session's start never changes: read once per session, not on every call
        -- (pg_stat_activity builds a snapshot of every backend: about 20 us, a quarter of a
        -- hit's time in the server, measured with 3,000 hits in a DO loop on a loaded machine).
        -- Kept as microseconds since the epoch, which no DateStyle changes.
        started := 'epoch'::timestamptz + nullif(current_setting('once_internal.backend_start', true), '')::bigint
                                          * '1 microsecond'::interval;
        IF started IS NULL THEN
            started := once_internal.backend_started(pid);
            PERFORM set_config('once_internal.backend_start',
                               (extract(epoch FROM started) * 1000000)::bigint::text, false);
        END IF;
    ELSE
        started := once_internal.backend_started(pid);
    END IF;
    IF started IS NULL THEN
        RAISE EXCEPTION 'no backend with pid % is running', pid
            USING ERRCODE = 'invalid_parameter_value', HINT = pid_hint;
    END IF;
END
$$;

-- claim_key gained fingerprint (pg_once 0.3.0): a new signature, so a new function. An
-- earlier edition's claim_key is dropped, and what was granted on it is given to the new
-- one below, as sql/pg_once--0.2.0--0.3.0.sql does for the extension.
CREATE TEMPORARY TABLE pg_once_sql_replaced (signature text, acl aclitem[]) ON COMMIT DROP;
DO $replace$
DECLARE
    old regprocedure := to_regprocedure('once.claim_key(text,interval,interval,integer,boolean)');
BEGIN
    IF old IS NOT NULL THEN
        INSERT INTO pg_once_sql_replaced
            SELECT 'once.claim_key(text,interval,interval,integer,boolean,bytea)',
                   coalesce(p.proacl, acldefault('f', p.proowner))
              FROM pg_proc p WHERE p.oid = old;
        EXECUTE format('DROP FUNCTION %s', old);
    END IF;
END
$replace$;

CREATE OR REPLACE FUNCTION once.claim_key(
    key         text,
    lease       interval DEFAULT '30 seconds',
    wait        interval DEFAULT '0',
    owner_pid   integer DEFAULT NULL,
    serve_stale boolean DEFAULT false,
    fingerprint bytea DEFAULT NULL)
RETURNS once.claim
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer;
    started timestamptz;
    only_lease boolean := false;
    deadline timestamptz;
    nap interval := '5 milliseconds';
    c once.claim;
    h bytea;
    r record;
    seen_token bigint;
BEGIN
    PERFORM once_internal.usable_key(key, 'claim_key');
    PERFORM once_internal.usable_interval(lease, 'lease');
    PERFORM once_internal.usable_interval(wait, 'wait');
    IF serve_stale IS NULL THEN
        RAISE EXCEPTION 'serve_stale must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass true to be answered refresh and stale (see Freshness), false for the four outcomes of pg_once 0.1.';
    END IF;
    SELECT o.pid, o.started, o.lease_only INTO pid, started, only_lease
      FROM once_internal.claim_owner(owner_pid) o;
    -- args::fingerprint: NULL (none), or 1 to 64 bytes (a digest, never the request).
    IF octet_length(fingerprint) NOT BETWEEN 1 AND 64 THEN
        RAISE EXCEPTION '%', CASE WHEN octet_length(fingerprint) = 0 THEN 'fingerprint must not be empty'
                                  ELSE format('fingerprint must be at most 64 bytes, got %s', octet_length(fingerprint)) END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a digest of the request, e.g. sha256(convert_to(method || '' '' || path || '' '' || body, ''UTF8'')) (32 bytes), or NULL to claim without one.';
    END IF;
    IF wait > '0' AND current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION 'claim_key cannot wait inside a REPEATABLE READ or SERIALIZABLE transaction'
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'Call claim_key with wait in its own READ COMMITTED transaction (autocommit), or pass wait => ''0''.';
    END IF;
    -- waiting.rs, by polling: one look, then looks with sleeps between them until wait
    -- runs out. The edition has no latches to be woken by: the sleeps start at 5 ms and
    -- double up to 100 ms (a waiter sees a result at most that late), and hold no lock (a
    -- look that loses takes none with it).
    -- A waiting look is first a read of the key's row by its hash: while it is the same
    -- running claim (same token), within its lease and with its owner alive, the answer
    -- is the same wait, with the row's owner, lease and attempts, and claim_attempt (its
    -- checks, its settings, its subtransaction) is not run. The owner's liveness is then
    -- looked at most every 200 ms (backend_alive, once_internal.waiting). Anything else,
    -- and the last look at the deadline, is claim_attempt's.
    -- waiting.rs claim_key_at_once: with wait => 0, a look that found the key's row held
    -- by another transaction (answered wait, naming nobody) looks again every 10 ms for up
    -- to 100 ms (PASSING_LOCK_MICROS), as such locks pass in moments: answered wait, the
    -- caller would wait for an announcement that may never come. A key another
    -- transaction is inserting is answered at once, as the extension does.
    IF wait = '0' THEN
        deadline := clock_timestamp() + interval '100 milliseconds';
        LOOP
            c := once_internal.claim_attempt(key, lease, pid, started, only_lease, '0', serve_stale,
                                             fingerprint);
            EXIT WHEN c.outcome <> 'wait' OR c.owner IS NOT NULL OR clock_timestamp() >= deadline
                   OR pg_is_in_recovery();
            -- Hashed only here, off the path of every answer given at once.
            h := coalesce(h, once.key_hash(claim_key.key));
            EXIT WHEN NOT EXISTS (SELECT 1 FROM once.entries e WHERE e.key_hash = h);
            PERFORM pg_sleep(0.01);  -- wait::SHORT_POLL_MICROS
        END LOOP;
        RETURN c;
    END IF;
    deadline := clock_timestamp() + wait;
    LOOP
        IF seen_token IS NOT NULL AND clock_timestamp() < deadline THEN
            SELECT e.token, e.state, e.owner, e.lease_expires_at, e.attempts, e.lease_only,
                   e.owner_pid, e.owner_started
              INTO r FROM once.entries e WHERE e.key_hash = h;
            IF FOUND AND r.token = seen_token AND r.state = 'running'
               AND r.lease_expires_at > clock_timestamp()
               AND (r.lease_only OR pg_is_in_recovery()
                    OR once_internal.backend_alive(r.owner_pid, r.owner_started)) THEN
                c.owner := r.owner;
                c.lease_expires_at := r.lease_expires_at;
                c.attempts := r.attempts;
                PERFORM pg_sleep(extract(epoch FROM least(nap, deadline - clock_timestamp())));
                nap := least(nap * 2, '100 milliseconds');
                CONTINUE;
            END IF;
        END IF;
        c := once_internal.claim_attempt(key, lease, pid, started, only_lease,
                                         greatest(deadline - clock_timestamp(), '0'), serve_stale,
                                         fingerprint);
        EXIT WHEN c.outcome <> 'wait' OR clock_timestamp() >= deadline;
        seen_token := NULL;
        IF c.owner IS NOT NULL THEN
            -- A running claim: remember which, for the next looks.
            h := coalesce(h, once.key_hash(key));
            SELECT e.token INTO seen_token FROM once.entries e
             WHERE e.key_hash = h AND e.state = 'running' AND e.owner = c.owner
               AND e.lease_expires_at = c.lease_expires_at;
            PERFORM set_config('once_internal.waiting', 'on', true);
        END IF;
        PERFORM pg_sleep(extract(epoch FROM least(nap, deadline - clock_timestamp())));
        nap := least(nap * 2, '100 milliseconds');
    END LOOP;
    PERFORM set_config('once_internal.waiting', 'off', true);
    RETURN c;
END
$$;

-- once.owner_session: this connection's pid, for claim_key(owner_pid => ...) on other
-- connections (through a pool). As with the extension when not preloaded, any backend's
-- pid may be named, so there is nothing to register: liveness reads pg_stat_activity, and
-- the claims of a closed owner session are taken over by the next caller (or reaped by
-- the next reap_stale), there being no worker to take them back the moment it closes.
CREATE OR REPLACE FUNCTION once.owner_session() RETURNS integer
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN pg_backend_pid();

-- once.get (claim::get): the result claim_key would answer hit with, NULL otherwise (and
-- when this read draws an early refresh, which the session's next claim_key then takes);
-- writes nothing.
CREATE OR REPLACE FUNCTION once.get(key text) RETURNS jsonb
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    e once.entries;
    drawn boolean;
    decision text;
BEGIN
    PERFORM once_internal.usable_key(key, 'get');
    SELECT * INTO e FROM once.entries WHERE once.entries.key_hash = once.key_hash(get.key);
    IF e.result IS NULL OR e.expires_at <= clock_timestamp() THEN
        RETURN NULL;
    END IF;
    -- A fresh result: what claim_key's look decides, but for the claim. Another
    -- transaction's hold on the row cannot be seen from SQL: taken as none here (the
    -- claim_key that takes the owed refresh finds it).
    LOOP
        decision := once_internal.claim_decision(e.state, true, false, false, false,
                                                 pg_is_in_recovery(), false, NULL, drawn, false);
        EXIT WHEN decision <> 'ask:early_refresh_drawn';
        drawn := once_internal.draws_early_refresh(e);
    END LOOP;
    IF decision = 'early_refresh' THEN
        PERFORM set_config('once_internal.owed_early_refresh', e.token::text, false);
        RETURN NULL;
    END IF;
    RETURN e.result;
END
$$;

-- ---- an owner's writes: protocol/resolve.rs ------------------------------------------

CREATE OR REPLACE FUNCTION once.complete_key(
    key    text,
    token  bigint,
    result jsonb,
    ttl    interval DEFAULT NULL,
    stale  interval DEFAULT NULL,
    beta   float8 DEFAULT NULL,
    jitter float8 DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(complete_key.key, 'complete_key'));
    key text := complete_key.key;
    token bigint := once_internal.usable_integer(complete_key.token, 'token');
    result jsonb := complete_key.result;
    ttl interval := complete_key.ttl;
    stale interval := complete_key.stale;
    beta float8 := nullif(complete_key.beta, 0);
    jitter float8 := complete_key.jitter;
    holder oid := once_internal.token_holder();
    draw float8 := random();
    now timestamptz := clock_timestamp();
    ended record;
    queue text;
    owner text;
    claimed_at timestamptz;
BEGIN
    PERFORM once_internal.refuse_writes('complete_key');
    IF result IS NULL THEN
        RAISE EXCEPTION 'result must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Pass the computed value as jsonb; to cache "nothing", pass ''null''::jsonb.';
    END IF;
    PERFORM once_internal.result_size(result, 'result');
    PERFORM once_internal.check_policy(ttl, stale, beta, jitter);
    {{sql:complete}}
    INTO ended;
    IF ended IS NULL THEN
        RETURN false;
    END IF;
    IF ended.queue IS NOT NULL THEN
        queue := ended.queue; owner := ended.owner; claimed_at := ended.claimed_at;
        {{sql:record_completion}};
    END IF;
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION once.fail_key(
    key         text,
    token       bigint,
    error       text,
    retry_after interval DEFAULT '0')
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(fail_key.key, 'fail_key'));
    token bigint := once_internal.usable_integer(fail_key.token, 'token');
    error text := fail_key.error;
    retry_after interval := fail_key.retry_after;
    holder oid := once_internal.token_holder();
BEGIN
    PERFORM once_internal.refuse_writes('fail_key');
    IF error IS NULL THEN
        RAISE EXCEPTION 'error must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Describe what went wrong, e.g. the upstream error message.';
    END IF;
    PERFORM once_internal.within_limit(octet_length(error), 'error', 'once.max_error_size', 16,
        'Record the error''s first lines and keep the whole of it in your logs, or ask an administrator to raise once.max_error_size.');
    PERFORM once_internal.usable_interval(retry_after, 'retry_after');
    {{sql:fail}};
    RETURN FOUND;
END
$$;

-- complete_key for many claims in one statement (queue::complete_many): complete_many.sql
-- locks the keys in key_hash order, so two batches cannot deadlock; its completions
-- record their queue history themselves (rules/completions_recorded.sql).
CREATE OR REPLACE FUNCTION once.complete_keys(
    keys    text[],
    tokens  bigint[],
    results jsonb[],
    ttl     interval DEFAULT NULL,
    stale   interval DEFAULT NULL,
    beta    float8 DEFAULT NULL,
    jitter  float8 DEFAULT NULL)
RETURNS TABLE (key text)
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    hint constant text := 'Pass three arrays of the same length: keys, their tokens, their results.';
    key_hashes bytea[];
    tokens bigint[] := complete_keys.tokens;
    results jsonb[] := complete_keys.results;
    ttl interval := complete_keys.ttl;
    stale interval := complete_keys.stale;
    beta float8 := nullif(complete_keys.beta, 0);
    jitter float8 := complete_keys.jitter;
    holder oid := once_internal.token_holder();
    k text;
    r jsonb;
BEGIN
    PERFORM once_internal.refuse_writes('complete_keys');
    IF keys IS NULL OR tokens IS NULL OR results IS NULL THEN
        RAISE EXCEPTION '% must not be NULL',
            CASE WHEN keys IS NULL THEN 'keys' WHEN tokens IS NULL THEN 'tokens' ELSE 'results' END
            USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    END IF;
    IF coalesce(cardinality(keys), 0) <> coalesce(cardinality(tokens), 0)
       OR coalesce(cardinality(keys), 0) <> coalesce(cardinality(results), 0) THEN
        RAISE EXCEPTION 'keys, tokens and results have %, % and % elements',
            coalesce(cardinality(keys), 0), coalesce(cardinality(tokens), 0), coalesce(cardinality(results), 0)
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    END IF;
    IF array_position(results, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'results[i] must not be NULL' USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    END IF;
    FOREACH r IN ARRAY results LOOP
        PERFORM once_internal.result_size(r, 'a result');
    END LOOP;
    IF array_position(keys, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'keys[i] must not be NULL' USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    END IF;
    FOREACH k IN ARRAY keys LOOP
        PERFORM once_internal.usable_key(k, 'complete_keys');
    END LOOP;
    PERFORM once_internal.usable_integer(t, 'token') FROM unnest(tokens) t;
    PERFORM once_internal.check_policy(ttl, stale, beta, jitter);
    key_hashes := ARRAY(SELECT once.key_hash(k) FROM unnest(keys) k);
    RETURN QUERY
    {{sql:complete_many}};
END
$$;

CREATE OR REPLACE FUNCTION once.heartbeat_key(
    key   text,
    token bigint,
    lease interval DEFAULT '30 seconds')
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(heartbeat_key.key, 'heartbeat_key'));
    token bigint := once_internal.usable_integer(heartbeat_key.token, 'token');
    lease interval := once_internal.usable_interval(heartbeat_key.lease, 'lease');
    holder oid := once_internal.token_holder();
    extended timestamptz;
BEGIN
    PERFORM once_internal.refuse_writes('heartbeat_key');
    {{sql:heartbeat}}
    INTO extended;
    RETURN extended;
END
$$;

CREATE OR REPLACE FUNCTION once.release_key(
    key   text,
    token bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(release_key.key, 'release_key'));
    token bigint := once_internal.usable_integer(release_key.token, 'token');
    holder oid := once_internal.token_holder();
    done integer;
BEGIN
    PERFORM once_internal.refuse_writes('release_key');
    {{sql:release}}
    INTO done;
    RETURN FOUND;
END
$$;

-- ---- reruns and reaping: protocol/rerun.rs, protocol/reap.rs -------------------------

-- invalidate.sql and refresh.sql act on the state their snapshot shows: a key whose run
-- ended between the snapshot and the row lock matches none of their branches. A request
-- must not be lost to that (rerun::until_matched), so each runs again, with a new
-- snapshot, until it matches or the key is absent.
CREATE OR REPLACE FUNCTION once.invalidate_key(key text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(invalidate_key.key, 'invalidate_key'));
    done integer;
BEGIN
    PERFORM once_internal.refuse_writes('invalidate_key');
    LOOP
        {{sql:invalidate}}
        INTO done;
        IF FOUND THEN
            RETURN true;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM once.entries WHERE once.entries.key_hash = param.key_hash) THEN
            RETURN false;
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION once.refresh_key(key text, stale interval DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    key_hash bytea := once.key_hash(once_internal.usable_key(refresh_key.key, 'refresh_key'));
    stale interval := once_internal.usable_interval(refresh_key.stale, 'stale');
    what text;
    queue text;
BEGIN
    PERFORM once_internal.refuse_writes('refresh_key');
    LOOP
        {{sql:refresh}}
        INTO what, queue;
        IF FOUND THEN
            RETURN what;  -- expired, rerun or pending
        END IF;
        IF NOT EXISTS (SELECT 1 FROM once.entries WHERE once.entries.key_hash = param.key_hash) THEN
            RETURN 'absent';
        END IF;
    END LOOP;
END
$$;

-- Claims whose owner is gone, expired results and old history, as reap::reap does. The
-- edition has no worker: pg_cron or the clients call it (docs/sql-edition.md). The
-- history is purged in batches for up to 100 ms (reap.rs, PURGE_BUDGET), keeping
-- once.history_retention (seconds; a row of once.settings here, default 7 days).
CREATE OR REPLACE FUNCTION once.reap_stale()
RETURNS TABLE (reclaimed bigint, expired bigint, history bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
<<param>>
DECLARE
    batch bigint := 10000;
    retention_s float8 := coalesce((SELECT s.value FROM once.settings s WHERE s.name = 'once.history_retention'),
                                   '604800')::float8;
    after timestamptz;
    started timestamptz := clock_timestamp();
    purged bigint;
    last timestamptz;
BEGIN
    PERFORM once_internal.refuse_writes('reap_stale');
    {{sql:reap_gone_owners}};
    GET DIAGNOSTICS reclaimed = ROW_COUNT;
    {{sql:purge_expired}};
    GET DIAGNOSTICS expired = ROW_COUNT;
    history := 0;
    LOOP
        {{sql:purge_history}}
        INTO purged, last;
        history := history + purged;
        after := last;
        EXIT WHEN purged < batch OR clock_timestamp() - started > '100 milliseconds';
    END LOOP;
    RETURN NEXT;
END
$$;

-- The grants of the functions replaced above, on their successors, which finish.sql then
-- treats as existing ones (it closes only new functions to PUBLIC).
DO $grant_again$
DECLARE
    r record;
    g record;
BEGIN
    FOR r IN SELECT signature::regprocedure AS f, acl FROM pg_once_sql_replaced LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', r.f);
        FOR g IN SELECT a.grantee, a.privilege_type, a.is_grantable FROM aclexplode(r.acl) a
                  WHERE a.grantee <> (SELECT proowner FROM pg_proc WHERE oid = r.f) LOOP
            EXECUTE format('GRANT %s ON FUNCTION %s TO %s%s', g.privilege_type, r.f,
                           CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
                           CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
        INSERT INTO pg_once_sql_existing VALUES (r.f);
    END LOOP;
END
$grant_again$;

COMMENT ON FUNCTION once.claim_key(text, interval, interval, integer, boolean, bytea) IS
    'Claim a key or get its cached result, in one round trip (SQL edition: wait polls). outcome is hit, claimed, failed or wait; with serve_stale => true also refresh and stale; with a fingerprint also mismatch.';
COMMENT ON FUNCTION once.owner_session() IS
    'This connection''s pid: claims made on other connections with claim_key(..., owner_pid => that pid) end when this connection closes, as if made on it. Call it on a connection your process keeps open, such as its LISTEN connection.';
COMMENT ON FUNCTION once.get(text) IS
    'The fresh result claim_key would answer hit with, or NULL. Writes nothing.';
COMMENT ON FUNCTION once.complete_key(text, bigint, jsonb, interval, interval, float8, float8) IS
    'Store the result of your claim and wake everyone waiting for the key. Returns false, changing nothing, if token is no longer the key''s current claim.';
COMMENT ON FUNCTION once.complete_keys(text[], bigint[], jsonb[], interval, interval, float8, float8) IS
    'complete_key for many claims in one statement (e.g. what one claim_next(n => 10) call handed out). Returns the keys completed; a claim no longer current is left out.';
COMMENT ON FUNCTION once.fail_key(text, bigint, text, interval) IS
    'Record that your claim failed with error, and wake waiters; claim_key answers failed until retry_after has passed.';
COMMENT ON FUNCTION once.heartbeat_key(text, bigint, interval) IS
    'Extend your claim''s lease to now + lease and return the new expiry; NULL if token is no longer current: stop computing.';
COMMENT ON FUNCTION once.release_key(text, bigint) IS
    'Give your claim back without recording a failure; returns false if token is no longer current.';
COMMENT ON FUNCTION once.invalidate_key(text) IS
    'Forget a key: drop its cached result or failure; a running key keeps its claim and is computed once more when its run ends. Returns false if the key was absent.';
COMMENT ON FUNCTION once.refresh_key(text, interval) IS
    'Have a key computed again, its current result served as stale for stale meanwhile (NULL: not served). Returns expired, rerun (it is running: computed once more when the run ends), pending (queued) or absent.';
COMMENT ON FUNCTION once.reap_stale() IS
    'Take back claims whose owner is gone, delete expired results and old attempt history. The SQL edition has no worker: schedule it with pg_cron, or let the clients call it.';
