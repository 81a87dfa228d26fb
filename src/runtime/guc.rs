//! The once.* settings.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};
use std::ffi::CString;

/// Whether a claim also ends when the backend that made it exits. Recorded with each claim
/// (as once.entries.lease_only), so the session that claims decides how its claim is judged.
pub static BACKEND_LIVENESS: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Milliseconds between two looks at a key while claim_key waits without shared memory.
pub static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(20);

#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum NotifyMode {
    /// Hand keys to the database's pg_once worker after commit; it sends them in batches.
    #[name = c"relay"]
    Relay,
    /// The committing transaction sends its own NOTIFY.
    #[name = c"direct"]
    Direct,
    /// No NOTIFY at all (server-side waiting is still woken).
    #[name = c"off"]
    Off,
}

/// How keys leaving `running` are announced on channel `once`.
pub static NOTIFY: GucSetting<NotifyMode> = GucSetting::<NotifyMode>::new(NotifyMode::Relay);

/// Databases that get a pg_once worker (reaper and NOTIFY relay), comma-separated.
pub static DATABASES: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"postgres"));

/// Seconds that once.attempts keeps a row before reap_stale removes it.
pub static HISTORY_RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);

/// Milliseconds a pg_once worker lets notifications gather after sending a batch.
pub static RELAY_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(50);

/// Largest result complete_key stores, in kB (a result is sent whole with every hit).
pub static MAX_RESULT_SIZE_KB: GucSetting<i32> = GucSetting::<i32>::new(16 * 1024);

/// Largest payload enqueue_key stores, in kB (claim_next hands it to a worker whole).
pub static MAX_PAYLOAD_SIZE_KB: GucSetting<i32> = GucSetting::<i32>::new(1024);

/// Longest error fail_key stores, in kB (every caller answered `failed` is sent it, and
/// every attempt at a queued key keeps its own copy in once.attempts).
pub static MAX_ERROR_SIZE_KB: GucSetting<i32> = GucSetting::<i32>::new(16);

/// Milliseconds between two reap_stale runs of a pg_once worker.
pub static REAPER_NAPTIME_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);

/// Define the settings and reserve the `once.` prefix. `preloading`: loaded by
/// shared_preload_libraries, the only time a server-start setting (once.databases) may be
/// defined.
pub fn register(preloading: bool) {
    GucRegistry::define_bool_guc(
        c"once.backend_liveness",
        c"A claim also ends when the backend that made it exits, not only when its lease runs out.",
        c"Turn off for sessions behind a proxy that may close server connections under live clients \
          (e.g. PgBouncer server_lifetime); their claims then end only when the lease expires. \
          Recorded with each claim, so it can be set per role or per session.",
        &BACKEND_LIVENESS,
        GucContext::Userset,
        GucFlags::default(),
    );
    // Any role may tune its own waits, but not into a busy loop: each look is an index
    // read that a waiting call makes for as long as its wait lasts, so 10 ms (at most
    // 100 looks a second per waiting call) is the floor. A superuser-only setting would
    // keep the loop away from roles too, but also per-role tuning, which is the point.
    GucRegistry::define_int_guc(
        c"once.poll_interval",
        c"How often a waiting claim_key looks at its key again when it cannot be woken.",
        c"Used when pg_once is not in shared_preload_libraries. At least 10 ms.",
        &POLL_INTERVAL_MS,
        10,
        60_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"once.history_retention",
        c"How long once.attempts keeps the history of an attempt.",
        c"reap_stale (and the pg_once worker) deletes older rows.",
        &HISTORY_RETENTION_S,
        60,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_enum_guc(
        c"once.notify",
        c"How keys leaving the running state are announced on channel once: relay, direct or off.",
        c"relay hands them to the database's pg_once worker after commit (needs \
          shared_preload_libraries; otherwise direct is used); direct NOTIFYs from the \
          committing transaction; off sends nothing (waiting claim_key calls are still woken).",
        &NOTIFY,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"once.max_result_size",
        c"Largest result complete_key, complete_keys and cached store.",
        c"A larger result is refused with 54000. Every hit sends the whole result, and jsonb \
          itself cannot hold much more than 256MB.",
        &MAX_RESULT_SIZE_KB,
        1,
        256 * 1024,
        GucContext::Suset,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_int_guc(
        c"once.max_payload_size",
        c"Largest payload enqueue_key stores.",
        c"A larger payload is refused with 54000 before anything is written. claim_next \
          hands the whole payload to a worker; jsonb cannot hold much more than 256MB.",
        &MAX_PAYLOAD_SIZE_KB,
        1,
        256 * 1024,
        GucContext::Suset,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_int_guc(
        c"once.max_error_size",
        c"Longest error fail_key stores.",
        c"A longer error is refused with 54000 before anything is written. Every caller \
          answered failed is sent it, and once.attempts keeps it for each queued attempt.",
        &MAX_ERROR_SIZE_KB,
        1,
        1024,
        GucContext::Suset,
        GucFlags::UNIT_KB,
    );
    if preloading {
        GucRegistry::define_string_guc(
            c"once.databases",
            c"Databases where a pg_once worker reaps stale claims and relays notifications.",
            c"Comma-separated; read at server start. Only with shared_preload_libraries.",
            &DATABASES,
            GucContext::Postmaster,
            GucFlags::default(),
        );
    }
    GucRegistry::define_int_guc(
        c"once.relay_interval",
        c"How long a pg_once worker lets notifications gather after sending a batch.",
        c"Larger batches wake each LISTENing backend fewer times; a notification is \
          delayed by at most about this long. Only with shared_preload_libraries.",
        &RELAY_INTERVAL_MS,
        0,
        1000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"once.reaper_naptime",
        c"How often a pg_once worker runs reap_stale.",
        c"Only with shared_preload_libraries.",
        &REAPER_NAPTIME_MS,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    // Every once.* setting is defined above: a misspelt one (`SET once.poll_intervall`)
    // is then an error instead of a silently accepted placeholder, and one already set
    // in postgresql.conf is reported and removed.
    crate::pg_compat::reserve_guc_prefix(c"once");
}

/// The databases named by once.databases.
pub fn databases() -> Vec<String> {
    DATABASES
        .get()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
        .split(',')
        .map(|db| db.trim().to_owned())
        .filter(|db| !db.is_empty())
        .collect()
}
