//! The pg_once launcher and its workers always come back: after pg_terminate_backend of
//! either, for a database created after the server started, and never in a storm.
//! scripts/test.sh runs this binary alone, one test at a time (they terminate the
//! launcher and the workers, create and drop databases and restart the server), with
//! PG_ONCE_SERVER_LOG naming the server's log and PG_ONCE_DATA_DIR its data directory.
//! On a server without pg_once preloaded there are no workers: every test returns at once.
//!
//! The preloaded server lists `pg_once_missing`, a database that does not exist, in
//! once.databases.

use anyhow::{bail, Context, Result};
use pg_once_multi::{admin, fresh_key, once, pg_ctl};
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// Named in the preloaded server's once.databases, created and dropped by these tests.
const MISSING: &str = "pg_once_missing";

/// How soon a terminated worker or launcher must be back (each restarts a second later).
const BACK_WITHIN: Duration = Duration::from_secs(2);

async fn preloaded(client: &Client) -> Result<bool> {
    Ok(client
        .query_one("SELECT shared_memory FROM once.stats", &[])
        .await?
        .get(0))
}

/// A connection to database `db` of the test server.
async fn connect_to(db: &str) -> Result<Client> {
    once::connect(&format!("{} dbname={db}", once::dsn_from_env()?)).await
}

/// Pids of the pg_once workers connected to database `db`.
async fn workers_of(client: &Client, db: &str) -> Result<Vec<i32>> {
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_once worker' AND datname = $1",
            &[&db],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

async fn launcher_pid(client: &Client) -> Result<Option<i32>> {
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_once launcher'",
            &[],
        )
        .await?;
    anyhow::ensure!(rows.len() <= 1, "{} pg_once launchers", rows.len());
    Ok(rows.first().map(|r| r.get(0)))
}

/// Poll `probe` every 50 ms until it yields a value, for at most `within`.
async fn poll<T, F, Fut>(within: Duration, mut probe: F) -> Result<Option<T>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = probe().await? {
            return Ok(Some(found));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The one pg_once worker of database `db` other than `except`, waiting for it up to
/// `within`.
async fn worker_within(
    client: &Client,
    db: &str,
    except: Option<i32>,
    within: Duration,
) -> Result<Option<i32>> {
    poll(within, || async move {
        let pids = workers_of(client, db).await?;
        anyhow::ensure!(pids.len() <= 1, "{} pg_once workers for {db}", pids.len());
        Ok(pids.first().copied().filter(|&pid| Some(pid) != except))
    })
    .await
}

async fn terminate(client: &Client, pid: i32) -> Result<()> {
    let signalled: bool = client
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await?
        .get(0);
    anyhow::ensure!(signalled, "could not signal {pid}");
    Ok(())
}

async fn current_database(client: &Client) -> Result<String> {
    Ok(client
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0))
}

async fn drop_database(client: &Client, db: &str) -> Result<()> {
    // FORCE: a pg_once worker may be connected to it.
    client
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    Ok(())
}

/// The server's log so far (scripts/test.sh sets PG_ONCE_SERVER_LOG).
fn server_log() -> Result<String> {
    let path = std::env::var("PG_ONCE_SERVER_LOG")
        .context("PG_ONCE_SERVER_LOG is not set: run through scripts/test.sh")?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {path}"))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_terminated_worker_is_back_within_two_seconds_twice_and_reaps() -> Result<()> {
    let admin = admin().await?;
    if !preloaded(&admin).await? {
        return Ok(());
    }
    let db = current_database(&admin).await?;
    let mut worker = worker_within(&admin, &db, None, Duration::from_secs(10))
        .await?
        .context("no pg_once worker to begin with")?;
    for round in 1..=2 {
        let terminated = Instant::now();
        terminate(&admin, worker).await?;
        worker = worker_within(&admin, &db, Some(worker), BACK_WITHIN)
            .await?
            .with_context(|| {
                format!("round {round}: no new pg_once worker within {BACK_WITHIN:?} of pg_terminate_backend")
            })?;
        eprintln!("round {round}: back after {:?}", terminated.elapsed());
    }
    // The worker is not only there but working: a claim whose owner exits is reaped with
    // no client call.
    let key = fresh_key("reaped-after-restart");
    let owner = pg_once_multi::session().await?;
    assert!(
        once::claim_key(&owner, &key, Duration::from_secs(600), Duration::ZERO)
            .await?
            .is("claimed")
    );
    drop(owner);
    let reaped = poll(Duration::from_secs(5), || async {
        let state: String = admin
            .query_one(
                "SELECT state::text FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[&key],
            )
            .await?
            .get(0);
        Ok((state != "running").then_some(state))
    })
    .await?;
    assert!(
        reaped.is_some(),
        "the claim of an owner that exited is still running 5 s later"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_count_the_worker_of_this_database_only() -> Result<()> {
    let admin = admin().await?;
    if !preloaded(&admin).await? {
        return Ok(());
    }
    let workers = poll(Duration::from_secs(5), || async {
        let workers: Option<i32> = admin
            .query_one("SELECT workers FROM once.stats", &[])
            .await?
            .get(0);
        Ok((workers == Some(1)).then_some(()))
    })
    .await?;
    assert!(
        workers.is_some(),
        "once.stats.workers is not 1 where a worker runs"
    );

    // A database that once.databases does not name: no worker of its own.
    let unlisted = "pg_once_unlisted";
    drop_database(&admin, unlisted).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {unlisted}"))
        .await?;
    let there = connect_to(unlisted).await?;
    there.batch_execute("CREATE EXTENSION pg_once").await?;
    let row = there
        .query_one("SELECT shared_memory, workers FROM once.stats", &[])
        .await?;
    let (shared_memory, workers): (bool, Option<i32>) = (row.get(0), row.get(1));
    drop(there);
    drop_database(&admin, unlisted).await?;
    assert!(shared_memory);
    assert_eq!(
        workers,
        Some(0),
        "once.stats.workers counted another database's worker"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_database_is_logged_once_and_gets_its_worker_once_created() -> Result<()> {
    let admin = admin().await?;
    if !preloaded(&admin).await? {
        return Ok(());
    }
    let databases: String = admin
        .query_one("SELECT current_setting('once.databases')", &[])
        .await?
        .get(0);
    anyhow::ensure!(
        databases.split(',').any(|db| db.trim() == MISSING),
        "once.databases is {databases:?}: scripts/test.sh lists {MISSING} in it"
    );
    drop_database(&admin, MISSING).await?;
    // Longer than the launcher's 5 s between looks, and than several restarts of a worker
    // every second: one line per look, or per restart, would show.
    tokio::time::sleep(Duration::from_secs(6)).await;

    // The launcher logs a missing database once when it starts, and once each time the
    // database goes missing again after it existed.
    let log = server_log()?;
    let since = [
        "pg_once launcher started".to_string(),
        format!("database \"{MISSING}\" now exists"),
    ]
    .iter()
    .filter_map(|marker| log.rfind(marker.as_str()))
    .max()
    .unwrap_or(0);
    let missing_lines: Vec<&str> = log[since..]
        .lines()
        .filter(|line| line.contains(MISSING) && line.contains("does not exist"))
        .collect();
    assert_eq!(
        missing_lines.len(),
        1,
        "the missing database was not logged exactly once: {missing_lines:#?}"
    );
    assert!(
        missing_lines[0].contains("WARNING"),
        "{missing_lines:?}: a warning"
    );

    admin
        .batch_execute(&format!("CREATE DATABASE {MISSING}"))
        .await?;
    let there = connect_to(MISSING).await?;
    there.batch_execute("CREATE EXTENSION pg_once").await?;
    let created = Instant::now();
    let worker = worker_within(&admin, MISSING, None, Duration::from_secs(8)).await?;
    let took = created.elapsed();
    // The worker shows in pg_stat_activity as soon as it has connected, and serves the
    // database (once.stats counts it) once it has attached the relay, a moment later: a
    // loaded run read 0 in between. Waited for, within the same 8 s.
    let workers = poll(
        Duration::from_secs(8).saturating_sub(created.elapsed()),
        || async {
            let workers: Option<i32> = there
                .query_one("SELECT workers FROM once.stats", &[])
                .await?
                .get(0);
            Ok(Some(workers).filter(|w| *w == Some(1)))
        },
    )
    .await?
    .flatten();
    drop(there);
    drop_database(&admin, MISSING).await?;
    assert!(
        worker.is_some(),
        "no pg_once worker for {MISSING} 8 s after it was created"
    );
    eprintln!("worker for the created database after {took:?}");
    assert_eq!(workers, Some(1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_terminated_launcher_is_back_and_keeps_the_running_workers() -> Result<()> {
    let admin = admin().await?;
    if !preloaded(&admin).await? {
        return Ok(());
    }
    let db = current_database(&admin).await?;
    let worker = worker_within(&admin, &db, None, Duration::from_secs(10))
        .await?
        .context("no pg_once worker to begin with")?;
    let launcher = launcher_pid(&admin).await?.context("no pg_once launcher")?;
    terminate(&admin, launcher).await?;
    let back = poll(BACK_WITHIN, || async {
        Ok(launcher_pid(&admin).await?.filter(|&pid| pid != launcher))
    })
    .await?;
    assert!(
        back.is_some(),
        "no new pg_once launcher within {BACK_WITHIN:?}"
    );
    // The new launcher found the worker running: it started no second one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(workers_of(&admin, &db).await?, vec![worker]);
    // And it watches it: a worker it did not start is restarted too.
    terminate(&admin, worker).await?;
    let again = worker_within(&admin, &db, Some(worker), BACK_WITHIN).await?;
    assert!(
        again.is_some(),
        "the worker the new launcher found was not restarted within {BACK_WITHIN:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_failing_at_start_is_retried_with_a_growing_backoff() -> Result<()> {
    let admin = admin().await?;
    if !preloaded(&admin).await? {
        return Ok(());
    }
    drop_database(&admin, MISSING).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {MISSING}"))
        .await?;
    let worker = worker_within(&admin, MISSING, None, Duration::from_secs(8))
        .await?
        .with_context(|| format!("no pg_once worker for {MISSING} once created"))?;
    tokio::time::sleep(Duration::from_millis(300)).await;

    // From now on its worker fails as it connects, every time it is started.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {MISSING} WITH ALLOW_CONNECTIONS false"
        ))
        .await?;
    let from = server_log()?.len();
    terminate(&admin, worker).await?;
    tokio::time::sleep(Duration::from_secs(9)).await;
    let log = server_log()?;
    let refused = log[from..]
        .lines()
        .filter(|line| line.contains(&format!("\"{MISSING}\" is not currently accepting")))
        .count();

    // Started again at about 1, 2, 4 and 8 s (then 16, 32, 60 s): 4 failures in 9 s,
    // where a restart every second would fail 9 times.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {MISSING} WITH ALLOW_CONNECTIONS true"
        ))
        .await?;
    let back = worker_within(&admin, MISSING, None, Duration::from_secs(12)).await?;
    drop_database(&admin, MISSING).await?;
    assert!(
        (2..=5).contains(&refused),
        "the failing worker was started {refused} times in 9 s"
    );
    assert!(
        back.is_some(),
        "no worker once the database accepted connections again"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fast_shutdown_stops_the_launcher_and_its_workers_at_once() -> Result<()> {
    let admin = admin().await?;
    if !preloaded(&admin).await? {
        return Ok(());
    }
    let db = current_database(&admin).await?;
    worker_within(&admin, &db, None, Duration::from_secs(10))
        .await?
        .context("no pg_once worker to begin with")?;
    drop(admin);
    let from = server_log()?.len();
    let stopping = Instant::now();
    pg_ctl(&["stop", "-m", "fast"])?;
    let took = stopping.elapsed();
    let log_path = std::env::var("PG_ONCE_SERVER_LOG")?;
    pg_ctl(&["start", "-l", &log_path])?;
    let log = server_log()?;
    let shutdown = &log[from..];
    let end = shutdown
        .find("database system is shut down")
        .context("no shutdown in the log")?;
    let complaints: Vec<&str> = shutdown[..end]
        .lines()
        .filter(|l| {
            l.contains("pg_once")
                && (l.contains("ERROR") || l.contains("FATAL") || l.contains("PANIC"))
        })
        .collect();
    assert!(complaints.is_empty(), "{complaints:#?}");
    assert!(took < Duration::from_secs(10), "the shutdown took {took:?}");

    let admin = connect_when_up().await?;
    let worker = worker_within(&admin, &db, None, Duration::from_secs(10)).await?;
    assert!(worker.is_some(), "no pg_once worker after the restart");
    Ok(())
}

/// Connect, retrying while the server starts.
async fn connect_when_up() -> Result<Client> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match admin().await {
            Ok(client) => return Ok(client),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => bail!("the server did not come back: {e:#}"),
        }
    }
}
