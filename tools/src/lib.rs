//! What the demo, the benchmarks, the soak driver and the multi-connection tests share:
//! the SQL calls of `pg_once_client::raw` (re-exported here, with the forms these tools
//! use), plus test utilities that are not client API (connecting, LISTEN receivers,
//! backend pids, terminating backends).

use anyhow::{Context, Result};
use futures_util::{stream, StreamExt};
use std::time::Duration;
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

pub use pg_once_client;
pub use pg_once_client::raw::{
    complete_key, fail_key, heartbeat_key, invalidate_key, release_key, Claim, Owner,
};

/// once.claim_key(key, lease, wait), the claim belonging to the calling connection
/// (`owner_pid` left out): the form the benchmarks and the multi-connection tests use,
/// where each simulated client is one direct connection. Applications use
/// `pg_once_client::Client`, which claims as its LISTEN connection.
pub async fn claim_key(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
) -> Result<Claim> {
    Ok(pg_once_client::raw::claim_key(client, key, lease, wait, Owner::Connection).await?)
}

/// once.reap_stale(): (claims reclaimed, results expired).
pub async fn reap_stale(client: &Client) -> Result<(i64, i64)> {
    let reaped = pg_once_client::raw::reap_stale(client).await?;
    Ok((reaped.reclaimed, reaped.expired))
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
