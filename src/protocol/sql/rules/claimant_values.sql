-- The values of claimant_columns, in its order.
'running', once_internal.next_token(), $owner, $owner_pid, $owner_started, $lease_only, clock_timestamp() + $lease, clock_timestamp(), clock_timestamp(), NULL, NULL, $owner_role
