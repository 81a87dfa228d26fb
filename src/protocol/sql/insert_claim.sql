INSERT INTO once.entries (key_hash, key, attempts, {{claimant_columns}})
     VALUES ($key_hash, $key, 1, {{claimant_values}})
     ON CONFLICT (key_hash) DO NOTHING
     RETURNING token, lease_expires_at, attempts
