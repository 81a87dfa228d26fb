//! Server-side waiting: claim_key(..., wait => ...) blocks inside the call until the key
//! resolves, its owner is gone (then the caller gets the claim) or the wait elapses.
//!
//! Waiting holds no lock: between two looks at the key the backend sleeps on its process
//! latch, so the owner and every other caller proceed as if nobody waited. The latch wait
//! wakes for query cancel, statement_timeout and postmaster death.

use crate::args::Key;
use crate::claim::{self, Claim};
use crate::liveness::{self, OwnerWatch};
use pgrx::datum::Interval;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Look at the key until it is decided or `wait_micros` have passed.
pub fn claim_waiting(key: &Key, lease: Interval, wait_micros: i128) -> Claim {
    let deadline = now() as i128 + wait_micros;
    let mut watch = OwnerWatch::default();
    loop {
        let claim = claim::attempt(key, lease, &mut watch);
        let Claim::Wait { owner_backend, .. } = &claim else {
            return claim;
        };
        // Waiting for ourselves would never end: this session's claim is only resolved
        // by this session.
        if *owner_backend == Some(liveness::my_identity()) {
            return claim;
        }
        let remaining = deadline - now() as i128;
        if remaining <= 0 {
            return claim;
        }
        let poll = crate::guc::POLL_INTERVAL_MS.get() as i128 * 1000;
        sleep_micros(remaining.min(poll));
    }
}

fn now() -> pg_sys::TimestampTz {
    // SAFETY: reads the system clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Sleep on the process latch, waking early for interrupts (cancel, timeouts, shutdown).
fn sleep_micros(micros: i128) {
    let millis = ((micros + 999) / 1000).clamp(1, i32::MAX as i128) as std::ffi::c_long;
    // SAFETY: the standard latch wait of a backend; WL_EXIT_ON_PM_DEATH exits if the
    // postmaster dies.
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            millis,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    check_for_interrupts!();
}
