-- enqueue_keys: enqueue_new.sql, enqueue_again.sql, enqueue_rerun.sql and queue.rs's KEY_STATE for a whole batch,
-- in one statement, each key with its own payload. `locked` locks the keys that exist in
-- key_hash order and reads the latest version of each (FOR UPDATE in READ COMMITTED), and
-- what becomes of a key is decided on that version (l.), not on the statement's snapshot,
-- which a commit since may have outdated. The keys it did not find are then inserted, in
-- key_hash order too: a row passes `NOT IN (... locked)` only once every key is locked, so
-- each call locks, then inserts, each in key_hash order, and two batches cannot wait for
-- each other in a cycle (the module's comment, "Deadlocks"). A key found by neither (not
-- in the snapshot, and inserted meanwhile by a transaction that committed while the INSERT
-- waited for it) has outcome NULL: enqueue_many runs the statement again for those keys
-- alone (`$pending`; NULL: every key), with a snapshot that sees them. Its generic plan
-- must look keys up in the primary key however few rows the table had when it was made:
-- enqueue_keys is declared with enable_seqscan off (sql/functions.sql says why).
WITH input AS (
         SELECT i.* FROM unnest($key_hashes::bytea[], $keys::text[], $payloads::jsonb[])
                             WITH ORDINALITY AS i(key_hash, key, payload, ord)
          WHERE $pending::bigint[] IS NULL OR i.ord = ANY ($pending)),
     locked AS (
         SELECT key_hash, state, expires_at FROM once.entries
          WHERE key_hash = ANY ($pending_hashes::bytea[])
          ORDER BY key_hash
            FOR UPDATE),
     again AS (
         UPDATE once.entries AS e
            SET state = 'queued', queue = $queue, payload = i.payload, priority = $priority,
                run_at = coalesce($run_at, clock_timestamp()), max_attempts = $max_attempts,
                enqueued_at = clock_timestamp(), attempts = 0, retry_at = NULL,
                updated_at = clock_timestamp()
           FROM input i, locked l
          WHERE e.key_hash = ANY ($pending_hashes) AND e.key_hash = l.key_hash
            AND e.key_hash = i.key_hash
            AND (l.state = 'failed'
                 OR (l.state = 'done' AND ($refresh OR l.expires_at <= clock_timestamp())))
         RETURNING e.key_hash),
     rerun AS (
         UPDATE once.entries AS e
            SET queue = $queue, payload = i.payload, priority = $priority,
                max_attempts = $max_attempts, {{rerun_requested(how='keep'; stale=NULL::interval)}}
           FROM input i, locked l
          WHERE e.key_hash = ANY ($pending_hashes) AND e.key_hash = l.key_hash
            AND e.key_hash = i.key_hash AND l.state = 'running' AND $refresh
         RETURNING e.key_hash),
     new AS (
         INSERT INTO once.entries (key_hash, key, state, token, queue, payload, priority,
                                   run_at, max_attempts, enqueued_at)
         SELECT i.key_hash, i.key, 'queued', 0, $queue, i.payload, $priority,
                coalesce($run_at, clock_timestamp()), $max_attempts, clock_timestamp()
           FROM input i
          WHERE i.key_hash NOT IN (SELECT key_hash FROM locked)
          ORDER BY i.key_hash
         ON CONFLICT (key_hash) DO NOTHING
         RETURNING key_hash)
     SELECT i.ord,
            CASE WHEN n.key_hash IS NOT NULL THEN 'queued'
                 WHEN a.key_hash IS NOT NULL OR r.key_hash IS NOT NULL THEN 'requeued'
                 WHEN l.state = 'done' THEN 'cached'
                 WHEN l.key_hash IS NOT NULL THEN 'duplicate'
            END AS outcome,
            n.key_hash IS NOT NULL OR a.key_hash IS NOT NULL AS due
       FROM input i
       LEFT JOIN new n ON n.key_hash = i.key_hash
       LEFT JOIN again a ON a.key_hash = i.key_hash
       LEFT JOIN rerun r ON r.key_hash = i.key_hash
       LEFT JOIN locked l ON l.key_hash = i.key_hash
