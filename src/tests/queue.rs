//! Queue mode: enqueue_key and claim_next, refresh, backoff and dead letters, the attempt
//! history, batch invalidation and completion, once.queue_stats.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{claim_next, kill_owner, one, text};
    use pgrx::prelude::*;

    #[pg_test]
    fn enqueue_is_idempotent_per_key_and_claim_next_hands_it_out_once() {
        assert_eq!(
            text("SELECT once.enqueue_key('job', '{\"n\": 1}')"),
            "queued"
        );
        assert_eq!(
            text("SELECT once.enqueue_key('job', '{\"n\": 2}')"),
            "duplicate"
        );
        let payload = one::<String>("SELECT payload::text FROM once.claim_next()");
        assert_eq!(
            payload.as_deref(),
            Some("{\"n\": 1}"),
            "the first payload stands"
        );
        assert!(
            claim_next("default", 10).is_empty(),
            "a claimed key is not handed out again"
        );
        assert_eq!(
            text("SELECT once.enqueue_key('job')"),
            "duplicate",
            "running: not duplicated"
        );
        let token = one::<i64>("SELECT token FROM once.entries WHERE key = 'job'").unwrap();
        Spi::run(&format!(
            "SELECT once.complete_key('job', {token}, '\"v1\"')"
        ))
        .unwrap();
        assert_eq!(
            text("SELECT once.enqueue_key('job')"),
            "cached",
            "a fresh result is kept"
        );
    }

    /// enqueue_keys answers every key as enqueue_key would, in the order given, in one
    /// call: each state a key can be in, mixed in one batch.
    #[pg_test]
    fn enqueue_keys_answers_each_key_as_enqueue_key_would() {
        let (_, done) = crate::tests::outcome_and_token("done");
        Spi::run(&format!(
            "SELECT once.complete_key('done', {done}, '\"v\"')"
        ))
        .unwrap();
        let (_, expired) = crate::tests::outcome_and_token("expired");
        Spi::run(&format!(
            "SELECT once.complete_key('expired', {expired}, '\"v\"', ttl => '1 hour');
             UPDATE once.entries SET expires_at = clock_timestamp() - interval '1 second'
              WHERE key = 'expired'"
        ))
        .unwrap();
        let (_, failed) = crate::tests::outcome_and_token("failed");
        Spi::run(&format!("SELECT once.fail_key('failed', {failed}, 'boom')")).unwrap();
        crate::tests::outcome_and_token("running");
        Spi::run("SELECT once.enqueue_key('queued', '{\"n\": 0}')").unwrap();
        assert_eq!(
            text(
                "SELECT string_agg(key || '=' || outcome, ' ' ORDER BY n)
                   FROM once.enqueue_keys(
                            ARRAY['queued', 'new', 'done', 'expired', 'failed', 'running'],
                            ARRAY['{\"n\": 1}', '{\"n\": 2}', '{\"n\": 3}', '{\"n\": 4}',
                                  '{\"n\": 5}', NULL]::jsonb[],
                            priority => 7)
                        WITH ORDINALITY AS r(key, outcome, n)"
            ),
            "queued=duplicate new=queued done=cached expired=requeued failed=requeued running=duplicate"
        );
        // What each outcome wrote: payload and priority of the batch for the keys queued
        // or queued again, nothing for the others.
        assert_eq!(
            text(
                "SELECT string_agg(key || ':' || state || ':' || coalesce(payload->>'n', '-')
                                   || ':' || coalesce(priority::text, '-'), ' ' ORDER BY key)
                   FROM once.entries"
            ),
            "done:done:-:0 expired:queued:4:7 failed:queued:5:7 new:queued:2:7 queued:queued:0:0 running:running:-:0"
        );
        // refresh: a fresh result is queued again (and served meanwhile), a running key
        // is queued again when its run ends.
        assert_eq!(
            text(
                "SELECT string_agg(key || '=' || outcome, ' ')
                   FROM once.enqueue_keys(ARRAY['done', 'running', 'new'], refresh => true)"
            ),
            "done=requeued running=requeued new=duplicate"
        );
        assert_eq!(
            text(
                "SELECT string_agg(key || ':' || state || ':' || coalesce(rerun, '-'), ' ' ORDER BY key)
                   FROM once.entries WHERE key IN ('done', 'running')"
            ),
            "done:queued:- running:running:keep"
        );
        assert_eq!(
            text("SELECT outcome || ' ' || result::text FROM once.claim_key('done')"),
            "hit \"v\""
        );
        // An empty batch answers nothing and writes nothing.
        assert_eq!(
            one::<i64>("SELECT count(*) FROM once.enqueue_keys(ARRAY[]::text[])"),
            Some(0)
        );
    }

    /// Every key of a batch is checked with the caller's rights before anything is
    /// written: one key the caller may not use refuses the whole batch.
    #[pg_test]
    fn enqueue_keys_refuses_a_batch_with_a_key_the_caller_may_not_use() {
        Spi::run(
            "CREATE ROLE batch_outsider;
             GRANT USAGE ON SCHEMA once TO batch_outsider;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO batch_outsider;
             SELECT once.create_namespace('tenant/', 'pg_database_owner');
             SELECT once.create_queue('tenant', namespace => 'tenant/');
             SELECT once.enqueue_key('tenant/old', queue => 'tenant');",
        )
        .unwrap();
        let before = crate::tests::snapshot();
        Spi::run("SET LOCAL ROLE batch_outsider").unwrap();
        crate::tests::assert_error(
            "SELECT * FROM once.enqueue_keys(ARRAY['mine', 'tenant/new'])",
            "42501",
            "permission denied for namespace \"tenant/\": enqueue_keys",
        );
        crate::tests::assert_error(
            "SELECT * FROM once.enqueue_keys(ARRAY['mine'], queue => 'tenant')",
            "42501",
            "permission denied for namespace \"tenant/\"",
        );
        Spi::run("RESET ROLE").unwrap();
        // A namespace's key never goes into a shared queue, whoever asks.
        crate::tests::assert_error(
            "SELECT * FROM once.enqueue_keys(ARRAY['mine', 'tenant/new'])",
            "42501",
            "key \"tenant/new\" belongs to namespace \"tenant/\", queue \"default\" does not",
        );
        assert_eq!(crate::tests::snapshot(), before, "nothing was written");
        // A member enqueues the namespace's keys into its queue.
        assert_eq!(
            text(
                "SELECT string_agg(key || '=' || outcome, ' ')
                   FROM once.enqueue_keys(ARRAY['tenant/old', 'tenant/new'], queue => 'tenant')"
            ),
            "tenant/old=duplicate tenant/new=queued"
        );
    }

    #[pg_test]
    fn refresh_keeps_serving_the_previous_result_until_the_new_one_lands() {
        Spi::run("SELECT once.enqueue_key('page')").unwrap();
        let (_, token, _) = claim_next("default", 1)[0].clone();
        Spi::run(&format!(
            "SELECT once.complete_key('page', {token}, '\"old\"')"
        ))
        .unwrap();
        assert_eq!(
            text("SELECT once.enqueue_key('page', refresh => true)"),
            "requeued"
        );
        assert_eq!(
            text("SELECT outcome || ' ' || result::text FROM once.claim_key('page')"),
            "hit \"old\""
        );
        let (_, token, attempt) = claim_next("default", 1)[0].clone();
        assert_eq!(attempt, 1);
        assert_eq!(
            text("SELECT outcome || ' ' || result::text FROM once.claim_key('page')"),
            "hit \"old\""
        );
        Spi::run(&format!(
            "SELECT once.complete_key('page', {token}, '\"new\"')"
        ))
        .unwrap();
        assert_eq!(
            text("SELECT result::text FROM once.claim_key('page')"),
            "\"new\""
        );
    }

    #[pg_test]
    fn failures_back_off_then_stay_failed_as_a_dead_letter() {
        Spi::run("SELECT once.create_queue('q', max_attempts => 2, backoff => '10 seconds')")
            .unwrap();
        Spi::run("SELECT once.enqueue_key('k', queue => 'q')").unwrap();
        let (_, token, attempt) = claim_next("q", 1)[0].clone();
        assert_eq!(attempt, 1);
        assert_eq!(
            one::<bool>(&format!("SELECT once.fail_key('k', {token}, 'timeout')")),
            Some(true)
        );
        // Back in the queue, due after 5 to 10 s (10 s with jitter), with the error counted.
        assert_eq!(
            text("SELECT state || ' ' || errors || ' ' || (run_at - clock_timestamp() BETWEEN '4 s' AND '10 s') FROM once.entries WHERE key = 'k'"),
            "queued 1 true"
        );
        assert!(claim_next("q", 1).is_empty(), "not due yet");
        Spi::run("UPDATE once.entries SET run_at = clock_timestamp() WHERE key = 'k'").unwrap();
        let (_, token, attempt) = claim_next("q", 1)[0].clone();
        assert_eq!(attempt, 2);
        Spi::run(&format!(
            "SELECT once.fail_key('k', {token}, 'timeout again')"
        ))
        .unwrap();
        assert_eq!(
            text(
                "SELECT state || ' ' || (retry_at = 'infinity') FROM once.entries WHERE key = 'k'"
            ),
            "failed true"
        );
        assert_eq!(
            text("SELECT outcome || ': ' || error FROM once.claim_key('k')"),
            "failed: timeout again"
        );
        assert_eq!(
            text("SELECT key || ' ' || attempts FROM once.dead_letters"),
            "k 2"
        );
        // Re-enqueued, it gets a new budget of attempts.
        assert_eq!(
            text("SELECT once.enqueue_key('k', queue => 'q')"),
            "requeued"
        );
        assert_eq!(claim_next("q", 1)[0].2, 1);
    }

    #[pg_test]
    fn claim_next_takes_fewest_errors_then_priority_then_oldest() {
        Spi::run("SELECT once.create_queue('order')").unwrap();
        Spi::run("SELECT once.enqueue_key('old-low', queue => 'order', priority => 5, run_at => now() - interval '3 minutes')").unwrap();
        Spi::run("SELECT once.enqueue_key('new-high', queue => 'order', priority => 1, run_at => now() - interval '1 minute')").unwrap();
        Spi::run("SELECT once.enqueue_key('old-high', queue => 'order', priority => 1, run_at => now() - interval '2 minutes')").unwrap();
        Spi::run("SELECT once.enqueue_key('erring', queue => 'order', priority => 0, run_at => now() - interval '9 minutes')").unwrap();
        Spi::run("UPDATE once.entries SET errors = 3 WHERE key = 'erring'").unwrap();
        Spi::run("SELECT once.enqueue_key('future', queue => 'order', run_at => now() + interval '1 hour')").unwrap();
        let order: Vec<String> = (0..5)
            .flat_map(|_| claim_next("order", 1))
            .map(|c| c.0)
            .collect();
        assert_eq!(order, ["old-high", "new-high", "old-low", "erring"]);
    }

    #[pg_test]
    fn release_returns_a_queued_key_without_counting_the_attempt() {
        Spi::run("SELECT once.enqueue_key('r')").unwrap();
        let (_, token, _) = claim_next("default", 1)[0].clone();
        assert_eq!(
            one::<bool>(&format!("SELECT once.release_key('r', {token})")),
            Some(true)
        );
        assert_eq!(
            text("SELECT state || ' ' || attempts FROM once.entries WHERE key = 'r'"),
            "queued 0"
        );
        assert_eq!(claim_next("default", 1)[0].2, 1);
    }

    #[pg_test]
    fn every_ended_attempt_is_in_the_history() {
        Spi::run("SELECT once.enqueue_key(k) FROM unnest(ARRAY['a', 'b', 'c', 'd']) k").unwrap();
        let claimed = claim_next("default", 4);
        assert_eq!(claimed.len(), 4);
        let token = |k: &str| claimed.iter().find(|c| c.0 == k).unwrap().1;
        Spi::run(&format!(
            "SELECT once.complete_key('a', {}, '1')",
            token("a")
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT once.fail_key('b', {}, 'boom')",
            token("b")
        ))
        .unwrap();
        Spi::run(&format!("SELECT once.release_key('c', {})", token("c"))).unwrap();
        Spi::run("SELECT once.invalidate_keys(prefix => 'd')").unwrap();
        let history = text(
            "SELECT string_agg(key || ':' || outcome || ':' || coalesce(error, '-'), ' ' ORDER BY key) FROM once.attempts",
        );
        assert_eq!(
            history,
            "a:completed:- b:failed:boom c:released:- d:cancelled:-"
        );
        assert_eq!(one::<bool>("SELECT bool_and(started_at <= finished_at AND worker IS NOT NULL) FROM once.attempts"), Some(true));
    }

    #[pg_test]
    fn each_ended_attempt_leaves_its_outcome_on_the_key() {
        // The statement that ends an attempt says how in once.entries.last_outcome, and the
        // history records that: no error text is read to tell a reaped claim from a
        // failure (this failure's message even looks like a reaper's).
        Spi::run("SELECT once.enqueue_key(k) FROM unnest(ARRAY['done', 'failed', 'released', 'reaped', 'taken']) k").unwrap();
        let claimed = claim_next("default", 5);
        let token = |k: &str| claimed.iter().find(|c| c.0 == k).unwrap().1;
        Spi::run(&format!(
            "SELECT once.complete_key('done', {}, '1')",
            token("done")
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT once.fail_key('failed', {}, 'owner x (token 1) is gone: not really')",
            token("failed")
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT once.release_key('released', {})",
            token("released")
        ))
        .unwrap();
        kill_owner("taken");
        assert_eq!(
            text("SELECT outcome FROM once.claim_key('taken')"),
            "claimed"
        );
        kill_owner("reaped");
        assert_eq!(
            one::<i64>("SELECT reclaimed FROM once.reap_stale()"),
            Some(1)
        );
        assert_eq!(
            text(
                "SELECT string_agg(key || ':' || last_outcome, ' ' ORDER BY key) FROM once.entries"
            ),
            "done:completed failed:failed reaped:abandoned released:released taken:taken_over"
        );
        assert_eq!(
            text("SELECT string_agg(key || ':' || outcome, ' ' ORDER BY key) FROM once.attempts"),
            "done:completed failed:failed reaped:abandoned released:released taken:taken_over"
        );
    }

    #[pg_test]
    fn a_dead_worker_counts_as_an_attempt() {
        Spi::run("SELECT once.create_queue('fragile', max_attempts => 1)").unwrap();
        Spi::run("SELECT once.enqueue_key('crasher', queue => 'fragile')").unwrap();
        Spi::run("SELECT once.enqueue_key('victim', queue => 'default')").unwrap();
        claim_next("fragile", 1);
        claim_next("default", 1);
        kill_owner("crasher");
        kill_owner("victim");
        assert_eq!(
            one::<i64>("SELECT reclaimed FROM once.reap_stale()"),
            Some(2)
        );
        // Its only attempt was used: it stays failed. The other goes back with a backoff.
        assert_eq!(
            text("SELECT state::text FROM once.entries WHERE key = 'crasher'"),
            "failed"
        );
        assert_eq!(text("SELECT state || ' ' || (run_at > clock_timestamp()) FROM once.entries WHERE key = 'victim'"), "queued true");
        assert_eq!(
            text("SELECT string_agg(outcome, ',') FROM once.attempts"),
            "abandoned,abandoned"
        );
    }

    #[pg_test]
    fn invalidate_keys_by_queue_or_prefix() {
        Spi::run("SELECT once.create_queue('batch')").unwrap();
        Spi::run("SELECT once.enqueue_key('https://a.example/' || i, queue => 'batch') FROM generate_series(1, 5) i").unwrap();
        Spi::run("SELECT once.enqueue_key('https://b.example/' || i) FROM generate_series(1, 3) i")
            .unwrap();
        let (key, token, _) = claim_next("batch", 1)[0].clone();
        assert_eq!(
            one::<i64>("SELECT once.invalidate_keys(prefix => 'https://b.example/')"),
            Some(3)
        );
        assert_eq!(
            one::<i64>("SELECT once.invalidate_keys(queue => 'batch')"),
            Some(5)
        );
        assert_eq!(one::<i64>("SELECT count(*) FROM once.entries"), Some(0));
        assert_eq!(
            Spi::get_one_with_args::<bool>(
                "SELECT once.complete_key($1, $2, '1')",
                &[key.as_str().into(), token.into()]
            )
            .unwrap(),
            Some(false),
            "a cancelled worker's result is refused"
        );
    }

    #[pg_test]
    fn complete_keys_completes_the_current_claims_of_a_batch() {
        Spi::run("SELECT once.enqueue_key(k) FROM unnest(ARRAY['x', 'y', 'z']) k").unwrap();
        let claimed = claim_next("default", 3);
        let keys: Vec<&str> = claimed.iter().map(|c| c.0.as_str()).collect();
        let mut tokens: Vec<i64> = claimed.iter().map(|c| c.1).collect();
        tokens[1] += 1000; // a claim this worker no longer holds
        let done = text(&format!(
            "SELECT string_agg(key, ',' ORDER BY key) FROM once.complete_keys(ARRAY{keys:?}::text[], ARRAY{tokens:?}, ARRAY['1', '2', '3']::jsonb[])"
        ).replace('"', "'"));
        let mut expected = [keys[0], keys[2]];
        expected.sort();
        assert_eq!(done, expected.join(","));
        assert_eq!(
            one::<i64>("SELECT count(*) FROM once.entries WHERE state = 'done'"),
            Some(2)
        );
    }

    #[pg_test]
    fn queue_stats_show_depth_due_running_and_dead() {
        Spi::run("SELECT once.create_queue('s', max_attempts => 1)").unwrap();
        Spi::run("SELECT once.enqueue_key('due' || i, queue => 's') FROM generate_series(1, 3) i")
            .unwrap();
        Spi::run(
            "SELECT once.enqueue_key('later', queue => 's', run_at => now() + interval '1 hour')",
        )
        .unwrap();
        let claimed = claim_next("s", 2);
        Spi::run(&format!(
            "SELECT once.fail_key('{}', {}, 'x')",
            claimed[0].0, claimed[0].1
        ))
        .unwrap();
        assert_eq!(
            text("SELECT format('%s %s %s %s %s', depth, due, running, dead, failed_last_minute) FROM once.queue_stats WHERE queue = 's'"),
            "2 1 1 1 1"
        );
    }

    /// Rows of once.entries read so far in this transaction (sequential scans and index
    /// scans' row fetches).
    fn entries_read() -> i64 {
        one::<i64>(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
               FROM pg_stat_xact_user_tables WHERE relid = 'once.entries'::regclass",
        )
        .unwrap_or(0)
    }

    #[pg_test]
    fn claim_next_and_its_idle_look_read_no_job_that_is_not_due() {
        // 2,000 jobs due tomorrow sort first (priority -1); one job due now after them.
        Spi::run(
            "SELECT once.enqueue_key('later-' || i, NULL, 'default', -1 - i % 3, now() + interval '1 day' + i * interval '1 s')
               FROM generate_series(1, 2000) i",
        )
        .unwrap();
        Spi::run("SELECT once.enqueue_key('now', priority => 5)").unwrap();
        Spi::run("ANALYZE once.entries").unwrap();
        let before = entries_read();
        let claimed = claim_next("default", 1);
        let read = entries_read() - before;
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].0, "now");
        // A volatile due bound was a filter on the row: every job not due was read.
        assert!(read <= 10, "claim_next read {read} rows");
        // Nothing due now: the idle look reads when the next job is due, one index probe
        // per (errors, priority) group, not every queued row.
        let before = entries_read();
        assert!(claim_next("default", 1).is_empty());
        let due =
            one::<bool>("SELECT count(*) = 0 FROM once.claim_next(wait => '20 milliseconds')");
        assert_eq!(due, Some(true));
        let read = entries_read() - before;
        assert!(read <= 20, "an idle claim_next read {read} rows");
    }
}
