//! The pg_once worker: one background worker per database in once.databases, started when
//! pg_once is in shared_preload_libraries. It
//! - runs reap_stale every once.reaper_naptime, so abandoned claims and expired results
//!   go away with no client help;
//! - sends the notifications that committing transactions handed over (once.notify =
//!   relay), in batches, so those transactions never take NOTIFY's commit lock.
//!
//! Like pg_cron's launcher: it starts once recovery has finished (so never on a standby),
//! is restarted a second after a crash, does nothing where the extension is not
//! installed, and exits with the postmaster.

use crate::protocol::claim;
use crate::runtime::shmem;
use crate::runtime::{guc, notify};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// Keys sent per relay transaction, at most.
const RELAY_BATCH: usize = 10_000;

/// Register one worker per database named by once.databases (from _PG_init, preloading).
pub fn register() {
    for db in guc::databases().into_iter().take(shmem::MAX_DATABASES) {
        BackgroundWorkerBuilder::new(&format!("pg_once worker for database {db}"))
            .set_type("pg_once worker")
            .set_library("pg_once")
            .set_function("pg_once_worker_main")
            .set_extra(&db)
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(Some(Duration::from_secs(1)))
            .load();
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_once_worker_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let database = BackgroundWorker::get_extra().to_owned();
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
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
    // SAFETY: MyDatabaseId is set once connected.
    let Some(queue) = shared.attach_relay(unsafe { pg_sys::MyDatabaseId }) else {
        log!(
            "pg_once: no free relay slot for database {database}; at most {} databases",
            shmem::MAX_DATABASES
        );
        return;
    };
    log!("pg_once worker started for database {database}");

    let mut next_reap = Instant::now();
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
    shared.detach_relay(queue);
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
        BackgroundWorker::transaction(|| {
            for key in &keys {
                notify::notify_now(key);
            }
        });
        shared.consume(queue, sent_up_to);
        sent += keys.len();
    }
}

/// reap_stale, where the extension is installed.
fn reap() {
    BackgroundWorker::transaction(|| {
        // SAFETY: catalog lookup inside a transaction.
        let installed =
            unsafe { pg_sys::get_extension_oid(c"pg_once".as_ptr(), true) } != pg_sys::InvalidOid;
        if installed {
            let r = claim::reap();
            if r.reclaimed > 0 || r.expired > 0 || r.history > 0 {
                debug1!(
                    "pg_once: reclaimed {} claims, purged {} expired results and {} history rows",
                    r.reclaimed,
                    r.expired,
                    r.history
                );
            }
        }
    });
}
