-- A running key enqueued with refresh is neither left alone (the request would be lost)
-- nor queued beside its run (two computations at once): it goes back to the queue when
-- the run ends, with this payload, whose result is served meanwhile (rules/completed.sql).
UPDATE once.entries
        SET queue = $queue, payload = $payload, priority = $priority,
            max_attempts = $max_attempts, {{rerun_requested(how='keep'; stale=NULL::interval)}}
      WHERE key_hash = $key_hash AND state = 'running' AND $refresh
