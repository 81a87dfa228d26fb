-- refresh_key: expire a result now (served as stale for $stale, if given), make a failure
-- claimable now, send a queued key's result back to its queue, or, on a running key,
-- request one more run after this one. Answers what it did.
WITH running AS (
         UPDATE once.entries
            SET {{rerun_requested(how=CASE WHEN $stale::interval IS NULL THEN 'discard' ELSE 'stale' END; stale=$stale)}}
          WHERE key_hash = $key_hash AND state = 'running'
         RETURNING 'rerun'::text AS what, queue),
     resolved AS (
         UPDATE once.entries
            SET expires_at = least(coalesce(expires_at, clock_timestamp()), clock_timestamp()),
                stale_until = clock_timestamp() + $stale,
                retry_at = CASE WHEN state = 'failed' THEN clock_timestamp() END,
                state = CASE WHEN queue IS NULL THEN state ELSE 'queued' END,
                run_at = CASE WHEN queue IS NULL THEN run_at ELSE clock_timestamp() END,
                attempts = CASE WHEN queue IS NULL THEN attempts ELSE 0 END,
                enqueued_at = CASE WHEN queue IS NULL THEN enqueued_at ELSE clock_timestamp() END,
                updated_at = clock_timestamp()
          WHERE key_hash = $key_hash AND state IN ('done', 'failed')
         RETURNING 'expired'::text AS what, queue),
     queued AS (
         SELECT 'pending'::text AS what, queue FROM once.entries
          WHERE key_hash = $key_hash AND state = 'queued')
     SELECT what, queue FROM running UNION ALL SELECT what, queue FROM resolved
     UNION ALL SELECT what, queue FROM queued
