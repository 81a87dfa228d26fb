//! SQL statements prepared once per backend and kept for its lifetime.
//!
//! Plans are prepared as "mutating": SPI then takes a fresh snapshot for every execution,
//! even of a SELECT. A waiting claim_key re-reads its key many times inside one
//! transaction and must see each change as soon as it is committed.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiTupleTable};
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

/// Parameter types of the statements.
pub mod types {
    use pgrx::pg_sys::{self, PgOid};

    pub const BYTEA: PgOid = PgOid::from_untagged(pg_sys::BYTEAOID);
    pub const TEXT: PgOid = PgOid::from_untagged(pg_sys::TEXTOID);
    pub const INT4: PgOid = PgOid::from_untagged(pg_sys::INT4OID);
    pub const INT8: PgOid = PgOid::from_untagged(pg_sys::INT8OID);
    pub const FLOAT8: PgOid = PgOid::from_untagged(pg_sys::FLOAT8OID);
    pub const BOOL: PgOid = PgOid::from_untagged(pg_sys::BOOLOID);
    pub const TIMESTAMPTZ: PgOid = PgOid::from_untagged(pg_sys::TIMESTAMPTZOID);
    pub const INTERVAL: PgOid = PgOid::from_untagged(pg_sys::INTERVALOID);
    pub const JSONB: PgOid = PgOid::from_untagged(pg_sys::JSONBOID);
    pub const BYTEA_ARRAY: PgOid = PgOid::from_untagged(pg_sys::BYTEAARRAYOID);
    pub const INT8_ARRAY: PgOid = PgOid::from_untagged(pg_sys::INT8ARRAYOID);
    pub const JSONB_ARRAY: PgOid = PgOid::from_untagged(pg_sys::JSONBARRAYOID);
}

/// SQL text and the types of its parameters.
pub struct Statement {
    sql: &'static str,
    arg_types: &'static [PgOid],
}

impl Statement {
    pub const fn new(sql: &'static str, arg_types: &'static [PgOid]) -> Statement {
        Statement { sql, arg_types }
    }
}

thread_local! {
    /// Kept plans by the address of their Statement. Boxed so a plan never moves.
    static PLANS: RefCell<HashMap<usize, Box<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

/// Execute `statement` with `args` and hand its result to `read` before SPI memory goes away.
pub fn run<R>(
    statement: &'static Statement,
    args: &[DatumWithOid],
    read: impl FnOnce(SpiTupleTable<'_>) -> pgrx::spi::Result<R>,
) -> R {
    Spi::connect(|client| {
        let plan: *const OwnedPreparedStatement = PLANS.with_borrow_mut(|plans| {
            let id = statement as *const Statement as usize;
            let plan = match plans.entry(id) {
                Entry::Occupied(kept) => kept.into_mut(),
                Entry::Vacant(slot) => {
                    let prepared = client.prepare_mut(statement.sql, statement.arg_types)?;
                    slot.insert(Box::new(prepared.keep()))
                }
            };
            Ok::<_, pgrx::spi::SpiError>(&**plan as *const OwnedPreparedStatement)
        })?;
        // SAFETY: kept plans are boxed and never removed, so the pointer stays valid.
        // `select` on a mutating plan: a fresh snapshot per execution (read_only = false)
        // without pgrx's `update`, which would assign a transaction id up front and turn
        // every cache hit into a committed write. Statements that write get one anyway.
        let table = client.select(unsafe { &*plan }, None, args)?;
        read(table)
    })
    .unwrap_or_else(|e| error!("pg_once: {e}"))
}
