//! Reaping (reap_stale, and the worker every once.reaper_naptime): claims whose owner is
//! gone are taken back, expired results and old attempt history purged, key counts folded.

use crate::protocol::counts;
use crate::protocol::rules::*;
use crate::protocol::standby;
use crate::runtime::guc;
use crate::runtime::liveness;
use crate::runtime::shmem::{self, Counter};
use crate::storage::statements::{self, params, Statement};
use pgrx::datum::TimestampWithTimeZone;
use std::time::{Duration, Instant};

static REAP_GONE_OWNERS: Statement = statement!("reap_gone_owners");

static PURGE_HISTORY: Statement = statement!("purge_history");

static PURGE_EXPIRED: Statement = statement!("purge_expired");

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

/// Take back claims whose owner is gone, purge expired results and old attempt history:
/// once.reap_stale(), in the caller's transaction.
pub fn reap() -> Reaped {
    let reclaimed = reclaim();
    let (expired, history) = purge();
    Reaped {
        reclaimed,
        expired,
        history,
    }
}

/// Take back claims whose owner is gone; returns how many. The worker commits this on its
/// own, before it purges: a reclaimed row stays locked until the transaction that wrote
/// it ends, and a claim of that key meanwhile is answered `wait` (it never waits for a
/// lock with `wait => 0`), so the shorter that transaction, the sooner the key is
/// claimable and its waiters are woken.
pub fn reclaim() -> i64 {
    standby::refuse_writes("reap_stale");
    liveness::refresh();
    let reclaimed = statements::run(&REAP_GONE_OWNERS, params![], |table| Ok(table.len() as i64));
    shmem::count_n(Counter::Reaped, reclaimed as u64);
    reclaimed
}

/// Purge expired results and old attempt history, and fold key counts; returns how many
/// results and history rows were purged.
pub fn purge() -> (i64, i64) {
    standby::refuse_writes("reap_stale");
    let expired = statements::run(&PURGE_EXPIRED, params![batch = PURGE_BATCH], |table| {
        Ok(table.len() as i64)
    });
    let history = purge_history(guc::HISTORY_RETENTION_S.get() as f64, PURGE_BUDGET);
    counts::fold();
    shmem::count_n(Counter::Purged, expired as u64);
    (expired, history)
}

/// Delete attempt history older than `retention_s` seconds, a batch at a time, until none
/// is left or `budget` has gone (checked after each batch: at least one batch is purged).
pub fn purge_history(retention_s: f64, budget: Duration) -> i64 {
    let started = Instant::now();
    let mut history = 0;
    let mut after: Option<TimestampWithTimeZone> = None;
    loop {
        let (purged, last) = statements::run(
            &PURGE_HISTORY,
            params![
                retention_s = retention_s,
                after = after,
                batch = PURGE_BATCH
            ],
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
        if purged < PURGE_BATCH || started.elapsed() >= budget {
            return history;
        }
    }
}
