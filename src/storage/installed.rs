//! Which version of pg_once's SQL objects this database has, against this library's own.
//!
//! The two change at different moments. A package upgrade replaces the library at once,
//! and `ALTER EXTENSION pg_once UPDATE` replaces the SQL later, database by database; a
//! server that preloads pg_once keeps running the old library until it restarts, and a
//! session that loaded it keeps it until it ends. In between, the declarations and tables
//! are not the ones the code was written for: a function may receive arguments it does
//! not expect, or return a type its declaration does not say. So every call checks first
//! and, while the versions differ, refuses with 55000 and what to do, changing nothing.
//!
//! The answer is kept once the versions agree, and forgotten whenever any function's
//! catalog entry changes. Every install and upgrade script declares
//! `library_version()` again (CONTRIBUTING.md, "Upgrades"), so after an upgrade every
//! backend looks again before its next call.

use crate::errors;
use crate::storage::statements::{self, Statement};
use crate::storage::watched::Watched;
use pgrx::pg_sys;

/// This library's version, as built.
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version of pg_once installed in this database, if it is.
pub fn installed_version() -> Option<String> {
    static VERSION: Statement =
        Statement::new("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'pg_once'");
    statements::run(&VERSION, statements::params![], |table| {
        if table.is_empty() {
            return Ok(None);
        }
        table.first().get_one::<String>()
    })
}

thread_local! {
    /// Kept once the installed version was found equal to LIBRARY_VERSION, until any
    /// function's catalog entry changes.
    static MATCHED: Watched = const { Watched::of_catalog(pg_sys::SysCacheIdentifier::PROCOID) };
}

/// Refuse the call (55000) unless this database's pg_once is this library's version.
pub fn require_matching_version() {
    if MATCHED.with(Watched::kept).is_some() {
        return;
    }
    match installed_version() {
        Some(version) if version == LIBRARY_VERSION => MATCHED.with(|kept| kept.keep((), [])),
        // Not installed: only while CREATE EXTENSION runs (or DROP EXTENSION, in the
        // same transaction); nothing to compare yet.
        None => {}
        Some(version) => refuse(&version),
    }
}

fn refuse(installed: &str) -> ! {
    let message = format!(
        "pg_once's library is version {LIBRARY_VERSION}, but this database has pg_once {installed} installed"
    );
    if newer(LIBRARY_VERSION, installed) {
        errors::object_not_in_prerequisite_state(
            message,
            "Run ALTER EXTENSION pg_once UPDATE in this database, as its owner or a superuser.",
        )
    } else {
        errors::object_not_in_prerequisite_state(
            message,
            "This session loaded an older library than the one installed. Start a new session; \
             where pg_once is in shared_preload_libraries, restart the server.",
        )
    }
}

/// Whether version `a` is later than `b` (dotted numbers; anything else compares as 0).
fn newer(a: &str, b: &str) -> bool {
    let parts = |v: &str| -> Vec<u64> { v.split('.').map(|p| p.parse().unwrap_or(0)).collect() };
    parts(a) > parts(b)
}

#[cfg(test)]
mod tests {
    use super::newer;

    #[test]
    fn versions_compare_by_number() {
        assert!(newer("0.2.0", "0.1.0"));
        assert!(newer("0.10.0", "0.9.3"));
        assert!(!newer("0.1.0", "0.2.0"));
        assert!(!newer("0.2.0", "0.2.0"));
    }
}
