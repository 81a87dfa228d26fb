-- create_queue: a new queue, or a changed policy or namespace of an existing one
-- (queue::upsert_queue decides who may).
INSERT INTO once.queues (name, max_attempts, backoff, max_backoff, namespace)
     VALUES ($name, $max_attempts, $backoff, $max_backoff, $namespace)
     ON CONFLICT (name) DO UPDATE
        SET max_attempts = EXCLUDED.max_attempts, backoff = EXCLUDED.backoff,
            max_backoff = EXCLUDED.max_backoff, namespace = EXCLUDED.namespace
