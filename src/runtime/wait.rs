//! Sleeping inside a call until something changes: the primitive under claim_key's and
//! claim_next's `wait` (the loops themselves are protocol::waiting).
//!
//! Waiting holds no lock: between two looks the backend sleeps on its process latch, so
//! the owner and every other caller proceed as if nobody waited. The sleep ends for query
//! cancel, statement_timeout and postmaster death.
//!
//! With shared memory the waiter announces what it waits for (a key's or a queue's tag) in
//! its backend slot before each look; whoever changes that thing sets the waiter's latch
//! right after committing, and an owner that exits sets it too. Without shared memory
//! nobody can wake a waiter, and it looks again every once.poll_interval.

use crate::key;
use crate::runtime::guc;
use crate::runtime::shmem::{self, BackendSlot, Counter};
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Longest sleep between two looks when wake-ups come through shared memory: a backstop,
/// not the mechanism.
pub const SAFETY_SLEEP_MICROS: i128 = 1_000_000;

/// How often to look again when nothing will announce the change awaited (another
/// transaction's uncommitted write, a key another worker is claiming right now).
pub const SHORT_POLL_MICROS: i128 = 10_000;

/// Clears the waiter announcement however the wait ends (result, timeout or error).
struct Announcement(&'static BackendSlot);

impl Announcement {
    fn new(slot: &'static BackendSlot, tag: u64) -> Self {
        slot.wait_for(tag);
        Announcement(slot)
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        self.0.wait_for(0);
    }
}

/// One wait of one call, from its start to its deadline.
pub struct Waiter {
    deadline: i128,
    /// Present when wake-ups come through shared memory; withdrawn when the Waiter drops.
    announcement: Option<Announcement>,
    waited: bool,
}

impl Waiter {
    /// Start waiting up to `wait_micros` for whatever `tag` names.
    pub fn new(tag: u64, wait_micros: i128) -> Waiter {
        Waiter {
            deadline: now() as i128 + wait_micros,
            announcement: shmem::shared()
                .and_then(|shared| shared.my_slot())
                .map(|slot| Announcement::new(slot, tag)),
            waited: false,
        }
    }

    /// Whether a change will wake this waiter (preloaded), rather than its next poll.
    pub fn is_woken_by_changes(&self) -> bool {
        self.announcement.is_some()
    }

    /// Call before each look: a wake-up that arrives after the look then leaves the latch
    /// set, and the sleep that follows returns at once.
    pub fn before_look(&self) {
        // SAFETY: this backend's own latch.
        unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
    }

    /// Microseconds left until the deadline (<= 0: time is up).
    pub fn remaining(&self) -> i128 {
        self.deadline - now() as i128
    }

    /// Milliseconds left for a write to wait for another transaction's lock.
    pub fn millis_left(&self) -> i64 {
        (self.remaining() / 1000) as i64
    }

    /// How long to sleep when nobody announces changes: once.poll_interval.
    pub fn poll_interval() -> i128 {
        guc::POLL_INTERVAL_MS.get() as i128 * 1000
    }

    /// Sleep up to `micros` (never past the deadline), waking early when the latch is set
    /// or for interrupts (cancel, timeouts, shutdown).
    pub fn sleep(&mut self, micros: i128) {
        if !self.waited {
            self.waited = true;
            shmem::count(Counter::Waited);
        }
        if sleep_micros(micros.min(self.remaining())) {
            shmem::count(Counter::Wakeups);
        }
    }
}

/// The server's clock, in microseconds since 2000-01-01 (what clock_timestamp() reads).
pub fn now() -> pg_sys::TimestampTz {
    // SAFETY: reads the system clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Sleep `micros` (or until the latch is set) outside any wait of a call: e.g. between
/// tries to take a lock that must not be queued for.
pub fn pause(micros: i128) {
    sleep_micros(micros);
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
    // without a Rust backtrace: see api::body, around every SQL function, and errors::plain).
    check_for_interrupts!();
    events & pg_sys::WL_LATCH_SET as i32 != 0
}

/// What a worker waiting in claim_next for `queue` announces in its backend slot: the tag
/// of "queue", a NUL and the queue's name. A key's tag is that of its text, and key text
/// holds no NUL, so a queue's tag and a key's meet only by chance, and a collision only
/// causes a spurious wake-up.
pub fn queue_tag(queue: &str) -> u64 {
    let mut name = Vec::with_capacity(6 + queue.len());
    name.extend_from_slice(b"queue\0");
    name.extend_from_slice(queue.as_bytes());
    key::tag_of_bytes(&name)
}
