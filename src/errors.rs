//! Errors pg_once raises. Every one carries a specific SQLSTATE, a message that names the
//! offending argument, and a hint that says what to do instead. Raising aborts the
//! statement, so nothing the call would have changed is changed.

use pgrx::pg_sys::panic::ErrorReport;
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

/// 0A000: the call cannot work in the caller's transaction.
pub fn not_supported(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED, message, hint)
}

/// 42704: a named object (a queue) does not exist.
pub fn undefined_object(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT, message, hint)
}

/// 42501: the current role may not do this.
pub fn insufficient_privilege(message: String, hint: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        message,
        hint,
    )
}

/// 55006: the object is still in use (a queue that still has keys).
pub fn object_in_use(message: String, hint: &str) -> ! {
    raise(PgSqlErrorCode::ERRCODE_OBJECT_IN_USE, message, hint)
}
