//! Errors pg_once raises. Every one carries a specific SQLSTATE, a message that names the
//! offending argument, and a hint that says what to do instead. Raising aborts the
//! statement, so nothing the call would have changed is changed.

use pgrx::pg_sys::panic::{CaughtError, ErrorReport};
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// Raise an ERROR with `code`, `message` and `hint`.
pub fn raise(code: PgSqlErrorCode, message: String, hint: &str) -> ! {
    ErrorReport::new(code, message, "pg_once")
        .set_hint(hint)
        .report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// 22004: a required argument was SQL NULL.
pub fn null_argument(name: &str, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
        format!("{name} must not be NULL"),
        hint,
    )
}

/// 22023: an argument is out of its documented range.
pub fn invalid_argument(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
        message,
        hint,
    )
}

/// 22001: a key is longer than the documented limit.
pub fn too_long(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_STRING_DATA_RIGHT_TRUNCATION,
        message,
        hint,
    )
}

/// 54000: a value is larger than a documented limit (a result past once.max_result_size).
pub fn limit_exceeded(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
        message,
        hint,
    )
}

/// 0A000: the call cannot work in the caller's transaction.
pub fn not_supported(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED, message, hint)
}

/// 55P03: a lock could not be had within the time the call gives it.
pub fn lock_not_available(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, message, hint)
}

/// 42704: a named object (a queue) does not exist.
pub fn undefined_object(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT, message, hint)
}

/// 42601: a query once.cached is given is not the one statement it caches.
pub fn syntax_error(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_SYNTAX_ERROR, message, hint)
}

/// 42501: the current role may not do this.
pub fn insufficient_privilege(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        message,
        hint,
    )
}

/// 55000: the call cannot run in the state the database is in (pg_once's SQL objects and
/// its library are of different versions).
pub fn object_not_in_prerequisite_state(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        message,
        hint,
    )
}

/// 55006: the object is still in use (a queue that still has keys).
pub fn object_in_use(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_OBJECT_IN_USE, message, hint)
}

/// 25006: the call would write, and this server is a hot standby, where nothing can be
/// written (as PostgreSQL refuses any write there).
pub fn read_only(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
        message,
        hint,
    )
}

/// Raise again an error caught on its way through Rust code, as PostgreSQL raised it (its
/// SQLSTATE, message, detail and hint) and nothing more. pgrx would otherwise attach the
/// Rust backtrace of where the error crossed into Rust to the DETAIL line whenever the
/// server runs with RUST_BACKTRACE set: a cancelled claim_key would send a client dozens of
/// lines of our call stack instead of PostgreSQL's one-line 57014.
pub fn reraise(caught: CaughtError) -> ! {
    match caught {
        CaughtError::PostgresError(report) => {
            let mut again = ErrorReport::new(
                report.sql_error_code(),
                report.message().to_owned(),
                "pg_once",
            );
            if let Some(detail) = report.detail() {
                again = again.set_detail(detail);
            }
            if let Some(hint) = report.hint() {
                again = again.set_hint(hint);
            }
            again.report(PgLogLevel::ERROR);
            unreachable!("ERROR does not return")
        }
        other => other.rethrow(),
    }
}

/// Run `f`, raising any PostgreSQL error that crosses it the way `reraise` does. Every SQL
/// function runs inside this, so no error pg_once reports carries a Rust backtrace.
pub fn plain<R>(f: impl FnOnce() -> R) -> R {
    pgrx::PgTryBuilder::new(std::panic::AssertUnwindSafe(f))
        .catch_others(|caught| reraise(caught))
        .execute()
}
