-- A failure is served to callers until retry_at; a queued key goes back to its queue
-- instead (rules/failed_attempt.sql).
WITH policy AS (
         SELECT e.key_hash, {{retry_policy}}
           FROM once.entries e LEFT JOIN once.queues q ON q.name = e.queue
          WHERE e.key_hash = $key_hash AND e.token = $token AND e.state = 'running'
            AND {{token_holder(alias=e.)}})
     UPDATE once.entries AS e
        SET {{failed_attempt(p=p.; retry_after=$retry_after)}},
            error = $error, last_outcome = 'failed'
       FROM policy p
      WHERE e.key_hash = $key_hash AND e.key_hash = p.key_hash AND e.token = $token
        AND e.state = 'running'
