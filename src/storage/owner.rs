//! The role that owns the pg_once extension's objects (once.entries among them), whose
//! rights the statements of every pg_once function run with (statements::as_extension_owner).
//! Its own module, below both: statements run as it, and entry reads rows with statements.

use crate::storage::watched::Watched;
use pgrx::pg_sys;
use pgrx::prelude::*;

thread_local! {
    /// The owner and once.entries, whose changes (ALTER TABLE ... OWNER, DROP and CREATE
    /// EXTENSION) drop the copy.
    static OWNER: Watched<pg_sys::Oid> = const { Watched::of_relations() };
}

/// The extension's owner; None where there is no once.entries: pg_once is not installed
/// in this database (the worker asking whether it is, or CREATE EXTENSION before creating
/// the table). Kept only once found, so that a later CREATE EXTENSION is seen.
pub fn extension_owner() -> Option<pg_sys::Oid> {
    if let Some(known) = OWNER.with(Watched::kept) {
        return Some(known);
    }
    // By name, raising no error when missing: the version check runs a statement before
    // anything else, and must refuse (55000) a database whose once.entries is another
    // version's, not fail here.
    // SAFETY: syscache lookups by name, in a transaction (every caller runs in one).
    let table = unsafe {
        let namespace = pg_sys::get_namespace_oid(crate::schema::API.as_ptr(), true);
        if namespace == pg_sys::InvalidOid {
            return None;
        }
        pg_sys::get_relname_relid(c"entries".as_ptr(), namespace)
    };
    if table == pg_sys::InvalidOid {
        return None;
    }
    let owner = relation_owner(table);
    OWNER.with(|kept| kept.keep(owner, [table]));
    Some(owner)
}

/// The owner of relation `oid`, from the syscache.
fn relation_owner(oid: pg_sys::Oid) -> pg_sys::Oid {
    // SAFETY: a syscache lookup of an existing relation, released at once.
    unsafe {
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(oid),
        );
        if tuple.is_null() {
            error!("pg_once: relation {} has no pg_class row", oid.to_u32());
        }
        let owner = (*pg_sys::GETSTRUCT(tuple).cast::<pg_sys::FormData_pg_class>()).relowner;
        pg_sys::ReleaseSysCache(tuple);
        owner
    }
}
