//! The one error type of this crate. It is `Clone` because one outcome (a result or an
//! error) is handed to every caller that coalesced onto the same computation.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Short for `std::result::Result<T, pg_once_client::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong talking to pg_once.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A pg_once call failed: the server refused it (bad input, with a SQLSTATE and hint)
    /// or the connection broke.
    #[error("pg_once: {}", describe(.0))]
    Db(#[source] Arc<tokio_postgres::Error>),
    /// No pooled connection could be had (pool closed, timed out, or connecting failed).
    #[error("pg_once: no connection from the pool: {0}")]
    Pool(#[source] Arc<deadpool_postgres::PoolError>),
    /// The process's LISTEN connection (owner liveness and wake-ups) is not available.
    #[error("pg_once: the LISTEN connection is unavailable: {0}")]
    Listener(String),
    /// Options that cannot work together.
    #[error("pg_once: bad configuration: {0}")]
    Configuration(String),
    /// An option out of range or that needs another (a `stale` without a `ttl`), refused
    /// before any call (rule F1).
    #[error("pg_once: invalid option: {0}")]
    InvalidOption(String),
    /// This process computed the key and the compute function returned an error (or
    /// panicked). The key was failed with the error text, so that waiters share it.
    #[error("computing {key:?} failed: {source}")]
    Compute {
        key: String,
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// The last attempt at the key, possibly by another process, failed; its error is
    /// served until `retry_at`, then the key may be computed again.
    #[error("{key:?} failed: {message} (retry at {retry_at:?})")]
    Failed {
        key: String,
        message: String,
        retry_at: Option<SystemTime>,
    },
    /// The call's overall `wait` ran out while another caller was still computing the key.
    #[error("timed out after {waited:?} waiting for {key:?} to be computed elsewhere")]
    Timeout { key: String, waited: Duration },
    /// This process's claim on the key ended before its result was stored (its lease ran
    /// out, its LISTEN connection died, or the key was invalidated); the result was
    /// discarded because a newer claim, or no claim, stands.
    #[error("the claim on {key:?} was lost before its result was stored")]
    ClaimLost { key: String },
    /// A value that cannot be written so that it reads back as itself (rules V3, V4): a
    /// computed result (nothing was cached; the key was failed with this reason, served
    /// for `retry_after`), or the arguments of a default key (K2; `key` is then the
    /// function's name, and nothing ran).
    #[error("{key:?}: not serializable: {reason}")]
    NotSerializable { key: String, reason: String },
    /// The cached JSON does not deserialise into the type the caller asked for.
    #[error("the cached result for {key:?} does not fit the requested type: {source}")]
    Deserialize {
        key: String,
        #[source]
        source: Arc<serde_json::Error>,
    },
    /// Every caller of the computation stopped waiting (their futures were dropped), so it
    /// was stopped and its claim released (rule X2). No caller still waiting sees it.
    #[error("every caller of {key:?} stopped waiting")]
    Cancelled { key: String },
    /// The server answered something this client does not understand (version mismatch).
    #[error("pg_once: unexpected answer from the server: {0}")]
    Protocol(String),
}

/// R1 for a tokio-postgres error.
fn db_connection_lost(e: &tokio_postgres::Error) -> bool {
    let sqlstate = e.code().map(|c| c.code());
    retryable(
        sqlstate,
        sqlstate.is_none() && (e.is_closed() || io_failure(e)),
    )
}

/// Whether the driver's error without a SQLSTATE is a broken socket (reset, refused,
/// timed out): an I/O error, but not a TLS handshake that refused the server's
/// certificate, which tokio-rustls also reports as an I/O error and no retry can fix.
fn io_failure(e: &tokio_postgres::Error) -> bool {
    let Some(io) = std::error::Error::source(e).and_then(|s| s.downcast_ref::<std::io::Error>())
    else {
        return false;
    };
    !tls_refusal(io)
}

#[cfg(feature = "tls")]
fn tls_refusal(io: &std::io::Error) -> bool {
    io.get_ref()
        .is_some_and(|inner| inner.is::<rustls::Error>())
}

#[cfg(not(feature = "tls"))]
fn tls_refusal(_: &std::io::Error) -> bool {
    false
}

/// Rule R1 of docs/clients.md: whether a failed call is sent again on another
/// connection, from its SQLSTATE (None: the driver's own error) and whether the driver
/// says the connection is gone.
pub(crate) fn retryable(sqlstate: Option<&str>, connection_lost: bool) -> bool {
    match sqlstate {
        Some(code) => code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03"),
        None => connection_lost,
    }
}

/// A tokio-postgres error with what its own `Display` leaves to its source: the server's
/// message and SQLSTATE ("db error" alone says nothing), or why connecting failed.
fn describe(e: &tokio_postgres::Error) -> String {
    match (e.as_db_error(), std::error::Error::source(e)) {
        (Some(db), _) => format!("{}: {} ({})", db.severity(), db.message(), db.code().code()),
        (None, Some(source)) => format!("{e}: {source}"),
        (None, None) => e.to_string(),
    }
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::Db(Arc::new(e))
    }
}

impl From<deadpool_postgres::PoolError> for Error {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        Error::Pool(Arc::new(e))
    }
}

impl Error {
    /// The SQLSTATE of a server error, e.g. `"22023"`.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Db(e) => e.code().map(|c| c.code()),
            _ => None,
        }
    }

    /// The text `fail_key` stores for a refusal: `SQLSTATE: message` (docs/clients.md, F3).
    pub(crate) fn refusal_text(&self) -> String {
        match self {
            Error::Db(e) => match e.as_db_error() {
                Some(db) => format!("{}: {}", db.code().code(), db.message()),
                None => e.to_string(),
            },
            other => other.to_string(),
        }
    }

    /// Whether the error says the connection, not the call, failed, so that the same call
    /// on another connection may succeed (docs/clients.md, R1): SQLSTATE class 08,
    /// 57P01 to 57P03, a connection the driver found closed or broken, or no connection from
    /// the pool because making one failed that way. Never a statement timeout or cancel
    /// (57014), a serialization failure or any other refusal: those reach the caller.
    pub fn is_connection_error(&self) -> bool {
        match self {
            Error::Pool(e) => match &**e {
                deadpool_postgres::PoolError::Backend(e) => db_connection_lost(e),
                // Connecting took too long (the server is unreachable for now); a
                // timeout waiting for a free connection is not one: nothing failed.
                deadpool_postgres::PoolError::Timeout(t) => {
                    !matches!(t, deadpool_postgres::TimeoutType::Wait)
                }
                _ => false,
            },
            Error::Db(e) => db_connection_lost(e),
            _ => false,
        }
    }
}
