//! Shared memory, when pg_once is loaded through shared_preload_libraries.
//!
//! - One slot per backend: the identity of a backend that has made a claim (pid and start
//!   time, so liveness is an exact test with no pgstat copy), and the key it is waiting
//!   for (so whoever resolves that key sets its latch right after commit).
//! - One relay queue per database worker: keys to NOTIFY, handed over after commit.
//! - Counters for once.stats.
//!
//! Everything is fixed-size and sized at server start. Nothing here can fill up in a way
//! that fails a caller: every backend has its slot, and a full relay queue makes the
//! committing backend send its notifications itself.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering::SeqCst};

/// Databases that can have a pg_once worker (reaper and NOTIFY relay).
pub const MAX_DATABASES: usize = 8;
/// Bytes of queued keys per database relay.
const RELAY_BYTES: usize = 256 * 1024;

/// What once.stats counts, since server start.
#[derive(Clone, Copy)]
#[repr(usize)]
pub enum Counter {
    Claimed,
    Hits,
    Waited,
    Wakeups,
    TakenOver,
    Completed,
    Failed,
    Released,
    Invalidated,
    Reaped,
    Purged,
    NotifiedDirect,
    NotifiedRelayed,
}
const COUNTERS: usize = Counter::NotifiedRelayed as usize + 1;

#[repr(C)]
pub struct BackendSlot {
    /// Pid of the backend that registered here, 0 if none.
    pid: AtomicI32,
    started: AtomicI64,
    pgprocno: AtomicI32,
    /// First 8 bytes of the digest of the key (or queue) this backend waits for, 0 if not
    /// waiting.
    waiting_for: AtomicU64,
    /// Registered by once.owner_session(): claims made by other backends may name it.
    owner_session: AtomicBool,
}

#[repr(C)]
struct RelayQueue {
    /// Database this queue serves, 0 if unused.
    dboid: AtomicU32,
    /// Pid and PGPROC number of the worker draining it; pid 0 while it is not running.
    worker_pid: AtomicI32,
    worker_pgprocno: AtomicI32,
    /// An owner session exited: the worker should reap now rather than at its next round.
    reap_requested: AtomicBool,
    /// Byte positions (monotonic; index = position % RELAY_BYTES), under the queue's lock.
    head: UnsafeCell<u64>,
    tail: UnsafeCell<u64>,
    /// Bytes promised to transactions that are committing.
    reserved: UnsafeCell<u64>,
    data: UnsafeCell<[u8; RELAY_BYTES]>,
}

#[repr(C)]
pub struct Shared {
    backends: usize,
    counters: [AtomicU64; COUNTERS],
    relays: [RelayQueue; MAX_DATABASES],
    // followed by `backends` BackendSlots
}

// SAFETY: fields are atomics, or cells only touched under the queue's LWLock.
unsafe impl Sync for Shared {}

static mut SHARED: *mut Shared = std::ptr::null_mut();
/// LWLocks: [0] guards assigning relay queues to databases, [1 + i] guards relay queue i.
static mut LOCKS: *mut pg_sys::LWLockPadded = std::ptr::null_mut();
const TRANCHE: &std::ffi::CStr = c"pg_once";

static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

fn size() -> usize {
    // SAFETY: MaxBackends is final by the time shared memory is requested.
    let backends = unsafe { pg_sys::MaxBackends } as usize;
    size_of::<Shared>() + backends * size_of::<BackendSlot>()
}

/// Ask for shared memory; called from _PG_init while preloading.
pub fn request() {
    // SAFETY: hook chaining as every preloaded library does, in the postmaster.
    unsafe {
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST_HOOK {
            prev();
        }
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
            (*shared).backends = pg_sys::MaxBackends as usize;
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

/// Count one event, if counting is possible.
pub fn count(counter: Counter) {
    if let Some(shared) = shared() {
        shared.counters[counter as usize].fetch_add(1, SeqCst);
    }
}

/// Count `n` events.
pub fn count_n(counter: Counter, n: u64) {
    if let Some(shared) = shared() {
        shared.counters[counter as usize].fetch_add(n, SeqCst);
    }
}

/// The counters, in `Counter` order.
pub fn counters() -> Option<[u64; COUNTERS]> {
    shared().map(|s| std::array::from_fn(|i| s.counters[i].load(SeqCst)))
}

/// The first 8 bytes of a key digest: what waiter slots hold. Distinct keys sharing a
/// prefix only cause a spurious wake-up, after which the waiter simply looks again.
pub fn key_tag(digest: &[u8]) -> u64 {
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(tag).max(1) // 0 means "not waiting"
}

/// What a worker waiting in claim_next for `queue` holds in its slot: a 64-bit FNV-1a hash
/// of "queue", a NUL and the queue's name. Key tags come from SHA-256 digests, so the two
/// meet only by chance, and a collision only causes a spurious wake-up.
pub fn queue_tag(queue: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in b"queue\0".iter().chain(queue.as_bytes()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash.max(1)
}

fn latch_of(pgprocno: i32) -> *mut pg_sys::Latch {
    // SAFETY: pgprocno indexes ProcGlobal->allProcs, which lives for the server's lifetime.
    unsafe { &raw mut (*(*pg_sys::ProcGlobal).allProcs.add(pgprocno as usize)).procLatch }
}

impl Shared {
    fn slot(&self, backend_id: i32) -> Option<&BackendSlot> {
        let index = usize::try_from(backend_id).ok()?.checked_sub(1)?;
        if index >= self.backends {
            return None;
        }
        // SAFETY: `backends` slots follow the header, as sized in size().
        unsafe {
            let first = (self as *const Shared).add(1).cast::<BackendSlot>();
            Some(&*first.add(index))
        }
    }

    fn slots(&self) -> impl Iterator<Item = &BackendSlot> {
        (1..=self.backends as i32).filter_map(|id| self.slot(id))
    }

    /// This backend's slot (regular backends and workers have one).
    pub fn my_slot(&self) -> Option<&BackendSlot> {
        // SAFETY: MyBackendId is set at backend start.
        self.slot(unsafe { pg_sys::MyBackendId })
    }

    /// The slot of the running backend `pid`, if that backend registered in it.
    fn registered_slot(&self, pid: i32) -> Option<&BackendSlot> {
        // SAFETY: BackendPidGetProc locks ProcArrayLock; the PGPROC outlives the call.
        let proc_ = unsafe { pg_sys::BackendPidGetProc(pid) };
        if proc_.is_null() {
            return None;
        }
        // SAFETY: a PGPROC returned by BackendPidGetProc.
        let slot = self.slot(unsafe { (*proc_).backendId })?;
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
        let mut woken = 0;
        for slot in self.slots() {
            let waiting_for = slot.waiting_for.load(SeqCst);
            if waiting_for != 0 && tags.contains(&waiting_for) {
                // SAFETY: SetLatch on another process's latch is what latches are for.
                unsafe { pg_sys::SetLatch(latch_of(slot.pgprocno.load(SeqCst))) };
                woken += 1;
            }
        }
        woken
    }
}

impl BackendSlot {
    /// Record this backend's identity (before it makes a claim).
    pub fn register(&self, pid: i32, started: i64) {
        // SAFETY: MyProc is this backend's PGPROC.
        self.pgprocno
            .store(unsafe { (*pg_sys::MyProc).pgprocno }, SeqCst);
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
        // SAFETY: MyProc is this backend's PGPROC.
        self.pgprocno
            .store(unsafe { (*pg_sys::MyProc).pgprocno }, SeqCst);
        self.waiting_for.store(tag, SeqCst);
    }
}

// ---- relay queues -------------------------------------------------------------------

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

impl Shared {
    /// The relay queue of `dboid` whose worker is running.
    pub fn relay_for(&self, dboid: pg_sys::Oid) -> Option<usize> {
        self.relays
            .iter()
            .position(|q| q.dboid.load(SeqCst) == dboid.to_u32() && q.worker_pid.load(SeqCst) != 0)
    }

    /// Attach the calling worker to the queue of its database (taking a free one).
    pub fn attach_relay(&self, dboid: pg_sys::Oid) -> Option<usize> {
        let _guard = Locked::exclusive(lock(0));
        let index = self
            .relays
            .iter()
            .position(|q| q.dboid.load(SeqCst) == dboid.to_u32())
            .or_else(|| self.relays.iter().position(|q| q.dboid.load(SeqCst) == 0))?;
        let queue = &self.relays[index];
        queue.dboid.store(dboid.to_u32(), SeqCst);
        // SAFETY: MyProc is this worker's PGPROC.
        queue
            .worker_pgprocno
            .store(unsafe { (*pg_sys::MyProc).pgprocno }, SeqCst);
        queue.worker_pid.store(unsafe { pg_sys::MyProcPid }, SeqCst);
        Some(index)
    }

    /// Ask the worker of `dboid`, if one runs, to reap at once.
    pub fn request_reap(&self, dboid: pg_sys::Oid) {
        if let Some(index) = self.relay_for(dboid) {
            let q = &self.relays[index];
            q.reap_requested.store(true, SeqCst);
            // SAFETY: the worker's latch.
            unsafe { pg_sys::SetLatch(latch_of(q.worker_pgprocno.load(SeqCst))) };
        }
    }

    /// Whether a reap was requested since the last call (the worker's side).
    pub fn take_reap_request(&self, index: usize) -> bool {
        self.relays[index].reap_requested.swap(false, SeqCst)
    }

    pub fn detach_relay(&self, index: usize) {
        self.relays[index].worker_pid.store(0, SeqCst);
    }

    /// Promise `bytes` of queue space to a committing transaction; false if full.
    pub fn reserve(&self, index: usize, bytes: u64) -> bool {
        let q = &self.relays[index];
        let _guard = Locked::exclusive(lock(1 + index));
        // SAFETY: the cells are only touched under this lock.
        unsafe {
            let used = *q.head.get() - *q.tail.get() + *q.reserved.get();
            if used + bytes > RELAY_BYTES as u64 {
                return false;
            }
            *q.reserved.get() += bytes;
        }
        true
    }

    /// Give back a promise that will not be used (the transaction aborted).
    pub fn unreserve(&self, index: usize, bytes: u64) {
        let q = &self.relays[index];
        let _guard = Locked::exclusive(lock(1 + index));
        // SAFETY: under the lock.
        unsafe { *q.reserved.get() -= bytes };
    }

    /// Append `keys` using the space reserved for them, and wake the worker.
    pub fn push(&self, index: usize, keys: &[String], reserved: u64) {
        let q = &self.relays[index];
        {
            let _guard = Locked::exclusive(lock(1 + index));
            // SAFETY: under the lock; positions wrap modulo RELAY_BYTES.
            unsafe {
                let data = &mut *q.data.get();
                let mut head = *q.head.get();
                for key in keys {
                    let len = (key.len() as u16).to_le_bytes();
                    for &b in len.iter().chain(key.as_bytes()) {
                        data[(head % RELAY_BYTES as u64) as usize] = b;
                        head += 1;
                    }
                }
                *q.head.get() = head;
                *q.reserved.get() -= reserved;
            }
        }
        // SAFETY: the worker's latch.
        unsafe { pg_sys::SetLatch(latch_of(q.worker_pgprocno.load(SeqCst))) };
    }

    /// Read up to `max` queued keys without removing them (the worker's side), and the
    /// position to `consume` up to once they are sent. Keys stay queued until then, so a
    /// worker that dies mid-batch leaves them for its successor.
    pub fn peek(&self, index: usize, max: usize) -> (Vec<String>, u64) {
        let q = &self.relays[index];
        let _guard = Locked::exclusive(lock(1 + index));
        let mut keys = Vec::new();
        // SAFETY: under the lock.
        unsafe {
            let data = &*q.data.get();
            let (head, mut tail) = (*q.head.get(), *q.tail.get());
            let byte = |pos: u64| data[(pos % RELAY_BYTES as u64) as usize];
            while tail < head && keys.len() < max {
                let len = u16::from_le_bytes([byte(tail), byte(tail + 1)]) as u64;
                let bytes: Vec<u8> = (tail + 2..tail + 2 + len).map(byte).collect();
                keys.push(String::from_utf8_lossy(&bytes).into_owned());
                tail += 2 + len;
            }
            (keys, tail)
        }
    }

    /// Remove the keys read by `peek` up to `position`.
    pub fn consume(&self, index: usize, position: u64) {
        let q = &self.relays[index];
        let _guard = Locked::exclusive(lock(1 + index));
        // SAFETY: under the lock.
        unsafe { *q.tail.get() = position };
    }

    /// Bytes a list of keys takes in a relay queue.
    pub fn queue_bytes(keys: &[String]) -> u64 {
        keys.iter().map(|k| 2 + k.len() as u64).sum()
    }

    /// Number of database workers currently running.
    pub fn workers_running(&self) -> i32 {
        self.relays
            .iter()
            .filter(|q| q.worker_pid.load(SeqCst) != 0)
            .count() as i32
    }
}
