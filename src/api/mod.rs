//! The SQL surface: the C functions behind the functions CREATE EXTENSION declares in
//! sql/functions.sql. Each checks its arguments (args) and calls the protocol; none holds
//! a rule of the protocol itself.
//!
//! Every function here is `sql = false`: its CREATE FUNCTION statement (defaults,
//! comment; neither SECURITY DEFINER nor a SET clause: storage::statements runs each
//! statement as the extension's owner with search_path pinned) is hand-written next to the others in
//! sql/functions.sql, with its arguments in the order of the Rust signature. Arguments
//! arrive as Options so that NULL gets the documented 22004 error instead of a silent
//! NULL result, and every body runs inside `body`: the check that this database's pg_once is
//! this library's version, then errors::plain.

pub mod args;
mod cache;
pub mod hints;
mod internal;
mod namespace;
mod queue;
mod retired;
mod triggers;

use crate::errors;
use crate::key::Key;
use crate::protocol::namespace as namespaces;
use crate::protocol::standby;
use crate::runtime::liveness::Owner;
use crate::storage::installed;
use pgrx::pg_sys;

/// The body of every SQL function: refused (55000) while this database's pg_once objects
/// are of another version than this library (storage::installed), and raising errors
/// without a Rust backtrace (errors::plain).
fn body<R>(f: impl FnOnce() -> R) -> R {
    errors::plain(|| {
        installed::require_matching_version();
        f()
    })
}

/// The key a call names: checked (args::key), and one the caller may use (42501 for a key
/// of a namespace whose owner the caller is not a member of). `function` names the call
/// in a refusal.
fn usable_key<'a>(key: Option<&'a str>, function: &str) -> Key<'a> {
    let text = args::key(key);
    namespaces::require_key(text, function);
    Key::new(text)
}

/// Who a claim_key or claim_next call claims for (`owner_pid`). On a standby nothing is
/// claimed, and a pid there names a backend of the primary, which this server cannot
/// check: the argument is not judged, so that hits are served whatever it says.
fn claim_owner(owner_pid: Option<i32>) -> Owner {
    if standby::active() {
        Owner::LeaseOnly
    } else {
        Owner::from_arg(owner_pid)
    }
}

/// A waiting call needs to see other sessions' commits, which a REPEATABLE READ or
/// SERIALIZABLE snapshot never shows: it would always wait out its full time.
fn refuse_wait_under_snapshot_isolation(function: &str) {
    // SAFETY: reads the current transaction's isolation level.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        errors::not_supported(
            format!("{function} cannot wait inside a REPEATABLE READ or SERIALIZABLE transaction"),
            &format!("Call {function} with wait in its own READ COMMITTED transaction (autocommit), or pass wait => '0'."),
        );
    }
}
