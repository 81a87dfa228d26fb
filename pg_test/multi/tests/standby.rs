//! pg_once on a hot standby of the preloaded server (PG_ONCE_STANDBY_DSN, built by
//! scripts/test.sh with pg_basebackup -R): what only reads is served, everything that
//! would write is refused with 25006 and a hint to call it on the primary, and a key
//! running on the primary is answered `wait`: the standby cannot judge an owner that lives
//! on another server, so it never decides that the owner is gone.
//!
//! scripts/test.sh runs this binary one test at a time, while no other test writes, so
//! that a test's waits on the standby see only its own writes replayed.

use anyhow::{Context, Result};
use pg_once_multi::{admin, fresh_key, once};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

const LEASE: Duration = Duration::from_secs(60);
const NO_WAIT: Duration = Duration::ZERO;

async fn standby() -> Result<Client> {
    let dsn = std::env::var("PG_ONCE_STANDBY_DSN").context(
        "PG_ONCE_STANDBY_DSN is not set: scripts/test.sh builds a standby of the preloaded server",
    )?;
    let client = once::connect(&dsn).await?;
    let in_recovery: bool = client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await?
        .get(0);
    anyhow::ensure!(in_recovery, "{dsn} is not a standby");
    Ok(client)
}

/// Wait until the standby has replayed everything the primary has written so far; returns
/// when it saw that.
async fn replayed(primary: &Client, standby: &Client) -> Result<Instant> {
    let lsn: String = primary
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done: bool = standby
            .query_one(
                "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)",
                &[&lsn],
            )
            .await?
            .get(0);
        if done {
            return Ok(Instant::now());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the standby has not replayed {lsn} after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `sql` fails on the standby with 25006, naming once.`function` and pointing at the
/// primary.
async fn assert_refused(standby: &Client, function: &str, sql: &str) {
    let error = match standby.batch_execute(sql).await {
        Ok(()) => panic!("{sql} succeeded on the standby"),
        Err(e) => e,
    };
    let db = error
        .as_db_error()
        .unwrap_or_else(|| panic!("{sql}: not a server error: {error}"));
    assert_eq!(
        db.code(),
        &SqlState::READ_ONLY_SQL_TRANSACTION,
        "{sql}: {}",
        db.message()
    );
    assert!(
        db.message()
            .contains(&format!("cannot execute once.{function}() during recovery")),
        "{sql}: {}",
        db.message()
    );
    let hint = db.hint().unwrap_or_default();
    assert!(
        hint.contains(&format!("Call once.{function} on the primary")),
        "{sql}: hint {hint:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn hits_and_the_views_are_served_on_a_standby() -> Result<()> {
    let primary = admin().await?;
    let standby = standby().await?;
    let key = fresh_key("standby-hit");
    let claim = once::claim_key(&primary, &key, LEASE, NO_WAIT).await?;
    let token = claim.token.context("claimed")?;
    assert!(once::complete_key(&primary, &key, token, &json!({"on": "primary"}), None).await?);
    let failed = fresh_key("standby-failed");
    let claim = once::claim_key(&primary, &failed, LEASE, NO_WAIT).await?;
    once::fail_key(
        &primary,
        &failed,
        claim.token.context("claimed")?,
        "boom",
        Duration::from_secs(600),
    )
    .await?;
    replayed(&primary, &standby).await?;

    let hit = once::claim_key(&standby, &key, LEASE, NO_WAIT).await?;
    assert!(hit.is("hit"), "{hit:?}");
    assert_eq!(
        (hit.token, hit.result),
        (None, Some(json!({"on": "primary"})))
    );
    // With a wait too: a hit needs no waiting.
    let hit = once::claim_key(&standby, &key, LEASE, Duration::from_secs(5)).await?;
    assert!(hit.is("hit"), "{hit:?}");
    // A pooled client passes the pid of its owner session, a backend of the primary this
    // server cannot see: the hit is served all the same.
    let owner_pid: i32 = primary
        .query_one("SELECT once.owner_session()", &[])
        .await?
        .get(0);
    let outcome: String = standby
        .query_one(
            "SELECT outcome FROM once.claim_key($1, owner_pid => $2)",
            &[&key, &owner_pid],
        )
        .await?
        .get(0);
    assert_eq!(outcome, "hit");
    let served = once::claim_key(&standby, &failed, LEASE, NO_WAIT).await?;
    assert!(served.is("failed"), "{served:?}");
    assert_eq!(served.error.as_deref(), Some("boom"));

    for view in ["once.stats", "once.queue_stats", "once.dead_letters"] {
        standby
            .query(&format!("SELECT * FROM {view}"), &[])
            .await
            .with_context(|| format!("reading {view} on the standby"))?;
    }
    let done: i64 = standby
        .query_one("SELECT done FROM once.stats", &[])
        .await?
        .get(0);
    assert!(done >= 1);
    Ok(())
}

/// A result in its stale window is served stale on a standby, where nobody can refresh
/// it (a claim would be a write), rather than refused; without serve_stale the caller is
/// refused as for any claim there.
#[tokio::test(flavor = "multi_thread")]
async fn a_stale_result_is_served_on_a_standby() -> Result<()> {
    let primary = admin().await?;
    let standby = standby().await?;
    let key = fresh_key("standby-stale");
    primary
        .execute(
            "SELECT once.complete_key($1, (once.claim_key($1)).token, '\"old\"',
                                      ttl => '1 microsecond', stale => '1 hour')",
            &[&key],
        )
        .await?;
    replayed(&primary, &standby).await?;
    let row = standby
        .query_one(
            "SELECT outcome, result::text FROM once.claim_key($1, wait => '5 seconds', serve_stale => true)",
            &[&key],
        )
        .await?;
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("stale".to_owned(), "\"old\"".to_owned())
    );
    let refused = standby
        .query_one("SELECT outcome FROM once.claim_key($1)", &[&key])
        .await
        .expect_err("a claim on a standby is refused");
    assert_eq!(
        refused.as_db_error().map(|e| e.code().code()),
        Some("25006"),
        "{refused}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_running_on_the_primary_is_answered_wait_on_a_standby() -> Result<()> {
    let primary = admin().await?;
    let owner = once::connect(&once::dsn_from_env()?).await?;
    let standby = standby().await?;
    let key = fresh_key("standby-running");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    assert!(claim.is("claimed"));
    replayed(&primary, &standby).await?;

    // The owner's pid means nothing here: no takeover is tried, whatever it looks like.
    let answer = once::claim_key(&standby, &key, LEASE, NO_WAIT).await?;
    assert!(answer.is("wait"), "{answer:?}");
    assert_eq!(
        (answer.token, &answer.owner),
        (None, &claim.owner),
        "the standby reports the primary's claim: its owner, never its token"
    );
    // A wait on the standby ends at its deadline: nothing there wakes it, and it does
    // not hang past it.
    let started = Instant::now();
    let answer = wait_on_standby(&standby, &key, Duration::from_millis(700)).await?;
    let took = started.elapsed();
    assert!(answer.is("wait"), "{answer:?}");
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(700) + SLACK,
        "answered after {took:?} with a 700 ms wait"
    );

    // A completion on the primary reaches a waiter on the standby by replay, seen at its
    // next look (it polls: with the backstop sleep of the primary, it took a second).
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move {
            let claim = wait_on_standby(&standby, &key, Duration::from_secs(20)).await;
            (claim, Instant::now())
        })
    };
    let token = claim.token.context("claimed")?;
    assert!(once::complete_key(&owner, &key, token, &json!("done"), None).await?);
    let replay_seen = replayed(&primary, &admin_of_standby().await?).await?;
    let (answer, at) = waiting.await?;
    let answer = answer?;
    assert!(answer.is("hit"), "{answer:?}");
    let after = at.saturating_duration_since(replay_seen);
    assert!(
        after < SLACK,
        "the standby's waiter saw the completion {after:?} after it was replayed"
    );
    Ok(())
}

/// How late a call may answer past what it was told, on a loaded machine: a round trip
/// and the scheduler, nothing that grows with the wait.
const SLACK: Duration = Duration::from_secs(2);

/// A second connection to the standby, to watch its replay while another one waits.
async fn admin_of_standby() -> Result<Client> {
    standby().await
}

/// claim_key on the standby with `wait`, asked again with what is left of it whenever the
/// standby answers `wait` early: it does so when replay waits for the waiter's snapshot
/// (protocol::standby), as a client asks again after a `wait`.
async fn wait_on_standby(standby: &Client, key: &str, wait: Duration) -> Result<once::Claim> {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = once::claim_key(standby, key, LEASE, left).await?;
        if !answer.is("wait") || Instant::now() >= deadline {
            return Ok(answer);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_on_a_standby_never_holds_back_the_replay_it_waits_for() -> Result<()> {
    // The waiter's statement keeps its snapshot. Rows of another key updated after it began
    // and then vacuumed on the primary make replay on the standby wait for that snapshot
    // (max_standby_streaming_delay, 30 s by default), and the completion behind that
    // cleanup could not reach the waiter for its whole wait.
    let primary = admin().await?;
    let owner = once::connect(&once::dsn_from_env()?).await?;
    let standby = standby().await?;
    let watcher = admin_of_standby().await?;
    let key = fresh_key("standby-replay");
    let other = fresh_key("standby-churn");
    let claim = once::claim_key(&owner, &key, LEASE, NO_WAIT).await?;
    let token = claim.token.context("claimed")?;
    let churn = once::claim_key(&primary, &other, LEASE, NO_WAIT).await?;
    let churn = churn.token.context("claimed")?;
    replayed(&primary, &watcher).await?;

    let wait = Duration::from_secs(20);
    let started = Instant::now();
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move {
            let answer = once::claim_key(&standby, &key, LEASE, wait).await;
            (answer, Instant::now(), standby)
        })
    };
    // The waiter has its snapshot once its statement runs on the standby.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !watcher
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_stat_activity
                             WHERE state = 'active' AND query LIKE '%claim_key%'
                               AND pid <> pg_backend_pid())",
            &[],
        )
        .await?
        .get::<_, bool>(0)
    {
        anyhow::ensure!(Instant::now() < deadline, "the waiter never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Dead rows newer than the waiter's snapshot, removed by VACUUM: a cleanup record
    // that conflicts with it. Then the completion it waits for, behind that record.
    assert!(once::complete_key(&primary, &other, churn, &json!(1), None).await?);
    primary
        .batch_execute(&format!("SELECT once.invalidate_key({})", quote(&other)))
        .await?;
    primary.batch_execute("VACUUM once.entries").await?;
    assert!(once::complete_key(&owner, &key, token, &json!("done"), None).await?);

    let (answer, answered, standby) = waiting.await?;
    let answer = answer?;
    assert!(
        answered - started < wait - SLACK,
        "the waiter held replay back for its whole wait ({answer:?} after {:?})",
        answered - started
    );
    // Replay goes on once the waiter has answered, and the next call sees the result.
    replayed(&primary, &watcher).await?;
    let elapsed = started.elapsed();
    assert!(
        elapsed < wait,
        "the standby replayed the completion {elapsed:?} after the waiter began"
    );
    let hit = once::claim_key(&standby, &key, LEASE, NO_WAIT).await?;
    assert!(hit.is("hit"), "{hit:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_write_is_refused_on_a_standby_with_25006_and_a_hint() -> Result<()> {
    let primary = admin().await?;
    let owner = once::connect(&once::dsn_from_env()?).await?;
    let standby = standby().await?;
    let cold = fresh_key("standby-cold");
    let owned = fresh_key("standby-owned");
    let done = fresh_key("standby-done");
    let queue = format!("standby_{}", fresh_key("q").replace('/', "_"));
    let claim = once::claim_key(&owner, &owned, LEASE, NO_WAIT).await?;
    let token = claim.token.context("claimed")?;
    let finished = once::claim_key(&primary, &done, LEASE, NO_WAIT).await?;
    once::complete_key(
        &primary,
        &done,
        finished.token.context("claimed")?,
        &json!(1),
        None,
    )
    .await?;
    primary
        .batch_execute(&format!(
            "SELECT once.create_queue({q}); SELECT once.enqueue_key({k}, queue => {q})",
            q = quote(&queue),
            k = quote(&fresh_key("standby-job")),
        ))
        .await?;
    let empty_queue = format!("{queue}_empty");
    primary
        .batch_execute(&format!(
            "SELECT once.create_queue({})",
            quote(&empty_queue)
        ))
        .await?;
    replayed(&primary, &standby).await?;

    let (cold, running, done) = (quote(&cold), quote(&owned), quote(&done));
    let (queue_q, empty_q) = (quote(&queue), quote(&empty_queue));
    let cases = [
        ("claim_key", format!("SELECT once.claim_key({cold})")),
        (
            "claim_key",
            format!("SELECT once.claim_key({cold}, wait => '5 s')"),
        ),
        (
            "complete_key",
            format!("SELECT once.complete_key({running}, {token}, '1')"),
        ),
        (
            "fail_key",
            format!("SELECT once.fail_key({running}, {token}, 'e')"),
        ),
        (
            "heartbeat_key",
            format!("SELECT once.heartbeat_key({running}, {token})"),
        ),
        (
            "release_key",
            format!("SELECT once.release_key({running}, {token})"),
        ),
        ("invalidate_key", format!("SELECT once.invalidate_key({done})")),
        ("reap_stale", "SELECT * FROM once.reap_stale()".to_owned()),
        (
            "enqueue_key",
            format!("SELECT once.enqueue_key({cold}, queue => {queue_q})"),
        ),
        ("claim_next", format!("SELECT * FROM once.claim_next({queue_q})")),
        (
            "claim_next",
            format!("SELECT * FROM once.claim_next({queue_q}, wait => '5 s')"),
        ),
        (
            "complete_keys",
            format!(
                "SELECT * FROM once.complete_keys(ARRAY[{running}], ARRAY[{token}::bigint], ARRAY['1']::jsonb[])"
            ),
        ),
        (
            "invalidate_keys",
            format!("SELECT once.invalidate_keys(queue => {queue_q})"),
        ),
        ("create_queue", "SELECT once.create_queue('standby_new')".to_owned()),
        ("drop_queue", format!("SELECT once.drop_queue({empty_q})")),
    ];
    for (function, sql) in &cases {
        let started = Instant::now();
        assert_refused(&standby, function, sql).await;
        // Refused before anything else: a call with a wait does not wait first.
        assert!(started.elapsed() < Duration::from_secs(2), "{sql} waited");
    }
    // The running claim is still the owner's: nothing on the standby touched it (and
    // the answer names the owner, never its token).
    let still = once::claim_key(&standby, &owned, LEASE, NO_WAIT).await?;
    assert!(
        still.is("wait") && still.token.is_none() && still.owner.is_some(),
        "{still:?}"
    );
    assert!(once::complete_key(&owner, &owned, token, &json!(2), None).await?);
    primary
        .batch_execute(&format!(
            "SELECT once.invalidate_keys(queue => {queue_q}); SELECT once.drop_queue({queue_q}); SELECT once.drop_queue({empty_q})"
        ))
        .await?;
    Ok(())
}
