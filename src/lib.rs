//! pg_once: compute each expensive, cacheable key once across a fleet of processes.
//!
//! The SQL objects are declared by hand in sql/; this crate provides the C functions
//! behind them. Layers, each calling only those below it; the full map, file by file, is
//! CONTRIBUTING.md's "Layers" (kept there once):
//! - `api`: the SQL surface, one function per SQL function (arguments checked in `args`,
//!   each body in `body`), the hints for calls PostgreSQL cannot match, internal helpers.
//! - `protocol`: what the calls mean: `claim`, `queue`, `waiting`, `freshness`,
//!   `namespace`, `cached`, `counts` (once.stats' key counts), `standby`, `rules`.
//! - `storage`: once.entries below the protocol: `statements`, `entry`, `subxact`, `jsonb`,
//!   `installed` (version check), `tokens` (the fencing-token floor), `watched`
//!   (per-backend copies of small tables).
//! - `runtime`: `shmem`, `wait`, `liveness`, `notify`, `launcher`, `worker`, `guc`.
//! - Used by all: `key` (a key, its SHA-256 digest, its tag), `errors`, `schema`,
//!   `pg_compat` (what differs between PostgreSQL majors, and only that).

use pgrx::prelude::*;

// First: its macros name the internal schema in the statements of every layer.
#[macro_use]
mod schema;

mod api;
mod errors;
mod key;
mod pg_compat;
mod protocol;
mod runtime;
mod storage;

#[cfg(any(test, feature = "pg_test"))]
mod tests;

pgrx::pg_module_magic!(name, version);

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/functions.sql", name = "functions", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: reads a flag the postmaster sets while loading preload libraries.
    let preloading = unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress };
    runtime::guc::register(preloading);
    // Every backend that loads pg_once: the transaction callbacks refuse to PREPARE a
    // transaction that announces keys (and, with shared memory, wake and relay at commit).
    runtime::notify::register_callbacks();
    // Every backend that loads pg_once: pending key counts die with an aborted
    // transaction (protocol::counts).
    protocol::counts::register_callbacks();
    // Every backend that loads pg_once: a call PostgreSQL cannot match to a pg_once
    // function (`wait => 10`) gets a hint naming the argument and what to write.
    api::hints::install();
    // Shared memory and workers exist only when preloaded; otherwise waiting polls, the
    // trigger NOTIFYs directly and reap_stale is called by a scheduler.
    if preloading {
        runtime::shmem::request();
        runtime::launcher::register();
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
