-- Claims whose owner is gone become `failed` with retry_at = now: claimable at once, the
-- error recorded and counted, waiters notified by the trigger. Queued keys go back to
-- their queue after a backoff, unless that was their last attempt. SKIP LOCKED: a reaper
-- never waits for anybody, so any number of them can run at the same time.
WITH gone AS (
         SELECT e.key_hash,
                CASE WHEN e.lease_expires_at <= clock_timestamp() THEN 'lease expired'
                     ELSE 'backend exited' END AS why, {{retry_policy}}
           FROM once.entries e LEFT JOIN once.queues q ON q.name = e.queue
          WHERE e.state = 'running' AND {{owner_gone(row=e.)}}
            FOR UPDATE OF e SKIP LOCKED)
     UPDATE once.entries AS e
        SET {{failed_attempt(p=g.; retry_after='0'::interval)}},
            error = {{owner_gone_error(row=e.; why=g.why; how=reaped)}},
            last_outcome = 'abandoned'
       FROM gone g
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM gone)) AND e.key_hash = g.key_hash
