//! Is the backend that made a claim still there?
//!
//! A claim records its backend's pid and start time. The pid alone is not enough: after
//! the owner exits, the operating system may give the same pid to a new backend, which
//! must not keep the claim alive.
//!
//! With shared memory (preloaded), every backend registers its identity in its slot
//! before it claims, and clears it when it exits, waking whoever waits for its keys: the
//! test is then exact and costs one ProcArray lookup. Without shared memory the start
//! time comes from the server's backend status table (what pg_stat_activity.backend_start
//! shows), a per-transaction copy that must be refreshed.

use crate::errors;
use crate::pg_compat;
use crate::runtime::{guc, shmem};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::ffi::CStr;

thread_local! {
    /// Statement start time of the last refresh of pgstat's backend status copy.
    static REFRESHED_FOR: Cell<pg_sys::TimestampTz> = const { Cell::new(i64::MIN) };
}

/// The identity a claim records for its owner: this backend.
pub fn my_identity() -> (i32, pg_sys::TimestampTz) {
    // SAFETY: both are set once at backend start and never change.
    unsafe { (pg_sys::MyProcPid, pg_sys::MyStartTimestamp) }
}

/// Whether the backend (pid, started) is still running.
pub fn backend_alive(pid: i32, started: pg_sys::TimestampTz) -> bool {
    match shmem::shared() {
        Some(shared) => shared.backend_alive(pid, started),
        None => pid_in_use(pid) && backend_start_time(pid) == Some(started),
    }
}

/// What ends a claim besides its lease: the `owner_pid` argument of claim_key and
/// claim_next.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Owner {
    /// The backend making the call (the default; under transaction pooling that is a
    /// server connection that belongs to no client in particular).
    ThisBackend,
    /// Only the lease (owner_pid => 0, or once.backend_liveness = off).
    LeaseOnly,
    /// Another backend, registered by once.owner_session(): typically the long-lived
    /// connection of the client process whose pooled calls make the claims.
    Session {
        pid: i32,
        started: pg_sys::TimestampTz,
    },
}

impl Owner {
    /// The owner a claim names, from claim_key's or claim_next's `owner_pid`.
    pub fn from_arg(owner_pid: Option<i32>) -> Owner {
        let Some(pid) = owner_pid else {
            return if guc::BACKEND_LIVENESS.get() {
                Owner::ThisBackend
            } else {
                Owner::LeaseOnly
            };
        };
        let hint = "Pass the pid that once.owner_session() returned on a connection your process keeps open, 0 to end the claim only when its lease runs out, or NULL for this connection.";
        match pid {
            0 => Owner::LeaseOnly,
            pid if pid < 0 => {
                errors::invalid_argument(format!("owner_pid must not be negative, got {pid}"), hint)
            }
            pid if pid == my_identity().0 => Owner::ThisBackend,
            pid => match session_started(pid) {
                Some(started) => Owner::Session { pid, started },
                None => errors::invalid_argument(
                    match shmem::shared() {
                        Some(_) => format!("no owner session with pid {pid} is running"),
                        None => format!("no backend with pid {pid} is running"),
                    },
                    hint,
                ),
            },
        }
    }

    /// The (pid, start time) a claim records, and whether its backend's exit ends it.
    pub fn identity(&self) -> (i32, pg_sys::TimestampTz, bool) {
        match *self {
            Owner::ThisBackend => {
                let (pid, started) = my_identity();
                (pid, started, false)
            }
            Owner::LeaseOnly => {
                let (pid, started) = my_identity();
                (pid, started, true)
            }
            Owner::Session { pid, started } => (pid, started, false),
        }
    }

    /// Get ready to record a claim on `tag` for this owner: the backend registered (so
    /// others can test its liveness exactly) and, if this backend is the owner, the key
    /// remembered so that its waiters are woken when this backend exits.
    pub fn before_claiming(&self, tag: Option<u64>) {
        register_backend();
        if let (Owner::ThisBackend, Some(tag)) = (self, tag) {
            own(tag);
        }
    }
}

/// Who a claim names: a label for people, and what ends it besides its lease.
pub struct Me {
    pub label: String,
    pub pid: i32,
    pub started: pg_sys::TimestampTz,
    pub lease_only: bool,
}

impl Me {
    /// This session, named `worker` if given, else by its application_name, making a
    /// claim whose liveness is `owner`'s.
    pub fn new(worker: Option<&str>, owner: Owner) -> Me {
        let my_pid = my_identity().0;
        // SAFETY: application_name is a GUC string, NULL or NUL-terminated.
        let app = unsafe {
            let name = pg_sys::application_name;
            if name.is_null() {
                ""
            } else {
                CStr::from_ptr(name).to_str().unwrap_or("")
            }
        };
        // A worker is named as it asks; otherwise the session's application_name and pid.
        let label = match worker {
            Some(worker) => worker.to_owned(),
            None if app.is_empty() => format!("pid {my_pid}"),
            None => format!("{app} (pid {my_pid})"),
        };
        let (pid, started, lease_only) = owner.identity();
        Me {
            label,
            pid,
            started,
            lease_only,
        }
    }

    pub fn started_param(&self) -> DatumWithOid<'static> {
        // SAFETY: a TimestampTz is passed by value.
        unsafe { DatumWithOid::new(self.started, pg_sys::TIMESTAMPTZOID) }
    }
}

/// Start time of the owner session with this pid, if it is running: with shared memory,
/// a backend that called once.owner_session(); without, any backend.
fn session_started(pid: i32) -> Option<pg_sys::TimestampTz> {
    match shmem::shared() {
        Some(shared) => shared.owner_session_started(pid),
        None if pid_in_use(pid) => {
            refresh();
            backend_start_time(pid)
        }
        None => None,
    }
}

/// once.owner_session(): make this backend an owner session and return its pid. When it
/// exits, the database's pg_once worker reaps the claims that named it at once, waking
/// their waiters, instead of at its next round.
pub fn become_owner_session() -> i32 {
    register_backend();
    if let Some(slot) = shmem::shared().and_then(|s| s.my_slot()) {
        slot.mark_owner_session();
    }
    my_identity().0
}

thread_local! {
    /// Tags of the keys this backend has claimed and not yet resolved itself.
    static OWNED: RefCell<HashSet<u64>> = RefCell::new(HashSet::new());
    static EXIT_HOOKED: Cell<bool> = const { Cell::new(false) };
}

/// Record this backend's identity in shared memory before it claims anything, so that
/// others can tell when it is gone and it can wake their waits when it exits.
pub fn register_backend() {
    let Some(slot) = shmem::shared().and_then(|s| s.my_slot()) else {
        return;
    };
    let (pid, started) = my_identity();
    if !slot.is_registered(pid) {
        slot.register(pid, started);
    }
    if !EXIT_HOOKED.replace(true) {
        // SAFETY: registers a callback run once when this backend exits.
        unsafe { pg_sys::before_shmem_exit(Some(on_backend_exit), pg_sys::Datum::from(0)) };
    }
}

/// This backend holds the claim on `tag`: wake its waiters if the backend exits.
pub fn own(tag: u64) {
    if shmem::shared().is_some() {
        OWNED.with_borrow_mut(|owned| owned.insert(tag));
    }
}

/// This backend resolved its claim on `tag` itself: no need to wake anyone at exit.
pub fn disown(tag: u64) {
    OWNED.with_borrow_mut(|owned| owned.remove(&tag));
}

/// The backend is exiting (disconnect, pg_terminate_backend, FATAL error): its claims are
/// gone. Unregister, then wake the waiters of the keys it held, so one of them takes over
/// at once instead of at its next look.
#[pg_guard]
unsafe extern "C-unwind" fn on_backend_exit(_code: i32, _arg: pg_sys::Datum) {
    let Some(shared) = shmem::shared() else {
        return;
    };
    if let Some(slot) = shared.my_slot() {
        let was_owner_session = slot.unregister();
        if was_owner_session {
            // Claims made elsewhere in this session's name are gone now; only a reaper
            // can tell, so ask the database's worker to run at once.
            // SAFETY: MyDatabaseId is set once connected.
            shared.request_reap(unsafe { pg_sys::MyDatabaseId });
        }
    }
    let owned: Vec<u64> = OWNED.with_borrow(|owned| owned.iter().copied().collect());
    if !owned.is_empty() {
        shared.wake(&owned);
    }
}

/// Cheap first test: does any backend have this pid right now?
pub fn pid_in_use(pid: i32) -> bool {
    // SAFETY: BackendPidGetProc takes ProcArrayLock itself and returns NULL when not found.
    unsafe { !pg_sys::BackendPidGetProc(pid).is_null() }
}

/// Throw away pgstat's copy of the backend status table so the next lookup reads shared
/// memory again. PostgreSQL keeps that copy for the whole transaction, and a waiting
/// claim_key looks at its owner many times within one transaction.
pub fn refresh() {
    // SAFETY: frees only the backend-local copy; safe inside a transaction.
    unsafe {
        pg_sys::pgstat_clear_backend_activity_snapshot();
        REFRESHED_FOR.set(pg_sys::GetCurrentStatementStartTimestamp());
    }
}

/// Start time of the backend with this pid, from a copy no older than the current statement.
fn backend_start_time(pid: i32) -> Option<pg_sys::TimestampTz> {
    // SAFETY: the pgstat accessors return pointers into a backend-local copy that stays
    // valid until the next refresh; we only read from it here.
    unsafe {
        if REFRESHED_FOR.get() != pg_sys::GetCurrentStatementStartTimestamp() {
            refresh();
        }
        let n = pg_sys::pgstat_fetch_stat_numbackends();
        (1..=n).find_map(|i| {
            let entry = pg_compat::local_backend_status(i);
            let status = &entry.as_ref()?.backendStatus;
            (status.st_procpid == pid).then_some(status.st_proc_start_timestamp)
        })
    }
}

/// Without shared memory: remembers the last owner confirmed alive, so that a caller
/// checking the same owner again and again (a waiting claim_key) only pays for the cheap
/// pid test. While that pid stays in use it is the same process, since a pid is only
/// reused after its process has exited; a reuse within one poll interval would go
/// unseen, which Linux's sequential pid allocation makes a non-event. With shared memory
/// the test is exact and cheap, and nothing is remembered.
#[derive(Default)]
pub struct OwnerWatch {
    confirmed: Option<(i32, pg_sys::TimestampTz)>,
}

impl OwnerWatch {
    pub fn alive(&mut self, pid: i32, started: pg_sys::TimestampTz) -> bool {
        if let Some(shared) = shmem::shared() {
            return shared.backend_alive(pid, started);
        }
        if !pid_in_use(pid) {
            self.confirmed = None;
            return false;
        }
        if self.confirmed == Some((pid, started)) {
            return true;
        }
        refresh();
        let alive = backend_start_time(pid) == Some(started);
        self.confirmed = alive.then_some((pid, started));
        alive
    }
}
