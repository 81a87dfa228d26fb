-- After finish.sql (which closes to PUBLIC what this run created): what the views call as
-- their reader is granted to PUBLIC, as the extension grants its may_use_key, runtime,
-- caller_administers and pending_key_counts (sql/functions.sql). Nobody has USAGE on
-- once_internal, so nobody can call them but through the views, and each only tells the
-- reader about itself (views.sql).
GRANT EXECUTE ON FUNCTION once_internal.view_may_use_key(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.caller_administers() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.runtime() TO PUBLIC;
GRANT EXECUTE ON FUNCTION once_internal.pending_key_counts() TO PUBLIC;
