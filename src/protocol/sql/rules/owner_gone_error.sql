-- The error recorded when a claim whose owner is gone ends: `{how}` is "taken over" or
-- "reaped", `why` an expression saying what made the owner count as gone.
format('owner %s (token %s) is gone: %s; claim {how}', {row}owner, {row}token, {why})
