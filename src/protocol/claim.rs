//! Taking a key (claim_key, once.get): one look at its row, and the claim when it may be
//! claimed.
//!
//! Each write is one short statement, run as a plan prepared once per backend. None takes
//! a lock that outlives the caller's own (short) transaction, so a computation in progress
//! holds no lock at all: its claim is a committed row with a token. Two callers racing to
//! claim the same key both write `WHERE token = <what I saw>`; the second one blocks on
//! the first one's row lock, then finds the token changed and starts over, so a key never
//! has two owners.
//!
//! A claim never waits long for someone else's transaction: it does not write a row that
//! a transaction in progress holds (or a key such a transaction is inserting) but answers
//! `wait`, and the write itself gives up when what is left of the caller's `wait` runs
//! out (see storage::subxact). Only two claims racing within the same instant block on
//! each other, for as long as the first one's statement takes.
//!
//! On a hot standby every write here is refused before it starts, and a running key is
//! answered `wait` without judging its owner (see protocol::standby). The other stages of
//! a claim: resolve (its owner's writes), rerun (refresh_key, invalidate_key), reap.

use crate::key::Key;
use crate::protocol::freshness;
use crate::protocol::namespace;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::liveness::{Me, Owner, OwnerWatch};
use crate::runtime::shmem::{self, Counter};
use crate::storage::entry::{self, Entry, KeyState};
use crate::storage::jsonb::Jsonb;
use crate::storage::statements::{self, params, Param, Statement};
use crate::storage::subxact::{self, Blocked, LockBudget};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::prelude::*;

/// What a claim attempt decided (the `outcome` of once.claim plus its details).
pub enum Claim {
    Hit {
        result: Jsonb,
        expires_at: Option<TimestampWithTimeZone>,
        attempts: i32,
    },
    /// The caller owns the key now. `kept`: the result of a claim that keeps it (a
    /// refresh), answered with outcome `claimed` to a caller that does not take stale
    /// answers (StaleRule).
    Claimed { taken: Taken, kept: Option<Kept> },
    /// A claim that keeps the previous result, served to others while it is recomputed:
    /// a result in its stale window, a fresh one that drew an early refresh, or one whose
    /// refresher failed or is gone. Answered only to a caller that takes stale answers.
    Refresh { taken: Taken, kept: Kept },
    /// Someone else holds the key. All but `uncommitted` are NULL in the answer when
    /// another transaction is writing the key right now and has not committed (a claim
    /// made in a transaction block that is still open, or prepared): then only that
    /// transaction's end can tell, and what its uncommitted claim says is all we know.
    /// (Never the owner's token: see api::cache's answer.)
    Wait {
        owner: Option<String>,
        lease_expires_at: Option<TimestampWithTimeZone>,
        attempts: Option<i32>,
        /// Another transaction is writing the key: look again soon, nobody will wake us.
        uncommitted: bool,
    },
    Failed {
        error: Option<String>,
        retry_at: Option<TimestampWithTimeZone>,
        attempts: i32,
    },
    /// The previous result, past its ttl but within its stale window, while someone
    /// refreshes it (or, after a failed refresh, until retry_at). Never waits.
    Stale {
        owner: Option<String>,
        lease_expires_at: Option<TimestampWithTimeZone>,
        result: Jsonb,
        expires_at: Option<TimestampWithTimeZone>,
        error: Option<String>,
        attempts: i32,
    },
    /// The key's current attempt was claimed with another fingerprint and still counts (it
    /// runs, or its result is served): this caller's request is not the one the key
    /// stands for. Nothing was changed (see `mismatches`).
    Mismatch,
}

/// A claim this call took.
pub struct Taken {
    pub token: i64,
    pub owner: String,
    pub lease_expires_at: TimestampWithTimeZone,
    pub attempts: i32,
}

/// The previous result a refresh keeps, served to others while it is recomputed.
pub struct Kept {
    pub result: Jsonb,
    pub expires_at: Option<TimestampWithTimeZone>,
}

static INSERT_CLAIM: Statement = statement!("insert_claim");

static TAKE_CLAIM: Statement = statement!("take_claim");

/// One look at the key, claiming it if it may be claimed. Never waits for the owner, and
/// waits for another transaction's lock at most `budget`. `serve_stale`: the caller takes
/// the answers `refresh` and `stale`; otherwise it is answered as before they existed (a
/// refresh as `claimed`, a stale result as the state of the key says: `wait`, `failed`,
/// or a claim). What it changes is decided in one place, StaleRule. `fingerprint`: the
/// caller's request, stored with a claim it takes and compared with the key's (`mismatches`).
pub fn attempt(
    key: &Key,
    lease: Interval,
    owner: Owner,
    watch: &mut OwnerWatch,
    budget: LockBudget,
    serve_stale: bool,
    fingerprint: Option<&[u8]>,
) -> Claim {
    let rule = StaleRule { serve_stale };
    loop {
        check_for_interrupts!();
        let entry = match entry::read(key) {
            Ok(entry) => entry,
            Err(Blocked) => return busy(None),
        };
        let Some(entry) = entry else {
            // Absent to us, but maybe claimed by a transaction that has not committed:
            // inserting would wait for it, so report it as held instead.
            match entry::uncommitted(key) {
                Ok(None) => {}
                Ok(Some(pending)) => return busy(Some(&pending)),
                Err(Blocked) => return busy(None),
            }
            match insert_claim(key, lease, owner, budget, fingerprint) {
                Ok(Some(taken)) => return Claim::Claimed { taken, kept: None },
                Ok(None) => continue, // someone else inserted it first: look again
                Err(Blocked) => return busy(None),
            }
        };
        if mismatches(&entry, fingerprint) {
            return Claim::Mismatch;
        }
        if entry.fresh() {
            // A fresh result, also while the key is recomputed (a refresh, an early one, a
            // queued key enqueued with refresh): it is served until the new one lands. A
            // done key may draw an early refresh; losing the race for it is a hit.
            if draws_early_refresh(&entry) {
                let early = take_claim(key, &entry, lease, owner, None, budget, true, fingerprint);
                if let Ok(Some(taken)) = early {
                    return rule.refreshing(taken, entry);
                }
            }
            shmem::count(Counter::Hits);
            return Claim::Hit {
                result: entry.result.expect("fresh means a result"),
                expires_at: entry.expires_at,
                attempts: entry.attempts,
            };
        }
        let gone_reason = match entry.state {
            KeyState::Failed if entry.retry_later() => {
                return rule.unavailable(entry, Unavailable::Failed);
            }
            // On a standby its owner is a backend of the primary: only the primary can
            // judge it.
            KeyState::Running if standby::active() => {
                return rule.unavailable(entry, Unavailable::Owned);
            }
            KeyState::Running => match running_owner_status(&entry, watch) {
                OwnerStatus::Alive => return rule.unavailable(entry, Unavailable::Owned),
                OwnerStatus::Gone(why) => Some(why),
            },
            // A queue's worker will recompute it.
            KeyState::Queued if rule.serves_stale(&entry) => return stale_result(entry, false),
            _ => None, // expired result, failure due for retry, or queued
        };
        // A result in its stale window is served while it cannot be refreshed: on a
        // standby (nothing is claimed there), or while another transaction is changing
        // the row (the write would wait for it: a stale answer never waits).
        if rule.serves_stale(&entry) && standby::active() {
            return stale_result(entry, false);
        }
        if entry::held_elsewhere(&entry) {
            return rule.unavailable(entry, Unavailable::Busy);
        }
        let keep = entry.servable_stale();
        let taken = take_claim(
            key,
            &entry,
            lease,
            owner,
            gone_reason,
            budget,
            keep,
            fingerprint,
        );
        match taken {
            Ok(Some(taken)) if keep => return rule.refreshing(taken, entry),
            Ok(Some(taken)) => return Claim::Claimed { taken, kept: None },
            Ok(None) => {} // the key changed between our read and our write: look again
            Err(Blocked) => return rule.unavailable(entry, Unavailable::Busy),
        }
    }
}

/// once.get: the result claim_key would answer `hit` with, counted as a hit; None whenever
/// claim_key would answer anything else (absent, running, failed, past its ttl even within
/// its stale window, another transaction writing the key, or a fresh result whose read
/// draws an early refresh), so that the caller asks claim_key instead. Writes nothing and
/// claims nothing. A drawn early refresh is owed to this session's next claim
/// (freshness::owe_early_refresh): drawn again there, a refresh would be taken with the
/// square of its probability.
pub fn get(key: &Key) -> Option<Jsonb> {
    let entry = entry::read(key).ok()??;
    if !entry.fresh() {
        return None;
    }
    if draws_early_refresh(&entry) {
        freshness::owe_early_refresh(&entry);
        return None;
    }
    shmem::count(Counter::Hits);
    entry.result
}

/// Does this read of a fresh result take an early refresh? Only a done key may (not one
/// already being recomputed), never on a standby, and not while another transaction
/// writes the row (the claim could not be taken).
fn draws_early_refresh(entry: &Entry) -> bool {
    entry.state == KeyState::Done
        && !standby::active()
        && freshness::draws_early_refresh(entry)
        && !entry::held_elsewhere(entry)
}

/// Is the caller's request (`fingerprint`) not the one `entry`'s current attempt was
/// claimed for, while that attempt still counts? It counts while the key runs (its owner
/// alive or not: a takeover is a retry of the same request) and while its result is
/// served (fresh, or in its stale window). A key without a fingerprint, or a caller
/// without one, never mismatches: absent fingerprints behave as before they existed. Once
/// the attempt no longer counts (failed, result expired, released, invalidated) a claim
/// takes the key and stores its own fingerprint; a failure still served until retry_at
/// is answered `failed` to every caller, as before.
fn mismatches(entry: &Entry, fingerprint: Option<&[u8]>) -> bool {
    let (Some(theirs), Some(mine)) = (entry.fingerprint.as_deref(), fingerprint) else {
        return false;
    };
    theirs != mine && (entry.state == KeyState::Running || entry.fresh() || entry.servable_stale())
}

/// Why a key past its ttl cannot be handed to this caller now.
enum Unavailable {
    /// Its failure is served until retry_at.
    Failed,
    /// Its (live) owner is computing it.
    Owned,
    /// Another transaction is changing the row: the write would wait for it.
    Busy,
}

/// What a key that is past its ttl, or being refreshed, answers: the one place where
/// `serve_stale` (claim_key's argument) changes an answer.
#[derive(Clone, Copy)]
struct StaleRule {
    serve_stale: bool,
}

impl StaleRule {
    /// The caller is answered `entry`'s result as stale rather than wait, fail or claim:
    /// it is in its stale window, and the caller takes stale answers.
    fn serves_stale(self, entry: &Entry) -> bool {
        self.serve_stale && entry.servable_stale()
    }

    /// The answer for a key the caller cannot have now: its stale result if it serves
    /// one, else what `why` says.
    fn unavailable(self, entry: Entry, why: Unavailable) -> Claim {
        if self.serves_stale(&entry) {
            // Only a live owner refreshes it: the others answer no owner.
            return stale_result(entry, matches!(why, Unavailable::Owned));
        }
        match why {
            Unavailable::Failed => Claim::Failed {
                error: entry.error,
                retry_at: entry.retry_at,
                attempts: entry.attempts,
            },
            Unavailable::Owned => Claim::Wait {
                owner: entry.owner,
                lease_expires_at: entry.lease_expires_at,
                attempts: Some(entry.attempts),
                uncommitted: false,
            },
            Unavailable::Busy => busy(None),
        }
    }

    /// A claim that kept `entry`'s result: answered `refresh` to a caller that takes stale
    /// answers, `claimed` (with the result) to one that does not.
    fn refreshing(self, taken: Taken, entry: Entry) -> Claim {
        shmem::count(Counter::Refreshes);
        let kept = Kept {
            result: entry.result.expect("a refresh keeps a result"),
            expires_at: entry.expires_at,
        };
        if self.serve_stale {
            Claim::Refresh { taken, kept }
        } else {
            Claim::Claimed {
                taken,
                kept: Some(kept),
            }
        }
    }
}

/// `entry`'s result served as stale; `refreshing`: its owner is refreshing it.
fn stale_result(entry: Entry, refreshing: bool) -> Claim {
    shmem::count(Counter::Stale);
    Claim::Stale {
        owner: entry.owner.filter(|_| refreshing),
        lease_expires_at: entry.lease_expires_at.filter(|_| refreshing),
        result: entry.result.expect("stale means a result"),
        expires_at: entry.expires_at,
        error: entry.error,
        attempts: entry.attempts,
    }
}

/// The answer while another transaction writes the key: what its uncommitted version
/// says, if we could read it.
fn busy(pending: Option<&Entry>) -> Claim {
    Claim::Wait {
        owner: pending.and_then(|e| e.owner.clone()),
        lease_expires_at: pending.and_then(|e| e.lease_expires_at),
        attempts: pending.map(|e| e.attempts),
        uncommitted: true,
    }
}

enum OwnerStatus {
    Alive,
    Gone(&'static str),
}

fn running_owner_status(entry: &Entry, watch: &mut OwnerWatch) -> OwnerStatus {
    if entry.lease_expired() {
        return OwnerStatus::Gone("lease expired");
    }
    if entry.lease_only {
        return OwnerStatus::Alive;
    }
    let pid = entry.owner_pid.expect("running has an owner pid");
    let started = entry
        .owner_started
        .expect("running has an owner start")
        .into_inner();
    if watch.alive(pid, started) {
        OwnerStatus::Alive
    } else {
        OwnerStatus::Gone("backend exited")
    }
}

fn claimed_from(table: pgrx::spi::SpiTupleTable<'_>, me: &Me) -> pgrx::spi::Result<Option<Taken>> {
    if table.is_empty() {
        return Ok(None);
    }
    shmem::count(Counter::Claimed);
    let row = table.first();
    Ok(Some(Taken {
        token: row.get_by_name("token")?.expect("token is NOT NULL"),
        lease_expires_at: row
            .get_by_name("lease_expires_at")?
            .expect("a claim has a lease"),
        attempts: row.get_by_name("attempts")?.unwrap_or(1),
        owner: me.label.clone(),
    }))
}

fn insert_claim(
    key: &Key,
    lease: Interval,
    owner: Owner,
    budget: LockBudget,
    fingerprint: Option<&[u8]>,
) -> Result<Option<Taken>, Blocked> {
    let args = params![
        key_hash = key.hash_param(),
        key = key.text_param(),
        fingerprint = fingerprint,
    ];
    let claim = claim_by(&INSERT_CLAIM, key, args, lease, owner, budget)?;
    if claim.is_some() {
        namespace::recheck_key(key.text, "claim_key");
    }
    Ok(claim)
}

#[allow(clippy::too_many_arguments)] // each is one of take_claim.sql's parameters
fn take_claim(
    key: &Key,
    seen: &Entry,
    lease: Interval,
    owner: Owner,
    gone_reason: Option<&str>,
    budget: LockBudget,
    keep_result: bool,
    fingerprint: Option<&[u8]>,
) -> Result<Option<Taken>, Blocked> {
    let args = params![
        key_hash = key.hash_param(),
        seen_token = seen.token,
        seen_state = seen.state.label(),
        gone_reason = gone_reason,
        keep_result = keep_result,
        fingerprint = fingerprint,
    ];
    let claim = claim_by(&TAKE_CLAIM, key, args, lease, owner, budget)?;
    if claim.is_some() && gone_reason.is_some() {
        shmem::count(Counter::TakenOver);
    }
    Ok(claim)
}

/// Run `statement` (INSERT_CLAIM or TAKE_CLAIM) with `args` and the claimant's parameters:
/// `key` claimed for `owner` for `lease`, if the statement matches.
fn claim_by<'a>(
    statement: &'static Statement,
    key: &Key,
    args: impl IntoIterator<Item = Param<'a>>,
    lease: Interval,
    owner: Owner,
    budget: LockBudget,
) -> Result<Option<Taken>, Blocked> {
    standby::refuse_writes("claim_key");
    let me = &Me::new(None, owner);
    owner.before_claiming(Some(key.tag));
    let args = args.into_iter().chain(claimant_params(me, lease));
    // In a subtransaction: a claim that lost to a committed one leaves no lock behind, and
    // one that meets an uncommitted one gives up at the budget.
    subxact::keep_if(
        budget,
        || statements::run(statement, args, |table| claimed_from(table, me)),
        Option::is_some,
    )
}
