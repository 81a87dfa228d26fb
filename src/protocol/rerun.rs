//! Asking for a key to be computed again, or forgotten (refresh_key, invalidate_key).
//!
//! A running key is never forgotten or recomputed beside its run: the request is
//! recorded (protocol/sql/rules/rerun_requested.sql) and carried out by the statement
//! that ends the run.

use crate::key::Key;
use crate::protocol::queue;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::shmem::{self, Counter};
use crate::storage::statements::{self, params, Param, Statement};
use pgrx::datum::Interval;
use pgrx::prelude::*;

static INVALIDATE: Statement = statement!("invalidate");

static REFRESH: Statement = statement!("refresh");

static KEY_EXISTS: Statement =
    Statement::new("SELECT 1 FROM once.entries WHERE key_hash = $key_hash");

/// Run `statement` (INVALIDATE or REFRESH, which act on the state a fresh snapshot shows)
/// until it matches the key or the key is absent. A key whose state changed between
/// the snapshot and the row lock (a run ended just then) matches none of its branches; a
/// request must not be lost to that, so it runs again with a snapshot that shows the new
/// state.
fn until_matched<R>(
    key: &Key,
    statement: &'static Statement,
    args: impl Fn() -> Vec<Param<'static>>,
    read: impl Fn(pgrx::spi::SpiTupleTable<'_>) -> pgrx::spi::Result<Option<R>>,
) -> Option<R> {
    loop {
        check_for_interrupts!();
        if let Some(answer) = statements::run(statement, args(), &read) {
            return Some(answer);
        }
        let exists = statements::run(&KEY_EXISTS, params![key_hash = key.hash_param()], |t| {
            Ok(!t.is_empty())
        });
        if !exists {
            return None;
        }
    }
}

/// Forget a key; false when it was absent. A running key is not forgotten but recomputed
/// once more when its run ends, its results not served meanwhile (see sql/invalidate.sql).
pub fn invalidate(key: &Key) -> bool {
    standby::refuse_writes("invalidate_key");
    let done = until_matched(
        key,
        &INVALIDATE,
        || params![key_hash = key.hash_param()].into(),
        |table| Ok((!table.is_empty()).then_some(())),
    )
    .is_some();
    if done {
        shmem::count(Counter::Invalidated);
    }
    done
}

/// What refresh_key did.
pub enum Refreshed {
    /// No such key: the next claim computes it anyway.
    Absent,
    /// Its result expired now (or its failure may be retried now, or it went back to its
    /// queue).
    Expired,
    /// It is running: it will be computed once more when this run ends.
    Rerun,
    /// It is queued: it will run anyway.
    Pending,
}

/// Ask for `key` to be computed again; `stale`: how long its present result (or, running,
/// the result of the run) may be served as stale meanwhile (None: not at all).
pub fn request_refresh(key: &Key, stale: Option<Interval>) -> Refreshed {
    standby::refuse_writes("refresh_key");
    let answer = until_matched(
        key,
        &REFRESH,
        || params![key_hash = key.hash_param(), stale = stale].into(),
        |table| {
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            let what: String = row.get(1)?.expect("what is set");
            let queue: Option<String> = row.get(2)?;
            Ok(Some((what, queue)))
        },
    );
    match answer {
        None => Refreshed::Absent,
        Some((what, queue)) => match what.as_str() {
            "rerun" => Refreshed::Rerun,
            "pending" => Refreshed::Pending,
            _ => {
                if let Some(queue) = queue {
                    queue::has_work(&queue);
                }
                Refreshed::Expired
            }
        },
    }
}
