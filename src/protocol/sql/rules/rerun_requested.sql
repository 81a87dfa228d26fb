-- SET list recording a request to compute a running key once more when its run ends
-- (refresh_key, invalidate_key, enqueue_key with refresh). `{how}` says what becomes of
-- the run's result: `keep` (served as completed: a queued key's previous result while it
-- is processed again), `stale` (served as stale for `{stale}`) or `discard` (not served).
-- However many requests arrive they make one rerun: the strictest `how` wins, and the
-- shortest stale window.
rerun = CASE WHEN 'discard' IN (rerun, {how}) THEN 'discard'
                          WHEN 'stale' IN (rerun, {how}) THEN 'stale' ELSE 'keep' END,
             rerun_stale = least(CASE WHEN rerun = 'stale' THEN rerun_stale END,
                                 CASE WHEN {how} = 'stale' THEN {stale} END),
             updated_at = clock_timestamp()
