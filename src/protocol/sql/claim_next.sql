-- once_internal.row_taken: see storage::entry::taken.
--
-- A claim reads only due jobs, whatever the queue holds. entries_queue_idx orders a queue
-- by (errors, priority, run_at), and jobs not due sort within each (errors, priority)
-- group after the due ones: so the claim walks the groups in order, one probe each for the
-- group's first entry (`groups`, a loose index scan), and in each takes the due jobs as a
-- range of run_at, up to n in all, locking them as it goes (SKIP LOCKED in the group's
-- scan: a locked job is passed over and the next taken, as in one scan). The outer LIMIT
-- stops it at n: a group after that is never read. The due bound is a scalar subquery,
-- computed once, so that it is an index condition: `run_at <= clock_timestamp()`, volatile,
-- was a filter on the row, and with 200,000 jobs due tomorrow each claim read all 200,000
-- rows (BENCHMARKS.md, "Scale").
WITH RECURSIVE groups AS (
         (SELECT errors, priority FROM once.entries
           WHERE state = 'queued' AND queue = $queue
           ORDER BY errors, priority LIMIT 1)
         UNION ALL
         SELECT n.errors, n.priority
           FROM groups g,
                LATERAL (SELECT errors, priority FROM once.entries
                          WHERE state = 'queued' AND queue = $queue
                            AND (errors, priority) > (g.errors, g.priority)
                          ORDER BY errors, priority LIMIT 1) n),
     now AS (SELECT clock_timestamp() AS due),
     next AS (
         SELECT d.ctid
           FROM groups g,
                LATERAL (SELECT ctid FROM once.entries
                          WHERE state = 'queued' AND queue = $queue
                            AND errors = g.errors AND priority = g.priority
                            AND run_at <= (SELECT due FROM now)
                            AND NOT once_internal.row_taken(ctid)
                          ORDER BY run_at
                          LIMIT $n
                            FOR UPDATE SKIP LOCKED) d
          LIMIT $n)
     UPDATE once.entries AS e
        SET ({{claimant_columns}}) = ({{claimant_values}}),
            attempts = e.attempts + 1
      WHERE e.ctid = ANY (ARRAY(SELECT ctid FROM next))
     RETURNING e.key, e.token, e.payload, e.attempts, e.key_hash
