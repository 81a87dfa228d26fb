-- Claims a key nobody has: its first attempt, with the request's fingerprint ($fingerprint,
-- NULL without one), which later claims are compared with (protocol::claim, Fingerprint).
INSERT INTO once.entries (key_hash, key, attempts, fingerprint, {{claimant_columns}})
     VALUES ($key_hash, $key, 1, $fingerprint, {{claimant_values}})
     ON CONFLICT (key_hash) DO NOTHING
     RETURNING token, lease_expires_at, attempts
