-- create_namespace: a new namespace, or a new owner or payload of an existing one
-- (protocol::namespace::create has dealt with the keys that change hands).
INSERT INTO once_internal.namespace_owners (prefix, owner, notify)
     VALUES ($prefix, $owner::regrole, $notify)
     ON CONFLICT (prefix) DO UPDATE SET owner = EXCLUDED.owner, notify = EXCLUDED.notify
