//! Reading one key's row, straight from the primary-key index.
//!
//! This is the read of every claim_key call: the whole of a cache hit, and the look a
//! waiting claim_key repeats. Through SPI it costs a full executor start per call (plan
//! revalidation, executor state, projection), which made a hit cost twice a plain
//! primary-key SELECT. An index lookup with the same MVCC rules is a fraction of that.
//! Writes stay SQL (see protocol::claim): they need triggers, ON CONFLICT and index upkeep.

use crate::errors;
use crate::key::Key;
use crate::pg_compat;
use crate::storage::jsonb::Jsonb;
use crate::storage::subxact::Blocked;
use crate::storage::watched::Watched;
use pgrx::datum::{FromDatum, Interval, TimestampWithTimeZone};
use pgrx::memcxt::PgMemoryContexts;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::ffi::CStr;

/// A key's state: the value of once.entries.state (the enum once.key_state).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum KeyState {
    Queued,
    Running,
    Done,
    Failed,
}

impl KeyState {
    /// The label once.key_state gives it.
    pub fn label(self) -> &'static str {
        match self {
            KeyState::Queued => "queued",
            KeyState::Running => "running",
            KeyState::Done => "done",
            KeyState::Failed => "failed",
        }
    }

    fn from_label(label: &str) -> KeyState {
        match label {
            "queued" => KeyState::Queued,
            "running" => KeyState::Running,
            "done" => KeyState::Done,
            "failed" => KeyState::Failed,
            other => {
                error!("pg_once: once.key_state has a value {other:?} this library does not know")
            }
        }
    }
}

/// A key's row as the claim protocol needs it, and the time it was read.
pub struct Entry {
    pub state: KeyState,
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
    /// The end of the window in which an expired result is still served, as stale.
    pub stale_until: Option<TimestampWithTimeZone>,
    /// complete_key's beta (early refreshes), and how long the result took to compute.
    pub beta: Option<f64>,
    pub compute_time: Option<Interval>,
    /// The fingerprint the key's current attempt was claimed with (claim_key's).
    pub fingerprint: Option<Vec<u8>>,
    /// Server clock (what clock_timestamp() reads) right after the row was read.
    pub read_at: pg_sys::TimestampTz,
    /// Where the version read lies in once.entries.
    pub tid: pg_sys::ItemPointerData,
}

impl Entry {
    fn passed(&self, t: Option<TimestampWithTimeZone>) -> bool {
        t.is_some_and(|t| t.into_inner() <= self.read_at)
    }
    /// The key has a result and it is fresh (within its ttl).
    pub fn fresh(&self) -> bool {
        self.result.is_some() && !self.passed(self.expires_at)
    }
    /// The key has a result past its ttl that may still be served, as stale.
    pub fn servable_stale(&self) -> bool {
        self.result.is_some()
            && self.passed(self.expires_at)
            && self.stale_until.is_some()
            && !self.passed(self.stale_until)
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
const COLUMNS: [&CStr; 16] = [
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
    c"stale_until",
    c"beta",
    c"compute_time",
    c"fingerprint",
];

/// The current version of `key`'s row, as a fresh snapshot sees it (READ COMMITTED: every
/// call sees everything committed before it), or None if the key is absent. Blocked when
/// the table or its primary key cannot be locked at once: DDL holds or waits for them.
pub fn read(key: &Key) -> Result<Option<Entry>, Blocked> {
    // SAFETY: GetTransactionSnapshot returns the current MVCC snapshot; `scan` registers it.
    unsafe { scan(key, pg_sys::GetTransactionSnapshot(), true) }
}

/// A version of `key`'s row that another transaction has inserted and not yet committed
/// (a claim made inside a transaction that is still open, or prepared), when `read` found
/// the key absent. Writing the key now would wait for that transaction to end.
pub fn uncommitted(key: &Key) -> Result<Option<Entry>, Blocked> {
    // A dirty snapshot sees rows whose inserter is still in progress, as unique checks do;
    // it records the in-progress inserter in xmin.
    let mut dirty = pg_sys::SnapshotData {
        snapshot_type: pg_sys::SnapshotType::SNAPSHOT_DIRTY,
        ..Default::default()
    };
    // SAFETY: a dirty snapshot is a plain struct that an index scan uses unregistered
    // (registering would copy it, and the scan would record the inserter in the copy).
    let entry = unsafe { scan(key, &mut dirty, false)? };
    Ok(entry.filter(|_| dirty.xmin != pg_sys::InvalidTransactionId))
}

/// Read `key`'s row through the primary key with `snapshot`.
///
/// The relations are locked only for the look and unlocked at once, not kept until the
/// transaction ends as a reader's locks usually are: a waiting claim_key looks again and
/// again within one transaction, for as long as a day, and a lock kept across its sleeps
/// would make DDL on once.entries (VACUUM FULL, ALTER, DROP EXTENSION) wait for it, and
/// every other pg_once call wait behind that DDL. For the same reason the locks are only
/// taken if they can be had at once; otherwise the look is Blocked and the caller decides
/// whether to try again. Values are copied out before the locks go.
unsafe fn scan(
    key: &Key,
    snapshot: pg_sys::Snapshot,
    register: bool,
) -> Result<Option<Entry>, Blocked> {
    // SAFETY: standard index-scan sequence (as in PostgreSQL's own catalog lookups):
    // relations locked AccessShare (and released at close, as catalog readers do), an MVCC
    // snapshot registered for the scan and for detoasting, and every value copied into
    // the caller's memory context before the slot is dropped.
    unsafe {
        let Some((relations, table, index)) = open_locked(true) else {
            return Err(Blocked);
        };
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let index = index.expect("asked for the index");
        let snapshot = if register {
            pg_sys::RegisterSnapshot(snapshot)
        } else {
            snapshot
        };

        let mut scankey = pg_sys::ScanKeyData::default();
        pg_sys::ScanKeyInit(
            &mut scankey,
            1,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_BYTEAEQ),
            key.hash_datum(),
        );
        let scan = pg_compat::index_beginscan(table, index, snapshot, 1, 0);
        pg_sys::index_rescan(scan, &mut scankey, 1, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(table, std::ptr::null_mut());

        let entry = if pg_sys::index_getnext_slot(
            scan,
            pg_sys::ScanDirection::ForwardScanDirection,
            slot,
        ) {
            pg_sys::slot_getallattrs(slot);
            let value = |i: usize| {
                let at = relations.attnums[i] - 1;
                (*(*slot).tts_values.add(at), *(*slot).tts_isnull.add(at))
            };
            Some(Entry {
                state: KeyState::of_datum(value(0).0),
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
                stale_until: copy(value(12)),
                beta: copy(value(13)),
                compute_time: copy(value(14)),
                fingerprint: copy(value(15)),
                read_at: pg_sys::GetCurrentTimestamp(),
                tid: (*slot).tts_tid,
            })
        } else {
            None
        };

        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        if register {
            pg_sys::UnregisterSnapshot(snapshot);
        }
        pg_sys::index_close(index, lock);
        pg_sys::table_close(table, lock);
        Ok(entry)
    }
}

/// Is the row version `entry` was read from locked, updated or deleted by another
/// transaction that is still in progress? Writing it would wait for that transaction.
pub fn held_elsewhere(entry: &Entry) -> bool {
    // SAFETY: as in `taken`: the table is opened with AccessShareLock (released at close),
    // the tid is checked against the relation's size, the header is read under a share
    // lock on its buffer, and the pin is released.
    unsafe {
        let Some((_, table, _)) = open_locked(false) else {
            return true;
        };
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let held = with_tuple_header(table, entry.tid, |header| {
            holder(header).is_some_and(|h| pg_sys::TransactionIdIsInProgress(h.xid))
        });
        pg_sys::table_close(table, lock);
        held
    }
}

/// once.entries, its primary key and the attribute numbers of `COLUMNS`: looked up once
/// per backend, not by name on every read (that was about 2% of a cache hit's server
/// time), and again after any invalidation of either relation (DROP and CREATE
/// EXTENSION, ALTER TABLE).
#[derive(Clone, Copy)]
struct Relations {
    table: pg_sys::Oid,
    index: pg_sys::Oid,
    attnums: [usize; COLUMNS.len()],
}

thread_local! {
    static RELATIONS: Watched<Relations> = const { Watched::of_relations() };
}

fn relations() -> Relations {
    RELATIONS.with(|kept| kept.get(read_relations))
}

fn read_relations() -> (Relations, [pg_sys::Oid; 2]) {
    // SAFETY: syscache lookups by name, in a transaction (every caller runs in one).
    let found = unsafe {
        let namespace = pg_sys::get_namespace_oid(crate::schema::API.as_ptr(), false);
        let relation = |name: &CStr| {
            let oid = pg_sys::get_relname_relid(name.as_ptr(), namespace);
            if oid == pg_sys::InvalidOid {
                error!(
                    "pg_once: relation once.{} is missing; reinstall the extension",
                    name.to_string_lossy()
                );
            }
            oid
        };
        let table = relation(c"entries");
        Relations {
            table,
            index: relation(c"entries_pkey"),
            attnums: COLUMNS.map(|name| attnum(table, name)),
        }
    };
    (found, [found.table, found.index])
}

/// Lock once.entries against every write until this transaction ends (SHARE ROW
/// EXCLUSIVE: reads go on, writers wait, and so does another such lock), if that can be
/// done at once: create_namespace's, so that no key is written under a prefix between
/// its count of the keys there and its commit (protocol::namespace::create). Never
/// queued: a waiting lock request would make every pg_once write queue behind it.
pub fn try_lock_against_writes() -> bool {
    // SAFETY: a lock on an existing relation, released by the transaction's end.
    unsafe {
        pg_sys::ConditionalLockRelationOid(
            relations().table,
            pg_sys::ShareRowExclusiveLock as pg_sys::LOCKMODE,
        )
    }
}

/// once.entries (and its primary key, if `with_index`) opened under AccessShareLock,
/// taken only if it can be had at once (None otherwise). Unlock with `table_close` and
/// `index_close` and that lock mode. Locking processes pending invalidations, so a
/// relation dropped and created again meanwhile (DROP and CREATE EXTENSION) is looked up
/// again before it is opened.
unsafe fn open_locked(
    with_index: bool,
) -> Option<(Relations, pg_sys::Relation, Option<pg_sys::Relation>)> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    let no_lock = pg_sys::NoLock as pg_sys::LOCKMODE;
    // SAFETY: the relations are locked before they are opened, and unlocked again when
    // the cached OIDs turned out to be stale.
    unsafe {
        loop {
            let relations = relations();
            if !pg_sys::ConditionalLockRelationOid(relations.table, lock) {
                return None;
            }
            if with_index && !pg_sys::ConditionalLockRelationOid(relations.index, lock) {
                pg_sys::UnlockRelationOid(relations.table, lock);
                return None;
            }
            if RELATIONS.with(Watched::kept).is_none() {
                if with_index {
                    pg_sys::UnlockRelationOid(relations.index, lock);
                }
                pg_sys::UnlockRelationOid(relations.table, lock);
                continue;
            }
            let table = pg_sys::table_open(relations.table, no_lock);
            let index = with_index.then(|| pg_sys::index_open(relations.index, no_lock));
            return Some((relations, table, index));
        }
    }
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
/// It runs ~100 times per claim_next call with 64 workers, which is why once_internal.row_taken is
/// not SECURITY DEFINER (sql/functions.sql says why) and checks the caller's SELECT
/// privilege on once.entries itself.
pub fn taken(tid: pg_sys::ItemPointerData) -> bool {
    // SAFETY: once.entries is opened with AccessShareLock (inside claim_next, which
    // already holds RowExclusiveLock, that is only a local count); the tid is checked
    // against the relation's size before the page is read, the tuple header is read under
    // a share lock on its buffer, and the pin is released.
    unsafe {
        let table_oid = relations().table;
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        if pg_sys::pg_class_aclcheck(table_oid, pg_sys::GetUserId(), pg_sys::ACL_SELECT as _)
            != pg_sys::AclResult::ACLCHECK_OK
        {
            errors::insufficient_privilege(
                concat!("permission denied for function ", internal!("row_taken")).into(),
                "It is claim_next's filter and needs SELECT on once.entries. Call once.claim_next.",
            );
        }
        let table = pg_sys::relation_open(table_oid, lock);
        let answer = with_tuple_header(table, tid, |header| taken_elsewhere(header));
        pg_sys::relation_close(table, lock);
        answer
    }
}

/// Call `f` with the header of the tuple at `tid` (any version, live or dead), under a
/// share lock on its buffer; false if there is no such tuple.
unsafe fn with_tuple_header(
    table: pg_sys::Relation,
    tid: pg_sys::ItemPointerData,
    f: impl FnOnce(pg_sys::HeapTupleHeader) -> bool,
) -> bool {
    // SAFETY: the tid is checked against the relation's size before the page is read, the
    // header is only read under a share lock on its buffer, and the pin is released.
    unsafe {
        let (block, _) = pgrx::itemptr::item_pointer_get_both(tid);
        let blocks =
            pg_sys::RelationGetNumberOfBlocksInFork(table, pg_sys::ForkNumber::MAIN_FORKNUM);
        if block >= blocks {
            return false;
        }
        let mut tuple = pg_sys::HeapTupleData {
            t_len: 0,
            t_self: tid,
            t_tableOid: (*table).rd_id,
            t_data: std::ptr::null_mut(),
        };
        let mut buffer: pg_sys::Buffer = pg_sys::InvalidBuffer as pg_sys::Buffer;
        let any = &raw mut pg_sys::SnapshotAnyData;
        let mut answer = false;
        if pg_compat::heap_fetch(table, any, &mut tuple, &mut buffer) {
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
            answer = f(tuple.t_data);
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
        }
        if buffer != pg_sys::InvalidBuffer as pg_sys::Buffer {
            pg_sys::ReleaseBuffer(buffer);
        }
        answer
    }
}

/// The transaction a tuple header names as its xmax: a locker, updater or deleter.
struct Holder {
    xid: pg_sys::TransactionId,
    /// It only locked the row (FOR UPDATE and the like); the version is still current.
    locked_only: bool,
    /// The header is hinted: the holder has committed.
    committed: bool,
}

/// The header's holder, unless it has none, it is this transaction (or one of its
/// subtransactions), or several transactions only lock it at once (a MultiXact of lockers:
/// rare here, since nothing takes shared row locks on once.entries).
unsafe fn holder(header: pg_sys::HeapTupleHeader) -> Option<Holder> {
    // SAFETY: the caller holds a share lock on the header's buffer.
    unsafe {
        let infomask = (*header).t_infomask as u32;
        if infomask & pg_sys::HEAP_XMAX_INVALID != 0 {
            return None;
        }
        let locked_only = infomask & pg_sys::HEAP_XMAX_LOCK_ONLY != 0
            || infomask & (pg_sys::HEAP_XMAX_IS_MULTI | pg_sys::HEAP_LOCK_MASK)
                == pg_sys::HEAP_XMAX_EXCL_LOCK;
        let xid = if infomask & pg_sys::HEAP_XMAX_IS_MULTI != 0 {
            if locked_only {
                return None;
            }
            pg_sys::HeapTupleGetUpdateXid(header)
        } else {
            (*header).t_choice.t_heap.t_xmax
        };
        if xid == pg_sys::InvalidTransactionId || pg_sys::TransactionIdIsCurrentTransactionId(xid) {
            return None;
        }
        Some(Holder {
            xid,
            locked_only,
            committed: infomask & pg_sys::HEAP_XMAX_COMMITTED != 0,
        })
    }
}

/// Does this tuple header name, as its xmax, an updater or deleter that has committed, or
/// another transaction in progress (a locker, updater or deleter)? Our own transaction and
/// its subtransactions never count: what we hold, FOR UPDATE handles; nor do several
/// lockers at once: FOR UPDATE SKIP LOCKED decides about them.
unsafe fn taken_elsewhere(header: pg_sys::HeapTupleHeader) -> bool {
    // SAFETY: the caller holds a share lock on the header's buffer.
    let Some(holder) = (unsafe { holder(header) }) else {
        return false;
    };
    if holder.committed {
        // A committed locker no longer holds anything; a committed updater replaced this
        // version.
        return !holder.locked_only;
    }
    // In progress first: a transaction is marked committed before it leaves the proc
    // array, and either way a holder counts.
    // SAFETY: plain lookups of a transaction's status.
    unsafe {
        pg_sys::TransactionIdIsInProgress(holder.xid)
            || (!holder.locked_only && pg_sys::TransactionIdDidCommit(holder.xid))
    }
}

/// Attribute number of column `name` of relation `table`.
unsafe fn attnum(table: pg_sys::Oid, name: &CStr) -> usize {
    // SAFETY: a syscache lookup by name.
    let number = unsafe { pg_sys::get_attnum(table, name.as_ptr()) };
    if number <= 0 {
        error!("pg_once: once.entries has no column {name:?}");
    }
    number as usize
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

thread_local! {
    /// once.key_state's values by OID, as read: enum_out is a syscache probe and a palloc
    /// per read. A reinstalled type gets new OIDs, which are simply looked up anew.
    static STATES: RefCell<Vec<(pg_sys::Datum, KeyState)>> = const { RefCell::new(Vec::new()) };
}

impl KeyState {
    /// The state a once.key_state value read from once.entries holds.
    ///
    /// # Safety
    /// `datum` is a once.key_state value.
    pub unsafe fn of_datum(datum: pg_sys::Datum) -> KeyState {
        if let Some(state) = STATES.with_borrow(|states| {
            states
                .iter()
                .find(|(value, _)| *value == datum)
                .map(|(_, state)| *state)
        }) {
            return state;
        }
        // SAFETY: enum_out of a once.key_state value read from once.entries.
        let state = unsafe {
            let label =
                pgrx::fcinfo::direct_function_call_as_datum(pg_sys::enum_out, &[Some(datum)])
                    .expect("enum_out returns a label");
            KeyState::from_label(&CStr::from_ptr(label.cast_mut_ptr()).to_string_lossy())
        };
        STATES.with_borrow_mut(|states| states.push((datum, state)));
        state
    }
}
