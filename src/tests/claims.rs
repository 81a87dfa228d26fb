//! The claim lifecycle of one key (claim, complete, fail, heartbeat, release, invalidate)
//! and the fencing tokens that refuse a stale or made-up owner.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{answer, one, outcome_and_token, state_of};
    use pgrx::prelude::*;

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
        // The owner is alive (it is us), so a second look is told to wait, with the owner
        // but never its token (docs/security.md, "Tokens").
        let (outcome, told) = answer("k");
        assert_eq!((outcome.as_str(), told), ("wait", None));
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
    fn invalidate_lets_a_run_end_unserved_then_recomputes_and_drops_a_result() {
        let (_, token) = outcome_and_token("k");
        assert_eq!(one::<bool>("SELECT once.invalidate_key('k')"), Some(true));
        assert_eq!(
            answer("k"),
            ("wait".to_owned(), None),
            "the run keeps its claim: no second computation starts beside it"
        );
        assert_eq!(
            one::<bool>(&format!("SELECT once.complete_key('k', {token}, '1')")),
            Some(true),
            "the run may still complete"
        );
        let (outcome, token) = outcome_and_token("k");
        assert_eq!(
            outcome, "claimed",
            "its result is not served: computed once more"
        );
        one::<bool>(&format!("SELECT once.complete_key('k', {token}, '1')"));
        assert_eq!(one::<bool>("SELECT once.invalidate_key('k')"), Some(true));
        assert_eq!(state_of("k"), None);
        assert_eq!(one::<bool>("SELECT once.invalidate_key('k')"), Some(false));
    }

    #[pg_test]
    fn tokens_increase_across_keys_and_deletions() {
        let (_, a) = outcome_and_token("a");
        // Deletes the running key's row (invalidate_key would let the run end).
        Spi::run("SELECT once.invalidate_keys(prefix => 'a')").unwrap();
        let (_, b) = outcome_and_token("b");
        let (_, a2) = outcome_and_token("a");
        assert!(a < b && b < a2, "{a} {b} {a2}");
    }
}
