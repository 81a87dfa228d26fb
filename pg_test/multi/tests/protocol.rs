//! The claim protocol across real, separate connections: every claim and completion is
//! committed, notifications are really delivered, owners are really terminated.

use anyhow::Result;
use pg_once_multi::{admin, claims_once_a_lock_passes, fresh_key, once, session, spawn_claim};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::time::timeout;

const LEASE: Duration = Duration::from_secs(30);
const NO_WAIT: Duration = Duration::ZERO;

/// Receive notifications until one on channel `once` carries `key`, or fail after 5 s.
async fn expect_notification(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
    key: &str,
) {
    let found = timeout(Duration::from_secs(5), async {
        while let Some(n) = rx.recv().await {
            if n.channel() == "once" && n.payload() == key {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(found, Ok(true), "no notification with payload {key:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_are_notified_verbatim_on_channel_once() -> Result<()> {
    let _ = admin().await?;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let owner = session().await?;
    let long = format!("{}/{}", fresh_key("long"), "x".repeat(7000));
    let keys = [
        fresh_key("it's \"quoted\""),
        fresh_key("line\nbreak\\backslash"),
        fresh_key("ünïcødé ✓ 漢字 🚀"),
        fresh_key("'; DROP TABLE once.entries; --"),
        long,
    ];
    for key in &keys {
        let claim = once::claim_key(&owner, key, LEASE, NO_WAIT).await?;
        assert!(claim.is("claimed"), "{claim:?}");
        assert!(once::complete_key(&owner, key, claim.token.unwrap(), &json!("r"), None).await?);
        expect_notification(&mut rx, key).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_way_out_of_running_is_notified() -> Result<()> {
    let admin = admin().await?;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let owner = session().await?;
    let claim = |key: String| {
        let owner = &owner;
        async move {
            let c = once::claim_key(owner, &key, LEASE, NO_WAIT).await.unwrap();
            (key, c.token.unwrap())
        }
    };

    let (key, token) = claim(fresh_key("failed")).await;
    once::fail_key(&owner, &key, token, "boom", Duration::from_secs(60)).await?;
    expect_notification(&mut rx, &key).await;

    let (key, token) = claim(fresh_key("released")).await;
    once::release_key(&owner, &key, token).await?;
    expect_notification(&mut rx, &key).await;

    // Removed by invalidate_keys (invalidate_key lets a run end, and recomputes after).
    let (key, _) = claim(fresh_key("invalidated")).await;
    admin
        .execute("SELECT once.invalidate_keys(prefix => $1)", &[&key])
        .await?;
    expect_notification(&mut rx, &key).await;

    // Reaped: the owner's lease has run out. By this reap_stale, or by the preloaded
    // server's worker before it: either way the key leaves running and is announced.
    let key = fresh_key("reaped");
    once::claim_key(&owner, &key, Duration::from_millis(50), NO_WAIT).await?;
    let state = "SELECT state::text FROM once.entries WHERE key = $1";
    while admin
        .query_one(
            "SELECT lease_expires_at > clock_timestamp() FROM once.entries WHERE key = $1",
            &[&key],
        )
        .await?
        .get::<_, Option<bool>>(0)
        == Some(true)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    once::reap_stale(&admin).await?;
    let reaped: String = admin.query_one(state, &[&key]).await?.get(0);
    assert_eq!(reaped, "failed", "a claim past its lease is reaped");
    expect_notification(&mut rx, &key).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn two_sessions_one_claims_one_waits() -> Result<()> {
    let _ = admin().await?;
    let (a, b) = (session().await?, session().await?);
    let key = fresh_key("two");
    let first = once::claim_key(&a, &key, LEASE, NO_WAIT).await?;
    let second = once::claim_key(&b, &key, LEASE, NO_WAIT).await?;
    assert!(first.is("claimed"), "{first:?}");
    assert!(second.is("wait"), "{second:?}");
    // The waiter is told whose claim it waits for, and until when: never its token.
    assert_eq!(second.token, None);
    assert_eq!(second.owner, first.owner);
    assert_eq!(second.lease_expires_at, first.lease_expires_at);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn terminated_owner_is_taken_over_within_a_second() -> Result<()> {
    let admin = admin().await?;
    let (owner, next) = (session().await?, session().await?);
    let key = fresh_key("terminated");
    let long_lease = Duration::from_secs(600);
    let claim = once::claim_key(&owner, &key, long_lease, NO_WAIT).await?;
    assert!(claim.is("claimed"));
    assert!(once::claim_key(&next, &key, LEASE, NO_WAIT)
        .await?
        .is("wait"));

    once::terminate_backend(&admin, once::backend_pid(&owner).await?).await?;
    let terminated = Instant::now();
    let taken = once::claim_key(&next, &key, LEASE, NO_WAIT).await?;
    let took = terminated.elapsed();
    assert!(taken.is("claimed"), "{taken:?}");
    assert!(taken.token > claim.token);
    assert!(
        took < Duration::from_secs(1),
        "took {took:?}, not within a second of a 600 s lease"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn waiter_is_handed_the_claim_when_the_owner_is_terminated() -> Result<()> {
    let admin = admin().await?;
    let (owner, waiter) = (session().await?, session().await?);
    let key = fresh_key("terminated-while-waited");
    assert!(
        once::claim_key(&owner, &key, Duration::from_secs(600), NO_WAIT)
            .await?
            .is("claimed")
    );

    let waiting = spawn_claim(waiter, &key, LEASE, Duration::from_secs(30));
    tokio::time::sleep(Duration::from_millis(200)).await; // the waiter is blocked by now
    once::terminate_backend(&admin, once::backend_pid(&owner).await?).await?;
    let terminated = Instant::now();
    let (claim, returned) = waiting.await?;
    let claim = claim?;
    assert!(claim.is("claimed"), "{claim:?}");
    let took = returned.saturating_duration_since(terminated);
    assert!(
        took < Duration::from_secs(1),
        "waiter got the claim {took:?} after the owner died"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn zombie_completion_after_takeover_is_refused_and_the_newer_result_stands() -> Result<()> {
    let _ = admin().await?;
    let (zombie, successor, reader) = (session().await?, session().await?, session().await?);
    let key = fresh_key("zombie");
    // The zombie claims with a short lease and then stalls past it (a GC pause, say).
    let old = once::claim_key(&zombie, &key, Duration::from_millis(200), NO_WAIT).await?;
    assert!(old.is("claimed"));
    let new = once::claim_key(&successor, &key, LEASE, Duration::from_secs(5)).await?;
    assert!(
        new.is("claimed"),
        "the lease ran out, so the waiter takes over: {new:?}"
    );

    // The zombie wakes up: every write it tries is refused, and changes nothing.
    let (old_token, new_token) = (old.token.unwrap(), new.token.unwrap());
    assert!(once::heartbeat_key(&zombie, &key, old_token, LEASE)
        .await?
        .is_none());
    assert!(!once::complete_key(&zombie, &key, old_token, &json!("stale"), None).await?);
    assert!(!once::fail_key(&zombie, &key, old_token, "late", NO_WAIT).await?);
    assert!(!once::release_key(&zombie, &key, old_token).await?);

    assert!(once::complete_key(&successor, &key, new_token, &json!("fresh"), None).await?);
    // And once more after the successor's completion.
    assert!(!once::complete_key(&zombie, &key, old_token, &json!("stale"), None).await?);
    let hit = once::claim_key(&reader, &key, LEASE, NO_WAIT).await?;
    assert!(hit.is("hit"));
    assert_eq!(hit.result, Some(json!("fresh")));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn failure_is_shared_with_waiters_and_retried_after_retry_after() -> Result<()> {
    let _ = admin().await?;
    let owner = session().await?;
    let key = fresh_key("failure");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let (client, key) = (session().await?, key.clone());
        waiters.push(tokio::spawn(async move {
            once::claim_key(&client, &key, LEASE, Duration::from_secs(10)).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retry_after = Duration::from_secs(1);
    assert!(
        once::fail_key(
            &owner,
            &key,
            claim.token.unwrap(),
            "upstream 503",
            retry_after
        )
        .await?
    );
    let failed_at = Instant::now();
    for w in waiters {
        let got = w.await??;
        assert!(
            got.is("failed"),
            "a waiter must share the failure, not retry: {got:?}"
        );
        assert_eq!(got.error.as_deref(), Some("upstream 503"));
    }
    // Until retry_after has passed, newcomers get the failure too...
    assert!(once::claim_key(&owner, &key, LEASE, NO_WAIT)
        .await?
        .is("failed"));
    // ...and after it, the next caller claims the key again.
    tokio::time::sleep(retry_after.saturating_sub(failed_at.elapsed()) + Duration::from_millis(50))
        .await;
    let retry = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    assert!(retry.is("claimed"), "{retry:?}");
    assert_eq!(retry.attempts, Some(2));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_concurrent_callers_one_computation() -> Result<()> {
    const CALLERS: usize = 200;
    let admin = admin().await?;
    let key = fresh_key("stampede");
    let mut clients = Vec::with_capacity(CALLERS);
    for _ in 0..CALLERS {
        clients.push(session().await?);
    }
    // Everyone asks at the same instant; whoever is told "claimed" computes for 500 ms.
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(CALLERS));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let (key, start) = (key.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let claim = once::claim_key(&client, &key, LEASE, Duration::from_secs(30)).await?;
                if claim.is("claimed") {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let result = json!({"computed_by": claim.token});
                    anyhow::ensure!(
                        once::complete_key(&client, &key, claim.token.unwrap(), &result, None)
                            .await?
                    );
                    return Ok((claim.outcome, Some(result)));
                }
                Ok((claim.outcome, claim.result))
            })
        })
        .collect();
    let mut claimed = 0;
    let mut results = Vec::new();
    for task in tasks {
        let (outcome, result) = task.await??;
        match outcome.as_str() {
            "claimed" => claimed += 1,
            "hit" => {}
            other => panic!("a caller ended with {other}"),
        }
        results.push(result.expect("every caller ends with the result"));
    }
    assert_eq!(claimed, 1, "exactly one caller computes");
    assert_eq!(results.len(), CALLERS);
    assert!(
        results.iter().all(|r| r == &results[0]),
        "all 200 hold the same result"
    );
    let attempts: i32 = admin
        .query_one(
            "SELECT attempts FROM once.entries WHERE key_hash = once.key_hash($1)",
            &[&key],
        )
        .await?
        .get(0);
    assert_eq!(attempts, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn many_waiters_of_a_terminated_owner_end_with_one_new_owner_and_its_result() -> Result<()> {
    // Many waiters race to take the dead owner's claim. The losers must not keep a lock on
    // the winner's row (they did once, and the winner's complete_key then blocked until
    // every loser's wait ran out), so everybody has the result soon after the winner.
    const WAITERS: usize = 40;
    let admin = admin().await?;
    let owner = session().await?;
    let key = fresh_key("terminated-many");
    assert!(
        once::claim_key(&owner, &key, Duration::from_secs(600), NO_WAIT)
            .await?
            .is("claimed")
    );
    let mut waiters = Vec::new();
    for _ in 0..WAITERS {
        let (client, key) = (session().await?, key.clone());
        waiters.push(tokio::spawn(async move {
            let claim = once::claim_key(&client, &key, LEASE, Duration::from_secs(20)).await?;
            if claim.is("claimed") {
                tokio::time::sleep(Duration::from_millis(300)).await;
                once::complete_key(
                    &client,
                    &key,
                    claim.token.unwrap(),
                    &json!("second try"),
                    None,
                )
                .await?;
                return anyhow::Ok(("claimed".to_string(), Some(json!("second try"))));
            }
            Ok((claim.outcome, claim.result))
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    once::terminate_backend(&admin, once::backend_pid(&owner).await?).await?;
    let terminated = Instant::now();
    let mut outcomes = std::collections::BTreeMap::new();
    for w in waiters {
        let (outcome, result) = w.await??;
        assert_eq!(result, Some(json!("second try")), "{outcome}");
        *outcomes.entry(outcome).or_insert(0) += 1;
    }
    assert_eq!(outcomes.get("claimed"), Some(&1), "{outcomes:?}");
    assert_eq!(outcomes.get("hit"), Some(&(WAITERS - 1)), "{outcomes:?}");
    let took = terminated.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "all waiters answered only {took:?} after the takeover"
    );
    Ok(())
}

/// A transaction that resolves a key announces it on channel `once` when it commits, which
/// a prepared transaction cannot do: PREPARE TRANSACTION is refused with 0A000 and pg_once's
/// own message and hint, whether pg_once is preloaded (the keys go to the relay worker) or
/// not (the trigger NOTIFYs), and the transaction is rolled back.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_that_resolves_a_key_cannot_be_prepared() -> Result<()> {
    let admin = admin().await?;
    let owner = session().await?;
    let key = fresh_key("prepared-resolution");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let token = claim.token.expect("claimed");
    let quoted = format!("'{}'", key.replace('\'', "''"));
    let gid = format!("pg_once_prepare_{}", key.replace(['/', '\''], "_"));
    let state = || async {
        let row = admin
            .query_one(
                "SELECT state::text, token FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[&key],
            )
            .await?;
        anyhow::Ok((row.get::<_, String>(0), row.get::<_, i64>(1)))
    };
    for call in [
        format!("SELECT once.complete_key({quoted}, {token}, '\"r\"')"),
        format!("SELECT once.invalidate_keys(prefix => {quoted})"),
    ] {
        let tx = session().await?;
        tx.batch_execute(&format!("BEGIN; {call}")).await?;
        let error = tx
            .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
            .await
            .expect_err("PREPARE TRANSACTION after a resolution must fail");
        let db = error.as_db_error().expect("a server error");
        assert_eq!(
            db.code(),
            &tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED,
            "{call}: {}",
            db.message()
        );
        assert!(
            db.message()
                .starts_with("cannot PREPARE a transaction that completed, failed"),
            "{call}: {}",
            db.message()
        );
        let hint = db.hint().unwrap_or_default();
        assert!(
            hint.contains("outside two-phase commit"),
            "{call}: {hint:?}"
        );
        // Nothing was prepared and nothing committed: the claim stands as it was.
        let prepared: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1",
                &[&gid],
            )
            .await?
            .get(0);
        assert_eq!(prepared, 0, "{call}");
        assert_eq!(state().await?, ("running".to_string(), token), "{call}");
        // The session is usable again, out of the failed transaction.
        tx.batch_execute("SELECT 1").await?;
    }
    // A resolution rolled back to a savepoint announces nothing: that transaction prepares.
    let tx = session().await?;
    tx.batch_execute(&format!(
        "BEGIN; SAVEPOINT s; SELECT once.invalidate_keys(prefix => {quoted}); ROLLBACK TO SAVEPOINT s; \
         PREPARE TRANSACTION '{gid}'"
    ))
    .await?;
    admin
        .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
        .await?;
    assert!(once::complete_key(&owner, &key, token, &json!("r"), None).await?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_without_wait_looks_again_while_a_row_lock_passes() -> Result<()> {
    // A claimable key whose row another transaction has locked for an instant (a
    // heartbeat, a completion, the worker reclaiming the claim) used to be answered `wait`
    // at once with `wait => 0`: the caller then waited for an announcement that may never
    // come. The claim now looks again for up to 100 ms.
    let admin = admin().await?;
    let key = fresh_key("passing-lock");
    let first = once::claim_key(&admin, &key, LEASE, NO_WAIT).await?;
    // Failed, due for retry at once: claimable, and its row stays.
    assert!(once::fail_key(&admin, &key, first.token.unwrap(), "e", Duration::ZERO).await?);
    let lock = format!(
        "BEGIN; SELECT FROM once.entries WHERE key = '{}' FOR UPDATE",
        key.replace('\'', "''")
    );
    // Before, no try was ever claimed. Released as soon as the claim is seen running (it
    // never waits on the row's lock: the SQL edition locks it with SKIP LOCKED).
    claims_once_a_lock_passes(
        &lock,
        || key.clone(),
        "SELECT coalesce(bool_or(state = 'active' AND query LIKE '%claim_key%'), false)
           FROM pg_stat_activity WHERE pid = $1",
    )
    .await
}
