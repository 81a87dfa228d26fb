//! The client primitive under the middleware: one request's claim on its entry, made
//! with the client's own machinery (the pool and its retries, the LISTEN connection as
//! owner and waker, heartbeats), and the [`IdempotencyClaim`] a handler completes in its
//! own transaction (rule I8).

use super::rules;
use crate::error::{Error, Result};
use crate::inner::Inner;
use crate::raw::{self, Freshness};
use crate::run::heartbeat_until_lost;
use crate::Client;
use http::{HeaderMap, StatusCode};
use serde_json::Value;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::task::JoinHandle;

/// How `claim_key` with a fingerprint answered a request (I4).
pub(crate) enum Answer {
    /// The stored response.
    Hit(Value),
    /// This request runs the key; the claim is heartbeated while it is held.
    Claimed(Arc<Held>),
    /// Another request with the key runs (still, after `wait`).
    Running,
    /// The key was used by a request with another fingerprint.
    Mismatch,
    /// The key was failed with `fail_key`; it may run again at `retry_at`.
    Failed { retry_at: Option<SystemTime> },
}

impl Client {
    /// Claim `key` for one request: `claim_key(key, lease, wait => 0, owner_pid => P,
    /// fingerprint)`, asked again while another request runs it, for up to `wait` (zero:
    /// one look), by rule C2: holding no pooled connection, woken by the key's
    /// notification on the LISTEN connection, by its owner's lease running out, or by the
    /// recheck interval. A claim taken is heartbeated every `lease / 3` until it is
    /// completed or released.
    pub(crate) async fn claim_request(
        &self,
        key: &str,
        fingerprint: Option<&[u8]>,
        lease: Duration,
        wait: Duration,
    ) -> Result<Answer> {
        let inner = &self.inner;
        let deadline = Instant::now() + wait;
        let mut poll_backoff = Duration::from_millis(50);
        loop {
            // Interest first, then the question (C4).
            let mut interest = inner.listener.as_ref().map(|l| l.interest(key));
            let owner = inner
                .owner(deadline.saturating_duration_since(Instant::now()))
                .await?;
            let claim = match with_conn!(inner, until deadline, owned |conn| {
                claim_on_its_own_task(inner, conn, key, fingerprint, lease, owner)
            }) {
                Ok(claim) => claim,
                Err(e) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if inner.owner_died(&e, owner, left).await {
                        continue; // R3
                    }
                    return Err(e);
                }
            };
            return Ok(match claim.outcome.as_str() {
                "hit" => Answer::Hit(claim.result.unwrap_or(Value::Null)),
                "claimed" => {
                    let token = claim
                        .token
                        .ok_or_else(|| Error::Protocol("a claim without a token".into()))?;
                    Answer::Claimed(Held::start(inner.clone(), key, token, lease))
                }
                "mismatch" => Answer::Mismatch,
                "failed" => Answer::Failed {
                    retry_at: claim.retry_at,
                },
                "wait" if Instant::now() < deadline => {
                    inner
                        .pause_while_running(
                            interest.as_mut(),
                            claim.lease_expires_at,
                            deadline,
                            &mut poll_backoff,
                        )
                        .await;
                    continue;
                }
                "wait" => Answer::Running,
                other => return Err(Error::Protocol(format!("claim_key outcome {other:?}"))),
            });
        }
    }
}

/// `claim_key` for one request on `conn`, on a task of its own (`claim_task`): a request
/// whose future is dropped while the claim is on its way (its client went away) releases
/// the key the server claimed for it when the answer comes, so that a retry runs it at
/// once rather than after the lease (R2).
async fn claim_on_its_own_task(
    inner: &Arc<Inner>,
    conn: deadpool_postgres::Object,
    key: &str,
    fingerprint: Option<&[u8]>,
    lease: Duration,
    owner: raw::Owner,
) -> Result<raw::Claim> {
    let statement = {
        let (key, fingerprint) = (key.to_owned(), fingerprint.map(<[u8]>::to_vec));
        async move {
            let fingerprint = fingerprint.as_deref();
            raw::claim_request_key(&conn, &key, lease, Duration::ZERO, owner, fingerprint).await
        }
    };
    let claimed_in = {
        let key = key.to_owned();
        move |claim: raw::Claim| match (claim.outcome.as_str(), claim.token) {
            ("claimed", Some(token)) => vec![(key, token)],
            _ => Vec::new(),
        }
    };
    crate::claim_task::claim_on_its_own_task(inner, statement, claimed_in, None)
        .await
        .expect("a claim waited for without a bound is answered")
}

/// Where a held claim stands.
const RUNNING: u8 = 0;
/// The handler stored the response itself, in its transaction (I8).
const COMPLETED_BY_HANDLER: u8 = 1;
/// The handler's `complete` found the claim taken over: its transaction must not commit,
/// and the request is answered as a concurrent duplicate.
const LOST: u8 = 2;

/// A claim this process holds for one request, heartbeated (H1, H2) until it is
/// completed, released, or dropped (then it ends with its lease, or with the process).
pub(crate) struct Held {
    inner: Arc<Inner>,
    pub(crate) key: String,
    token: i64,
    state: AtomicU8,
    heartbeats: Mutex<Option<JoinHandle<()>>>,
}

impl Held {
    fn start(inner: Arc<Inner>, key: &str, token: i64, lease: Duration) -> Arc<Held> {
        let beats = {
            let (inner, key) = (inner.clone(), key.to_owned());
            tokio::spawn(async move {
                let (inner, key) = (&*inner, key.as_str());
                let beat = move || async move {
                    with_conn!(inner, |c| raw::heartbeat_key(c, key, token, lease))
                        .map(|expiry| expiry.is_some())
                };
                heartbeat_until_lost(key, lease, beat).await;
                // Noticed again where it matters: by complete_key answering false.
                tracing::warn!(
                    key,
                    "pg_once: a request's claim was lost while its handler ran"
                );
            })
        };
        Arc::new(Held {
            inner,
            key: key.to_owned(),
            token,
            state: AtomicU8::new(RUNNING),
            heartbeats: Mutex::new(Some(beats)),
        })
    }

    fn stop_heartbeats(&self) {
        if let Some(beats) = self.heartbeats.lock().unwrap().take() {
            beats.abort();
        }
    }

    pub(crate) fn completed_by_handler(&self) -> bool {
        self.state.load(Ordering::SeqCst) == COMPLETED_BY_HANDLER
    }

    pub(crate) fn lost(&self) -> bool {
        self.state.load(Ordering::SeqCst) == LOST
    }

    /// Store `stored` (the response, I5) through the pool: false if the claim was lost.
    pub(crate) async fn complete(&self, stored: &Value, ttl: Duration) -> Result<bool> {
        let freshness = Freshness::ttl(Some(ttl));
        let done = with_conn!(self.inner, |c| raw::complete_key_with(
            c, &self.key, self.token, stored, &freshness
        ));
        self.stop_heartbeats();
        done
    }

    /// Give the claim back (`release_key`), so that a retry runs the request again. A
    /// release that fails is logged (F4): the claim then ends with its lease.
    pub(crate) async fn release(&self) {
        self.stop_heartbeats();
        match with_conn!(self.inner, |c| raw::release_key(c, &self.key, self.token)) {
            Ok(_) => {}
            Err(e) => tracing::warn!(key = self.key, error = %e,
                "pg_once: could not release a request's claim; it ends with its lease"),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.stop_heartbeats();
    }
}

/// The claim of a request the middleware let through, as a request extension: a handler
/// that writes to the same database completes it in its own transaction, before it
/// commits (rule I8), so that its side effects and the stored response commit together.
///
/// ```no_run
/// # async fn handler(claim: Option<pg_once_client::http::IdempotencyClaim>,
/// #                  conn: &mut tokio_postgres::Client) -> pg_once_client::Result<()> {
/// use http::{HeaderMap, StatusCode};
/// let tx = conn.transaction().await?;
/// // ... the handler's own writes on `tx` ...
/// let (status, headers, body) = (StatusCode::CREATED, HeaderMap::new(), b"{}".to_vec());
/// if let Some(claim) = &claim {
///     claim.complete(&tx, status, &headers, &body).await?; // Error::ClaimLost: roll back
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct IdempotencyClaim {
    pub(crate) held: Arc<Held>,
    pub(crate) ttl: Duration,
    pub(crate) max_body: usize,
    pub(crate) stored_for: Arc<rules::StoredFor>,
}

impl std::fmt::Debug for IdempotencyClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyClaim")
            .field("key", &self.held.key)
            .finish()
    }
}

impl IdempotencyClaim {
    /// The entry's pg_once key (rule I2: `idempotency:#hmac-sha256:...` with a secret).
    pub fn key(&self) -> &str {
        &self.held.key
    }

    /// Store the response `status`, `headers`, `body` as this request's result with
    /// `complete_key` on `conn`, the handler's own connection or transaction
    /// (`tokio_postgres::Client` or `Transaction`; deadpool's derefs to them: `&*tx`), so
    /// that it commits, or rolls back, with the handler's writes. Stored as the middleware
    /// stores responses (I5: the same headers left out, no body past `max_body`). The
    /// middleware then sends the handler's response as it is, without storing it again.
    ///
    /// [`Error::ClaimLost`] when the claim is no longer this request's (its process was
    /// stopped long enough for another request to take the key over): nothing was stored,
    /// the transaction must roll back, and the middleware answers this request as a
    /// concurrent duplicate, whatever the handler returns. Other errors are the server's.
    pub async fn complete<C>(
        &self,
        conn: &C,
        status: StatusCode,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<()>
    where
        C: tokio_postgres::GenericClient + Sync,
    {
        let body = (body.len() <= self.max_body).then_some(body);
        let stored = rules::stored_response(status, headers, body, &self.stored_for);
        let freshness = Freshness::ttl(Some(self.ttl));
        let held = &self.held;
        if raw::complete_key_in(conn, &held.key, held.token, &stored, &freshness).await? {
            held.state.store(COMPLETED_BY_HANDLER, Ordering::SeqCst);
            // Its heartbeats would wait for the transaction's row lock, then find the
            // claim completed: stop them now.
            held.stop_heartbeats();
            Ok(())
        } else {
            held.state.store(LOST, Ordering::SeqCst);
            Err(Error::ClaimLost {
                key: held.key.clone(),
            })
        }
    }
}
