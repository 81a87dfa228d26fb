//! Fencing tokens: the next value of once_internal.token_seq, never at or below a token
//! this cluster may have handed out before.
//!
//! The sequence starts (START WITH) at a floor above every such token: the cluster's WAL
//! position when the extension was created (sql/schema.sql says why that works). pg_dump
//! saves the sequence's value and a restore sets it back to that value, which in another
//! cluster carries the dumped tokens over, but in the same cluster (or any whose floor is
//! higher) takes the sequence below its floor, where it would hand out tokens this
//! cluster issued after the dump. So every token is drawn here: a value below the floor
//! moves the sequence up to it first, once. The sequence has no MINVALUE, so that the
//! restore's setval itself succeeds and a restore reports no error.

use crate::storage::statements::{self, Statement};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::IntoDatum;
use std::cell::Cell;

thread_local! {
    /// The sequence and its floor (seqstart), read once per backend, and again after a
    /// relcache invalidation of the sequence (DROP and CREATE EXTENSION make a new one).
    static SEQUENCE: Cell<Option<(pg_sys::Oid, i64)>> = const { Cell::new(None) };
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// The next fencing token.
pub fn next() -> i64 {
    let (sequence, floor) = sequence();
    let token = nextval(sequence);
    if token >= floor {
        return token;
    }
    // Below the floor: set back by a restore. One backend at a time moves it up (a lock
    // that conflicts with itself, and with nextval meanwhile); the others then draw
    // above the floor. Without the lock, two could each see a value below it and both set
    // it to the floor, handing out the same token twice.
    // SAFETY: locks the sequence until the end of this transaction.
    unsafe { pg_sys::LockRelationOid(sequence, pg_sys::ShareRowExclusiveLock as i32) };
    let token = nextval(sequence);
    if token >= floor {
        return token;
    }
    // SAFETY: setval(sequence, floor, true), as the SQL function; the next value is floor + 1.
    unsafe {
        pgrx::direct_function_call_as_datum(
            pg_sys::setval3_oid,
            &[sequence.into_datum(), floor.into_datum(), true.into_datum()],
        )
    };
    nextval(sequence)
}

fn nextval(sequence: pg_sys::Oid) -> i64 {
    // SAFETY: nextval(regclass) of an existing sequence; the caller may use it (the
    // functions that claim run as the extension's owner).
    unsafe { pgrx::direct_function_call::<i64>(pg_sys::nextval_oid, &[sequence.into_datum()]) }
        .expect("nextval returns a value")
}

fn sequence() -> (pg_sys::Oid, i64) {
    if let Some(known) = SEQUENCE.get() {
        return known;
    }
    if !CALLBACK_REGISTERED.replace(true) {
        // SAFETY: registers a callback for the lifetime of the backend; it only resets a
        // cell, as an invalidation callback must.
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget), pg_sys::Datum::from(0)) };
    }
    static FLOOR: Statement = Statement::new(concat!(
        "SELECT s.seqrelid, s.seqstart FROM pg_catalog.pg_sequence s \
         WHERE s.seqrelid = '",
        internal!("token_seq"),
        "'::pg_catalog.regclass"
    ));
    let known = statements::run(&FLOOR, statements::params![], |table| {
        let row = table.first();
        Ok((
            row.get::<pg_sys::Oid>(1)?.expect("seqrelid is NOT NULL"),
            row.get::<i64>(2)?.expect("seqstart is NOT NULL"),
        ))
    });
    SEQUENCE.set(Some(known));
    known
}

#[pg_guard]
unsafe extern "C-unwind" fn forget(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    if let Some((sequence, _)) = SEQUENCE.get() {
        if relid == sequence || relid == pg_sys::InvalidOid {
            SEQUENCE.set(None);
        }
    }
}
