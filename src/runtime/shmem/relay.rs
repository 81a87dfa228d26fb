//! One relay queue per database worker: the keys whose NOTIFY committing transactions
//! handed over to the worker (once.notify = relay).
//!
//! A transaction promises itself room at pre-commit (`reserve`), so that once it has
//! committed the hand-over cannot fail; it appends its keys after commit (`push`). The
//! worker reads keys without removing them (`peek`) and removes them only once it has
//! sent them (`consume`), so a worker that dies mid-batch leaves them to its successor.
//!
//! The ring itself (`RelayRing`) is plain Rust with no PostgreSQL in it, tested below;
//! `Shared`'s methods wrap it in the queue's LWLock and set the worker's latch.
//!
//! A queue also records the worker that serves its database, the one registry of running
//! workers: committing backends relay only to a database whose worker runs, once.stats
//! counts it, and the launcher (workers::launcher) reads it to tell whether a worker it
//! did not start itself is still running and whether a worker got through its start.
//! A worker clears its pid however it exits (`detach_relay` runs from an exit callback):
//! a worker that dies without running it (SIGKILL, a crash) makes the postmaster
//! reinitialise shared memory, so a pid found here is always a running worker.

use super::{lock, Locked, Shared};
use crate::pg_compat::{self, latch_of};
use pgrx::pg_sys;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering::SeqCst};

/// Bytes of queued keys per database relay.
const RELAY_BYTES: usize = 256 * 1024;

/// Keys, each stored as a 2-byte little-endian length and its bytes, in a ring of `N`
/// bytes. Positions only grow; a position's byte is at `position % N`. All-zero is the
/// empty ring (shared memory starts zeroed).
#[repr(C)]
pub struct RelayRing<const N: usize> {
    /// Where the next key goes.
    head: u64,
    /// Where the oldest key not yet consumed starts.
    tail: u64,
    /// Bytes promised to transactions that are committing.
    reserved: u64,
    data: [u8; N],
}

/// Why a worker could not attach to a relay queue.
#[derive(Debug)]
pub enum AttachError {
    /// Another worker (this pid) already serves the database.
    Taken { pid: i32 },
    /// Every queue serves another database.
    Full,
}

impl<const N: usize> RelayRing<N> {
    /// Bytes `keys` take in a ring.
    pub fn bytes_for(keys: &[String]) -> u64 {
        keys.iter().map(|k| 2 + k.len() as u64).sum()
    }

    /// Promise `bytes` to a committing transaction; false if they do not fit.
    pub fn reserve(&mut self, bytes: u64) -> bool {
        let used = self.head - self.tail + self.reserved;
        if used + bytes > N as u64 {
            return false;
        }
        self.reserved += bytes;
        true
    }

    /// Give back a promise that will not be used (the transaction aborted).
    pub fn unreserve(&mut self, bytes: u64) {
        self.reserved -= bytes;
    }

    /// Append `keys` into the `reserved` bytes promised for them. Returns whether the ring
    /// was empty before: only then may the reader be asleep (see worker.rs).
    pub fn push(&mut self, keys: &[String], reserved: u64) -> bool {
        debug_assert!(Self::bytes_for(keys) <= reserved && reserved <= self.reserved);
        let was_empty = self.head == self.tail;
        for key in keys {
            // Keys are at most 7,500 bytes (the key rule of api/argument_rules.json, which a
            // test of args.rs keeps under 65,536): the length fits.
            let len = (key.len() as u16).to_le_bytes();
            for &b in len.iter().chain(key.as_bytes()) {
                self.data[(self.head % N as u64) as usize] = b;
                self.head += 1;
            }
        }
        self.reserved -= reserved;
        was_empty
    }

    /// Up to `max` keys from the oldest on, without removing them, and the position to
    /// `consume` up to once they are sent.
    pub fn peek(&self, max: usize) -> (Vec<String>, u64) {
        let byte = |pos: u64| self.data[(pos % N as u64) as usize];
        let mut keys = Vec::new();
        let mut tail = self.tail;
        while tail < self.head && keys.len() < max {
            let len = u16::from_le_bytes([byte(tail), byte(tail + 1)]) as u64;
            let bytes: Vec<u8> = (tail + 2..tail + 2 + len).map(byte).collect();
            keys.push(String::from_utf8_lossy(&bytes).into_owned());
            tail += 2 + len;
        }
        (keys, tail)
    }

    /// Remove the keys read by `peek` up to `position`.
    pub fn consume(&mut self, position: u64) {
        debug_assert!(self.tail <= position && position <= self.head);
        self.tail = position;
    }

    /// Drop every key and promise: the ring is empty, ready for another database.
    pub fn clear(&mut self) {
        self.tail = self.head;
        self.reserved = 0;
    }
}

#[repr(C)]
pub(super) struct RelayQueue {
    /// Database this queue serves, 0 if unused.
    dboid: AtomicU32,
    /// Pid and PGPROC number of the worker draining it; pid 0 while it is not running.
    worker_pid: AtomicI32,
    worker_proc_number: AtomicI32,
    /// An owner session exited: the worker should reap now rather than at its next round.
    reap_requested: AtomicBool,
    /// Launch number (see workers::launcher) of the last worker here that got through its
    /// first round: the launcher's test of whether a worker that stopped had started well.
    ready_launch: AtomicU32,
    /// Only touched under the queue's LWLock (`Shared::ring`).
    ring: UnsafeCell<RelayRing<RELAY_BYTES>>,
}

impl Shared {
    /// Run `f` on relay queue `index`'s ring under the queue's lock.
    fn ring<R>(&self, index: usize, f: impl FnOnce(&mut RelayRing<RELAY_BYTES>) -> R) -> R {
        let _guard = Locked::exclusive(lock(1 + index));
        // SAFETY: the ring is only touched under this lock, so this is the only reference.
        f(unsafe { &mut *self.relays[index].ring.get() })
    }

    fn wake_worker(&self, index: usize) {
        let queue = &self.relays[index];
        // SAFETY: SetLatch on another process's latch is what latches are for.
        unsafe { pg_sys::SetLatch(latch_of(queue.worker_proc_number.load(SeqCst))) };
    }

    /// The relay queue of `dboid` whose worker is running.
    pub fn relay_for(&self, dboid: pg_sys::Oid) -> Option<usize> {
        self.relays
            .iter()
            .position(|q| q.dboid.load(SeqCst) == dboid.to_u32() && q.worker_pid.load(SeqCst) != 0)
    }

    /// The queue assigned to `dboid`, whether or not its worker runs.
    fn queue_of(&self, dboid: pg_sys::Oid) -> Option<&RelayQueue> {
        self.relays
            .iter()
            .find(|q| q.dboid.load(SeqCst) == dboid.to_u32())
    }

    /// Attach the calling worker to the queue of its database (taking a free one), unless
    /// another worker serves it: two workers draining one queue would send keys twice.
    pub fn attach_relay(&self, dboid: pg_sys::Oid) -> Result<usize, AttachError> {
        let _guard = Locked::exclusive(lock(0));
        let index = self
            .relays
            .iter()
            .position(|q| q.dboid.load(SeqCst) == dboid.to_u32())
            .or_else(|| self.relays.iter().position(|q| q.dboid.load(SeqCst) == 0))
            .ok_or(AttachError::Full)?;
        let queue = &self.relays[index];
        let pid = queue.worker_pid.load(SeqCst);
        if pid != 0 {
            return Err(AttachError::Taken { pid });
        }
        queue.dboid.store(dboid.to_u32(), SeqCst);
        queue
            .worker_proc_number
            .store(pg_compat::my_proc_number(), SeqCst);
        // SAFETY: MyProcPid is set at process start.
        queue.worker_pid.store(unsafe { pg_sys::MyProcPid }, SeqCst);
        Ok(index)
    }

    /// Ask the worker of `dboid`, if one runs, to reap at once.
    pub fn request_reap(&self, dboid: pg_sys::Oid) {
        if let Some(index) = self.relay_for(dboid) {
            self.relays[index].reap_requested.store(true, SeqCst);
            self.wake_worker(index);
        }
    }

    /// Whether a reap was requested since the last call (the worker's side).
    pub fn take_reap_request(&self, index: usize) -> bool {
        self.relays[index].reap_requested.swap(false, SeqCst)
    }

    /// The calling worker is exiting: its queue no longer has a worker (committing
    /// backends send their own NOTIFYs until the next one attaches), and the launcher is
    /// woken to start that one.
    pub fn detach_relay(&self, index: usize) {
        // SAFETY: MyProcPid is set at process start.
        let me = unsafe { pg_sys::MyProcPid };
        // Only our own pid: a worker refused by attach_relay never took the queue.
        let _ = self.relays[index]
            .worker_pid
            .compare_exchange(me, 0, SeqCst, SeqCst);
        self.wake_launcher();
    }

    /// The calling worker, started as launch number `launch`, got through its first round.
    pub fn worker_ready(&self, index: usize, launch: u32) {
        self.relays[index].ready_launch.store(launch, SeqCst);
    }

    /// Whether the worker started as launch number `launch` for `dboid` got through its
    /// first round.
    pub fn was_ready(&self, dboid: pg_sys::Oid, launch: u32) -> bool {
        self.queue_of(dboid)
            .is_some_and(|q| q.ready_launch.load(SeqCst) == launch)
    }

    /// Pid of the worker serving `dboid`, if one runs.
    pub fn worker_of(&self, dboid: pg_sys::Oid) -> Option<i32> {
        self.queue_of(dboid)
            .map(|q| q.worker_pid.load(SeqCst))
            .filter(|&pid| pid != 0)
    }

    /// Databases that have a queue but no worker: the launcher frees the queues of those
    /// that no longer exist (`release_relay`).
    pub fn idle_relays(&self) -> Vec<pg_sys::Oid> {
        self.relays
            .iter()
            .filter(|q| q.dboid.load(SeqCst) != 0 && q.worker_pid.load(SeqCst) == 0)
            .map(|q| pg_sys::Oid::from(q.dboid.load(SeqCst)))
            .collect()
    }

    /// Free the queue of `dboid`, a database that no longer exists, for another database;
    /// keys left in it are dropped. Without this, each database dropped and created again
    /// would keep a queue until the server restarts. Safe because no backend is connected
    /// to a database that does not exist, so none is between `reserve` and `push`.
    pub fn release_relay(&self, dboid: pg_sys::Oid) {
        let _guard = Locked::exclusive(lock(0));
        let Some(index) = self
            .relays
            .iter()
            .position(|q| q.dboid.load(SeqCst) == dboid.to_u32())
        else {
            return;
        };
        let queue = &self.relays[index];
        if queue.worker_pid.load(SeqCst) != 0 {
            return;
        }
        self.ring(index, |ring| ring.clear());
        queue.reap_requested.store(false, SeqCst);
        queue.ready_launch.store(0, SeqCst);
        queue.dboid.store(0, SeqCst);
    }

    /// The calling process is the launcher: workers set its latch when they exit.
    pub fn set_launcher(&self) {
        self.launcher_proc_number
            .store(pg_compat::my_proc_number(), SeqCst);
        // SAFETY: MyProcPid is set at process start.
        self.launcher_pid
            .store(unsafe { pg_sys::MyProcPid }, SeqCst);
    }

    /// The calling launcher is exiting.
    pub fn clear_launcher(&self) {
        // SAFETY: MyProcPid is set at process start.
        let me = unsafe { pg_sys::MyProcPid };
        let _ = self.launcher_pid.compare_exchange(me, 0, SeqCst, SeqCst);
    }

    fn wake_launcher(&self) {
        if self.launcher_pid.load(SeqCst) != 0 {
            // SAFETY: SetLatch on another process's latch is what latches are for.
            unsafe { pg_sys::SetLatch(latch_of(self.launcher_proc_number.load(SeqCst))) };
        }
    }

    /// A number no earlier worker start had (wrapping after 4 billion starts; 0 is never
    /// given, so a queue's `ready_launch` of 0 matches no worker).
    pub fn next_launch(&self) -> u32 {
        loop {
            let n = self.launches.fetch_add(1, SeqCst).wrapping_add(1);
            if n != 0 {
                return n;
            }
        }
    }

    /// Promise `bytes` of queue space to a committing transaction; false if full.
    pub fn reserve(&self, index: usize, bytes: u64) -> bool {
        self.ring(index, |ring| ring.reserve(bytes))
    }

    /// Give back a promise that will not be used (the transaction aborted).
    pub fn unreserve(&self, index: usize, bytes: u64) {
        self.ring(index, |ring| ring.unreserve(bytes));
    }

    /// Append `keys` using the space reserved for them, and wake the worker if it may be
    /// asleep: a worker sleeps only after finding its queue empty, and drains it all once
    /// woken, so only the first key after it emptied the queue needs to wake it.
    pub fn push(&self, index: usize, keys: &[String], reserved: u64) {
        if self.ring(index, |ring| ring.push(keys, reserved)) {
            self.wake_worker(index);
        }
    }

    /// Read up to `max` queued keys without removing them (the worker's side), and the
    /// position to `consume` up to once they are sent.
    pub fn peek(&self, index: usize, max: usize) -> (Vec<String>, u64) {
        self.ring(index, |ring| ring.peek(max))
    }

    /// Remove the keys read by `peek` up to `position`.
    pub fn consume(&self, index: usize, position: u64) {
        self.ring(index, |ring| ring.consume(position));
    }

    /// Bytes a list of keys takes in a relay queue.
    pub fn queue_bytes(keys: &[String]) -> u64 {
        RelayRing::<RELAY_BYTES>::bytes_for(keys)
    }

    /// Workers serving `dboid` right now: 0 or 1 (see attach_relay).
    pub fn workers_serving(&self, dboid: pg_sys::Oid) -> i32 {
        i32::from(self.worker_of(dboid).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::RelayRing;

    fn ring<const N: usize>() -> Box<RelayRing<N>> {
        Box::new(RelayRing {
            head: 0,
            tail: 0,
            reserved: 0,
            data: [0; N],
        })
    }

    fn keys(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Reserve, then push, as a committing transaction does.
    fn hand_over<const N: usize>(ring: &mut RelayRing<N>, names: &[&str]) -> bool {
        let keys = keys(names);
        let bytes = RelayRing::<N>::bytes_for(&keys);
        assert!(ring.reserve(bytes), "room for {names:?}");
        ring.push(&keys, bytes)
    }

    #[test]
    fn keys_come_out_in_order_and_stay_until_consumed() {
        let mut ring = ring::<64>();
        assert!(
            hand_over(&mut ring, &["a", "bb"]),
            "the first push finds the ring empty"
        );
        assert!(!hand_over(&mut ring, &["ccc"]), "later pushes do not");
        let (all, end) = ring.peek(10);
        assert_eq!(all, keys(&["a", "bb", "ccc"]));
        assert_eq!(ring.peek(10).0, all, "peek removes nothing");
        let (first_two, position) = ring.peek(2);
        assert_eq!(first_two, keys(&["a", "bb"]));
        ring.consume(position);
        assert_eq!(ring.peek(10).0, keys(&["ccc"]));
        ring.consume(end);
        assert_eq!(ring.peek(10), (vec![], end));
        assert!(
            hand_over(&mut ring, &["d"]),
            "empty again once all is consumed"
        );
    }

    #[test]
    fn keys_wrap_around_the_end_of_the_ring() {
        let mut ring = ring::<16>();
        for round in 0..20 {
            let key = format!("key-{round}"); // 2 + 5 or 6 bytes: crosses the end often
            hand_over(&mut ring, &[&key]);
            let (got, position) = ring.peek(1);
            assert_eq!(got, vec![key]);
            ring.consume(position);
        }
        assert!(
            ring.head > 16 * 5,
            "positions kept growing past the ring's size"
        );
    }

    #[test]
    fn a_full_ring_refuses_a_promise_until_keys_are_consumed() {
        let mut ring = ring::<16>();
        hand_over(&mut ring, &["0123456789"]); // 12 of 16 bytes
        assert!(!ring.reserve(5), "12 + 5 > 16");
        assert!(ring.reserve(4), "12 + 4 fits exactly");
        assert!(!ring.reserve(1), "promised bytes count as used");
        ring.unreserve(4);
        assert!(ring.reserve(3));
        ring.unreserve(3);
        let (_, position) = ring.peek(1);
        ring.consume(position);
        assert!(ring.reserve(16), "all of it is free again");
    }

    #[test]
    fn a_cleared_ring_is_empty_and_promises_nothing() {
        let mut ring = ring::<16>();
        hand_over(&mut ring, &["0123456789"]);
        assert!(ring.reserve(4));
        ring.clear();
        let (keys, position) = ring.peek(10);
        assert!(keys.is_empty());
        assert_eq!(position, ring.head, "positions keep growing");
        assert!(ring.reserve(16), "all of it is free again");
    }

    #[test]
    fn keys_keep_their_bytes() {
        let mut ring = ring::<64>();
        let names = ["ключ", "'; DROP TABLE x; --", "line\nbreak", ""];
        hand_over(&mut ring, &names);
        assert_eq!(ring.peek(10).0, keys(&names));
    }

    #[test]
    fn a_longest_key_fits_its_length_prefix() {
        let mut ring = ring::<16384>();
        let long = "x".repeat(7500);
        hand_over(&mut ring, &[&long, "after"]);
        assert_eq!(ring.peek(10).0, vec![long, "after".to_string()]);
    }
}
