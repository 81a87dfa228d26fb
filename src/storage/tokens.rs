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
//! restore's setval itself succeeds and a restore reports no error. Drawing costs one
//! comparison more than nextval; only the first claims after such a restore do more.

use crate::storage::statements::{self, Statement};
use crate::storage::watched::Watched;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::IntoDatum;

thread_local! {
    /// The sequence and its floor (seqstart), read once per backend, and again after a
    /// relcache invalidation of the sequence (DROP and CREATE EXTENSION make a new one).
    static SEQUENCE: Watched<(pg_sys::Oid, i64)> = const { Watched::of_relations() };
}

/// The next fencing token.
pub fn next() -> i64 {
    let (sequence, floor) = sequence();
    let token = nextval(sequence);
    if token >= floor {
        return token;
    }
    raise_to_floor(sequence, floor)
}

/// The sequence was set back below its floor (by a restore): move it up, then draw.
///
/// One backend at a time moves it, holding a lock on the sequence (`try_lock_sequence`): two that
/// each saw a value below the floor must not both set it to the floor, or they would both
/// draw floor + 1. The others never wait on that lock (a claim's lock waits are bounded,
/// and a bounded wait that runs out answers `wait`): they draw again after a moment, and
/// once the sequence has been moved their values are above the floor.
fn raise_to_floor(sequence: pg_sys::Oid, floor: i64) -> i64 {
    loop {
        if try_lock_sequence(sequence) {
            let token = nextval(sequence);
            if token >= floor {
                return token;
            }
            // SAFETY: setval(sequence, floor, true), as the SQL function: the next value
            // is floor + 1.
            unsafe {
                pgrx::direct_function_call_as_datum(
                    pg_sys::setval3_oid,
                    &[sequence.into_datum(), floor.into_datum(), true.into_datum()],
                )
            };
            return nextval(sequence);
        }
        // SAFETY: a short sleep; then a cancel or timeout ends the loop.
        unsafe { pg_sys::pg_usleep(100) };
        check_for_interrupts!();
        let token = nextval(sequence);
        if token >= floor {
            return token;
        }
    }
}

/// A lock on the sequence itself, SHARE UPDATE EXCLUSIVE (one holder at a time; no
/// conflict with the ROW EXCLUSIVE lock nextval and setval take), if it can be had at
/// once, held until the transaction ends. Not an advisory lock: any role may take any
/// advisory lock, and pg_once's key (its constant and the sequence's OID, which pg_class
/// shows to everyone) was one: a role that held it kept the sequence below its floor
/// after a restore, and every claim drew one value a moment until it reached the floor,
/// for hours. Only the sequence's owner may lock it (LOCK TABLE checks privileges, and no
/// role has USAGE on once_internal).
fn try_lock_sequence(sequence: pg_sys::Oid) -> bool {
    // SAFETY: a conditional lock on an existing relation, released at the transaction's
    // end (as the advisory lock was).
    unsafe {
        pg_sys::ConditionalLockRelationOid(
            sequence,
            pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE,
        )
    }
}

fn nextval(sequence: pg_sys::Oid) -> i64 {
    // SAFETY: nextval(regclass) of an existing sequence; the caller may use it (the
    // functions that claim run as the extension's owner).
    unsafe { pgrx::direct_function_call::<i64>(pg_sys::nextval_oid, &[sequence.into_datum()]) }
        .expect("nextval returns a value")
}

fn sequence() -> (pg_sys::Oid, i64) {
    SEQUENCE.with(|kept| kept.get(read_sequence))
}

fn read_sequence() -> ((pg_sys::Oid, i64), [pg_sys::Oid; 1]) {
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
    (known, [known.0])
}
