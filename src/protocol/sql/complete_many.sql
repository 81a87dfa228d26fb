-- Each (key, token, result) completes like complete_key; rows are locked in key_hash
-- order first, so two batches (or a batch and invalidate_keys) cannot deadlock.
WITH input AS (
         SELECT i.*, random() AS draw, clock_timestamp() AS now
           FROM unnest($key_hashes::bytea[], $tokens::bigint[], $results::jsonb[])
                    AS i(key_hash, token, result)),
     locked AS (
         SELECT key_hash FROM once.entries
          WHERE key_hash = ANY ($key_hashes) AND state = 'running'
          ORDER BY key_hash
            FOR UPDATE),
     ended AS (
         UPDATE once.entries AS e
            SET {{completed(result=i.result; d=i.)}}
           FROM input i, locked l
          WHERE e.key_hash = ANY ($key_hashes) AND e.key_hash = l.key_hash
            AND e.key_hash = i.key_hash AND e.token = i.token AND e.state = 'running'
            AND {{token_holder(alias=e.)}}
         RETURNING {{ended_attempt_columns}}),
     recorded AS ({{completions_recorded(ended=ended)}}
     )
     SELECT key FROM ended
