-- Columns of the retry policy of a key whose attempt failed, for a query over
-- `once.entries e LEFT JOIN once.queues q ON q.name = e.queue`:
-- - queued_key: it belongs to a queue, so it goes back there rather than serving the
--   failure;
-- - dead: that was its last attempt (max_attempts of the key, else of its queue);
-- - backoff: backoff * 2^(attempts - 1), capped at max_backoff, jittered to between half
--   and all of that (see once.create_queue).
-- - rerun: a recompute was requested during the attempt (rerun_requested): the key is
--   due (or claimable) again at once, with a new budget of attempts.
e.queue IS NOT NULL AS queued_key,
         e.rerun IS NOT NULL AS rerun,
         e.rerun IS NULL AND e.attempts >= coalesce(e.max_attempts, q.max_attempts, 1) AS dead,
         CASE WHEN e.rerun IS NOT NULL THEN '0'::interval
              ELSE least(q.max_backoff, q.backoff * power(2, greatest(e.attempts - 1, 0)))
                   * (0.5 + random() / 2) END AS backoff
