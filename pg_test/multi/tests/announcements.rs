//! What one transaction announces on channel `once` is bounded (runtime::notify): up to
//! 1,000 keys and 64 kB of them are announced one by one; past either, the transaction
//! announces the empty payload alone ("some keys resolved: ask again"), and its waiters are
//! answered all the same. scripts/test.sh runs this file against a plain server (the
//! committing backend notifies) and a preloaded one (the worker relays).

use anyhow::Result;
use pg_once_multi::{admin, fresh_key, once, session, spawn_claim};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_postgres::{Client, Notification};

const LEASE: Duration = Duration::from_secs(60);

/// Claim `n` keys `{prefix}/{i}` of `pad` more bytes each, then complete them all in one
/// transaction (one statement).
/// Each claim may wait (10 s) for the locks of the other test's burst: with `wait => 0` a
/// claim that meets the table's extension lock, held by a concurrent bulk insert, gives
/// up at once and answers `wait`.
async fn resolve_in_one_transaction(client: &Client, prefix: &str, n: i32, pad: i32) -> Result<()> {
    client
        .batch_execute(
            "CREATE TEMP TABLE IF NOT EXISTS burst (key text, token bigint); TRUNCATE burst",
        )
        .await?;
    client
        .execute(
            "INSERT INTO burst
             SELECT k, (once.claim_key(k, wait => '10 seconds', owner_pid => 0)).token
               FROM (SELECT $1 || '/' || i || repeat('x', $3) AS k FROM generate_series(1, $2) i) s",
            &[&prefix, &n, &pad],
        )
        .await?;
    let completed: i64 = client
        .query_one(
            "SELECT count(*) FROM burst WHERE once.complete_key(key, token, '1')",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(completed, i64::from(n));
    Ok(())
}

/// Payloads heard within `within`, counted: those starting with `prefix` under the
/// prefix, the empty one under "".
async fn heard(
    rx: &mut UnboundedReceiver<Notification>,
    prefix: &str,
    within: Duration,
) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    let _ = tokio::time::timeout(within, async {
        while let Some(n) = rx.recv().await {
            let payload = n.payload();
            if payload.is_empty() {
                *counts.entry(String::new()).or_default() += 1;
            } else if payload.starts_with(prefix) {
                *counts.entry(prefix.to_owned()).or_default() += 1;
            }
        }
    })
    .await;
    counts
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_past_the_bounds_announces_only_that_something_changed() -> Result<()> {
    let _ = admin().await?;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let owner = session().await?;
    for mode in ["relay", "direct"] {
        owner
            .batch_execute(&format!("SET once.notify = {mode}"))
            .await?;
        // Past the count: 1,500 keys. One of them has a waiter, which must be answered.
        // Each claim may wait: `wait => 0` answers `wait` rather than queue behind a
        // passing lock (the worker's rounds), and on a saturated machine one in a thousand
        // did, failing the setup rather than what is tested.
        let prefix = fresh_key("many");
        let waited = format!("{prefix}/750");
        let claims: i64 = owner
            .query_one(
                "SELECT count(*) FROM generate_series(1, 1500) i,
                        once.claim_key($1 || '/' || i, wait => '10 seconds', owner_pid => 0) c
                  WHERE c.outcome = 'claimed'",
                &[&prefix],
            )
            .await?
            .get(0);
        assert_eq!(claims, 1500);
        let waiter = spawn_claim(session().await?, &waited, LEASE, Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(200)).await;
        owner
            .execute(
                "SELECT count(*) FROM once.entries e
                  WHERE e.key LIKE $1 || '/%' AND once.complete_key(e.key, e.token, '1')",
                &[&prefix],
            )
            .await?;
        assert!(waiter.await?.0?.is("hit"), "{mode}: the waiter is answered");
        let counts = heard(&mut rx, &prefix, Duration::from_secs(2)).await;
        assert_eq!(
            counts.get(&prefix),
            None,
            "{mode}: no key announced one by one"
        );
        assert!(
            counts.get("").is_some_and(|&n| n >= 1),
            "{mode}: the empty payload announced: {counts:?}"
        );

        // Past the bytes: 20 keys of 7 kB (140 kB).
        let prefix = fresh_key("large");
        resolve_in_one_transaction(&owner, &prefix, 20, 7000).await?;
        let counts = heard(&mut rx, &prefix, Duration::from_secs(2)).await;
        assert_eq!(counts.get(&prefix), None, "{mode}: no large key announced");
        assert!(counts.contains_key(""), "{mode}: {counts:?}");

        // Within both: every key, verbatim.
        let prefix = fresh_key("few");
        resolve_in_one_transaction(&owner, &prefix, 100, 0).await?;
        let counts = heard(&mut rx, &prefix, Duration::from_secs(2)).await;
        assert_eq!(counts.get(&prefix), Some(&100), "{mode}: {counts:?}");
    }
    Ok(())
}

/// The measurement of issue 23, item 9: a listener idle in a transaction holds PostgreSQL's
/// notify queue, which then grows by all that is announced until commits that notify
/// fail. A burst of 2,000 keys of 7 kB (14 MB of keys) in one transaction adds one empty
/// payload to it, not 14 MB.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_beside_an_idle_listener_hardly_fills_the_notify_queue() -> Result<()> {
    let admin = admin().await?;
    let idle = session().await?;
    idle.batch_execute("LISTEN once").await?;
    idle.batch_execute("BEGIN").await?;
    idle.batch_execute("SELECT 1").await?;
    let usage = || async {
        Ok::<f64, anyhow::Error>(
            admin
                .query_one("SELECT pg_notification_queue_usage()", &[])
                .await?
                .get(0),
        )
    };
    let before = usage().await?;
    let owner = session().await?;
    owner.batch_execute("SET once.notify = direct").await?;
    resolve_in_one_transaction(&owner, &fresh_key("burst"), 2000, 7000).await?;
    let after = usage().await?;
    idle.batch_execute("COMMIT").await?;
    // One 8 kB page of PostgreSQL 15's 8 GB queue is 1e-6; the burst announced key by key
    // would take 14 MB, 0.0017.
    println!("notify queue usage before the burst {before:.7}, after {after:.7}");
    assert!(
        after - before < 1e-5,
        "the burst filled the notify queue from {before} to {after}"
    );
    Ok(())
}
