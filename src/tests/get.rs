//! once.get: claim_key's hit alone (protocol::claim::get). It must answer a result exactly
//! when claim_key would answer hit, and NULL otherwise, writing nothing.

#[pgrx::pg_schema]
mod tests {
    use crate::tests::{answer, one, outcome_and_token, snapshot, state_of};
    use pgrx::prelude::*;

    /// once.get(key) as text (NULL: None).
    fn get(key: &str) -> Option<String> {
        Spi::get_one_with_args::<String>("SELECT once.get($1)::text", &[key.into()]).unwrap()
    }

    fn complete(key: &str, token: i64, result: &str, options: &str) {
        assert_eq!(
            one::<bool>(&format!(
                "SELECT once.complete_key('{key}', {token}, '{result}'{options})"
            )),
            Some(true)
        );
    }

    #[pg_test]
    fn get_returns_a_fresh_result_and_null_for_every_other_state() {
        // Absent: NULL, and nothing claimed or written.
        assert_eq!(get("k"), None);
        assert_eq!(state_of("k"), None);

        // Running (our own claim, which claim_key answers wait): NULL.
        let (_, token) = outcome_and_token("k");
        assert_eq!(get("k"), None);
        // Done: the result, as claim_key's hit gives it; a JSON null is jsonb 'null'.
        complete("k", token, "{\"v\": 1}", "");
        assert_eq!(get("k").as_deref(), Some("{\"v\": 1}"));
        let (_, token) = outcome_and_token("null");
        complete("null", token, "null", "");
        assert_eq!(get("null").as_deref(), Some("null"));

        // Failed, its failure still served: NULL (claim_key answers failed).
        let (_, token) = outcome_and_token("failed");
        assert_eq!(
            one::<bool>(&format!(
                "SELECT once.fail_key('failed', {token}, 'upstream 503', '1 hour')"
            )),
            Some(true)
        );
        assert_eq!(get("failed"), None);

        // Past its ttl: NULL, without and with a stale window (claim_key claims it, or with
        // serve_stale refreshes it).
        let (_, token) = outcome_and_token("expired");
        complete("expired", token, "1", ", ttl => '1 ms'");
        let (_, token) = outcome_and_token("stale");
        complete("stale", token, "1", ", ttl => '1 ms', stale => '1 hour'");
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        let before = snapshot();
        assert_eq!(get("expired"), None);
        assert_eq!(get("stale"), None);
        assert_eq!(get("absent"), None);
        assert_eq!(get("k").as_deref(), Some("{\"v\": 1}"));
        assert_eq!(snapshot(), before, "get writes nothing");
        // ...and the keys are still claim_key's to settle.
        assert_eq!(answer("expired").0, "claimed");
    }

    #[pg_test]
    fn a_get_that_draws_an_early_refresh_leaves_it_to_the_next_claim_key() {
        // As freshness::hits_draw_early_refreshes_with_beta_and_only_one_runs: each read
        // draws a refresh with probability above 0.8.
        let (_, token) = outcome_and_token("k");
        Spi::run("SELECT pg_sleep(0.05)").unwrap();
        complete("k", token, "1", ", ttl => '1 second', beta => 100");
        let answers: Vec<Option<String>> = (0..20).map(|_| get("k")).collect();
        assert!(
            answers.iter().any(Option::is_none) && answers.iter().flatten().all(|r| r == "1"),
            "a drawn refresh is answered NULL, every other read the result: {answers:?}"
        );
        assert_eq!(state_of("k").as_deref(), Some("done"), "get claims nothing");
        // The next get draws again (its NULL owes the refresh again), so end on a NULL.
        while get("k").is_some() {}
        // The refresh was drawn by the get: claim_key takes it without drawing again, even
        // though, with beta gone, it would draw nothing itself.
        Spi::run("UPDATE once.entries SET beta = NULL WHERE key = 'k'").unwrap();
        let (outcome, refresher) = answer("k");
        assert_eq!(
            outcome, "claimed",
            "a refresh, answered claimed without serve_stale"
        );
        assert!(refresher.unwrap() > token);
        // The debt is paid once: the fresh result is served while it is recomputed.
        assert_eq!(get("k").as_deref(), Some("1"));
    }

    #[pg_test]
    fn a_debt_is_paid_only_by_the_result_that_drew_it() {
        let (_, token) = outcome_and_token("k");
        Spi::run("SELECT pg_sleep(0.05)").unwrap();
        complete("k", token, "1", ", ttl => '1 second', beta => 100");
        while get("k").is_some() {}
        // Another result since (another token): it draws for itself, and without beta
        // never does.
        Spi::run("SELECT once.invalidate_key('k')").unwrap();
        let (_, token) = outcome_and_token("k");
        complete("k", token, "2", ", ttl => '1 hour'");
        assert_eq!(answer("k").0, "hit");
        assert_eq!(get("k").as_deref(), Some("2"));
    }

    #[pg_test]
    fn get_counts_a_hit_in_once_stats() {
        let (_, token) = outcome_and_token("k");
        complete("k", token, "1", "");
        let hits = one::<i64>("SELECT hits FROM once.stats").unwrap();
        assert_eq!(get("absent"), None);
        assert_eq!(get("k").as_deref(), Some("1"));
        assert!(one::<i64>("SELECT hits FROM once.stats").unwrap() > hits);
    }
}
