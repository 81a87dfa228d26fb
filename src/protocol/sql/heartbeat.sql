UPDATE once.entries
        SET lease_expires_at = clock_timestamp() + $lease, updated_at = clock_timestamp()
      WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND {{token_holder(alias=)}}
     RETURNING lease_expires_at
