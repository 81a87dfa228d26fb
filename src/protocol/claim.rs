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
use crate::protocol::decision::{self, decide, Caller, Decision, Observe, OwnerStatus, Seen};
use crate::protocol::freshness;
use crate::protocol::namespace;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::liveness::{Me, Owner, OwnerWatch};
use crate::runtime::shmem::{self, Counter};
use crate::storage::entry::{self, Entry};
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
    /// answers (protocol::decision).
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
    /// stands for. Nothing was changed (see `decision::Seen::mismatches`).
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
/// or a claim). `fingerprint`: the caller's request, stored with a claim it takes and
/// compared with the key's. What a look decides is protocol::decision's; this carries it
/// out.
pub fn attempt(
    key: &Key,
    lease: Interval,
    owner: Owner,
    watch: &mut OwnerWatch,
    budget: LockBudget,
    serve_stale: bool,
    fingerprint: Option<&[u8]>,
) -> Claim {
    loop {
        check_for_interrupts!();
        let entry = match entry::read(key) {
            Ok(entry) => entry,
            Err(Blocked) => return busy(None),
        };
        let caller = Caller {
            standby: standby::active(),
            serve_stale,
        };
        let seen = entry.as_ref().map(|e| Seen::of(e, fingerprint));
        let mut look = Look::new(key, entry.as_ref(), Some(&mut *watch));
        let decision = decide(seen.as_ref(), caller, &mut look);
        let pending = look.pending.take();
        let Some(entry) = entry else {
            if decision != Decision::Insert {
                return busy(pending.as_ref());
            }
            match insert_claim(key, lease, owner, budget, fingerprint) {
                Ok(Some(taken)) => return Claim::Claimed { taken, kept: None },
                Ok(None) => continue, // someone else inserted it first: look again
                Err(Blocked) => return busy(None),
            }
        };
        let seen = seen.expect("a row was seen");
        return match decision {
            Decision::Insert => unreachable!("a row was seen"),
            Decision::Busy => busy(None),
            Decision::Mismatch => Claim::Mismatch,
            Decision::Hit => hit(entry),
            Decision::EarlyRefresh => {
                // Losing the race for it, or meeting another transaction's lock, is a hit:
                // a refresh the caller can do without never waits for a lock (1 ms, as the
                // SQL edition's lock_timeout), whatever its `wait`.
                let at_once = LockBudget(1);
                match take_claim(key, &entry, lease, owner, None, at_once, true, fingerprint) {
                    Ok(Some(taken)) => refreshing(taken, entry, serve_stale),
                    _ => hit(entry),
                }
            }
            Decision::Failed => Claim::Failed {
                error: entry.error,
                retry_at: entry.retry_at,
                attempts: entry.attempts,
            },
            Decision::Wait => Claim::Wait {
                owner: entry.owner,
                lease_expires_at: entry.lease_expires_at,
                attempts: Some(entry.attempts),
                uncommitted: false,
            },
            Decision::Stale { refreshing } => stale_result(entry, refreshing),
            Decision::Take { keep, gone } => {
                let taken = take_claim(key, &entry, lease, owner, gone, budget, keep, fingerprint);
                match taken {
                    Ok(Some(taken)) if keep => refreshing(taken, entry, serve_stale),
                    Ok(Some(taken)) => Claim::Claimed { taken, kept: None },
                    Ok(None) => continue, // the key changed between our read and our write
                    Err(Blocked) => match decision::when_held(&seen, caller) {
                        Decision::Stale { refreshing } => stale_result(entry, refreshing),
                        _ => busy(None),
                    },
                }
            }
        };
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
    let caller = Caller {
        standby: standby::active(),
        serve_stale: false,
    };
    let seen = Seen::of(&entry, None);
    // A fresh result: its owner is never judged, so the look needs no watch.
    match decide(Some(&seen), caller, &mut Look::new(key, Some(&entry), None)) {
        Decision::Hit => hit(entry).into_result(),
        Decision::EarlyRefresh => {
            freshness::owe_early_refresh(&entry);
            None
        }
        _ => None,
    }
}

/// The fresh result of `entry`, counted as a hit.
fn hit(entry: Entry) -> Claim {
    shmem::count(Counter::Hits);
    Claim::Hit {
        result: entry.result.expect("fresh means a result"),
        expires_at: entry.expires_at,
        attempts: entry.attempts,
    }
}

impl Claim {
    fn into_result(self) -> Option<Jsonb> {
        match self {
            Claim::Hit { result, .. } => Some(result),
            _ => None,
        }
    }
}

/// The facts protocol::decision asks of a look at `key`, observed when asked.
struct Look<'a> {
    key: &'a Key<'a>,
    entry: Option<&'a Entry>,
    watch: Option<&'a mut OwnerWatch>,
    /// For an absent key: the uncommitted version another transaction is inserting, if it
    /// could be read (what `busy` answers).
    pending: Option<Entry>,
}

impl<'a> Look<'a> {
    fn new(key: &'a Key<'a>, entry: Option<&'a Entry>, watch: Option<&'a mut OwnerWatch>) -> Self {
        Look {
            key,
            entry,
            watch,
            pending: None,
        }
    }

    fn entry(&self) -> &'a Entry {
        self.entry.expect("asked only about a row that was seen")
    }
}

impl Observe for Look<'_> {
    fn owner(&mut self) -> OwnerStatus {
        let entry = self.entry();
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
        let watch = self
            .watch
            .as_mut()
            .expect("a look that judges owners has a watch");
        if watch.alive(pid, started) {
            OwnerStatus::Alive
        } else {
            OwnerStatus::Gone("backend exited")
        }
    }

    fn early_refresh_drawn(&mut self) -> bool {
        freshness::draws_early_refresh(self.entry())
    }

    fn held_elsewhere(&mut self) -> bool {
        match self.entry {
            Some(entry) => entry::held_elsewhere(entry),
            None => match entry::uncommitted(self.key) {
                Ok(None) => false,
                Ok(Some(pending)) => {
                    self.pending = Some(pending);
                    true
                }
                Err(Blocked) => true,
            },
        }
    }
}

/// A claim that kept `entry`'s result: answered `refresh` to a caller that takes stale
/// answers, `claimed` (with the result) to one that does not.
fn refreshing(taken: Taken, entry: Entry, serve_stale: bool) -> Claim {
    shmem::count(Counter::Refreshes);
    let kept = Kept {
        result: entry.result.expect("a refresh keeps a result"),
        expires_at: entry.expires_at,
    };
    if serve_stale {
        Claim::Refresh { taken, kept }
    } else {
        Claim::Claimed {
            taken,
            kept: Some(kept),
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
