//! What raw SQL callers meet outside the happy path: claims that are not committed (a
//! transaction block still open, a prepared transaction, two transactions waiting for each
//! other's keys), DDL while someone waits, cancelled waits, a waiter that shares the
//! owner's server connection, pooled server connections that are recycled under a live
//! owner, and queue workers waiting for work. Each call must return or fail within its
//! own bound, whatever the others hold.
//!
//! Statements go through the simple query protocol, so the same helpers work on a direct
//! connection and through PgBouncer in transaction mode (PG_ONCE_BOUNCER_DSN, started by
//! scripts/test.sh), where a named prepared statement would not survive its transaction.

use anyhow::{anyhow, Context, Result};
use pg_once_multi::{admin, fresh_key, once, session};
use std::time::{Duration, Instant};
use tokio::time::timeout;
use tokio_postgres::{Client, SimpleQueryMessage};

/// No test may hang: anything that has not returned after this is a failure.
const HANG: Duration = Duration::from_secs(30);

/// Tests in this file run at the same time. DDL on once.entries waits for every open
/// transaction that wrote it, as DDL does, and while the DDL waits every pg_once call is
/// told `wait` rather than queue behind it: so tests that keep a transaction open (read)
/// and tests that run DDL (write) take turns.
static DDL: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A connection through PgBouncer (transaction pooling, 6 server connections).
async fn pooled() -> Result<Client> {
    let dsn = std::env::var("PG_ONCE_BOUNCER_DSN")
        .context("PG_ONCE_BOUNCER_DSN is not set: run these through scripts/test.sh")?;
    once::connect(&dsn).await
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The first row of a simple query, as text columns (None for NULL).
async fn row(client: &Client, sql: &str) -> Result<Vec<Option<String>>> {
    for message in client.simple_query(sql).await? {
        if let SimpleQueryMessage::Row(row) = message {
            return Ok((0..row.len())
                .map(|i| row.get(i).map(str::to_owned))
                .collect());
        }
    }
    Err(anyhow!("no row from {sql}"))
}

/// The first column of the first row.
async fn value(client: &Client, sql: &str) -> Result<Option<String>> {
    Ok(row(client, sql).await?.swap_remove(0))
}

/// claim_key's outcome, token and owner, and how long the call took.
struct Answer {
    outcome: String,
    token: Option<i64>,
    owner: Option<String>,
    took: Duration,
}

/// once.claim_key(key, wait => wait_ms, owner_pid => ...) through the simple protocol.
async fn claim(client: &Client, key: &str, wait_ms: u64, owner_pid: Option<i32>) -> Result<Answer> {
    let owner = owner_pid.map_or("NULL".to_owned(), |p| p.to_string());
    let sql = format!(
        "SELECT outcome, token, owner FROM once.claim_key({}, wait => make_interval(secs => {}), owner_pid => {owner})",
        quote(key),
        wait_ms as f64 / 1000.0
    );
    let started = Instant::now();
    let row = timeout(HANG, row(client, &sql))
        .await
        .context("claim_key hung")??;
    Ok(Answer {
        outcome: row[0].clone().expect("outcome is never NULL"),
        token: row[1].as_deref().map(|t| t.parse().unwrap()),
        owner: row[2].clone(),
        took: started.elapsed(),
    })
}

async fn complete(client: &Client, key: &str, token: i64) -> Result<bool> {
    let sql = format!(
        "SELECT once.complete_key({}, {token}, '\"done\"')",
        quote(key)
    );
    Ok(value(client, &sql).await?.as_deref() == Some("t"))
}

/// Rows claim_next returned (keys), and how long it took.
async fn claim_next(client: &Client, queue: &str, wait_ms: u64) -> Result<(Vec<String>, Duration)> {
    let sql = format!(
        "SELECT key FROM once.claim_next({}, wait => make_interval(secs => {}))",
        quote(queue),
        wait_ms as f64 / 1000.0
    );
    let started = Instant::now();
    let messages = timeout(HANG, client.simple_query(&sql))
        .await
        .context("claim_next hung")??;
    let keys = messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    Ok((keys, started.elapsed()))
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The answer came at the caller's deadline: not before it (it really waited), and not
/// long after it (nothing held it past its bound).
fn assert_answered_at_deadline(answer: &Answer, wait_ms: u64, what: &str) {
    let took = ms(answer.took);
    assert!(
        took + 50 >= wait_ms as u128 && took < wait_ms as u128 + 1500,
        "{what}: answered after {took} ms with wait {wait_ms} ms"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_uncommitted_claim_holds_other_callers_no_longer_than_their_wait() -> Result<()> {
    let _no_ddl = DDL.read().await;
    let _ = admin().await?;
    let key = fresh_key("uncommitted");
    let holder = session().await?;
    holder.batch_execute("BEGIN").await?;
    let mine = claim(&holder, &key, 0, None).await?;
    assert_eq!(mine.outcome, "claimed");

    for (name, other) in [("direct", session().await?), ("pgbouncer", pooled().await?)] {
        let now = claim(&other, &key, 0, None).await?;
        assert_eq!(now.outcome, "wait", "{name}");
        assert!(
            ms(now.took) < 1000,
            "{name}: wait => 0 took {} ms",
            ms(now.took)
        );
        // What the uncommitted claim says is reported: its owner, never its token
        // (docs/security.md, "Tokens").
        assert_eq!((now.token, &now.owner), (None, &mine.owner), "{name}");
        let later = claim(&other, &key, 1500, None).await?;
        assert_eq!(later.outcome, "wait", "{name}");
        assert_answered_at_deadline(&later, 1500, name);
    }
    // Once committed, the claim is an ordinary one: its owner is alive, others wait.
    holder.batch_execute("COMMIT").await?;
    let other = session().await?;
    let after = claim(&other, &key, 0, None).await?;
    assert_eq!(
        (after.outcome.as_str(), &after.owner),
        ("wait", &mine.owner)
    );
    assert!(complete(&holder, &key, mine.token.unwrap()).await?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_claim_holds_other_callers_no_longer_than_their_wait() -> Result<()> {
    let _no_ddl = DDL.read().await;
    let admin = admin().await?;
    let key = fresh_key("prepared");
    let gid = format!("pg_once_test_{}", key.replace('/', "_"));
    let holder = session().await?;
    holder.batch_execute("BEGIN").await?;
    let mine = claim(&holder, &key, 0, None).await?;
    assert_eq!(mine.outcome, "claimed");
    holder
        .batch_execute(&format!("PREPARE TRANSACTION {}", quote(&gid)))
        .await?;

    let result = async {
        for other in [session().await?, pooled().await?] {
            let now = claim(&other, &key, 0, None).await?;
            assert_eq!(now.outcome, "wait");
            assert!(ms(now.took) < 1000, "wait => 0 took {} ms", ms(now.took));
            let later = claim(&other, &key, 1200, None).await?;
            assert_eq!(later.outcome, "wait");
            assert_answered_at_deadline(&later, 1200, "prepared claim");
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    admin
        .batch_execute(&format!("ROLLBACK PREPARED {}", quote(&gid)))
        .await?;
    result?;
    // Rolled back: the key is absent again and the next caller claims it.
    let other = session().await?;
    assert_eq!(claim(&other, &key, 0, None).await?.outcome, "claimed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn two_transactions_waiting_for_each_others_keys_each_return_at_their_deadline() -> Result<()>
{
    let _no_ddl = DDL.read().await;
    let _ = admin().await?;
    let (k1, k2) = (fresh_key("cross-1"), fresh_key("cross-2"));
    let (a, b) = (session().await?, session().await?);
    a.batch_execute("BEGIN").await?;
    b.batch_execute("BEGIN").await?;
    assert_eq!(claim(&a, &k1, 0, None).await?.outcome, "claimed");
    assert_eq!(claim(&b, &k2, 0, None).await?.outcome, "claimed");

    // Each now waits for the key the other claimed and has not committed.
    let (a_waits, b_waits) = tokio::join!(claim(&a, &k2, 1000, None), claim(&b, &k1, 2000, None));
    let (a_waits, b_waits) = (a_waits?, b_waits?);
    assert_eq!(
        (a_waits.outcome.as_str(), b_waits.outcome.as_str()),
        ("wait", "wait")
    );
    assert_answered_at_deadline(&a_waits, 1000, "first of the cross-wait");
    assert_answered_at_deadline(&b_waits, 2000, "second of the cross-wait");
    a.batch_execute("ROLLBACK").await?;
    b.batch_execute("ROLLBACK").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn ddl_on_once_entries_does_not_wait_for_a_waiting_claim() -> Result<()> {
    let _ddl = DDL.write().await;
    let admin = admin().await?;
    let key = fresh_key("ddl");
    let owner = session().await?;
    let mine = claim(&owner, &key, 0, None).await?;
    assert_eq!(mine.outcome, "claimed");

    let waiter = session().await?;
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move { claim(&waiter, &key, 20_000, None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    // VACUUM FULL needs an exclusive lock on once.entries. Before, the waiter kept a
    // share lock for its whole wait: the VACUUM queued behind it, and every other pg_once
    // call queued behind the VACUUM.
    let ddl = session().await?;
    ddl.batch_execute("SET statement_timeout = '10s'").await?;
    let started = Instant::now();
    ddl.batch_execute("VACUUM FULL once.entries").await?;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "VACUUM FULL took {} ms",
        ms(started.elapsed())
    );
    let other = session().await?;
    let cold = claim(&other, &fresh_key("ddl-other"), 0, None).await?;
    assert_eq!(cold.outcome, "claimed");

    // The waiter still waits, on the rewritten table, and is answered by the completion.
    assert!(!waiting.is_finished());
    assert!(complete(&owner, &key, mine.token.unwrap()).await?);
    let answer = waiting.await??;
    assert_eq!(answer.outcome, "hit");
    let _ = admin;
    Ok(())
}

/// The error a cancelled call ended with: SQLSTATE, message and detail.
async fn cancelled(client: &Client, sql: &str) -> Result<(String, String, Option<String>)> {
    let error = timeout(HANG, client.simple_query(sql))
        .await
        .context("hung")?
        .expect_err("the call should have been cancelled");
    let db = error.as_db_error().context("not a server error")?;
    Ok((
        db.code().code().to_owned(),
        db.message().to_owned(),
        db.detail().map(str::to_owned),
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_wait_ends_with_57014_and_leaves_the_session_clean() -> Result<()> {
    let admin = admin().await?;
    let key = fresh_key("cancelled");
    let owner = session().await?;
    let mine = claim(&owner, &key, 0, None).await?;
    let wait_sql = format!(
        "SELECT * FROM once.claim_key({}, wait => '20 s')",
        quote(&key)
    );

    // statement_timeout. The servers of scripts/test.sh run with RUST_BACKTRACE=1: no
    // Rust backtrace may reach the client (it used to arrive as the DETAIL).
    let waiter = session().await?;
    waiter
        .batch_execute("SET statement_timeout = '300ms'")
        .await?;
    let (code, message, detail) = cancelled(&waiter, &wait_sql).await?;
    assert_eq!(code, "57014");
    assert_eq!(message, "canceling statement due to statement timeout");
    assert_eq!(detail, None);
    waiter.batch_execute("RESET statement_timeout").await?;

    // pg_cancel_backend, as an operator would.
    let pid = once::backend_pid(&waiter).await?;
    let cancel = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        admin
            .batch_execute(&format!("SELECT pg_cancel_backend({pid})"))
            .await
    });
    let (code, message, detail) = cancelled(&waiter, &wait_sql).await?;
    cancel.await??;
    assert_eq!(code, "57014");
    assert_eq!(message, "canceling statement due to user request");
    assert_eq!(detail, None);

    // The session is usable, and its next wait is woken like any other.
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move { claim(&waiter, &key, 20_000, None).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(complete(&owner, &key, mine.token.unwrap()).await?);
    let answer = waiting.await??;
    assert_eq!(answer.outcome, "hit");
    assert!(ms(answer.took) < 5000, "woken after {} ms", ms(answer.took));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_on_the_owners_own_server_connection_waits() -> Result<()> {
    // Behind a pool, another client's calls can run on the server connection that made
    // a claim. Such a waiter used to be told `wait` at once (the call assumed it was the
    // owner asking about itself), and clients following the raw SQL loop (docs/concepts.md, "The client protocol") spun on it.
    let _ = admin().await?;
    let key = fresh_key("same-connection");
    let shared = session().await?;
    let mine = claim(&shared, &key, 0, None).await?;
    assert_eq!(mine.outcome, "claimed");
    let pid = once::backend_pid(&shared).await?;

    let waiting = {
        let key = key.clone();
        tokio::spawn(async move { claim(&shared, &key, 10_000, None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the waiter returned at once");
    // The owning client completes through another server connection.
    let elsewhere = session().await?;
    assert_ne!(once::backend_pid(&elsewhere).await?, pid);
    assert!(complete(&elsewhere, &key, mine.token.unwrap()).await?);
    let answer = waiting.await??;
    assert_eq!(answer.outcome, "hit");
    Ok(())
}

/// RECONNECT on PgBouncer's admin console: every server connection is closed once it is
/// released, as with server_lifetime, and the next transaction gets a new one.
async fn recycle_pooled_server_connections() -> Result<()> {
    let dsn = std::env::var("PG_ONCE_BOUNCER_DSN")?.replace("dbname=postgres", "dbname=pgbouncer");
    let console = once::connect(&dsn).await?;
    console.simple_query("RECONNECT").await?;
    Ok(())
}

/// The pid in a claim's `owner`: "application_name (pid 1234)", or "pid 1234" without one.
fn pid_of_owner(owner: &str) -> Option<String> {
    let pid = owner.rsplit_once("pid ")?.1.trim_end_matches(')');
    Some(pid.to_owned())
}

/// Backend pids serving a connection through PgBouncer, seen by asking it a few times.
async fn server_pids(client: &Client) -> Result<Vec<String>> {
    let mut pids = Vec::new();
    for _ in 0..3 {
        pids.push(value(client, "SELECT pg_backend_pid()").await?.unwrap());
    }
    Ok(pids)
}

// `scripts/suite.sh multi` runs this one alone, after the others: its RECONNECT makes
// PgBouncer refuse every client for a while (server_login_retry).
#[tokio::test(flavor = "multi_thread")]
async fn an_owner_session_keeps_a_pooled_claim_until_its_process_goes() -> Result<()> {
    let admin = admin().await?;
    // The client process: its own long-lived connection, and calls through the pool.
    let process_connection = session().await?;
    let p: i32 = value(&process_connection, "SELECT once.owner_session()")
        .await?
        .unwrap()
        .parse()?;
    assert_eq!(p, once::backend_pid(&process_connection).await?);
    let pool = pooled().await?;
    let other = pooled().await?;

    let key = fresh_key("owner-session");
    let mine = claim(&pool, &key, 0, Some(p)).await?;
    assert_eq!(mine.outcome, "claimed");
    let unnamed = fresh_key("pooled-default");
    let theirs = claim(&pool, &unnamed, 0, None).await?;
    assert_eq!(theirs.outcome, "claimed");

    // PgBouncer closes the server connections under the live client.
    let before = server_pids(&pool).await?;
    recycle_pooled_server_connections().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while server_pids(&pool)
        .await?
        .iter()
        .any(|pid| before.contains(pid))
    {
        assert!(
            Instant::now() < deadline,
            "PgBouncer did not recycle its connections"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The old server connections are closed, and their backends gone: until a backend has
    // exited, its claims are still its own. The backend that made the unnamed claim is
    // awaited by name: other tests share the pool, so it need not be one of those sampled.
    let claimer = theirs
        .owner
        .as_deref()
        .and_then(pid_of_owner)
        .expect("owner names a pid");
    let before = before
        .into_iter()
        .chain([claimer])
        .collect::<Vec<_>>()
        .join(",");
    while value(
        &admin,
        &format!("SELECT count(*) FROM pg_stat_activity WHERE pid IN ({before})"),
    )
    .await?
    .as_deref()
        != Some("0")
    {
        assert!(
            Instant::now() < deadline,
            "the recycled backends {before} did not exit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The claim named the process's connection: still owned, and its completion lands.
    let now = claim(&other, &key, 0, None).await?;
    assert_eq!((now.outcome.as_str(), &now.owner), ("wait", &mine.owner));
    // The default (this server connection) is why owner_pid exists: that claim is gone
    // with the connection that happened to make it, and is taken over.
    assert_eq!(claim(&other, &unnamed, 0, None).await?.outcome, "claimed");
    assert!(complete(&pool, &key, mine.token.unwrap()).await?);

    // A second claim, then the process dies: its claims end with its connection.
    let key = fresh_key("owner-session-dies");
    assert_eq!(claim(&pool, &key, 0, Some(p)).await?.outcome, "claimed");
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move { claim(&other, &key, 20_000, None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed_at = Instant::now();
    once::terminate_backend(&admin, p).await?;
    let answer = waiting.await??;
    assert_eq!(answer.outcome, "claimed");
    // Woken as the owner exits, not when the 30 s lease runs out: a third of it leaves a
    // loaded machine room and still tells the two apart.
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "taken over {} ms after the process's connection closed",
        ms(killed_at.elapsed())
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn owner_pid_names_a_running_owner_session_or_nothing() -> Result<()> {
    let admin = admin().await?;
    let client = session().await?;
    for (pid, why) in [(-1, "must not be negative"), (999_999, "is running")] {
        let sql = format!("SELECT * FROM once.claim_key('k', owner_pid => {pid})");
        let error = client.simple_query(&sql).await.expect_err("refused");
        let db = error.as_db_error().unwrap();
        assert_eq!(db.code().code(), "22023", "{}", db.message());
        assert!(db.message().contains(why), "{}", db.message());
        assert!(db.hint().unwrap().contains("once.owner_session()"));
    }

    // 0: the lease alone. The claim outlives the connection that made it.
    let key = fresh_key("lease-only");
    let claimer = session().await?;
    let mine = claim(&claimer, &key, 0, Some(0)).await?;
    assert_eq!(mine.outcome, "claimed");
    let lease_only = value(
        &admin,
        &format!(
            "SELECT lease_only FROM once.entries WHERE key = {}",
            quote(&key)
        ),
    )
    .await?;
    assert_eq!(lease_only.as_deref(), Some("t"));
    once::terminate_backend(&admin, once::backend_pid(&claimer).await?).await?;
    let after = claim(&client, &key, 0, None).await?;
    assert_eq!(
        (after.outcome.as_str(), &after.owner),
        ("wait", &mine.owner)
    );
    assert!(after.owner.is_some());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn claim_next_waits_for_work_holding_no_lock() -> Result<()> {
    let _ddl = DDL.write().await;
    let admin = admin().await?;
    for (name, worker) in [("direct", session().await?), ("pgbouncer", pooled().await?)] {
        let queue = fresh_key("waiting-queue").replace('/', "-");
        admin
            .batch_execute(&format!("SELECT once.create_queue({})", quote(&queue)))
            .await?;

        // Nothing to do: an empty answer at the deadline.
        let (keys, took) = claim_next(&worker, &queue, 500).await?;
        assert!(keys.is_empty(), "{name}");
        assert!(
            ms(took) >= 450 && ms(took) < 2000,
            "{name}: empty after {} ms",
            ms(took)
        );

        // Work arrives while the worker waits; meanwhile DDL is not held up by it.
        let waiting = {
            let queue = queue.clone();
            tokio::spawn(async move {
                let answer = claim_next(&worker, &queue, 20_000).await;
                (answer, worker)
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        admin.batch_execute("VACUUM FULL once.entries").await?;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{name}: VACUUM FULL waited"
        );
        let key = fresh_key("job");
        let enqueued_at = Instant::now();
        admin
            .batch_execute(&format!(
                "SELECT once.enqueue_key({}, queue => {})",
                quote(&key),
                quote(&queue)
            ))
            .await?;
        let (answer, worker) = waiting.await?;
        let (keys, _) = answer?;
        assert_eq!(keys, vec![key.clone()], "{name}");
        assert!(enqueued_at.elapsed() < Duration::from_secs(3), "{name}");

        // A failure sends the key back after its backoff; a waiting worker gets it then.
        let token = value(
            &admin,
            &format!("SELECT token FROM once.entries WHERE key = {}", quote(&key)),
        )
        .await?
        .unwrap();
        let failed = value(
            &worker,
            &format!(
                "SELECT once.fail_key({}, {token}, 'boom', retry_after => '1 s')",
                quote(&key)
            ),
        )
        .await?;
        assert_eq!(failed.as_deref(), Some("t"));
        let (keys, took) = claim_next(&worker, &queue, 20_000).await?;
        assert_eq!(keys, vec![key.clone()], "{name}");
        assert!(
            ms(took) >= 800 && ms(took) < 6000,
            "{name}: retried after {} ms",
            ms(took)
        );
        admin
            .batch_execute(&format!(
                "SELECT once.invalidate_keys(queue => {})",
                quote(&queue)
            ))
            .await?;
    }
    Ok(())
}
