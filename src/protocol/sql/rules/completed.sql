-- SET list of a completed claim (of `once.entries e`): `{result}` (an expression) is
-- fresh until `$ttl` from now, shortened by up to `$jitter` of it (`draw`, a random
-- number in [0, 1), and `now` come from the row source `{d}`), then served as stale for
-- `$stale` more; NULL ttl: fresh until invalidated. `$beta` is kept for early refreshes,
-- and the time since the claim as the computation's length (protocol::freshness).
--
-- A rerun requested during the run (rerun_requested) is carried out here: the result is
-- stored, but it expires at once (served as stale for rerun_stale, or not at all:
-- `discard`; `keep`: as completed) and a queued key goes back to its queue, due now, so
-- that the key is computed once more.
state = CASE WHEN e.rerun IS NOT NULL AND e.queue IS NOT NULL THEN 'queued'
                          ELSE 'done' END::once.key_state,
            result = {result},
            expires_at = CASE WHEN e.rerun IN ('discard', 'stale') THEN {d}now
                              ELSE {d}now + $ttl * (1 - coalesce($jitter, 0) * {d}draw) END,
            stale_until = CASE WHEN e.rerun = 'discard' THEN NULL
                               WHEN e.rerun = 'stale' THEN {d}now + e.rerun_stale
                               ELSE {d}now + $ttl * (1 - coalesce($jitter, 0) * {d}draw) + $stale END,
            beta = $beta, compute_time = {d}now - e.claimed_at,
            run_at = CASE WHEN e.rerun IS NOT NULL AND e.queue IS NOT NULL THEN {d}now ELSE e.run_at END,
            attempts = CASE WHEN e.rerun IS NOT NULL AND e.queue IS NOT NULL THEN 0
                            ELSE e.attempts END,
            rerun = NULL, rerun_stale = NULL,
            completed_at = {d}now, updated_at = {d}now,
            lease_expires_at = NULL, error = NULL, retry_at = NULL,
            last_outcome = 'completed'
