-- SET list applying a retry_policy row `p` to a failed attempt: a key of no queue is
-- failed and serves its failure for `retry_after`; a queued key goes back to its queue
-- after its backoff (or `retry_after`, if longer), unless it is dead: then it stays
-- failed for good (retry_at = infinity: a dead letter, until enqueued again).
state = CASE WHEN {p}queued_key AND NOT {p}dead THEN 'queued'
                          ELSE 'failed' END::once.key_state,
             retry_at = CASE WHEN NOT {p}queued_key THEN clock_timestamp() + CASE WHEN {p}rerun THEN '0'::interval ELSE {retry_after} END
                             WHEN {p}dead THEN 'infinity' END,
             run_at = CASE WHEN {p}queued_key AND NOT {p}dead
                           THEN clock_timestamp() + CASE WHEN {p}rerun THEN '0'::interval ELSE greatest({retry_after}, {p}backoff) END
                           ELSE e.run_at END,
             attempts = CASE WHEN {p}rerun AND {p}queued_key THEN 0 ELSE e.attempts END,
             rerun = NULL, rerun_stale = NULL,
             errors = e.errors + 1, lease_expires_at = NULL, updated_at = clock_timestamp()
