INSERT INTO once.entries (key_hash, key, state, token, queue, payload, priority, run_at,
                               max_attempts, enqueued_at)
     VALUES ($key_hash, $key, 'queued', 0, $queue, $payload, $priority,
             coalesce($run_at, clock_timestamp()), $max_attempts, clock_timestamp())
     ON CONFLICT (key_hash) DO NOTHING
