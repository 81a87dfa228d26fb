//! Resolving a key once this process leads it: claim, wait or read until the key has an
//! outcome, and when this process holds the claim, compute while heartbeating it, then
//! complete or fail the key (docs/clients.md, rules C, H, F and V).

use crate::claim_task;
use crate::error::{Error, Result};
use crate::inner::Inner;
use crate::listener::Interest;
use crate::options::Resolved;
use crate::outcome::Outcome;
use crate::raw::{self, Claim, Owner};
use crate::refresh;
use crate::values::as_stored;
use futures_util::future::{BoxFuture, FutureExt};
use serde_json::Value;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a compute function can end with, before it is turned into an [`Error`].
pub(crate) enum ComputeError {
    /// The function's error, with the short name of its type (see [`failure_text`]).
    Failed(&'static str, Box<dyn std::error::Error + Send + Sync>),
    Serialize(serde_json::Error),
}

impl ComputeError {
    /// A compute function's error `e`, named after its type `E`.
    pub(crate) fn failed<E>(e: E) -> Self
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        ComputeError::Failed(type_name_of::<E>(), e.into())
    }
}

/// The short name of an error type for rule F2's `Type: message`: the last segment of its
/// path, without generic arguments (`my_app::Upstream` is `Upstream`, `std::io::Error` is
/// `Error`). A type that says nothing of the failure (`String`, `&str`, a `Box<dyn Error>`
/// whose concrete type is gone) is `Error`, as Node writes every error.
pub(crate) fn type_name_of<E>() -> &'static str {
    let full = std::any::type_name::<E>();
    let path = full.split('<').next().unwrap_or(full);
    let short = path
        .rsplit("::")
        .next()
        .unwrap_or(path)
        .trim_start_matches('&');
    match short {
        "" | "str" | "String" | "Box" | "Arc" | "Cow" => "Error",
        short => short,
    }
}

/// The text `fail_key` stores for a compute function's error (rule F2): `Type: message`,
/// or the type alone when the message is empty, as the Python and Node clients write it.
pub(crate) fn failure_text(kind: &str, e: &(dyn std::error::Error + Send + Sync)) -> String {
    let message = e.to_string();
    if message.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}: {message}")
    }
}

pub(crate) type Compute =
    Box<dyn FnOnce() -> BoxFuture<'static, std::result::Result<Value, ComputeError>> + Send>;

/// Rule F7's refusal of `stale` and `beta` against a server older than 0.2.0.
const NO_FRESHNESS_SERVER: &str = "stale and beta need pg_once 0.2.0 or later on the server \
    (ALTER EXTENSION pg_once UPDATE)";

/// `claim_key(key, lease, wait => 0, owner_pid => owner)`, with `serve_stale => true` when
/// the call asks for stale or early-refreshed answers (`stale` or `beta`). Without them
/// the call is the one pg_once 0.1 took, and is answered as it was: it waits for a refresh
/// another caller runs rather than be served the old result.
///
/// F7: `stale` and `beta` need pg_once 0.2.0 on the server. An older one (no
/// `owner_session()`, so claims owned by their connection, or no `serve_stale` argument:
/// 42883) is a configuration error before anything is claimed.
async fn claim(c: &tokio_postgres::Client, key: &str, s: &Resolved, owner: Owner) -> Result<Claim> {
    if s.freshness.stale.is_some() || s.freshness.beta.is_some() {
        let too_old = || Error::Configuration(NO_FRESHNESS_SERVER.into());
        if owner == Owner::Connection {
            return Err(too_old());
        }
        match raw::claim_key_serving_stale(c, key, s.lease, Duration::ZERO, owner).await {
            Err(e) if e.sqlstate() == Some("42883") => Err(too_old()),
            other => other,
        }
    } else {
        raw::claim_key(c, key, s.lease, Duration::ZERO, owner).await
    }
}

/// [`claim`] on `conn`, on a task of its own (`claim_task`), its answer waited for until
/// the caller's `deadline` (N6): past it, the caller gets `Timeout` and the claim goes on.
/// A key it claims (`claimed`, or `refresh`, whose previous result nobody will serve) is
/// then given back when the answer comes, as it is when the caller's future is dropped
/// meanwhile (every caller cancelled, X2): a statement already sent is never abandoned (R2).
async fn claim_for_caller(
    inner: &Arc<Inner>,
    conn: deadpool_postgres::Object,
    key: &str,
    s: &Resolved,
    owner: Owner,
    deadline: Instant,
    started: Instant,
) -> Result<Claim> {
    let statement = {
        let (key, s) = (key.to_owned(), s.clone());
        async move { claim(&conn, &key, &s, owner).await }
    };
    let claimed_in = {
        let key = key.to_owned();
        move |claim: Claim| match (claim.outcome.as_str(), claim.token) {
            ("claimed" | "refresh", Some(token)) => vec![(key, token)],
            _ => Vec::new(),
        }
    };
    let answer_by = claim_task::answer_by(inner, deadline);
    claim_task::claim_on_its_own_task(inner, statement, claimed_in, Some(answer_by))
        .await
        .unwrap_or_else(|| {
            Err(Error::Timeout {
                key: key.to_owned(),
                waited: started.elapsed(),
            })
        })
}

/// Claim, wait or read `key` until it has an outcome (this runs once per key per process).
/// `claimed` is where the token of a claim this call makes is kept, for the claim to be
/// given back if every caller stops waiting (see `Client::get_or_compute_checked`).
pub(crate) async fn resolve(
    inner: &Arc<Inner>,
    key: &str,
    compute: Compute,
    s: &Resolved,
    claimed: &Mutex<Option<i64>>,
) -> Result<(Value, Outcome)> {
    let started = Instant::now();
    let mut waited = false;
    let deadline = started + s.wait;
    let mut poll_backoff = Duration::from_millis(50);
    let mut compute = Some(compute);
    loop {
        // Interest first, then the question: a completion in between still wakes us.
        let mut interest: Option<Interest> = inner.listener.as_ref().map(|l| l.interest(key));
        let owner = inner
            .owner(deadline.saturating_duration_since(Instant::now()))
            .await?;
        let claim = match with_conn!(inner, until deadline, owned |conn| {
            claim_for_caller(inner, conn, key, s, owner, deadline, started)
        }) {
            Ok(claim) => claim,
            Err(e) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if inner.owner_died(&e, owner, left).await {
                    continue;
                }
                return Err(e);
            }
        };
        match claim.outcome.as_str() {
            // `stale`: the previous result, while another caller refreshes it; answered at
            // once, never waited on.
            "hit" | "stale" => {
                let outcome = match (claim.outcome.as_str(), waited) {
                    ("stale", _) => Outcome::Stale,
                    (_, true) => Outcome::Waited,
                    _ => Outcome::Hit,
                };
                return Ok((claim.result.unwrap_or(Value::Null), outcome));
            }
            "refresh" => {
                drop(interest);
                let token = claim
                    .token
                    .ok_or_else(|| Error::Protocol("a refresh without a token".into()))?;
                let compute = compute
                    .take()
                    .expect("a key is claimed at most once per call");
                return match claim.result {
                    // Serve the previous result now; recompute in the background.
                    Some(previous) => {
                        let run = {
                            let (inner, key, s) = (inner.clone(), key.to_owned(), s.clone());
                            async move { run_claimed(&inner, &key, token, compute, &s).await }
                                .boxed()
                        };
                        refresh::start(inner, key, token, run).await;
                        Ok((previous, Outcome::Refresh))
                    }
                    // Nothing to serve meanwhile: compute now, as for `claimed`.
                    None => {
                        *claimed.lock().unwrap() = Some(token);
                        let value = run_claimed(inner, key, token, compute, s).await?;
                        Ok((value, Outcome::Claimed))
                    }
                };
            }
            "failed" => {
                return Err(Error::Failed {
                    key: key.to_owned(),
                    message: claim.error.unwrap_or_default(),
                    retry_at: claim.retry_at,
                })
            }
            "claimed" => {
                drop(interest);
                let token = claim
                    .token
                    .ok_or_else(|| Error::Protocol("a claim without a token".into()))?;
                let compute = compute
                    .take()
                    .expect("a key is claimed at most once per call");
                *claimed.lock().unwrap() = Some(token);
                let value = run_claimed(inner, key, token, compute, s).await?;
                return Ok((value, Outcome::Claimed));
            }
            "wait" => {
                waited = true;
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        key: key.to_owned(),
                        waited: started.elapsed(),
                    });
                }
                inner
                    .pause_while_running(
                        interest.as_mut(),
                        claim.lease_expires_at,
                        deadline,
                        &mut poll_backoff,
                    )
                    .await;
            }
            other => return Err(Error::Protocol(format!("claim_key outcome {other:?}"))),
        }
    }
}

/// How a claimed computation ended.
pub(crate) enum Ran {
    Done(std::result::Result<Value, ComputeError>),
    /// heartbeat_key said the claim was lost: the computation was stopped.
    Lost,
}

/// Run `compute` while heartbeating the claim every `lease / 3`. A panic counts as an error.
pub(crate) async fn compute_with_heartbeat(
    inner: &Inner,
    key: &str,
    token: i64,
    lease: Duration,
    compute: BoxFuture<'static, std::result::Result<Value, ComputeError>>,
) -> Ran {
    let work = AssertUnwindSafe(compute).catch_unwind().map(|r| match r {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(ComputeError::Failed(
                "panic",
                format!("the compute function panicked: {what}").into(),
            ))
        }
    });
    let heartbeats = heartbeat_until_lost(key, lease, || async move {
        with_conn!(inner, |c| raw::heartbeat_key(c, key, token, lease)).map(|a| a.is_some())
    });
    tokio::select! {
        done = work => Ran::Done(done),
        () = heartbeats => Ran::Lost,
    }
}

/// Heartbeat a claim with `beat` (true: extended, false: the claim is lost) every
/// `lease / 3` (H1) until a beat says it is lost (H3), the only way this returns.
///
/// H2: after a failed beat, the next comes within a second (`lease / 6` when shorter), not
/// a full third of the lease later, so that two blips in a row do not lose the claim.
pub(crate) async fn heartbeat_until_lost<F, Fut>(key: &str, lease: Duration, mut beat: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let every = lease / 3;
    let after_failure = every.min(Duration::from_secs(1)).min(lease / 6);
    let mut next = every;
    loop {
        tokio::time::sleep(next).await;
        match beat().await {
            Ok(true) => next = every,
            Ok(false) => return,
            Err(e) => {
                tracing::warn!(key, error = %e, "pg_once: a heartbeat failed; retrying");
                next = after_failure;
            }
        }
    }
}

/// This process holds the claim: compute, then complete or fail the key.
pub(crate) async fn run_claimed(
    inner: &Inner,
    key: &str,
    token: i64,
    compute: Compute,
    s: &Resolved,
) -> Result<Value> {
    let lost = || Error::ClaimLost {
        key: key.to_owned(),
    };
    let (error, fail_with) =
        match compute_with_heartbeat(inner, key, token, s.lease, compute()).await {
            Ran::Lost => return Err(lost()),
            Ran::Done(Ok(value)) => {
                let stored = with_conn!(inner, |c| raw::complete_key_with(
                    c,
                    key,
                    token,
                    &value,
                    &s.freshness
                ));
                match stored {
                    Ok(true) => return Ok(as_stored(value)),
                    Ok(false) => return Err(lost()),
                    // F3: the server refused the result (54000: too large, say). Fail the key
                    // with the refusal, so that waiters share it rather than each compute a
                    // result that would be refused again.
                    Err(e) if !e.is_connection_error() => {
                        let message = e.refusal_text();
                        (e, message)
                    }
                    // L4: no server answered within the budget (R2), which a release would
                    // only spend again: the caller gets the connection error, and the claim
                    // ends with its owner or its lease, as in the other clients.
                    Err(e) => return Err(e),
                }
            }
            Ran::Done(Err(ComputeError::Failed(kind, source))) => {
                let message = failure_text(kind, &*source);
                let error = Error::Compute {
                    key: key.to_owned(),
                    source: Arc::from(source),
                };
                (error, message)
            }
            // V4: nothing can be cached. Fail the key with the reason rather than release it:
            // released, every waiter would claim it in turn and fail the same way.
            Ran::Done(Err(ComputeError::Serialize(e))) => {
                let message = format!("the result is not JSON-serialisable: {e}");
                let error = Error::NotSerializable {
                    key: key.to_owned(),
                    reason: e.to_string(),
                };
                (error, message)
            }
        };
    // F4: the caller gets its own error, whatever becomes of fail_key.
    match with_conn!(inner, |c| raw::fail_key(
        c,
        key,
        token,
        &fail_with,
        s.retry_after
    )) {
        Ok(true) => {}
        Ok(false) => tracing::info!(
            key,
            "pg_once: the claim was lost before its failure was stored"
        ),
        Err(e) => {
            tracing::warn!(key, error = %e, "pg_once: could not fail the key; its claim ends with its lease")
        }
    }
    Err(error)
}

#[cfg(test)]
mod tests {
    use super::{failure_text, type_name_of};

    #[derive(Debug)]
    struct Upstream;
    impl std::fmt::Display for Upstream {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("the upstream said 503")
        }
    }
    impl std::error::Error for Upstream {}

    #[test]
    fn a_compute_error_is_stored_as_type_colon_message() {
        // F2: `Type: message`, the type named as a reader knows it.
        let text =
            |kind: &str, e: Box<dyn std::error::Error + Send + Sync>| failure_text(kind, &*e);
        assert_eq!(
            text(type_name_of::<Upstream>(), Box::new(Upstream)),
            "Upstream: the upstream said 503"
        );
        assert_eq!(
            text(
                type_name_of::<std::io::Error>(),
                std::io::Error::other("boom").into()
            ),
            "Error: boom"
        );
        assert_eq!(text(type_name_of::<&str>(), "boom".into()), "Error: boom");
        assert_eq!(
            text(type_name_of::<String>(), String::new().into()),
            "Error"
        );
        assert_eq!(
            type_name_of::<Box<dyn std::error::Error + Send + Sync>>(),
            "Error"
        );
    }

    /// H2: with a lease of 30 s the first beat comes at 10 s; when it fails, the next comes
    /// 1 s later, not at 20 s, and beats go back to every 10 s once one succeeds.
    #[tokio::test(start_paused = true)]
    async fn a_failed_heartbeat_is_retried_within_a_second() {
        use std::sync::{Arc, Mutex};
        use std::time::Duration;
        let start = tokio::time::Instant::now();
        let beats = Arc::new(Mutex::new(Vec::new()));
        let seen = beats.clone();
        super::heartbeat_until_lost("k", Duration::from_secs(30), move || {
            let seen = seen.clone();
            async move {
                let mut seen = seen.lock().unwrap();
                seen.push(start.elapsed());
                match seen.len() {
                    1 => Err(crate::Error::Listener("a blip".into())),
                    2 | 3 => Ok(true),
                    _ => Ok(false),
                }
            }
        })
        .await;
        let beats = beats.lock().unwrap().clone();
        let secs: Vec<u64> = beats.iter().map(|d| d.as_secs()).collect();
        assert_eq!(secs, [10, 11, 21, 31], "{beats:?}");
    }
}
