//! Server-side waiting: claim_key(..., wait => ...) blocks inside the call until the key
//! resolves, its owner is gone (then the caller gets the claim) or the wait elapses.
//!
//! Waiting holds no lock: between two looks at the key the backend sleeps on its process
//! latch, so the owner and every other caller proceed as if nobody waited. The sleep ends
//! for query cancel, statement_timeout and postmaster death.
//!
//! Each look takes its locks only if it can have them at once and releases them at once,
//! and a look that would write (claim the key) waits for another transaction's lock at
//! most until the deadline: an uncommitted or prepared claim, or DDL on once.entries, make
//! the call answer `wait` at its deadline instead of blocking past it.
//!
//! With shared memory the waiter announces the key in its backend slot before each look;
//! whoever resolves the key sets the waiter's latch right after committing, and an owner
//! that exits sets it too. The waiter then sleeps until woken, until the owner's lease
//! runs out, or at most SAFETY_SLEEP. Without shared memory it looks again every
//! once.poll_interval.

use crate::claim::{self, Claim, LockBudget};
use crate::key::Key;
use crate::liveness::{Owner, OwnerWatch};
use crate::shmem::{self, BackendSlot, Counter};
use pgrx::datum::Interval;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Longest sleep between two looks when wake-ups come through shared memory: a backstop,
/// not the mechanism.
const SAFETY_SLEEP_MICROS: i128 = 1_000_000;

/// How often to look again while another transaction holds an uncommitted claim on the key
/// (nothing announces its commit or abort).
const UNCOMMITTED_POLL_MICROS: i128 = 10_000;

/// Clears the waiter announcement however the wait ends (result, timeout or error).
struct Announcement<'a>(&'a BackendSlot);

impl<'a> Announcement<'a> {
    fn new(slot: &'a BackendSlot, tag: u64) -> Self {
        slot.wait_for(tag);
        Announcement(slot)
    }
}

impl Drop for Announcement<'_> {
    fn drop(&mut self) {
        self.0.wait_for(0);
    }
}

/// Look at the key until it is decided or `wait_micros` have passed.
pub fn claim_waiting(key: &Key, lease: Interval, owner: Owner, wait_micros: i128) -> Claim {
    let deadline = now() as i128 + wait_micros;
    let mut watch = OwnerWatch::default();
    // Lives until the wait ends, then withdraws the announcement.
    let announcement = shmem::shared()
        .and_then(|shared| shared.my_slot())
        .map(|slot| Announcement::new(slot, key.tag));
    let woken_by_shared_memory = announcement.is_some();
    let mut waited = false;
    loop {
        // Reset before looking: a wake-up that arrives after the look leaves the latch set
        // and the sleep below returns at once.
        // SAFETY: this backend's own latch.
        unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
        let claim = claim::attempt(key, lease, owner, &mut watch, budget_until(deadline));
        let Claim::Wait {
            lease_expires_at,
            uncommitted,
            ..
        } = &claim
        else {
            return claim;
        };
        // No early return when the owner is this very backend: behind a pool, the claim
        // may belong to another client whose calls ran on this server connection.
        let now = now() as i128;
        let remaining = deadline - now;
        if remaining <= 0 {
            return claim;
        }
        if !waited {
            waited = true;
            shmem::count(Counter::Waited);
        }
        let sleep = if *uncommitted {
            // Nobody wakes us when another transaction commits or aborts its claim.
            remaining.min(UNCOMMITTED_POLL_MICROS)
        } else if woken_by_shared_memory {
            // Wake up just after the lease ends: then the claim may be taken over.
            let lease_end = lease_expires_at.map_or(i128::MAX, |t| t.into_inner() as i128);
            let lease_left = lease_end.saturating_sub(now) + 1000;
            remaining.min(lease_left.max(1000)).min(SAFETY_SLEEP_MICROS)
        } else {
            remaining.min(crate::guc::POLL_INTERVAL_MS.get() as i128 * 1000)
        };
        if sleep_micros(sleep) {
            shmem::count(Counter::Wakeups);
        }
    }
}

/// What is left until `deadline` for a write to wait for another transaction's lock.
fn budget_until(deadline: i128) -> LockBudget {
    LockBudget(((deadline - now() as i128) / 1000) as i64)
}

fn now() -> pg_sys::TimestampTz {
    // SAFETY: reads the system clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Sleep on the process latch, waking early when it is set or for interrupts (cancel,
/// timeouts, shutdown). True if woken by the latch.
fn sleep_micros(micros: i128) -> bool {
    let millis = ((micros + 999) / 1000).clamp(1, i32::MAX as i128) as std::ffi::c_long;
    // SAFETY: the standard latch wait of a backend; WL_EXIT_ON_PM_DEATH exits if the
    // postmaster dies.
    let events = unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            millis,
            pg_sys::PG_WAIT_EXTENSION,
        )
    };
    // A cancel or statement_timeout ends the wait with PostgreSQL's 57014 error (raised
    // without a Rust backtrace: see errors::plain, around every SQL function).
    check_for_interrupts!();
    events & pg_sys::WL_LATCH_SET as i32 != 0
}

/// claim_next(..., wait => ...): claim up to `n` due keys of `queue`, waiting up to
/// `wait_micros` for one to become due. Like claim_key's wait it holds no lock while it
/// sleeps (each look runs in a subtransaction that is rolled back when it finds nothing).
/// With shared memory it is woken after the commit of whatever makes a key of the queue
/// due now (enqueue_key, a failure, release or reaped claim sending a key back) and sleeps
/// no longer than until the earliest queued key's due time (a backoff ending); without,
/// it looks again every once.poll_interval.
pub fn claim_next_waiting(
    queue: &str,
    lease: Interval,
    worker: Option<&str>,
    owner: Owner,
    n: i32,
    wait_micros: i128,
) -> Vec<crate::queue::Claimed> {
    let deadline = now() as i128 + wait_micros;
    let announcement = shmem::shared()
        .and_then(|shared| shared.my_slot())
        .map(|slot| Announcement::new(slot, shmem::queue_tag(queue)));
    let woken_by_shared_memory = announcement.is_some();
    let mut waited = false;
    loop {
        // SAFETY: this backend's own latch.
        unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
        if let Ok(claimed) =
            crate::queue::claim_next_within(queue, lease, worker, owner, n, budget_until(deadline))
        {
            if !claimed.is_empty() {
                return claimed;
            }
        }
        let now = now() as i128;
        let remaining = deadline - now;
        if remaining <= 0 {
            return Vec::new();
        }
        if !waited {
            waited = true;
            shmem::count(Counter::Waited);
        }
        let sleep = if woken_by_shared_memory {
            let until_due = match crate::queue::next_due(queue, budget_until(deadline)) {
                // A key that is due already but was not ours to take (another worker is
                // claiming it): look again shortly.
                Ok(Some(due)) => (due.into_inner() as i128 - now).max(UNCOMMITTED_POLL_MICROS),
                Ok(None) => SAFETY_SLEEP_MICROS,
                Err(_) => UNCOMMITTED_POLL_MICROS,
            };
            remaining.min(until_due).min(SAFETY_SLEEP_MICROS)
        } else {
            remaining.min(crate::guc::POLL_INTERVAL_MS.get() as i128 * 1000)
        };
        if sleep_micros(sleep) {
            shmem::count(Counter::Wakeups);
        }
    }
}
