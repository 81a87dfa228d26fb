//! Rust client for pg_once: compute each expensive, cacheable key
//! once across a fleet of processes, with nothing but PostgreSQL.
//!
//! [`Client`] is what applications use: [`Client::get_or_compute`] (and its wrapper
//! [`Client::cached`]) returns a key's cached result or computes it exactly once while
//! every other caller, in this process or another, waits for it; [`Client::work`] runs a
//! queue worker loop. It goes through a deadpool-postgres pool, which may point at
//! PgBouncer in transaction mode: every call is one unnamed statement in autocommit, and
//! waiting calls hold no pooled connection. One direct LISTEN connection per process
//! carries the wake-ups and names the process as the owner of its claims, so a process
//! that dies loses them within about a second. [`raw`] has one function per SQL call.
//!
//! ```no_run
//! use pg_once_client::{CallOptions, Client, Options};
//! # async fn demo() -> pg_once_client::Result<()> {
//! let client = Client::connect(
//!     "host=pgbouncer port=6432 user=app dbname=app",
//!     Options {
//!         listen_conninfo: Some("host=db port=5432 user=app dbname=app".into()),
//!         ..Options::default()
//!     },
//! )
//! .await?;
//! let page: serde_json::Value = client
//!     .get_or_compute(
//!         "https://example.com/a",
//!         || async { Ok::<_, std::io::Error>(serde_json::json!({"title": "A"})) },
//!         CallOptions::default(),
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! With the feature `http`, `http::IdempotencyLayer` (a `tower::Layer` for axum and
//! hyper) runs each request carrying an `Idempotency-Key` once across every process and
//! replays its response to retries (rule I).
//!
//! The behaviour every pg_once client shares is specified in `docs/clients.md`. TLS (the
//! default feature `tls`, rustls) follows the conninfo's `sslmode` and `sslrootcert` for
//! the pool and the LISTEN connection alike ([`Conninfo`]).

// First: its with_conn! macro is used by the modules after it.
#[macro_use]
mod inner;
mod claim_task;
mod client;
mod coalesce;
mod conninfo;
mod error;
#[cfg(feature = "http")]
pub mod http;
pub mod key;
mod listener;
mod options;
mod outcome;
pub mod raw;
mod refresh;
mod run;
mod tls;
mod values;
#[cfg(test)]
mod vectors;
mod worker;

pub use client::{Cached, Client};
pub use conninfo::Conninfo;
pub use error::{Error, Result};
pub use key::KeySet;
pub use listener::CHANNEL;
pub use options::{CallOptions, Options};
pub use outcome::{Outcome, OutcomeEvent, OutcomeHook};
pub use raw::{CachedSql, Claim, Freshness, Job, Owner, Reaped};
pub use tls::Connector;
pub use tls::{RootCerts, SslMode};
pub use worker::{WorkOptions, WorkReport};

/// `d` scaled by a random factor in [0.5, 1.0]: spreads out processes that would
/// otherwise ask the server at the same instants.
pub(crate) fn jitter(d: std::time::Duration) -> std::time::Duration {
    d.mul_f64(0.5 + fastrand::f64() / 2.0)
}
