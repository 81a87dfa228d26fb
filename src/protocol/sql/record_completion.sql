-- The history of a queued key that complete_key completed (rules/completions_recorded.sql).
{{completions_recorded(ended=(SELECT $key_hash::bytea, $key::text, $queue::text, $token::bigint, $owner::text,
             $claimed_at::timestamptz) AS ended (key_hash, key, queue, token, owner, claimed_at))}}
