//! Subtransactions that undo what a lost race locked, and bound how long a write may wait
//! for another transaction's lock.
//!
//! When an UPDATE finds that a concurrent transaction changed its row first, PostgreSQL
//! (READ COMMITTED) locks the row's newest version before re-checking the WHERE clause,
//! and keeps that lock until the end of the transaction even when the re-check fails.
//! A waiting claim_key that lost a race for a key would thus hold a lock on the winner's
//! claim for the rest of its wait, and the winner's complete_key would block behind it.
//! Running the attempt in a subtransaction and rolling it back when nothing was won
//! releases that lock at once.
//!
//! A claim's write can also meet a row (or, for a new key, an index entry) that another
//! transaction is writing and has not committed: a claim made inside a transaction block
//! that is still open, a prepared transaction, a session that is not in autocommit. Its
//! lock lasts as long as that transaction, so the write runs with lock_timeout set to what
//! is left of the caller's `wait`, and gives up (rolled back, `Blocked`) at the deadline.

use crate::errors;
use pgrx::pg_sys;
use pgrx::{PgSqlErrorCode, PgTryBuilder};
use std::ffi::CString;

/// A lock wait inside the subtransaction reached its deadline: another transaction holds a
/// lock on what the write needed. Nothing was changed and nothing stays locked.
#[derive(Debug)]
pub struct Blocked;

/// How long a write may wait for another transaction's lock, in milliseconds (at least 1
/// is used): what is left of the caller's `wait`.
#[derive(Clone, Copy, Debug)]
pub struct LockBudget(pub i64);

/// Run `f` in a subtransaction in which no lock wait lasts longer than `budget`. Keep its
/// effects if `won(&result)`, roll them (and every lock `f` took) back otherwise. A lock
/// wait that times out rolls back and returns Blocked; any other error rolls back and
/// propagates.
pub fn keep_if<R>(
    budget: LockBudget,
    f: impl FnOnce() -> R,
    won: impl FnOnce(&R) -> bool,
) -> Result<R, Blocked> {
    // SAFETY: the same sequence PL/pgSQL uses around an EXCEPTION block: begin an internal
    // subtransaction, run in the caller's memory context, then release or roll back and
    // restore the caller's memory context and resource owner. The lock_timeout set here
    // is saved at a GUC nesting level of its own (as for a function's SET clause) and
    // restored before the subtransaction ends; a rollback restores it too.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        let restore = || {
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        };
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        let guc_level = pg_sys::NewGUCNestLevel();
        let outcome = PgTryBuilder::new(std::panic::AssertUnwindSafe(|| {
            set_lock_timeout(budget.0.clamp(1, i32::MAX as i64));
            Ok(f())
        }))
        .catch_when(PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, |_| Err(Blocked))
        .catch_others(|error| {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            restore();
            errors::reraise(error)
        })
        .execute();
        let result = match outcome {
            Ok(result) => {
                pg_sys::AtEOXact_GUC(true, guc_level);
                if won(&result) {
                    pg_sys::ReleaseCurrentSubTransaction();
                } else {
                    pg_sys::RollbackAndReleaseCurrentSubTransaction();
                }
                Ok(result)
            }
            Err(Blocked) => {
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
                Err(Blocked)
            }
        };
        restore();
        result
    }
}

/// SET lock_timeout for the current GUC nesting level.
unsafe fn set_lock_timeout(ms: i64) {
    let value = CString::new(ms.to_string()).expect("digits");
    // SAFETY: the caller opened a GUC nesting level; GUC_ACTION_SAVE restores the old
    // value when that level ends.
    unsafe {
        pg_sys::set_config_option(
            c"lock_timeout".as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
    }
}
