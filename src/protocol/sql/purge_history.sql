-- The oldest history rows past the retention, through the btree on finished_at: a probe
-- of its leftmost entries, whatever the history holds. The cutoff is a scalar subquery,
-- computed once before the scan (an InitPlan) and so usable as an index condition: written
-- `finished_at < clock_timestamp() - ...`, a volatile condition, it is a filter and the
-- planner scanned the whole table instead, 336 ms a round with 2,000,000 rows of history
-- and nothing to purge (BENCHMARKS.md, "Scale"). Not statement_timestamp() or now(): in
-- the worker, which receives no statements, they need not move.
--
-- A call purges several batches in one transaction (reap.rs, PURGE_BUDGET): each starts at the last
-- finished_at the batch before it deleted ($after), or it would walk again, from the left
-- end, over every index entry its own transaction deleted (not yet dead to anyone: the
-- 2,000,000 rows took 4.6 s to purge that way, 2.8 s this way).
WITH purged AS (
         DELETE FROM once.attempts
          WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM once.attempts
                 WHERE finished_at < (SELECT clock_timestamp() - make_interval(secs => $retention_s))
                   AND finished_at >= coalesce($after, '-infinity')
                 ORDER BY finished_at
                 LIMIT $batch))
         RETURNING finished_at)
     SELECT count(*) AS purged, max(finished_at) AS last FROM purged
