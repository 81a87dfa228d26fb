-- INSERT appending to once.attempts the attempts that completions ended, read from `{ended}`
-- (a row source with the columns of `ended_attempt_columns!`); keys that were never
-- enqueued have no history.
--
-- Completions record their attempts themselves, right where they end them; the
-- entries_record_attempt trigger (schema.sql) records every other end (failures,
-- releases, takeovers, reaping, cancellation). A row trigger pays a PL/pgSQL call and an
-- INSERT executor for each key: 14% of a queue's server time with batches of 10
-- (bench/profiles/queue.svg). complete_keys records a batch with one INSERT in its own
-- statement; complete_key records a queued key with one more statement, and a cache key,
-- which has no history, costs nothing.
INSERT INTO once.attempts (key_hash, key, queue, token, worker, started_at, outcome)
             SELECT key_hash, key, queue, token, owner, claimed_at, 'completed'
               FROM {ended} WHERE queue IS NOT NULL
