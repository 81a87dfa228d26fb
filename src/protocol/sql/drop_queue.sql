-- drop_queue, once queue::drop_queue has found it empty and the caller allowed.
DELETE FROM once.queues WHERE name = $name
