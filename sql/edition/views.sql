-- The views of the SQL edition (docs/sql-edition.md): once.stats, once.queue_stats,
-- once.dead_letters, once.keys and once.namespaces are sql/functions.sql's own views, taken from
-- there by scripts/sql_edition_tle.py, with their comments. What they call that is C in
-- the extension is declared here, and so are the counts of keys once.stats sums
-- (once_internal.key_counts, sql/schema.sql's table), kept by triggers as in the
-- extension, in PL/pgSQL.
--
-- The views call functions as the role reading them (PostgreSQL checks a view's tables as
-- the view's owner, its functions' EXECUTE as the reader, and runs them as the reader).
-- The edition's may_use_key reads once_internal.namespace_owners, which a reader may not,
-- and judges once_internal.caller(): the views call view_may_use_key instead, SECURITY
-- INVOKER, whose current_user is the reader, and which hands it to may_use_key_as, run as
-- the installing role. A caller of may_use_key_as may name any role: it tells only what
-- pg_has_role and once.namespaces tell anyone (whether that role may use a key), and sets
-- once_internal.caller for its own transaction, which every implementation of once.*
-- sets again before reading it (once_internal.vouch). The same for caller_administers.
-- These and runtime and pending_key_counts are granted to PUBLIC (late in the script:
-- views_grants.sql), as the extension grants its four.

CREATE OR REPLACE FUNCTION once_internal.may_use_key_as(reader name, key text) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    PERFORM set_config('once_internal.caller', coalesce(to_regrole(quote_ident(reader))::oid, 0)::text, true),
            set_config('once_internal.borrowed', once_internal.borrowed(reader), true);
    RETURN once_internal.may_use_key(key);
END
$$;

CREATE OR REPLACE FUNCTION once_internal.view_may_use_key(key text) RETURNS boolean
    LANGUAGE sql STABLE SECURITY INVOKER PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    RETURN once_internal.may_use_key_as(current_user, key);

CREATE OR REPLACE FUNCTION once_internal.administers_as(reader name) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    PERFORM set_config('once_internal.caller', coalesce(to_regrole(quote_ident(reader))::oid, 0)::text, true),
            set_config('once_internal.borrowed', once_internal.borrowed(reader), true);
    RETURN once_internal.administers();
END
$$;

-- Whether the reader administers pg_once here (a superuser, or a member of the role that
-- installed it): once.stats shows last_token only then (or to pg_monitor's members).
CREATE OR REPLACE FUNCTION once_internal.caller_administers() RETURNS boolean
    LANGUAGE sql STABLE SECURITY INVOKER PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    RETURN once_internal.administers_as(current_user);

-- How pg_once runs here: never in shared memory, keys announced by the committing
-- transaction's own NOTIFY (the triggers' pg_notify), no pg_once worker (reap_stale runs
-- when scheduled: docs/sql-edition.md), and no counters (NULL, as the extension's when
-- not preloaded).
CREATE OR REPLACE FUNCTION once_internal.runtime()
    RETURNS TABLE (shared_memory boolean, notify text, workers integer, counters jsonb)
    LANGUAGE sql STABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
    RETURN (false, 'direct'::text, 0, NULL::jsonb);

-- Nothing is pending here: the edition writes each statement's change of the counts
-- into key_counts at once (count_keys, below), visible to its own transaction, which the
-- extension keeps in backend memory until commit. Kept for the view's text.
CREATE OR REPLACE FUNCTION once_internal.pending_key_counts()
    RETURNS TABLE (namespace text, queued bigint, done bigint, failed bigint, errors bigint,
                   attempts bigint)
    LANGUAGE sql STABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
    AS 'SELECT NULL::text, 0::bigint, 0::bigint, 0::bigint, 0::bigint, 0::bigint WHERE false';

-- ---- the counts of keys (src/protocol/counts.rs in PL/pgSQL) ------------------------

-- What a key's counts are kept under (counts::label): its namespace's prefix ('' for
-- none), followed for a once.cached key by a once.cached key of its role with a digest
-- of zeros, so that once.stats' filter shows them only to who may use the key.
CREATE OR REPLACE FUNCTION once_internal.key_count_label(key text) RETURNS text
    LANGUAGE sql STABLE STRICT PARALLEL RESTRICTED
    SET search_path = pg_catalog, pg_temp
    RETURN coalesce(once_internal.key_namespace(key), '')
           || coalesce('#cached:' || once_internal.cached_key_role(key)::text || ':' || repeat('0', 64), '');

-- The slot of key_counts this transaction writes its changes into, chosen once per
-- transaction (kept in the transaction-local setting once_internal.counts_slot):
-- - READ COMMITTED: this backend's pid, so that two backends never wait for each
--   other's counts (the extension uses the backend's number, which SQL cannot see), and
--   a transaction updates its one row in place (HOT: fillfactor 50, no index on the
--   counters), which page pruning cleans up without VACUUM;
-- - REPEATABLE READ or SERIALIZABLE: a slot of the transaction's own, from its id (as
--   counts::transaction_slot), which no other transaction updates: such a transaction
--   may not update a row that another one (a fold) changed after its snapshot (40001);
-- - while a prepared transaction exists (pg_prepared_xact(), read only when
--   max_prepared_transactions > 0), the transaction's own as well: a prepared
--   transaction keeps its rows locked after its backend moved on, and this backend's
--   next write to the same slot would wait for it. Not whenever prepared transactions
--   are merely allowed: a slot per transaction is a row inserted and a row deleted per
--   transaction, and between two autovacuums their dead index entries made every fold
--   slower (8 clients' cycles fell from 535/s to 259/s within a minute, 2026-12-02,
--   bench/edition/drift.sh).
-- A READ COMMITTED transaction then folds into its slot the rows no transaction holds
-- of the transactions' own slots (below -1: committed ones; nobody writes them again),
-- at most 64 of them, oldest slot numbers first, through the primary key (a plain index
-- scan, which marks the dead entries it passes so that the next scan skips them; a
-- bitmap scan never does), and, on the session's first write, those of backends that
-- are gone: the rows once.stats sums stay about as many as there are namespaces times
-- backends running, without any reaping (the extension folds in its worker's
-- reap_stale). SKIP LOCKED: a fold never waits, and nothing waits for a fold but a new
-- backend that got a gone one's pid, until the folding transaction ends.
CREATE OR REPLACE FUNCTION once_internal.counts_slot() RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
#variable_conflict use_column
DECLARE
    chosen text := current_setting('once_internal.counts_slot', true);
    my_slot integer;
    read_committed boolean := current_setting('transaction_isolation') = 'read committed';
    first_write boolean;
BEGIN
    -- A setting anyone may SET: taken only if it names this backend's slot or this
    -- transaction's, so that nobody can write (and hold) another session's counts row.
    IF chosen ~ '^-?[0-9]{1,10}$' AND (chosen::bigint = pg_backend_pid()
                                       OR chosen::bigint = -2 - (txid_current() & 1073741823)) THEN
        RETURN chosen::integer;
    END IF;
    IF read_committed AND (current_setting('max_prepared_transactions')::integer = 0
                           OR NOT EXISTS (SELECT 1 FROM pg_prepared_xact() p)) THEN
        my_slot := pg_backend_pid();
    ELSE
        my_slot := -2 - (txid_current() & 1073741823)::integer;
    END IF;
    IF read_committed THEN
        first_write := current_setting('once_internal.counts_session', true)
                       IS DISTINCT FROM pg_backend_pid()::text;
        WITH folded AS (
            DELETE FROM once_internal.key_counts k
             WHERE k.ctid = ANY (ARRAY(SELECT c.ctid FROM once_internal.key_counts c
                                        WHERE c.slot < -1 AND c.slot <> my_slot
                                        ORDER BY c.slot LIMIT 64
                                          FOR UPDATE SKIP LOCKED)
                                 || ARRAY(SELECT c.ctid FROM once_internal.key_counts c
                                           WHERE first_write AND c.slot > 0 AND c.slot <> my_slot
                                             AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = c.slot)
                                             FOR UPDATE SKIP LOCKED))
            RETURNING k.namespace, k.queued, k.done, k.failed, k.errors, k.attempts)
        INSERT INTO once_internal.key_counts AS c (slot, namespace, queued, done, failed, errors, attempts)
        SELECT my_slot, f.namespace, sum(f.queued), sum(f.done), sum(f.failed), sum(f.errors), sum(f.attempts)
          FROM folded f GROUP BY f.namespace
        ON CONFLICT (slot, namespace) DO UPDATE
           SET queued = c.queued + excluded.queued, done = c.done + excluded.done,
               failed = c.failed + excluded.failed, errors = c.errors + excluded.errors,
               attempts = c.attempts + excluded.attempts;
        IF first_write THEN
            PERFORM set_config('once_internal.counts_session', pg_backend_pid()::text, false);
        END IF;
    END IF;
    PERFORM set_config('once_internal.counts_slot', my_slot::text, true);
    RETURN my_slot;
END
$$;

-- Statement triggers on once.entries (one per event: PostgreSQL allows transition tables
-- only on single-event triggers): each statement's change of the counts, by label, is
-- added to this transaction's slot in one upsert. Running keys are not counted (once.stats
-- counts them from their rows, through their partial index), and a key whose state,
-- errors and attempts did not change (a heartbeat) adds nothing: only the keys that
-- changed a count have their label computed.
CREATE OR REPLACE FUNCTION once_internal.count_keys() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    AS $$
#variable_conflict use_column
DECLARE
    labels text[];
    qs bigint[];
    ds bigint[];
    fs bigint[];
    es bigint[];
    as_ bigint[];
    my_slot integer;
BEGIN
    -- One branch per event: each names only the transition tables its trigger has.
    IF TG_OP = 'INSERT' THEN
        SELECT array_agg(l.label), array_agg(l.q), array_agg(l.d), array_agg(l.f), array_agg(l.e), array_agg(l.a)
          INTO labels, qs, ds, fs, es, as_
          FROM (SELECT once_internal.key_count_label(n.key) AS label,
                       count(*) FILTER (WHERE n.state = 'queued') AS q,
                       count(*) FILTER (WHERE n.state = 'done') AS d,
                       count(*) FILTER (WHERE n.state = 'failed') AS f,
                       sum(n.errors) AS e, sum(n.attempts) AS a
                  FROM new_rows n WHERE n.state <> 'running' GROUP BY 1) l;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT array_agg(l.label), array_agg(-l.q), array_agg(-l.d), array_agg(-l.f), array_agg(-l.e), array_agg(-l.a)
          INTO labels, qs, ds, fs, es, as_
          FROM (SELECT once_internal.key_count_label(o.key) AS label,
                       count(*) FILTER (WHERE o.state = 'queued') AS q,
                       count(*) FILTER (WHERE o.state = 'done') AS d,
                       count(*) FILTER (WHERE o.state = 'failed') AS f,
                       sum(o.errors) AS e, sum(o.attempts) AS a
                  FROM old_rows o WHERE o.state <> 'running' GROUP BY 1) l;
    ELSE
        SELECT array_agg(l.label), array_agg(l.q), array_agg(l.d), array_agg(l.f), array_agg(l.e), array_agg(l.a)
          INTO labels, qs, ds, fs, es, as_
          FROM (SELECT once_internal.key_count_label(k.key) AS label,
                       sum(k.q) AS q, sum(k.d) AS d, sum(k.f) AS f, sum(k.e) AS e, sum(k.a) AS a
                  FROM (SELECT r.key,
                               sum(r.sign) FILTER (WHERE r.state = 'queued') AS q,
                               sum(r.sign) FILTER (WHERE r.state = 'done') AS d,
                               sum(r.sign) FILTER (WHERE r.state = 'failed') AS f,
                               sum(r.sign * r.errors) AS e, sum(r.sign * r.attempts) AS a
                          FROM (SELECT o.key, o.state, o.errors, o.attempts, -1 AS sign
                                  FROM old_rows o WHERE o.state <> 'running'
                                UNION ALL
                                SELECT n.key, n.state, n.errors, n.attempts, 1
                                  FROM new_rows n WHERE n.state <> 'running') r
                         GROUP BY r.key) k
                 WHERE coalesce(k.q, 0) <> 0 OR coalesce(k.d, 0) <> 0 OR coalesce(k.f, 0) <> 0
                    OR k.e <> 0 OR k.a <> 0
                 GROUP BY 1) l;
    END IF;
    IF labels IS NOT NULL THEN
        -- Before the upsert: counts_slot may fold rows of key_counts itself.
        my_slot := once_internal.counts_slot();
        INSERT INTO once_internal.key_counts AS c (slot, namespace, queued, done, failed, errors, attempts)
        SELECT my_slot, u.label, coalesce(u.q, 0), coalesce(u.d, 0),
               coalesce(u.f, 0), coalesce(u.e, 0), coalesce(u.a, 0)
          FROM unnest(labels, qs, ds, fs, es, as_) AS u(label, q, d, f, e, a)
        ON CONFLICT (slot, namespace) DO UPDATE
           SET queued = c.queued + excluded.queued, done = c.done + excluded.done,
               failed = c.failed + excluded.failed, errors = c.errors + excluded.errors,
               attempts = c.attempts + excluded.attempts;
    END IF;
    RETURN NULL;
END
$$;

-- once.entries was truncated: no key is left (the extension's write_key_counts).
CREATE OR REPLACE FUNCTION once_internal.forget_key_counts() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    DELETE FROM once_internal.key_counts;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER entries_count_inserted
    AFTER INSERT ON once.entries REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.count_keys();
CREATE OR REPLACE TRIGGER entries_count_updated
    AFTER UPDATE ON once.entries REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.count_keys();
CREATE OR REPLACE TRIGGER entries_count_deleted
    AFTER DELETE ON once.entries REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.count_keys();
CREATE OR REPLACE TRIGGER entries_truncated_count
    AFTER TRUNCATE ON once.entries
    FOR EACH STATEMENT EXECUTE FUNCTION once_internal.forget_key_counts();

-- Count every key again (counts::recount): after the namespaces change (the trigger
-- namespace_owners_recount, from sql/schema.sql, calls it), or by hand, as the
-- installing role, after writing once.entries with triggers disabled. Writers of
-- once.entries wait until the transaction ends. Not SECURITY DEFINER, and not granted.
CREATE OR REPLACE FUNCTION once_internal.recount_keys() RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    LOCK TABLE once.entries IN SHARE MODE;
    LOCK TABLE once_internal.key_counts IN EXCLUSIVE MODE;
    DELETE FROM once_internal.key_counts;
    INSERT INTO once_internal.key_counts (slot, namespace, queued, done, failed, errors, attempts)
    SELECT -1, n.label, count(*) FILTER (WHERE n.state = 'queued'),
           count(*) FILTER (WHERE n.state = 'done'), count(*) FILTER (WHERE n.state = 'failed'),
           sum(n.errors), sum(n.attempts)
      FROM (SELECT once_internal.key_count_label(e.key) AS label, e.state, e.errors, e.attempts
              FROM once.entries e WHERE e.state <> 'running') n
     GROUP BY n.label;
END
$$;
