-- Claims a key that exists but may be claimed: expired result, failure whose retry time has
-- come, or a claim whose owner is gone ($gone_reason says why; the takeover counts as an
-- error). A refresh ($keep_result) keeps the result, its expiry and its stale window, so
-- that it is served to others while it is recomputed; any other claim drops them. `token = $seen_token AND state = $seen_state` makes the claim conditional on
-- nothing having changed since the key was read, and a running key is taken only if its
-- owner is still gone when the row is locked (a heartbeat may have just extended the
-- lease). Run through subxact::keep_if, so a lost race leaves no lock behind.
-- The new attempt is the request of $fingerprint (NULL: none); a refresh, which serves the
-- kept result meanwhile, keeps the kept result's fingerprint when it is given none, so
-- that a request the result does not answer is still told mismatch (protocol::claim).
UPDATE once.entries
        SET ({{claimant_columns}}) = ({{claimant_values}}),
            attempts = CASE WHEN state = 'done' THEN 1 ELSE attempts + 1 END,
            errors = CASE WHEN state = 'done' THEN 0
                          WHEN state = 'running' THEN errors + 1 ELSE errors END,
            error = CASE WHEN state = 'done' THEN NULL
                         WHEN state = 'running' THEN {{owner_gone_error(row=; why=$gone_reason; how=taken over)}}
                         ELSE error END,
            last_outcome = CASE WHEN state = 'running' THEN 'taken_over' ELSE last_outcome END,
            result = CASE WHEN $keep_result THEN result END,
            expires_at = CASE WHEN $keep_result THEN expires_at END,
            stale_until = CASE WHEN $keep_result THEN stale_until END,
            retry_at = NULL,
            fingerprint = CASE WHEN $keep_result THEN COALESCE($fingerprint, fingerprint)
                               ELSE $fingerprint END
      WHERE key_hash = $key_hash AND token = $seen_token AND state = $seen_state::once.key_state
        AND (state <> 'running' OR {{owner_gone(row=)}})
     RETURNING token, lease_expires_at, attempts
