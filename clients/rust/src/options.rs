//! What a [`Client`](crate::Client) is told: its [`Options`], a call's [`CallOptions`],
//! and the settings one call runs with once both are combined.

use crate::error::{Error, Result};
use crate::outcome::OutcomeHook;
use crate::raw::Freshness;
use std::time::Duration;

/// How a [`Client`](crate::Client) claims, waits and caches. Every field has a default
/// (`Options::default()`); per-call overrides go in [`CallOptions`].
#[derive(Debug, Clone)]
pub struct Options {
    /// Lease of a claim; heartbeats renew it every `lease / 3`. Default 30 s.
    pub lease: Duration,
    /// How long a call waits in total for someone else's computation before
    /// [`Error::Timeout`]. Default 30 s.
    pub wait: Duration,
    /// How long results are cached (None: until invalidated). Default None.
    pub ttl: Option<Duration>,
    /// Stale-while-revalidate: after `ttl`, a result stays servable for this much longer.
    /// A call in that window gets the old result at once, and the first one (across every
    /// process) recomputes the key in the background of its process. Zero: none (the
    /// result is gone at `ttl`, and callers wait for its recomputation). Needs `ttl`.
    /// Default zero.
    pub stale: Duration,
    /// XFetch early refresh (0 < beta <= 100; zero: none): before `ttl` ends, a hit may
    /// return the result and recompute the key in the background, the likelier the
    /// closer the expiry and the longer the last computation took; 1 is the paper's
    /// choice, more refreshes earlier. Needs `ttl`. Default zero.
    pub beta: f64,
    /// 0 <= jitter < 1: each result's `ttl` is shortened by up to this fraction, at
    /// random, so that keys filled together do not expire together. Needs `ttl`. Default
    /// zero.
    pub jitter: f64,
    /// How long a failure is served to other callers before the key may be computed again.
    /// Default 5 s, as in the Python and Node clients: long enough that the crowd woken by
    /// the failure shares it instead of each retrying a broken upstream, short enough not
    /// to poison the key.
    pub retry_after: Duration,
    /// Use the process's LISTEN connection (owner liveness and wake-ups). Default true.
    /// With false, waiting calls poll with jittered backoff (50 ms doubling to 1 s) and
    /// claims are held by their lease alone (`owner_pid => 0`).
    pub listen: bool,
    /// Conninfo of the LISTEN connection: direct or session-pooled, never
    /// transaction-pooled. Default: the conninfo given to [`Client::connect`](crate::Client::connect); required
    /// with [`Client::from_pool`](crate::Client::from_pool) when `listen` is true.
    pub listen_conninfo: Option<String>,
    /// Called once per finished `get_or_compute` with how it was answered and how long
    /// it took (rule O1). Default None.
    pub on_outcome: Option<OutcomeHook>,
    /// Connections in the pool made by [`Client::connect`](crate::Client::connect). Default 10.
    pub pool_size: usize,
    /// How long getting a pooled connection may take, waiting for a free one or making a
    /// new one, before the call fails with [`Error::Pool`] (rule N6). Applies to the pool
    /// [`Client::connect`](crate::Client::connect) makes; a pool given to [`Client::from_pool`](crate::Client::from_pool) keeps its own
    /// timeouts. Default 10 s.
    pub connect_timeout: Duration,
    /// How often a waiting call asks the server again without a notification (jittered).
    /// Default 1 s.
    pub recheck: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            lease: Duration::from_secs(30),
            wait: Duration::from_secs(30),
            ttl: None,
            stale: Duration::ZERO,
            beta: 0.0,
            jitter: 0.0,
            retry_after: Duration::from_secs(5),
            listen: true,
            listen_conninfo: None,
            on_outcome: None,
            pool_size: 10,
            connect_timeout: Duration::from_secs(10),
            recheck: Duration::from_secs(1),
        }
    }
}

/// Per-call overrides of [`Options`]; None keeps the client's setting.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    pub lease: Option<Duration>,
    pub wait: Option<Duration>,
    /// `Some(None)`: cache until invalidated.
    pub ttl: Option<Option<Duration>>,
    /// `Some(Duration::ZERO)`: no stale window.
    pub stale: Option<Duration>,
    /// `Some(0.0)`: no early refresh.
    pub beta: Option<f64>,
    /// `Some(0.0)`: no jitter.
    pub jitter: Option<f64>,
    pub retry_after: Option<Duration>,
}

/// The settings one call runs with.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub lease: Duration,
    pub wait: Duration,
    pub freshness: Freshness,
    pub retry_after: Duration,
}

/// The `complete_key` arguments for a ttl and the freshness options as [`Options`] and
/// [`CallOptions`] give them (zero: none, i.e. NULL). Options that cannot work without a
/// ttl are refused before any key is claimed, rather than by `complete_key` after the
/// computation.
pub(crate) fn freshness(
    ttl: Option<Duration>,
    stale: Duration,
    beta: f64,
    jitter: f64,
) -> Result<Freshness> {
    let f = Freshness {
        ttl,
        stale: (!stale.is_zero()).then_some(stale),
        beta: (beta != 0.0).then_some(beta),
        jitter: (jitter != 0.0).then_some(jitter),
    };
    if ttl.is_none() && (f.stale.is_some() || f.beta.is_some() || f.jitter.is_some()) {
        return Err(Error::InvalidOption(
            "stale, beta and jitter apply to a result that expires: set a ttl too".into(),
        ));
    }
    Ok(f)
}
