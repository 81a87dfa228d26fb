//! Per-backend copies of what every call consults and rarely changes, and when to drop
//! them: the one mechanism for each such copy (the namespaces, each queue's namespace,
//! once.entries' OIDs and attribute numbers, the token sequence and its floor, the
//! version check).
//!
//! A change to what a copy was read from sends an invalidation that every backend sees at
//! its next transaction, or sooner when it takes a lock it does not hold yet: a relcache
//! invalidation for a table or index (DDL, or the statement trigger
//! once_internal.namespaces_changed of a table whose rows are kept), a syscache one for a
//! system catalog's rows. The callback registered here turns it into a flag, and the copy
//! is dropped and read again at its next use.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::ffi::CStr;

/// How many relations one copy may be read from (once.entries and its primary key).
const MAX_RELATIONS: usize = 2;

/// A per-backend copy of `T`, dropped when what it was read from changes. Keep one in a
/// `thread_local!`; `get` reads the copy again when it was dropped. `Watched` alone
/// (`Watched<()>`, made by `new`) watches a table's rows for a copy kept elsewhere, which
/// asks `changed` before each use.
pub struct Watched<T = ()> {
    catalog: Option<pg_sys::SysCacheIdentifier::Type>,
    /// The table `new` names, looked up again after each change: the extension may have
    /// been dropped and created again, with a new table.
    table: Option<(&'static CStr, &'static CStr)>,
    copy: RefCell<Option<T>>,
    /// Created at the first use and never freed: the invalidation callback's argument
    /// for the rest of the backend's life.
    state: Cell<Option<&'static State>>,
}

struct State {
    /// The relations the copy was read from (InvalidOid: none).
    relations: Cell<[pg_sys::Oid; MAX_RELATIONS]>,
    /// Set by the callback, which may run while the copy is borrowed or being read (a
    /// role-membership lookup, or any lock taken for the first time, can process
    /// invalidations), so it only sets this flag: the copy is dropped at its next use.
    dropped: Cell<bool>,
}

impl<T: Clone> Watched<T> {
    /// A copy dropped on a relcache invalidation of a relation it was read from (`get`
    /// and `keep` name them).
    pub const fn of_relations() -> Watched<T> {
        Watched::watching(None, None)
    }

    /// A copy dropped when any row of a system catalog changes (PROCOID: any function
    /// declared, replaced or dropped).
    pub const fn of_catalog(cache: pg_sys::SysCacheIdentifier::Type) -> Watched<T> {
        Watched::watching(Some(cache), None)
    }

    const fn watching(
        catalog: Option<pg_sys::SysCacheIdentifier::Type>,
        table: Option<(&'static CStr, &'static CStr)>,
    ) -> Watched<T> {
        Watched {
            catalog,
            table,
            copy: RefCell::new(None),
            state: Cell::new(None),
        }
    }

    /// The copy, read and kept first when there is none: `read` returns it with the
    /// relations it was read from.
    pub fn get<const N: usize>(&self, read: impl FnOnce() -> (T, [pg_sys::Oid; N])) -> T {
        if let Some(copy) = self.kept() {
            return copy;
        }
        let (copy, relations) = read();
        self.keep(copy.clone(), relations);
        copy
    }

    /// The copy, unless there is none or what it was read from changed since it was kept.
    pub fn kept(&self) -> Option<T> {
        let state = self.state();
        if state.dropped.replace(false) {
            self.copy.replace(None);
            return None;
        }
        self.copy.borrow().clone()
    }

    /// Keep `copy`, read from `relations`, until one of them changes (or, for a
    /// catalog's copy, any of its rows). A change while it was being read, since the
    /// `kept` that found none, drops it at its next use.
    pub fn keep<const N: usize>(&self, copy: T, relations: [pg_sys::Oid; N]) {
        const { assert!(N <= MAX_RELATIONS) };
        let mut kept = [pg_sys::InvalidOid; MAX_RELATIONS];
        kept[..N].copy_from_slice(&relations);
        self.state().relations.set(kept);
        self.copy.replace(Some(copy));
    }

    fn state(&self) -> &'static State {
        if let Some(state) = self.state.get() {
            return state;
        }
        let state: &'static State = Box::leak(Box::new(State {
            relations: Cell::new([pg_sys::InvalidOid; MAX_RELATIONS]),
            dropped: Cell::new(false),
        }));
        let arg = pg_sys::Datum::from(state as *const State);
        // SAFETY: registers a callback for the lifetime of the backend, with an argument
        // that lives as long; it only sets a flag, as a callback must (no catalog access).
        unsafe {
            match self.catalog {
                Some(cache) => {
                    pg_sys::CacheRegisterSyscacheCallback(cache as i32, Some(catalog_changed), arg)
                }
                None => pg_sys::CacheRegisterRelcacheCallback(Some(relation_changed), arg),
            }
        };
        self.state.set(Some(state));
        state
    }
}

impl Watched<()> {
    /// Table `schema.name`, whose rows other sessions change, for a copy kept elsewhere.
    pub const fn new(schema: &'static CStr, name: &'static CStr) -> Watched {
        Watched::watching(None, Some((schema, name)))
    }

    /// Whether the table changed since the last call that said so (true at the first
    /// call): then drop the copy and read the table again.
    pub fn changed(&self) -> bool {
        // Take in invalidations committed since this transaction last did: PostgreSQL
        // does only when it takes a lock it does not hold yet, so a transaction that
        // already holds its locks would otherwise keep a copy older than a committed
        // change (a namespace created meanwhile) until it ends. Cheap when none is queued
        // (one unlocked read of shared memory). Copies of relations' definitions need not:
        // DDL's lock conflicts with every use of them.
        // SAFETY: processes queued invalidation messages, as any lock acquisition does.
        unsafe { pg_sys::AcceptInvalidationMessages() };
        if self.kept().is_some() {
            return false;
        }
        // SAFETY: catalog lookups by name.
        let table = self
            .table
            .map_or(pg_sys::InvalidOid, |(schema, name)| unsafe {
                let schema = pg_sys::get_namespace_oid(schema.as_ptr(), true);
                pg_sys::get_relname_relid(name.as_ptr(), schema)
            });
        self.keep((), [table]);
        true
    }
}

/// A relcache invalidation of one relation (or of every relation: InvalidOid).
#[pg_guard]
unsafe extern "C-unwind" fn relation_changed(arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: the argument Watched::state registered, never freed.
    let state = unsafe { &*arg.cast_mut_ptr::<State>() };
    if relid == pg_sys::InvalidOid || state.relations.get().contains(&relid) {
        state.dropped.set(true);
    }
}

/// A syscache invalidation of one of a catalog's rows (or of all of them).
#[pg_guard]
unsafe extern "C-unwind" fn catalog_changed(arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    // SAFETY: the argument Watched::state registered, never freed.
    let state = unsafe { &*arg.cast_mut_ptr::<State>() };
    state.dropped.set(true);
}
