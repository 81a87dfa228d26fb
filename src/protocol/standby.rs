//! A hot standby: what pg_once can do on a server in recovery.
//!
//! A standby replays the primary's once.entries, so everything that only reads works there:
//! cache hits, failures still being served, the views. Nothing can be written, so every
//! call that would write (a claim, a completion, invalidation, the queue) is refused with
//! PostgreSQL's 25006 as for any write on a standby, naming the function and pointing at
//! the primary, before it has done anything.
//!
//! A running key is answered `wait`, whatever its owner looks like from here: the owner is
//! a backend of the primary, which this server's process table and shared memory know
//! nothing about, so only the primary can tell whether it is gone (and take the claim over).
//! Nobody on a standby wakes a waiter either: the commit callbacks that do so run on the
//! primary, so a wait here polls (protocol::waiting).
//!
//! A waiting claim_key is one statement, and keeps that statement's snapshot for as long as
//! it waits. Replay of the primary's cleanup of rows that snapshot may still see stops
//! until the statement ends (or max_standby_streaming_delay runs out and PostgreSQL cancels
//! it): had the waiter gone on waiting, it would have held back the very completion it
//! waits for. So a waiter that finds replay stopped answers `wait` at once (`replay_waits`),
//! and its caller asks again with a new snapshot.
//!
//! This module is the one place that asks whether the server is in recovery.

use crate::errors;
use crate::protocol::rules::statement;
use crate::storage::statements::{self, params, Statement};
use pgrx::pg_sys;

static REPLAY_WAITS: Statement = statement!("replay_waits");

/// Whether this server is a standby (in recovery), where nothing can be written.
pub fn active() -> bool {
    // SAFETY: reads shared recovery state; callable from any backend at any time.
    unsafe { pg_sys::RecoveryInProgress() }
}

/// Refuse SQL function `function` (a once.* function that would write) on a standby:
/// 25006, as PostgreSQL refuses any write there.
pub fn refuse_writes(function: &str) {
    if active() {
        errors::read_only(
            format!("cannot execute once.{function}() during recovery"),
            &format!(
                "This server is a hot standby: it serves cache hits and the once.* views, and \
                 nothing that writes. Call once.{function} on the primary."
            ),
        );
    }
}

/// Is replay on this standby stopped by a conflict with a backend here (possibly the
/// caller's own snapshot)? Only meaningful while `active()`.
pub fn replay_waits() -> bool {
    statements::run(&REPLAY_WAITS, params![], |table| {
        Ok(table
            .first()
            .get_by_name::<bool, _>("waits")?
            .unwrap_or(false))
    })
}
