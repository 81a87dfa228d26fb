-- A running claim's owner is gone: its lease ran out, or (unless its claim is lease-only)
-- the backend it names is no longer the one that made the claim (once_internal.backend_alive).
-- The same test, made from Rust on a row already read, is claim::Look::owner.
({row}lease_expires_at <= clock_timestamp() OR (NOT {row}lease_only AND NOT once_internal.backend_alive({row}owner_pid, {row}owner_started)))
