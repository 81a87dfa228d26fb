-- A released key becomes absent, so the next caller claims it as if it were cold (tokens
-- come from a sequence, so deleting the row cannot make an old token valid again); a
-- released refresh goes back to serving the result it kept, and the next caller in its
-- stale window refreshes it. A queued key goes back to its queue, due now, and the
-- attempt does not count.
WITH gone AS (
         DELETE FROM once.entries
          WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND queue IS NULL
            AND result IS NULL AND {{token_holder(alias=)}}
         RETURNING 1),
     kept AS (
         UPDATE once.entries
            SET state = 'done', lease_expires_at = NULL, updated_at = clock_timestamp(),
                last_outcome = 'released', rerun = NULL, rerun_stale = NULL
          WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND queue IS NULL
            AND result IS NOT NULL AND {{token_holder(alias=)}}
         RETURNING 1),
     requeued AS (
         UPDATE once.entries
            SET state = 'queued', attempts = greatest(attempts - 1, 0),
                run_at = clock_timestamp(), lease_expires_at = NULL,
                updated_at = clock_timestamp(), last_outcome = 'released'
          WHERE key_hash = $key_hash AND token = $token AND state = 'running'
            AND queue IS NOT NULL AND {{token_holder(alias=)}}
         RETURNING 1)
     SELECT 1 FROM gone UNION ALL SELECT 1 FROM kept UNION ALL SELECT 1 FROM requeued
