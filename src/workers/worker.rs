//! The pg_once worker: one per database named in once.databases, started by the pg_once
//! launcher (workers::launcher) when pg_once is in shared_preload_libraries. It
//! - runs reap_stale every once.reaper_naptime, so abandoned claims and expired results
//!   go away with no client help;
//! - sends the notifications that committing transactions handed over (once.notify =
//!   relay), in batches, so those transactions never take NOTIFY's commit lock.
//!
//! It does nothing where the extension is not installed, and exits on SIGTERM or with the
//! postmaster. The launcher starts it again however it ended.

use crate::protocol;
use crate::runtime::shmem::{self, AttachError};
use crate::runtime::{guc, notify};
use crate::storage::installed;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// Keys sent per relay transaction, at most.
const RELAY_BATCH: usize = 10_000;

/// What the launcher tells a worker it starts, packed into the worker's Datum argument
/// (a dynamic worker gets nothing else by value but bgw_extra, which holds the name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// The database to serve, by oid: the one the launcher looked up, even if another
    /// database takes its name meanwhile.
    pub dboid: pg_sys::Oid,
    /// This start's number (Shared::next_launch), reported back once the worker is ready.
    pub number: u32,
}

impl Launch {
    pub fn to_datum(self) -> pg_sys::Datum {
        pg_sys::Datum::from((u64::from(self.number) << 32) | u64::from(self.dboid.to_u32()))
    }

    fn from_datum(arg: pg_sys::Datum) -> Launch {
        let packed = arg.value() as u64;
        Launch {
            dboid: pg_sys::Oid::from(packed as u32),
            number: (packed >> 32) as u32,
        }
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_once_worker_main(arg: pg_sys::Datum) {
    let launch = Launch::from_datum(arg);
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let database = BackgroundWorker::get_extra().to_owned();
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(launch.dboid), None);
    // The worker runs as a superuser: let no schema on a user's path change its SQL.
    // SAFETY: setting a GUC in this process.
    unsafe {
        pg_sys::SetConfigOption(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
    let shared = shmem::shared().expect("the worker only runs when preloaded");
    let queue = match shared.attach_relay(launch.dboid) {
        Ok(queue) => queue,
        Err(AttachError::Taken { pid }) => {
            // A launcher that restarted meanwhile started a second worker; the first one
            // keeps serving and the launcher adopts it.
            log!("pg_once: database {database} is already served by the pg_once worker with pid {pid}; this one exits");
            return;
        }
        Err(AttachError::Full) => {
            log!(
                "pg_once: no free relay slot for database {database}; at most {} databases",
                shmem::MAX_DATABASES
            );
            return;
        }
    };
    // However the worker exits from here on (SIGTERM, an ERROR), the queue is freed for
    // its successor and the launcher woken to start it.
    // SAFETY: registers a callback run once when this worker exits.
    unsafe { pg_sys::before_shmem_exit(Some(on_worker_exit), pg_sys::Datum::from(queue)) };
    log!("pg_once worker started for database {database}");

    let mut next_reap = Instant::now();
    let mut ready = false;
    // Every wait below is a latch wait: SIGTERM and SIGHUP set the latch, so a stop or a
    // reload is seen at once, whatever the worker was waiting for.
    loop {
        if BackgroundWorker::sigterm_received() {
            break;
        }
        if BackgroundWorker::sighup_received() {
            reload_settings();
        }
        let sent = relay(shared, queue);
        if shared.take_reap_request(queue) || Instant::now() >= next_reap {
            reap();
            next_reap = Instant::now() + naptime();
        }
        if !ready {
            // A first round done: the launcher restarts this worker promptly if it stops
            // from now on, and with a growing backoff if it had not got this far.
            shared.worker_ready(queue, launch.number);
            ready = true;
        }
        if sent > 0 {
            // Let the next batch gather: every listening backend is signalled once per
            // batch and wakes to read it, so fewer, larger batches cost them far less.
            // Then relay again: keys pushed meanwhile found the queue non-empty and did
            // not set the latch (see Shared::push).
            match gather(Duration::from_millis(guc::RELAY_INTERVAL_MS.get() as u64)) {
                Gathered::Elapsed => continue,
                Gathered::Reload => {
                    reload_settings();
                    continue;
                }
                Gathered::Stop => break,
            }
        }
        // The queue was empty at the last look: the next key pushed sets the latch.
        let until_reap = next_reap.saturating_duration_since(Instant::now());
        if !BackgroundWorker::wait_latch(Some(until_reap.max(Duration::from_millis(1)))) {
            break; // SIGTERM or postmaster death
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_worker_exit(_code: i32, queue: pg_sys::Datum) {
    if let Some(shared) = shmem::shared() {
        shared.detach_relay(queue.value());
    }
}

fn reload_settings() {
    // SAFETY: re-read postgresql.conf, as after any SIGHUP.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
}

/// How a gathering sleep ended.
enum Gathered {
    Elapsed,
    /// SIGHUP: settings are to be reloaded (the flag has been taken).
    Reload,
    /// SIGTERM, or the postmaster died.
    Stop,
}

/// Sleep for `interval`, or until SIGTERM or SIGHUP. A latch set by a committing
/// transaction does not end the sleep: the point is to let keys gather.
fn gather(interval: Duration) -> Gathered {
    let until = Instant::now() + interval;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Gathered::Elapsed;
        }
        // False on SIGTERM (whose flag it takes) or postmaster death.
        if !BackgroundWorker::wait_latch(Some(left)) {
            return Gathered::Stop;
        }
        if BackgroundWorker::sighup_received() {
            return Gathered::Reload;
        }
    }
}

fn naptime() -> Duration {
    Duration::from_millis(guc::REAPER_NAPTIME_MS.get() as u64)
}

/// Send what committed transactions handed over, one transaction per batch of at most
/// RELAY_BATCH keys. Returns how many keys were sent.
fn relay(shared: &shmem::Shared, queue: usize) -> usize {
    let mut sent = 0;
    loop {
        let (keys, sent_up_to) = shared.peek(queue, RELAY_BATCH);
        if keys.is_empty() {
            return sent;
        }
        // A listener that does not read keeps the notify queue from moving: past half full
        // the batch is announced as ANY_KEY alone, past nine tenths not at all, so that
        // this transaction's commit cannot fail (runtime::notify).
        BackgroundWorker::transaction(|| {
            match notify::Announcement::for_queue_usage(notify::notify_queue_usage(), false) {
                notify::Announcement::Keys => keys.iter().for_each(|key| notify::notify_now(key)),
                notify::Announcement::AnyKey => notify::notify_now(notify::ANY_KEY),
                notify::Announcement::Nothing => {}
            }
        });
        shared.consume(queue, sent_up_to);
        sent += keys.len();
    }
}

/// reap_stale, where this library's version of the extension is installed, in two
/// transactions: the takeover of gone owners' claims commits first, on its own, so that
/// those keys are claimable (and their waiters woken) without waiting for the purges
/// (protocol::reap::reclaim). Between a package upgrade and ALTER EXTENSION pg_once UPDATE
/// the tables are not the ones this code knows: the worker says so once and waits
/// (relaying still works: it touches no table).
fn reap() {
    let reclaimed =
        BackgroundWorker::transaction(|| installed_here().then(protocol::reap::reclaim));
    let Some(reclaimed) = reclaimed else {
        return;
    };
    let (expired, history) = BackgroundWorker::transaction(protocol::reap::purge);
    if reclaimed > 0 || expired > 0 || history > 0 {
        debug1!(
            "pg_once: reclaimed {reclaimed} claims, purged {expired} expired results and {history} history rows"
        );
    }
}

/// Is this library's version of the extension installed in the worker's database? Logs
/// a mismatch once, until it is resolved.
fn installed_here() -> bool {
    let Some(version) = installed::installed_version() else {
        return false;
    };
    if version != installed::LIBRARY_VERSION {
        if !MISMATCH_LOGGED.replace(true) {
            warning!(
                "pg_once worker: this database has pg_once {version} installed, but the server runs the pg_once {} library; the worker reaps nothing until ALTER EXTENSION pg_once UPDATE is run in it",
                installed::LIBRARY_VERSION
            );
        }
        return false;
    }
    MISMATCH_LOGGED.set(false);
    true
}

thread_local! {
    /// The version mismatch was logged (once, until it is resolved).
    static MISMATCH_LOGGED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
