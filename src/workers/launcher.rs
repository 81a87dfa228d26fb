//! The pg_once launcher: the one static background worker pg_once registers (when
//! preloaded). It starts a worker (workers::worker) for each database named in
//! once.databases, and starts it again whenever it stops, however it stopped: a worker
//! that the postmaster restarted itself would be gone for good after exiting with code 0
//! (pg_terminate_backend), and would be restarted every second, forever, where its
//! database does not exist.
//!
//! - The launcher connects to no database: it reads only pg_database, a shared catalog.
//! - A database that does not exist is logged once, then looked up again every
//!   MISSING_RECHECK; once it is created, its worker starts (and does its work once
//!   CREATE EXTENSION pg_once has run there).
//! - A worker is started again RESTART_DELAY after it stops, if it had got through its
//!   first round (connected, relayed, reaped: `Shared::was_ready`). One that stopped
//!   before that is failing at start (its database refuses connections, its schema is
//!   broken) and is started again after a backoff that doubles up to MAX_BACKOFF, so
//!   that its error is logged at most about once a minute rather than every second.
//! - Like PostgreSQL's logical replication launcher, it starts once recovery has finished
//!   (so never on a standby) and exits with code 1 on SIGTERM, so that the postmaster
//!   starts it again RESTART_DELAY later after pg_terminate_backend or an ERROR, and
//!   simply not at a server shutdown. Its workers do not depend on it: they keep running
//!   while it is gone, and its successor finds them in shared memory (each relay queue
//!   records its worker's pid) and watches them instead of starting second ones.
//!
//! Every sleep is a latch wait. The latch is set by SIGTERM and SIGHUP, by the postmaster
//! when a worker the launcher started starts or stops (bgw_notify_pid), and by any worker
//! as it exits (`Shared::detach_relay`), which is how the launcher hears of workers it
//! did not start.

use crate::runtime::guc;
use crate::runtime::shmem::{self, Shared};
use crate::workers::worker::Launch;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime,
    DynamicBackgroundWorker, SignalWakeFlags,
};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use std::time::{Duration, Instant};

/// Delay before a worker that had started well is started again, and before the
/// postmaster starts the launcher again.
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// Longest delay between two starts of a worker that keeps failing at start.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// How often a database of once.databases that does not exist is looked up again.
const MISSING_RECHECK: Duration = Duration::from_secs(5);

/// Register the launcher (from _PG_init, preloading), unless once.databases is empty.
pub fn register() {
    if guc::databases().is_empty() {
        return;
    }
    BackgroundWorkerBuilder::new("pg_once launcher")
        .set_type("pg_once launcher")
        .set_library("pg_once")
        .set_function("pg_once_launcher_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(RESTART_DELAY))
        .load();
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_once_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(None, None);
    let shared = shmem::shared().expect("the launcher only runs when preloaded");
    // Before looking for running workers: one that exits after the look wakes us.
    shared.set_launcher();
    let names = database_names();
    log!(
        "pg_once launcher started for databases: {}",
        names.join(", ")
    );
    let mut databases: Vec<Database> = names.into_iter().map(Database::new).collect();
    loop {
        if BackgroundWorker::sigterm_received() {
            stop(shared);
        }
        if BackgroundWorker::sighup_received() {
            // SAFETY: re-read postgresql.conf, as after any SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let now = Instant::now();
        // Nothing should need a look sooner than this unless the latch is set; looking
        // anyway costs nothing and bounds the harm of a wake-up missed by a bug.
        let mut next = now + MISSING_RECHECK;
        for database in &mut databases {
            if let Some(at) = database.look(shared, now) {
                next = next.min(at);
            }
        }
        let timeout = next.saturating_duration_since(Instant::now());
        // False on SIGTERM (whose flag it takes) or postmaster death.
        if !BackgroundWorker::wait_latch(Some(timeout.max(Duration::from_millis(1)))) {
            stop(shared);
        }
    }
}

/// Exit with code 1: the postmaster starts a new launcher RESTART_DELAY later, unless the
/// server is shutting down. (Code 0 would unregister the launcher for good.)
fn stop(shared: &Shared) -> ! {
    shared.clear_launcher();
    debug1!("pg_once launcher shutting down");
    crate::pg_compat::proc_exit(1)
}

/// The databases of once.databases, each once, at most MAX_DATABASES of them (one relay
/// queue each); the rest are logged and ignored.
fn database_names() -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for name in guc::databases() {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.len() > shmem::MAX_DATABASES {
        let ignored = names.split_off(shmem::MAX_DATABASES);
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_CONFIG_FILE_ERROR,
            format!(
                "pg_once: once.databases names more than {} databases; ignoring {}",
                shmem::MAX_DATABASES,
                ignored.join(", ")
            ),
            "pg_once",
        )
        .set_hint("Remove databases from once.databases: pg_once serves at most 8.")
        .report(PgLogLevel::WARNING);
    }
    names
}

/// When to start a database's worker again after it stopped.
#[derive(Debug)]
struct Backoff {
    /// The delay after the next failed start.
    next: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            next: RESTART_DELAY,
        }
    }

    /// A worker stopped, or could not be started: the delay before the next start.
    /// `started_well`: it had got through its first round.
    fn after_stop(&mut self, started_well: bool) -> Duration {
        if started_well {
            self.next = RESTART_DELAY;
            return RESTART_DELAY;
        }
        let delay = self.next;
        self.next = (self.next * 2).min(MAX_BACKOFF);
        delay
    }
}

/// A database of once.databases and its worker.
struct Database {
    name: String,
    worker: Worker,
    backoff: Backoff,
    /// Its absence has been logged, and not logged again until it has existed.
    reported_missing: bool,
    /// A failure to start its worker has been logged, and not logged again until a start
    /// succeeds.
    reported_no_slot: bool,
}

enum Worker {
    /// None running: look the database up and start one at this instant.
    Due(Instant),
    /// Started by this launcher: the postmaster sets our latch when it starts and stops.
    Started {
        handle: DynamicBackgroundWorker,
        launch: Launch,
    },
    /// Found running when this launcher looked (started by a launcher before it): its
    /// exit sets our latch.
    Adopted { dboid: pg_sys::Oid, pid: i32 },
}

impl Database {
    fn new(name: String) -> Database {
        Database {
            name,
            worker: Worker::Due(Instant::now()),
            backoff: Backoff::new(),
            reported_missing: false,
            reported_no_slot: false,
        }
    }

    /// Act on what changed since the last look. Returns when to look again, or None to
    /// wait for the latch.
    fn look(&mut self, shared: &Shared, now: Instant) -> Option<Instant> {
        let started_well = match &self.worker {
            Worker::Due(at) if now < *at => return Some(*at),
            Worker::Due(_) => return self.start(shared, now),
            Worker::Started { handle, launch } => match handle.pid() {
                Ok(_) | Err(BackgroundWorkerStatus::NotYetStarted) => return None,
                // Stopped (or the postmaster died, which the next latch wait reports).
                Err(_) => shared.was_ready(launch.dboid, launch.number),
            },
            Worker::Adopted { dboid, pid } => {
                if shared.worker_of(*dboid) == Some(*pid) {
                    return None;
                }
                // It ran before this launcher started, long enough to be trusted.
                true
            }
        };
        let at = now + self.backoff.after_stop(started_well);
        self.worker = Worker::Due(at);
        Some(at)
    }

    /// Start the worker if the database exists, or adopt the one already serving it.
    fn start(&mut self, shared: &Shared, now: Instant) -> Option<Instant> {
        let Some(dboid) = lookup(&self.name, shared) else {
            if !self.reported_missing {
                ErrorReport::new(
                    PgSqlErrorCode::ERRCODE_INVALID_CATALOG_NAME,
                    format!(
                        "pg_once: database \"{}\" named in once.databases does not exist",
                        self.name
                    ),
                    "pg_once",
                )
                .set_detail(format!(
                    "pg_once looks for it every {} seconds and starts its worker once it exists.",
                    MISSING_RECHECK.as_secs()
                ))
                .set_hint(
                    "Create it (and run CREATE EXTENSION pg_once in it), or remove it from \
                     once.databases.",
                )
                .report(PgLogLevel::WARNING);
                self.reported_missing = true;
            }
            let at = now + MISSING_RECHECK;
            self.worker = Worker::Due(at);
            return Some(at);
        };
        if self.reported_missing {
            log!(
                "pg_once: database \"{}\" now exists; starting its worker",
                self.name
            );
            self.reported_missing = false;
            self.backoff = Backoff::new();
        }
        if let Some(pid) = shared.worker_of(dboid) {
            self.worker = Worker::Adopted { dboid, pid };
            return None;
        }
        let launch = Launch {
            dboid,
            number: shared.next_launch(),
        };
        // SAFETY: MyProcPid is set at process start.
        let me = unsafe { pg_sys::MyProcPid };
        let started =
            BackgroundWorkerBuilder::new(&format!("pg_once worker for database {}", self.name))
                .set_type("pg_once worker")
                .set_library("pg_once")
                .set_function("pg_once_worker_main")
                .set_argument(Some(launch.to_datum()))
                .set_extra(&self.name)
                .enable_spi_access()
                .set_start_time(BgWorkerStartTime::RecoveryFinished)
                // The launcher restarts it, with its own backoff; the postmaster never does.
                .set_restart_time(None)
                // The postmaster sets our latch when it starts and when it stops.
                .set_notify_pid(me)
                .load_dynamic();
        match started {
            Ok(handle) => {
                self.reported_no_slot = false;
                self.worker = Worker::Started { handle, launch };
                None
            }
            Err(_) => {
                if !self.reported_no_slot {
                    ErrorReport::new(
                        PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
                        format!(
                            "pg_once: could not start the worker for database \"{}\": no free background worker slot",
                            self.name
                        ),
                        "pg_once",
                    )
                    .set_hint(
                        "Raise max_worker_processes: pg_once needs one for its launcher and \
                         one per database in once.databases. pg_once keeps trying.",
                    )
                    .report(PgLogLevel::WARNING);
                    self.reported_no_slot = true;
                }
                let at = now + self.backoff.after_stop(false);
                self.worker = Worker::Due(at);
                Some(at)
            }
        }
    }
}

/// The oid of database `name`, if it exists. On the way, free the relay queues of
/// databases that no longer exist (Shared::release_relay).
fn lookup(name: &str, shared: &Shared) -> Option<pg_sys::Oid> {
    // Before the scan: a queue idle by then belongs to a database that existed by then,
    // so one the scan does not find was dropped.
    let idle = shared.idle_relays();
    let databases = BackgroundWorker::transaction(databases);
    for dboid in idle {
        if !databases.iter().any(|(oid, _)| *oid == dboid) {
            shared.release_relay(dboid);
        }
    }
    databases
        .into_iter()
        .find(|(_, datname)| datname == name)
        .map(|(oid, _)| oid)
}

/// Every database: oid and name, read with a sequential scan of pg_database. Connected to
/// no database, the launcher has relcache entries for the shared catalogs but maybe not
/// for their indexes (until some backend has written the shared relcache init file), and
/// building one would read pg_class, which needs a database: get_database_oid could then
/// fail. The autovacuum launcher reads pg_database the same way, for the same reason.
fn databases() -> Vec<(pg_sys::Oid, String)> {
    let mut found = Vec::new();
    // SAFETY: inside a transaction (BackgroundWorker::transaction); the tuples are read
    // while the scan holds them, and the relation is closed with the lock it was opened with.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let relation = pg_sys::table_open(pg_sys::DatabaseRelationId, lock);
        let scan = pg_sys::table_beginscan_catalog(relation, 0, std::ptr::null_mut());
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
            let name = std::ffi::CStr::from_ptr((*form).datname.data.as_ptr());
            found.push(((*form).oid, name.to_string_lossy().into_owned()));
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(relation, lock);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::{Backoff, MAX_BACKOFF, RESTART_DELAY};
    use std::time::Duration;

    #[test]
    fn a_worker_that_started_well_is_restarted_after_a_second() {
        let mut backoff = Backoff::new();
        for _ in 0..5 {
            assert_eq!(backoff.after_stop(true), RESTART_DELAY);
        }
    }

    #[test]
    fn a_worker_that_keeps_failing_at_start_waits_longer_each_time_up_to_a_minute() {
        let mut backoff = Backoff::new();
        let delays: Vec<u64> = (0..9)
            .map(|_| backoff.after_stop(false).as_secs())
            .collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff.after_stop(false), MAX_BACKOFF);
    }

    #[test]
    fn a_good_start_resets_the_backoff() {
        let mut backoff = Backoff::new();
        for _ in 0..4 {
            backoff.after_stop(false);
        }
        assert_eq!(backoff.after_stop(true), RESTART_DELAY);
        assert_eq!(backoff.after_stop(false), Duration::from_secs(1));
        assert_eq!(backoff.after_stop(false), Duration::from_secs(2));
    }
}
