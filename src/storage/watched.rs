//! Per-backend copies of small tables that every call consults (the namespaces, each
//! queue's namespace), and when to drop them. A change to such a table sends a relcache
//! invalidation (its statement trigger, once_internal.namespaces_changed), which every
//! backend sees at its next transaction; the callback registered here turns it into a
//! flag that the copy's owner checks before each use.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::Cell;
use std::ffi::CStr;

/// A table whose per-backend copy is dropped when it changes. Keep one in a
/// `thread_local!` and ask `changed` before using the copy.
pub struct Watched {
    schema: &'static CStr,
    name: &'static CStr,
    /// Created at the first use and never freed: the invalidation callback's argument
    /// for the rest of the backend's life.
    state: Cell<Option<&'static State>>,
}

struct State {
    table: Cell<pg_sys::Oid>,
    /// Set by the callback, which may run while the copy is borrowed (a role-membership
    /// lookup can process invalidations), so it only sets this flag.
    changed: Cell<bool>,
}

impl Watched {
    pub const fn new(schema: &'static CStr, name: &'static CStr) -> Watched {
        Watched {
            schema,
            name,
            state: Cell::new(None),
        }
    }

    /// Whether the table changed since the last call that said so (true at the first
    /// call): then drop the copy and read the table again.
    pub fn changed(&self) -> bool {
        let state = self.state.get().unwrap_or_else(|| {
            let state: &'static State = Box::leak(Box::new(State {
                table: Cell::new(pg_sys::InvalidOid),
                changed: Cell::new(true),
            }));
            // SAFETY: registers a callback for the lifetime of the backend, with an
            // argument that lives as long; it only sets a flag, as a callback must.
            unsafe {
                pg_sys::CacheRegisterRelcacheCallback(
                    Some(forget),
                    pg_sys::Datum::from(state as *const State),
                )
            };
            self.state.set(Some(state));
            state
        });
        // Take in invalidations committed since this transaction last did: PostgreSQL
        // does only when it takes a lock it does not hold yet, so a transaction that
        // already holds its locks would otherwise keep a copy older than a committed
        // change (a namespace created meanwhile) until it ends. Cheap when none is queued
        // (one unlocked read of shared memory).
        // SAFETY: processes queued invalidation messages, as any lock acquisition does.
        unsafe { pg_sys::AcceptInvalidationMessages() };
        if !state.changed.replace(false) {
            return false;
        }
        // Looked up again each time: the extension may have been dropped and created
        // again, with a new table.
        // SAFETY: catalog lookups by name.
        state.table.set(unsafe {
            let schema = pg_sys::get_namespace_oid(self.schema.as_ptr(), true);
            pg_sys::get_relname_relid(self.name.as_ptr(), schema)
        });
        true
    }
}

/// A relcache invalidation of the watched table (or of every relation).
#[pg_guard]
unsafe extern "C-unwind" fn forget(arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: the argument Watched::changed registered, never freed.
    let state = unsafe { &*arg.cast_mut_ptr::<State>() };
    if relid == pg_sys::InvalidOid || relid == state.table.get() {
        state.changed.set(true);
    }
}
