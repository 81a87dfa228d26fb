//! Namespaces: key prefixes that belong to a role.
//!
//! A namespace is a row of once_internal.namespace_owners: every key that starts with its prefix
//! belongs to it (the longest registered prefix wins), and only members of its owner role
//! (and superusers) may use those keys: claim, read, complete, fail, heartbeat, release,
//! invalidate or enqueue them. A queue may belong to a namespace too (once.queues.namespace);
//! then only members may take its keys with claim_next, enqueue into it, or drop it.
//! Keys outside every namespace are shared by every role granted pg_once, as before.
//!
//! Who is asking: the functions are SECURITY DEFINER, so the current user inside them is the
//! extension's owner. The caller is the "outer" user, which SECURITY DEFINER leaves alone
//! and SET ROLE changes: what current_user was when the caller called. (A caller's own
//! SECURITY DEFINER function calling pg_once is checked as the role that called it.)
//!
//! Cost: the registered namespaces are read once per backend and kept, sorted longest
//! prefix first, until once_internal.namespace_owners changes (its trigger sends a relcache
//! invalidation that every backend sees at its next transaction). With no namespace a
//! check is one empty-list test; with some, a prefix comparison per namespace and, for a
//! key inside one, PostgreSQL's cached role-membership test.

use crate::errors;
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

/// The role on whose behalf pg_once is being called (see the module comment).
fn caller() -> pg_sys::Oid {
    // SAFETY: reads a backend global.
    unsafe { pg_sys::GetOuterUserId() }
}

// Schema-qualified throughout: may_use_key (views) runs it with the caller's
// search_path, and the plan is kept for the backend's life.
static LOAD: Statement = Statement::new(concat!(
    "SELECT prefix, owner::pg_catalog.oid AS owner, notify FROM ",
    internal!("namespace_owners"),
    " ORDER BY pg_catalog.length(prefix) DESC, prefix"
));

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
    // may_use_key runs as the caller, who may not read the table: read it as its
    // owner, as PostgreSQL's own internal lookups do (e.g. foreign-key checks).
    let _owner = AsTableOwner::become_();
    let namespaces = statements::run(&LOAD, params![], |table| {
        table
            .map(|row| {
                Ok(Namespace {
                    prefix: row.get_by_name("prefix")?.expect("prefix is NOT NULL"),
                    owner: row.get_by_name("owner")?.expect("owner is NOT NULL"),
                    payload: match row.get_by_name::<String, _>("notify")?.as_deref() {
                        Some("key") => Payload::Key,
                        _ => Payload::Digest,
                    },
                })
            })
            .collect::<pgrx::spi::Result<Vec<_>>>()
    });
    CACHE.with_borrow_mut(|cache| *cache = Some(namespaces));
}

/// Raise 42501 unless the caller may use `key` (`what` says what was refused).
pub fn require_key(key: &str, what: &str) {
    with_namespace_of(key, |namespace| match namespace {
        Some(n) if !n.admits_caller() => n.refuse(what),
        _ => {}
    });
}

/// Whether the caller may use `key` (for filters: views, invalidate_keys).
pub fn admits_key(key: &str) -> bool {
    with_namespace_of(key, |namespace| {
        namespace.is_none_or(Namespace::admits_caller)
    })
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

/// Run as the owner of once_internal.namespace_owners until dropped (SECURITY_LOCAL_USERID_CHANGE:
/// nothing the caller set with SET ROLE or SET SESSION AUTHORIZATION changes meanwhile).
struct AsTableOwner {
    user: pg_sys::Oid,
    context: i32,
}

impl AsTableOwner {
    fn become_() -> AsTableOwner {
        // SAFETY: save the current user and switch to the extension's owner, the owner of
        // its tables; restored in Drop, and by PostgreSQL itself if an error aborts.
        unsafe {
            let mut saved = AsTableOwner {
                user: pg_sys::InvalidOid,
                context: 0,
            };
            pg_sys::GetUserIdAndSecContext(&mut saved.user, &mut saved.context);
            let owner = extension_owner();
            pg_sys::SetUserIdAndSecContext(
                owner,
                saved.context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32,
            );
            saved
        }
    }
}

impl Drop for AsTableOwner {
    fn drop(&mut self) {
        // SAFETY: restores what become_ saved.
        unsafe { pg_sys::SetUserIdAndSecContext(self.user, self.context) };
    }
}

/// The OID of once_internal.namespace_owners.
fn namespace_owners() -> pg_sys::Oid {
    // SAFETY: catalog lookups by name.
    unsafe {
        let schema = pg_sys::get_namespace_oid(crate::schema::INTERNAL.as_ptr(), false);
        pg_sys::get_relname_relid(c"namespace_owners".as_ptr(), schema)
    }
}

/// The role that owns the pg_once extension (and so its tables).
fn extension_owner() -> pg_sys::Oid {
    let table = namespace_owners();
    // SAFETY: a syscache lookup; an installed extension's table has an owner.
    unsafe {
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(table),
        );
        if tuple.is_null() {
            error!(concat!(
                "pg_once: relation ",
                internal!("namespace_owners"),
                " is missing; reinstall the extension"
            ));
        }
        let class = pg_sys::GETSTRUCT(tuple).cast::<pg_sys::FormData_pg_class>();
        let owner = (*class).relowner;
        pg_sys::ReleaseSysCache(tuple);
        owner
    }
}

/// Raise 42501 unless the caller is a superuser or a member of the extension's owner:
/// namespaces decide who may use which keys, so only the extension's administrators may
/// define them (applications are usually granted EXECUTE on every function).
fn require_administrator(function: &str) {
    let caller = caller();
    // SAFETY: role lookups in the (cached) catalogs.
    let allowed = unsafe {
        pg_sys::superuser_arg(caller) || pg_sys::has_privs_of_role(caller, extension_owner())
    };
    if !allowed {
        errors::insufficient_privilege(
            format!("permission denied for function once.{function}"),
            "Namespaces are defined by a superuser or a member of the role that owns the pg_once extension.",
        );
    }
}

static UPSERT: Statement = Statement::new(concat!(
    "INSERT INTO ",
    internal!("namespace_owners"),
    " (prefix, owner, notify)
     VALUES ($prefix, $owner::regrole, $notify)
     ON CONFLICT (prefix) DO UPDATE SET owner = EXCLUDED.owner, notify = EXCLUDED.notify"
));

static DELETE: Statement = Statement::new(concat!(
    "DELETE FROM ",
    internal!("namespace_owners"),
    " WHERE prefix = $prefix"
));

static KEYS_IN: Statement = Statement::new(concat!(
    "SELECT count(*) FROM once.entries
      WHERE left(key, length($prefix)) = $prefix AND ",
    internal!("key_namespace"),
    "(key) = $prefix"
));

static QUEUES_IN: Statement = Statement::new(
    "SELECT string_agg(name, ', ' ORDER BY name) FROM once.queues WHERE namespace = $prefix",
);

/// once.create_namespace: register (or change) the namespace `prefix`.
pub fn create(prefix: &str, owner: pg_sys::Oid, payload: Payload) {
    require_administrator("create_namespace");
    let notify = match payload {
        Payload::Key => "key",
        Payload::Digest => "digest",
    };
    let args = params![prefix = prefix, owner = owner, notify = notify];
    statements::run(&UPSERT, args, |_| Ok(()));
}

/// once.drop_namespace: forget the namespace `prefix`, which must own no key and no queue
/// (they would silently become shared by every role).
pub fn remove(prefix: &str) -> bool {
    require_administrator("drop_namespace");
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

/// Trigger on once_internal.namespace_owners: every backend's kept copy is out of date.
#[pg_trigger(sql = false)]
fn namespaces_changed<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    let table = trigger.relid().unwrap_or_else(|e| error!("pg_once: {e}"));
    // SAFETY: queues a relcache invalidation, sent to every backend at commit.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(table) };
    Ok(None)
}
