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
    let retention = guc::HISTORY_RETENTION_S.get() as f64;
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
    counts::fold();
    shmem::count_n(Counter::Reaped, reclaimed as u64);
    shmem::count_n(Counter::Purged, expired as u64);
    Reaped {
        reclaimed,
        expired,
        history,
    }
}
