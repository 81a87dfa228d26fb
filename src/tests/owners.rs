//! Owners that go away: exited backends, expired leases, reused pids, lease-only claims,
//! waiting for an owner, takeover and reap_stale.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{answer, kill_owner, one, outcome_and_token, state_of};
    use pgrx::prelude::*;

    #[pg_test]
    fn claim_of_an_exited_owner_is_taken_over_at_once() {
        let (_, token) = outcome_and_token("k");
        kill_owner("k");
        let (outcome, new_token) = outcome_and_token("k");
        assert_eq!(outcome, "claimed");
        assert!(new_token > token);
        let (errors, error) =
            Spi::get_two::<i32, String>("SELECT errors, error FROM once.entries WHERE key = 'k'")
                .unwrap();
        assert_eq!(errors, Some(1));
        assert!(error.unwrap().contains("backend exited"));
        // The zombie's token is refused; the new owner's result stands.
        assert_eq!(
            one::<bool>(&format!(
                "SELECT once.complete_key('k', {token}, '\"zombie\"')"
            )),
            Some(false)
        );
        assert_eq!(
            one::<bool>(&format!(
                "SELECT once.complete_key('k', {new_token}, '\"fresh\"')"
            )),
            Some(true)
        );
        assert_eq!(
            one::<String>("SELECT result::text FROM once.entries WHERE key = 'k'").as_deref(),
            Some("\"fresh\"")
        );
    }

    #[pg_test]
    fn claim_whose_lease_expired_is_taken_over() {
        outcome_and_token("k");
        Spi::run(
            "UPDATE once.entries SET lease_expires_at = clock_timestamp() - interval '1 second'",
        )
        .unwrap();
        assert_eq!(outcome_and_token("k").0, "claimed");
        let error = one::<String>("SELECT error FROM once.entries WHERE key = 'k'").unwrap();
        assert!(error.contains("lease expired"), "{error}");
    }

    #[pg_test]
    fn pid_reused_by_a_newer_backend_does_not_keep_a_claim_alive() {
        outcome_and_token("k");
        // Our own pid, but a different start time: a different backend.
        Spi::run("UPDATE once.entries SET owner_started = owner_started - interval '1 hour'")
            .unwrap();
        assert_eq!(outcome_and_token("k").0, "claimed");
    }

    #[pg_test]
    fn lease_only_claims_survive_their_backend_until_the_lease_ends() {
        Spi::run("SET LOCAL once.backend_liveness = off").unwrap();
        outcome_and_token("k");
        assert_eq!(
            one::<bool>("SELECT lease_only FROM once.entries WHERE key = 'k'"),
            Some(true)
        );
        kill_owner("k");
        assert_eq!(answer("k").0, "wait");
        assert_eq!(
            one::<i64>("SELECT reclaimed FROM once.reap_stale()"),
            Some(0)
        );
        Spi::run(
            "UPDATE once.entries SET lease_expires_at = clock_timestamp() - interval '1 second'",
        )
        .unwrap();
        assert_eq!(outcome_and_token("k").0, "claimed");
    }

    #[pg_test]
    fn waiting_for_a_key_this_session_owns_waits_like_anyone_else() {
        // Behind a pool the same server connection serves many clients, so a claim held by
        // this backend may be another client's: the call waits, bounded by its wait.
        outcome_and_token("k");
        let started = std::time::Instant::now();
        let outcome =
            one::<String>("SELECT outcome FROM once.claim_key('k', wait => '300 milliseconds')");
        assert_eq!(outcome.as_deref(), Some("wait"));
        assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    }

    #[pg_test]
    fn waiting_for_a_lease_only_owner_returns_wait_after_the_wait() {
        Spi::run("SET LOCAL once.backend_liveness = off").unwrap();
        outcome_and_token("k");
        let started = std::time::Instant::now();
        let outcome =
            one::<String>("SELECT outcome FROM once.claim_key('k', wait => '200 milliseconds')");
        assert_eq!(outcome.as_deref(), Some("wait"));
        assert!(started.elapsed() >= std::time::Duration::from_millis(200));
    }

    #[pg_test]
    fn waiter_is_given_the_claim_when_the_lease_runs_out() {
        Spi::run("SET LOCAL once.backend_liveness = off").unwrap();
        Spi::run("SELECT once.claim_key('k', lease => '300 milliseconds')").unwrap();
        let outcome = one::<String>("SELECT outcome FROM once.claim_key('k', wait => '5 seconds')");
        assert_eq!(outcome.as_deref(), Some("claimed"));
    }

    #[pg_test]
    fn reap_stale_reclaims_gone_owners_and_purges_expired_results() {
        outcome_and_token("gone");
        kill_owner("gone");
        outcome_and_token("alive");
        let (_, token) = outcome_and_token("expiring");
        Spi::run(&format!(
            "SELECT once.complete_key('expiring', {token}, '1', '1 millisecond')"
        ))
        .unwrap();
        Spi::run("SELECT pg_sleep(0.01)").unwrap();

        let (reclaimed, expired) =
            Spi::get_two::<i64, i64>("SELECT reclaimed, expired FROM once.reap_stale()").unwrap();
        assert_eq!((reclaimed, expired), (Some(1), Some(1)));
        assert_eq!(state_of("gone").as_deref(), Some("failed"));
        assert_eq!(state_of("alive").as_deref(), Some("running"));
        assert_eq!(state_of("expiring"), None);
        let error = one::<String>("SELECT error FROM once.entries WHERE key = 'gone'").unwrap();
        assert!(error.contains("claim reaped"), "{error}");
        // A reaped key may be retried at once.
        assert_eq!(outcome_and_token("gone").0, "claimed");
        // Running it again finds nothing more to do.
        let again = Spi::get_two::<i64, i64>("SELECT * FROM once.reap_stale()").unwrap();
        assert_eq!(again, (Some(0), Some(0)));
    }

    /// Rows of `table` that scans of this transaction have read so far, by sequential
    /// scans and through indexes.
    fn rows_read(table: &str) -> i64 {
        one::<i64>(&format!(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
               FROM pg_stat_xact_user_tables WHERE relid = '{table}'::regclass"
        ))
        .unwrap_or(0)
    }

    #[pg_test]
    fn reap_stale_with_nothing_to_purge_only_probes_indexes() {
        // History younger than the retention and results that expire tomorrow: a round
        // finds that none is due through its indexes, without reading any row. (A volatile
        // bound, `finished_at < clock_timestamp() - ...`, cannot be an index condition: the
        // round read the whole history, 336 ms with 2,000,000 rows; BENCHMARKS.md, "Scale".)
        Spi::run(
            "INSERT INTO once.attempts (key_hash, key, queue, token, started_at, finished_at, outcome)
             SELECT once.key_hash('h' || i), 'h' || i, 'default', i, now(), now() - i * interval '1 s', 'completed'
               FROM generate_series(1, 5000) i",
        )
        .unwrap();
        Spi::run(
            "INSERT INTO once.entries (key_hash, key, state, token, result, expires_at)
             SELECT once.key_hash('e' || i), 'e' || i, 'done', i, '1', now() + interval '1 day' + i * interval '1 s'
               FROM generate_series(1, 5000) i",
        )
        .unwrap();
        Spi::run("ANALYZE once.attempts, once.entries").unwrap();
        let (history, entries) = (rows_read("once.attempts"), rows_read("once.entries"));
        let (expired, purged) =
            Spi::get_two::<i64, i64>("SELECT expired, history FROM once.reap_stale()").unwrap();
        assert_eq!((expired, purged), (Some(0), Some(0)));
        // Not exactly none: planning may read a row at an end of an index to estimate a
        // range (get_actual_variable_range).
        let read = (
            rows_read("once.attempts") - history,
            rows_read("once.entries") - entries,
        );
        assert!(
            read.0 < 10 && read.1 < 10,
            "rows read (history, entries): {read:?}"
        );
    }

    #[pg_test]
    fn reap_stale_purges_more_history_than_one_batch() {
        // One call a once.reaper_naptime: a call that purged one batch (PURGE_BATCH) capped
        // the purge below what a busy queue completes, and the history grew without bound.
        use crate::protocol::reap::{purge_history, PURGE_BATCH};
        use std::time::Duration;
        let rows = PURGE_BATCH * 5 / 2;
        Spi::run(&format!(
            "INSERT INTO once.attempts (key_hash, key, queue, token, started_at, finished_at, outcome)
             SELECT once.key_hash('h' || i), 'h' || i, 'default', i, now(), now() - interval '8 days' - i * interval '1 ms', 'completed'
               FROM generate_series(1, {rows}) i
             UNION ALL
             SELECT once.key_hash('new'), 'new', 'default', 0, now(), now(), 'completed'"
        ))
        .unwrap();
        let week = 7.0 * 86_400.0;
        // Out of time from the start: one batch, never none, so every call makes progress.
        assert_eq!(purge_history(week, Duration::ZERO), PURGE_BATCH);
        // With time left, batch after batch until none is past the retention: how much a
        // call gets through depends only on its budget, not on how busy the machine is.
        assert_eq!(
            purge_history(week, Duration::from_secs(3600)),
            rows - PURGE_BATCH
        );
        assert_eq!(
            one::<String>("SELECT string_agg(key, ',') FROM once.attempts").as_deref(),
            Some("new"),
            "rows within the retention stay"
        );
        // reap_stale purges with once.history_retention, within PURGE_BUDGET.
        Spi::run(
            "INSERT INTO once.attempts (key_hash, key, queue, token, started_at, finished_at, outcome)
             VALUES (once.key_hash('old'), 'old', 'default', 1, now(), now() - interval '8 days', 'completed')",
        )
        .unwrap();
        assert_eq!(one::<i64>("SELECT history FROM once.reap_stale()"), Some(1));
    }
}
