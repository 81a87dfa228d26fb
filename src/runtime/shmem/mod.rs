//! Shared memory, when pg_once is loaded through shared_preload_libraries.
//!
//! - One slot per backend: the identity of a backend that has made a claim (pid and start
//!   time, so liveness is an exact test with no pgstat copy), and the key it is waiting
//!   for (so whoever resolves that key sets its latch right after commit).
//! - One relay queue per database worker: keys to NOTIFY, handed over after commit. It
//!   also records which worker serves the database, which the launcher reads.
//! - Counters for once.stats.
//!
//! Layout: `Shared` (this file) holds the counters (counters.rs) and one relay queue per
//! database (relay.rs), and is followed by one slot per backend (slots.rs).
//!
//! Everything is fixed-size and sized at server start. Nothing here can fill up in a way
//! that fails a caller: every backend has its slot, and a full relay queue makes the
//! committing backend send its notifications itself.

mod counters;
mod relay;
mod slots;

pub use counters::{count, count_n, counters, Counter, COUNTER_COLUMNS};
pub use relay::AttachError;
pub use slots::BackendSlot;

use crate::pg_compat;
use counters::COUNTERS;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

/// Databases that can have a pg_once worker (reaper and NOTIFY relay).
pub const MAX_DATABASES: usize = 8;

#[repr(C)]
pub struct Shared {
    backends: usize,
    counters: [AtomicU64; COUNTERS],
    relays: [relay::RelayQueue; MAX_DATABASES],
    /// Pid and PGPROC number of the running pg_once launcher (pid 0: none), whose latch a
    /// worker sets when it exits.
    launcher_pid: AtomicI32,
    launcher_proc_number: AtomicI32,
    /// Worker starts so far: each start gets the next number (see workers::launcher).
    launches: AtomicU32,
    // followed by `backends` BackendSlots
}

// SAFETY: fields are atomics, or cells only touched under the queue's LWLock.
unsafe impl Sync for Shared {}

static mut SHARED: *mut Shared = std::ptr::null_mut();
/// LWLocks: [0] guards assigning relay queues to databases, [1 + i] guards relay queue i.
static mut LOCKS: *mut pg_sys::LWLockPadded = std::ptr::null_mut();
const TRANCHE: &std::ffi::CStr = c"pg_once";

static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

fn size() -> usize {
    size_of::<Shared>() + pg_compat::max_backends() * size_of::<BackendSlot>()
}

/// Ask for shared memory; called from _PG_init while preloading.
pub fn request() {
    pg_compat::request_shared_memory(request_space);
    // SAFETY: hook chaining as every preloaded library does, in the postmaster.
    unsafe {
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
    }
}

fn request_space() {
    // SAFETY: called where PostgreSQL takes these requests (pg_compat::request_shared_memory).
    unsafe {
        pg_sys::RequestAddinShmemSpace(size());
        pg_sys::RequestNamedLWLockTranche(TRANCHE.as_ptr(), 1 + MAX_DATABASES as i32);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP_HOOK {
            prev();
        }
        let init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let shared = pg_sys::ShmemInitStruct(TRANCHE.as_ptr(), size(), &mut found).cast::<Shared>();
        if !found {
            // All-zero is the empty state of every field.
            std::ptr::write_bytes(shared.cast::<u8>(), 0, size());
            (*shared).backends = pg_compat::max_backends();
        }
        SHARED = shared;
        LOCKS = pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr());
        pg_sys::LWLockRelease(init_lock);
    }
}

/// The shared state, if pg_once was preloaded.
pub fn shared() -> Option<&'static Shared> {
    // SAFETY: set once in the postmaster before any backend starts, then only read.
    unsafe { SHARED.as_ref() }
}

fn lock(index: usize) -> *mut pg_sys::LWLock {
    // SAFETY: LOCKS has 1 + MAX_DATABASES entries, set at startup.
    unsafe { &raw mut (*LOCKS.add(index)).lock }
}

struct Locked(*mut pg_sys::LWLock);
impl Locked {
    fn exclusive(lock: *mut pg_sys::LWLock) -> Locked {
        // SAFETY: a valid LWLock; released in Drop (and by PostgreSQL on error).
        unsafe { pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE) };
        Locked(lock)
    }
}
impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: acquired in `exclusive`.
        unsafe { pg_sys::LWLockRelease(self.0) }
    }
}
