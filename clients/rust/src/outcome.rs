//! What each call ended with, for metrics and logs (rule O1), and its `tracing` span (O2).

use crate::error::Error;
use std::sync::Arc;
use std::time::Duration;

/// How a call was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The stored result, at once.
    Hit,
    /// The previous result, while another caller refreshes it.
    Stale,
    /// The previous result, while this process refreshes it in the background.
    Refresh,
    /// Computed here.
    Claimed,
    /// Computed by another process, which this call waited for.
    Waited,
    /// Shared another call of this process for the same key (C1).
    Coalesced,
    /// An error: a shared failure, this computation's, or any other.
    Failed,
}

impl Outcome {
    /// The name docs/clients.md gives it (`hit`, `stale`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Stale => "stale",
            Outcome::Refresh => "refresh",
            Outcome::Claimed => "claimed",
            Outcome::Waited => "waited",
            Outcome::Coalesced => "coalesced",
            Outcome::Failed => "failed",
        }
    }
}

/// One finished call, as the outcome hook sees it.
#[derive(Debug)]
pub struct OutcomeEvent<'a> {
    pub outcome: Outcome,
    pub key: &'a str,
    /// From the call's start to its answer.
    pub duration: Duration,
    /// With [`Outcome::Failed`].
    pub error: Option<&'a Error>,
}

/// A function called once per finished call (`Options::on_outcome`). One that panics is
/// logged and ignored: it never changes the call's answer.
#[derive(Clone)]
pub struct OutcomeHook(pub Arc<dyn Fn(&OutcomeEvent<'_>) + Send + Sync>);

impl OutcomeHook {
    pub fn new(f: impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static) -> Self {
        OutcomeHook(Arc::new(f))
    }

    pub(crate) fn call(&self, event: &OutcomeEvent<'_>) {
        let hook = std::panic::AssertUnwindSafe(|| (self.0)(event));
        if std::panic::catch_unwind(hook).is_err() {
            tracing::warn!(
                key = event.key,
                "pg_once: the outcome hook panicked; ignored"
            );
        }
    }
}

impl std::fmt::Debug for OutcomeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OutcomeHook(..)")
    }
}
