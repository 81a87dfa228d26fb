//! Waking waiters, the background worker and the NOTIFY relay. scripts/test.sh runs this
//! file against a plain server and against one with pg_once preloaded; each test asserts
//! what its mode promises.

use anyhow::Result;
use pg_once_multi::{admin, fresh_key, once, session, spawn_claim};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::time::timeout;
use tokio_postgres::Client;

const LEASE: Duration = Duration::from_secs(30);
const NO_WAIT: Duration = Duration::ZERO;

async fn preloaded(client: &Client) -> Result<bool> {
    Ok(client
        .query_one("SELECT shared_memory FROM once.stats", &[])
        .await?
        .get(0))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_never_wakes_to_a_result_it_cannot_see() -> Result<()> {
    let _ = admin().await?;
    let (owner, waiter) = (session().await?, session().await?);
    let key = fresh_key("wake-after-commit");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let waiting = spawn_claim(waiter, &key, LEASE, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(200)).await;

    // complete_key runs, but its transaction stays open: nothing is visible yet.
    owner.batch_execute("BEGIN").await?;
    assert!(once::complete_key(&owner, &key, claim.token.unwrap(), &json!("v1"), None).await?);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "the waiter returned before the result was committed"
    );
    let commit_sent = Instant::now();
    owner.batch_execute("COMMIT").await?;

    let (claim, returned) = waiting.await?;
    let claim = claim?;
    assert!(claim.is("hit"), "{claim:?}");
    assert_eq!(claim.result, Some(json!("v1")));
    assert!(
        returned >= commit_sent,
        "the waiter returned before COMMIT was even sent"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rolled_back_completion_wakes_nobody_to_a_result() -> Result<()> {
    let _ = admin().await?;
    let (owner, waiter) = (session().await?, session().await?);
    let key = fresh_key("rolled-back");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let waiting = spawn_claim(waiter, &key, LEASE, Duration::from_millis(1500));
    tokio::time::sleep(Duration::from_millis(200)).await;
    owner.batch_execute("BEGIN").await?;
    once::complete_key(&owner, &key, claim.token.unwrap(), &json!("never"), None).await?;
    owner.batch_execute("ROLLBACK").await?;
    let got = waiting.await?.0?;
    assert!(
        got.is("wait"),
        "the owner is still computing, so the waiter keeps waiting: {got:?}"
    );
    Ok(())
}

/// Time from complete_key's commit to the waiter's return, for one waiter.
async fn wake_latency() -> Result<Duration> {
    let (owner, waiter) = (session().await?, session().await?);
    let key = fresh_key("latency");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let waiting = spawn_claim(waiter, &key, LEASE, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(100)).await;
    once::complete_key(&owner, &key, claim.token.unwrap(), &json!(1), None).await?;
    let completed = Instant::now();
    let (claim, returned) = waiting.await?;
    anyhow::ensure!(claim?.is("hit"));
    Ok(returned.saturating_duration_since(completed))
}

#[tokio::test(flavor = "multi_thread")]
async fn preloaded_waiters_are_woken_not_polled() -> Result<()> {
    let admin = admin().await?;
    let preloaded = preloaded(&admin).await?;
    let before: Option<i64> = admin
        .query_one("SELECT wakeups FROM once.stats", &[])
        .await?
        .get(0);
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        worst = worst.max(wake_latency().await?);
    }
    let after: Option<i64> = admin
        .query_one("SELECT wakeups FROM once.stats", &[])
        .await?
        .get(0);
    if preloaded {
        // Woken through shared memory: counted, and well under the 1 s backstop.
        assert!(
            after.unwrap() >= before.unwrap() + 5,
            "{before:?} -> {after:?}"
        );
        assert!(
            worst < Duration::from_millis(500),
            "slowest wake-up {worst:?}"
        );
    } else {
        assert_eq!(after, None, "no counters without shared memory");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_worker_reaps_abandoned_claims_with_no_client_call() -> Result<()> {
    let admin = admin().await?;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let owner = session().await?;
    let key = fresh_key("abandoned");
    assert!(
        once::claim_key(&owner, &key, Duration::from_millis(100), NO_WAIT)
            .await?
            .is("claimed")
    );
    // Nobody calls claim_key or reap_stale for this key from here on.
    let state = || async {
        let row = admin
            .query_one(
                "SELECT state::text FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[&key],
            )
            .await?;
        anyhow::Ok(row.get::<_, String>(0))
    };
    if preloaded(&admin).await? {
        let notified = timeout(Duration::from_secs(5), async {
            while let Some(n) = rx.recv().await {
                if n.payload() == key {
                    return true;
                }
            }
            false
        })
        .await;
        assert_eq!(notified, Ok(true), "the reaped key was not notified");
        assert_eq!(state().await?, "failed");
    } else {
        // Without the worker, the lease runs out but the row waits for a reap_stale call
        // (pg_cron or a client) or for the next claim_key.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(state().await?, "running");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn notifications_are_relayed_by_the_worker_when_preloaded() -> Result<()> {
    let admin = admin().await?;
    let preloaded = preloaded(&admin).await?;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let owner = session().await?;
    let owner_pid = once::backend_pid(&owner).await?;
    let key = fresh_key("relayed");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    once::complete_key(&owner, &key, claim.token.unwrap(), &json!(1), None).await?;
    let sender = timeout(Duration::from_secs(5), async {
        while let Some(n) = rx.recv().await {
            if n.payload() == key {
                return Some(n.process_id());
            }
        }
        None
    })
    .await?
    .expect("notified");
    if preloaded {
        let worker: i32 = admin
            .query_one(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_once worker' AND datname = current_database()",
                &[],
            )
            .await?
            .get(0);
        assert_eq!(
            sender, worker,
            "sent by the worker, not by the completing backend"
        );
    } else {
        assert_eq!(
            sender, owner_pid,
            "without a relay the completing backend notifies"
        );
    }

    // once.notify = direct: the completing backend sends it itself.
    owner.batch_execute("SET once.notify = direct").await?;
    let key = fresh_key("direct");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    once::complete_key(&owner, &key, claim.token.unwrap(), &json!(1), None).await?;
    let n = timeout(Duration::from_secs(5), async {
        loop {
            let n = rx.recv().await.expect("listener alive");
            if n.payload() == key {
                return n;
            }
        }
    })
    .await?;
    assert_eq!(n.process_id(), owner_pid);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn with_notify_off_waiters_are_still_answered_and_nothing_is_sent() -> Result<()> {
    let _ = admin().await?;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let (owner, waiter) = (session().await?, session().await?);
    owner.batch_execute("SET once.notify = off").await?;
    let key = fresh_key("silent");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let waiting = spawn_claim(waiter, &key, LEASE, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(100)).await;
    once::complete_key(&owner, &key, claim.token.unwrap(), &json!(1), None).await?;
    assert!(waiting.await?.0?.is("hit"));
    let heard = timeout(Duration::from_millis(500), async {
        while let Some(n) = rx.recv().await {
            if n.payload() == key {
                return true;
            }
        }
        false
    })
    .await;
    assert!(
        heard.is_err() || heard == Ok(false),
        "once.notify = off sent a notification"
    );
    Ok(())
}

/// enqueue_keys wakes a worker waiting in claim_next on the queue, after its commit and
/// not before, as enqueue_key does: preloaded, at once (counted in `wakeups`), well before
/// the 1 s safety look that would otherwise find the keys (three rounds, so that a safety
/// look that happens to fall just after the commit does not pass for a wake-up);
/// otherwise at its next look.
#[tokio::test(flavor = "multi_thread")]
async fn enqueue_keys_wakes_a_waiting_worker_after_commit() -> Result<()> {
    let admin = admin().await?;
    let preloaded = preloaded(&admin).await?;
    let wakeups = || async {
        let row = admin
            .query_one("SELECT wakeups FROM once.stats", &[])
            .await?;
        anyhow::Ok(row.get::<_, Option<i64>>(0))
    };
    let before = wakeups().await?;
    let mut slowest = Duration::ZERO;
    for round in 0..3 {
        // A queue per round: the keys a round's worker claimed go back to their queue when
        // its session ends.
        let queue = fresh_key("batch-wake").replace('/', "-");
        admin
            .execute("SELECT once.create_queue($1)", &[&queue])
            .await?;
        let worker = session().await?;
        let waiting = {
            let queue = queue.clone();
            tokio::spawn(async move {
                let rows = worker
                    .query(
                        "SELECT key FROM once.claim_next($1, n => 10, wait => '20 s')",
                        &[&queue],
                    )
                    .await;
                (rows, Instant::now())
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let keys = [
            fresh_key(&format!("batch-wake-{round}-a")),
            fresh_key(&format!("batch-wake-{round}-b")),
        ];
        admin.batch_execute("BEGIN").await?;
        admin
            .execute(
                "SELECT * FROM once.enqueue_keys($1::text[], queue => $2)",
                &[&keys.to_vec(), &queue],
            )
            .await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "the worker returned before the keys were committed"
        );
        let committed = Instant::now();
        admin.batch_execute("COMMIT").await?;
        let (rows, returned) = timeout(Duration::from_secs(25), waiting).await??;
        let mut got: Vec<String> = rows?.iter().map(|r| r.get(0)).collect();
        got.sort();
        let mut want = keys.to_vec();
        want.sort();
        assert_eq!(got, want);
        slowest = slowest.max(returned.saturating_duration_since(committed));
        admin
            .execute("SELECT once.invalidate_keys(queue => $1)", &[&queue])
            .await?;
    }
    if preloaded {
        let after = wakeups().await?;
        assert!(after.unwrap() > before.unwrap(), "{before:?} -> {after:?}");
        assert!(
            slowest < Duration::from_millis(300),
            "slowest wake-up {slowest:?} after commit"
        );
    }
    Ok(())
}
