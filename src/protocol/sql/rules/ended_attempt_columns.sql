-- The columns a completing UPDATE returns (`RETURNING`, of `once.entries e`) for
-- `completions_recorded!`. A completion changes none of them, so the new row's values are
-- the attempt's own.
e.key_hash, e.key, e.queue, e.token, e.owner, e.claimed_at
