//! A claiming statement (`claim_key`, `claim_next`) run on a task of its own, so that its
//! caller can leave while it is on its way without abandoning it (docs/clients.md, R2 and
//! X2).
//!
//! Once sent, the server may claim keys whose tokens only its answer carries. A caller
//! whose future is dropped (cancelled), or whose `wait` runs out, before the answer comes
//! must neither wait for it (N6) nor drop it: the claims would be held by nobody until
//! their lease ran out, and every other process would wait that long. So the statement
//! runs on a task that owns its pooled connection and finishes whatever its caller does,
//! and the claims of an answer nobody took are given back with `release_key`.

use crate::error::{Error, Result};
use crate::inner::Inner;
use crate::raw;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Run `statement` (which owns its pooled connection) on a task of its own and wait for
/// its answer until `answer_by` (None: until it comes). None when `answer_by` came first:
/// the statement goes on, and `claims_in` of its answer, the `(key, token)` of every
/// claim it made, are released when it comes. Likewise when the caller's future is
/// dropped while it waits.
pub(crate) async fn claim_on_its_own_task<T, S, C>(
    inner: &Arc<Inner>,
    statement: S,
    claims_in: C,
    answer_by: Option<Instant>,
) -> Option<Result<T>>
where
    T: Send + 'static,
    S: Future<Output = Result<T>> + Send + 'static,
    C: FnOnce(T) -> Vec<(String, i64)> + Send + 'static,
{
    let (deliver, delivered) = oneshot::channel();
    let inner = inner.clone();
    tokio::spawn(async move {
        let answer = Untaken {
            inner,
            answer: Some(statement.await),
            claims_in: Some(claims_in),
        };
        // A caller that has left gives the answer back here, and dropping it releases
        // its claims (so does a caller that leaves between this send and its receive:
        // the answer is dropped with the channel).
        drop(deliver.send(answer));
    });
    let delivered = match answer_by {
        Some(answer_by) => tokio::time::timeout_at(answer_by.into(), delivered)
            .await
            .ok()?,
        None => delivered.await,
    };
    Some(match delivered {
        Ok(mut answer) => answer.take(),
        // The task ended without an answer: it panicked, or the runtime is shutting down.
        Err(_) => Err(Error::Protocol(
            "the task running a claim ended without its answer".into(),
        )),
    })
}

/// A claiming statement's answer on its way to its caller. Dropped untaken (its caller
/// left), the claims it made are released: nobody else knows their tokens.
struct Untaken<T, C: FnOnce(T) -> Vec<(String, i64)>> {
    inner: Arc<Inner>,
    answer: Option<Result<T>>,
    claims_in: Option<C>,
}

impl<T, C: FnOnce(T) -> Vec<(String, i64)>> Untaken<T, C> {
    fn take(&mut self) -> Result<T> {
        self.answer.take().expect("an answer is taken once")
    }
}

impl<T, C: FnOnce(T) -> Vec<(String, i64)>> Drop for Untaken<T, C> {
    fn drop(&mut self) {
        let (Some(Ok(answer)), Some(claims_in)) = (self.answer.take(), self.claims_in.take())
        else {
            return; // taken, or an error: nothing was claimed
        };
        let claims = claims_in(answer);
        if claims.is_empty() {
            return;
        }
        let inner = self.inner.clone();
        let release = async move {
            for (key, token) in claims {
                release_abandoned(&inner, &key, token).await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(release)),
            Err(_) => tracing::warn!(
                "pg_once: a claim whose caller left cannot be released without a runtime; \
                 it ends with its owner or its lease"
            ),
        }
    }
}

/// How long a caller with a `wait` ending at `deadline` waits for the answer of a claim
/// sent now: until that deadline (N6). A claim sent once the wait has run out (a `wait` of
/// zero, or the last look at the deadline) must still be answered to be of any use, and
/// gets the budget R2 gives every other statement, `connect_timeout`.
pub(crate) fn answer_by(inner: &Inner, deadline: Instant) -> Instant {
    let now = Instant::now();
    if now < deadline {
        deadline
    } else {
        now + inner.options.connect_timeout
    }
}

/// X2: every caller stopped waiting while this process held the claim: give it back, so
/// that another caller, here or elsewhere, computes the key at once.
pub(crate) async fn release_abandoned(inner: &Inner, key: &str, token: i64) {
    match with_conn!(inner, |c| raw::release_key(c, key, token)) {
        Ok(_) => tracing::debug!(
            key,
            "pg_once: every caller stopped waiting; the claim was released"
        ),
        Err(e) => {
            tracing::warn!(key, error = %e, "pg_once: could not release an abandoned claim; it ends with its lease")
        }
    }
}
