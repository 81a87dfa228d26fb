-- Who may act on a claim with its token (complete, fail, heartbeat, release): the role
-- that made it (`owner_role`), exactly, or anyone when `$holder` is NULL (an
-- administrator: namespace::token_holder), or anyone for a claim older than the column.
-- Tokens come from one sequence, so a role can guess another's from its own; a guess
-- must not let it end or extend another role's claim (docs/security.md). `{alias}` is the
-- table's alias with its dot, or nothing.
({alias}owner_role = $holder OR {alias}owner_role IS NULL OR $holder IS NULL)
