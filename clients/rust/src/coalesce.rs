//! In-process coalescing (rule C1): concurrent calls for one key in this process make one
//! claim and share its answer, each with its own bound (X1); when every caller has
//! stopped waiting, the computation is told, so that it gives its claim back (X2).

use crate::error::{Error, Result};
use crate::outcome::Outcome;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use serde_json::Value;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::watch;

/// A key's shared answer: its value and how the computing call got it.
pub(crate) type Answer = Shared<BoxFuture<'static, Result<(Value, Outcome)>>>;

/// A key this process is resolving: its outcome, shared by every caller (C1), and who
/// still waits for it.
struct InFlight {
    answer: Answer,
    callers: Weak<Callers>,
    /// The span of the call that resolves the key, which coalesced calls follow from.
    span: Option<tracing::Id>,
}

/// Held by every caller waiting for one in-flight key. When the last is dropped (every
/// caller's future was dropped: cancelled, or timed out by its owner), the computation is
/// abandoned and its claim given back (rule X2).
struct Callers(watch::Sender<bool>);

impl Drop for Callers {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// The keys this process is resolving right now.
#[derive(Default)]
pub(crate) struct InFlightKeys(Mutex<HashMap<String, InFlight>>);

/// A caller's share of a key's answer, held while it waits.
pub(crate) struct Joined {
    pub answer: Answer,
    /// Whether the caller joined a computation another call started.
    pub coalesced: bool,
    _caller: Arc<Callers>,
}

impl InFlightKeys {
    /// Join the computation of `key` this process runs, or start one: `start` is given a
    /// receiver that turns true once every caller has stopped waiting, and returns the
    /// future that resolves the key. It runs as a task of its own, so that a caller that
    /// stops waiting does not stop it for the others; the key leaves the set when it ends.
    pub(crate) fn join_or_start<S, Fut>(
        self: &Arc<Self>,
        key: &str,
        span: &tracing::Span,
        start: S,
    ) -> Joined
    where
        S: FnOnce(watch::Receiver<bool>) -> Fut,
        Fut: Future<Output = Result<(Value, Outcome)>> + Send + 'static,
    {
        let mut inflight = self.0.lock().unwrap();
        let joined = inflight.get(key).and_then(|f| {
            let callers = f.callers.upgrade()?;
            if let Some(leader) = &f.span {
                span.follows_from(leader.clone());
            }
            Some(Joined {
                answer: f.answer.clone(),
                coalesced: true,
                _caller: callers,
            })
        });
        if let Some(joined) = joined {
            return joined;
        }
        let (abandon, abandoned) = watch::channel(false);
        let callers = Arc::new(Callers(abandon));
        let mine = Arc::downgrade(&callers);
        let work = start(abandoned);
        let (keys, owned_key) = (self.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            let result = work.await;
            let mut inflight = keys.0.lock().unwrap();
            if inflight
                .get(&owned_key)
                .is_some_and(|f| f.callers.ptr_eq(&mine))
            {
                inflight.remove(&owned_key);
            }
            result
        });
        let owned_key = key.to_owned();
        let answer = async move {
            task.await.unwrap_or_else(|e| {
                Err(Error::Compute {
                    key: owned_key,
                    source: Arc::new(std::io::Error::other(format!(
                        "the task resolving the key ended: {e}"
                    ))),
                })
            })
        }
        .boxed()
        .shared();
        inflight.insert(
            key.to_owned(),
            InFlight {
                answer: answer.clone(),
                callers: Arc::downgrade(&callers),
                span: span.id(),
            },
        );
        Joined {
            answer,
            coalesced: false,
            _caller: callers,
        }
    }
}
