-- After finish.sql (which closes to PUBLIC what this run created): what the views call as
-- their reader is granted to PUBLIC, as the extension grants its may_use_key, runtime,
-- caller_administers and pending_key_counts (sql/functions.sql), with what they call as
-- the installing role. Each tells only what anyone may know (views.sql).
GRANT EXECUTE ON FUNCTION once_internal.view_may_use_key(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.may_use_key_as(name, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.administers_as(name) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.caller_administers() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.runtime() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.pending_key_counts() TO PUBLIC;
