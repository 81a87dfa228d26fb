//! Background refreshes. A call answered `refresh` (the previous result, and a claim on
//! the key: the key is in its stale window, or a hit drew an early refresh) returns the
//! previous result at once; the key is recomputed on a task of its own, heartbeated, and
//! completed, or failed (the server keeps serving the previous result: stale-if-error).
//!
//! At most one refresh per key runs in a process. Each ends with its claim settled:
//! completed, failed, or given back (`release_key`) when the client shuts down or its last
//! clone is dropped, so that another caller refreshes the key instead of waiting for the
//! claim to be noticed dead.

use crate::error::Result;
use futures_util::future::BoxFuture;
use serde_json::Value;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long a stopped refresh may take to give its key back before
/// [`crate::Client::shutdown`] returns anyway (the server ends the claim when the
/// process's LISTEN connection closes, or at the end of its lease).
const RELEASE_PATIENCE: Duration = Duration::from_secs(5);

/// Whether the client starts and runs background refreshes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    /// `shutdown` is waiting for the running refreshes: new ones are given back at once.
    Draining,
    /// Running refreshes are stopped and their keys given back; new ones too.
    Stopped,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    /// The keys being refreshed in the background.
    running: HashSet<String>,
}

/// The refreshes of one client. Phase and running keys are one value, changed atomically,
/// so that no refresh can start unseen by a shutdown that is draining.
pub(crate) struct Refreshes {
    state: watch::Sender<State>,
}

impl Default for Refreshes {
    fn default() -> Self {
        Refreshes {
            state: watch::Sender::new(State {
                phase: Phase::Open,
                running: HashSet::new(),
            }),
        }
    }
}

impl Refreshes {
    /// Stop the running refreshes (they give their keys back) and start no more.
    pub fn stop(&self) {
        self.state.send_modify(|s| s.phase = Phase::Stopped);
    }

    /// Let the running refreshes finish for up to `drain`, then stop the rest and wait
    /// (up to [`RELEASE_PATIENCE`]) for their keys to be given back. No refresh starts
    /// from now on.
    pub async fn shutdown(&self, drain: Duration) {
        self.state.send_if_modified(|s| {
            let open = s.phase == Phase::Open;
            if open {
                s.phase = Phase::Draining;
            }
            open
        });
        if !self.settled(drain).await {
            self.stop();
            self.settled(RELEASE_PATIENCE).await;
        }
    }

    /// Wait until no refresh runs, for up to `patience`; whether none does.
    async fn settled(&self, patience: Duration) -> bool {
        let mut state = self.state.subscribe();
        let idle = async { drop(state.wait_for(|s| s.running.is_empty()).await) };
        tokio::time::timeout(patience, idle).await.is_ok()
    }

    /// The keys being refreshed in the background now.
    pub fn running(&self) -> Vec<String> {
        self.state.borrow().running.iter().cloned().collect()
    }
}

/// What a refresh needs of its client: the client's refreshes, and a way to give a claim
/// back (`release_key`, a failure logged: the claim then ends with its lease or the LISTEN
/// connection). The client implements it; this module knows nothing else of it.
pub(crate) trait Refresher: Send + Sync + 'static {
    fn refreshes(&self) -> &Refreshes;
    fn give_back<'a>(&'a self, key: &'a str, token: i64) -> BoxFuture<'a, ()>;
}

/// Recompute `key`, whose claim (`token`) came with outcome `refresh`, on a task of its
/// own: `run` computes, heartbeats and completes or fails the key. If the client is
/// shutting down, or a refresh of the key still runs here (one whose claim was lost and
/// that has not noticed yet), the claim is given back instead: another caller refreshes
/// the key.
pub(crate) async fn start<R: Refresher>(
    client: &Arc<R>,
    key: &str,
    token: i64,
    run: BoxFuture<'static, Result<Value>>,
) {
    let started = client
        .refreshes()
        .state
        .send_if_modified(|s| s.phase == Phase::Open && s.running.insert(key.to_owned()));
    if !started {
        client.give_back(key, token).await;
        return;
    }
    let running = Running {
        client: client.clone(),
        key: key.to_owned(),
    };
    let mut state = client.refreshes().state.subscribe();
    tokio::spawn(async move {
        let (client, key) = (&running.client, running.key.as_str());
        let stopped = async { drop(state.wait_for(|s| s.phase == Phase::Stopped).await) };
        tokio::select! {
            // Nobody awaits the outcome: a compute error was stored by fail_key, and
            // callers see it (with the previous result) until the next refresh.
            result = run => match result {
                Ok(_) => tracing::debug!(key, "pg_once: refreshed in the background"),
                Err(e) => tracing::warn!(key, error = %e, "pg_once: a background refresh failed; the previous result stays served"),
            },
            () = stopped => client.give_back(key, token).await,
        }
    });
}

/// A key's place in the running set, left when its task ends or is dropped (with its
/// runtime, say).
struct Running<R: Refresher> {
    client: Arc<R>,
    key: String,
}

impl<R: Refresher> Drop for Running<R> {
    fn drop(&mut self) {
        self.client.refreshes().state.send_modify(|s| {
            s.running.remove(&self.key);
        });
    }
}
