-- On a hot standby: is replay stopped by a conflict with a backend of this server (a
-- snapshot that the primary's cleanup would break, or a lock or buffer pin that replay
-- needs)? PostgreSQL then waits up to max_standby_streaming_delay for that backend's
-- query to end before cancelling it. A wait event is read live from the process, not from
-- the transaction's copy of pg_stat_activity, so a waiting claim_key that asks again and
-- again sees each change. Run with the extension owner's rights: the startup process's
-- wait event is shown only to roles with pg_read_all_stats.
SELECT EXISTS (
         SELECT FROM pg_catalog.pg_stat_activity a
          WHERE a.backend_type = 'startup'
            AND (a.wait_event IN ('RecoveryConflictSnapshot', 'RecoveryConflictTablespace')
                 OR a.wait_event_type IN ('Lock', 'BufferPin'))) AS waits
