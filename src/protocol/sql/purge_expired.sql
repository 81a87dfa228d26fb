-- A result in its stale window is still served: it goes when the window does. (stale_until
-- is never before expires_at, so the index on expires_at still finds the candidates.) The
-- bound on expires_at is a scalar subquery, as in purge_history.sql, so that it is an index
-- condition: a volatile one is a filter, and the scan read every result with a future
-- expiry before finding that none had expired.
WITH expired AS (
         SELECT key_hash FROM once.entries
          WHERE expires_at <= (SELECT clock_timestamp()) AND state = 'done'
            AND (stale_until IS NULL OR stale_until <= clock_timestamp())
          ORDER BY expires_at
          LIMIT $batch
            FOR UPDATE SKIP LOCKED)
     DELETE FROM once.entries AS e USING expired
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM expired)) AND e.key_hash = expired.key_hash
