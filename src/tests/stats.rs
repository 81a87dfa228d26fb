//! once.stats: keys counted by state, and the call counters in shared memory when preloaded.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{answer, one, outcome_and_token, text};
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

    /// once.stats' counts by state, and a count of the keys themselves.
    fn counts_and_keys() -> (String, String) {
        (
            text("SELECT format('%s/%s/%s/%s/%s/%s', queued, running, done, failed, errors, attempts) FROM once.stats"),
            text("SELECT format('%s/%s/%s/%s/%s/%s', count(*) FILTER (WHERE state = 'queued'), count(*) FILTER (WHERE state = 'running'), count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state = 'failed'), coalesce(sum(errors), 0), coalesce(sum(attempts), 0)) FROM once.entries"),
        )
    }

    #[pg_test]
    fn counts_follow_truncate_and_writes_without_triggers_after_a_recount() {
        outcome_and_token("counted");
        Spi::run("SELECT once.enqueue_key('counted-queued')").unwrap();
        let (counts, keys) = counts_and_keys();
        assert_eq!(counts, keys);
        Spi::run("TRUNCATE once.entries").unwrap();
        assert_eq!(
            counts_and_keys(),
            ("0/0/0/0/0/0".into(), "0/0/0/0/0/0".into())
        );
        // Rows written with triggers off (a replica's apply, pg_restore --disable-triggers)
        // are not counted until recount_keys.
        Spi::run("SET LOCAL session_replication_role = replica").unwrap();
        Spi::run("INSERT INTO once.entries (key_hash, key, state, token, result) VALUES (once.key_hash('quiet'), 'quiet', 'done', 1, '1')").unwrap();
        Spi::run("SET LOCAL session_replication_role = origin").unwrap();
        assert_eq!(
            counts_and_keys(),
            ("0/0/0/0/0/0".into(), "0/0/1/0/0/0".into())
        );
        Spi::run("SELECT once_internal.recount_keys()").unwrap();
        assert_eq!(
            counts_and_keys(),
            ("0/0/1/0/0/0".into(), "0/0/1/0/0/0".into())
        );
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
        assert_eq!(answer("k2").0, "hit");
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

    /// A random workload over two queues: keys enqueued due now or tomorrow, claimed,
    /// completed, failed for good (max_attempts 1) or left running, some enqueued again.
    fn random_queue_workload(seed: f64) {
        Spi::run(&format!("SELECT setseed({seed})")).unwrap();
        Spi::run("SELECT once.create_queue('qa', max_attempts => 1), once.create_queue('qb', max_attempts => 1)")
            .unwrap();
        Spi::run(
            "SELECT once.enqueue_key('job-' || i, NULL, CASE WHEN random() < 0.5 THEN 'qa' ELSE 'qb' END,
                                     run_at => CASE WHEN random() < 0.3 THEN now() + interval '1 day' END)
               FROM generate_series(1, 400) i",
        )
        .unwrap();
        for queue in ["qa", "qb"] {
            Spi::run(&format!(
                "WITH c AS (SELECT key, token, random() AS r FROM once.claim_next('{queue}', n => 150))
                 SELECT CASE WHEN r < 0.6 THEN once.complete_key(key, token, '1')::text
                             WHEN r < 0.8 THEN once.fail_key(key, token, 'x')::text END
                   FROM c"
            ))
            .unwrap();
        }
        Spi::run(
            "SELECT once.enqueue_key(key, NULL, queue) FROM once.entries
              WHERE state = 'done' AND random() < 0.3",
        )
        .unwrap();
    }

    #[pg_test]
    fn queue_stats_agree_with_a_direct_count_after_a_random_workload() {
        random_queue_workload(0.25);
        let direct = text(
            "SELECT string_agg(format('%s %s %s %s %s', q, depth, due, running, dead), ', ' ORDER BY q)
               FROM (SELECT q.name AS q,
                            count(*) FILTER (WHERE e.state = 'queued') AS depth,
                            count(*) FILTER (WHERE e.state = 'queued' AND e.run_at <= clock_timestamp()) AS due,
                            count(*) FILTER (WHERE e.state = 'running') AS running,
                            count(*) FILTER (WHERE e.state = 'failed') AS dead
                       FROM once.queues q LEFT JOIN once.entries e ON e.queue = q.name
                      GROUP BY q.name) c",
        );
        let view = text(
            "SELECT string_agg(format('%s %s %s %s %s', queue, depth, due, running, dead), ', ' ORDER BY queue)
               FROM once.queue_stats",
        );
        assert_eq!(view, direct);
        let history = text(
            "SELECT format('%s %s', count(*) FILTER (WHERE outcome = 'completed'), count(*) FILTER (WHERE outcome <> 'completed'))
               FROM once.attempts",
        );
        let shown = text(
            "SELECT format('%s %s', sum(completed_last_minute), sum(failed_last_minute)) FROM once.queue_stats",
        );
        assert_eq!(shown, history);
        let totals = text(
            "SELECT format('%s %s %s', count(*) FILTER (WHERE state = 'queued'), count(*) FILTER (WHERE state = 'running'),
                           count(*) FILTER (WHERE state = 'failed')) FROM once.entries",
        );
        assert_eq!(
            text("SELECT format('%s %s %s', queued, running, failed) FROM once.stats"),
            totals
        );
    }

    #[pg_test]
    fn queue_stats_read_no_done_key() {
        // 5,000 done keys in a queue and a few that matter: the view reads the few, through
        // the partial indexes of their states. (A join on the queue read every key the
        // queue ever ran: 1.6 s a scrape at 1,000,000 keys.)
        Spi::run("SELECT once.create_queue('qa', max_attempts => 1)").unwrap();
        Spi::run(
            "INSERT INTO once.entries (key_hash, key, state, token, result, queue, run_at)
             SELECT once.key_hash('done-' || i), 'done-' || i, 'done', i, '1', 'qa', now()
               FROM generate_series(1, 5000) i",
        )
        .unwrap();
        random_queue_workload(0.5);
        Spi::run("ANALYZE once.entries").unwrap();
        let matter = one::<i64>("SELECT count(*) FROM once.entries WHERE state <> 'done'").unwrap();
        let before = one::<i64>(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
               FROM pg_stat_xact_user_tables WHERE relid = 'once.entries'::regclass",
        )
        .unwrap_or(0);
        Spi::run("SELECT * FROM once.queue_stats").unwrap();
        let read = one::<i64>(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
               FROM pg_stat_xact_user_tables WHERE relid = 'once.entries'::regclass",
        )
        .unwrap_or(0)
            - before;
        // (Planning may read a few more, at an end of an index, to estimate a range.)
        assert!(
            read <= matter + 10,
            "read {read} rows of once.entries, {matter} not done"
        );
    }
}
