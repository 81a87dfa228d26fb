//! Reading one key's row, straight from the primary-key index.
//!
//! This is the read of every claim_key call: the whole of a cache hit, and the look a
//! waiting claim_key repeats. Through SPI it costs a full executor start per call (plan
//! revalidation, executor state, projection), which made a hit cost twice a plain
//! primary-key SELECT. An index lookup with the same MVCC rules is a fraction of that.
//! Writes stay SQL (see claim.rs): they need triggers, ON CONFLICT and index upkeep.

use crate::args::Key;
use crate::errors;
use crate::jsonb::Jsonb;
use pgrx::datum::{FromDatum, TimestampWithTimeZone};
use pgrx::memcxt::PgMemoryContexts;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::CStr;

/// A key's row as the claim protocol needs it, and the time it was read.
pub struct Entry {
    pub state: String,
    pub token: i64,
    pub result: Option<Jsonb>,
    pub expires_at: Option<TimestampWithTimeZone>,
    pub error: Option<String>,
    pub retry_at: Option<TimestampWithTimeZone>,
    pub owner: Option<String>,
    pub owner_pid: Option<i32>,
    pub owner_started: Option<TimestampWithTimeZone>,
    pub lease_only: bool,
    pub lease_expires_at: Option<TimestampWithTimeZone>,
    pub attempts: i32,
    /// Server clock (what clock_timestamp() reads) right after the row was read.
    pub read_at: pg_sys::TimestampTz,
}

impl Entry {
    fn passed(&self, t: Option<TimestampWithTimeZone>) -> bool {
        t.is_some_and(|t| t.into_inner() <= self.read_at)
    }
    /// A done key's result is still to be served.
    pub fn fresh(&self) -> bool {
        !self.passed(self.expires_at)
    }
    /// A failed key's failure is still to be served.
    pub fn retry_later(&self) -> bool {
        self.retry_at.is_some() && !self.passed(self.retry_at)
    }
    pub fn lease_expired(&self) -> bool {
        self.passed(self.lease_expires_at)
    }
}

/// The columns read, in the order of `COLUMNS`.
const COLUMNS: [&CStr; 12] = [
    c"state",
    c"token",
    c"result",
    c"expires_at",
    c"error",
    c"retry_at",
    c"owner",
    c"owner_pid",
    c"owner_started",
    c"lease_only",
    c"lease_expires_at",
    c"attempts",
];

/// The current version of `key`'s row, as a fresh snapshot sees it (READ COMMITTED: every
/// call sees everything committed before it), or None if the key is absent.
pub fn read(key: &Key) -> Option<Entry> {
    // SAFETY: standard index-scan sequence (as in PostgreSQL's own catalog lookups):
    // relations opened and locked AccessShare (kept until transaction end, like any
    // reader), a registered snapshot for the scan and for detoasting, and every value
    // copied into the caller's memory context before the slot is dropped.
    unsafe {
        let [table_oid, index_oid] = once_relations([c"entries", c"entries_pkey"]);
        let table = pg_sys::table_open(table_oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let index = pg_sys::index_open(index_oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let attnums = COLUMNS.map(|name| attnum(table, name));
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());

        let mut scankey = pg_sys::ScanKeyData::default();
        pg_sys::ScanKeyInit(
            &mut scankey,
            1,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_BYTEAEQ),
            key.hash_datum(),
        );
        let scan = pg_sys::index_beginscan(table, index, snapshot, 1, 0);
        pg_sys::index_rescan(scan, &mut scankey, 1, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(table, std::ptr::null_mut());

        let entry = if pg_sys::index_getnext_slot(
            scan,
            pg_sys::ScanDirection::ForwardScanDirection,
            slot,
        ) {
            pg_sys::slot_getallattrs(slot);
            let value = |i: usize| {
                let at = attnums[i] - 1;
                (*(*slot).tts_values.add(at), *(*slot).tts_isnull.add(at))
            };
            Some(Entry {
                state: state_label(value(0).0),
                token: copy::<i64>(value(1)).expect("token is NOT NULL"),
                result: copy(value(2)),
                expires_at: copy(value(3)),
                error: copy(value(4)),
                retry_at: copy(value(5)),
                owner: copy(value(6)),
                owner_pid: copy(value(7)),
                owner_started: copy(value(8)),
                lease_only: copy(value(9)).unwrap_or(false),
                lease_expires_at: copy(value(10)),
                attempts: copy(value(11)).unwrap_or(0),
                read_at: pg_sys::GetCurrentTimestamp(),
            })
        } else {
            None
        };

        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::table_close(table, pg_sys::NoLock as pg_sys::LOCKMODE);
        entry
    }
}

/// The OIDs of relations of schema once (each lookup is a syscache probe: cheap, but
/// taken runs once per claim_next candidate, so it looks up only what it opens).
unsafe fn once_relations<const N: usize>(names: [&CStr; N]) -> [pg_sys::Oid; N] {
    let namespace = pg_sys::get_namespace_oid(c"once".as_ptr(), false);
    names.map(|name| {
        let oid = pg_sys::get_relname_relid(name.as_ptr(), namespace);
        if oid == pg_sys::InvalidOid {
            error!(
                "pg_once: relation once.{} is missing; reinstall the extension",
                name.to_string_lossy()
            );
        }
        oid
    })
}

/// Is the once.entries row version at `tid` of no use to a claimer in this transaction:
/// updated or deleted by a committed transaction, or held (locked, updated or deleted) by
/// another transaction still in progress?
///
/// claim_next asks this of each candidate its snapshot sees as queued, before locking it.
/// - Replaced by a commit: another worker claimed the key since claim_next's snapshot.
///   Without the question FOR UPDATE SKIP LOCKED follows the row to its running version,
///   locks that version and only then finds it no longer queued; the lock stays until
///   claim_next's transaction ends, and the owner's complete_key waits for it (with 64
///   workers on 2 cores, completions spent more time waiting there than anywhere else).
/// - Held by a transaction in progress: another worker is claiming it right now. SKIP
///   LOCKED would skip it too, but only after taking the page's buffer lock exclusively to
///   try; with 64 workers reading the same few pages at the head of a queue those
///   exclusive locks queued up behind each other. This answer needs only a share lock.
///
/// A row taken after this check is still handled by FOR UPDATE and its re-check, so a no
/// never does harm; a yes must be right when given. (A row updated but still queued, say
/// by an administrator's UPDATE, is passed over by that one call; the next sees its new
/// version. A holder that rolls back right after the check costs that one call the row,
/// as SKIP LOCKED would have.)
///
/// It runs ~100 times per claim_next call with 64 workers, so the SQL function is not
/// SECURITY DEFINER: entering and leaving one (its pinned search_path) cost more than the
/// answer. claim_next, which is, calls it as the extension's owner; anyone else needs
/// SELECT on once.entries, as a direct look at the rows would.
pub fn taken(tid: pg_sys::ItemPointerData) -> bool {
    // SAFETY: once.entries is opened with AccessShareLock (inside claim_next, which
    // already holds RowExclusiveLock, that is only a local count); the tid is checked
    // against the relation's size before the page is read, the tuple header is read under
    // a share lock on its buffer, and the pin is released.
    unsafe {
        let [table_oid] = once_relations([c"entries"]);
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        if pg_sys::pg_class_aclcheck(table_oid, pg_sys::GetUserId(), pg_sys::ACL_SELECT as _)
            != pg_sys::AclResult::ACLCHECK_OK
        {
            errors::insufficient_privilege(
                "permission denied for function once.row_taken".into(),
                "It is claim_next's filter and needs SELECT on once.entries. Call once.claim_next.",
            );
        }
        let table = pg_sys::relation_open(table_oid, lock);
        let (block, _) = pgrx::itemptr::item_pointer_get_both(tid);
        let blocks =
            pg_sys::RelationGetNumberOfBlocksInFork(table, pg_sys::ForkNumber::MAIN_FORKNUM);
        let mut answer = false;
        if block < blocks {
            let mut tuple = pg_sys::HeapTupleData {
                t_len: 0,
                t_self: tid,
                t_tableOid: table_oid,
                t_data: std::ptr::null_mut(),
            };
            let mut buffer: pg_sys::Buffer = pg_sys::InvalidBuffer as pg_sys::Buffer;
            let any = &raw mut pg_sys::SnapshotAnyData;
            if pg_sys::heap_fetch(table, any, &mut tuple, &mut buffer, true) {
                pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
                answer = taken_elsewhere(tuple.t_data);
                pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
            }
            if buffer != pg_sys::InvalidBuffer as pg_sys::Buffer {
                pg_sys::ReleaseBuffer(buffer);
            }
        }
        pg_sys::relation_close(table, lock);
        answer
    }
}

/// Does this tuple header name, as its xmax, an updater or deleter that has committed, or
/// another transaction in progress (a locker, updater or deleter)? Our own transaction and
/// its subtransactions never count: what we hold, FOR UPDATE handles.
unsafe fn taken_elsewhere(header: pg_sys::HeapTupleHeader) -> bool {
    let infomask = (*header).t_infomask as u32;
    if infomask & pg_sys::HEAP_XMAX_INVALID != 0 {
        return false;
    }
    let locked_only = infomask & pg_sys::HEAP_XMAX_LOCK_ONLY != 0
        || infomask & (pg_sys::HEAP_XMAX_IS_MULTI | pg_sys::HEAP_LOCK_MASK)
            == pg_sys::HEAP_XMAX_EXCL_LOCK;
    let xmax = if infomask & pg_sys::HEAP_XMAX_IS_MULTI != 0 {
        // Several holders at once: rare here (nothing takes shared row locks on
        // once.entries). Only an updater among them is looked at; FOR UPDATE SKIP LOCKED
        // decides about lockers.
        if locked_only {
            return false;
        }
        pg_sys::HeapTupleGetUpdateXid(header)
    } else if infomask & pg_sys::HEAP_XMAX_COMMITTED != 0 {
        // Hinted: a committed locker no longer holds anything; a committed updater replaced
        // this version.
        return !locked_only;
    } else {
        (*header).t_choice.t_heap.t_xmax
    };
    if xmax == pg_sys::InvalidTransactionId || pg_sys::TransactionIdIsCurrentTransactionId(xmax) {
        return false;
    }
    // In progress first: a transaction is marked committed before it leaves the proc
    // array, and either way a holder counts.
    pg_sys::TransactionIdIsInProgress(xmax)
        || (!locked_only && pg_sys::TransactionIdDidCommit(xmax))
}

/// Attribute number of column `name` of `table`.
unsafe fn attnum(table: pg_sys::Relation, name: &CStr) -> usize {
    let desc = (*table).rd_att;
    (0..(*desc).natts as usize)
        .find(|&i| {
            let att = &(*desc).attrs.as_slice((*desc).natts as usize)[i];
            !att.attisdropped && CStr::from_ptr(att.attname.data.as_ptr()) == name
        })
        .map(|i| i + 1)
        .unwrap_or_else(|| error!("pg_once: once.entries has no column {name:?}"))
}

/// Copy a value out of the slot into the current memory context.
unsafe fn copy<T: FromDatum>((datum, isnull): (pg_sys::Datum, bool)) -> Option<T> {
    T::from_datum_in_memory_context(
        PgMemoryContexts::CurrentMemoryContext,
        datum,
        isnull,
        pg_sys::InvalidOid,
    )
}

/// The label of a once.key_state value.
unsafe fn state_label(datum: pg_sys::Datum) -> String {
    let label = pgrx::fcinfo::direct_function_call_as_datum(pg_sys::enum_out, &[Some(datum)])
        .expect("enum_out returns a label");
    CStr::from_ptr(label.cast_mut_ptr())
        .to_string_lossy()
        .into_owned()
}
