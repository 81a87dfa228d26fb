//! Single-session tests of the state machine and of every bad-input rule.
//! Each #[pg_test] runs in one transaction that is rolled back afterwards, so these cannot
//! see NOTIFY delivery, other sessions or crashes: pg_test/ covers those.

#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// Run one SQL statement and return its single value.
    fn one<T: FromDatum + IntoDatum>(sql: &str) -> Option<T> {
        Spi::get_one::<T>(sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    fn outcome_and_token(key: &str) -> (String, i64) {
        let (outcome, token) = Spi::get_two_with_args::<String, i64>(
            "SELECT outcome, token FROM once.claim_key($1)",
            &[key.into()],
        )
        .unwrap();
        (outcome.unwrap(), token.unwrap())
    }

    /// The SQLSTATE and message of the error `sql` raises, or None if it succeeds.
    /// A PL/pgSQL exception block rolls back just the failed statement, like a client would.
    fn error_of(sql: &str) -> Option<String> {
        Spi::run(
            "CREATE OR REPLACE FUNCTION pg_temp.error_of(sql text) RETURNS text
             LANGUAGE plpgsql AS $$
             BEGIN EXECUTE sql; RETURN NULL;
             EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE || ': ' || SQLERRM; END $$",
        )
        .unwrap();
        Spi::get_one_with_args::<String>("SELECT pg_temp.error_of($1)", &[sql.into()]).unwrap()
    }

    fn assert_error(sql: &str, sqlstate: &str, message_part: &str) {
        let error = error_of(sql).unwrap_or_else(|| panic!("{sql} succeeded; expected {sqlstate}"));
        assert!(
            error.starts_with(&format!("{sqlstate}: ")) && error.contains(message_part),
            "{sql}: expected {sqlstate} mentioning {message_part:?}, got {error:?}"
        );
    }

    /// Everything about every key, to prove a failed call changed nothing.
    fn snapshot() -> String {
        one::<String>(
            "SELECT coalesce(string_agg(e::text, ',' ORDER BY key), '') FROM once.entries e",
        )
        .unwrap()
    }

    fn state_of(key: &str) -> Option<String> {
        Spi::get_one_with_args::<String>(
            "SELECT (SELECT state::text FROM once.entries WHERE key_hash = once.key_hash($1))",
            &[key.into()],
        )
        .unwrap()
    }

    /// Make the owner of `key` look like a backend that has exited.
    fn kill_owner(key: &str) {
        Spi::run_with_args(
            "UPDATE once.entries SET owner_pid = 2147483647 WHERE key_hash = once.key_hash($1)",
            &[key.into()],
        )
        .unwrap();
    }

    #[pg_test]
    fn cold_key_is_claimed_then_waited_for_by_its_own_session() {
        let (outcome, token) = outcome_and_token("k");
        assert_eq!(outcome, "claimed");
        assert!(token > 0);
        let owner = one::<String>("SELECT owner FROM once.entries WHERE key = 'k'").unwrap();
        assert!(
            owner.contains(&format!("pid {}", std::process::id())),
            "{owner}"
        );
        // The owner is alive (it is us), so a second look is told to wait, with the owner.
        let (outcome, same) = outcome_and_token("k");
        assert_eq!((outcome.as_str(), same), ("wait", token));
    }

    #[pg_test]
    fn completed_result_is_a_hit_and_cannot_be_overwritten() {
        let (_, token) = outcome_and_token("k");
        let completed = Spi::get_one_with_args::<bool>(
            "SELECT once.complete_key('k', $1, '{\"v\": 1}')",
            &[token.into()],
        );
        assert_eq!(completed.unwrap(), Some(true));
        let (outcome, result, attempts) = Spi::get_three::<String, pgrx::JsonB, i32>(
            "SELECT outcome, result, attempts FROM once.claim_key('k')",
        )
        .unwrap();
        assert_eq!(outcome.as_deref(), Some("hit"));
        assert_eq!(result.unwrap().0, serde_json::json!({"v": 1}));
        assert_eq!(attempts, Some(1));
        // The same token, a stale token and a made-up token all bounce off a done key.
        for t in [token, token - 1, token + 1000] {
            let again = Spi::get_one_with_args::<bool>(
                "SELECT once.complete_key('k', $1, '{\"v\": 2}')",
                &[t.into()],
            );
            assert_eq!(again.unwrap(), Some(false), "token {t}");
        }
        assert_eq!(
            one::<String>("SELECT result::text FROM once.entries WHERE key = 'k'").as_deref(),
            Some("{\"v\": 1}")
        );
    }

    #[pg_test]
    fn expired_result_is_claimed_again_with_a_larger_token() {
        let (_, first) = outcome_and_token("k");
        Spi::run(&format!(
            "SELECT once.complete_key('k', {first}, '1', ttl => '1 millisecond')"
        ))
        .unwrap();
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        let (outcome, second) = outcome_and_token("k");
        assert_eq!(outcome, "claimed");
        assert!(second > first);
        assert_eq!(
            one::<bool>("SELECT result IS NULL FROM once.entries WHERE key = 'k'"),
            Some(true)
        );
        assert_eq!(
            one::<i32>("SELECT attempts FROM once.entries WHERE key = 'k'"),
            Some(1)
        );
    }

    #[pg_test]
    fn failure_is_shared_until_retry_after_then_claimed_again() {
        let (_, token) = outcome_and_token("k");
        let failed = one::<bool>(&format!(
            "SELECT once.fail_key('k', {token}, 'upstream 503', retry_after => '1 hour')"
        ));
        assert_eq!(failed, Some(true));
        let (outcome, error, retry_in_future) = Spi::get_three::<String, String, bool>(
            "SELECT outcome, error, retry_at > now() FROM once.claim_key('k')",
        )
        .unwrap();
        assert_eq!(outcome.as_deref(), Some("failed"));
        assert_eq!(error.as_deref(), Some("upstream 503"));
        assert_eq!(retry_in_future, Some(true));
        assert_eq!(
            one::<i32>("SELECT errors FROM once.entries WHERE key = 'k'"),
            Some(1)
        );

        // Once retry_at has passed, the next caller gets the claim: attempt 2.
        Spi::run("UPDATE once.entries SET retry_at = clock_timestamp() - interval '1 second'")
            .unwrap();
        let (outcome, attempts) =
            Spi::get_two::<String, i32>("SELECT outcome, attempts FROM once.claim_key('k')")
                .unwrap();
        assert_eq!(outcome.as_deref(), Some("claimed"));
        assert_eq!(attempts, Some(2));
    }

    #[pg_test]
    fn failure_with_no_retry_after_is_claimable_at_once() {
        let (_, token) = outcome_and_token("k");
        one::<bool>(&format!("SELECT once.fail_key('k', {token}, 'oops')"));
        assert_eq!(outcome_and_token("k").0, "claimed");
    }

    #[pg_test]
    fn heartbeat_extends_the_lease_only_for_the_current_token() {
        let (_, token) = outcome_and_token("k");
        let before = one::<pgrx::datum::TimestampWithTimeZone>(
            "SELECT lease_expires_at FROM once.entries WHERE key = 'k'",
        )
        .unwrap();
        let extended = one::<bool>(&format!(
            "SELECT once.heartbeat_key('k', {token}, '1 hour') > '{before}'::timestamptz + interval '50 minutes'"
        ));
        assert_eq!(extended, Some(true));
        let stale = one::<pgrx::datum::TimestampWithTimeZone>(&format!(
            "SELECT once.heartbeat_key('k', {})",
            token + 1
        ));
        assert!(stale.is_none());
    }

    #[pg_test]
    fn release_makes_the_key_absent_and_its_token_useless() {
        let (_, token) = outcome_and_token("k");
        assert_eq!(
            one::<bool>(&format!("SELECT once.release_key('k', {token})")),
            Some(true)
        );
        assert_eq!(state_of("k"), None);
        assert_eq!(
            one::<bool>(&format!("SELECT once.release_key('k', {token})")),
            Some(false)
        );
        let (outcome, next) = outcome_and_token("k");
        assert_eq!(outcome, "claimed");
        assert!(next > token);
        // The released token cannot complete the new claim.
        assert_eq!(
            one::<bool>(&format!("SELECT once.complete_key('k', {token}, '1')")),
            Some(false)
        );
    }

    #[pg_test]
    fn invalidate_cancels_a_claim_and_drops_a_result() {
        let (_, token) = outcome_and_token("k");
        assert_eq!(one::<bool>("SELECT once.invalidate_key('k')"), Some(true));
        assert_eq!(
            one::<bool>(&format!("SELECT once.complete_key('k', {token}, '1')")),
            Some(false),
            "a cancelled owner's completion is refused"
        );
        let (_, token) = outcome_and_token("k");
        one::<bool>(&format!("SELECT once.complete_key('k', {token}, '1')"));
        assert_eq!(one::<bool>("SELECT once.invalidate_key('k')"), Some(true));
        assert_eq!(state_of("k"), None);
        assert_eq!(one::<bool>("SELECT once.invalidate_key('k')"), Some(false));
    }

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
        assert_eq!(outcome_and_token("k").0, "wait");
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

    #[pg_test]
    fn tokens_increase_across_keys_and_deletions() {
        let (_, a) = outcome_and_token("a");
        Spi::run("SELECT once.invalidate_key('a')").unwrap();
        let (_, b) = outcome_and_token("b");
        let (_, a2) = outcome_and_token("a");
        assert!(a < b && b < a2, "{a} {b} {a2}");
    }

    #[pg_test]
    fn keys_are_data_stored_verbatim() {
        for key in [
            "it's",
            "back\\slash",
            "new\nline",
            "ünïcødé ✓ 漢字",
            "'; DROP TABLE once.entries; --",
            "\"quoted\"",
        ] {
            let (outcome, _) = outcome_and_token(key);
            assert_eq!(outcome, "claimed", "{key:?}");
            let stored = Spi::get_one_with_args::<String>(
                "SELECT key FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[key.into()],
            )
            .unwrap();
            assert_eq!(stored.as_deref(), Some(key));
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM once.entries"), Some(6));
    }

    #[pg_test]
    fn keys_up_to_7500_bytes_work_end_to_end() {
        let key = "é".repeat(3750); // 7,500 bytes in UTF-8
        let (outcome, token) = outcome_and_token(&key);
        assert_eq!(outcome, "claimed");
        let done = Spi::get_one_with_args::<bool>(
            "SELECT once.complete_key($1, $2, '\"long\"')",
            &[key.as_str().into(), token.into()],
        )
        .unwrap();
        assert_eq!(done, Some(true));
        assert_eq!(outcome_and_token(&key).0, "hit");
    }

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
    fn stored_digest_is_once_key_hash() {
        outcome_and_token("abc");
        assert_eq!(
            one::<bool>("SELECT key_hash = sha256('abc'::bytea) AND key_hash = once.key_hash(key) FROM once.entries"),
            Some(true)
        );
    }

    // ---- bad input: a specific SQLSTATE, a message that names the problem, nothing changed

    #[pg_test]
    fn bad_keys_are_refused() {
        let long = format!("SELECT once.claim_key(repeat('x', {}))", 7501);
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
        assert_eq!(outcome_and_token("k"), ("wait".to_string(), token));
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
    fn errors_carry_a_hint() {
        // Re-raise the hint as the message, so error_of can show it.
        let error = error_of(
            "DO $$ DECLARE h text;
             BEGIN PERFORM once.claim_key('x', lease => '0');
             EXCEPTION WHEN invalid_parameter_value THEN
               GET STACKED DIAGNOSTICS h = PG_EXCEPTION_HINT;
               RAISE EXCEPTION USING MESSAGE = h;
             END $$",
        )
        .unwrap();
        assert!(error.contains("heartbeat_key"), "{error}");
    }

    // ---- queue mode

    fn text(sql: &str) -> String {
        one::<String>(sql).unwrap_or_else(|| panic!("{sql} returned NULL"))
    }

    /// claim_next on queue `q`: (key, token, attempt) of each claimed key.
    fn claim_next(q: &str, n: i32) -> Vec<(String, i64, i32)> {
        Spi::connect(|client| {
            client
                .select(
                    "SELECT key, token, attempt FROM once.claim_next($1, n => $2)",
                    None,
                    &[q.into(), n.into()],
                )
                .unwrap()
                .map(|row| {
                    (
                        row.get::<String>(1).unwrap().unwrap(),
                        row.get::<i64>(2).unwrap().unwrap(),
                        row.get::<i32>(3).unwrap().unwrap(),
                    )
                })
                .collect()
        })
    }

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
        Spi::run("SELECT once.invalidate_key('d')").unwrap();
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

    #[pg_test]
    fn bad_queue_input_is_refused() {
        Spi::run("SELECT once.enqueue_key('busy', queue => 'default')").unwrap();
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
                "SELECT once.drop_queue('default')",
                "55006",
                "still has 1 keys",
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
}
