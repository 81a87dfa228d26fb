//! Where pg_once's SQL objects live: the API in schema `once` (the control file's), and
//! what only pg_once itself calls or reads in `once_internal`, out of the way of `\df
//! once.*` (sql/schema.sql says what goes there and why nobody is granted USAGE on it).
//! Every statement in Rust that names an internal object takes the schema from here; the
//! statement files of protocol/sql/, plain SQL, write it out (`once_internal.name`).

use std::ffi::CStr;

/// The internal schema's name, as a literal for `concat!`.
macro_rules! internal_schema {
    () => {
        "once_internal"
    };
}

/// An object of the internal schema as SQL text: `internal!("token_seq")` is
/// `once_internal.token_seq`. A literal, so that statements can `concat!` it.
macro_rules! internal {
    ($name:literal) => {
        concat!(internal_schema!(), ".", $name)
    };
}

/// The internal schema's name, for catalog lookups by name.
pub const INTERNAL: &CStr =
    match CStr::from_bytes_with_nul(concat!(internal_schema!(), "\0").as_bytes()) {
        Ok(name) => name,
        Err(_) => panic!("the schema name has no NUL inside"),
    };

/// The API's schema (the control file's `schema`), for catalog lookups by name.
pub const API: &CStr = c"once";
