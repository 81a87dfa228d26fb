//! Keys counted by namespace and state as they change, so that once.stats reads a few
//! rows instead of every key (sql/schema.sql, once_internal.key_counts).
//!
//! A row trigger on once.entries (`count_key`) adds each change of a key's state, errors
//! or attempts to this backend's pending counts, by (sub)transaction; when the
//! transaction commits (or prepares), they are written, one row per namespace, into this
//! backend's slot, in the transaction: the counts commit with the keys and are exact in
//! every snapshot. A savepoint rolled back drops its pending counts, a committed one
//! hands them to its parent, an aborted transaction drops them all. Until then, once.stats
//! adds this backend's pending counts (`pending`), so a transaction sees its own changes.
//! Written once per transaction, not per statement: a transaction that updates the same
//! row again and again makes a chain of versions that every later update walks (a loop
//! of 2,000 claims and completions in one transaction took 1 ms a cycle that way).
//!
//! Slots: each backend writes the rows of its own slot (its backend number), so two
//! backends never wait for each other's counts. A prepared transaction keeps its row
//! locks after its backend moved on, and after that backend exited, when another backend
//! has its number: so it writes into a slot of its own, numbered from its transaction id
//! (`transaction_slot`), which no backend writes; so does a REPEATABLE READ or
//! SERIALIZABLE transaction, which may not update its backend's row once the fold deleted
//! it after its snapshot. (It wrote into the next of four slots of
//! its backend before: a role that prepared a transaction and disconnected held up, until
//! an administrator ended it, the commits of the next backend to get its number.) The
//! worker's reap_stale (or an administrator's) folds every slot it can lock into slot -1
//! (`fold`), so the view sums about as many rows as there are namespaces and backends
//! active since the last reap.

use crate::pg_compat;
use crate::protocol::namespace;
use crate::storage::entry::KeyState;
use crate::storage::statements::{self, params, Statement};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::num::NonZeroUsize;

/// How one key's row changes the counts of its namespace.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
struct Counts {
    queued: i64,
    done: i64,
    failed: i64,
    errors: i64,
    attempts: i64,
}

impl Counts {
    fn merge(&mut self, other: &Counts) {
        self.queued += other.queued;
        self.done += other.done;
        self.failed += other.failed;
        self.errors += other.errors;
        self.attempts += other.attempts;
    }

    /// Add (`sign` 1) or take away (-1) a row in `state` with `errors` and `attempts`.
    /// Running rows are not counted here: once.stats counts them (and their errors and
    /// attempts) from the running keys themselves, which their partial index keeps few.
    /// So a claim of a new key, the commonest write after a hit, changes no count.
    fn add(&mut self, sign: i64, state: KeyState, errors: i32, attempts: i32) {
        let count = match state {
            KeyState::Queued => &mut self.queued,
            KeyState::Done => &mut self.done,
            KeyState::Running => return,
            KeyState::Failed => &mut self.failed,
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
    /// Counts not written yet, by the subtransaction that made them and `label`.
    static PENDING: RefCell<Vec<(pg_sys::SubTransactionId, String, Counts)>> = const { RefCell::new(Vec::new()) };
}

/// A slot of this transaction's own, below -1 (slot -1 is the folded counts, backends'
/// slots are their numbers), from its transaction id: two transactions share one only if
/// their ids are 2^30 apart. Written by a prepared transaction, which keeps its rows
/// locked after its backend exited, and by a REPEATABLE READ or SERIALIZABLE one, which
/// may not update a row that another transaction (reap_stale's fold) deleted or updated
/// after its snapshot was taken: its commit failed (40001) whenever the worker had folded
/// its backend's row meanwhile, which it does every round. A row of its own is inserted.
fn transaction_slot() -> i32 {
    // SAFETY: reads this transaction's id; one that changed keys has one.
    let xid = unsafe { pg_sys::GetTopTransactionIdIfAny() };
    -2 - (xid.into_inner() & 0x3FFF_FFFF) as i32
}

/// A row of once.entries was inserted, updated or deleted (the count_key trigger): its
/// change of the counts is added to this (sub)transaction's. Updates that change no count
/// are passed over here rather than by a WHEN clause, which PostgreSQL would read from the
/// catalog and compile again for every UPDATE statement.
pub fn count_change(trigger: &pgrx::PgTrigger<'_>) {
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
        let mut change = Counts::default();
        for (tuple, sign) in [(old, -1), (new, 1)] {
            if !tuple.is_null() {
                let state = KeyState::of_datum(datum_of(tuple, tupdesc, c"state"));
                let errors = datum_of(tuple, tupdesc, c"errors").value() as i32;
                let attempts = datum_of(tuple, tupdesc, c"attempts").value() as i32;
                change.add(sign, state, errors, attempts);
            }
        }
        // An update that changed none of them (a heartbeat, a refresh's bookkeeping).
        if change.is_zero() {
            return;
        }
        let key_tuple = if old.is_null() { new } else { old };
        let key = text_of(key_tuple, tupdesc, c"key");
        let prefix = label(&key);
        let level = pg_sys::GetCurrentSubTransactionId();
        PENDING.with_borrow_mut(|pending| add_pending(pending, level, prefix, change));
    }
}

/// What a key's counts are kept under (key_counts.namespace): the prefix of its namespace
/// ('' for none); for a once.cached key, followed by a once.cached key of its role with a
/// digest of zeros, since only that role may use it. once.stats shows the counts of a
/// label to whoever `may_use_key(label)`: the label is judged as the key is, namespace and
/// role. (Before, another role's cached results were counted under '' with every shared
/// key, in the totals every role sees.) The view's filter reads only a label's namespace
/// and role, so the label carries both.
pub fn label(key: &str) -> String {
    let prefix = namespace::prefix_of(key).unwrap_or_default();
    match namespace::cached_key_role(key) {
        None => prefix,
        Some(role) => format!(
            "{prefix}{}{}:{}",
            namespace::CACHED_MARK,
            role.to_u32(),
            "0".repeat(64)
        ),
    }
}

fn add_pending(
    pending: &mut Vec<(pg_sys::SubTransactionId, String, Counts)>,
    level: pg_sys::SubTransactionId,
    prefix: String,
    change: Counts,
) {
    match pending
        .iter_mut()
        .find(|(l, p, _)| *l == level && *p == prefix)
    {
        Some((_, _, counts)) => counts.merge(&change),
        None => pending.push((level, prefix, change)),
    }
}

/// This backend's counts not written yet, summed by namespace: what its transaction
/// changed so far (once.stats adds them, once_internal.pending_key_counts).
pub fn pending() -> Vec<(String, [i64; 5])> {
    summed(&PENDING.with_borrow(|p| p.clone()))
        .into_iter()
        .map(|(prefix, c)| (prefix, [c.queued, c.done, c.failed, c.errors, c.attempts]))
        .collect()
}

fn summed(pending: &[(pg_sys::SubTransactionId, String, Counts)]) -> Vec<(String, Counts)> {
    let mut sums: Vec<(String, Counts)> = Vec::new();
    for (_, prefix, counts) in pending {
        match sums.iter_mut().find(|(p, _)| p == prefix) {
            Some((_, sum)) => sum.merge(counts),
            None => sums.push((prefix.clone(), *counts)),
        }
    }
    sums.retain(|(_, counts)| !counts.is_zero());
    sums
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
    " AS c (slot, namespace, queued, done, failed, errors, attempts)
     SELECT $slot, d.* FROM unnest($namespaces, $queued, $done, $failed, $errors, $attempts)
         AS d (namespace, queued, done, failed, errors, attempts)
     ON CONFLICT (slot, namespace) DO UPDATE
        SET queued = c.queued + excluded.queued,
            done = c.done + excluded.done, failed = c.failed + excluded.failed,
            errors = c.errors + excluded.errors, attempts = c.attempts + excluded.attempts"
));

// The common case: one namespace, whose row this slot has.
static ADD: Statement = Statement::new(concat!(
    "UPDATE ",
    internal!("key_counts"),
    " SET queued = queued + $queued, done = done + $done,
          failed = failed + $failed, errors = errors + $errors, attempts = attempts + $attempts
      WHERE slot = $slot AND namespace = $namespace"
));

/// Write `sums` into `slot`'s rows.
fn write(slot: i32, sums: &[(String, Counts)], sign: i64) {
    if let [(namespace, c)] = sums {
        let updated = statements::run(
            &ADD,
            params![
                queued = sign * c.queued,
                done = sign * c.done,
                failed = sign * c.failed,
                errors = sign * c.errors,
                attempts = sign * c.attempts,
                slot = slot,
                namespace = namespace.as_str(),
            ],
            |table| Ok(table.len()),
        );
        if updated == 1 {
            return;
        }
    }
    if sums.is_empty() {
        return;
    }
    let column =
        |f: fn(&Counts) -> i64| sums.iter().map(|(_, c)| sign * f(c)).collect::<Vec<i64>>();
    let namespaces: Vec<String> = sums.iter().map(|(p, _)| p.clone()).collect();
    statements::run(
        &WRITE,
        params![
            slot = slot,
            namespaces = namespaces,
            queued = column(|c| c.queued),
            done = column(|c| c.done),
            failed = column(|c| c.failed),
            errors = column(|c| c.errors),
            attempts = column(|c| c.attempts),
        ],
        |_| Ok(()),
    );
}

/// Write this transaction's pending counts into `slot` (at commit or prepare).
fn write_pending(slot: impl FnOnce() -> i32) {
    let sums = summed(&PENDING.take());
    if sums.is_empty() {
        return;
    }
    let slot = slot();
    // The error of a commit that fails here (a lock or statement timeout, a read-only
    // transaction), as every SQL function raises its errors: without a Rust backtrace.
    crate::errors::plain(|| write_in_snapshot(slot, &sums));
}

fn write_in_snapshot(slot: i32, sums: &[(String, Counts)]) {
    // At commit no statement runs, so there is no snapshot for SPI to run in: give it one,
    // as PostgreSQL does for the deferred triggers it fires at that point.
    // SAFETY: pushed and popped around the write; an error aborts the transaction, whose
    // cleanup drops the stack of active snapshots.
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
    write(slot, sums, 1);
    unsafe { pg_sys::PopActiveSnapshot() };
}

static LOCK_FOR_RECOUNT: Statement =
    Statement::new("LOCK TABLE once.entries IN SHARE ROW EXCLUSIVE MODE");
static LOCK_COUNTS: Statement = Statement::new(concat!(
    "LOCK TABLE ",
    internal!("key_counts"),
    " IN EXCLUSIVE MODE"
));
static FORGET: Statement = Statement::new(concat!("DELETE FROM ", internal!("key_counts")));
static COUNT_ALL: Statement = Statement::new(concat!(
    "INSERT INTO ",
    internal!("key_counts"),
    " (slot, namespace, queued, done, failed, errors, attempts)
     SELECT -1, n.namespace,
            count(*) FILTER (WHERE n.state = 'queued'),
            count(*) FILTER (WHERE n.state = 'done'), count(*) FILTER (WHERE n.state = 'failed'),
            sum(n.errors), sum(n.attempts)
       FROM (SELECT ",
    internal!("key_count_label"),
    "(e.key) AS namespace, e.state, e.errors, e.attempts
               FROM once.entries e WHERE e.state <> 'running') n
      GROUP BY n.namespace"
));

/// Count every key again (once_internal.recount_keys; after the namespaces change, or a
/// TRUNCATE). once.entries is locked against writes until the transaction ends, and the
/// counts against reap_stale's fold. The count sees this transaction's own changes, which
/// its pending counts will add again when it commits: so they are taken off here (if a
/// savepoint around this is rolled back, both go).
pub fn recount() {
    statements::run(&LOCK_FOR_RECOUNT, params![], |_| Ok(()));
    statements::run(&LOCK_COUNTS, params![], |_| Ok(()));
    statements::run(&FORGET, params![], |_| Ok(()));
    statements::run(&COUNT_ALL, params![], |_| Ok(()));
    write(-1, &summed(&PENDING.with_borrow(|p| p.clone())), -1);
}

// Fold the slots that no transaction holds into slot -1, in one statement: the
// transactions' own (below -1), and with $backends the backends' too.
static FOLD: Statement = Statement::new(concat!(
    "WITH folded AS (
         DELETE FROM ",
    internal!("key_counts"),
    " WHERE ctid IN (SELECT ctid FROM ",
    internal!("key_counts"),
    " WHERE (slot < -1 OR ($backends AND slot >= 0)) FOR UPDATE SKIP LOCKED)
         RETURNING namespace, queued, done, failed, errors, attempts)
     INSERT INTO ",
    internal!("key_counts"),
    " AS c (slot, namespace, queued, done, failed, errors, attempts)
     SELECT -1, namespace, sum(queued), sum(done), sum(failed), sum(errors), sum(attempts)
       FROM folded GROUP BY namespace
     ON CONFLICT (slot, namespace) DO UPDATE
        SET queued = c.queued + excluded.queued,
            done = c.done + excluded.done, failed = c.failed + excluded.failed,
            errors = c.errors + excluded.errors, attempts = c.attempts + excluded.attempts"
));

/// Fold the slots into slot -1 (reap_stale, each round): what once.stats sums stays about
/// as many rows as there are namespaces. The fold keeps the rows it deletes, and the slot
/// -1 rows it writes, locked until its transaction ends; so:
///
/// - Only an administrator's call folds (the worker is one): any role granted reap_stale
///   may leave its transaction open (or prepare it), and the next commit of every backend
///   whose slot it folded, and the worker's next fold, waited for it.
/// - Only pg_once's worker folds the backends' slots, which their backends write again at
///   their next commit. Its transaction ends right after the fold, and no other fold
///   touches those rows, so a backend waits for it briefly and it never waits for a
///   backend. An administrator's reap_stale folded them too: one that stayed in its
///   transaction held up every writer, and two folds at once deadlocked at commit (the
///   soak of bench/soak-scale.sh, with administrators reaping beside the worker). Other
///   calls fold the transactions' own slots (below -1), which nobody writes again. Without
///   the worker (not preloaded) the backends' slots stay, at most one row per backend
///   number and namespace.
/// - One fold at a time, and none while recount_keys holds the counts: a fold that cannot
///   take the table's self-exclusive lock at once skips this round rather than wait.
pub fn fold() {
    if !namespace::caller_administers() {
        return;
    }
    // SAFETY: catalog lookups by name; a conditional lock released at the transaction's
    // end, as the statement's own would be.
    let locked = unsafe {
        let schema = pg_sys::get_namespace_oid(crate::schema::INTERNAL.as_ptr(), true);
        let table = pg_sys::get_relname_relid(c"key_counts".as_ptr(), schema);
        table != pg_sys::InvalidOid
            && pg_sys::ConditionalLockRelationOid(
                table,
                pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE,
            )
    };
    if locked {
        let backends = in_pg_once_worker();
        statements::run(&FOLD, params![backends = backends], |_| Ok(()));
    }
}

/// Whether this process is a background worker of pg_once's (the one that reaps).
fn in_pg_once_worker() -> bool {
    // SAFETY: MyBgworkerEntry is NULL outside background workers, else this worker's
    // registration, whose library name is a NUL-terminated string.
    unsafe {
        let entry = pg_sys::MyBgworkerEntry;
        !entry.is_null()
            && std::ffi::CStr::from_ptr((*entry).bgw_library_name.as_ptr()) == c"pg_once"
    }
}

/// Transaction callbacks (registered once per backend, lib.rs): pending counts are
/// written at commit into this backend's slot (a REPEATABLE READ or SERIALIZABLE
/// transaction's into its own, `transaction_slot`), at prepare into the transaction's own
/// slot, and die with an aborted (sub)transaction.
pub fn register_callbacks() {
    // SAFETY: plain callback registration, for the lifetime of the backend.
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact), std::ptr::null_mut());
    }
}

/// IsolationUsesXactSnapshot(): REPEATABLE READ or SERIALIZABLE.
fn uses_transaction_snapshot() -> bool {
    // SAFETY: reads the current transaction's isolation level.
    unsafe { pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_COMMIT if uses_transaction_snapshot() => write_pending(transaction_slot),
        XACT_EVENT_PRE_COMMIT => write_pending(pg_compat::my_proc_number),
        XACT_EVENT_PRE_PREPARE => write_pending(transaction_slot),
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            PENDING.take();
        }
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact(
    event: pg_sys::SubXactEvent::Type,
    mine: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    match event {
        SUBXACT_EVENT_ABORT_SUB => PENDING.with_borrow_mut(|p| p.retain(|(l, _, _)| *l != mine)),
        SUBXACT_EVENT_COMMIT_SUB => PENDING.with_borrow_mut(|p| {
            let handed: Vec<_> = p.iter().filter(|(l, _, _)| *l == mine).cloned().collect();
            p.retain(|(l, _, _)| *l != mine);
            for (_, prefix, counts) in handed {
                add_pending(p, parent, prefix, counts);
            }
        }),
        _ => {}
    }
}
