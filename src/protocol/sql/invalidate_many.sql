-- Locks in key_hash order (the ORDER BY sits below the row locking), then deletes. Only
-- keys the caller may use (namespaces): may_use_key answers from memory.
WITH doomed AS (
         SELECT key_hash FROM once.entries
          WHERE ($queue::text IS NULL OR queue = $queue)
            AND ($prefix::text IS NULL OR left(key, length($prefix)) = $prefix)
            AND once_internal.may_use_key(key)
          ORDER BY key_hash
            FOR UPDATE)
     DELETE FROM once.entries AS e USING doomed
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM doomed)) AND e.key_hash = doomed.key_hash
