//! Freshness (protocol::freshness, docs/sql-reference.md "Freshness"): stale windows,
//! early refreshes, reruns, jitter, the result-size limit, once.cached. Single-session:
//! pg_test/ proves the same with concurrent callers.

#[pgrx::pg_schema]
mod tests {
    use super::super::*;

    /// (outcome, token, result as text, error) of a claim_key call with serve_stale.
    fn ask(key: &str, serve_stale: bool) -> (String, Option<i64>, Option<String>, Option<String>) {
        Spi::connect(|client| {
            let row = client
                .select(
                    "SELECT outcome, token, result::text, error
                       FROM once.claim_key($1, serve_stale => $2)",
                    None,
                    &[key.into(), serve_stale.into()],
                )
                .unwrap()
                .first();
            (
                row.get::<String>(1).unwrap().unwrap(),
                row.get::<i64>(2).unwrap(),
                row.get::<String>(3).unwrap(),
                row.get::<String>(4).unwrap(),
            )
        })
    }

    fn complete(key: &str, token: i64, result: &str, options: &str) -> bool {
        one::<bool>(&format!(
            "SELECT once.complete_key('{key}', {token}, '{result}'{options})"
        ))
        .unwrap()
    }

    /// A key whose result "1" expired a moment ago and may be served as stale for an hour.
    fn stale_key(key: &str) {
        let (_, token) = outcome_and_token(key);
        assert!(complete(
            key,
            token,
            "1",
            ", ttl => '1 ms', stale => '1 hour'"
        ));
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
    }

    #[pg_test]
    fn in_the_stale_window_one_caller_refreshes_and_the_others_get_the_old_result() {
        stale_key("k");
        let (outcome, token, result, _) = ask("k", true);
        assert_eq!(
            (outcome.as_str(), result.as_deref()),
            ("refresh", Some("1"))
        );
        let token = token.unwrap();
        for _ in 0..3 {
            let (outcome, told, result, _) = ask("k", true);
            assert_eq!(
                (outcome.as_str(), told, result.as_deref()),
                ("stale", None, Some("1")),
                "the old result at once, never the refresher's token"
            );
        }
        // A caller that did not ask for stale answers is told to wait, as before.
        assert_eq!(ask("k", false).0, "wait");
        assert!(complete("k", token, "2", ", ttl => '1 hour'"));
        assert_eq!(ask("k", true).2.as_deref(), Some("2"));
        assert_eq!(ask("k", true).0, "hit");
    }

    #[pg_test]
    fn once_stats_counts_stale_answers_and_refreshes() {
        // Preloaded (pg_test::postgresql_conf_options); other tests count too.
        let count = |column: &str| one::<i64>(&format!("SELECT {column} FROM once.stats")).unwrap();
        let (stale, refreshes) = (count("stale"), count("refreshes"));
        stale_key("k");
        assert_eq!(ask("k", true).0, "refresh");
        assert_eq!(ask("k", true).0, "stale");
        assert!(count("refreshes") > refreshes);
        assert!(count("stale") > stale);
    }

    #[pg_test]
    fn a_refresh_is_claimed_with_the_old_result_for_a_caller_without_serve_stale() {
        stale_key("k");
        let (outcome, token, result, _) = ask("k", false);
        assert_eq!(
            (outcome.as_str(), result.as_deref()),
            ("claimed", Some("1"))
        );
        assert_eq!(ask("k", true).0, "stale", "the old result is still served");
        assert!(complete("k", token.unwrap(), "2", ""));
    }

    #[pg_test]
    fn a_failed_refresh_keeps_the_old_result_served_with_its_error() {
        stale_key("k");
        let (_, token, _, _) = ask("k", true);
        Spi::run(&format!(
            "SELECT once.fail_key('k', {}, 'upstream 503', retry_after => '1 hour')",
            token.unwrap()
        ))
        .unwrap();
        let (outcome, _, result, error) = ask("k", true);
        assert_eq!(
            (outcome.as_str(), result.as_deref(), error.as_deref()),
            ("stale", Some("1"), Some("upstream 503"))
        );
        assert_eq!(ask("k", false).0, "failed", "old callers see the failure");
        // Once its retry time has come, the next caller refreshes.
        Spi::run("UPDATE once.entries SET retry_at = clock_timestamp() WHERE key = 'k'").unwrap();
        let (outcome, _, result, _) = ask("k", true);
        assert_eq!(
            (outcome.as_str(), result.as_deref()),
            ("refresh", Some("1"))
        );
    }

    #[pg_test]
    fn a_dead_or_released_refresher_leaves_the_old_result_and_the_next_caller_refreshes() {
        stale_key("k");
        let (_, first, _, _) = ask("k", true);
        kill_owner("k");
        let (outcome, second, result, _) = ask("k", true);
        assert_eq!(
            (outcome.as_str(), result.as_deref()),
            ("refresh", Some("1"))
        );
        assert!(second > first);
        assert_eq!(
            one::<bool>(&format!(
                "SELECT once.release_key('k', {})",
                second.unwrap()
            )),
            Some(true)
        );
        assert_eq!(state_of("k").as_deref(), Some("done"));
        let (outcome, _, result, _) = ask("k", true);
        assert_eq!(
            (outcome.as_str(), result.as_deref()),
            ("refresh", Some("1"))
        );
    }

    #[pg_test]
    fn after_the_stale_window_the_key_is_computed_as_if_cold() {
        let (_, token) = outcome_and_token("k");
        assert!(complete(
            "k",
            token,
            "1",
            ", ttl => '1 ms', stale => '2 ms'"
        ));
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        let (outcome, _, result, _) = ask("k", true);
        assert_eq!((outcome.as_str(), result), ("claimed", None));
        assert_eq!(ask("k", true).0, "wait");
    }

    #[pg_test]
    fn reap_stale_purges_a_result_only_once_its_stale_window_is_over() {
        stale_key("in-window");
        let (_, token) = outcome_and_token("expired");
        assert!(complete("expired", token, "1", ", ttl => '1 ms'"));
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        assert_eq!(one::<i64>("SELECT expired FROM once.reap_stale()"), Some(1));
        assert_eq!(state_of("expired"), None);
        assert_eq!(state_of("in-window").as_deref(), Some("done"));
        assert_eq!(
            one::<i64>("SELECT expired_unpurged FROM once.stats"),
            Some(0),
            "a result in its stale window is still served"
        );
    }

    #[pg_test]
    fn hits_draw_early_refreshes_with_beta_and_only_one_runs() {
        // delta (claim to completion) is ~50 ms; with beta 100, beta * delta = 5 s against
        // a ttl of 1 s: each hit draws a refresh with probability above 0.8.
        let (_, token) = outcome_and_token("k");
        Spi::run("SELECT pg_sleep(0.05)").unwrap();
        assert!(complete(
            "k",
            token,
            "1",
            ", ttl => '1 second', beta => 100"
        ));
        let answers: Vec<(String, Option<i64>)> = (0..20)
            .map(|_| {
                let (outcome, token, _, _) = ask("k", true);
                (outcome, token)
            })
            .collect();
        // Only the refresh, the claim, carries a token: a hit served while it runs must
        // not hand out the refresher's (anyone holding it could end that claim).
        assert!(
            answers
                .iter()
                .all(|(outcome, token)| token.is_some() == (outcome == "refresh")),
            "{answers:?}"
        );
        let outcomes: Vec<String> = answers.into_iter().map(|(o, _)| o).collect();
        let first = outcomes.iter().position(|o| o == "refresh");
        assert!(first.is_some(), "{outcomes:?}");
        assert!(
            outcomes.iter().filter(|o| *o == "refresh").count() == 1
                && outcomes.iter().all(|o| o == "hit" || o == "refresh"),
            "one refresh at a time, everyone else keeps getting hit: {outcomes:?}"
        );
        assert!(
            one::<bool>("SELECT compute_time >= '50 ms' FROM once.entries WHERE key = 'k'")
                .unwrap()
        );
    }

    #[pg_test]
    fn without_beta_hits_never_refresh_early() {
        let (_, token) = outcome_and_token("k");
        Spi::run("SELECT pg_sleep(0.05)").unwrap();
        assert!(complete("k", token, "1", ", ttl => '1 second'"));
        assert!((0..200).all(|_| ask("k", true).0 == "hit"));
    }

    #[pg_test]
    fn jitter_spreads_the_expiries_of_keys_filled_together() {
        Spi::run(
            "SELECT once.complete_key(k, (once.claim_key(k)).token, '1',
                                      ttl => '100 seconds', jitter => 0.5)
               FROM (SELECT 'j' || i AS k FROM generate_series(1, 200) i) keys",
        )
        .unwrap();
        let spread = text(
            "SELECT count(DISTINCT expires_at) || ' '
                    || (min(expires_at - clock_timestamp()) BETWEEN '49 s' AND '60 s') || ' '
                    || (max(expires_at - clock_timestamp()) BETWEEN '90 s' AND '100 s')
               FROM once.entries WHERE key LIKE 'j%'",
        );
        assert_eq!(spread, "200 true true");
    }

    #[pg_test]
    fn many_recompute_requests_during_a_run_give_exactly_one_more_run() {
        let (_, token) = outcome_and_token("k");
        for _ in 0..5 {
            assert_eq!(
                text("SELECT once.refresh_key('k', stale => '1 hour')"),
                "rerun"
            );
        }
        assert_eq!(ask("k", true).0, "wait", "no second computation meanwhile");
        assert!(complete("k", token, "1", ", ttl => '1 hour'"));
        // The run's result is served as stale, as asked, while one more run computes.
        let (outcome, rerun, result, _) = ask("k", true);
        assert_eq!(
            (outcome.as_str(), result.as_deref()),
            ("refresh", Some("1"))
        );
        assert_eq!(ask("k", true).0, "stale");
        assert!(complete("k", rerun.unwrap(), "2", ", ttl => '1 hour'"));
        assert_eq!(ask("k", true).0, "hit", "exactly one more run");
        assert_eq!(text("SELECT once.refresh_key('nope')"), "absent");
        assert_eq!(text("SELECT once.refresh_key('k')"), "expired");
        assert_eq!(ask("k", true).0, "claimed", "without stale, not served");
    }

    #[pg_test]
    fn a_queued_key_enqueued_again_while_it_runs_runs_once_more_after() {
        Spi::run("SELECT once.enqueue_key('q', '{\"v\": 1}')").unwrap();
        let claimed = claim_next("default", 1);
        assert_eq!(
            text("SELECT once.enqueue_key('q', '{\"v\": 2}', refresh => true)"),
            "requeued"
        );
        assert_eq!(
            text("SELECT once.enqueue_key('q', '{\"v\": 3}', refresh => true)"),
            "requeued"
        );
        assert!(claim_next("default", 1).is_empty(), "not beside its run");
        assert!(complete("q", claimed[0].1, "1", ", ttl => '1 hour'"));
        assert_eq!(ask("q", false).0, "hit", "its result is served meanwhile");
        let again = claim_next("default", 5);
        assert_eq!(again.len(), 1);
        assert_eq!(
            text("SELECT payload::text FROM once.entries WHERE key = 'q'"),
            "{\"v\": 3}"
        );
        assert!(complete("q", again[0].1, "2", ""));
        assert!(claim_next("default", 5).is_empty(), "exactly one more run");
    }

    #[pg_test]
    fn bad_freshness_options_are_refused_and_change_nothing() {
        let (_, token) = outcome_and_token("k");
        let before = snapshot();
        for (options, part) in [
            (", stale => '1 minute'", "stale needs a ttl"),
            (", beta => 1", "beta needs a ttl"),
            (", jitter => 0.1", "jitter needs a ttl"),
            (", ttl => '1 s', stale => '0'", "stale must be positive"),
            (
                ", ttl => '1 s', beta => -1",
                "beta must be between 0 and 100",
            ),
            (
                ", ttl => '1 s', jitter => 1",
                "jitter must be at least 0 and less than 1",
            ),
        ] {
            assert_error(
                &format!("SELECT once.complete_key('k', {token}, '1'{options})"),
                "22023",
                part,
            );
        }
        assert_error(
            "SELECT once.refresh_key('k', stale => '-1 s')",
            "22023",
            "stale must be positive",
        );
        assert_error(
            "SELECT once.claim_key('k', serve_stale => NULL)",
            "22004",
            "serve_stale must not be NULL",
        );
        assert_eq!(snapshot(), before);
    }

    #[pg_test]
    fn a_result_past_once_max_result_size_is_refused() {
        let (_, token) = outcome_and_token("k");
        Spi::run("SET LOCAL once.max_result_size = '1kB'").unwrap();
        let before = snapshot();
        assert_error(
            &format!("SELECT once.complete_key('k', {token}, to_jsonb(repeat('x', 2000)))"),
            "54000",
            "more than once.max_result_size (1 kB)",
        );
        assert_error(
            &format!(
                "SELECT once.complete_keys(ARRAY['k'], ARRAY[{token}::bigint], ARRAY[to_jsonb(repeat('x', 2000))])"
            ),
            "54000",
            "more than once.max_result_size (1 kB)",
        );
        assert_eq!(snapshot(), before);
        assert!(complete("k", token, "1", ""));
    }

    #[pg_test]
    fn cached_runs_the_query_once_and_as_the_caller() {
        Spi::run(
            "CREATE SEQUENCE public.cached_runs;
             CREATE TABLE public.secret (v int); INSERT INTO public.secret VALUES (42);
             CREATE ROLE cached_reader; CREATE ROLE cached_outsider;
             GRANT USAGE ON SCHEMA once TO cached_reader, cached_outsider;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO cached_reader, cached_outsider;
             GRANT SELECT ON public.secret TO cached_reader;
             GRANT USAGE ON SEQUENCE public.cached_runs TO cached_reader, cached_outsider;",
        )
        .unwrap();
        let query = "SELECT v, nextval('public.cached_runs') AS run FROM public.secret";
        let cached = |key: &str| {
            text(&format!(
                "SELECT once.cached('{key}', $q${query}$q$, ttl => '1 hour')::text"
            ))
        };
        Spi::run("SET LOCAL ROLE cached_reader").unwrap();
        assert_eq!(cached("report"), "[{\"v\": 42, \"run\": 1}]");
        assert_eq!(
            cached("report"),
            "[{\"v\": 42, \"run\": 1}]",
            "not run again"
        );
        Spi::run("RESET ROLE").unwrap();
        Spi::run("SET LOCAL ROLE cached_outsider").unwrap();
        // Neither computed nor served to a role that may not read the table.
        assert_error(
            &format!("SELECT once.cached('report', $q${query}$q$, ttl => '1 hour')"),
            "42501",
            "permission denied for table secret",
        );
        assert_error(
            &format!("SELECT once.cached('other', $q${query}$q$, ttl => '1 hour')"),
            "42501",
            "permission denied for table secret",
        );
        Spi::run("RESET ROLE").unwrap();
        assert_eq!(
            state_of("other"),
            None,
            "a failed computation records nothing"
        );
        assert_error(
            "SELECT once.cached('x', 'SELECT 1', stale => '1 minute')",
            "22023",
            "stale needs a ttl",
        );
        assert_eq!(state_of("x"), None);
    }
}
