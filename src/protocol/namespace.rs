//! Namespaces: key prefixes that belong to a role.
//!
//! A namespace is a row of once_internal.namespace_owners: every key that starts with its prefix
//! belongs to it (the longest registered prefix wins), and only members of its owner role
//! (and superusers) may use those keys: claim, read, complete, fail, heartbeat, release,
//! invalidate or enqueue them. A queue may belong to a namespace too (once.queues.namespace);
//! then only members may take its keys with claim_next, enqueue into it, or drop it.
//! Keys outside every namespace are shared by every role granted pg_once, as before.
//!
//! Who is asking: the current user, `GetUserId()`, as PostgreSQL's own privilege checks
//! judge it. pg_once's C functions are not SECURITY DEFINER (storage::statements takes the
//! owner's rights for their statements only), so it is the role that called them: `SET
//! ROLE` changes it, and code owned by one role that runs in another's session (a SECURITY
//! DEFINER function, an index expression evaluated by ANALYZE or autovacuum, a
//! materialized view refreshed by someone else) is judged as the role that owns the code,
//! never as the session's user (docs/security.md).
//!
//! Cost: the registered namespaces are read once per backend and kept, sorted longest
//! prefix first, until once_internal.namespace_owners changes (its trigger sends a relcache
//! invalidation, which every backend takes in before its next check, even inside an open
//! transaction: storage::watched). With no namespace a check is one empty-list test; with
//! some, a prefix comparison per namespace and, for a key inside one, PostgreSQL's cached
//! role-membership test. The read takes no lock past itself (see `read_all`).

use crate::errors;
use crate::runtime::wait;
use crate::storage::statements::{self, params, Statement};
use crate::storage::watched::Watched;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;

/// What a namespace's keys are announced as on channel `once`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Payload {
    /// The key itself.
    Key,
    /// The hex SHA-256 of the key (`encode(once.key_hash(key), 'hex')`): a client waiting
    /// for a key computes it from the key; a listener without rights learns nothing.
    Digest,
}

/// A registered namespace.
pub struct Namespace {
    pub prefix: String,
    pub owner: pg_sys::Oid,
    pub payload: Payload,
}

impl Namespace {
    /// Whether the calling role may use this namespace's keys and queues.
    pub fn admits_caller(&self) -> bool {
        // SAFETY: has_privs_of_role reads the (cached) role-membership graph.
        unsafe { pg_sys::has_privs_of_role(caller(), self.owner) }
    }

    fn refuse(&self, what: &str) -> ! {
        // SAFETY: GetUserNameFromId with noerr = true returns NULL for a dropped role.
        let owner = unsafe {
            let name = pg_sys::GetUserNameFromId(self.owner, true);
            if name.is_null() {
                format!("role {}", self.owner.to_u32())
            } else {
                std::ffi::CStr::from_ptr(name)
                    .to_string_lossy()
                    .into_owned()
            }
        };
        errors::insufficient_privilege(
            format!("permission denied for namespace \"{}\": {what}", self.prefix),
            &format!(
                "Keys and queues of namespace \"{}\" belong to role {owner}: call as a member of it (GRANT {owner} TO ...).",
                self.prefix
            ),
        )
    }
}

/// The role pg_once is being called by (see the module comment).
pub fn caller() -> pg_sys::Oid {
    statements::calling_user().0
}

thread_local! {
    /// The registered namespaces, longest prefix first; None until read.
    static CACHE: RefCell<Option<Vec<Namespace>>> = const { RefCell::new(None) };
    /// once_internal.namespace_owners: when it changes, the cache is read again.
    static NAMESPACE_OWNERS: Watched = const { Watched::new(crate::schema::INTERNAL, c"namespace_owners") };
}

/// Run `f` on the namespace `text` (a key or a queue's namespace name) belongs to, if any.
fn with_namespace_of<R>(text: &str, f: impl FnOnce(Option<&Namespace>) -> R) -> R {
    load();
    CACHE.with_borrow(|cache| {
        let namespaces = cache.as_ref().expect("loaded");
        f(namespaces
            .iter()
            .find(|n| text.starts_with(n.prefix.as_str())))
    })
}

fn load() {
    if NAMESPACE_OWNERS.with(Watched::changed) {
        CACHE.with_borrow_mut(|cache| *cache = None);
    }
    if CACHE.with_borrow(Option::is_some) {
        return;
    }
    let mut namespaces = read_all();
    namespaces.sort_by(|a, b| {
        b.prefix
            .len()
            .cmp(&a.prefix.len())
            .then_with(|| a.prefix.cmp(&b.prefix))
    });
    CACHE.with_borrow_mut(|cache| *cache = Some(namespaces));
}

/// Every registered namespace, as the latest committed state has them.
///
/// Read straight from the table rather than by a statement, for two reasons. The latest
/// snapshot, not the transaction's: a REPEATABLE READ transaction that began before a
/// namespace was created must still be refused its keys. And the table's lock is
/// released as soon as the rows are read: a statement's lock would be kept until the
/// transaction ends, which for a waiting claim_key is its whole wait, so that DDL on the
/// table (ALTER EXTENSION UPDATE) would queue behind every waiter and every call behind
/// the DDL. The read checks no privilege: it is pg_once reading its own table for
/// whoever calls it (may_use_key runs as the views' reader).
fn read_all() -> Vec<Namespace> {
    // SAFETY: the table is opened under AccessShareLock and closed (unlocking it) after
    // the scan; the snapshot is registered for the scan's duration; every column read is
    // NOT NULL and of the type read.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let table = pg_sys::table_open(namespace_owners(), lock);
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let scan = pg_sys::systable_beginscan(
            table,
            pg_sys::InvalidOid,
            false,
            snapshot,
            0,
            std::ptr::null_mut(),
        );
        let desc = (*table).rd_att;
        let column = |tuple: pg_sys::HeapTuple, attnum: i32| {
            let mut null = false;
            let datum = pg_sys::heap_getattr(tuple, attnum, desc, &mut null);
            assert!(!null, "namespace_owners' columns are NOT NULL");
            datum
        };
        let mut namespaces = Vec::new();
        loop {
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            // Columns 1 to 3: prefix text, owner regrole, notify text (schema.sql).
            let text = |attnum| {
                String::from_datum(column(tuple, attnum), false).expect("text is NOT NULL")
            };
            namespaces.push(Namespace {
                prefix: text(1),
                owner: pg_sys::Oid::from_datum(column(tuple, 2), false).expect("owner"),
                payload: match text(3).as_str() {
                    "key" => Payload::Key,
                    _ => Payload::Digest,
                },
            });
        }
        pg_sys::systable_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(table, lock);
        namespaces
    }
}

/// Raise 42501 unless the caller may use `key` (`what` says what was refused): a key of a
/// namespace the caller is not a member of, or a once.cached key of another role
/// (protocol::cached).
pub fn require_key(key: &str, what: &str) {
    with_namespace_of(key, |namespace| match namespace {
        Some(n) if !n.admits_caller() => n.refuse(what),
        _ => {}
    });
    if !admits_cached(key) {
        errors::insufficient_privilege(
            format!("permission denied for key \"{key}\": {what}"),
            "once.cached keeps a query's rows under a key of the role that ran the query: only that role (or an administrator) may use it. Call once.cached with your own query.",
        );
    }
}

/// Whether the caller may use `key` (for filters: views, invalidate_keys).
pub fn admits_key(key: &str) -> bool {
    with_namespace_of(key, |namespace| {
        namespace.is_none_or(Namespace::admits_caller)
    }) && admits_cached(key)
}

/// Unless `key` is a once.cached key of another role than the caller's.
fn admits_cached(key: &str) -> bool {
    cached_key_role(key).is_none_or(|role| role == caller() || caller_administers())
}

/// What separates a once.cached key from the caller's key in it.
pub const CACHED_MARK: &str = "#cached:";

/// The role whose once.cached key `key` is, if it is one (see protocol::cached): such a
/// key is that role's alone.
pub fn cached_key_role(key: &str) -> Option<pg_sys::Oid> {
    let at = key.rfind(CACHED_MARK)?;
    let (role, digest) = key[at + CACHED_MARK.len()..].split_once(':')?;
    if digest.len() != 64 {
        return None;
    }
    role.parse::<u32>().ok().map(pg_sys::Oid::from)
}

/// The prefix of the namespace `key` belongs to, if any.
pub fn prefix_of(key: &str) -> Option<String> {
    with_namespace_of(key, |namespace| namespace.map(|n| n.prefix.clone()))
}

/// What to announce on channel `once` for `key`, whose digest is `digest`.
pub fn payload(key: &str, digest: &[u8]) -> String {
    let payload = with_namespace_of(key, |namespace| namespace.map(|n| n.payload));
    match payload {
        Some(Payload::Digest) => digest.iter().map(|b| format!("{b:02x}")).collect(),
        _ => key.to_owned(),
    }
}

/// The registered namespace named exactly `prefix`, as the caller must be allowed to use
/// it (for a queue's namespace): 42704 if there is none, 42501 if the caller may not.
pub fn require_named(prefix: &str, what: &str) {
    let known = with_namespace_of(prefix, |namespace| match namespace {
        Some(n) if n.prefix == prefix => {
            if !n.admits_caller() {
                n.refuse(what);
            }
            true
        }
        _ => false,
    });
    if !known {
        errors::undefined_object(
            format!("namespace \"{prefix}\" does not exist"),
            "Create it first with once.create_namespace(prefix, owner), or pass NULL for a queue shared by every role.",
        );
    }
}

/// The OID of once_internal.namespace_owners.
fn namespace_owners() -> pg_sys::Oid {
    // SAFETY: catalog lookups by name.
    let table = unsafe {
        let schema = pg_sys::get_namespace_oid(crate::schema::INTERNAL.as_ptr(), false);
        pg_sys::get_relname_relid(c"namespace_owners".as_ptr(), schema)
    };
    if table == pg_sys::InvalidOid {
        error!(concat!(
            "pg_once: relation ",
            internal!("namespace_owners"),
            " is missing; reinstall the extension"
        ));
    }
    table
}

/// Whether the caller administers pg_once: a superuser or a member of the extension's
/// owner, acting as itself. Only administrators define namespaces (which decide who may
/// use which keys; applications are usually granted EXECUTE on every function) and
/// change shared queues (which every role's workers serve).
///
/// "As itself": never from a security-restricted operation (an index expression that
/// ANALYZE, autovacuum or CREATE INDEX evaluates, a materialized view's query), where
/// PostgreSQL runs code a table's owner wrote, nor from inside a SECURITY DEFINER
/// function or any other local change of user: code written by one role must not act with
/// the rights of the administrator whose session happens to run it.
pub fn caller_administers() -> bool {
    let (caller, context) = statements::calling_user();
    // What InSecurityRestrictedOperation() and InLocalUserIdChange() say, of the call.
    let borrowed =
        (pg_sys::SECURITY_RESTRICTED_OPERATION | pg_sys::SECURITY_LOCAL_USERID_CHANGE) as i32;
    if context & borrowed != 0 {
        return false;
    }
    // SAFETY: role lookups in the (cached) catalogs.
    unsafe {
        let owner = crate::storage::owner::extension_owner().unwrap_or(pg_sys::InvalidOid);
        pg_sys::superuser_arg(caller) || pg_sys::has_privs_of_role(caller, owner)
    }
}

/// The `$holder` of protocol/sql/rules/token_holder.sql: the caller, whose own claims it
/// may end with their tokens, or None (NULL) for an administrator, who may end any.
pub fn token_holder() -> Option<pg_sys::Oid> {
    (!caller_administers()).then(caller)
}

/// Raise 42501 unless the caller administers pg_once (`caller_administers`).
pub fn require_administrator(what: &str, hint: &str) {
    if !caller_administers() {
        errors::insufficient_privilege(format!("permission denied: {what}"), hint);
    }
}

const NAMESPACES_HINT: &str = "Namespaces are defined by a superuser or a member of the role that owns the pg_once extension, calling the function itself (not from a SECURITY DEFINER function, an index expression or a materialized view).";

// Statement files (protocol::rules) that name no rule, loaded without them as
// PURGE_HANDED_OVER is (see there); in files so that the SQL edition splices them too.
static UPSERT: Statement = Statement::new(include_str!("sql/upsert_namespace.sql"));

static DELETE: Statement = Statement::new(include_str!("sql/delete_namespace.sql"));

static KEYS_IN: Statement = Statement::new(concat!(
    "SELECT count(*) FROM once.entries
      WHERE left(key, length($prefix)) = $prefix AND ",
    internal!("key_namespace"),
    "(key) = $prefix"
));

static QUEUES_IN: Statement = Statement::new(
    "SELECT string_agg(name, ', ' ORDER BY name) FROM once.queues WHERE namespace = $prefix",
);

/// What create_namespace does with keys that already exist under the prefix and would
/// change hands: keys outside every namespace, or of a shorter one, or of this namespace
/// when its owner changes. Any role could have planted them (a completed result, a claim,
/// a long failure), and the namespace's owner would be served them as its own.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Existing {
    /// Refuse (55006) while there are any.
    Refuse,
    /// Delete them first.
    Purge,
    /// Give them to the namespace: the administrator has checked them.
    Adopt,
}

// Keys that would change hands, as `Existing` says. Scans once.entries (no index has the
// key's text): create_namespace is an administrator's rare call.
static HANDED_OVER: Statement = Statement::new(concat!(
    "SELECT count(*) FROM once.entries
      WHERE left(key, length($prefix)) = $prefix
        AND (length(coalesce(",
    internal!("key_namespace"),
    "(key), '')) < length($prefix) OR $owner_changes)"
));

// A statement file (protocol::rules) that names no rule: loaded without them, so that
// namespaces, which the rules consult (claimant_params), do not depend on the rules.
static PURGE_HANDED_OVER: Statement = Statement::new(include_str!("sql/purge_handed_over.sql"));

/// once.create_namespace: register (or change) the namespace `prefix`.
///
/// Race-free against writers: once.entries is locked against writes (SHARE ROW
/// EXCLUSIVE, held until commit) before the existing keys are counted, so a key written
/// under the prefix either committed before the count (and is counted) or is written after
/// this transaction commits, by a call that then sees the namespace (`recheck_key`).
pub fn create(prefix: &str, owner: pg_sys::Oid, payload: Payload, existing: Existing) {
    require_administrator("once.create_namespace", NAMESPACES_HINT);
    lock_against_writes();
    let owner_changes = with_namespace_of(prefix, |namespace| {
        namespace.is_some_and(|n| n.prefix == prefix && n.owner != owner)
    });
    let args = || params![prefix = prefix, owner_changes = owner_changes];
    let keys: i64 = statements::run(&HANDED_OVER, args(), |table| {
        Ok(table.first().get(1)?.unwrap_or(0))
    });
    if keys > 0 {
        match existing {
            Existing::Refuse => errors::object_in_use(
                format!(
                    "{keys} key{} under \"{prefix}\" would become the namespace's",
                    if keys == 1 { "" } else { "s" }
                ),
                "Any role may have written them. Pass existing => 'purge' to delete them first, or existing => 'adopt' to give them to the namespace once you have checked them (SELECT key, state FROM once.entries WHERE key LIKE ...).",
            ),
            Existing::Purge => statements::run(&PURGE_HANDED_OVER, args(), |_| Ok(())),
            Existing::Adopt => {}
        }
    }
    let notify = match payload {
        Payload::Key => "key",
        Payload::Digest => "digest",
    };
    let args = params![prefix = prefix, owner = owner, notify = notify];
    statements::run(&UPSERT, args, |_| Ok(()));
}

/// How long create_namespace waits for transactions that wrote keys to end.
const WRITERS_PATIENCE_MICROS: i128 = 10_000_000;

/// Lock once.entries against writes (storage::entry::try_lock_against_writes), trying
/// again every few milliseconds while transactions that wrote keys are open, for at most
/// WRITERS_PATIENCE: a lock request left waiting in the queue would stop every pg_once
/// write behind it, for as long as the longest open transaction lasts.
fn lock_against_writes() {
    let deadline = wait::now() as i128 + WRITERS_PATIENCE_MICROS;
    while !crate::storage::entry::try_lock_against_writes() {
        if wait::now() as i128 >= deadline {
            errors::lock_not_available(
                "create_namespace could not lock once.entries against writes for 10 s".into(),
                "A transaction that wrote keys is still open (see pg_stat_activity, state 'idle in transaction'): end it, then call create_namespace again.",
            );
        }
        wait::pause(wait::SHORT_POLL_MICROS);
    }
}

/// After a call wrote `key` as a new row: raise 42501 if, meanwhile, the key became a
/// namespace's that the caller may not use (see `create`). The write waited for
/// create_namespace's lock, so its namespace is visible now; the error undoes the write.
pub fn recheck_key(key: &str, what: &str) {
    require_key(key, what);
}

/// once.drop_namespace: forget the namespace `prefix`, which must own no key and no queue
/// (they would silently become shared by every role).
pub fn remove(prefix: &str) -> bool {
    require_administrator("once.drop_namespace", NAMESPACES_HINT);
    // As in `create`: a key a transaction in flight writes under the prefix is counted,
    // and so is a queue being created in the namespace (create_queue checks the namespace
    // again after its write, which waits for this lock).
    lock_against_writes();
    lock_against_new_queues();
    let keys: i64 = statements::run(&KEYS_IN, params![prefix = prefix], |table| {
        Ok(table.first().get(1)?.unwrap_or(0))
    });
    let queues: Option<String> = statements::run(&QUEUES_IN, params![prefix = prefix], |table| {
        table.first().get(1)
    });
    if keys > 0 || queues.is_some() {
        errors::object_in_use(
            match &queues {
                Some(q) => format!("namespace \"{prefix}\" still has {keys} keys and queues {q}"),
                None => format!("namespace \"{prefix}\" still has {keys} keys"),
            },
            &format!(
                "Remove them first (once.invalidate_keys(prefix => '{0}'), once.drop_queue), so that they do not become shared by every role.",
                prefix.replace('\'', "''")
            ),
        );
    }
    statements::run(&DELETE, params![prefix = prefix], |table| {
        Ok(table.len() == 1)
    })
}

/// Lock once.queues against writes until this transaction ends (SHARE ROW EXCLUSIVE):
/// drop_namespace's, so that no queue is created in the namespace between its count of
/// the namespace's queues and its commit. Only create_queue and drop_queue write the
/// table, briefly, so waiting for them holds up nothing else.
pub fn lock_against_new_queues() {
    // SAFETY: catalog lookups by name, then a lock released by the transaction's end.
    unsafe {
        let schema = pg_sys::get_namespace_oid(crate::schema::API.as_ptr(), false);
        let queues = pg_sys::get_relname_relid(c"queues".as_ptr(), schema);
        if queues == pg_sys::InvalidOid {
            error!("pg_once: relation once.queues is missing; reinstall the extension");
        }
        pg_sys::LockRelationOid(queues, pg_sys::ShareRowExclusiveLock as pg_sys::LOCKMODE);
    }
}

/// A table whose rows backends keep a copy of changed (once_internal.namespace_owners,
/// once.queues: the statement trigger once_internal.namespaces_changed): every backend's
/// copy is out of date.
pub fn kept_copies_outdated(table: pg_sys::Oid) {
    // SAFETY: queues a relcache invalidation, sent to every backend at commit.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(table) };
}
