//! claim_key and claim_next, as the SQL surface calls them: without `wait`, one look (and
//! for claim_key a few more while another transaction changes the key's row for an
//! instant); with it, look, and while there is nothing to take, sleep (runtime::wait)
//! until something changes or the wait runs out.
//!
//! Each look takes its locks only if it can have them at once and releases them at once,
//! and a look that would write (claim) waits for another transaction's lock at most until
//! the deadline: an uncommitted or prepared claim, or DDL on once.entries, make the call
//! answer at its deadline instead of blocking past it.
//!
//! On a hot standby nothing wakes a waiter (the wake-ups come from commits on the primary):
//! a waiting claim_key polls every once.poll_interval there, as without shared memory, and
//! answers `wait` early once replay waits for it (protocol::standby).

use crate::key::Key;
use crate::protocol::claim::{self, Claim};
use crate::protocol::queue::{self, Claimed};
use crate::protocol::standby;
use crate::runtime::liveness::{Owner, OwnerWatch};
use crate::runtime::wait::{self, Waiter, SAFETY_SLEEP_MICROS, SHORT_POLL_MICROS};
use crate::storage::subxact::LockBudget;
use pgrx::datum::Interval;

/// What is left of the wait for a write to wait for another transaction's lock.
fn budget(waiter: &Waiter) -> LockBudget {
    LockBudget(waiter.millis_left())
}

/// Look at the key until it is decided or `wait_micros` have passed. Sleeps until woken by
/// the key's resolution or its owner's exit, until just after the owner's lease runs out
/// (the claim may then be taken over), or at most SAFETY_SLEEP.
/// A stale answer (serve_stale) never waits.
pub fn claim_key(
    key: &Key,
    lease: Interval,
    owner: Owner,
    wait_micros: i128,
    serve_stale: bool,
    fingerprint: Option<&[u8]>,
) -> Claim {
    if wait_micros <= 0 {
        return claim_key_at_once(key, lease, owner, serve_stale, fingerprint);
    }
    let mut waiter = Waiter::new(key.tag, wait_micros);
    let mut watch = OwnerWatch::default();
    loop {
        waiter.before_look();
        let budget = budget(&waiter);
        let claim = claim::attempt(
            key,
            lease,
            owner,
            &mut watch,
            budget,
            serve_stale,
            fingerprint,
        );
        let Claim::Wait {
            lease_expires_at,
            uncommitted,
            ..
        } = &claim
        else {
            return claim;
        };
        // No early return when the owner is this very backend: behind a pool, the claim
        // may belong to another client whose calls ran on this server connection.
        let remaining = waiter.remaining();
        if remaining <= 0 {
            return claim;
        }
        // On a standby, this statement's snapshot may be what holds replay back, and with
        // it the change it waits for: answer now (protocol::standby).
        if standby::active() && standby::replay_waits() {
            return claim;
        }
        let sleep = if *uncommitted {
            // Nobody wakes us when another transaction commits or aborts its claim.
            SHORT_POLL_MICROS
        } else if waiter.is_woken_by_changes() && !standby::active() {
            let now = wait::now() as i128;
            let lease_end = lease_expires_at.map_or(i128::MAX, |t| t.into_inner() as i128);
            let lease_left = lease_end.saturating_sub(now) + 1000;
            lease_left.clamp(1000, SAFETY_SLEEP_MICROS)
        } else {
            Waiter::poll_interval()
        };
        waiter.sleep(sleep);
    }
}

/// How long a call with `wait => 0` looks again at a key whose row another transaction is
/// changing right now. A completion, heartbeat or the worker's reclaim commits within
/// moments, and a lock on the table (its extension, autovacuum's truncation) passes as
/// quickly; answering `wait` then would send the caller to wait for an announcement that
/// may never come (the key is free, or its owner alive), as CI saw on loaded machines.
const PASSING_LOCK_MICROS: i128 = 100_000;

/// claim_key with `wait => 0`: waits for no other claim, committed or not (an uncommitted
/// one whose version it can read is answered `wait` at once). Only while another
/// transaction writes the key's row, or the table is locked for an instant, does it look
/// again, for PASSING_LOCK_MICROS at most. The first look costs what it did before: a hit
/// registers no waiter.
fn claim_key_at_once(
    key: &Key,
    lease: Interval,
    owner: Owner,
    serve_stale: bool,
    fingerprint: Option<&[u8]>,
) -> Claim {
    let mut watch = OwnerWatch::default();
    let mut look = |budget| {
        claim::attempt(
            key,
            lease,
            owner,
            &mut watch,
            budget,
            serve_stale,
            fingerprint,
        )
    };
    let started = wait::now() as i128;
    let claim = look(LockBudget((PASSING_LOCK_MICROS / 1000) as i64));
    if !passing(&claim) || standby::active() {
        return claim;
    }
    let left = PASSING_LOCK_MICROS - (wait::now() as i128 - started);
    if left <= 0 {
        return claim;
    }
    let mut waiter = Waiter::new(key.tag, left);
    loop {
        waiter.sleep(SHORT_POLL_MICROS);
        waiter.before_look();
        let claim = look(budget(&waiter));
        if !passing(&claim) || waiter.remaining() <= 0 {
            return claim;
        }
    }
}

/// An answer `wait` that names nobody: another transaction is writing the key's row right
/// now, or a lock kept the look from reading it.
fn passing(claim: &Claim) -> bool {
    matches!(
        claim,
        Claim::Wait {
            uncommitted: true,
            owner: None,
            ..
        }
    )
}

/// Claim up to `n` due keys of `queue`, waiting up to `wait_micros` for one to become due.
/// Each look runs in a subtransaction that is rolled back when it finds nothing, so the
/// wait holds no lock. Woken after the commit of whatever makes a key of the queue due
/// now (enqueue_key, a failure, release or reaped claim sending a key back); sleeps no
/// longer than until the earliest queued key's due time (a backoff ending).
pub fn claim_next(
    queue_name: &str,
    lease: Interval,
    worker: Option<&str>,
    owner: Owner,
    n: i32,
    wait_micros: i128,
) -> Vec<Claimed> {
    if wait_micros <= 0 {
        return queue::claim_next(queue_name, lease, worker, owner, n);
    }
    let mut waiter = Waiter::new(wait::queue_tag(queue_name), wait_micros);
    loop {
        waiter.before_look();
        if let Ok(claimed) =
            queue::claim_next_within(queue_name, lease, worker, owner, n, budget(&waiter))
        {
            if !claimed.is_empty() {
                return claimed;
            }
        }
        if waiter.remaining() <= 0 {
            return Vec::new();
        }
        let sleep = if waiter.is_woken_by_changes() {
            match queue::next_due(queue_name, budget(&waiter)) {
                // A key that is due already but was not ours to take (another worker is
                // claiming it): look again shortly.
                Ok(Some(due)) => {
                    let now = wait::now() as i128;
                    (due.into_inner() as i128 - now).max(SHORT_POLL_MICROS)
                }
                Ok(None) => SAFETY_SLEEP_MICROS,
                Err(_) => SHORT_POLL_MICROS,
            }
            .min(SAFETY_SLEEP_MICROS)
        } else {
            Waiter::poll_interval()
        };
        waiter.sleep(sleep);
    }
}
