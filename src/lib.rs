//! pg_once: compute each expensive, cacheable key once across a fleet of processes.
//!
//! The SQL objects are declared by hand in sql/; this crate provides the C functions
//! behind them. Modules, by concern:
//! - `api`: the SQL-callable functions (argument checks, then the protocol)
//! - `key`: a cache key, checked, and its digest (the primary key of once.entries)
//! - `args` / `errors`: bad input → a specific SQLSTATE and an actionable message
//! - `claim`: the claim protocol, every write of once.entries
//! - `entry`: reading a key's row straight from the primary-key index
//! - `queue`: queue mode (queues, enqueue, claim_next, batch operations)
//! - `wait`: server-side waiting inside claim_key
//! - `liveness`: who a claim names (`Me`, `Owner`) and whether that owner is still running
//! - `notify`: the trigger that NOTIFYs channel `once` with the key
//! - `shmem`: shared memory when preloaded (backend slots, relay queues, counters)
//! - `worker`: the per-database background worker (reaper and NOTIFY relay)
//! - `guc`: the once.* settings
//! - `statements`, `subxact`, `jsonb`: plan caching, lock-free lost races, jsonb pass-through

use pgrx::prelude::*;

mod api;
mod args;
mod claim;
mod entry;
mod errors;
mod guc;
mod jsonb;
mod key;
mod liveness;
mod notify;
mod queue;
mod shmem;
mod statements;
mod subxact;
mod wait;
mod worker;

#[cfg(any(test, feature = "pg_test"))]
mod tests;

pgrx::pg_module_magic!(name, version);

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/functions.sql", name = "functions", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: reads a flag the postmaster sets while loading preload libraries.
    let preloading = unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress };
    guc::register(preloading);
    // Shared memory, commit callbacks and workers exist only when preloaded; otherwise
    // waiting polls, the trigger NOTIFYs directly and reap_stale is called by a scheduler.
    if preloading {
        shmem::request();
        notify::register_callbacks();
        worker::register();
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![
            "shared_preload_libraries = 'pg_once'",
            "once.databases = 'pgrx_tests'",
        ]
    }
}
