//! Server-side waiting: claim_key(..., wait => ...) blocks inside the call until the key
//! resolves, its owner is gone (then the caller gets the claim) or the wait elapses.
//!
//! Waiting holds no lock: between two looks at the key the backend sleeps on its process
//! latch, so the owner and every other caller proceed as if nobody waited. The sleep ends
//! for query cancel, statement_timeout and postmaster death.
//!
//! With shared memory the waiter announces the key in its backend slot before each look;
//! whoever resolves the key sets the waiter's latch right after committing, and an owner
//! that exits sets it too. The waiter then sleeps until woken, until the owner's lease
//! runs out, or at most SAFETY_SLEEP. Without shared memory it looks again every
//! once.poll_interval.

use crate::args::Key;
use crate::claim::{self, Claim};
use crate::liveness::{self, OwnerWatch};
use crate::shmem::{self, BackendSlot, Counter};
use pgrx::datum::Interval;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Longest sleep between two looks when wake-ups come through shared memory: a backstop,
/// not the mechanism.
const SAFETY_SLEEP_MICROS: i128 = 1_000_000;

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
pub fn claim_waiting(key: &Key, lease: Interval, wait_micros: i128) -> Claim {
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
        let claim = claim::attempt(key, lease, &mut watch);
        let Claim::Wait {
            owner_backend,
            lease_expires_at,
            ..
        } = &claim
        else {
            return claim;
        };
        // Waiting for ourselves would never end: this session's claim is only resolved
        // by this session.
        if *owner_backend == Some(liveness::my_identity()) {
            return claim;
        }
        let now = now() as i128;
        let remaining = deadline - now;
        if remaining <= 0 {
            return claim;
        }
        if !waited {
            waited = true;
            shmem::count(Counter::Waited);
        }
        let sleep = if woken_by_shared_memory {
            // Wake up just after the lease ends: then the claim may be taken over.
            let lease_left = lease_expires_at.into_inner() as i128 - now + 1000;
            remaining.min(lease_left.max(1000)).min(SAFETY_SLEEP_MICROS)
        } else {
            remaining.min(crate::guc::POLL_INTERVAL_MS.get() as i128 * 1000)
        };
        if sleep_micros(sleep) {
            shmem::count(Counter::Wakeups);
        }
    }
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
    check_for_interrupts!();
    events & pg_sys::WL_LATCH_SET as i32 != 0
}
