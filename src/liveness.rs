//! Is the backend that made a claim still there?
//!
//! A claim records its backend's pid and start time. The pid alone is not enough: after
//! the owner exits, the operating system may give the same pid to a new backend, which
//! must not keep the claim alive. The start time comes from the server's backend status
//! table (what pg_stat_activity.backend_start shows).

use pgrx::pg_sys;
use std::cell::Cell;

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
    pid_in_use(pid) && backend_start_time(pid) == Some(started)
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
            let entry = pg_sys::pgstat_fetch_stat_local_beentry(i);
            let status = &entry.as_ref()?.backendStatus;
            (status.st_procpid == pid).then_some(status.st_proc_start_timestamp)
        })
    }
}

/// Remembers the last owner confirmed alive, so that a caller checking the same owner
/// again and again (a waiting claim_key) only pays for the cheap pid test: while that pid
/// stays in use without a gap it is the same process, since a pid is only reused after
/// its process has exited.
#[derive(Default)]
pub struct OwnerWatch {
    confirmed: Option<(i32, pg_sys::TimestampTz)>,
}

impl OwnerWatch {
    pub fn alive(&mut self, pid: i32, started: pg_sys::TimestampTz) -> bool {
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
