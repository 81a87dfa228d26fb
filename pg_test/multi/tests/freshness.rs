//! Freshness across real, concurrent connections (docs/sql-reference.md, "Freshness"):
//! stale windows under a crowd, refreshers that fail or die, reruns requested from many
//! connections at once, and once.cached against roles.

use anyhow::Result;
use pg_once_multi::{admin, fresh_key, once, session};
use std::sync::Arc;
use tokio::sync::Barrier;
use tokio_postgres::Client;

/// (outcome, token, result as text, error) of claim_key(key, wait, serve_stale => true).
async fn ask(client: &Client, key: &str, wait: &str) -> Result<Answer> {
    let row = client
        .query_one(
            "SELECT outcome, token, result::text, error
               FROM once.claim_key($1, wait => $2::text::interval, serve_stale => true)",
            &[&key, &wait],
        )
        .await?;
    Ok(Answer {
        outcome: row.get(0),
        token: row.get(1),
        result: row.get(2),
        error: row.get(3),
    })
}

#[derive(Debug)]
struct Answer {
    outcome: String,
    token: Option<i64>,
    result: Option<String>,
    error: Option<String>,
}

/// A key whose result `result` is past its ttl, in a stale window of an hour.
async fn stale_key(client: &Client, key: &str, result: &str) -> Result<()> {
    client
        .execute(
            "SELECT once.complete_key($1, (once.claim_key($1)).token, to_jsonb($2::text),
                                      ttl => '1 microsecond', stale => '1 hour')",
            &[&key, &result],
        )
        .await?;
    Ok(())
}

async fn complete(
    client: &Client,
    key: &str,
    token: i64,
    result: &str,
    options: &str,
) -> Result<bool> {
    Ok(client
        .query_one(
            &format!("SELECT once.complete_key($1, $2, to_jsonb($3::text){options})"),
            &[&key, &token, &result],
        )
        .await?
        .get(0))
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_callers_per_stale_window_get_one_refresh_and_the_old_result_at_once(
) -> Result<()> {
    let _ = admin().await?;
    let key = fresh_key("crowd");
    let callers = 200;
    let mut clients = Vec::with_capacity(callers);
    for _ in 0..callers {
        clients.push(Arc::new(session().await?));
    }
    stale_key(&clients[0], &key, "result 0").await?;
    for window in 1..=3 {
        let old = format!("result {}", window - 1);
        let barrier = Arc::new(Barrier::new(callers));
        let mut tasks = Vec::new();
        for client in &clients {
            let (client, barrier, key) = (client.clone(), barrier.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                // A wait of 10 s: a caller told anything but refresh or stale would have
                // waited for the refresher, which does not complete while they ask.
                ask(&client, &key, "10 seconds").await
            }));
        }
        let mut refreshes = Vec::new();
        for task in tasks {
            let answer = task.await??;
            assert_eq!(
                answer.result.as_deref(),
                Some(&*format!("\"{old}\"")),
                "{answer:?}"
            );
            match answer.outcome.as_str() {
                "refresh" => refreshes.push(answer.token.unwrap()),
                "stale" => {}
                other => panic!("window {window}: {other}: {answer:?}"),
            }
        }
        assert_eq!(
            refreshes.len(),
            1,
            "window {window}: one refresh among {callers} callers"
        );
        // The refresher's result replaces the old one for everyone, until it too goes
        // stale and the next window begins.
        let new = format!("result {window}");
        let options = ", ttl => '200 ms', stale => '1 hour'";
        assert!(complete(&clients[0], &key, refreshes[0], &new, options).await?);
        assert_eq!(ask(&clients[1], &key, "0").await?.outcome, "hit");
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_refresher_leaves_the_old_result_served_and_the_next_caller_refreshes(
) -> Result<()> {
    let admin = admin().await?;
    let key = fresh_key("killed-refresher");
    let refresher = session().await?;
    let reader = session().await?;
    stale_key(&admin, &key, "old").await?;
    let first = ask(&refresher, &key, "0").await?;
    assert_eq!(first.outcome, "refresh");
    assert_eq!(ask(&reader, &key, "10 seconds").await?.outcome, "stale");
    once::terminate_backend(&admin, once::backend_pid(&refresher).await?).await?;
    // When preloaded, the worker reaps the dead refresher's claim as its backend exits; a
    // caller that comes while the reap's transaction is open is served the old result
    // (a stale answer never waits) and the next one refreshes. So: stale answers with the
    // old result, then one refresh, within a few seconds.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let next = loop {
        let answer = ask(&reader, &key, "10 seconds").await?;
        if answer.outcome != "stale" || std::time::Instant::now() > deadline {
            break answer;
        }
        assert_eq!(answer.result.as_deref(), Some("\"old\""), "{answer:?}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert_eq!(
        (next.outcome.as_str(), next.result.as_deref()),
        ("refresh", Some("\"old\"")),
        "the dead refresher's claim is taken over, the old result kept"
    );
    assert!(next.token > first.token);
    let late: bool = admin
        .query_one(
            "SELECT once.complete_key($1, $2, '\"zombie\"', ttl => '1 hour')",
            &[&key, &first.token.unwrap()],
        )
        .await?
        .get(0);
    assert!(!late, "the dead refresher's token is fenced");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_refresh_keeps_the_old_result_served_and_then_the_next_caller_refreshes(
) -> Result<()> {
    let admin = admin().await?;
    let key = fresh_key("failed-refresh");
    let reader = session().await?;
    stale_key(&admin, &key, "old").await?;
    let refresh = ask(&admin, &key, "0").await?;
    assert_eq!(refresh.outcome, "refresh");
    admin
        .execute(
            "SELECT once.fail_key($1, $2, 'upstream 503', retry_after => '300 ms')",
            &[&key, &refresh.token.unwrap()],
        )
        .await?;
    let served = ask(&reader, &key, "10 seconds").await?;
    assert_eq!(
        (
            served.outcome.as_str(),
            served.result.as_deref(),
            served.error.as_deref()
        ),
        ("stale", Some("\"old\""), Some("upstream 503"))
    );
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let next = ask(&reader, &key, "10 seconds").await?;
    assert_eq!(
        (next.outcome.as_str(), next.result.as_deref()),
        ("refresh", Some("\"old\""))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn many_recompute_requests_from_many_connections_during_a_run_give_one_more_run() -> Result<()>
{
    let admin = admin().await?;
    let key = fresh_key("reruns");
    let owner = session().await?;
    let run = ask(&owner, &key, "0").await?;
    assert_eq!(run.outcome, "claimed");
    let requesters = 50;
    let barrier = Arc::new(Barrier::new(requesters));
    let mut tasks = Vec::new();
    for i in 0..requesters {
        let (barrier, key) = (barrier.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let client = session().await?;
            barrier.wait().await;
            // Every way of asking, mixed.
            let sql = match i % 3 {
                0 => "SELECT once.refresh_key($1, stale => '1 hour')::text",
                1 => "SELECT once.refresh_key($1)::text",
                _ => "SELECT once.invalidate_key($1)::text",
            };
            let answer: String = client.query_one(sql, &[&key]).await?.get(0);
            anyhow::Ok(answer)
        }));
    }
    for task in tasks {
        let answer = task.await??;
        assert!(answer == "rerun" || answer == "true", "{answer}");
    }
    assert_eq!(
        ask(&admin, &key, "0").await?.outcome,
        "wait",
        "no second run meanwhile"
    );
    assert!(
        complete(
            &owner,
            &key,
            run.token.unwrap(),
            "run 1",
            ", ttl => '1 hour'"
        )
        .await?
    );
    // Exactly one more run: every caller but one is told to wait for it.
    let mut runs = Vec::new();
    for client in [&admin, &owner] {
        let answer = ask(client, &key, "0").await?;
        if answer.outcome == "claimed" || answer.outcome == "refresh" {
            runs.push(answer.token.unwrap());
        } else {
            assert_eq!(answer.outcome, "wait", "{answer:?}");
        }
    }
    assert_eq!(runs.len(), 1);
    assert!(complete(&owner, &key, runs[0], "run 2", ", ttl => '1 hour'").await?);
    assert_eq!(ask(&admin, &key, "0").await?.outcome, "hit", "and no third");
    Ok(())
}

/// CALL once.cached: the claim is committed before the query runs, so the other callers
/// wait for it (and are woken) as for any claim: ten callers at once run the query once.
#[tokio::test(flavor = "multi_thread")]
async fn called_in_autocommit_cached_runs_its_query_once_for_everyone() -> Result<()> {
    let admin = admin().await?;
    let key = fresh_key("cached-call");
    let sequence = format!("public.\"{}\"", key.replace('"', ""));
    admin
        .batch_execute(&format!("CREATE SEQUENCE {sequence}"))
        .await?;
    let query = format!(
        "SELECT nextval('{}') AS run, pg_sleep(0.3)::text AS slept",
        sequence.replace('\'', "''")
    );
    let barrier = Arc::new(Barrier::new(10));
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (barrier, key, query) = (barrier.clone(), key.clone(), query.clone());
        tasks.push(tokio::spawn(async move {
            let client = session().await?;
            barrier.wait().await;
            let row = client
                .query_one(
                    "CALL once.cached($1, $2, NULL, ttl => '1 hour')",
                    &[&key, &query],
                )
                .await?;
            anyhow::Ok(row.get::<_, serde_json::Value>(0))
        }));
    }
    for task in tasks {
        assert_eq!(task.await??, serde_json::json!([{"run": 1, "slept": ""}]));
    }
    admin
        .batch_execute(&format!("DROP SEQUENCE {sequence}"))
        .await?;
    Ok(())
}

/// CALL once.cached: a failing query's error is recorded and shared until retry_after,
/// as any pg_once failure: the next caller of the same role and query gets it (38000, not
/// the query's own 22012) without running the query.
/// A caller refused by a privilege check leaves no failure behind.
#[tokio::test(flavor = "multi_thread")]
async fn called_in_autocommit_cached_shares_a_failure() -> Result<()> {
    let admin = admin().await?;
    let first = session().await?;
    let second = session().await?;
    let key = fresh_key("cached-failure");
    let call = "CALL once.cached($1, $2, NULL, ttl => '1 hour', retry_after => '1 hour')";
    // Fails when run, not when planned (a constant 1 / 0 would fail in the planner too).
    let broken = "SELECT 1 / (random() * 0)::int AS x";
    let error = first
        .query_one(call, &[&key, &broken])
        .await
        .expect_err("the query fails");
    assert_eq!(
        error.as_db_error().map(|e| e.code().code()),
        Some("22012"),
        "{error}"
    );
    let shared = second
        .query_one(call, &[&key, &broken])
        .await
        .expect_err("the failure is shared");
    let db = shared.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "38000");
    assert!(
        db.message().contains("division by zero"),
        "{}",
        db.message()
    );

    // A role that may not read the table: refused, and the key is left as it was.
    let denied = fresh_key("cached-denied");
    admin
        .batch_execute(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'cached_nobody') THEN
                     CREATE ROLE cached_nobody;
                 END IF;
             END $$;
             GRANT USAGE ON SCHEMA once TO cached_nobody;
             GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO cached_nobody;
             CREATE TABLE IF NOT EXISTS public.cached_secret (v int);",
        )
        .await?;
    first.batch_execute("SET ROLE cached_nobody").await?;
    let refused = first
        .query_one(call, &[&denied, &"SELECT v FROM public.cached_secret"])
        .await
        .expect_err("no SELECT on the table");
    assert_eq!(
        refused.as_db_error().map(|e| e.code().code()),
        Some("42501"),
        "{refused}"
    );
    first.batch_execute("RESET ROLE").await?;
    let state: Option<String> = admin
        .query_one(
            "SELECT (SELECT state::text FROM once.entries WHERE key_hash = once.key_hash($1))",
            &[&denied],
        )
        .await?
        .get(0);
    assert_eq!(state, None, "released, not failed");
    Ok(())
}

/// CALL once.cached: a query cancelled by statement_timeout ends with 57014, and the claim
/// it had committed is given back, so the next caller computes at once instead of waiting
/// for the lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_cached_call_gives_its_claim_back() -> Result<()> {
    let admin = admin().await?;
    let caller = session().await?;
    let key = fresh_key("cached-cancelled");
    caller
        .batch_execute("SET statement_timeout = '300ms'")
        .await?;
    let cancelled = caller
        .query_one(
            "CALL once.cached($1, 'SELECT pg_sleep(5)::text AS slept', NULL, ttl => '1 hour')",
            &[&key],
        )
        .await
        .expect_err("statement_timeout cancels the query");
    assert_eq!(
        cancelled.as_db_error().map(|e| e.code().code()),
        Some("57014"),
        "{cancelled}"
    );
    let state: Option<String> = admin
        .query_one(
            "SELECT (SELECT state::text FROM once.entries WHERE key_hash = once.key_hash($1))",
            &[&key],
        )
        .await?
        .get(0);
    assert_eq!(state, None, "released, not left running nor failed");
    Ok(())
}
