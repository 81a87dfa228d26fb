//! once.cached's keys: the rows of a query are kept under the caller's key bound to what
//! produced them, so that nobody is served rows they could not have computed.
//!
//! A cached query result is only as public as the query: another role, or the same role
//! with another query text or another search_path (which decides what its names mean),
//! must never be handed it. So once.cached keeps it under
//! `KEY#cached:ROLE:DIGEST`: the caller's key, then the OID of the role that ran the
//! query, then the SHA-256 of the schemas its search_path resolves to and the query text. Two different
//! (role, search_path, query) never share an entry, and the entry's key says whose it is:
//! such a key is usable only by that role (and administrators), through once.cached or
//! any other function (protocol::namespace::require_key), so a role that guesses the
//! key still gets 42501.
//!
//! The query must be one SELECT (or VALUES, TABLE): once.cached runs it inside a subquery
//! and, on every later hit, plans it again to check that the role may still run it
//! (privileges revoked since are honoured). A string with a second statement would run
//! that statement too, each time.

use crate::errors;
use crate::key;
use crate::protocol::namespace;
use pgrx::pg_sys;
use std::ffi::CString;

/// The key once.cached keeps `query`'s rows under, for the calling role and the schemas
/// its search_path resolves to.
pub fn key_for(key: &str, query: &str) -> String {
    require_one_select(query);
    let query = query.trim();
    // The schemas the names resolve in, by OID, pg_temp and pg_catalog included where
    // they apply (current_schemas(true)): the path's text would let a session's own
    // temporary table, found first, poison the rows every other session is served.
    // SAFETY: fetch_search_path returns a fresh List of OIDs in the current context.
    let schemas: Vec<String> = unsafe {
        let list = pg_sys::fetch_search_path(true);
        pgrx::PgList::<std::ffi::c_void>::from_pg(list)
            .iter_oid()
            .map(|oid| oid.to_u32().to_string())
            .collect()
    };
    // The schema list first, on a line of its own (digits and commas only), so that no
    // list and query can read as another pair.
    let bound = format!("{}\n{query}", schemas.join(","));
    let digest: String = key::sha256_hex(bound.as_bytes());
    format!(
        "{key}{}{}:{digest}",
        namespace::CACHED_MARK,
        namespace::caller().to_u32()
    )
}

/// Raise 42601 unless `query` is exactly one SELECT statement (or VALUES, TABLE); a
/// syntax error is raised as the parser raises it.
fn require_one_select(query: &str) {
    let text = CString::new(query).unwrap_or_else(|_| {
        errors::invalid_argument(
            "query must not contain a NUL character".into(),
            "Pass the text of one SELECT statement.",
        )
    });
    // SAFETY: the raw parser reads a NUL-terminated string and returns a List of RawStmt
    // allocated in the current memory context.
    let one_select = unsafe {
        let statements = pg_sys::raw_parser(text.as_ptr(), pg_sys::RawParseMode::RAW_PARSE_DEFAULT);
        let statements = pgrx::PgList::<pg_sys::RawStmt>::from_pg(statements);
        statements.len() == 1
            && statements.get_ptr(0).is_some_and(|raw| {
                let stmt = (*raw).stmt;
                !stmt.is_null()
                    && (*stmt).type_ == pg_sys::NodeTag::T_SelectStmt
                    && (*stmt.cast::<pg_sys::SelectStmt>()).intoClause.is_null()
            })
    };
    if !one_select {
        errors::syntax_error(
            "query must be exactly one SELECT statement".into(),
            "once.cached caches the rows of one query: pass one SELECT (or VALUES, TABLE) without a trailing second statement or SELECT INTO.",
        );
    }
}
