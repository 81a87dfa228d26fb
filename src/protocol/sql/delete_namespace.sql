-- drop_namespace, once protocol::namespace::remove has found it without keys and queues.
DELETE FROM once_internal.namespace_owners WHERE prefix = $prefix
