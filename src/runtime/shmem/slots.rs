//! One slot per backend: the identity of a backend that has made a claim (pid and start
//! time, so liveness is an exact test with no pgstat copy), whether it is an owner
//! session, and what it is waiting for (so whoever resolves that sets its latch right
//! after commit).

use super::Shared;
use crate::pg_compat::{self, latch_of};
use pgrx::pg_sys;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, Ordering::SeqCst};

#[repr(C)]
pub struct BackendSlot {
    /// Pid of the backend that registered here, 0 if none.
    pid: AtomicI32,
    started: AtomicI64,
    /// Where its latch is (pg_compat::latch_of).
    proc_number: AtomicI32,
    /// First 8 bytes of the digest of the key (or queue) this backend waits for, 0 if not
    /// waiting.
    waiting_for: AtomicU64,
    /// Registered by once.owner_session(): claims made by other backends may name it.
    owner_session: AtomicBool,
}

impl Shared {
    /// The slot of backend number `number` (pg_compat::my_backend_number).
    fn slot(&self, number: usize) -> Option<&BackendSlot> {
        if number >= self.backends {
            return None;
        }
        // SAFETY: `backends` slots follow the header, as sized in size().
        unsafe {
            let first = (self as *const Shared).add(1).cast::<BackendSlot>();
            Some(&*first.add(number))
        }
    }

    fn slots(&self) -> impl Iterator<Item = &BackendSlot> {
        (0..self.backends).filter_map(|number| self.slot(number))
    }

    /// This backend's slot (regular backends and workers have one).
    pub fn my_slot(&self) -> Option<&BackendSlot> {
        self.slot(pg_compat::my_backend_number()?)
    }

    /// The slot of the running backend `pid`, if that backend registered in it.
    fn registered_slot(&self, pid: i32) -> Option<&BackendSlot> {
        // SAFETY: BackendPidGetProc locks ProcArrayLock; the PGPROC outlives the call.
        let proc_ = unsafe { pg_sys::BackendPidGetProc(pid) };
        if proc_.is_null() {
            return None;
        }
        // SAFETY: a PGPROC returned by BackendPidGetProc.
        let slot = self.slot(unsafe { pg_compat::backend_number(proc_) }?)?;
        (slot.pid.load(SeqCst) == pid).then_some(slot)
    }

    /// Whether the backend (pid, started) is running and is the one that registered.
    pub fn backend_alive(&self, pid: i32, started: i64) -> bool {
        self.registered_slot(pid)
            .is_some_and(|slot| slot.started.load(SeqCst) == started)
    }

    /// Start time of the backend `pid` if it is running and registered as an owner session.
    pub fn owner_session_started(&self, pid: i32) -> Option<i64> {
        let slot = self.registered_slot(pid)?;
        slot.owner_session
            .load(SeqCst)
            .then(|| slot.started.load(SeqCst))
    }

    /// Set the latch of every backend waiting for one of `tags`.
    pub fn wake(&self, tags: &[u64]) -> usize {
        self.wake_where(|tag| tags.contains(&tag))
    }

    /// Set the latch of every waiting backend: each looks at its key again (a transaction
    /// resolved too many keys to list them: runtime::notify).
    pub fn wake_all(&self) -> usize {
        self.wake_where(|_| true)
    }

    fn wake_where(&self, wanted: impl Fn(u64) -> bool) -> usize {
        let mut woken = 0;
        for slot in self.slots() {
            let waiting_for = slot.waiting_for.load(SeqCst);
            if waiting_for != 0 && wanted(waiting_for) {
                // SAFETY: SetLatch on another process's latch is what latches are for.
                unsafe { pg_sys::SetLatch(latch_of(slot.proc_number.load(SeqCst))) };
                woken += 1;
            }
        }
        woken
    }
}

impl BackendSlot {
    /// Record this backend's identity (before it makes a claim).
    pub fn register(&self, pid: i32, started: i64) {
        self.proc_number.store(pg_compat::my_proc_number(), SeqCst);
        self.started.store(started, SeqCst);
        self.owner_session.store(false, SeqCst);
        self.pid.store(pid, SeqCst);
    }

    /// Forget this backend's identity: from now on its claims count as gone. Returns
    /// whether it was an owner session.
    pub fn unregister(&self) -> bool {
        self.pid.store(0, SeqCst);
        self.waiting_for.store(0, SeqCst);
        self.owner_session.swap(false, SeqCst)
    }

    /// This backend is an owner session (see once.owner_session()).
    pub fn mark_owner_session(&self) {
        self.owner_session.store(true, SeqCst);
    }

    pub fn is_registered(&self, pid: i32) -> bool {
        self.pid.load(SeqCst) == pid
    }

    /// Announce the key this backend waits for (0: none). Announce before looking at the
    /// key: a change committed after the look then finds the announcement and wakes us.
    pub fn wait_for(&self, tag: u64) {
        self.proc_number.store(pg_compat::my_proc_number(), SeqCst);
        self.waiting_for.store(tag, SeqCst);
    }
}
