//! A small Rust client for pg_once, shared by the demo, the benchmarks, the soak driver and
//! the multi-connection tests. It is also the reference for what a client does: one
//! round trip to claim, compute, one round trip to complete.

use anyhow::{Context, Result};
use futures_util::{stream, StreamExt};
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, NoTls, Notification};

/// Connection string from `PG_ONCE_DSN`, as scripts/*.sh set it for their cluster.
pub fn dsn_from_env() -> Result<String> {
    std::env::var("PG_ONCE_DSN").context(
        "PG_ONCE_DSN is not set: run these through scripts/test.sh (or set it to a server with pg_once installed)",
    )
}

/// Open a connection whose driver runs on the current tokio runtime.
pub async fn connect(dsn: &str) -> Result<Client> {
    let (client, connection) = tokio_postgres::connect(dsn, NoTls)
        .await
        .with_context(|| format!("connecting to {dsn}"))?;
    tokio::spawn(async move {
        // The connection ends when the client is dropped or the backend goes away.
        let _ = connection.await;
    });
    Ok(client)
}

/// Open a connection and deliver its notifications (from LISTEN) to the returned receiver.
pub async fn connect_listening(
    dsn: &str,
) -> Result<(Client, mpsc::UnboundedReceiver<Notification>)> {
    let (client, mut connection) = tokio_postgres::connect(dsn, NoTls)
        .await
        .with_context(|| format!("connecting to {dsn}"))?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                if tx.send(n).is_err() {
                    break;
                }
            }
        }
    });
    Ok((client, rx))
}

/// The backend pid of a connection.
pub async fn backend_pid(client: &Client) -> Result<i32> {
    Ok(client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0))
}

/// What once.claim_key returned.
#[derive(Debug, Clone)]
pub struct Claim {
    pub outcome: String,
    pub token: Option<i64>,
    pub result: Option<serde_json::Value>,
    pub error: Option<String>,
    pub owner: Option<String>,
    pub lease_expires_at: Option<SystemTime>,
    pub attempts: Option<i32>,
}

impl Claim {
    pub fn is(&self, outcome: &str) -> bool {
        self.outcome == outcome
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// once.claim_key(key, lease, wait).
pub async fn claim_key(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
) -> Result<Claim> {
    let row = client
        .query_one(
            "SELECT outcome, token, result, error, owner, lease_expires_at, attempts
               FROM once.claim_key($1, make_interval(secs => $2), make_interval(secs => $3))",
            &[&key, &secs(lease), &secs(wait)],
        )
        .await?;
    Ok(Claim {
        outcome: row.get(0),
        token: row.get(1),
        result: row.get(2),
        error: row.get(3),
        owner: row.get(4),
        lease_expires_at: row.get(5),
        attempts: row.get(6),
    })
}

/// once.complete_key(key, token, result, ttl).
pub async fn complete_key(
    client: &Client,
    key: &str,
    token: i64,
    result: &serde_json::Value,
    ttl: Option<Duration>,
) -> Result<bool> {
    let ttl = ttl.map(secs);
    Ok(client
        .query_one(
            "SELECT once.complete_key($1, $2, $3, make_interval(secs => $4))",
            &[&key, &token, result, &ttl],
        )
        .await?
        .get(0))
}

/// once.fail_key(key, token, error, retry_after).
pub async fn fail_key(
    client: &Client,
    key: &str,
    token: i64,
    error: &str,
    retry_after: Duration,
) -> Result<bool> {
    Ok(client
        .query_one(
            "SELECT once.fail_key($1, $2, $3, make_interval(secs => $4))",
            &[&key, &token, &error, &secs(retry_after)],
        )
        .await?
        .get(0))
}

/// once.heartbeat_key(key, token, lease): the new expiry, or None if the claim was lost.
pub async fn heartbeat_key(
    client: &Client,
    key: &str,
    token: i64,
    lease: Duration,
) -> Result<Option<SystemTime>> {
    Ok(client
        .query_one(
            "SELECT once.heartbeat_key($1, $2, make_interval(secs => $3))",
            &[&key, &token, &secs(lease)],
        )
        .await?
        .get(0))
}

/// once.release_key(key, token).
pub async fn release_key(client: &Client, key: &str, token: i64) -> Result<bool> {
    Ok(client
        .query_one("SELECT once.release_key($1, $2)", &[&key, &token])
        .await?
        .get(0))
}

/// once.invalidate_key(key).
pub async fn invalidate_key(client: &Client, key: &str) -> Result<bool> {
    Ok(client
        .query_one("SELECT once.invalidate_key($1)", &[&key])
        .await?
        .get(0))
}

/// once.reap_stale(): (claims reclaimed, results expired).
pub async fn reap_stale(client: &Client) -> Result<(i64, i64)> {
    let row = client
        .query_one("SELECT reclaimed, expired FROM once.reap_stale()", &[])
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Terminate another backend, as an operator or a crash would, and wait until it is gone.
pub async fn terminate_backend(admin: &Client, pid: i32) -> Result<()> {
    let done: bool = admin
        .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
        .await?
        .get(0);
    anyhow::ensure!(done, "backend {pid} did not exit within 5 s");
    Ok(())
}
