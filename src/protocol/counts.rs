//! Keys counted by namespace and state as they change, so that once.stats reads a few
//! rows instead of every key (sql/schema.sql, once_internal.key_counts).
//!
//! A row trigger on once.entries (`count_key`) adds each change of a key's state, errors
//! or attempts to this backend's pending counts; a statement trigger (`write_key_counts`)
//! writes them, one row per namespace, into this backend's slot when the statement ends,
//! in the statement's transaction: the counts commit and roll back with the keys, and are
//! exact in every snapshot. Pending counts never outlive their statement; an error before
//! they are written aborts the (sub)transaction, whose callback drops them.
//!
//! Slots: each backend writes the rows of its own slot (its backend number), so two
//! backends never wait for each other's counts. A prepared transaction keeps its row
//! locks after the backend moved on, so the backend then writes into another of its
//! slots (`SLOTS_PER_BACKEND`). reap_stale folds every slot it can lock into slot -1
//! (`fold`), so the view sums about as many rows as there are namespaces and backends
//! active since the last reap.

use crate::pg_compat;
use crate::protocol::namespace;
use crate::storage::statements::{self, params, Statement};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::num::NonZeroUsize;

/// How one key's row changes the counts of its namespace.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
struct Counts {
    queued: i64,
    running: i64,
    done: i64,
    failed: i64,
    errors: i64,
    attempts: i64,
}

impl Counts {
    /// Add (`sign` 1) or take away (-1) a row in `state` with `errors` and `attempts`.
    fn add(&mut self, sign: i64, state: &str, errors: i32, attempts: i32) {
        let count = match state {
            "queued" => &mut self.queued,
            "running" => &mut self.running,
            "done" => &mut self.done,
            _ => &mut self.failed,
        };
        *count += sign;
        self.errors += sign * i64::from(errors);
        self.attempts += sign * i64::from(attempts);
    }

    fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

thread_local! {
    /// Counts of the statement running now, by namespace prefix ('' for none).
    static PENDING: RefCell<Vec<(String, Counts)>> = const { RefCell::new(Vec::new()) };
    /// Which of this backend's slots it writes (see SLOTS_PER_BACKEND).
    static SLOT_TURN: Cell<i32> = const { Cell::new(0) };
    /// Whether this transaction wrote counts (then a PREPARE moves to the next slot).
    static WROTE: Cell<bool> = const { Cell::new(false) };
}

/// Slots per backend: one for its transactions, and more for when prepared
/// transactions still hold a slot's rows. A backend with this many transactions prepared
/// at once, each of which wrote keys, waits for the oldest to be committed or rolled back.
const SLOTS_PER_BACKEND: i32 = 4;

/// Trigger on once.entries, for each row inserted or deleted, and each updated with a
/// new state, errors or attempts (its WHEN clause).
#[pg_trigger(sql = false)]
fn count_key<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    let data = trigger.trigger_data();
    let op = trigger.op().unwrap_or_else(|e| error!("pg_once: {e}"));
    // SAFETY: the trigger data of an AFTER ROW trigger: tg_trigtuple is the row inserted
    // or deleted, or the old row of an update, whose new row is tg_newtuple.
    unsafe {
        let tupdesc = (*data.tg_relation).rd_att;
        let (old, new) = match op {
            PgTriggerOperation::Insert => (std::ptr::null_mut(), data.tg_trigtuple),
            PgTriggerOperation::Delete => (data.tg_trigtuple, std::ptr::null_mut()),
            _ => (data.tg_trigtuple, data.tg_newtuple),
        };
        let key_tuple = if old.is_null() { new } else { old };
        let key = text_of(key_tuple, tupdesc, c"key");
        let prefix = namespace::prefix_of(&key).unwrap_or_default();
        let mut change = Counts::default();
        for (tuple, sign) in [(old, -1), (new, 1)] {
            if !tuple.is_null() {
                let state = crate::storage::entry::state_label(datum_of(tuple, tupdesc, c"state"));
                let errors = datum_of(tuple, tupdesc, c"errors").value() as i32;
                let attempts = datum_of(tuple, tupdesc, c"attempts").value() as i32;
                change.add(sign, &state, errors, attempts);
            }
        }
        PENDING.with_borrow_mut(
            |pending| match pending.iter_mut().find(|(p, _)| *p == prefix) {
                Some((_, counts)) => {
                    counts.queued += change.queued;
                    counts.running += change.running;
                    counts.done += change.done;
                    counts.failed += change.failed;
                    counts.errors += change.errors;
                    counts.attempts += change.attempts;
                }
                None => pending.push((prefix, change)),
            },
        );
    }
    Ok(None)
}

/// The (not NULL) value of column `name` of a once.entries row.
unsafe fn datum_of(
    tuple: *mut pg_sys::HeapTupleData,
    tupdesc: pg_sys::TupleDesc,
    name: &std::ffi::CStr,
) -> pg_sys::Datum {
    // SAFETY: a row of once.entries and its descriptor; the columns read are NOT NULL.
    unsafe {
        let attno = pg_sys::SPI_fnumber(tupdesc, name.as_ptr());
        let attno = NonZeroUsize::new(attno.max(0) as usize)
            .unwrap_or_else(|| error!("pg_once: once.entries has no column {name:?}"));
        pgrx::heap_getattr_raw(tuple, attno, tupdesc).expect("the column is NOT NULL")
    }
}

unsafe fn text_of(
    tuple: *mut pg_sys::HeapTupleData,
    tupdesc: pg_sys::TupleDesc,
    name: &std::ffi::CStr,
) -> String {
    // SAFETY: a text column of a once.entries row.
    unsafe {
        String::from_datum(datum_of(tuple, tupdesc, name), false).expect("the column is NOT NULL")
    }
}

static WRITE: Statement = Statement::new(concat!(
    "INSERT INTO ",
    internal!("key_counts"),
    " AS c (slot, namespace, queued, running, done, failed, errors, attempts)
     SELECT $slot, d.* FROM unnest($namespaces, $queued, $running, $done, $failed, $errors, $attempts)
         AS d (namespace, queued, running, done, failed, errors, attempts)
     ON CONFLICT (slot, namespace) DO UPDATE
        SET queued = c.queued + excluded.queued, running = c.running + excluded.running,
            done = c.done + excluded.done, failed = c.failed + excluded.failed,
            errors = c.errors + excluded.errors, attempts = c.attempts + excluded.attempts"
));

static RECOUNT: Statement = Statement::new(concat!("SELECT ", internal!("recount_keys"), "()"));

/// Trigger on once.entries, for each statement: write what its rows changed. After a
/// TRUNCATE, count again (no key is left).
#[pg_trigger(sql = false)]
fn write_key_counts<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    if matches!(
        trigger.op().unwrap_or_else(|e| error!("pg_once: {e}")),
        PgTriggerOperation::Truncate
    ) {
        PENDING.take();
        statements::run(&RECOUNT, params![], |_| Ok(()));
        return Ok(None);
    }
    let pending: Vec<(String, Counts)> = PENDING
        .take()
        .into_iter()
        .filter(|(_, counts)| !counts.is_zero())
        .collect();
    if pending.is_empty() {
        return Ok(None);
    }
    let column = |f: fn(&Counts) -> i64| pending.iter().map(|(_, c)| f(c)).collect::<Vec<i64>>();
    let namespaces: Vec<String> = pending.iter().map(|(p, _)| p.clone()).collect();
    let slot = pg_compat::my_proc_number() * SLOTS_PER_BACKEND + SLOT_TURN.get();
    statements::run(
        &WRITE,
        params![
            slot = slot,
            namespaces = namespaces,
            queued = column(|c| c.queued),
            running = column(|c| c.running),
            done = column(|c| c.done),
            failed = column(|c| c.failed),
            errors = column(|c| c.errors),
            attempts = column(|c| c.attempts),
        ],
        |_| Ok(()),
    );
    WROTE.set(true);
    Ok(None)
}

// Fold the slots that no transaction holds into slot -1, in one statement.
static FOLD: Statement = Statement::new(concat!(
    "WITH folded AS (
         DELETE FROM ",
    internal!("key_counts"),
    " WHERE ctid IN (SELECT ctid FROM ",
    internal!("key_counts"),
    " WHERE slot <> -1 FOR UPDATE SKIP LOCKED)
         RETURNING namespace, queued, running, done, failed, errors, attempts)
     INSERT INTO ",
    internal!("key_counts"),
    " AS c (slot, namespace, queued, running, done, failed, errors, attempts)
     SELECT -1, namespace, sum(queued), sum(running), sum(done), sum(failed), sum(errors), sum(attempts)
       FROM folded GROUP BY namespace
     ON CONFLICT (slot, namespace) DO UPDATE
        SET queued = c.queued + excluded.queued, running = c.running + excluded.running,
            done = c.done + excluded.done, failed = c.failed + excluded.failed,
            errors = c.errors + excluded.errors, attempts = c.attempts + excluded.attempts"
));

/// Fold the backends' slots into slot -1 (reap_stale, each round): what once.stats sums
/// stays about as many rows as there are namespaces. Skipped while recount_keys holds the
/// counts, rather than waiting for the transaction that changes the namespaces to end.
pub fn fold() {
    // SAFETY: catalog lookups by name; a conditional lock released at the transaction's
    // end, as the statement's own would be.
    let locked = unsafe {
        let schema = pg_sys::get_namespace_oid(crate::schema::INTERNAL.as_ptr(), true);
        let table = pg_sys::get_relname_relid(c"key_counts".as_ptr(), schema);
        table != pg_sys::InvalidOid
            && pg_sys::ConditionalLockRelationOid(
                table,
                pg_sys::RowExclusiveLock as pg_sys::LOCKMODE,
            )
    };
    if locked {
        statements::run(&FOLD, params![], |_| Ok(()));
    }
}

/// Transaction callbacks (registered once per backend, lib.rs): pending counts die with
/// an aborted (sub)transaction; a prepared transaction keeps its slot's rows locked, so
/// the backend writes into its next slot from now on.
pub fn register_callbacks() {
    // SAFETY: plain callback registration, for the lifetime of the backend.
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact), std::ptr::null_mut());
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_PREPARE if WROTE.replace(false) => {
            SLOT_TURN.set((SLOT_TURN.get() + 1) % SLOTS_PER_BACKEND);
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            PENDING.take();
            WROTE.set(false);
        }
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => WROTE.set(false),
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact(
    event: pg_sys::SubXactEvent::Type,
    _mine: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        PENDING.take();
    }
}
