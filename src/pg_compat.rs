//! What differs between the PostgreSQL majors pg_once builds against (14 to 18), and
//! nothing else. Every `cfg(feature = "pgNN")` of the crate is in this file: the rest of
//! the code calls these functions, which mean the same on every version.
//!
//! - A backend's slot number. Up to 16 a backend of the MaxBackends kind (client
//!   backends, autovacuum, background workers, WAL senders) has a BackendId,
//!   1..=MaxBackends, the lowest free one when it starts (`MyBackendId`,
//!   `PGPROC.backendId`); auxiliary processes have none. PostgreSQL 17 replaced it with
//!   the ProcNumber, the index of the PGPROC in `ProcGlobal->allProcs`
//!   (`MyProcNumber`, `GetNumberFromPGProc`), whose first MaxBackends entries are those
//!   same kinds of backend and whose auxiliary processes come after them. Either way a
//!   running backend of those kinds has a unique number below MaxBackends, which is all
//!   pg_once's slots need.
//! - A PGPROC's index in `allProcs` (to reach its latch): `PGPROC.pgprocno` up to 16, the
//!   ProcNumber since 17.
//! - The backend status table by position: `pgstat_fetch_stat_local_beentry` up to 15,
//!   `pgstat_get_local_beentry_by_index` since 16 (same 1-based index into the local copy).
//! - Asking for shared memory: PostgreSQL 15 added `shmem_request_hook`, and computes
//!   MaxBackends before it runs; on 14 a library asks in `_PG_init`, before MaxBackends is
//!   computed (see `max_backends`).
//! - Reserving the `once.` prefix: `MarkGUCPrefixReserved` since 15. 14 has only
//!   `EmitWarningsOnPlaceholders`, which warns about `once.*` placeholders already set but
//!   cannot refuse later ones: on 14 a misspelt `SET once.poll_intervall` is accepted.
//! - `heap_fetch`: PostgreSQL 15 added `keep_buf` (keep the buffer pinned when the answer
//!   is false); on 14 a false answer releases it and leaves `InvalidBuffer`.
//! - `index_beginscan`: PostgreSQL 18 added an `instrument` argument (NULL: no EXPLAIN
//!   ANALYZE counts).
//! - `proc_exit` is declared `-> !` by pgrx's bindings up to 17, not for 18.
//! - A backend's random numbers: PostgreSQL 15 added `pg_prng` and its per-process
//!   `pg_global_prng_state`; 14 has the C library's `random()`, which it seeds per process
//!   the same way (InitProcessGlobals: strong random bits, else the pid and start time).
//!
//! - The timeline WAL is written on: `GetWALInsertionTimeLine()` since 15; on 14 the
//!   backend's `ThisTimeLineID`, which a backend that writes has set from shared memory
//!   (RecoveryInProgress, called before any write, does it once recovery has ended).
//!
//! pg_once is tested on 15 to 18 and type-checked on 14 against pgrx's bindings of it
//! (CONTRIBUTING.md, "PostgreSQL versions").

use pgrx::pg_sys;
use std::ffi::CStr;

/// This backend's number among the MaxBackends backends that can have one (0-based), or
/// None for a process without one (an auxiliary process).
pub fn my_backend_number() -> Option<usize> {
    // SAFETY (both): set once at backend start, before any SQL runs. Invalid is -1
    // (InvalidBackendId, INVALID_PROC_NUMBER), which below_max_backends turns into None.
    #[cfg(any(feature = "pg14", feature = "pg15", feature = "pg16"))]
    let number = unsafe { pg_sys::MyBackendId } - 1;
    #[cfg(any(feature = "pg17", feature = "pg18"))]
    let number = unsafe { pg_sys::MyProcNumber };
    below_max_backends(number)
}

/// The number (as `my_backend_number` would say in that backend) of the backend whose
/// PGPROC this is.
///
/// # Safety
/// `proc_` is a live PGPROC, e.g. from BackendPidGetProc.
pub unsafe fn backend_number(proc_: *const pg_sys::PGPROC) -> Option<usize> {
    #[cfg(any(feature = "pg14", feature = "pg15", feature = "pg16"))]
    let number = unsafe { (*proc_).backendId } - 1;
    #[cfg(any(feature = "pg17", feature = "pg18"))]
    let number = unsafe { proc_number(proc_) };
    below_max_backends(number)
}

fn below_max_backends(number: i32) -> Option<usize> {
    usize::try_from(number).ok().filter(|&n| n < max_backends())
}

/// Index of this process's PGPROC in `ProcGlobal->allProcs`, where its latch lives.
pub fn my_proc_number() -> i32 {
    // SAFETY: MyProc is this process's PGPROC, set at process start.
    unsafe { proc_number(pg_sys::MyProc) }
}

/// Index of `proc_` in `ProcGlobal->allProcs`.
///
/// # Safety
/// `proc_` points into `ProcGlobal->allProcs`.
unsafe fn proc_number(proc_: *const pg_sys::PGPROC) -> i32 {
    #[cfg(any(feature = "pg14", feature = "pg15", feature = "pg16"))]
    return unsafe { (*proc_).pgprocno };
    // GetNumberFromPGProc is a macro: the offset from the array's start.
    #[cfg(any(feature = "pg17", feature = "pg18"))]
    return unsafe { proc_.offset_from((*pg_sys::ProcGlobal).allProcs) } as i32;
}

/// The latch of the process whose PGPROC is number `proc_number` (see `my_proc_number`).
pub fn latch_of(proc_number: i32) -> *mut pg_sys::Latch {
    // SAFETY: allProcs lives for the server's lifetime and proc_number indexes it.
    unsafe { &raw mut (*(*pg_sys::ProcGlobal).allProcs.add(proc_number as usize)).procLatch }
}

/// A uniform draw in [0, 1) from this backend's generator, which PostgreSQL seeds in
/// every process (InitProcessGlobals). Not for secrets; it does not move SQL's random(),
/// which keeps a state of its own (setseed).
pub fn random_fraction() -> f64 {
    #[cfg(feature = "pg14")]
    {
        extern "C" {
            fn random() -> std::ffi::c_long;
        }
        // SAFETY: the C library's generator, which only this backend's thread uses.
        let draw = unsafe { random() };
        // 31 random bits, below 2^31.
        draw as f64 / (1u64 << 31) as f64
    }
    // SAFETY: the backend's global generator state, which only its thread uses.
    #[cfg(not(feature = "pg14"))]
    unsafe {
        pg_sys::pg_prng_double(&raw mut pg_sys::pg_global_prng_state)
    }
}

/// MaxBackends. On 14 it is computed only after preloaded libraries ask for shared memory,
/// so it is computed here the way PostgreSQL 14 does (InitializeMaxBackends), from
/// settings that are final by then.
pub fn max_backends() -> usize {
    #[cfg(feature = "pg14")]
    {
        let setting = |name: &CStr| -> usize {
            // SAFETY: GetConfigOption returns the setting's current value as a C string.
            let value =
                unsafe { CStr::from_ptr(pg_sys::GetConfigOption(name.as_ptr(), false, false)) };
            value
                .to_str()
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| pgrx::error!("pg_once: setting {name:?} is not an integer"))
        };
        setting(c"max_connections")
            + setting(c"autovacuum_max_workers")
            + 1
            + setting(c"max_worker_processes")
            + setting(c"max_wal_senders")
    }
    // SAFETY: final once shared memory is requested (shmem_request_hook runs after it).
    #[cfg(not(feature = "pg14"))]
    unsafe {
        pg_sys::MaxBackends as usize
    }
}

/// The `index`th entry (1-based, up to `pgstat_fetch_stat_numbackends()`) of this
/// backend's copy of the backend status table, NULL when out of range.
///
/// # Safety
/// Called inside a transaction; the entry is valid until the copy is cleared.
pub unsafe fn local_backend_status(index: i32) -> *mut pg_sys::LocalPgBackendStatus {
    #[cfg(any(feature = "pg14", feature = "pg15"))]
    return unsafe { pg_sys::pgstat_fetch_stat_local_beentry(index) };
    #[cfg(not(any(feature = "pg14", feature = "pg15")))]
    return unsafe { pg_sys::pgstat_get_local_beentry_by_index(index) };
}

/// Reserve the settings prefix `prefix`: a misspelt setting under it is an error, and one
/// already set is reported and removed (on 14: only reported, see the module's comment).
/// Call from _PG_init after defining the settings.
pub fn reserve_guc_prefix(prefix: &CStr) {
    // SAFETY: called from _PG_init, as PostgreSQL's own modules do.
    #[cfg(feature = "pg14")]
    unsafe {
        pg_sys::EmitWarningsOnPlaceholders(prefix.as_ptr())
    };
    // SAFETY: as above.
    #[cfg(not(feature = "pg14"))]
    unsafe {
        pg_sys::MarkGUCPrefixReserved(prefix.as_ptr())
    };
}

#[cfg(not(feature = "pg14"))]
static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
#[cfg(not(feature = "pg14"))]
static mut SHMEM_REQUEST: Option<fn()> = None;

/// Call `request` (which calls RequestAddinShmemSpace and RequestNamedLWLockTranche)
/// where PostgreSQL takes such requests: from shmem_request_hook since 15, at once on 14
/// (whose preloaded libraries ask in _PG_init). Call from _PG_init while preloading.
pub fn request_shared_memory(request: fn()) {
    #[cfg(feature = "pg14")]
    request();
    // SAFETY: hook chaining as every preloaded library does, in the postmaster.
    #[cfg(not(feature = "pg14"))]
    unsafe {
        SHMEM_REQUEST = Some(request);
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
    }
}

#[cfg(not(feature = "pg14"))]
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST_HOOK {
            prev();
        }
        if let Some(request) = SHMEM_REQUEST {
            request();
        }
    }
}

/// heap_fetch: whether `tuple.t_self` is a tuple visible to `snapshot`, read into `tuple`.
/// `buffer` is left pinned if valid: the caller releases it if it is not `InvalidBuffer`
/// (on 14 a false answer has already released it).
///
/// # Safety
/// As heap_fetch: `relation` is open and locked, `tuple.t_self` is set.
pub unsafe fn heap_fetch(
    relation: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    tuple: &mut pg_sys::HeapTupleData,
    buffer: &mut pg_sys::Buffer,
) -> bool {
    #[cfg(feature = "pg14")]
    return unsafe { pg_sys::heap_fetch(relation, snapshot, tuple, buffer) };
    #[cfg(not(feature = "pg14"))]
    return unsafe { pg_sys::heap_fetch(relation, snapshot, tuple, buffer, true) };
}

/// index_beginscan.
///
/// # Safety
/// As index_beginscan: both relations open and locked, `snapshot` registered.
pub unsafe fn index_beginscan(
    table: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    nkeys: i32,
    norderbys: i32,
) -> pg_sys::IndexScanDesc {
    #[cfg(not(feature = "pg18"))]
    return unsafe { pg_sys::index_beginscan(table, index, snapshot, nkeys, norderbys) };
    #[cfg(feature = "pg18")]
    return unsafe {
        pg_sys::index_beginscan(
            table,
            index,
            snapshot,
            std::ptr::null_mut(),
            nkeys,
            norderbys,
        )
    };
}

/// End this process as an ERROR in it would, running its exit callbacks.
pub fn proc_exit(code: i32) -> ! {
    // SAFETY: PostgreSQL's own way out of a backend or worker.
    unsafe { pg_sys::proc_exit(code) };
    // pgrx's bindings of 18 lose proc_exit's noreturn.
    #[cfg(feature = "pg18")]
    unreachable!("proc_exit returned")
}

/// The timeline this primary writes WAL on. Call only where writing is possible (after a
/// write such as nextval succeeded): on a standby there is none.
pub fn insert_timeline() -> u32 {
    // SAFETY: a read of shared state (15+) or of this backend's copy of it (14).
    #[cfg(feature = "pg14")]
    return unsafe { pg_sys::ThisTimeLineID };
    #[cfg(not(feature = "pg14"))]
    return unsafe { pg_sys::GetWALInsertionTimeLine() };
}
