//! Functions the extension's own SQL calls (listed under "Internal functions" in
//! docs/sql-reference.md): not part of the protocol's surface.

use crate::protocol::namespace;
use crate::runtime::guc::{self, NotifyMode};
use crate::runtime::{liveness, shmem};
use crate::storage::{entry, installed, tokens};
use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// The owner-gone test of the protocol's statements (protocol/sql/rules/owner_gone.sql).
#[pg_extern(sql = false)]
fn backend_alive(pid: Option<i32>, started: Option<TimestampWithTimeZone>) -> Option<bool> {
    Some(liveness::backend_alive(pid?, started?.into_inner()))
}

/// The next fencing token (storage::tokens): what every claim's row gets.
#[pg_extern(sql = false)]
fn next_token() -> i64 {
    // Called inside claims' statements: an error (a statement timeout while it moves the
    // sequence up) went on to the caller with a Rust backtrace as its detail.
    crate::errors::plain(tokens::next)
}

/// claim_next's filter: see storage::entry::taken.
#[pg_extern(sql = false)]
fn row_taken(tid: Option<pg_sys::ItemPointerData>) -> Option<bool> {
    Some(entry::taken(tid?))
}

/// Whether the caller may use `key` (namespaces): the filter of the views and of
/// invalidate_keys. Also true for a namespace's own prefix exactly when the caller may use
/// the namespace (a queue's namespace is checked that way).
#[pg_extern(sql = false)]
fn may_use_key(key: Option<&str>) -> Option<bool> {
    Some(namespace::admits_key(key?))
}

/// Whether the caller administers pg_once (namespace::caller_administers): once.stats
/// shows it the token sequence's value.
#[pg_extern(sql = false)]
fn caller_administers() -> bool {
    namespace::caller_administers()
}

/// The prefix of the namespace `key` belongs to (NULL: none).
#[pg_extern(sql = false)]
fn key_namespace(key: Option<&str>) -> Option<String> {
    namespace::prefix_of(key?)
}

/// What a key's counts are kept under in once_internal.key_counts (protocol::counts::label):
/// its namespace's prefix, and its role for a once.cached key.
#[pg_extern(sql = false)]
fn key_count_label(key: Option<&str>) -> Option<String> {
    Some(crate::protocol::counts::label(key?))
}

/// How pg_once runs in this server, and its counters since start as a jsonb object keyed
/// by once.stats column (NULL without shared memory). Feeds the once.stats view.
///
/// Named for the release of its signature: 0.1.0's runtime() returned the counters as
/// bigint[] (symbol runtime_wrapper). A declaration of one release must never reach code
/// of another that returns a different type (CONTRIBUTING.md, "Upgrades").
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn runtime_0_2() -> TableIterator<
    'static,
    (
        name!(shared_memory, bool),
        name!(notify, String),
        name!(workers, Option<i32>),
        name!(counters, Option<pgrx::JsonB>),
    ),
> {
    TableIterator::once(super::body(runtime))
}

/// runtime_0_2's one row.
fn runtime() -> (bool, String, Option<i32>, Option<pgrx::JsonB>) {
    let shared = shmem::shared();
    let notify = match guc::NOTIFY.get() {
        NotifyMode::Relay if shared.is_some() => "relay",
        NotifyMode::Off => "off",
        _ => "direct",
    };
    // By name, so that once.stats reads each counter by its column name.
    let counters = shmem::counters().map(|values| {
        let named = shmem::COUNTER_COLUMNS
            .iter()
            .zip(values)
            .map(|(&column, value)| (column.to_owned(), serde_json::Value::from(value)));
        pgrx::JsonB(serde_json::Value::Object(named.collect()))
    });
    // SAFETY: MyDatabaseId is set once connected.
    let database = unsafe { pg_sys::MyDatabaseId };
    (
        shared.is_some(),
        notify.to_owned(),
        // The worker serving this database (0 or 1): the others serve other databases.
        shared.map(|s| s.workers_serving(database)),
        counters,
    )
}

/// The version of the library loaded in this session. Every install and upgrade script
/// declares this function first and calls it, so that a script never runs against an
/// older library (one without this symbol) and every backend's version check is reset
/// (storage::installed). Not checked against the installed version: it is how that
/// difference is told.
#[pg_extern(sql = false)]
fn library_version() -> &'static str {
    installed::LIBRARY_VERSION
}

/// Count every key again (protocol::counts::recount): after the namespaces change, or
/// writes made with triggers disabled.
#[pg_extern(sql = false)]
fn recount_keys() {
    crate::protocol::counts::recount();
}

/// What this session's transaction changed in the counts of keys, not written yet
/// (protocol::counts): once.stats adds it to once_internal.key_counts.
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn pending_key_counts() -> TableIterator<
    'static,
    (
        name!(namespace, String),
        name!(queued, i64),
        name!(done, i64),
        name!(failed, i64),
        name!(errors, i64),
        name!(attempts, i64),
    ),
> {
    TableIterator::new(
        crate::protocol::counts::pending()
            .into_iter()
            .map(|(prefix, [q, d, f, e, a])| (prefix, q, d, f, e, a)),
    )
}
