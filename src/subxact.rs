//! Subtransactions that undo what a lost race locked.
//!
//! When an UPDATE finds that a concurrent transaction changed its row first, PostgreSQL
//! (READ COMMITTED) locks the row's newest version before re-checking the WHERE clause,
//! and keeps that lock until the end of the transaction even when the re-check fails.
//! A waiting claim_key that lost a race for a key would thus hold a lock on the winner's
//! claim for the rest of its wait, and the winner's complete_key would block behind it.
//! Running the attempt in a subtransaction and rolling it back when nothing was won
//! releases that lock at once.

use pgrx::pg_sys;
use pgrx::PgTryBuilder;

/// Run `f` in a subtransaction, keep its effects if `won(&result)`, roll them (and every
/// lock `f` took) back otherwise. Errors roll the subtransaction back and propagate.
pub fn keep_if<R>(f: impl FnOnce() -> R, won: impl FnOnce(&R) -> bool) -> R {
    // SAFETY: the same sequence PL/pgSQL uses around an EXCEPTION block: begin an internal
    // subtransaction, run in the caller's memory context, then release or roll back and
    // restore the caller's memory context and resource owner.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        let restore = || {
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        };
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        let result = PgTryBuilder::new(std::panic::AssertUnwindSafe(f))
            .catch_others(|error| {
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
                restore();
                error.rethrow()
            })
            .execute();
        if won(&result) {
            pg_sys::ReleaseCurrentSubTransaction();
        } else {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        restore();
        result
    }
}
