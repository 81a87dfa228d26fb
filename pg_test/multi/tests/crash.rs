//! Crashes and restarts of a real server: scripts/test.sh runs this binary alone, one test
//! at a time, against a cluster it may kill (PG_ONCE_DATA_DIR names its data directory).

use anyhow::{Context, Result};
use pg_once_multi::{fresh_key, once, pg_ctl, spawn_claim, start_test_server};
use serde_json::json;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

const LEASE: Duration = Duration::from_secs(600);
const NO_WAIT: Duration = Duration::ZERO;

/// Connect, retrying while the server restarts.
async fn connect_when_up() -> Result<Client> {
    let dsn = once::dsn_from_env()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match once::connect(&dsn).await {
            Ok(client) if client.simple_query("SELECT 1").await.is_ok() => return Ok(client),
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            other => return other,
        }
    }
}

async fn state_of(client: &Client, key: &str) -> Result<(String, Option<serde_json::Value>)> {
    let row = client
        .query_one(
            "SELECT state::text, result FROM once.entries WHERE key_hash = once.key_hash($1)",
            &[&key],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_of_an_owner_loses_no_result_and_frees_its_keys_at_once() -> Result<()> {
    let client = connect_when_up().await?;
    let done: Vec<String> = (0..20)
        .map(|i| fresh_key(&format!("kill9-done-{i}")))
        .collect();
    for key in &done {
        let claim = once::claim_key(&client, key, LEASE, NO_WAIT).await?;
        assert!(once::complete_key(&client, key, claim.token.unwrap(), &json!(key), None).await?);
    }
    let owner = connect_when_up().await?;
    let running: Vec<String> = (0..5)
        .map(|i| fresh_key(&format!("kill9-running-{i}")))
        .collect();
    for key in &running {
        assert!(once::claim_key(&owner, key, LEASE, NO_WAIT)
            .await?
            .is("claimed"));
    }
    // SIGKILL one backend: the postmaster resets every backend and recovers.
    let pid = once::backend_pid(&owner).await?;
    let killed = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()?;
    assert!(killed.success());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let client = connect_when_up().await?;
    for key in &done {
        assert_eq!(
            state_of(&client, key).await?,
            ("done".to_string(), Some(json!(key))),
            "{key}"
        );
    }
    let started = Instant::now();
    for key in &running {
        let claim = once::claim_key(&client, key, Duration::from_secs(30), NO_WAIT).await?;
        assert!(
            claim.is("claimed"),
            "{key} was not claimable after the crash: {claim:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn immediate_shutdown_mid_workload_loses_no_acknowledged_completion() -> Result<()> {
    const CLIENTS: usize = 32;
    const KEYS: usize = 300;
    let prefix = fresh_key("immediate");
    let acknowledged: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (client, prefix, acknowledged) = (
            connect_when_up().await?,
            prefix.clone(),
            acknowledged.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = c;
            loop {
                let key = format!("{prefix}/{}", i % KEYS);
                i += CLIENTS;
                let Ok(claim) =
                    once::claim_key(&client, &key, LEASE, Duration::from_millis(200)).await
                else {
                    return; // the server went away
                };
                if let (true, Some(token)) = (claim.is("claimed"), claim.token) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    match once::complete_key(&client, &key, token, &json!({"token": token}), None)
                        .await
                    {
                        Ok(true) => acknowledged.lock().unwrap().push((key, token)),
                        Ok(false) => {}
                        Err(_) => return,
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    pg_ctl(&["stop", "-m", "immediate"])?;
    for t in tasks {
        let _ = t.await;
    }
    start_test_server()?;

    let client = connect_when_up().await?;
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(
        acknowledged.len() > 50,
        "the workload completed only {} keys",
        acknowledged.len()
    );
    for (key, token) in &acknowledged {
        let row = client
            .query_one(
                "SELECT state::text, token, result FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[key],
            )
            .await?;
        let (state, stored, result): (String, i64, serde_json::Value) =
            (row.get(0), row.get(1), row.get(2));
        assert_eq!(
            (state.as_str(), stored, result),
            ("done", *token, json!({"token": token})),
            "{key}"
        );
    }
    // Every claim left running belonged to a backend that no longer exists.
    once::reap_stale(&client).await?;
    let running: i64 = client
        .query_one(
            "SELECT count(*) FROM once.entries WHERE state = 'running' AND starts_with(key, $1)",
            &[&prefix],
        )
        .await?
        .get(0);
    assert_eq!(running, 0, "keys still running after reap_stale");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_whose_claim_a_crash_lost_is_never_handed_out_again() -> Result<()> {
    // Claims in a transaction that never commits (as one with synchronous_commit = off may
    // commit without its WAL on disk): their owner holds the tokens, and the crash loses
    // the claims and, with the WAL not yet flushed, the sequence's advance. More than the
    // 32 values nextval logs ahead, so that the advance is in that WAL.
    let mut client = connect_when_up().await?;
    let open = client.transaction().await?;
    let mut lost = Vec::new();
    for _ in 0..40 {
        let row = open
            .query_one(
                "SELECT token FROM once.claim_key($1, lease => '600 s')",
                &[&fresh_key("crash-lost")],
            )
            .await?;
        lost.push(row.get::<_, i64>(0));
    }
    pg_ctl(&["stop", "-m", "immediate"])?;
    drop(open);
    start_test_server()?;

    let client = connect_when_up().await?;
    let highest = *lost.iter().max().expect("tokens were drawn");
    let mut after = Vec::new();
    for _ in 0..40 {
        let claim = once::claim_key(&client, &fresh_key("after-crash"), LEASE, NO_WAIT).await?;
        after.push(claim.token.context("a claim has a token")?);
    }
    let again: Vec<i64> = after.iter().filter(|t| lost.contains(t)).copied().collect();
    assert!(
        again.is_empty() && after[0] > highest,
        "after the crash, claims got {after:?}: {} of them held by the lost claims' owners, \
         whose highest token was {highest}",
        again.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_whose_socket_closes_mid_compute_is_taken_over_within_a_second() -> Result<()> {
    let dsn = once::dsn_from_env()?;
    let key = fresh_key("socket-closed");
    // Own the connection future, so that dropping it closes the socket with no goodbye.
    let (owner, connection) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await?;
    let driver = tokio::spawn(connection);
    assert!(once::claim_key(&owner, &key, LEASE, NO_WAIT)
        .await?
        .is("claimed"));

    let waiter = connect_when_up().await?;
    let waiting = spawn_claim(
        waiter,
        &key,
        Duration::from_secs(30),
        Duration::from_secs(10),
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    driver.abort(); // the socket closes; no SQL, no Terminate message
    let closed = Instant::now();
    let (claim, at) = waiting.await?;
    assert!(claim?.is("claimed"));
    let took = at.duration_since(closed);
    assert!(took < Duration::from_secs(1), "taken over after {took:?}");
    drop(owner);
    Ok(())
}

/// The worker pauses after each batch of notifications (once.relay_interval) to let the
/// next one gather. It pauses on its latch, so a reload (like a stop) ends the pause at
/// once instead of after it. Here: a key completed during a 1 s pause is relayed as soon
/// as the settings are reloaded, not when the pause would have ended.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_ends_the_workers_pause_between_batches_at_once() -> Result<()> {
    let admin = connect_when_up().await?;
    let workers: Option<i32> = admin
        .query_one("SELECT workers FROM once.stats", &[])
        .await?
        .get(0);
    if workers.unwrap_or(0) == 0 {
        return Ok(()); // no worker on this server: nothing relays
    }
    // Each its own statement: ALTER SYSTEM refuses to run in a transaction block.
    admin
        .batch_execute("ALTER SYSTEM SET once.relay_interval = '1s'")
        .await?;
    admin.batch_execute("SELECT pg_reload_conf()").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (listener, mut rx) = once::connect_listening(&once::dsn_from_env()?).await?;
    listener.batch_execute("LISTEN once").await?;
    let owner = connect_when_up().await?;
    let (first, second) = (fresh_key("pause-first"), fresh_key("pause-second"));
    let first_claim = once::claim_key(&owner, &first, LEASE, NO_WAIT).await?;
    let second_claim = once::claim_key(&owner, &second, LEASE, NO_WAIT).await?;
    once::complete_key(&owner, &first, first_claim.token.unwrap(), &json!(1), None).await?;
    // The worker has sent that batch, and pauses for 1 s before the next.
    wait_for(&mut rx, &first).await?;
    once::complete_key(
        &owner,
        &second,
        second_claim.token.unwrap(),
        &json!(2),
        None,
    )
    .await?;
    let reloaded = Instant::now();
    admin
        .batch_execute("ALTER SYSTEM RESET once.relay_interval")
        .await?;
    admin.batch_execute("SELECT pg_reload_conf()").await?;
    wait_for(&mut rx, &second).await?;
    let after_reload = reloaded.elapsed();
    assert!(
        after_reload < Duration::from_millis(500),
        "relayed {after_reload:?} after the reload: the pause outlived it"
    );
    Ok(())
}

/// Wait up to 5 s for a notification whose payload is `key`.
async fn wait_for(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
    key: &str,
) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = rx.recv().await.context("listener closed")?;
            if n.payload() == key {
                return Ok(());
            }
        }
    })
    .await
    .context("no notification within 5 s")?
}
