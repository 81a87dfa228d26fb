//! Bad input, queue mode's included: a specific SQLSTATE, a message that names the
//! problem, a hint, and nothing changed.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{answer, assert_error, hint_of, one, outcome_and_token, snapshot, text};
    use pgrx::prelude::*;

    #[pg_test]
    fn bad_keys_are_refused() {
        let long = format!("SELECT once.claim_key(repeat('x', {}))", 7501);
        let long_get = format!("SELECT once.get(repeat('x', {}))", 7501);
        let cases: &[(&str, &str, &str)] = &[
            (
                "SELECT once.claim_key(NULL)",
                "22004",
                "key must not be NULL",
            ),
            (
                "SELECT once.claim_key('')",
                "22023",
                "key must not be empty",
            ),
            (&long, "22001", "the limit is 7500 bytes"),
            ("SELECT once.get(NULL)", "22004", "key must not be NULL"),
            ("SELECT once.get('')", "22023", "key must not be empty"),
            (&long_get, "22001", "the limit is 7500 bytes"),
            (
                "SELECT once.complete_key(NULL, 1, '1')",
                "22004",
                "key must not be NULL",
            ),
            (
                "SELECT once.fail_key('', 1, 'e')",
                "22023",
                "key must not be empty",
            ),
            (
                "SELECT once.heartbeat_key(NULL, 1)",
                "22004",
                "key must not be NULL",
            ),
            (
                "SELECT once.release_key('', 1)",
                "22023",
                "key must not be empty",
            ),
            (
                "SELECT once.invalidate_key(NULL)",
                "22004",
                "key must not be NULL",
            ),
            (
                "SELECT once.invalidate_key(repeat('é', 3751))",
                "22001",
                "7502 bytes",
            ),
        ];
        let before = snapshot();
        for (sql, state, msg) in cases {
            assert_error(sql, state, msg);
        }
        assert_eq!(snapshot(), before);
    }

    #[pg_test]
    fn bad_tokens_are_refused() {
        let (_, token) = outcome_and_token("k");
        let before = snapshot();
        for sql in [
            "SELECT once.complete_key('k', NULL, '1')",
            "SELECT once.fail_key('k', NULL, 'e')",
            "SELECT once.heartbeat_key('k', NULL)",
            "SELECT once.release_key('k', NULL)",
        ] {
            assert_error(sql, "22004", "token must not be NULL");
        }
        for sql in [
            "SELECT once.complete_key('k', 0, '1')",
            "SELECT once.fail_key('k', -1, 'e')",
            "SELECT once.heartbeat_key('k', 0)",
            "SELECT once.release_key('k', -5)",
        ] {
            assert_error(sql, "22023", "token must be positive");
        }
        assert_eq!(snapshot(), before);
        assert_eq!(answer("k"), ("wait".to_string(), None));
        assert!(token > 0);
    }

    #[pg_test]
    fn bad_intervals_are_refused() {
        let (_, token) = outcome_and_token("k");
        let t = token.to_string();
        let cases = [
            (
                "SELECT once.claim_key('x', lease => NULL)".to_string(),
                "22004",
                "lease must not be NULL",
            ),
            (
                "SELECT once.claim_key('x', lease => '0')".to_string(),
                "22023",
                "lease must be positive",
            ),
            (
                "SELECT once.claim_key('x', lease => '-1 second')".to_string(),
                "22023",
                "lease must be positive",
            ),
            (
                "SELECT once.claim_key('x', lease => '2 days')".to_string(),
                "22023",
                "at most 1 day",
            ),
            (
                "SELECT once.claim_key('x', wait => NULL)".to_string(),
                "22004",
                "wait must not be NULL",
            ),
            (
                "SELECT once.claim_key('x', wait => '-1 second')".to_string(),
                "22023",
                "wait must not be negative",
            ),
            (
                "SELECT once.claim_key('x', wait => '1 year')".to_string(),
                "22023",
                "wait must be at most 1 day",
            ),
            (
                format!("SELECT once.complete_key('k', {t}, '1', ttl => '0')"),
                "22023",
                "ttl must be positive",
            ),
            (
                format!("SELECT once.complete_key('k', {t}, '1', ttl => '-1 hour')"),
                "22023",
                "ttl must be positive",
            ),
            (
                format!("SELECT once.complete_key('k', {t}, '1', ttl => '200 years')"),
                "22023",
                "at most 100 years",
            ),
            (
                format!("SELECT once.fail_key('k', {t}, 'e', retry_after => NULL)"),
                "22004",
                "retry_after must not be NULL",
            ),
            (
                format!("SELECT once.fail_key('k', {t}, 'e', retry_after => '-1 second')"),
                "22023",
                "must not be negative",
            ),
            (
                format!("SELECT once.fail_key('k', {t}, 'e', retry_after => '2 years')"),
                "22023",
                "at most 1 year",
            ),
            (
                format!("SELECT once.heartbeat_key('k', {t}, lease => '0')"),
                "22023",
                "lease must be positive",
            ),
            (
                format!("SELECT once.heartbeat_key('k', {t}, lease => '1 month')"),
                "22023",
                "at most 1 day",
            ),
        ];
        let before = snapshot();
        for (sql, state, msg) in &cases {
            assert_error(sql, state, msg);
        }
        assert_eq!(snapshot(), before, "no bad call may change a key");
    }

    #[pg_test]
    fn missing_result_or_error_is_refused() {
        let (_, token) = outcome_and_token("k");
        let before = snapshot();
        assert_error(
            &format!("SELECT once.complete_key('k', {token}, NULL)"),
            "22004",
            "result must not be NULL",
        );
        assert_error(
            &format!("SELECT once.fail_key('k', {token}, NULL)"),
            "22004",
            "error must not be NULL",
        );
        assert_eq!(snapshot(), before);
        // 'null'::jsonb is a value, and a fine result.
        assert_eq!(
            one::<bool>(&format!("SELECT once.complete_key('k', {token}, 'null')")),
            Some(true)
        );
    }

    #[pg_test]
    fn payloads_and_errors_past_their_limits_are_refused() {
        let (_, token) = outcome_and_token("k");
        Spi::run("SET LOCAL once.max_payload_size = '1kB'").unwrap();
        Spi::run("SET LOCAL once.max_error_size = '1kB'").unwrap();
        let before = snapshot();
        assert_error(
            "SELECT once.enqueue_key('job', jsonb_build_object('blob', repeat('x', 2000)))",
            "54000",
            "more than once.max_payload_size (1 kB)",
        );
        assert_error(
            &format!("SELECT once.fail_key('k', {token}, repeat('é', 513))"),
            "54000",
            "error is 1026 bytes, more than once.max_error_size (1 kB)",
        );
        assert_eq!(snapshot(), before, "a refused call writes nothing");
        // The hint says what to do instead.
        let hint = hint_of("SELECT once.enqueue_key('job', to_jsonb(repeat('x', 2000)))").unwrap();
        assert!(hint.contains("raise once.max_payload_size"), "{hint}");
        // Up to the limit is fine.
        assert_eq!(
            text("SELECT once.enqueue_key('job', to_jsonb(repeat('x', 100)))"),
            "queued"
        );
        assert_eq!(
            one::<bool>(&format!(
                "SELECT once.fail_key('k', {token}, repeat('e', 1024))"
            )),
            Some(true)
        );
    }

    #[pg_test]
    fn poll_interval_has_a_floor() {
        // Any role may set it, but not into a busy loop (src/runtime/guc.rs).
        assert_error(
            "SET LOCAL once.poll_interval = '1ms'",
            "22023",
            // PostgreSQL 17 writes the range with its units ("10 ms .. 60000 ms").
            "is outside the valid range for parameter \"once.poll_interval\" (10",
        );
        Spi::run("SET LOCAL once.poll_interval = '10ms'").unwrap();
    }

    #[pg_test]
    fn errors_carry_a_hint() {
        let hint = hint_of("SELECT once.claim_key('x', lease => '0')").unwrap();
        assert!(hint.contains("heartbeat_key"), "{hint}");
    }

    #[pg_test]
    fn bad_queue_input_is_refused() {
        Spi::run("SELECT once.create_queue('busy')").unwrap();
        Spi::run("SELECT once.enqueue_key('busy', queue => 'busy')").unwrap();
        let cases: &[(&str, &str, &str)] = &[
            (
                "SELECT once.enqueue_key('k', queue => 'nope')",
                "42704",
                "queue \"nope\" does not exist",
            ),
            (
                "SELECT once.claim_next('nope')",
                "42704",
                "queue \"nope\" does not exist",
            ),
            (
                "SELECT once.invalidate_keys(queue => 'nope')",
                "42704",
                "does not exist",
            ),
            ("SELECT once.drop_queue('nope')", "42704", "does not exist"),
            (
                "SELECT once.enqueue_key('k', queue => NULL)",
                "22004",
                "queue must not be NULL",
            ),
            (
                "SELECT once.claim_next('')",
                "22023",
                "queue must not be empty",
            ),
            (
                "SELECT once.enqueue_key(NULL)",
                "22004",
                "key must not be NULL",
            ),
            (
                "SELECT once.enqueue_key('k', priority => NULL)",
                "22004",
                "priority must not be NULL",
            ),
            (
                "SELECT once.enqueue_key('k', refresh => NULL)",
                "22004",
                "refresh must not be NULL",
            ),
            (
                "SELECT once.enqueue_key('k', max_attempts => 0)",
                "22023",
                "max_attempts must be between 1 and 1000",
            ),
            (
                "SELECT once.enqueue_key('k', run_at => 'infinity')",
                "22023",
                "run_at must be a finite time",
            ),
            (
                "SELECT once.claim_next(n => 0)",
                "22023",
                "n must be between 1 and 1000",
            ),
            (
                "SELECT once.claim_next(n => 1001)",
                "22023",
                "n must be between 1 and 1000",
            ),
            (
                "SELECT once.claim_next(n => NULL)",
                "22004",
                "n must not be NULL",
            ),
            (
                "SELECT once.claim_next(lease => '0')",
                "22023",
                "lease must be positive",
            ),
            (
                "SELECT once.claim_next(worker => repeat('w', 257))",
                "22001",
                "the limit is 256 bytes",
            ),
            (
                "SELECT once.create_queue('bad name!')",
                "22023",
                "invalid queue name",
            ),
            (
                "SELECT once.create_queue(NULL)",
                "22004",
                "name must not be NULL",
            ),
            (
                "SELECT once.create_queue('q2', max_attempts => 0)",
                "22023",
                "max_attempts must be between",
            ),
            (
                "SELECT once.create_queue('q2', max_attempts => NULL)",
                "22004",
                "max_attempts must not be NULL",
            ),
            (
                "SELECT once.create_queue('q2', backoff => '0')",
                "22023",
                "backoff must be positive",
            ),
            (
                "SELECT once.create_queue('q2', backoff => '1 hour', max_backoff => '1 minute')",
                "22023",
                "max_backoff",
            ),
            (
                "SELECT once.invalidate_keys()",
                "22023",
                "needs a queue or a key prefix",
            ),
            (
                "SELECT once.invalidate_keys(prefix => '')",
                "22023",
                "prefix must not be empty",
            ),
            (
                "SELECT once.drop_queue('busy')",
                "55006",
                "queue \"busy\" still has 1 keys",
            ),
            (
                "SELECT once.complete_keys(ARRAY['a'], ARRAY[1, 2], ARRAY['1']::jsonb[])",
                "22023",
                "have 1, 2 and 1 elements",
            ),
            (
                "SELECT once.complete_keys(ARRAY['a'], ARRAY[1], ARRAY[NULL]::jsonb[])",
                "22004",
                "results[i] must not be NULL",
            ),
            (
                "SELECT once.complete_keys(ARRAY['a'], ARRAY[0], ARRAY['1']::jsonb[])",
                "22023",
                "token must be positive",
            ),
            (
                "SELECT once.complete_keys(NULL, ARRAY[1], ARRAY['1']::jsonb[])",
                "22004",
                "keys must not be NULL",
            ),
        ];
        let before = snapshot();
        let queues = text("SELECT string_agg(name, ',' ORDER BY name) FROM once.queues");
        for (sql, state, msg) in cases {
            assert_error(sql, state, msg);
        }
        assert_eq!(snapshot(), before);
        assert_eq!(
            text("SELECT string_agg(name, ',' ORDER BY name) FROM once.queues"),
            queues
        );
    }

    #[pg_test]
    fn bad_batch_enqueue_input_is_refused() {
        // Keys that exist, so that a batch written in part would show.
        Spi::run("SELECT once.enqueue_key('old')").unwrap();
        Spi::run("SET LOCAL once.max_payload_size = '1kB'").unwrap();
        let long = format!(
            "SELECT * FROM once.enqueue_keys(ARRAY['fresh', repeat('x', {})])",
            7501
        );
        let cases: &[(&str, &str, &str)] = &[
            (
                "SELECT * FROM once.enqueue_keys(NULL)",
                "22004",
                "keys must not be NULL",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh', NULL])",
                "22004",
                "keys[2] must not be NULL",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh', ''])",
                "22023",
                "keys[2] must not be empty",
            ),
            (&long, "22001", "keys[2] is 7501 bytes long"),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh', 'old'], ARRAY['1']::jsonb[])",
                "22023",
                "keys and payloads have 2 and 1 elements",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], ARRAY['1', '2']::jsonb[])",
                "22023",
                "keys and payloads have 1 and 2 elements",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh', 'old', 'fresh'])",
                "22023",
                "keys[1] and keys[3] are both \"fresh\"",
            ),
            (
                "SELECT * FROM once.enqueue_keys(
                     ARRAY(SELECT 'k' || i FROM generate_series(1, 1001) i))",
                "22023",
                "keys has 1001 elements; enqueue_keys takes at most 1000",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh', 'old'],
                     ARRAY['1', jsonb_build_object('blob', repeat('x', 2000))])",
                "54000",
                "bytes, more than once.max_payload_size (1 kB)",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], queue => 'nope')",
                "42704",
                "queue \"nope\" does not exist",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], queue => NULL)",
                "22004",
                "queue must not be NULL",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], priority => NULL)",
                "22004",
                "priority must not be NULL",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], refresh => NULL)",
                "22004",
                "refresh must not be NULL",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], max_attempts => 1001)",
                "22023",
                "max_attempts must be between 1 and 1000",
            ),
            (
                "SELECT * FROM once.enqueue_keys(ARRAY['fresh'], run_at => '-infinity')",
                "22023",
                "run_at must be a finite time",
            ),
        ];
        let before = snapshot();
        for (sql, state, msg) in cases {
            assert_error(sql, state, msg);
        }
        assert_eq!(snapshot(), before, "a refused batch writes nothing");
        // The limits themselves pass: 1000 keys, a payload of 1 kB.
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM once.enqueue_keys(
                     ARRAY(SELECT 'k' || i FROM generate_series(1, 1000) i))"
            ),
            Some(1000)
        );
        assert_eq!(
            text(
                "SELECT string_agg(outcome, ',') FROM once.enqueue_keys(ARRAY['fresh'],
                     ARRAY[to_jsonb(repeat('x', 100))])"
            ),
            "queued"
        );
    }

    #[pg_test]
    fn bad_namespace_input_is_refused() {
        Spi::run("SELECT once.create_namespace('taken/', 'pg_database_owner')").unwrap();
        Spi::run("SELECT once.claim_key('taken/k')").unwrap();
        Spi::run("SELECT once.claim_key('planted/k')").unwrap();
        let cases: &[(&str, &str, &str)] = &[
            (
                "SELECT once.create_namespace(NULL, 'pg_database_owner')",
                "22004",
                "prefix must not be NULL",
            ),
            (
                "SELECT once.create_namespace('', 'pg_database_owner')",
                "22023",
                "prefix must not be empty",
            ),
            (
                "SELECT once.create_namespace(repeat('p', 7501), 'pg_database_owner')",
                "22001",
                "prefix is 7501 bytes long",
            ),
            (
                "SELECT once.create_namespace('p/', NULL)",
                "22004",
                "owner must not be NULL",
            ),
            (
                "SELECT once.create_namespace('p/', 'pg_database_owner', 'everything')",
                "22023",
                "notify must be 'digest' or 'key'",
            ),
            (
                "SELECT once.create_namespace('p/', 'pg_database_owner', 'digest', NULL)",
                "22004",
                "existing must not be NULL",
            ),
            (
                "SELECT once.create_namespace('p/', 'pg_database_owner', 'digest', 'keep')",
                "22023",
                "existing must be 'refuse', 'purge' or 'adopt'",
            ),
            (
                "SELECT once.create_namespace('planted/', 'pg_database_owner')",
                "55006",
                "1 key under \"planted/\" would become the namespace's",
            ),
            (
                "SELECT once.cached_key('k', NULL)",
                "22004",
                "query must not be NULL",
            ),
            (
                "SELECT once.cached_key('k', 'SELECT 1; DELETE FROM once.queues')",
                "42601",
                "query must be exactly one SELECT statement",
            ),
            (
                "SELECT once.cached_key('k', 'SELECT 1 INTO new_table')",
                "42601",
                "query must be exactly one SELECT statement",
            ),
            (
                "SELECT once.drop_namespace('nope/')",
                "42704",
                "namespace \"nope/\" does not exist",
            ),
            (
                "SELECT once.drop_namespace('taken/')",
                "55006",
                "namespace \"taken/\" still has 1 keys",
            ),
            (
                "SELECT once.create_queue('q3', namespace => 'nope/')",
                "42704",
                "namespace \"nope/\" does not exist",
            ),
            (
                "SELECT once.create_queue('q3', namespace => '')",
                "22023",
                "prefix must not be empty",
            ),
        ];
        let before = snapshot();
        let namespaces = text(
            "SELECT string_agg(prefix, ',' ORDER BY prefix) FROM once_internal.namespace_owners",
        );
        for (sql, state, msg) in cases {
            assert_error(sql, state, msg);
        }
        assert_eq!(snapshot(), before);
        assert_eq!(
            text("SELECT string_agg(prefix, ',' ORDER BY prefix) FROM once_internal.namespace_owners"),
            namespaces
        );
    }

    /// Every call that names no queue uses the default queue: dropping it would break them
    /// all (42704), so it is refused like a queue that still has keys, empty or not.
    #[pg_test]
    fn the_default_queue_cannot_be_dropped() {
        let queues = text("SELECT string_agg(name, ',' ORDER BY name) FROM once.queues");
        assert_error(
            "SELECT once.drop_queue('default')",
            "55006",
            "queue \"default\" cannot be dropped",
        );
        Spi::run("SELECT once.enqueue_key('k')").unwrap();
        assert_error(
            "SELECT once.drop_queue('default')",
            "55006",
            "queue \"default\" cannot be dropped",
        );
        assert_eq!(
            text("SELECT string_agg(name, ',' ORDER BY name) FROM once.queues"),
            queues
        );
        let hint = hint_of("SELECT once.drop_queue('default')").unwrap();
        assert!(
            hint.contains("invalidate_keys(queue => 'default')"),
            "{hint}"
        );
        assert_eq!(text("SELECT key FROM once.claim_next()"), "k");
    }
}
