//! once.stats: keys counted by state, and the call counters in shared memory when preloaded.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{one, outcome_and_token, text};
    use pgrx::prelude::*;

    #[pg_test]
    fn stats_counts_keys_by_state() {
        outcome_and_token("running");
        let (_, t) = outcome_and_token("done");
        Spi::run(&format!("SELECT once.complete_key('done', {t}, '1')")).unwrap();
        let (_, t) = outcome_and_token("failed");
        Spi::run(&format!(
            "SELECT once.fail_key('failed', {t}, 'x', '1 hour')"
        ))
        .unwrap();
        let row = one::<String>(
            "SELECT format('%s/%s/%s/%s', queued, running, done, failed) FROM once.stats",
        );
        assert_eq!(row.as_deref(), Some("0/1/1/1"));
    }

    #[pg_test]
    fn preloaded_server_counts_calls_in_shared_memory() {
        // pg_test::postgresql_conf_options preloads pg_once. Other tests run at the same
        // time and count too, hence "more than" rather than "exactly one more".
        assert_eq!(
            one::<bool>("SELECT shared_memory FROM once.stats"),
            Some(true)
        );
        let before = one::<i64>("SELECT claims FROM once.stats").unwrap();
        outcome_and_token("k");
        assert!(one::<i64>("SELECT claims FROM once.stats").unwrap() > before);
        let hits = one::<i64>("SELECT hits FROM once.stats").unwrap();
        let (_, token) = outcome_and_token("k2");
        Spi::run(&format!("SELECT once.complete_key('k2', {token}, '1')")).unwrap();
        outcome_and_token("k2");
        assert!(one::<i64>("SELECT hits FROM once.stats").unwrap() > hits);
    }

    #[pg_test]
    fn every_counter_has_its_column_in_once_stats() {
        // once_internal.runtime() names each counter by the once.stats column that shows it
        // (runtime::shmem::counters); the view reads them by those names. A counter
        // without a column, or a column naming no counter, would show nothing at all.
        let counters = text(
            "SELECT string_agg(k, ',' ORDER BY k) FROM jsonb_object_keys((SELECT counters FROM once_internal.runtime())) k",
        );
        let columns = text(
            "SELECT string_agg(attname, ',' ORDER BY attname) FROM pg_attribute
              WHERE attrelid = 'once.stats'::regclass AND attnum > 0
                AND attname NOT IN ('queued', 'running', 'done', 'failed', 'running_past_lease',
                                    'expired_unpurged', 'oldest_claimed_at', 'errors', 'attempts',
                                    'last_token', 'shared_memory', 'notify', 'workers')",
        );
        assert_eq!(counters, columns);
        assert_eq!(
            one::<bool>("SELECT num_nulls(claims, hits, waits, wakeups, takeovers, completions, failures, releases, invalidations, reaped, purged, notified_direct, notified_relayed) = 0 FROM once.stats"),
            Some(true),
            "every counter column reads a counter"
        );
    }
}
