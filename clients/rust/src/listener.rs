//! The process's one LISTEN connection.
//!
//! It does two jobs. It names the process as the owner of its claims: it calls
//! `once.owner_session()` and every claim passes the returned pid as `owner_pid`, so when
//! the process dies (and this connection with it) the server ends its claims within about
//! a second, while pooled server connections can come and go. And it multiplexes wake-ups:
//! every key is notified on channel `once` with the key (or, in a namespace, its digest)
//! as payload, and each waiting call
//! registers an [`Interest`] in its key before asking the server, so a completion that
//! lands between the question and the sleep still wakes it.
//!
//! When the connection is lost it reconnects with backoff, LISTENs again and gets a new
//! pid; meanwhile claims wait for it, and every waiter is woken (notifications may have
//! been missed) to ask the server again.

use crate::conninfo::Conninfo;
use crate::error::{Error, Result};
use crate::raw::Owner;
use futures_util::{stream, StreamExt};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;

/// The channel pg_once notifies on.
pub const CHANNEL: &str = "once";

/// How the LISTEN connection is doing.
#[derive(Debug, Clone, Default)]
pub(crate) struct State {
    /// The owner to claim as; None while (re)connecting.
    pub owner: Option<Owner>,
    /// The backend pid of the LISTEN connection, when connected.
    pub pid: Option<i32>,
    /// Why the last connection attempt failed, for error messages.
    pub last_error: Option<String>,
    /// The last attempt found the connection cannot work as configured (a transaction
    /// pooler): claims fail with this at once rather than wait for a connection.
    pub misconfigured: Option<Error>,
}

/// Per-key wake-up senders; a key is in the map while some call is interested in it.
/// A key of a namespace created with notify => 'digest' is notified as its hex SHA-256
/// (`encode(once.key_hash(key), 'hex')`), so each key is also found by its digest.
#[derive(Default)]
struct Registry {
    keys: Mutex<Keys>,
}

#[derive(Default)]
struct Keys {
    senders: HashMap<String, watch::Sender<u64>>,
    /// Digest -> key, for every key in `senders`.
    by_digest: HashMap<String, String>,
}

/// The hex SHA-256 of a key: what channel `once` carries for a key of a namespace that
/// announces digests.
pub(crate) fn digest(key: &str) -> String {
    hex(&Sha256::digest(key.as_bytes()))
}

/// Lower-case hex, as PostgreSQL's `encode(..., 'hex')` writes bytes.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Registry {
    fn wake(&self, payload: &str) {
        if payload.is_empty() {
            // A transaction that resolved very many keys announces them all as one empty
            // payload (keys are never empty): every waiter asks again.
            self.wake_all();
            return;
        }
        let keys = self.keys.lock().unwrap();
        let key = keys.by_digest.get(payload).map_or(payload, String::as_str);
        if let Some(tx) = keys.senders.get(key) {
            tx.send_modify(|n| *n += 1);
        }
    }
    fn interest(registry: &Arc<Registry>, key: &str) -> Interest {
        let mut keys = registry.keys.lock().unwrap();
        if !keys.senders.contains_key(key) {
            keys.by_digest.insert(digest(key), key.to_owned());
        }
        let rx = keys
            .senders
            .entry(key.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Interest {
            registry: registry.clone(),
            key: key.to_owned(),
            rx: Some(rx),
        }
    }

    fn wake_all(&self) {
        for tx in self.keys.lock().unwrap().senders.values() {
            tx.send_modify(|n| *n += 1);
        }
    }
}

/// A waiting call's registration for one key. Any notification of the key (or a
/// reconnection of the listener) after it was created makes [`Interest::changed`] return.
pub(crate) struct Interest {
    registry: Arc<Registry>,
    key: String,
    rx: Option<watch::Receiver<u64>>,
}

impl Interest {
    /// Resolves once the key was notified since the interest was created or last woken.
    pub async fn changed(&mut self) {
        if let Some(rx) = self.rx.as_mut() {
            if rx.changed().await.is_err() {
                // Cannot happen while we hold a receiver (the sender stays in the map);
                // never spin if it does.
                std::future::pending::<()>().await;
            }
        }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut keys = self.registry.keys.lock().unwrap();
        self.rx.take();
        if keys
            .senders
            .get(&self.key)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            keys.senders.remove(&self.key);
            keys.by_digest.remove(&digest(&self.key));
        }
    }
}

/// Handle on the listener task; dropping it closes the LISTEN connection, which ends the
/// claims it owns.
pub(crate) struct Listener {
    registry: Arc<Registry>,
    state: watch::Receiver<State>,
    task: JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Aborts a spawned task when dropped, so a connection's driver dies with its owner.
struct AbortOnDrop(JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Listener {
    /// Start the listener task; it connects in the background.
    pub fn start(conninfo: String) -> Result<Self> {
        let config = Conninfo::parse(&conninfo).map_err(|e| match e {
            Error::Configuration(why) => Error::Configuration(format!("listen_conninfo: {why}")),
            other => other,
        })?;
        let registry = Arc::new(Registry::default());
        let (state_tx, state) = watch::channel(State::default());
        let task = tokio::spawn(run(config, registry.clone(), state_tx));
        Ok(Listener {
            registry,
            state,
            task,
        })
    }

    /// Register interest in `key`: call before asking the server about it.
    pub fn interest(&self, key: &str) -> Interest {
        Registry::interest(&self.registry, key)
    }

    /// The owner to claim as, waiting up to `patience` for the connection to be up.
    pub async fn owner(&self, patience: Duration) -> Result<Owner> {
        let mut state = self.state.clone();
        let ready = |s: &State| s.owner.is_some() || s.misconfigured.is_some();
        let waited = tokio::time::timeout(patience, state.wait_for(ready)).await;
        match waited {
            Ok(Ok(s)) => match (&s.misconfigured, s.owner) {
                (Some(e), _) => Err(e.clone()),
                (None, owner) => Ok(owner.expect("waited for it")),
            },
            _ => Err(Error::Listener(
                self.state
                    .borrow()
                    .last_error
                    .clone()
                    .unwrap_or_else(|| format!("not connected after {patience:?}")),
            )),
        }
    }

    /// Whether the owner `was` is gone: the LISTEN connection it names has dropped (or
    /// been replaced) within `patience`. A claim refused with 22023 for a dead owner pid
    /// raced the connection's end, and is asked again with the new pid (rule R3).
    pub async fn replaced(&self, was: Owner, patience: Duration) -> bool {
        let mut state = self.state.clone();
        let gone = tokio::time::timeout(patience, state.wait_for(|s| s.owner != Some(was)))
            .await
            .is_ok_and(|changed| changed.is_ok());
        gone
    }

    /// The backend pid of the LISTEN connection, if connected.
    pub fn pid(&self) -> Option<i32> {
        self.state.borrow().pid
    }
}

/// Connect, LISTEN, name the owner, relay notifications; on loss, start over.
async fn run(config: Conninfo, registry: Arc<Registry>, state: watch::Sender<State>) {
    let mut backoff = Duration::from_millis(50);
    let mut warned_legacy = false;
    loop {
        match session(&config, &registry, &state, &mut warned_legacy).await {
            Ok(()) => backoff = Duration::from_millis(50),
            Err(e) => {
                if matches!(e, Error::Configuration(_)) {
                    tracing::error!(error = %e, "pg_once: the LISTEN connection cannot work");
                }
                state.send_modify(|s| {
                    s.last_error = Some(e.to_string());
                    s.misconfigured = matches!(e, Error::Configuration(_)).then_some(e);
                });
            }
        }
        // The connection is gone: claims must wait for the next one, and every waiter
        // asks the server again (its key's notification may have been missed).
        state.send_modify(|s| {
            s.owner = None;
            s.pid = None;
        });
        registry.wake_all();
        tokio::time::sleep(crate::jitter(backoff)).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// The warning for a server without `once.owner_session()` (rule F7).
const LEGACY_SERVER: &str = "pg_once: the server has no once.owner_session() \
    (pg_once before 0.2.0): claims belong to the pooled connection that made them, and a \
    recycled connection loses them (ALTER EXTENSION pg_once UPDATE)";

/// Why a LISTEN connection through a transaction pooler is refused (rule N5).
const TRANSACTION_POOLER: &str = "the LISTEN connection goes through a transaction pooler \
    (PgBouncer in transaction mode?): notifications would never arrive. Set listen_conninfo \
    to a direct or session-pooled connection string (the pool may stay on the transaction \
    pooler)";

/// How long a probe notification may take to come back before the LISTEN connection is
/// judged to be behind a transaction pooler. On a direct or session-pooled connection it
/// arrives in milliseconds.
const PROBE_PATIENCE: Duration = Duration::from_secs(2);

/// How long the LISTEN connection may stay silent before it is checked with a query, and
/// how long that query may take (rule N4, as in the Python and Node clients).
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// How long connecting the LISTEN connection may take when the conninfo sets no
/// `connect_timeout` (the pool's default, [`crate::Options::connect_timeout`]).
const CONNECT_PATIENCE: Duration = Duration::from_secs(10);

/// The first column of the first row of `sql`, an integer (simple query protocol: no
/// statement is prepared).
async fn first_int(client: &tokio_postgres::Client, sql: &str) -> Result<i32> {
    client
        .simple_query(sql)
        .await?
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .ok_or_else(|| Error::Protocol(format!("{sql} returned no integer")))
}

/// Whether a notification sent on another connection reaches this LISTEN connection
/// within [`PROBE_PATIENCE`]. Payloads that arrive meanwhile are passed on as usual.
async fn probe_arrives(
    config: &Conninfo,
    notifications: &mut mpsc::UnboundedReceiver<String>,
    registry: &Registry,
) -> Result<bool> {
    let probe = format!("pg_once-probe:{:016x}", fastrand::u64(..));
    let sender = config.connect().await?;
    sender
        .simple_query(&format!("NOTIFY {CHANNEL}, '{probe}'"))
        .await?;
    let arrived = tokio::time::timeout(PROBE_PATIENCE, async {
        while let Some(payload) = notifications.recv().await {
            if payload == probe {
                return true;
            }
            registry.wake(&payload);
        }
        false
    })
    .await;
    Ok(arrived.unwrap_or(false))
}

/// One LISTEN connection, from connecting until it closes. Ok if it was up at some point.
async fn session(
    config: &Conninfo,
    registry: &Registry,
    state: &watch::Sender<State>,
    warned_legacy: &mut bool,
) -> Result<()> {
    // Bounded, as libpq's connect_timeout would be: a network that swallows every packet
    // (what N4's check replaces a connection for) would otherwise hang the reconnection.
    let patience = config
        .config()
        .get_connect_timeout()
        .copied()
        .unwrap_or(CONNECT_PATIENCE);
    let (client, mut connection) =
        tokio::time::timeout(patience, config.config().connect(config.connector()?))
            .await
            .map_err(|_| Error::Listener(format!("could not connect within {patience:?}")))??;
    let (tx, mut notifications) = mpsc::unbounded_channel();
    let _driver = AbortOnDrop(tokio::spawn(async move {
        let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                if n.channel() == CHANNEL && tx.send(n.payload().to_owned()).is_err() {
                    break;
                }
            }
        }
        // Dropping tx tells the session the connection is gone.
    }));
    client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
    let owner = match first_int(&client, "SELECT once.owner_session()").await {
        Ok(pid) => Owner::Session(pid),
        Err(Error::Db(e))
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_FUNCTION) =>
        {
            // A server that predates owner_session(): claims fall back to belonging to
            // the connection that makes them (owner_pid left out). F7: said once per
            // client, not at every reconnection.
            if !std::mem::replace(warned_legacy, true) {
                tracing::warn!("{LEGACY_SERVER}");
            }
            Owner::Connection
        }
        Err(e) => return Err(e),
    };
    let backend = first_int(&client, "SELECT pg_backend_pid()").await?;
    if let Owner::Session(pid) = owner {
        // N5: through a transaction pooler the LISTEN is on whichever server connection
        // ran it, notifications never reach us, and every waiter would fall back to its
        // recheck. Two statements answered by different backends give the pooler away;
        // the same backend proves nothing (a quiet pooler hands it back), so a probe
        // notified from another connection must also arrive.
        if pid != backend || !probe_arrives(config, &mut notifications, registry).await? {
            return Err(Error::Configuration(TRANSACTION_POOLER.into()));
        }
    }
    state.send_modify(|s| {
        s.owner = Some(owner);
        s.pid = Some(backend);
        s.last_error = None;
        s.misconfigured = None;
    });
    // Anything notified while we were away was missed: everyone looks again.
    registry.wake_all();
    loop {
        match tokio::time::timeout(IDLE_CHECK, notifications.recv()).await {
            Ok(Some(key)) => registry.wake(&key),
            Ok(None) => break, // the connection closed
            Err(_idle) => {
                // N4: a connection whose network went silent (no FIN, no RST) tells us
                // nothing for minutes (TCP keepalive), and meanwhile every wake-up is lost
                // without a word. A query every IDLE_CHECK of silence, answered within as
                // much, or the connection is replaced.
                let check = tokio::time::timeout(IDLE_CHECK, client.simple_query("SELECT 1"));
                let failed = match check.await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("no answer to a check within {IDLE_CHECK:?}"),
                };
                tracing::warn!(
                    error = failed,
                    "pg_once: the LISTEN connection failed, reconnecting"
                );
                break;
            }
        }
    }
    drop(client);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{digest, Registry};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_digest_is_the_servers_hex_sha256() {
        // encode(once.key_hash('abc'), 'hex') on the server.
        assert_eq!(
            digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[tokio::test]
    async fn a_key_is_woken_by_its_name_or_by_its_digest() {
        let registry = Arc::new(Registry::default());
        for payload in ["tenant2/k".to_owned(), digest("tenant2/k")] {
            let mut interest = Registry::interest(&registry, "tenant2/k");
            registry.wake(&payload);
            tokio::time::timeout(Duration::from_secs(1), interest.changed())
                .await
                .unwrap_or_else(|_| panic!("not woken by {payload}"));
        }
        // An empty payload wakes every waiter, whatever its key.
        let mut a = Registry::interest(&registry, "a");
        let mut b = Registry::interest(&registry, "b");
        registry.wake("");
        for interest in [&mut a, &mut b] {
            tokio::time::timeout(Duration::from_secs(1), interest.changed())
                .await
                .expect("not woken by an empty payload");
        }
        drop((a, b));
        // Interests gone: the digest is forgotten with the key.
        assert!(registry.keys.lock().unwrap().by_digest.is_empty());
    }
}
