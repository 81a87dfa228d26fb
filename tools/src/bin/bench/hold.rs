//! `bench hold`: a queue in steady state while another session holds a snapshot, the
//! usual way a queue table bloats in production. Nothing that became dead after the
//! snapshot can be removed (by vacuum, HOT pruning or an index's bottom-up deletion)
//! until it ends, so every cycle leaves a dead row version behind; the question is how
//! fast the queue runs meanwhile, and how soon after the release it is back to its rate.

use super::{QueueImpl, QueueStatements};
use anyhow::{Context, Result};
use pg_once_tools as once;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// When the snapshot is taken and released, and how often a row is printed.
#[derive(Clone, Copy)]
pub struct Schedule {
    /// Run this long before `before` starts, printing rows that no median counts. A fresh
    /// queue table runs faster than one whose dead rows autovacuum has been clearing for a
    /// while (once a minute by default): a steady state needs a cycle of it or two.
    pub warmup: Duration,
    pub before: Duration,
    pub hold: Duration,
    pub after: Duration,
    pub interval: Duration,
}

/// The queue runs again at its earlier rate once an interval reaches this share of the
/// median rate before the snapshot.
const RECOVERED: f64 = 0.9;

/// The "after" rate is the median of this last stretch of the run.
const AFTER_TAIL: Duration = Duration::from_secs(30);

/// One interval's figures.
struct Sample {
    /// From the start of the run (warmup included) to the end of the interval.
    elapsed: Duration,
    phase: &'static str,
    jobs_per_s: f64,
    heap_bytes: i64,
    index_bytes: i64,
    dead_tuples: i64,
    autovacuums: i64,
    /// pg_once's history table (0 for the plain queue): every completion adds a row.
    attempts_bytes: i64,
}

pub struct Shape {
    pub with: QueueImpl,
    pub workers: usize,
    pub batch: i32,
    pub keys: i32,
}

/// Runs the schedule, printing a markdown row per interval as it ends, then an empty line
/// and the summary row; returns the run's figures as one JSON object.
pub async fn hold(dsn: &str, label: &str, shape: Shape, at: Schedule) -> Result<serde_json::Value> {
    let Shape {
        with,
        workers,
        batch,
        keys,
    } = shape;
    anyhow::ensure!(
        !at.interval.is_zero() && keys as i64 >= 2 * workers as i64 * batch as i64,
        "hold needs a positive --interval and at least 2 x workers x batch keys"
    );
    let admin = once::connect(dsn).await?;
    let name = format!("hold_{}", std::process::id());
    let table = match with {
        QueueImpl::Once => {
            admin
                .execute("SELECT once.create_queue($1)", &[&name])
                .await?;
            admin
                .execute(
                    "SELECT count(once.enqueue_key($1 || '/' || i, queue => $1))
                       FROM generate_series(1, $2) i",
                    &[&name, &keys],
                )
                .await?;
            "once.entries".to_string()
        }
        QueueImpl::Plain => {
            super::create_plain_queue(&admin, &name, keys as i64).await?;
            name.clone()
        }
        QueueImpl::Pgmq => anyhow::bail!("hold compares pg_once with the plain table only"),
    };
    admin.batch_execute("VACUUM ANALYZE").await?;
    super::settle(&admin).await?;

    // The pg_once worker reaps where the server preloads pg_once and once.databases names
    // this database; elsewhere the benchmark does its job, once a second like the worker.
    let worker_reaps: bool = admin
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_stat_activity
                             WHERE backend_type = 'pg_once worker' AND datname = current_database())",
            &[],
        )
        .await?
        .get(0);
    let reaper = if with == QueueImpl::Once && !worker_reaps {
        let client = once::connect(dsn).await?;
        Some(tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(1));
            loop {
                every.tick().await;
                if let Err(e) = once::reap_stale(&client).await {
                    break e;
                }
            }
        }))
    } else {
        None
    };

    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let client = once::connect(dsn).await?;
        let (name, done, stop) = (name.clone(), done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let statements = QueueStatements::prepare(&client, with, &name, batch).await?;
            let requeue = match with {
                QueueImpl::Once => client.prepare(
                    "SELECT count(once.enqueue_key(k, queue => $2, refresh => true)) FROM unnest($1::text[]) k",
                ).await?,
                // (pgmq never gets here: refused before the queue is made.)
                QueueImpl::Plain | QueueImpl::Pgmq => client.prepare(&format!(
                    "UPDATE {name} SET state = 'queued', worker = NULL, locked_at = NULL
                      WHERE id = ANY($1::text[]::bigint[]) AND $2::text IS NOT NULL"
                )).await?,
            };
            while !stop.load(Ordering::Relaxed) {
                let (keys, tokens) = statements.claim(&client, &name, &worker).await?;
                if keys.is_empty() {
                    // Every key is between its claim and its re-queue in other workers.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                statements.complete(&client, &keys, &tokens).await?;
                client.execute(&requeue, &[&keys, &name]).await?;
                done.fetch_add(keys.len() as u64, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    // As in `queue`: new backends first pay for mapping the shared buffers they touch.
    tokio::time::sleep(super::QUEUE_WARMUP).await;
    let started = Instant::now();

    let holder = once::connect(dsn).await?;
    let snapshot = tokio::spawn(async move {
        tokio::time::sleep_until((started + at.warmup + at.before).into()).await;
        holder
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .await?;
        // A transaction's snapshot is taken by its first statement; from then on its xmin
        // holds back the removal of every row version that dies later. This one checks
        // that it does.
        let holds: bool = holder
            .query_one(
                "SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = pg_backend_pid()",
                &[],
            )
            .await?
            .get(0);
        anyhow::ensure!(holds, "the holding session has no snapshot");
        tokio::time::sleep_until((started + at.warmup + at.before + at.hold).into()).await;
        holder.batch_execute("COMMIT").await?;
        anyhow::Ok(Instant::now())
    });

    let total = at.warmup + at.before + at.hold + at.after;
    let mut samples = Vec::new();
    let mut counted = 0;
    let mut tick = started;
    while tick + at.interval <= started + total + Duration::from_millis(1) {
        tick += at.interval;
        tokio::time::sleep_until(tick.into()).await;
        if tasks.iter().any(|t| t.is_finished()) {
            // Workers end before `stop` only by failing: say why now, not at the end.
            break;
        }
        let now = done.load(Ordering::Relaxed);
        let jobs_per_s = (now - counted) as f64 / at.interval.as_secs_f64();
        counted = now;
        let elapsed = tick - started;
        let phase = if elapsed <= at.warmup {
            "warmup"
        } else if elapsed <= at.warmup + at.before {
            "before"
        } else if elapsed <= at.warmup + at.before + at.hold {
            "held"
        } else {
            "after"
        };
        let sample = measure(&admin, &table, elapsed, phase, jobs_per_s).await?;
        println!(
            "| {label} | {:.0} | {phase} | {jobs_per_s:.0} | {:.1} MB | {:.1} MB | {} | {} |",
            elapsed.as_secs_f64(),
            sample.heap_bytes as f64 / 1e6,
            sample.index_bytes as f64 / 1e6,
            sample.dead_tuples,
            sample.autovacuums,
        );
        samples.push(sample);
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    let released = snapshot.await??;
    if let Some(reaper) = reaper {
        // It only ends by failing.
        if reaper.is_finished() {
            return Err(reaper.await?.context("reap_stale"));
        }
        reaper.abort();
    }
    super::drop_queue(&admin, with, &name).await?;

    let median_of = |keep: &dyn Fn(&Sample) -> bool| {
        let mut rates: Vec<f64> = samples
            .iter()
            .filter(|s| keep(s))
            .map(|s| s.jobs_per_s)
            .collect();
        rates.sort_by(f64::total_cmp);
        let n = rates.len();
        // Of an even count, the mean of the middle two: a short phase has only a few
        // intervals, and the upper one of two would be its best.
        (n > 0).then(|| (rates[(n - 1) / 2] + rates[n / 2]) / 2.0)
    };
    let before = median_of(&|s| s.phase == "before").context("no interval before the snapshot")?;
    let held = median_of(&|s| s.phase == "held");
    let tail_from = total.saturating_sub(AFTER_TAIL);
    let after = median_of(&|s| s.phase == "after" && s.elapsed > tail_from);
    // The end of the first interval after the release that reaches the earlier rate.
    let released_at = released - started;
    let recovery = samples
        .iter()
        .find(|s| s.elapsed > released_at && s.jobs_per_s >= RECOVERED * before)
        .map(|s| (s.elapsed - released_at).as_secs_f64());
    // Only a vacuum removes the index entries of the rows that died under the snapshot
    // (pages are pruned as they are read, but their line pointers stay until then).
    let vacuums_at_release = samples
        .iter()
        .take_while(|s| s.elapsed <= released_at)
        .last()
        .map_or(0, |s| s.autovacuums);
    let vacuumed = samples
        .iter()
        .find(|s| s.elapsed > released_at && s.autovacuums > vacuums_at_release)
        .map(|s| (s.elapsed - released_at).as_secs_f64());
    Ok(json!({
        "bench": "hold", "with": format!("{with:?}").to_lowercase(), "workers": workers,
        "batch": batch, "keys": keys,
        "before_s": at.before.as_secs_f64(), "hold_s": at.hold.as_secs_f64(),
        "after_s": at.after.as_secs_f64(), "interval_s": at.interval.as_secs_f64(),
        "reaper": if with == QueueImpl::Plain { "none" } else if worker_reaps { "worker" } else { "bench" },
        "before_jobs_per_s": before, "held_jobs_per_s": held, "after_jobs_per_s": after,
        "recovery_s": recovery, "autovacuum_after_release_s": vacuumed,
        "warmup_s": at.warmup.as_secs_f64(),
        "intervals": samples.iter().map(|s| json!({
            "elapsed_s": s.elapsed.as_secs_f64(), "phase": s.phase, "jobs_per_s": s.jobs_per_s,
            "heap_bytes": s.heap_bytes, "index_bytes": s.index_bytes,
            "dead_tuples": s.dead_tuples, "autovacuums": s.autovacuums,
            "attempts_bytes": s.attempts_bytes,
        })).collect::<Vec<_>>(),
    }))
}

/// The queue table's sizes and statistics now.
async fn measure(
    admin: &Client,
    table: &str,
    elapsed: Duration,
    phase: &'static str,
    jobs_per_s: f64,
) -> Result<Sample> {
    let row = admin
        .query_one(
            "SELECT pg_relation_size(relid), pg_indexes_size(relid), n_dead_tup, autovacuum_count,
                    coalesce(pg_total_relation_size(to_regclass('once.attempts')), 0)
                       * (relid = 'once.entries'::regclass)::int
               FROM pg_stat_user_tables WHERE relid = $1::text::regclass",
            &[&table],
        )
        .await?;
    Ok(Sample {
        elapsed,
        phase,
        jobs_per_s,
        heap_bytes: row.get(0),
        index_bytes: row.get(1),
        dead_tuples: row.get(2),
        autovacuums: row.get(3),
        attempts_bytes: row.get(4),
    })
}
