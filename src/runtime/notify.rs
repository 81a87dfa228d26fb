//! Telling the world that a key left the running state: waking waiters in shared memory
//! and notifying LISTENers on channel `once`.
//!
//! The trigger on once.entries (api::triggers::notify_key_resolved, through
//! protocol::resolve) calls `key_resolved` for every key that leaves `running`, with the
//! payload its namespace chooses (the key, or its digest). Nothing is sent before commit:
//! - waiters sleeping in claim_key are woken from the commit callback, which PostgreSQL
//!   calls after the transaction is visible to others, so a woken waiter always sees the
//!   change it was woken for;
//! - notifications go out as NOTIFY does, at commit. In `relay` mode the keys are handed
//!   to this database's pg_once worker after commit, and the worker sends them in
//!   batches: the committing transaction never takes NOTIFY's cluster-wide commit lock.
//!
//! The payload is passed to the server's pg_notify as a value, never spliced into SQL
//! text, so any key (quotes, newlines, `'; DROP TABLE`) is delivered verbatim.
//!
//! What one transaction announces is bounded, and so is what it keeps in memory for it: up
//! to MAX_ANNOUNCED_KEYS keys and MAX_ANNOUNCED_BYTES of them, each announced; past either,
//! the transaction announces only ANY_KEY ("some keys resolved: every waiter asks again"),
//! and wakes every waiter in shared memory instead of those of its keys. And announcing
//! never makes a commit fail. PostgreSQL writes a transaction's notifications into its
//! notify queue at commit and fails the commit when the queue is full ("too many
//! notifications in the NOTIFY queue"), which a listener that does not read (one idle in
//! a transaction, or whose client stopped reading) brings about: the queue cannot move
//! past it. So before sending, the committing transaction (and the relay worker) reads
//! how full the queue is (`Announcement::for_queue_usage`): from half full, where
//! PostgreSQL starts warning, only ANY_KEY; from nine tenths, nothing. Waiters in shared
//! memory are woken all the same, and clients that LISTEN ask again when their wait
//! times out (docs/clients.md).

use crate::errors;
use crate::runtime::guc::{self, NotifyMode};
use crate::runtime::shmem::{self, Counter};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;

/// The one channel pg_once notifies on.
pub const CHANNEL: &str = "once";

/// The payload that stands for "some keys resolved": whoever waits for a key asks again.
/// No key is empty, nor is a key's digest, so it is never mistaken for one.
pub const ANY_KEY: &str = "";

/// Keys one transaction announces one by one, at most (claim_next hands out 1,000 at a
/// time, so completing a batch still names its keys).
pub const MAX_ANNOUNCED_KEYS: usize = 1000;

/// Bytes of keys one transaction announces one by one, at most: a quarter of a relay
/// queue (shmem::relay), so that a few such transactions fit in it at once.
pub const MAX_ANNOUNCED_BYTES: usize = 64 * 1024;

/// What a transaction sends on channel `once`.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Announcement {
    /// Each key (or its digest).
    Keys,
    /// ANY_KEY alone.
    AnyKey,
    /// Nothing.
    Nothing,
}

impl Announcement {
    /// What to send with PostgreSQL's notify queue `usage` full (0 to 1,
    /// pg_notification_queue_usage), and `overflowed`: past MAX_ANNOUNCED_*.
    pub fn for_queue_usage(usage: f64, overflowed: bool) -> Announcement {
        if usage >= 0.9 {
            Announcement::Nothing
        } else if usage >= 0.5 || overflowed {
            Announcement::AnyKey
        } else {
            Announcement::Keys
        }
    }
}

/// What this transaction will announce when it commits.
#[derive(Default)]
struct Pending {
    /// Key tags whose waiters to wake (empty once `overflowed`: then every waiter).
    wake: Vec<u64>,
    /// Payloads to announce (empty once `overflowed`).
    payloads: Vec<String>,
    /// Bytes of `payloads`.
    bytes: usize,
    /// More keys resolved than MAX_ANNOUNCED_KEYS or MAX_ANNOUNCED_BYTES allow: announce
    /// ANY_KEY and wake every waiter. Kept past a rolled back savepoint (announcing too
    /// much only makes waiters look again).
    overflowed: bool,
    /// Keys announced on channel `once` at commit, directly or by relay: a transaction
    /// with any cannot be prepared (`refuse_prepare`). Kept with or without shared memory.
    announced: usize,
    /// Lengths of both lists, `bytes` and `announced` when each open subtransaction
    /// started.
    savepoints: Vec<(usize, usize, usize, usize)>,
    /// What goes out at commit, decided at pre-commit: sent directly (counted as such),
    /// or handed to the relay, with the queue space promised: (queue, bytes).
    direct: usize,
    reserved: Option<(usize, u64)>,
}

impl Pending {
    /// Record a resolved key: its payload, announced unless `mode` is off, and its tag.
    fn add(&mut self, payload: &str, tag: u64, announce: bool, shared: bool) {
        if announce {
            self.announced += 1;
            if !self.overflowed {
                self.bytes += payload.len();
                self.payloads.push(payload.to_owned());
            }
        }
        if shared && !self.overflowed {
            self.wake.push(tag);
        }
        if self.payloads.len() > MAX_ANNOUNCED_KEYS
            || self.bytes > MAX_ANNOUNCED_BYTES
            || self.wake.len() > MAX_ANNOUNCED_KEYS
        {
            self.overflowed = true;
            self.payloads = Vec::new();
            self.wake = Vec::new();
            self.bytes = 0;
        }
    }

    /// The payloads to send, by what the notify queue's fullness allows.
    fn take_announcement(&mut self) -> Vec<String> {
        if self.announced == 0 || (self.payloads.is_empty() && !self.overflowed) {
            return Vec::new();
        }
        match Announcement::for_queue_usage(notify_queue_usage(), self.overflowed) {
            Announcement::Keys => std::mem::take(&mut self.payloads),
            Announcement::AnyKey => vec![ANY_KEY.to_owned()],
            Announcement::Nothing => Vec::new(),
        }
    }
}

thread_local! {
    static PENDING: RefCell<Pending> = RefCell::new(Pending::default());
}

/// How full PostgreSQL's notify queue is, from 0 to 1.
pub fn notify_queue_usage() -> f64 {
    // SAFETY: pg_notification_queue_usage takes no argument and returns a float8.
    unsafe {
        let datum =
            pgrx::fcinfo::direct_function_call_as_datum(pg_sys::pg_notification_queue_usage, &[]);
        f64::from_datum(
            datum.expect("pg_notification_queue_usage returns a value"),
            false,
        )
        .expect("pg_notification_queue_usage is not NULL")
    }
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
    let announce = guc::NOTIFY.get() != NotifyMode::Off;
    let shared = shmem::shared().is_some();
    PENDING.with_borrow_mut(|p| p.add(payload, tag, announce, shared));
}

/// Wake the waiters announced on `tag` once this transaction commits (a queue's workers
/// waiting in claim_next: see runtime::wait::queue_tag).
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
    let shared = shmem::shared();
    match event {
        // Still before commit (and before PostgreSQL writes this transaction's
        // notifications into its queue): promise relay space, or send them ourselves.
        XACT_EVENT_PRE_COMMIT => PENDING.with_borrow_mut(|p| {
            let payloads = p.take_announcement();
            if payloads.is_empty() {
                return;
            }
            // SAFETY: MyDatabaseId is set once connected.
            let database = unsafe { pg_sys::MyDatabaseId };
            let bytes = shmem::Shared::queue_bytes(&payloads);
            let relayed = shared
                .filter(|_| guc::NOTIFY.get() == NotifyMode::Relay)
                .and_then(|s| s.relay_for(database).filter(|&q| s.reserve(q, bytes)));
            match relayed {
                Some(q) => p.reserved = Some((q, bytes)),
                None => {
                    for payload in &payloads {
                        notify_now(payload);
                    }
                    p.direct = payloads.len();
                }
            }
            p.payloads = payloads;
        }),
        // Committed and visible: hand the keys over and wake the waiters.
        XACT_EVENT_COMMIT => {
            let p = PENDING.take();
            let Some(shared) = shared else {
                return;
            };
            if let Some((queue, bytes)) = p.reserved {
                shared.push(queue, &p.payloads, bytes);
                shmem::count_n(Counter::NotifiedRelayed, p.payloads.len() as u64);
            }
            shmem::count_n(Counter::NotifiedDirect, p.direct as u64);
            if p.overflowed {
                shared.wake_all();
            } else if !p.wake.is_empty() {
                shared.wake(&p.wake);
            }
        }
        XACT_EVENT_ABORT => {
            if let (Some(shared), Some((queue, bytes))) = (shared, PENDING.take().reserved) {
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
        SUBXACT_EVENT_START_SUB => {
            p.savepoints
                .push((p.wake.len(), p.payloads.len(), p.bytes, p.announced))
        }
        SUBXACT_EVENT_COMMIT_SUB => {
            p.savepoints.pop();
        }
        SUBXACT_EVENT_ABORT_SUB => {
            // A subtransaction whose start we did not see began before pg_once was loaded
            // into this backend (not preloaded, the first call made inside a savepoint):
            // all we recorded happened inside it.
            let (wake, payloads, bytes, announced) = p.savepoints.pop().unwrap_or_default();
            if !p.overflowed {
                p.wake.truncate(wake);
                p.payloads.truncate(payloads);
                p.bytes = bytes;
            }
            p.announced = announced;
        }
        _ => {}
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_notify_queue_gets_less_and_then_nothing() {
        use Announcement::*;
        assert_eq!(Announcement::for_queue_usage(0.0, false), Keys);
        assert_eq!(Announcement::for_queue_usage(0.49, false), Keys);
        assert_eq!(Announcement::for_queue_usage(0.0, true), AnyKey);
        assert_eq!(Announcement::for_queue_usage(0.5, false), AnyKey);
        assert_eq!(Announcement::for_queue_usage(0.89, true), AnyKey);
        assert_eq!(Announcement::for_queue_usage(0.9, false), Nothing);
        assert_eq!(Announcement::for_queue_usage(1.0, true), Nothing);
    }

    #[test]
    fn a_transaction_keeps_a_bounded_list() {
        let mut p = Pending::default();
        for i in 0..MAX_ANNOUNCED_KEYS {
            p.add(&format!("k{i}"), i as u64, true, true);
        }
        assert!(!p.overflowed);
        assert_eq!(p.payloads.len(), MAX_ANNOUNCED_KEYS);
        p.add("one more", 0, true, true);
        assert!(p.overflowed);
        assert!(p.payloads.is_empty() && p.wake.is_empty());
        for _ in 0..100_000 {
            p.add("k", 0, true, true);
        }
        assert!(p.payloads.capacity() == 0 && p.wake.capacity() == 0);
        assert_eq!(p.announced, MAX_ANNOUNCED_KEYS + 100_001);

        let mut big = Pending::default();
        let key = "x".repeat(7500);
        for _ in 0..MAX_ANNOUNCED_BYTES / 7500 {
            big.add(&key, 0, true, false);
        }
        assert!(!big.overflowed);
        big.add(&key, 0, true, false);
        assert!(big.overflowed, "past MAX_ANNOUNCED_BYTES");
    }
}
