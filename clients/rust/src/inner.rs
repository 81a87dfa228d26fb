//! What every call of a [`Client`](crate::Client) shares: the pool its statements go
//! through, retried on another connection when theirs fails (`with_conn!`), the options,
//! the LISTEN connection that owns its claims, and the refreshes it runs; and the pause of
//! a call told `wait`.

use crate::error::{Error, Result};
use crate::listener::{Interest, Listener};
use crate::options::{freshness, CallOptions, Options, Resolved};
use crate::raw::{self, Owner};
use crate::refresh::{self, Refreshes};
use deadpool_postgres::Pool;
use futures_util::future::{BoxFuture, FutureExt};
use std::time::{Duration, Instant, SystemTime};

/// Run one pg_once call on a pooled connection, held only for that call:
/// `with_conn!(inner, |c| raw::claim_key(c, ...))` evaluates to the call's `Result`.
///
/// A call that fails because its connection did (a terminated backend, a restarted
/// PgBouncer, a pool that could not connect, a primary that died; [`Error::is_connection_error`],
/// rule R1) is tried again on another connection (R2): the second attempt at once, the
/// next ones after jittered pauses of 50 ms doubling to 1 s, as long as its budget lasts:
/// `connect_timeout` from the first attempt, long enough for a failover to another host of
/// the conninfo (N7). Every pg_once call is safe to repeat, and claims belong to the LISTEN
/// connection, not to the pooled one. (A macro rather than a function taking an async
/// closure: the closure's borrowed futures would not be provably `Send` for
/// `tokio::spawn`.)
///
/// `with_conn!(inner, until deadline, |c| ...)` gives a claim the caller's `wait` as its
/// budget instead (R2, N6): the first attempt is made as always (getting its connection
/// waits at most `connect_timeout`), the second at once, and a later one only if its
/// pause ends before the deadline; a retry's wait for a connection stops there; the
/// connection error is returned then. A statement already sent is never abandoned: a
/// claim it made would be held by nobody (a claim whose caller may leave while it is on
/// its way runs on a task of its own, `claim_task`, given the connection with `owned`).
macro_rules! with_conn {
    ($inner:expr, |$c:ident| $call:expr) => {{
        let inner: &$crate::inner::Inner = &$inner;
        with_conn!(inner, until std::time::Instant::now() + inner.options.connect_timeout, |$c| $call)
    }};
    ($inner:expr, until $deadline:expr, |$c:ident| $call:expr) => {
        with_conn!(@retry $inner, $deadline, |conn| {
            let $c: &tokio_postgres::Client = &conn;
            $call.await
        })
    };
    // `owned`: `$c` is the pooled connection itself (a `deadpool_postgres::Object`), for a
    // statement that must outlive its caller (see `claim_task`).
    ($inner:expr, until $deadline:expr, owned |$c:ident| $call:expr) => {
        with_conn!(@retry $inner, $deadline, |$c| $call.await)
    };
    (@retry $inner:expr, $deadline:expr, |$conn:ident| $use:expr) => {{
        let inner: &$crate::inner::Inner = &$inner;
        let deadline: std::time::Instant = $deadline;
        let mut attempt: u32 = 0;
        let mut pause = std::time::Duration::from_millis(50);
        let mut failed: Option<$crate::Error> = None;
        loop {
            attempt += 1;
            let conn = match failed.take() {
                Some(before) => {
                    match tokio::time::timeout_at(deadline.into(), inner.pool.get()).await {
                        Ok(conn) => conn.map_err($crate::Error::from),
                        Err(_) => break Err(before),
                    }
                }
                None => inner.pool.get().await.map_err($crate::Error::from),
            };
            let result: $crate::Result<_> = match conn {
                Ok($conn) => $use,
                Err(e) => Err(e),
            };
            match result {
                Err(e) if e.is_connection_error() => {
                    if attempt > 1 {
                        let wait = $crate::jitter(pause);
                        if std::time::Instant::now() + wait >= deadline {
                            break Err(e);
                        }
                        tokio::time::sleep(wait).await;
                        pause = (pause * 2).min(std::time::Duration::from_secs(1));
                    }
                    failed = Some(e);
                }
                other => break other,
            }
        }
    }};
}

pub(crate) struct Inner {
    pub pool: Pool,
    pub options: Options,
    pub listener: Option<Listener>,
    /// The refreshes this process runs in the background.
    pub refreshes: Refreshes,
}

impl refresh::Refresher for Inner {
    fn refreshes(&self) -> &Refreshes {
        &self.refreshes
    }

    fn give_back<'a>(&'a self, key: &'a str, token: i64) -> BoxFuture<'a, ()> {
        async move {
            if let Err(e) = with_conn!(self, |c| raw::release_key(c, key, token)) {
                tracing::warn!(key, error = %e, "pg_once: could not release a refresh's claim");
            }
        }
        .boxed()
    }
}

impl Inner {
    pub(crate) fn resolve(&self, opts: &CallOptions) -> Result<Resolved> {
        let o = &self.options;
        Ok(Resolved {
            lease: opts.lease.unwrap_or(o.lease),
            wait: opts.wait.unwrap_or(o.wait),
            freshness: freshness(
                opts.ttl.unwrap_or(o.ttl),
                opts.stale.unwrap_or(o.stale),
                opts.beta.unwrap_or(o.beta),
                opts.jitter.unwrap_or(o.jitter),
            )?,
            retry_after: opts.retry_after.unwrap_or(o.retry_after),
        })
    }

    /// Whether a claim refused with `e` should be asked again as another owner (rule R3):
    /// a 22023 naming an owner pid whose LISTEN connection has just died, which the
    /// listener notices within `patience` (it reconnects and gets a new pid).
    pub(crate) async fn owner_died(&self, e: &Error, owner: Owner, patience: Duration) -> bool {
        let (Some(listener), Owner::Session(pid)) = (&self.listener, owner) else {
            return false;
        };
        e.sqlstate() == Some("22023")
            && e.to_string().contains(&format!("pid {pid}"))
            && listener
                .replaced(owner, patience.min(Duration::from_secs(5)))
                .await
    }

    /// C2: the pause of a call told `wait` before it asks again, holding no connection:
    /// until the key's notification arrives on the LISTEN connection (`interest`,
    /// registered before the question, C4), just after the owner's lease runs out
    /// (`lease_expires_at`), a jittered recheck interval, or `deadline`, whichever comes
    /// first. Without a LISTEN connection it polls with jittered backoff (`poll_backoff`,
    /// 50 ms doubling to 1 s).
    pub(crate) async fn pause_while_running(
        &self,
        interest: Option<&mut Interest>,
        lease_expires_at: Option<SystemTime>,
        deadline: Instant,
        poll_backoff: &mut Duration,
    ) {
        let now = Instant::now();
        let mut until = deadline;
        if let Some(expiry) = lease_expires_at {
            let left = expiry
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            until = until.min(now + left + Duration::from_millis(20));
        }
        match interest {
            Some(interest) => {
                until = until.min(now + crate::jitter(self.options.recheck));
                tokio::select! {
                    _ = interest.changed() => {}
                    _ = tokio::time::sleep_until(until.into()) => {}
                }
            }
            None => {
                until = until.min(now + crate::jitter(*poll_backoff));
                *poll_backoff = (*poll_backoff * 2).min(Duration::from_secs(1));
                tokio::time::sleep_until(until.into()).await;
            }
        }
    }

    /// The owner to claim as: the LISTEN connection's pid, or the lease alone.
    pub(crate) async fn owner(&self, patience: Duration) -> Result<Owner> {
        match &self.listener {
            Some(l) => l.owner(patience.max(Duration::from_secs(5))).await,
            None => Ok(Owner::LeaseOnly),
        }
    }
}
