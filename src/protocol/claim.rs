//! The claim protocol: every write of once.entries (a key's row is read by `entry`).
//!
//! Each operation is one or two short statements, run as plans prepared once per backend.
//! They never take a lock that outlives the caller's own (short) transaction, so a
//! computation in progress holds no lock at all: its claim is a committed row with a token.
//!
//! Fencing: every write by an owner names the key *and* its token and the state
//! `running`; a write whose token is no longer current matches no row and changes nothing.
//! Two callers racing to claim the same key both write `WHERE token = <what I saw>`;
//! the second one blocks on the first one's row lock, then finds the token changed and
//! starts over, so a key never has two owners.
//!
//! A claim never waits long for someone else's transaction: it does not write a row that
//! a transaction in progress holds (or a key such a transaction is inserting) but answers
//! `wait`, and the write itself gives up when what is left of the caller's `wait` runs
//! out (see storage::subxact). Only two claims racing within the same instant block on
//! each other, for as long as the first one's statement takes.
//!
//! On a hot standby every write here is refused before it starts, and a running key is
//! answered `wait` without judging its owner (see protocol::standby).

use crate::key::Key;
use crate::protocol::freshness::{self, Policy};
use crate::protocol::namespace;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::liveness::{self, Me, Owner, OwnerWatch};
use crate::runtime::notify;
use crate::runtime::shmem::{self, Counter};
use crate::storage::entry::{self, Entry};
use crate::storage::jsonb::Jsonb;
use crate::storage::statements::{self, params, Param, Statement};
use crate::storage::subxact::{self, Blocked, LockBudget};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// What a claim attempt decided (the `outcome` of once.claim plus its details).
pub enum Claim {
    Hit {
        token: i64,
        result: Jsonb,
        expires_at: Option<TimestampWithTimeZone>,
        attempts: i32,
    },
    Claimed {
        token: i64,
        owner: String,
        lease_expires_at: TimestampWithTimeZone,
        attempts: i32,
    },
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
        token: i64,
        error: Option<String>,
        retry_at: Option<TimestampWithTimeZone>,
        attempts: i32,
    },
    /// A claim that keeps the previous result, served to others while it is recomputed:
    /// a result in its stale window, a fresh one that drew an early refresh, or one whose
    /// refresher failed or is gone. (Answered `claimed`, result set, to a caller that did
    /// not ask for serve_stale.)
    Refresh {
        claimed: Box<Claim>,
        result: Jsonb,
        expires_at: Option<TimestampWithTimeZone>,
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
}

static INSERT_CLAIM: Statement = Statement::new(concat!(
    "INSERT INTO once.entries (key_hash, key, attempts, ",
    claimant_columns!(),
    ")
     VALUES ($key_hash, $key, 1, ",
    claimant_values!(),
    ")
     ON CONFLICT (key_hash) DO NOTHING
     RETURNING token, lease_expires_at, attempts"
));

// Claims a key that exists but may be claimed: expired result, failure whose retry time has
// come, or a claim whose owner is gone ($gone_reason says why; the takeover counts as an
// error). A refresh ($keep_result) keeps the result, its expiry and its stale window, so
// that it is served to others while it is recomputed; any other claim drops them. `token = $seen_token AND state = $seen_state` makes the claim conditional on
// nothing having changed since the key was read, and a running key is taken only if its
// owner is still gone when the row is locked (a heartbeat may have just extended the
// lease). Run through subxact::keep_if, so a lost race leaves no lock behind.
static TAKE_CLAIM: Statement = Statement::new(concat!(
    "UPDATE once.entries
        SET (",
    claimant_columns!(),
    ") = (",
    claimant_values!(),
    "),
            attempts = CASE WHEN state = 'done' THEN 1 ELSE attempts + 1 END,
            errors = CASE WHEN state = 'done' THEN 0
                          WHEN state = 'running' THEN errors + 1 ELSE errors END,
            error = CASE WHEN state = 'done' THEN NULL
                         WHEN state = 'running' THEN ",
    owner_gone_error!("", "$gone_reason", "taken over"),
    "
                         ELSE error END,
            last_outcome = CASE WHEN state = 'running' THEN 'taken_over' ELSE last_outcome END,
            result = CASE WHEN $keep_result THEN result END,
            expires_at = CASE WHEN $keep_result THEN expires_at END,
            stale_until = CASE WHEN $keep_result THEN stale_until END,
            retry_at = NULL
      WHERE key_hash = $key_hash AND token = $seen_token AND state = $seen_state::once.key_state
        AND (state <> 'running' OR ",
    owner_gone!(""),
    ")
     RETURNING token, lease_expires_at, attempts"
));

// One key: the jitter's draw and the time come as parameters ($draw, $now), read just
// before the statement, rather than from a row source `FROM (SELECT random() AS draw,
// clock_timestamp() AS now) d` as complete_keys has them for each of its keys: that join
// made every complete_key plan a nested loop over a subquery, whose executor start alone
// was 4% of a claim+complete cycle's server time (perf, issue 25).
static COMPLETE: Statement = Statement::new(concat!(
    "UPDATE once.entries AS e SET ",
    completed!("$result", "$"),
    "
      WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND ",
    token_holder!(""),
    "
     RETURNING ",
    ended_attempt_columns!()
));

// The history of a queued key that complete_key completed (rules::completions_recorded).
static RECORD_COMPLETION: Statement = Statement::new(completions_recorded!(
    "(SELECT $key_hash::bytea, $key::text, $queue::text, $token::bigint, $owner::text,
             $claimed_at::timestamptz) AS ended (key_hash, key, queue, token, owner, claimed_at)"
));

// A failure is served to callers until retry_at; a queued key goes back to its queue
// instead (rules::failed_attempt).
static FAIL: Statement = Statement::new(concat!(
    "WITH policy AS (
         SELECT e.key_hash, ",
    retry_policy!(),
    "
           FROM once.entries e LEFT JOIN once.queues q ON q.name = e.queue
          WHERE e.key_hash = $key_hash AND e.token = $token AND e.state = 'running'
            AND ",
    token_holder!("e."),
    ")
     UPDATE once.entries AS e
        SET ",
    failed_attempt!("p.", "$retry_after"),
    ",
            error = $error, last_outcome = 'failed'
       FROM policy p
      WHERE e.key_hash = $key_hash AND e.key_hash = p.key_hash AND e.token = $token
        AND e.state = 'running'"
));

static HEARTBEAT: Statement = Statement::new(concat!(
    "UPDATE once.entries
        SET lease_expires_at = clock_timestamp() + $lease, updated_at = clock_timestamp()
      WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND ",
    token_holder!(""),
    "
     RETURNING lease_expires_at"
));

// A released key becomes absent, so the next caller claims it as if it were cold (tokens
// come from a sequence, so deleting the row cannot make an old token valid again); a
// released refresh goes back to serving the result it kept, and the next caller in its
// stale window refreshes it. A queued key goes back to its queue, due now, and the
// attempt does not count.
static RELEASE: Statement = Statement::new(concat!(
    "WITH gone AS (
         DELETE FROM once.entries
          WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND queue IS NULL
            AND result IS NULL AND ",
    token_holder!(""),
    "
         RETURNING 1),
     kept AS (
         UPDATE once.entries
            SET state = 'done', lease_expires_at = NULL, updated_at = clock_timestamp(),
                last_outcome = 'released', rerun = NULL, rerun_stale = NULL
          WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND queue IS NULL
            AND result IS NOT NULL AND ",
    token_holder!(""),
    "
         RETURNING 1),
     requeued AS (
         UPDATE once.entries
            SET state = 'queued', attempts = greatest(attempts - 1, 0),
                run_at = clock_timestamp(), lease_expires_at = NULL,
                updated_at = clock_timestamp(), last_outcome = 'released'
          WHERE key_hash = $key_hash AND token = $token AND state = 'running'
            AND queue IS NOT NULL AND ",
    token_holder!(""),
    "
         RETURNING 1)
     SELECT 1 FROM gone UNION ALL SELECT 1 FROM kept UNION ALL SELECT 1 FROM requeued"
));

// A key that is not running is forgotten. A running one keeps its claim (cancelling it
// would let a second computation start beside the first, whose owner does not know): its
// result, if it kept one, is no longer served, and the run's own result will not be
// either; when the run ends the key is computed once more (rules::rerun_requested).
static INVALIDATE: Statement = Statement::new(concat!(
    "WITH running AS (
         UPDATE once.entries
            SET ",
    rerun_requested!("'discard'", "NULL::interval"),
    ", result = NULL, expires_at = NULL, stale_until = NULL
          WHERE key_hash = $key_hash AND state = 'running'
         RETURNING 1),
     gone AS (
         DELETE FROM once.entries WHERE key_hash = $key_hash AND state <> 'running'
         RETURNING 1)
     SELECT 1 FROM running UNION ALL SELECT 1 FROM gone"
));

// refresh_key: expire a result now (served as stale for $stale, if given), make a failure
// claimable now, send a queued key's result back to its queue, or, on a running key,
// request one more run after this one. Answers what it did.
static REFRESH: Statement = Statement::new(concat!(
    "WITH running AS (
         UPDATE once.entries
            SET ",
    rerun_requested!(
        "CASE WHEN $stale::interval IS NULL THEN 'discard' ELSE 'stale' END",
        "$stale"
    ),
    "
          WHERE key_hash = $key_hash AND state = 'running'
         RETURNING 'rerun'::text AS what, queue),
     resolved AS (
         UPDATE once.entries
            SET expires_at = least(coalesce(expires_at, clock_timestamp()), clock_timestamp()),
                stale_until = clock_timestamp() + $stale,
                retry_at = CASE WHEN state = 'failed' THEN clock_timestamp() END,
                state = CASE WHEN queue IS NULL THEN state ELSE 'queued' END,
                run_at = CASE WHEN queue IS NULL THEN run_at ELSE clock_timestamp() END,
                attempts = CASE WHEN queue IS NULL THEN attempts ELSE 0 END,
                enqueued_at = CASE WHEN queue IS NULL THEN enqueued_at ELSE clock_timestamp() END,
                updated_at = clock_timestamp()
          WHERE key_hash = $key_hash AND state IN ('done', 'failed')
         RETURNING 'expired'::text AS what, queue),
     queued AS (
         SELECT 'pending'::text AS what, queue FROM once.entries
          WHERE key_hash = $key_hash AND state = 'queued')
     SELECT what, queue FROM running UNION ALL SELECT what, queue FROM resolved
     UNION ALL SELECT what, queue FROM queued"
));

// Claims whose owner is gone become `failed` with retry_at = now: claimable at once, the
// error recorded and counted, waiters notified by the trigger. Queued keys go back to
// their queue after a backoff, unless that was their last attempt. SKIP LOCKED: a reaper
// never waits for anybody, so any number of them can run at the same time.
static REAP_GONE_OWNERS: Statement = Statement::new(concat!(
    "WITH gone AS (
         SELECT e.key_hash,
                CASE WHEN e.lease_expires_at <= clock_timestamp() THEN 'lease expired'
                     ELSE 'backend exited' END AS why, ",
    retry_policy!(),
    "
           FROM once.entries e LEFT JOIN once.queues q ON q.name = e.queue
          WHERE e.state = 'running' AND ",
    owner_gone!("e."),
    "
            FOR UPDATE OF e SKIP LOCKED)
     UPDATE once.entries AS e
        SET ",
    failed_attempt!("g.", "'0'::interval"),
    ",
            error = ",
    owner_gone_error!("e.", "g.why", "reaped"),
    ",
            last_outcome = 'abandoned'
       FROM gone g
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM gone)) AND e.key_hash = g.key_hash"
));

// The oldest history rows past the retention, through the btree on finished_at: a probe
// of its leftmost entries, whatever the history holds. The cutoff is a scalar subquery,
// computed once before the scan (an InitPlan) and so usable as an index condition: written
// `finished_at < clock_timestamp() - ...`, a volatile condition, it is a filter and the
// planner scanned the whole table instead, 336 ms a round with 2,000,000 rows of history
// and nothing to purge (BENCHMARKS.md, "Scale"). Not statement_timestamp() or now(): in
// the worker, which receives no statements, they need not move.
//
// A call purges several batches in one transaction (PURGE_BUDGET): each starts at the last
// finished_at the batch before it deleted ($after), or it would walk again, from the left
// end, over every index entry its own transaction deleted (not yet dead to anyone: the
// 2,000,000 rows took 4.6 s to purge that way, 2.8 s this way).
static PURGE_HISTORY: Statement = Statement::new(
    "WITH purged AS (
         DELETE FROM once.attempts
          WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM once.attempts
                 WHERE finished_at < (SELECT clock_timestamp() - make_interval(secs => $retention_s))
                   AND finished_at >= coalesce($after, '-infinity')
                 ORDER BY finished_at
                 LIMIT $batch))
         RETURNING finished_at)
     SELECT count(*) AS purged, max(finished_at) AS last FROM purged",
);

// A result in its stale window is still served: it goes when the window does. (stale_until
// is never before expires_at, so the index on expires_at still finds the candidates.) The
// bound on expires_at is a scalar subquery, as in PURGE_HISTORY, so that it is an index
// condition: a volatile one is a filter, and the scan read every result with a future
// expiry before finding that none had expired.
static PURGE_EXPIRED: Statement = Statement::new(
    "WITH expired AS (
         SELECT key_hash FROM once.entries
          WHERE expires_at <= (SELECT clock_timestamp()) AND state = 'done'
            AND (stale_until IS NULL OR stale_until <= clock_timestamp())
          ORDER BY expires_at
          LIMIT $batch
            FOR UPDATE SKIP LOCKED)
     DELETE FROM once.entries AS e USING expired
      WHERE e.key_hash = ANY (ARRAY(SELECT key_hash FROM expired)) AND e.key_hash = expired.key_hash",
);

/// The parameters of rules::claimant_values: who claims, and for how long.
pub fn claimant_params(me: &Me, lease: Interval) -> [Param<'static>; 6] {
    params![
        owner_role = namespace::caller(),
        owner = me.label.clone(),
        owner_pid = me.pid,
        owner_started = me.started_param(),
        lease_only = me.lease_only,
        lease = lease,
    ]
}

/// One look at the key, claiming it if it may be claimed. Never waits for the owner, and
/// waits for another transaction's lock at most `budget`. `serve_stale`: the caller takes
/// the answers `refresh` and `stale`; otherwise it is answered as before they existed (a
/// refresh as `claimed`, a stale result as the state of the key says: `wait`, `failed`,
/// or a claim).
pub fn attempt(
    key: &Key,
    lease: Interval,
    owner: Owner,
    watch: &mut OwnerWatch,
    budget: LockBudget,
    serve_stale: bool,
) -> Claim {
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
            match insert_claim(key, lease, owner, budget) {
                Ok(Some(claim)) => return claim,
                Ok(None) => continue, // someone else inserted it first: look again
                Err(Blocked) => return busy(None),
            }
        };
        if entry.fresh() {
            // A fresh result, also while the key is recomputed (a refresh, an early one, a
            // queued key enqueued with refresh): it is served until the new one lands. A
            // done key may draw an early refresh; losing the race for it is a hit.
            if entry.state == "done"
                && !standby::active()
                && freshness::draws_early_refresh(&entry)
                && !entry::held_elsewhere(&entry)
            {
                if let Ok(Some(claim)) = take_claim(key, &entry, lease, owner, None, budget, true) {
                    return refreshing(claim, entry);
                }
            }
            shmem::count(Counter::Hits);
            return Claim::Hit {
                token: entry.token,
                result: entry.result.expect("fresh means a result"),
                expires_at: entry.expires_at,
                attempts: entry.attempts,
            };
        }
        let stale = entry.servable_stale();
        let gone_reason = match entry.state.as_str() {
            "failed" if entry.retry_later() => {
                return if stale && serve_stale {
                    stale_result(entry, false)
                } else {
                    Claim::Failed {
                        token: entry.token,
                        error: entry.error,
                        retry_at: entry.retry_at,
                        attempts: entry.attempts,
                    }
                };
            }
            // On a standby its owner is a backend of the primary: only the primary can
            // judge it.
            "running" if standby::active() => return held_by_owner(entry, serve_stale),
            "running" => match running_owner_status(&entry, watch) {
                OwnerStatus::Alive => return held_by_owner(entry, serve_stale),
                OwnerStatus::Gone(why) => Some(why),
            },
            // A queue's worker will recompute it.
            "queued" if stale && serve_stale => return stale_result(entry, false),
            _ => None, // expired result, failure due for retry, or queued
        };
        // A result in its stale window is served while it cannot be refreshed: on a
        // standby (nothing is claimed there), or while another transaction is changing
        // the row (the write would wait for it: a stale answer never waits).
        if stale && serve_stale && standby::active() {
            return stale_result(entry, false);
        }
        if entry::held_elsewhere(&entry) {
            return if stale && serve_stale {
                stale_result(entry, false)
            } else {
                busy(None)
            };
        }
        match take_claim(key, &entry, lease, owner, gone_reason, budget, stale) {
            Ok(Some(claim)) if stale => return refreshing(claim, entry),
            Ok(Some(claim)) => return claim,
            Ok(None) => {} // the key changed between our read and our write: look again
            Err(Blocked) if stale && serve_stale => return stale_result(entry, false),
            Err(Blocked) => return busy(None),
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
    // As in `attempt`: a done key may draw an early refresh, unless it cannot be taken.
    if entry.state == "done"
        && !standby::active()
        && freshness::draws_early_refresh(&entry)
        && !entry::held_elsewhere(&entry)
    {
        freshness::owe_early_refresh(&entry);
        return None;
    }
    shmem::count(Counter::Hits);
    entry.result
}

/// A claim that kept `entry`'s result.
fn refreshing(claimed: Claim, entry: Entry) -> Claim {
    shmem::count(Counter::Refreshes);
    Claim::Refresh {
        claimed: Box::new(claimed),
        result: entry.result.expect("a refresh keeps a result"),
        expires_at: entry.expires_at,
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

/// The answer for a key its (live) owner is computing: its previous result, if it is in
/// its stale window and the caller takes stale answers; else wait.
fn held_by_owner(entry: Entry, serve_stale: bool) -> Claim {
    if serve_stale && entry.servable_stale() {
        return stale_result(entry, true);
    }
    Claim::Wait {
        owner: entry.owner,
        lease_expires_at: entry.lease_expires_at,
        attempts: Some(entry.attempts),
        uncommitted: false,
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

fn claimed_from(table: pgrx::spi::SpiTupleTable<'_>, me: &Me) -> pgrx::spi::Result<Option<Claim>> {
    if table.is_empty() {
        return Ok(None);
    }
    shmem::count(Counter::Claimed);
    let row = table.first();
    Ok(Some(Claim::Claimed {
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
) -> Result<Option<Claim>, Blocked> {
    standby::refuse_writes("claim_key");
    let me = &Me::new(None, owner);
    owner.before_claiming(Some(key.tag));
    let args = params![key_hash = key.hash_param(), key = key.text_param()]
        .into_iter()
        .chain(claimant_params(me, lease));
    // In a subtransaction: an insert that lost to a committed one leaves no lock behind,
    // and one that meets an uncommitted one gives up at the budget.
    let claim = subxact::keep_if(
        budget,
        || statements::run(&INSERT_CLAIM, args, |table| claimed_from(table, me)),
        Option::is_some,
    )?;
    if claim.is_some() {
        namespace::recheck_key(key.text, "claim_key");
    }
    Ok(claim)
}

fn take_claim(
    key: &Key,
    seen: &Entry,
    lease: Interval,
    owner: Owner,
    gone_reason: Option<&str>,
    budget: LockBudget,
    keep_result: bool,
) -> Result<Option<Claim>, Blocked> {
    standby::refuse_writes("claim_key");
    let me = &Me::new(None, owner);
    owner.before_claiming(Some(key.tag));
    let args = params![
        key_hash = key.hash_param(),
        seen_token = seen.token,
        seen_state = seen.state.as_str(),
        gone_reason = gone_reason,
        keep_result = keep_result,
    ]
    .into_iter()
    .chain(claimant_params(me, lease));
    let claim = subxact::keep_if(
        budget,
        || statements::run(&TAKE_CLAIM, args, |table| claimed_from(table, me)),
        Option::is_some,
    )?;
    if claim.is_some() && gone_reason.is_some() {
        shmem::count(Counter::TakenOver);
    }
    Ok(claim)
}

/// An owner's write took effect: its claim is resolved by itself, not by its exit.
fn resolved_by_owner(key: &Key, done: bool, counter: Counter) -> bool {
    if done {
        liveness::disown(key.tag);
        shmem::count(counter);
    }
    done
}

/// Store the result of a claim, fresh and then stale as `policy` says; false when the
/// claim is no longer current.
pub fn complete(key: &Key, token: i64, result: Jsonb, policy: &Policy) -> bool {
    standby::refuse_writes("complete_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
        result = result,
        draw = freshness::jitter_draw(),
        now = TimestampWithTimeZone::try_from(crate::runtime::wait::now())
            .expect("the server's clock is a valid timestamp"),
    ]
    .into_iter()
    .chain(policy.params());
    let ended = statements::run(&COMPLETE, args, |table| {
        if table.is_empty() {
            return Ok(None);
        }
        let row = table.first();
        Ok(Some((
            row.get_by_name::<String, _>("queue")?,
            row.get_by_name::<String, _>("owner")?,
            row.get_by_name::<TimestampWithTimeZone, _>("claimed_at")?,
        )))
    });
    if let Some((Some(queue), owner, claimed_at)) = &ended {
        let args = params![
            key_hash = key.hash_param(),
            key = key.text,
            queue = queue.as_str(),
            token = token,
            owner = owner.as_deref(),
            claimed_at = *claimed_at,
        ];
        statements::run(&RECORD_COMPLETION, args, |_| Ok(()));
    }
    resolved_by_owner(key, ended.is_some(), Counter::Completed)
}

/// Record a failure of a claim; false when the claim is no longer current.
pub fn fail(key: &Key, token: i64, error: String, retry_after: Interval) -> bool {
    standby::refuse_writes("fail_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
        error = error,
        retry_after = retry_after,
    ];
    let done = statements::run(&FAIL, args, |table| Ok(table.len() == 1));
    resolved_by_owner(key, done, Counter::Failed)
}

/// Extend a claim's lease; None when the claim is no longer current.
pub fn heartbeat(key: &Key, token: i64, lease: Interval) -> Option<TimestampWithTimeZone> {
    standby::refuse_writes("heartbeat_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
        lease = lease,
    ];
    statements::run(&HEARTBEAT, args, |table| {
        if table.is_empty() {
            Ok(None)
        } else {
            table.first().get(1)
        }
    })
}

/// Give a claim back unfailed; false when the claim is no longer current.
pub fn release(key: &Key, token: i64) -> bool {
    standby::refuse_writes("release_key");
    let args = params![
        key_hash = key.hash_param(),
        token = token,
        holder = namespace::token_holder(),
    ];
    let done = statements::run(&RELEASE, args, |table| Ok(table.len() == 1));
    resolved_by_owner(key, done, Counter::Released)
}

static KEY_EXISTS: Statement =
    Statement::new("SELECT 1 FROM once.entries WHERE key_hash = $key_hash");

/// Run `statement` (one of INVALIDATE and REFRESH, which act on the state a fresh snapshot
/// shows) until it matches the key or the key is absent. A key whose state changed between
/// the snapshot and the row lock (a run ended just then) matches none of its branches; a
/// request must not be lost to that, so it runs again with a snapshot that shows the new
/// state.
fn until_matched<R>(
    key: &Key,
    statement: &'static Statement,
    args: impl Fn() -> Vec<Param<'static>>,
    read: impl Fn(pgrx::spi::SpiTupleTable<'_>) -> pgrx::spi::Result<Option<R>>,
) -> Option<R> {
    loop {
        check_for_interrupts!();
        if let Some(answer) = statements::run(statement, args(), &read) {
            return Some(answer);
        }
        let exists = statements::run(&KEY_EXISTS, params![key_hash = key.hash_param()], |t| {
            Ok(!t.is_empty())
        });
        if !exists {
            return None;
        }
    }
}

/// Forget a key; false when it was absent. A running key is not forgotten but recomputed
/// once more when its run ends, its results not served meanwhile (see INVALIDATE).
pub fn invalidate(key: &Key) -> bool {
    standby::refuse_writes("invalidate_key");
    let done = until_matched(
        key,
        &INVALIDATE,
        || params![key_hash = key.hash_param()].into(),
        |table| Ok((!table.is_empty()).then_some(())),
    )
    .is_some();
    if done {
        shmem::count(Counter::Invalidated);
    }
    done
}

/// What refresh_key did.
pub enum Refreshed {
    /// No such key: the next claim computes it anyway.
    Absent,
    /// Its result expired now (or its failure may be retried now, or it went back to its
    /// queue).
    Expired,
    /// It is running: it will be computed once more when this run ends.
    Rerun,
    /// It is queued: it will run anyway.
    Pending,
}

/// Ask for `key` to be computed again; `stale`: how long its present result (or, running,
/// the result of the run) may be served as stale meanwhile (None: not at all).
pub fn request_refresh(key: &Key, stale: Option<Interval>) -> Refreshed {
    standby::refuse_writes("refresh_key");
    let answer = until_matched(
        key,
        &REFRESH,
        || params![key_hash = key.hash_param(), stale = stale].into(),
        |table| {
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            let what: String = row.get(1)?.expect("what is set");
            let queue: Option<String> = row.get(2)?;
            Ok(Some((what, queue)))
        },
    );
    match answer {
        None => Refreshed::Absent,
        Some((what, queue)) => match what.as_str() {
            "rerun" => Refreshed::Rerun,
            "pending" => Refreshed::Pending,
            _ => {
                if let Some(queue) = queue {
                    crate::protocol::queue::has_work(&queue);
                }
                Refreshed::Expired
            }
        },
    }
}

/// Purge at most this many expired results, and as many history rows, per statement, to
/// bound each statement's memory (the ctids or keys it collects).
pub const PURGE_BATCH: i64 = 10_000;

/// A reap_stale call purges history in batches until none is left past the retention or
/// this much time has gone. Before, one batch a round capped the purge at 10,000 rows per
/// once.reaper_naptime, and a faster queue grew its history without bound. 100 ms deletes
/// about 80,000 rows here (BENCHMARKS.md, "Scale"), 18 times the 4,341 jobs/s 4 workers
/// complete (section 5), and bounds what a round costs the worker, which relays no
/// notification while it reaps: a backlog delays wake-ups by at most that much. (At
/// steady state a round purges one naptime's completions, in a few ms.)
pub const PURGE_BUDGET: Duration = Duration::from_millis(100);

/// What one reap_stale call did.
pub struct Reaped {
    pub reclaimed: i64,
    pub expired: i64,
    pub history: i64,
}

/// Take back claims whose owner is gone, purge expired results and old attempt history.
pub fn reap() -> Reaped {
    standby::refuse_writes("reap_stale");
    liveness::refresh();
    let reclaimed = statements::run(&REAP_GONE_OWNERS, params![], |table| Ok(table.len() as i64));
    let expired = statements::run(&PURGE_EXPIRED, params![batch = PURGE_BATCH], |table| {
        Ok(table.len() as i64)
    });
    let retention = crate::runtime::guc::HISTORY_RETENTION_S.get() as f64;
    let started = Instant::now();
    let mut history = 0;
    let mut after: Option<TimestampWithTimeZone> = None;
    loop {
        let (purged, last) = statements::run(
            &PURGE_HISTORY,
            params![retention_s = retention, after = after, batch = PURGE_BATCH],
            |table| {
                let row = table.first();
                Ok((
                    row.get_by_name::<i64, _>("purged")?
                        .expect("count(*) is not NULL"),
                    row.get_by_name::<TimestampWithTimeZone, _>("last")?,
                ))
            },
        );
        history += purged;
        after = last;
        if purged < PURGE_BATCH || started.elapsed() >= PURGE_BUDGET {
            break;
        }
    }
    crate::protocol::counts::fold();
    shmem::count_n(Counter::Reaped, reclaimed as u64);
    shmem::count_n(Counter::Purged, expired as u64);
    Reaped {
        reclaimed,
        expired,
        history,
    }
}

/// Trigger on once.entries: a running key was resolved (completed, failed, released,
/// reaped, invalidated). Its waiters are woken and it is announced on channel `once`, as
/// its namespace says (the key, or its digest).
#[pg_trigger(sql = false)]
fn notify_key_resolved<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgHeapTupleError> {
    // The triggers fire only for rows that were running (see schema.sql), so OLD exists.
    if let Some(old) = trigger.old() {
        let key = old
            .get_by_name::<&str>("key")
            .unwrap_or_else(|e| error!("pg_once: {e}"))
            .expect("once.entries.key is NOT NULL");
        let digest = old
            .get_by_name::<&[u8]>("key_hash")
            .unwrap_or_else(|e| error!("pg_once: {e}"))
            .expect("once.entries.key_hash is NOT NULL");
        notify::key_resolved(&namespace::payload(key, digest), crate::key::tag_of(digest));
    }
    Ok(None)
}
