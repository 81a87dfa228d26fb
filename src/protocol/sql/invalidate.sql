-- A key that is not running is forgotten. A running one keeps its claim (cancelling it
-- would let a second computation start beside the first, whose owner does not know): its
-- result, if it kept one, is no longer served, and the run's own result will not be
-- either; when the run ends the key is computed once more (rules/rerun_requested.sql).
WITH running AS (
         UPDATE once.entries
            SET {{rerun_requested(how='discard'; stale=NULL::interval)}}, result = NULL, expires_at = NULL, stale_until = NULL
          WHERE key_hash = $key_hash AND state = 'running'
         RETURNING 1),
     gone AS (
         DELETE FROM once.entries WHERE key_hash = $key_hash AND state <> 'running'
         RETURNING 1)
     SELECT 1 FROM running UNION ALL SELECT 1 FROM gone
