-- What a claim writes, as the columns and the values of a row constructor: the key
-- becomes running under a new token from the one sequence, owned by `$owner` (a label),
-- judged alive by `$owner_pid`/`$owner_started` unless `$lease_only`, until
-- `$lease` from now, made by role `$owner_role` (see token_holder). Pass
-- rules::claimant_params for these six parameters.
state, token, owner, owner_pid, owner_started, lease_only, lease_expires_at, claimed_at, updated_at, rerun, rerun_stale, owner_role
