//! Benchmark harness for what pgbench cannot measure: stampedes on one key (computations,
//! and latency from completion to each caller's answer), takeover after a killed owner,
//! idle LISTEN connections, queues (also under a held snapshot, and their sizes over
//! millions of cycles) and the memory of many idle connections. scripts/bench.sh drives
//! it; each round appends its raw figures to --json-out, one JSON line, which
//! bench/report.py renders into BENCHMARKS.md (bloat prints its line instead).

mod hold;
mod memory;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use pg_once_tools as once;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::Barrier;
use tokio_postgres::Client;

#[derive(Parser)]
#[command(about = "pg_once benchmark harness (see scripts/bench.sh)")]
struct Args {
    #[arg(long, env = "PG_ONCE_DSN")]
    dsn: String,
    /// Repeats, each a line of --json-out (the report shows the median and the range).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Label of the report's row.
    #[arg(long, default_value = "")]
    label: String,
    /// Append every round's raw figures here, one JSON object per line.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Many callers ask for one cold key at once; one computes.
    Stampede {
        #[arg(long, default_value_t = 200)]
        callers: usize,
        #[arg(long, value_enum)]
        strategy: Strategy,
        #[arg(long, default_value_t = 500)]
        compute_ms: u64,
    },
    /// Kill a claimer's connection; time until a waiting caller holds the claim.
    Takeover {
        #[arg(long, default_value_t = 30)]
        lease_s: u64,
        /// Judge the owner by its lease only (once.backend_liveness = off).
        #[arg(long)]
        lease_only: bool,
    },
    /// Workers taking jobs from a queue and completing them, for `seconds`: pg_once's
    /// claim_next + complete_key(s), or a plain hand-written SKIP LOCKED table.
    Queue {
        #[arg(long, value_enum)]
        with: QueueImpl,
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Jobs per claim (claim_next's n; the plain queue's LIMIT).
        #[arg(long, default_value_t = 1)]
        batch: i32,
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Server connections the workers share (default: one each). Worker libraries run
        /// many workers per process over a small pool.
        #[arg(long)]
        connections: Option<usize>,
        /// At most this many workers run a claim and its completion at once (default: all).
        /// With one connection each, this separates how many server processes take turns
        /// on the CPUs from how many claims run at the same time.
        #[arg(long)]
        in_flight: Option<usize>,
    },
    /// Cycle `keys` keys through claim_next, complete_key and enqueue_key(refresh) until
    /// `cycles` cycles are done, calling reap_stale meanwhile; report table and index sizes
    /// (each index of once.entries too) after the first `keys` cycles, at a tenth, a
    /// quarter and half of the run, every `every` cycles, and at the end. Prints one JSON
    /// line.
    Bloat {
        #[arg(long, default_value_t = 10_000)]
        keys: i32,
        #[arg(long, default_value_t = 1_000_000)]
        cycles: u64,
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Also measure every this many cycles, to draw the sizes' curve.
        #[arg(long)]
        every: Option<u64>,
    },
    /// Open `connections` connections that each run what a pg_once caller runs (or, with
    /// --baseline, a primary-key SELECT, an INSERT and an UPDATE), then, while they sit
    /// idle, read each backend's memory from /proc/<pid>/smaps_rollup (so run it on the
    /// server's machine) and the shared memory of pg_once and of the whole server. The
    /// server must preload pg_once and allow connections + 20 connections; the open-file
    /// limit must allow connections + 64 files. Row: private memory per backend (median,
    /// max), Pss (median, max), pg_once's shared memory, the server's, in MB.
    Memory {
        #[arg(long, default_value_t = 100)]
        connections: usize,
        #[arg(long)]
        baseline: bool,
    },
    /// A queue in steady state (`keys` keys cycled through claim, complete and re-queue by
    /// `workers` workers) while, after `warmup` + `before` s, another session holds a
    /// REPEATABLE READ snapshot for `hold` s; the run goes on for `after` s. Prints a row
    /// every `interval` s (elapsed s, phase, jobs/s, heap, indexes, dead tuples,
    /// autovacuums of the queue table), an empty line, then the summary row (median jobs/s
    /// before, held, over the last 30 s after; seconds from the release until an interval
    /// reaches 90% of the rate before, and until the table's first autovacuum).
    Hold {
        #[arg(long, value_enum)]
        with: QueueImpl,
        #[arg(long, default_value_t = 4)]
        workers: usize,
        #[arg(long, default_value_t = 10)]
        batch: i32,
        #[arg(long, default_value_t = 10_000)]
        keys: i32,
        /// Seconds of cycles before `before` starts, counted in no median.
        #[arg(long, default_value_t = 0)]
        warmup: u64,
        #[arg(long, default_value_t = 30)]
        before: u64,
        #[arg(long, default_value_t = 60)]
        hold: u64,
        #[arg(long, default_value_t = 60)]
        after: u64,
        #[arg(long, default_value_t = 5)]
        interval: u64,
    },
    /// Hold LISTEN connections on channel once until stdin closes; print what they got.
    Listeners {
        #[arg(long, default_value_t = 100)]
        count: usize,
        /// Never read the connections after LISTEN, like clients that LISTEN and then sit
        /// idle; otherwise read every notification as it arrives.
        #[arg(long)]
        idle: bool,
    },
}

#[derive(Clone, Copy, ValueEnum, Debug, PartialEq)]
enum QueueImpl {
    /// once.claim_next and once.complete_key / complete_keys.
    Once,
    /// A plain table: UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n).
    Plain,
    /// pgmq: pgmq.read (a visibility timeout) and pgmq.delete, its usual worker loop. Its
    /// SQL must be installed in the database first (scripts/bench.sh does, from a copy
    /// named by PGMQ_SQL; none is shipped with pg_once).
    Pgmq,
}

/// How a caller that is told `wait` gets its answer.
#[derive(Clone, Copy, ValueEnum, Debug, PartialEq)]
enum Strategy {
    /// claim_key(wait => ...): the server wakes it.
    Server,
    /// LISTEN once first, claim, wait for the key's notification, claim again.
    Listen,
    /// claim_key, on wait sleep 100 ms and try again.
    Poll100,
    /// claim_key, on wait sleep 1 s and try again.
    Poll1000,
    /// No pg_once: PostgreSQL's own wake-up, the usual way to make sessions wait for one
    /// computation without it. Callers block on an advisory lock that the computing
    /// session holds; its commit releases them all at once, and each reads a row by
    /// primary key in the same statement.
    Lock,
}

const LEASE: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    for _ in 0..args.rounds {
        let round = match args.what {
            What::Stampede {
                callers,
                strategy,
                compute_ms,
            } => {
                stampede(
                    &args.dsn,
                    callers,
                    strategy,
                    Duration::from_millis(compute_ms),
                )
                .await?
            }
            What::Takeover {
                lease_s,
                lease_only,
            } => takeover(&args.dsn, Duration::from_secs(lease_s), lease_only).await?,
            What::Queue {
                with,
                workers,
                batch,
                seconds,
                connections,
                in_flight,
            } => {
                let shape = QueueShape {
                    workers,
                    connections: connections.unwrap_or(workers).clamp(1, workers),
                    in_flight: in_flight.unwrap_or(workers).clamp(1, workers),
                    batch,
                };
                queue(&args.dsn, with, shape, Duration::from_secs(seconds)).await?
            }
            What::Bloat {
                keys,
                cycles,
                workers,
                every,
            } => {
                let run = bloat(&args.dsn, keys, cycles, workers, every).await?;
                println!("{run}");
                return append_json(args.json_out.as_deref(), &args.label, &run);
            }
            What::Listeners { count, idle } => return listeners(&args.dsn, count, idle).await,
            What::Memory {
                connections,
                baseline,
            } => memory::memory(&args.dsn, connections, baseline).await?,
            What::Hold {
                with,
                workers,
                batch,
                keys,
                warmup,
                before,
                hold,
                after,
                interval,
            } => {
                let shape = hold::Shape {
                    with,
                    workers,
                    batch,
                    keys,
                };
                let at = hold::Schedule {
                    warmup: Duration::from_secs(warmup),
                    before: Duration::from_secs(before),
                    hold: Duration::from_secs(hold),
                    after: Duration::from_secs(after),
                    interval: Duration::from_secs(interval),
                };
                let run = hold::hold(&args.dsn, &args.label, shape, at).await?;
                return append_json(args.json_out.as_deref(), &args.label, &run);
            }
        };
        append_json(args.json_out.as_deref(), &args.label, &round)?;
        // Let the backends of this round's connections exit before the next round.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

/// Append a run's figures to `path`, one JSON object per line, with the row's label.
fn append_json(
    path: Option<&std::path::Path>,
    label: &str,
    figures: &serde_json::Value,
) -> Result<()> {
    use std::io::Write;
    let Some(path) = path else { return Ok(()) };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut line = figures.clone();
    line["label"] = json!(label);
    writeln!(file, "{line}")?;
    Ok(())
}

fn fresh_key(what: &str) -> String {
    format!("bench/{what}/{}", nanos_since_epoch())
}

/// A number no earlier run used: keys and advisory locks of a run are made from it.
fn nanos_since_epoch() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// One caller's request, by `strategy`. Returns whether it computed, and the server's
/// clock when it had its answer (for the computing caller: when its complete_key ran,
/// just before that commit). Server clocks leave out the benchmark client's own
/// scheduling, which on a small machine would otherwise dominate.
async fn ask(
    client: &Client,
    notifications: Option<&mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>>,
    key: &str,
    strategy: Strategy,
    compute: Duration,
) -> Result<(bool, SystemTime)> {
    let wait = match strategy {
        Strategy::Server => 60.0,
        _ => 0.0,
    };
    let mut notifications = notifications;
    loop {
        let row = client
            .query_one(
                "SELECT outcome, token, clock_timestamp()
                   FROM once.claim_key($1, '30 seconds', make_interval(secs => $2))",
                &[&key, &wait],
            )
            .await?;
        let (outcome, token, at): (String, Option<i64>, SystemTime) =
            (row.get(0), row.get(1), row.get(2));
        match outcome.as_str() {
            "hit" => return Ok((false, at)),
            "claimed" => {
                tokio::time::sleep(compute).await;
                let token = token.context("claimed has a token")?;
                let row = client
                    .query_one(
                        "SELECT once.complete_key($1, $2, '\"page\"'), clock_timestamp()",
                        &[&key, &token],
                    )
                    .await?;
                anyhow::ensure!(row.get::<_, bool>(0));
                return Ok((true, row.get(1)));
            }
            "wait" => match strategy {
                Strategy::Server => {}
                Strategy::Listen => {
                    let rx = notifications
                        .as_deref_mut()
                        .context("listen needs a receiver")?;
                    let until = tokio::time::Instant::now() + LEASE;
                    while let Ok(Some(n)) = tokio::time::timeout_at(until, rx.recv()).await {
                        if n.payload() == key {
                            break;
                        }
                    }
                }
                Strategy::Poll100 => tokio::time::sleep(Duration::from_millis(100)).await,
                Strategy::Poll1000 => tokio::time::sleep(Duration::from_secs(1)).await,
                Strategy::Lock => anyhow::bail!("a lock stampede does not call claim_key"),
            },
            other => anyhow::bail!("unexpected outcome {other}"),
        }
    }
}

async fn stampede(
    dsn: &str,
    callers: usize,
    strategy: Strategy,
    compute: Duration,
) -> Result<serde_json::Value> {
    if strategy == Strategy::Lock {
        return stampede_on_a_lock(dsn, callers, compute).await;
    }
    let key = fresh_key("stampede");
    let mut clients = Vec::with_capacity(callers);
    for _ in 0..callers {
        clients.push(match strategy {
            Strategy::Listen => {
                let (client, rx) = once::connect_listening(dsn).await?;
                client.batch_execute("LISTEN once").await?;
                (client, Some(rx))
            }
            _ => (once::connect(dsn).await?, None),
        });
    }
    let start = Arc::new(Barrier::new(callers));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|(client, mut rx)| {
            let (key, start) = (key.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                ask(&client, rx.as_mut(), &key, strategy, compute).await
            })
        })
        .collect();
    let mut answered = Vec::new();
    let mut completed_at = None;
    let mut computations = 0;
    for task in tasks {
        let (computed, at) = task.await??;
        if computed {
            computations += 1;
            completed_at = Some(at);
        } else {
            answered.push(at);
        }
    }
    let completed_at = completed_at.context("someone computed")?;
    let mut latencies: Vec<f64> = answered
        .iter()
        .map(|at| {
            at.duration_since(completed_at)
                .unwrap_or_default()
                .as_secs_f64()
                * 1000.0
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
    Ok(json!({
        "bench": "stampede", "strategy": format!("{strategy:?}").to_lowercase(),
        "callers": callers, "computations": computations,
        "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": pct(1.0),
        "latencies_ms": latencies,
    }))
}

/// Strategy::Lock: `callers` sessions block on an advisory lock held by a session that
/// "computes" for `compute` and then commits; latencies run from just before that commit to
/// each caller's answer, by the server's clock as for pg_once.
async fn stampede_on_a_lock(
    dsn: &str,
    callers: usize,
    compute: Duration,
) -> Result<serde_json::Value> {
    let admin = once::connect(dsn).await?;
    admin
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_stampede_row (k int PRIMARY KEY, v jsonb);
             INSERT INTO bench_stampede_row VALUES (1, '\"page\"') ON CONFLICT DO NOTHING",
        )
        .await?;
    let lock_id = nanos_since_epoch() as i64;
    let owner = once::connect(dsn).await?;
    owner.batch_execute("BEGIN").await?;
    owner
        .execute("SELECT pg_advisory_xact_lock($1)", &[&lock_id])
        .await?;
    let mut tasks = Vec::with_capacity(callers);
    for _ in 0..callers {
        let client = once::connect(dsn).await?;
        tasks.push(tokio::spawn(async move {
            let row = client
                .query_one(
                    "WITH granted AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared($1))
                     SELECT v, clock_timestamp() FROM granted, bench_stampede_row WHERE k = 1",
                    &[&lock_id],
                )
                .await?;
            anyhow::Ok(row.get::<_, SystemTime>(1))
        }));
    }
    // Every caller is blocked on the lock before the computation ends, and has been for
    // longer than deadlock_timeout (1 s): each blocked session runs one deadlock check,
    // which takes every lock-manager partition, and checks that overlap the wake-up made
    // it many times slower.
    tokio::time::sleep(compute).await;
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let blocked: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                &[],
            )
            .await?
            .get(0);
        if blocked as usize >= callers {
            break;
        }
        anyhow::ensure!(Instant::now() < give_up, "only {blocked} callers blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let completed_at: SystemTime = owner
        .query_one("SELECT clock_timestamp()", &[])
        .await?
        .get(0);
    owner.batch_execute("COMMIT").await?;
    let mut latencies = Vec::with_capacity(callers);
    for task in tasks {
        let at = task.await??;
        latencies.push(
            at.duration_since(completed_at)
                .unwrap_or_default()
                .as_secs_f64()
                * 1000.0,
        );
    }
    latencies.sort_by(f64::total_cmp);
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
    Ok(json!({
        "bench": "stampede", "strategy": "lock", "callers": callers, "computations": 1,
        "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": pct(1.0),
        "latencies_ms": latencies,
    }))
}

async fn takeover(dsn: &str, lease: Duration, lease_only: bool) -> Result<serde_json::Value> {
    let admin = once::connect(dsn).await?;
    let owner = once::connect(dsn).await?;
    let waiter = once::connect(dsn).await?;
    if lease_only {
        owner
            .batch_execute("SET once.backend_liveness = off")
            .await?;
    }
    let key = fresh_key("takeover");
    anyhow::ensure!(once::claim_key(&owner, &key, lease, Duration::ZERO)
        .await?
        .is("claimed"));
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move {
            let claim =
                once::claim_key(&waiter, &key, LEASE, lease + Duration::from_secs(30)).await;
            (claim, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = once::backend_pid(&owner).await?;
    let killed = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await?;
    let (claim, at) = waiting.await?;
    anyhow::ensure!(claim?.is("claimed"), "the waiter did not take over");
    Ok(json!({
        "bench": "takeover", "lease_s": lease.as_secs(), "lease_only": lease_only,
        "takeover_ms": at.saturating_duration_since(killed).as_secs_f64() * 1000.0,
    }))
}

/// A connection that has run LISTEN once and is then never read again: the server writes
/// notifications to it until the socket buffers fill, then that backend waits.
async fn idle_listener(
    dsn: &str,
) -> Result<(
    Client,
    tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
)> {
    let (client, mut connection) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    {
        let listen = client.batch_execute("LISTEN once");
        tokio::pin!(listen);
        loop {
            tokio::select! {
                done = &mut listen => { done?; break; }
                message = std::future::poll_fn(|cx| connection.poll_message(cx)) => {
                    anyhow::ensure!(message.is_some(), "connection closed during LISTEN");
                }
            }
        }
    }
    Ok((client, connection))
}

async fn listeners(dsn: &str, count: usize, idle: bool) -> Result<()> {
    let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut held = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..count {
        if idle {
            held.push(idle_listener(dsn).await?);
            continue;
        }
        let (client, mut rx) = once::connect_listening(dsn).await?;
        client.batch_execute("LISTEN once").await?;
        clients.push(client);
        let received = received.clone();
        tokio::spawn(async move {
            while rx.recv().await.is_some() {
                received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    eprintln!(
        "{count} {} listeners ready",
        if idle { "idle" } else { "reading" }
    );
    // Run until stdin closes (the driving script ends us).
    tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin()
            .read_line(&mut sink)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
    })
    .await?;
    println!(
        "{}",
        json!({"bench": "listeners", "count": count, "idle": idle,
               "received": received.load(std::sync::atomic::Ordering::Relaxed)})
    );
    drop((clients, held));
    Ok(())
}

/// Jobs enough for `seconds` at a rate no run here reaches.
const JOBS_PER_SECOND_CAP: u64 = 80_000;

/// How long queue workers work before their jobs count.
const QUEUE_WARMUP: Duration = Duration::from_secs(1);

/// How the queue benchmark's workers reach the server.
#[derive(Clone, Copy)]
struct QueueShape {
    workers: usize,
    /// Connections, shared round-robin; a shared connection runs its workers' statements
    /// one after another, as a pool would.
    connections: usize,
    /// Workers allowed in a claim+complete cycle at once.
    in_flight: usize,
    batch: i32,
}

async fn queue(
    dsn: &str,
    with: QueueImpl,
    shape: QueueShape,
    seconds: Duration,
) -> Result<serde_json::Value> {
    let QueueShape {
        workers,
        connections,
        in_flight,
        batch,
    } = shape;
    let admin = once::connect(dsn).await?;
    let jobs = (JOBS_PER_SECOND_CAP * (seconds + QUEUE_WARMUP).as_secs()) as i64;
    let name = format!("bench_{}", std::process::id());
    // Setup writes rows directly: it is not what is measured.
    match with {
        QueueImpl::Once => {
            admin
                .execute("SELECT once.create_queue($1)", &[&name])
                .await?;
            admin
                .execute(
                    "INSERT INTO once.entries (key_hash, key, state, token, queue, payload, run_at, enqueued_at)
                     SELECT once.key_hash(k), k, 'queued', 0, $1, '{}', now(), now()
                       FROM (SELECT $1 || '/' || i AS k FROM generate_series(1, $2::bigint) i) s",
                    &[&name, &jobs],
                )
                .await?;
        }
        QueueImpl::Plain => create_plain_queue(&admin, &name, jobs).await?,
        QueueImpl::Pgmq => {
            admin.execute("SELECT pgmq.create($1)", &[&name]).await?;
            admin
                .execute(
                    &format!(
                        "INSERT INTO pgmq.q_{name} (vt, message)
                         SELECT now(), '{{}}' FROM generate_series(1, $1::bigint)"
                    ),
                    &[&jobs],
                )
                .await?;
        }
    }
    admin.batch_execute("VACUUM ANALYZE").await?;
    settle(&admin).await?;
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let dry = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Connections are long-lived, as workers' are. All connect before any worker starts
    // (64 connections take about a second while others work), and a new backend first
    // pays for mapping the shared buffers it touches (without huge pages, page faults were
    // 8% of all CPU in a 64-worker run), so jobs count only after QUEUE_WARMUP.
    let mut clients = Vec::with_capacity(connections);
    for _ in 0..connections {
        clients.push(Arc::new(tokio::sync::Mutex::new(once::connect(dsn).await?)));
    }
    let gate = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let counted_from = Instant::now() + QUEUE_WARMUP;
    let deadline = counted_from + seconds;
    let mut tasks = Vec::new();
    for w in 0..workers {
        // A shared connection serves one statement at a time, as a pool or PgBouncer in
        // transaction mode would (tokio-postgres alone would pipeline them).
        let connection = clients[w % connections].clone();
        let (name, done, dry, gate) = (name.clone(), done.clone(), dry.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let client = connection.lock().await;
            let statements = QueueStatements::prepare(&client, with, &name, batch).await?;
            drop(client);
            while Instant::now() < deadline {
                let _turn = gate.acquire().await?;
                let (keys, tokens) = statements
                    .claim(&*connection.lock().await, &name, &worker)
                    .await?;
                if keys.is_empty() {
                    dry.store(true, std::sync::atomic::Ordering::Relaxed);
                    break;
                }
                statements
                    .complete(&*connection.lock().await, &keys, &tokens)
                    .await?;
                if Instant::now() >= counted_from {
                    done.fetch_add(keys.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = counted_from.elapsed().as_secs_f64();
    let done = done.load(std::sync::atomic::Ordering::Relaxed);
    drop_queue(&admin, with, &name).await?;
    anyhow::ensure!(
        !dry.load(std::sync::atomic::Ordering::Relaxed),
        "the queue ran dry: raise JOBS_PER_SECOND_CAP"
    );
    Ok(json!({
        "bench": "queue", "with": format!("{with:?}").to_lowercase(), "workers": workers,
        "connections": connections, "in_flight": in_flight, "batch": batch, "jobs": done, "cycles_per_s": done as f64 / elapsed,
    }))
}

/// A hand-written queue table, `rows` jobs queued: the plain baseline of `queue` and `hold`.
async fn create_plain_queue(admin: &Client, name: &str, rows: i64) -> Result<()> {
    admin
        .batch_execute(&format!(
            "CREATE TABLE {name} (id bigserial PRIMARY KEY, state text NOT NULL DEFAULT 'queued',
                 payload jsonb, result jsonb, errors int NOT NULL DEFAULT 0,
                 priority int NOT NULL DEFAULT 0, run_at timestamptz NOT NULL DEFAULT now(),
                 worker text, locked_at timestamptz);
             CREATE INDEX ON {name} (errors, priority, run_at) WHERE state = 'queued';"
        ))
        .await?;
    admin
        .execute(
            &format!(
                "INSERT INTO {name} (payload) SELECT '{{}}' FROM generate_series(1, $1::bigint)"
            ),
            &[&rows],
        )
        .await?;
    Ok(())
}

/// Remove a benchmark queue and everything its jobs left behind.
async fn drop_queue(admin: &Client, with: QueueImpl, name: &str) -> Result<()> {
    match with {
        QueueImpl::Once => {
            // Where nothing else uses pg_once, empty its tables as the plain side drops its
            // own: a DELETE leaves dead index entries that the next round would pay for.
            let alone: bool = admin
                .query_one(
                    "SELECT NOT EXISTS (SELECT FROM once.entries WHERE queue IS DISTINCT FROM $1)
                        AND NOT EXISTS (SELECT FROM once.attempts WHERE queue IS DISTINCT FROM $1)",
                    &[&name],
                )
                .await?
                .get(0);
            if alone {
                admin
                    .batch_execute("TRUNCATE once.entries, once.attempts")
                    .await?;
            }
            admin
                .execute("DELETE FROM once.entries WHERE queue = $1", &[&name])
                .await?;
            admin
                .execute("DELETE FROM once.attempts WHERE queue = $1", &[&name])
                .await?;
            admin
                .execute("DELETE FROM once.queues WHERE name = $1", &[&name])
                .await?;
        }
        QueueImpl::Plain => admin.batch_execute(&format!("DROP TABLE {name}")).await?,
        QueueImpl::Pgmq => {
            admin
                .execute("SELECT pgmq.drop_queue($1)", &[&name])
                .await?;
        }
    }
    Ok(())
}

/// A worker's two statements, prepared on its connection: claim up to `batch` jobs of
/// queue `name`, and complete them (pg_once's claim_next and complete_key(s), or the plain
/// table's UPDATEs). Jobs are (key, token) pairs; the plain table's keys are its ids and
/// its tokens 0.
struct QueueStatements {
    with: QueueImpl,
    name: String,
    batch: i32,
    claim: tokio_postgres::Statement,
    complete: tokio_postgres::Statement,
}

impl QueueStatements {
    async fn prepare(client: &Client, with: QueueImpl, name: &str, batch: i32) -> Result<Self> {
        let (claim, complete) = match with {
            QueueImpl::Once => (
                client.prepare("SELECT key, token FROM once.claim_next($1, worker => $2, n => $3::bigint::int)").await?,
                if batch == 1 {
                    client.prepare("SELECT once.complete_key($1, $2, '{\"ok\": true}')").await?
                } else {
                    client.prepare("SELECT count(*) FROM once.complete_keys($1::text[], $2::bigint[], array_fill('{\"ok\": true}'::jsonb, ARRAY[cardinality($1::text[])]))").await?
                },
            ),
            QueueImpl::Plain => (
                client
                    .prepare(&format!(
                        "UPDATE {name} SET state = 'running', worker = $2, locked_at = now()
                          WHERE id IN (SELECT id FROM {name}
                                        WHERE state = 'queued' AND run_at <= now() AND $1::text IS NOT NULL
                                        ORDER BY errors, priority, run_at
                                        LIMIT $3 FOR UPDATE SKIP LOCKED)
                         RETURNING id::text, 0::bigint"
                    ))
                    .await?,
                client
                    .prepare(&format!(
                        "UPDATE {name} SET state = 'done', result = '{{\"ok\": true}}' WHERE id = ANY($1::text[]::bigint[])"
                    ))
                    .await?,
            ),
            // A 30 s visibility timeout, as pg_once's 30 s lease; $2 (the worker) is unused:
            // pgmq does not record who read a message.
            QueueImpl::Pgmq => (
                client
                    .prepare("SELECT msg_id::text, 0::bigint FROM pgmq.read($1, 30, $3::bigint::int) WHERE $2::text IS NOT NULL")
                    .await?,
                client
                    .prepare("SELECT count(*) FROM pgmq.delete($1, $2::text[]::bigint[])")
                    .await?,
            ),
        };
        Ok(QueueStatements {
            with,
            name: name.to_owned(),
            batch,
            claim,
            complete,
        })
    }

    /// Up to `batch` jobs for `worker`; none when the queue has nothing ready.
    async fn claim(
        &self,
        client: &Client,
        name: &str,
        worker: &str,
    ) -> Result<(Vec<String>, Vec<i64>)> {
        let rows = client
            .query(&self.claim, &[&name, &worker, &(self.batch as i64)])
            .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .unzip())
    }

    async fn complete(&self, client: &Client, keys: &[String], tokens: &[i64]) -> Result<()> {
        match (self.with, self.batch) {
            (QueueImpl::Once, 1) => {
                client
                    .query_one(&self.complete, &[&keys[0], &tokens[0]])
                    .await?;
            }
            (QueueImpl::Once, _) => {
                client.query_one(&self.complete, &[&keys, &tokens]).await?;
            }
            (QueueImpl::Plain, _) => {
                client.execute(&self.complete, &[&keys]).await?;
            }
            (QueueImpl::Pgmq, _) => {
                client
                    .query_one(&self.complete, &[&self.name, &keys])
                    .await?;
            }
        }
        Ok(())
    }
}

/// Start a measurement from a quiet server: the previous run's dirty pages written and no
/// autovacuum worker busy with its leftovers. On 2 cores a vacuum that starts in the middle
/// of a 4 s run takes half the machine from whichever side happens to run next.
async fn settle(admin: &tokio_postgres::Client) -> Result<()> {
    admin.batch_execute("CHECKPOINT").await?;
    let give_up = Instant::now() + Duration::from_secs(60);
    while Instant::now() < give_up {
        let busy: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'",
                &[],
            )
            .await?
            .get(0);
        if busy == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

async fn bloat(
    dsn: &str,
    keys: i32,
    cycles: u64,
    workers: usize,
    every: Option<u64>,
) -> Result<serde_json::Value> {
    let admin = once::connect(dsn).await?;
    admin
        .execute("SELECT once.create_queue('bloat')", &[])
        .await?;
    admin
        .execute("SELECT count(once.enqueue_key('bloat/' || i, queue => 'bloat')) FROM generate_series(1, $1) i", &[&keys])
        .await?;
    let started = Instant::now();
    let sizes_after = |cycles: u64| {
        let admin = &admin;
        async move {
            let row = admin
                .query_one(
                    "SELECT pg_relation_size('once.entries'), pg_indexes_size('once.entries'),
                            pg_total_relation_size('once.attempts'), n_dead_tup, autovacuum_count
                       FROM pg_stat_user_tables WHERE relid = 'once.entries'::regclass",
                    &[],
                )
                .await?;
            let (heap, indexes, history, dead, vacuums): (i64, i64, i64, i64, i64) =
                (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
            let each_index: serde_json::Map<String, serde_json::Value> = admin
                .query(
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
                       FROM pg_index WHERE indrelid = 'once.entries'::regclass",
                    &[],
                )
                .await?
                .iter()
                .map(|r| (r.get::<_, String>(0), json!(r.get::<_, i64>(1))))
                .collect();
            let seconds = started.elapsed().as_secs_f64();
            eprintln!(
                "\r  bloat: after {cycles} cycles ({seconds:.0} s): heap {:.1} MB, indexes {:.1} MB, {dead} dead rows",
                heap as f64 / 1e6,
                indexes as f64 / 1e6,
            );
            anyhow::Ok(json!({
                "cycles": cycles, "seconds": seconds, "heap_bytes": heap, "index_bytes": indexes,
                "index_bytes_each": each_index, "attempts_bytes": history, "dead_tuples": dead,
                "autovacuums": vacuums,
            }))
        }
    };
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut report = Vec::new();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (client, done) = (once::connect(dsn).await?, done.clone());
        tasks.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let claim = client
                .prepare("SELECT key, token FROM once.claim_next('bloat', worker => $1, n => 1)")
                .await?;
            let complete = client
                .prepare("SELECT once.complete_key($1, $2, '{\"ok\": true}')")
                .await?;
            let again = client
                .prepare("SELECT once.enqueue_key($1, queue => 'bloat', refresh => true)")
                .await?;
            while done.load(std::sync::atomic::Ordering::Relaxed) < cycles {
                let Some(row) = client.query_opt(&claim, &[&worker]).await? else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                let (key, token): (String, i64) = (row.get(0), row.get(1));
                client.query_one(&complete, &[&key, &token]).await?;
                client.query_one(&again, &[&key]).await?;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    // Sizes after the first pass over every key, then at fractions of the run (and every
    // `every` cycles): a bounded table levels off.
    let mut checkpoints: Vec<u64> = vec![keys as u64];
    checkpoints.extend(
        [10, 4, 2]
            .iter()
            .map(|d| cycles / d)
            .filter(|&c| c > keys as u64),
    );
    if let Some(every) = every.filter(|&e| e > 0) {
        checkpoints.extend((every..cycles).step_by(every as usize));
    }
    checkpoints.sort_unstable();
    checkpoints.dedup();
    let mut next_print = Instant::now();
    while done.load(std::sync::atomic::Ordering::Relaxed) < cycles {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n = done.load(std::sync::atomic::Ordering::Relaxed);
        // One row for the checkpoints passed since the last look, under the last of them.
        let passed = checkpoints.partition_point(|&c| c <= n);
        if passed > 0 {
            let c = checkpoints[passed - 1];
            checkpoints.drain(..passed);
            report.push(sizes_after(c).await?);
        }
        if Instant::now() >= next_print {
            // What the pg_once worker does where it runs: trim history, purge, reclaim.
            admin
                .execute("SELECT * FROM once.reap_stale()", &[])
                .await?;
            eprint!(
                "\r  bloat: {n}/{cycles} cycles, {:.0}/s   ",
                n as f64 / started.elapsed().as_secs_f64()
            );
            next_print = Instant::now() + Duration::from_secs(1);
        }
    }
    for t in tasks {
        t.await??;
    }
    eprintln!();
    report.push(sizes_after(cycles).await?);
    admin
        .execute("DELETE FROM once.entries WHERE queue = 'bloat'", &[])
        .await?;
    admin
        .execute("DELETE FROM once.attempts WHERE queue = 'bloat'", &[])
        .await?;
    admin
        .execute("DELETE FROM once.queues WHERE name = 'bloat'", &[])
        .await?;
    Ok(
        json!({"bench": "bloat", "keys": keys, "cycles": cycles, "workers": workers,
               "seconds": started.elapsed().as_secs_f64(), "sizes": report}),
    )
}
