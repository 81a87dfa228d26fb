//! Helpers for tests that need several real connections to a running server with
//! pg_once installed (scripts/test.sh starts one and sets PG_ONCE_DSN).

use anyhow::{Context, Result};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;
use tokio_postgres::Client;

pub use pg_once_tools as once;

/// Whether `write` answers within 5 s (its own error, if it failed); `what` names what it
/// would have waited for. Tests that hold something open end it after this, whatever the
/// answer, and only then return the error.
pub async fn answers_in_time<T, E>(
    write: impl std::future::Future<Output = std::result::Result<T, E>>,
    what: &str,
) -> Result<()>
where
    anyhow::Error: From<E>,
{
    match tokio::time::timeout(Duration::from_secs(5), write).await {
        Ok(answer) => answer.map(|_| ()).map_err(anyhow::Error::from),
        Err(_) => anyhow::bail!("a write waited 5 s for {what}"),
    }
}

/// Whether the server runs the SQL edition (docs/sql-edition.md) rather than the
/// extension: PG_ONCE_EDITION_SCRIPT names its script (scripts/sql-edition.sh's
/// pg_once_sql.sql), which `admin` installs as PG_ONCE_DSN's role, the database's owner
/// (scripts/test-sql-edition.sh runs the tests this way). The same tests attack both.
pub fn edition() -> bool {
    std::env::var_os("PG_ONCE_EDITION_SCRIPT").is_some()
}

/// A connection to the test server, with pg_once created if it is not yet: the
/// extension, or with PG_ONCE_EDITION_SCRIPT the SQL edition, installed by PG_ONCE_DSN's
/// role (the administrator of pg_once either way).
pub async fn admin() -> Result<Client> {
    // One test at a time: two concurrent CREATE EXTENSION IF NOT EXISTS both find it
    // missing, and one fails on the catalog's unique index.
    static CREATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let client = once::connect(&once::dsn_from_env()?).await?;
    let _creating = CREATING.lock().await;
    match std::env::var_os("PG_ONCE_EDITION_SCRIPT") {
        None => {
            client
                .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_once")
                .await?
        }
        Some(path) => {
            let installed: bool = client
                .query_one("SELECT to_regnamespace('once') IS NOT NULL", &[])
                .await?
                .get(0);
            if !installed {
                // The script is psql's: its one meta-command goes (it runs in one
                // transaction, which stops at its first error anyway).
                let script = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading PG_ONCE_EDITION_SCRIPT {path:?}"))?
                    .replace("\\set ON_ERROR_STOP 1\n", "");
                client.batch_execute(&script).await?;
            }
        }
    }
    Ok(client)
}

/// A connection as a superuser: PG_ONCE_SUPERUSER_DSN, else PG_ONCE_DSN (whose role is
/// a superuser on the extension's test servers). On the SQL edition's server PG_ONCE_DSN
/// is the database's owner, who installed it and is no superuser; the attacks that a
/// superuser's session must not carry out (its ANALYZE, its call of another role's
/// SECURITY DEFINER code) go through this one.
pub async fn superuser() -> Result<Client> {
    admin().await?;
    match std::env::var("PG_ONCE_SUPERUSER_DSN") {
        Ok(dsn) => once::connect(&dsn).await,
        Err(_) => once::connect(&once::dsn_from_env()?).await,
    }
}

/// The server's max_prepared_transactions: tests that PREPARE TRANSACTION skip below what
/// they need (the clusters of scripts/lib.sh have 10).
pub async fn max_prepared_transactions(client: &Client) -> Result<i32> {
    Ok(client
        .query_one(
            "SELECT current_setting('max_prepared_transactions')::int",
            &[],
        )
        .await?
        .get(0))
}

/// How once.stats' counts by state (kept as keys change) differ from a count of the keys
/// themselves, read in one snapshot; None when they agree. Read as an administrator, who
/// sees every key.
pub async fn stats_disagreement(client: &Client) -> Result<Option<String>> {
    let row = client
        .query_one(
            "SELECT s.c = e.c, s.c, e.c
               FROM (SELECT format('%s/%s/%s/%s/%s/%s', queued, running, done, failed, errors, attempts) AS c
                       FROM once.stats) s,
                    (SELECT format('%s/%s/%s/%s/%s/%s', count(*) FILTER (WHERE state = 'queued'),
                            count(*) FILTER (WHERE state = 'running'), count(*) FILTER (WHERE state = 'done'),
                            count(*) FILTER (WHERE state = 'failed'), coalesce(sum(errors), 0),
                            coalesce(sum(attempts), 0)) AS c
                       FROM once.entries) e",
            &[],
        )
        .await?;
    Ok(if row.get::<_, bool>(0) {
        None
    } else {
        Some(format!(
            "once.stats says {} (queued/running/done/failed/errors/attempts), the keys {}",
            row.get::<_, String>(1),
            row.get::<_, String>(2)
        ))
    })
}

/// Another plain connection to the test server.
pub async fn session() -> Result<Client> {
    once::connect(&once::dsn_from_env()?).await
}

/// Claim `key` (a ten-minute lease, no wait) and return its token; an error if the claim
/// is answered anything but `claimed`. What the token tests draw their tokens with.
pub async fn claimed_token(client: &Client, key: &str) -> Result<i64> {
    let claim = once::claim_key(client, key, Duration::from_secs(600), Duration::ZERO).await?;
    anyhow::ensure!(claim.is("claimed"), "{key}: {claim:?}");
    claim.token.context("a claim has a token")
}

/// A key no other test (nor an earlier run against the same server) uses.
pub fn fresh_key(name: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}/{nanos}/{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Calls claim_key on its own task, so the test can act while it waits. The task
/// yields the claim and the instant claim_key returned, for measuring wake-up times.
pub fn spawn_claim(
    client: Client,
    key: &str,
    lease: Duration,
    wait: Duration,
) -> JoinHandle<(Result<once::Claim>, Instant)> {
    let key = key.to_owned();
    tokio::spawn(async move {
        let claim = once::claim_key(&client, &key, lease, wait).await;
        (claim, Instant::now())
    })
}

/// The bin directory of the PostgreSQL that runs the test cluster (scripts/lib.sh exports
/// it as PG_ONCE_PG_BIN).
pub fn pg_bin() -> String {
    std::env::var("PG_ONCE_PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into())
}

/// Run the test cluster's pg_ctl on its data directory (PG_ONCE_DATA_DIR), as postgres.
/// For a PostgreSQL in a chroot, PG_ONCE_PG_BIN holds wrappers that enter it and switch
/// to postgres themselves (PG_ONCE_PG_BIN_SWITCHES_USER, see scripts/pg-versions.sh):
/// they must be run as root.
pub fn pg_ctl(args: &[&str]) -> Result<()> {
    let data = std::env::var("PG_ONCE_DATA_DIR")
        .context("PG_ONCE_DATA_DIR is not set: run through scripts/test.sh")?;
    pg_ctl_on(&data, args)
}

/// Start the test cluster (PG_ONCE_DATA_DIR) again after a test stopped it, logging where
/// scripts/lib.sh's cluster_start does.
pub fn start_test_server() -> Result<()> {
    let log = format!("{}/../server.log", std::env::var("PG_ONCE_DATA_DIR")?);
    pg_ctl(&["start", "-l", &log])
}

/// pg_ctl as [`pg_ctl`] does, on another cluster's data directory (a standby's).
pub fn pg_ctl_on(data: &str, args: &[&str]) -> Result<()> {
    let pg_ctl = format!("{}/pg_ctl", pg_bin());
    let mut command = if std::env::var_os("PG_ONCE_PG_BIN_SWITCHES_USER").is_some() {
        std::process::Command::new(&pg_ctl)
    } else {
        let mut runuser = std::process::Command::new("runuser");
        runuser.args(["-u", "postgres", "--", &pg_ctl]);
        runuser
    };
    let status = command
        .args(["-D", data, "-w", "-t", "60"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "pg_ctl {args:?} failed");
    Ok(())
}

/// Taken by every test of a file that creates or drops namespaces while other tests of
/// the same file claim keys: create_namespace locks once.entries against writes until it
/// commits, and a claim with `wait => 0` that meets that lock answers `wait` at once
/// rather than `claimed` (it never waits for a lock: docs/sql-reference.md).
pub static NAMESPACE_TESTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Roles as an administrator makes them for applications, and what a refusal says.
pub mod roles {
    use super::once;
    use anyhow::Result;
    use tokio_postgres::Client;

    /// A login role with the README's grants ("Granting access"), connected.
    pub async fn app_role(admin: &Client, name: &str) -> Result<Client> {
        // One at a time (an advisory lock): concurrent GRANTs on the same functions fail
        // with "tuple concurrently updated".
        admin
            .batch_execute(&format!(
                "BEGIN;
             SELECT pg_advisory_xact_lock(20261201);
             CREATE ROLE {name} LOGIN;
             GRANT USAGE ON SCHEMA once TO {name};
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO {name};
             GRANT SELECT ON once.stats, once.queue_stats, once.dead_letters, once.keys, once.namespaces
                TO {name};
             COMMIT;"
            ))
            .await?;
        connect_as(name).await
    }

    pub async fn connect_as(role: &str) -> Result<Client> {
        once::connect(&format!("{} user={role}", once::dsn_from_env()?)).await
    }

    /// The SQLSTATE and message of a failed statement.
    pub fn refusal<T: std::fmt::Debug>(
        result: Result<T, tokio_postgres::Error>,
    ) -> (String, String) {
        let error = result.expect_err("expected the call to be refused");
        let db = error.as_db_error().expect("a server error");
        (db.code().code().to_owned(), db.message().to_owned())
    }
}

/// claim_key with `wait => 0` while another session holds a lock that passes in moments
/// (`lock`: a BEGIN and the lock): held for good, the claim looks again for 100 ms, and
/// not much longer, then answers `wait`; released while it looks, it claims. `key` gives
/// the key of each claim. The lock is released as soon as `under_way` (SQL: whether the
/// claiming backend, $1, is at it) says so; that must come within those 100 ms, which a
/// loaded machine may miss, so the release is tried up to ten times.
pub async fn claims_once_a_lock_passes(
    lock: &str,
    key: impl Fn() -> String,
    under_way: &str,
) -> Result<()> {
    const LEASE: Duration = Duration::from_secs(30);
    // How late a call may answer on a loaded machine: a round trip and the scheduler.
    const SLACK: Duration = Duration::from_secs(2);
    let admin = admin().await?;
    let holder = session().await?;
    let mut claimer = session().await?;
    // A session's first call compiles the SQL edition's functions, which waits for any
    // lock on the table, as any statement naming it would: warmed first, as a pooled
    // connection is.
    once::claim_key(&claimer, &fresh_key("warm-up"), LEASE, Duration::ZERO).await?;

    holder.batch_execute(lock).await?;
    let started = Instant::now();
    let answer = once::claim_key(&claimer, &key(), LEASE, Duration::ZERO).await?;
    let took = started.elapsed();
    holder.batch_execute("ROLLBACK").await?;
    anyhow::ensure!(answer.is("wait"), "held for good: {answer:?}");
    anyhow::ensure!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(100) + SLACK,
        "held for good, the claim answered after {took:?}"
    );

    let claimer_pid = once::backend_pid(&claimer).await?;
    for _ in 0..10 {
        holder.batch_execute(lock).await?;
        let claiming = {
            let key = key();
            tokio::spawn(async move {
                let answer = once::claim_key(&claimer, &key, LEASE, Duration::ZERO).await;
                (answer, claimer)
            })
        };
        while !claiming.is_finished()
            && !admin
                .query_one(under_way, &[&claimer_pid])
                .await?
                .get::<_, bool>(0)
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        holder.batch_execute("COMMIT").await?;
        let (answer, back) = claiming.await?;
        claimer = back;
        if answer?.is("claimed") {
            return Ok(());
        }
    }
    anyhow::bail!("no claim was claimed once the lock passed, in ten tries")
}
