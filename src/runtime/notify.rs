//! Telling the world that a key left the running state: waking waiters in shared memory
//! and notifying LISTENers on channel `once`.
//!
//! The trigger on once.entries (protocol::claim::notify_key_resolved) calls `key_resolved`
//! for every key that leaves `running`, with the payload its namespace chooses (the key,
//! or its digest). Nothing is sent before commit:
//! - waiters sleeping in claim_key are woken from the commit callback, which PostgreSQL
//!   calls after the transaction is visible to others, so a woken waiter always sees the
//!   change it was woken for;
//! - notifications go out as NOTIFY does, at commit. In `relay` mode the keys are handed
//!   to this database's pg_once worker after commit, and the worker sends them in
//!   batches: the committing transaction never takes NOTIFY's cluster-wide commit lock.
//!
//! The payload is passed to the server's pg_notify as a value, never spliced into SQL
//! text, so any key (quotes, newlines, `'; DROP TABLE`) is delivered verbatim.

use crate::errors;
use crate::runtime::guc::{self, NotifyMode};
use crate::runtime::shmem::{self, Counter};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;

/// The one channel pg_once notifies on.
pub const CHANNEL: &str = "once";

/// What this transaction will announce when it commits.
#[derive(Default)]
struct Pending {
    /// Key tags whose waiters to wake.
    wake: Vec<u64>,
    /// Keys for the relay worker.
    relay: Vec<String>,
    /// Keys announced on channel `once` at commit, directly or by relay: a transaction
    /// with any cannot be prepared (`refuse_prepare`). Kept with or without shared memory.
    announced: usize,
    /// Lengths of both lists, and `announced`, when each open subtransaction started.
    savepoints: Vec<(usize, usize, usize)>,
    /// Relay queue space promised at pre-commit: (queue, bytes).
    reserved: Option<(usize, u64)>,
}

thread_local! {
    static PENDING: RefCell<Pending> = RefCell::new(Pending::default());
}

/// Send a notification on channel `once` now (delivered when this transaction commits).
pub fn notify_now(key: &str) {
    // SAFETY: pg_notify takes two text arguments and returns void.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::pg_notify,
            &[CHANNEL.into_datum(), key.into_datum()],
        );
    }
}

/// A key left the running state in the current transaction: announce `payload` on channel
/// `once` and wake the waiters of `tag`, both once the transaction commits.
pub fn key_resolved(payload: &str, tag: u64) {
    let shared = shmem::shared();
    let mode = guc::NOTIFY.get();
    // SAFETY: MyDatabaseId is set once connected.
    let database = unsafe { pg_sys::MyDatabaseId };
    let relay =
        mode == NotifyMode::Relay && shared.is_some_and(|s| s.relay_for(database).is_some());
    if mode != NotifyMode::Off && !relay {
        notify_now(payload);
        shmem::count(Counter::NotifiedDirect);
    }
    PENDING.with_borrow_mut(|p| {
        if mode != NotifyMode::Off {
            p.announced += 1;
        }
        if shared.is_some() {
            p.wake.push(tag);
            if relay {
                p.relay.push(payload.to_owned());
            }
        }
    });
}

/// Wake the waiters announced on `tag` once this transaction commits (a queue's workers
/// waiting in claim_next: see protocol::queue::wait_tag).
pub fn wake_after_commit(tag: u64) {
    if shmem::shared().is_some() {
        PENDING.with_borrow_mut(|p| p.wake.push(tag));
    }
}

/// Hook the commit/abort callbacks; called from _PG_init in every process that loads pg_once
/// (with or without shared memory: PREPARE is refused either way).
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
    if event == XACT_EVENT_PRE_PREPARE {
        refuse_prepare();
        // A prepared transaction commits later, from whichever session runs COMMIT
        // PREPARED: this backend cannot wake its waiters then. They find the change at
        // their next look (wait::SAFETY_SLEEP_MICROS).
        PENDING.take();
        return;
    }
    let Some(shared) = shmem::shared() else {
        // Only `announced` is kept here.
        if event == XACT_EVENT_COMMIT || event == XACT_EVENT_ABORT {
            PENDING.take();
        }
        return;
    };
    match event {
        // Still before commit: promise relay space, or send the notifications ourselves.
        XACT_EVENT_PRE_COMMIT => PENDING.with_borrow_mut(|p| {
            if p.relay.is_empty() {
                return;
            }
            let bytes = shmem::Shared::queue_bytes(&p.relay);
            // SAFETY: MyDatabaseId is set once connected.
            let queue = shared.relay_for(unsafe { pg_sys::MyDatabaseId });
            match queue.filter(|&q| shared.reserve(q, bytes)) {
                Some(q) => p.reserved = Some((q, bytes)),
                None => {
                    for key in p.relay.drain(..) {
                        notify_now(&key);
                    }
                }
            }
        }),
        // Committed and visible: hand the keys over and wake the waiters.
        XACT_EVENT_COMMIT => {
            let p = PENDING.take();
            if let Some((queue, bytes)) = p.reserved {
                shared.push(queue, &p.relay, bytes);
                shmem::count_n(Counter::NotifiedRelayed, p.relay.len() as u64);
            } else if !p.relay.is_empty() {
                shmem::count_n(Counter::NotifiedDirect, p.relay.len() as u64);
            }
            if !p.wake.is_empty() {
                shared.wake(&p.wake);
            }
        }
        XACT_EVENT_ABORT => {
            if let Some((queue, bytes)) = PENDING.take().reserved {
                shared.unreserve(queue, bytes);
            }
        }
        _ => {}
    }
}

/// PREPARE TRANSACTION of a transaction that resolved keys (completed, failed, released,
/// reaped or invalidated them), which are announced on channel `once` when it commits:
/// refused with 0A000, as PostgreSQL refuses a transaction that ran NOTIFY. A prepared
/// transaction commits later, in whichever session runs COMMIT PREPARED, and neither a
/// NOTIFY nor the hand-over to the relay worker can wait for that. XACT_EVENT_PRE_PREPARE
/// comes before PostgreSQL's own check (AtPrepare_Notify), so this error is the one the
/// client sees, preloaded or not.
fn refuse_prepare() {
    if PENDING.with_borrow(|p| p.announced > 0) {
        errors::not_supported(
            "cannot PREPARE a transaction that completed, failed, released, reaped or invalidated a key".into(),
            "pg_once announces such keys on channel \"once\" when the transaction commits, which a prepared transaction cannot do (as with NOTIFY). Make these calls in a transaction of their own, outside two-phase commit.",
        );
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact(
    event: pg_sys::SubXactEvent::Type,
    _mysubid: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    PENDING.with_borrow_mut(|p| match event {
        SUBXACT_EVENT_START_SUB => p
            .savepoints
            .push((p.wake.len(), p.relay.len(), p.announced)),
        SUBXACT_EVENT_COMMIT_SUB => {
            p.savepoints.pop();
        }
        SUBXACT_EVENT_ABORT_SUB => {
            // A subtransaction whose start we did not see began before pg_once was loaded
            // into this backend (not preloaded, the first call made inside a savepoint):
            // all we recorded happened inside it.
            let (wake, relay, announced) = p.savepoints.pop().unwrap_or_default();
            p.wake.truncate(wake);
            p.relay.truncate(relay);
            p.announced = announced;
        }
        _ => {}
    });
}
