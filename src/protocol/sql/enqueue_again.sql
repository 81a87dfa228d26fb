-- A key that failed for good, whose result expired, or (with refresh) whose result is
-- still fresh, goes back in the queue with a new budget of attempts. A fresh result stays
-- and is served until the new one lands; errors are kept, so a key that keeps failing
-- stays behind healthier ones. (A running key asked to refresh: enqueue_rerun.sql.)
UPDATE once.entries
        SET state = 'queued', queue = $queue, payload = $payload, priority = $priority,
            run_at = coalesce($run_at, clock_timestamp()), max_attempts = $max_attempts,
            enqueued_at = clock_timestamp(), attempts = 0, retry_at = NULL,
            updated_at = clock_timestamp()
      WHERE key_hash = $key_hash
        AND (state = 'failed'
             OR (state = 'done' AND ($refresh OR expires_at <= clock_timestamp())))
