//! Invariant soak: many clients doing random claim / compute / complete / fail / release /
//! heartbeat / invalidate / reap on a small key space, with client connections killed
//! now and then, checking pg_once's guarantees as it goes and at the end:
//!
//! 1. never two clients computing one key at the same instant. Clients record each claim
//!    they finish: from holding it to sending the final write (complete, fail, release).
//!    Two claims of one key whose writes were accepted must never overlap; and a claim
//!    whose write was refused must have been cancelled by an invalidate_key of that key
//!    meanwhile (the soak's computations last well under their lease, and a client whose
//!    connection was killed gets an error, not a refusal): any other refusal means the
//!    claim was taken from a live owner;
//! 2. no accepted completion from a superseded token (a stored result always carries the
//!    token of the claim that is current for its key);
//! 3. every key ends resolvable (nothing stuck in `wait` once every client is gone);
//! 4. no deadlock, and no SQLSTATE other than the killed connections' own.
//!
//!   soak --dsn ... --clients 16 --keys 24 --seconds 60      (CI: about a minute)
//!   soak --dsn ... --seconds 14400                          (hours)

use anyhow::Result;
use clap::Parser;
use pg_once_tools as once;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

#[derive(Parser)]
#[command(about = "pg_once invariant soak")]
struct Args {
    #[arg(long, env = "PG_ONCE_DSN")]
    dsn: String,
    #[arg(long, default_value_t = 16)]
    clients: usize,
    #[arg(long, default_value_t = 24)]
    keys: usize,
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Mean time between two killed client connections, in milliseconds.
    #[arg(long, default_value_t = 700)]
    kill_every_ms: u64,
}

/// Counts of what happened, by name, for the progress lines and the summary.
#[derive(Default)]
struct Tally(Mutex<BTreeMap<&'static str, u64>>);

impl Tally {
    fn add(&self, what: &'static str) {
        *self.0.lock().unwrap().entry(what).or_default() += 1;
    }
    fn get(&self, what: &str) -> u64 {
        self.0.lock().unwrap().get(what).copied().unwrap_or(0)
    }
}

/// A claim its owner finished with an accepted write: it was the key's only owner from
/// `held` (claim returned) to `finishing` (final write sent).
struct Ownership {
    client: usize,
    token: i64,
    held: Instant,
    finishing: Instant,
}

/// A claim whose final write was refused: (key, client, token, asked for, refused).
type Refusal = (String, usize, i64, Instant, Instant);

struct Shared {
    ownerships: Mutex<HashMap<String, Vec<Ownership>>>,
    refusals: Mutex<Vec<Refusal>>,
    /// invalidate_key calls: key -> (sent, returned).
    invalidations: Mutex<HashMap<String, Vec<(Instant, Instant)>>>,
    /// Clients whose connection has been killed and who have not noticed yet.
    killed: Vec<AtomicBool>,
    pids: Vec<AtomicU64>,
    tally: Tally,
    violations: Mutex<Vec<String>>,
    stop: AtomicBool,
}

impl Shared {
    fn violation(&self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.lock().unwrap().push(what);
    }
}

/// A tiny deterministic-per-client random source (xorshift): no extra dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// SQLSTATEs a client may see: its own connection terminated by the soak, and a claim
/// refused because this client's connection was the one killed mid-call.
/// The driver's error may sit anywhere in the chain: pg_once_client wraps it (shared, as
/// an Arc) in its own error type.
fn expected_error(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        let pg = cause.downcast_ref::<tokio_postgres::Error>().or_else(|| {
            cause
                .downcast_ref::<std::sync::Arc<tokio_postgres::Error>>()
                .map(|shared| &**shared)
        });
        pg.is_some_and(|pg| pg.is_closed() || pg.code().is_some_and(|c| c.code() == "57P01"))
    })
}

async fn client_loop(id: usize, dsn: String, keys: usize, shared: Arc<Shared>) -> Result<()> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((id as u64 + 1) * 0x1000_0001));
    'connection: while !shared.stop.load(Relaxed) {
        let client = once::connect(&dsn).await?;
        shared.pids[id].store(once::backend_pid(&client).await? as u64, Relaxed);
        shared.killed[id].store(false, Relaxed);
        while !shared.stop.load(Relaxed) {
            let key = format!("soak/{}", rng.below(keys as u64));
            let outcome = one_operation(id, &client, &key, &mut rng, &shared).await;
            if let Err(e) = outcome {
                if expected_error(&e) && shared.killed[id].load(Relaxed) {
                    shared.tally.add("reconnects");
                    continue 'connection;
                }
                if expected_error(&e) && shared.stop.load(Relaxed) {
                    return Ok(());
                }
                shared.violation(format!("client {id}: unexpected error: {e:#}"));
                continue 'connection;
            }
        }
    }
    Ok(())
}

async fn one_operation(
    id: usize,
    client: &Client,
    key: &str,
    rng: &mut Rng,
    shared: &Shared,
) -> Result<()> {
    shared.tally.add("operations");
    match rng.below(100) {
        0..=4 => {
            let sent = Instant::now();
            once::invalidate_key(client, key).await?;
            let returned = Instant::now();
            shared
                .invalidations
                .lock()
                .unwrap()
                .entry(key.to_owned())
                .or_default()
                .push((sent, returned));
            shared.tally.add("invalidations");
        }
        5..=9 => {
            once::reap_stale(client).await?;
            shared.tally.add("reaps");
        }
        _ => {
            let wait = Duration::from_millis(rng.below(300));
            let asked = Instant::now();
            let claim = once::claim_key(client, key, Duration::from_secs(5), wait).await?;
            shared.tally.add(match claim.outcome.as_str() {
                "hit" => "hits",
                "wait" => "waits",
                "failed" => "failures shared",
                _ => "claims",
            });
            if claim.is("claimed") {
                compute(
                    id,
                    client,
                    key,
                    claim.token.expect("token"),
                    asked,
                    rng,
                    shared,
                )
                .await?;
            }
        }
    }
    Ok(())
}

/// Hold the claim for a while, then complete, fail or release it; record the ownership
/// if that write was accepted.
async fn compute(
    id: usize,
    client: &Client,
    key: &str,
    token: i64,
    asked: Instant,
    rng: &mut Rng,
    shared: &Shared,
) -> Result<()> {
    let held = Instant::now();
    tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
    if rng.below(4) == 0 {
        once::heartbeat_key(client, key, token, Duration::from_secs(5)).await?;
        shared.tally.add("heartbeats");
    }
    let finishing = Instant::now();
    let accepted = match rng.below(10) {
        0..=6 => {
            let value = json!({"token": token, "client": id});
            let ttl = Duration::from_millis(300 + rng.below(700));
            let accepted = once::complete_key(client, key, token, &value, Some(ttl)).await?;
            shared.tally.add(if accepted {
                "completions"
            } else {
                "completions refused"
            });
            accepted
        }
        7..=8 => {
            let retry = Duration::from_millis(rng.below(100));
            let accepted = once::fail_key(client, key, token, "simulated failure", retry).await?;
            shared
                .tally
                .add(if accepted { "fails" } else { "fails refused" });
            accepted
        }
        _ => {
            let accepted = once::release_key(client, key, token).await?;
            shared.tally.add(if accepted {
                "releases"
            } else {
                "releases refused"
            });
            accepted
        }
    };
    if accepted {
        let ownership = Ownership {
            client: id,
            token,
            held,
            finishing,
        };
        shared
            .ownerships
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default()
            .push(ownership);
    } else {
        // From when the claim was asked for: an invalidation that ran after the claim
        // committed may have returned before the claim reached this client.
        let refusal = (key.to_owned(), id, token, asked, Instant::now());
        shared.refusals.lock().unwrap().push(refusal);
    }
    Ok(())
}

/// Invariant 1 over everything recorded.
fn check_ownerships(shared: &Shared) {
    let invalidations = shared.invalidations.lock().unwrap();
    for (key, client, token, held, refused) in shared.refusals.lock().unwrap().iter() {
        let cancelled = invalidations.get(key).is_some_and(|list| {
            list.iter()
                .any(|(sent, returned)| sent <= refused && returned >= held)
        });
        if !cancelled {
            shared.violation(format!(
                "key {key}: client {client} lost its claim (token {token}) while alive and within its lease"
            ));
        }
    }
    let mut ownerships = shared.ownerships.lock().unwrap();
    for (key, list) in ownerships.iter_mut() {
        list.sort_by_key(|o| o.held);
        for pair in list.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.held < a.finishing {
                shared.violation(format!(
                    "key {key}: client {} (token {}) held it while client {} (token {}) still owned it",
                    b.client, b.token, a.client, a.token
                ));
            }
        }
    }
}

/// Kill a random client's backend now and then, as a crashing pod would.
async fn killer(admin: Client, shared: Arc<Shared>, clients: usize, every: Duration) -> Result<()> {
    let mut rng = Rng(0xDEAD_BEEF);
    while !shared.stop.load(Relaxed) {
        tokio::time::sleep(every.mul_f64(0.5 + rng.below(100) as f64 / 100.0)).await;
        let victim = rng.below(clients as u64) as usize;
        let pid = shared.pids[victim].load(Relaxed) as i32;
        if pid == 0 || shared.killed[victim].load(Relaxed) {
            continue;
        }
        shared.killed[victim].store(true, Relaxed);
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await?;
        shared.tally.add("kills");
    }
    Ok(())
}

/// After the run, with every client gone: each key resolvable, each stored result
/// written under the key's current token.
async fn final_checks(admin: &Client, keys: usize, shared: &Shared) -> Result<()> {
    once::reap_stale(admin).await?;
    let rows = admin
        .query(
            "SELECT key, state::text, token, result FROM once.entries WHERE key LIKE 'soak/%'",
            &[],
        )
        .await?;
    for row in &rows {
        let (key, state, token, result): (String, String, i64, Option<serde_json::Value>) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if state == "done" {
            let written_by = result.as_ref().and_then(|r| r["token"].as_i64());
            if written_by != Some(token) {
                shared.violation(format!(
                    "key {key}: result {result:?} was not written under its current token {token}"
                ));
            }
        }
    }
    for k in 0..keys {
        let key = format!("soak/{k}");
        let claim = once::claim_key(admin, &key, Duration::from_secs(5), Duration::ZERO).await?;
        if claim.is("wait") {
            shared.violation(format!(
                "key {key} is stuck: owner {:?} though every client is gone",
                claim.owner
            ));
        } else if claim.is("claimed") {
            once::release_key(admin, &key, claim.token.unwrap()).await?;
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let admin = once::connect(&args.dsn).await?;
    admin
        .execute("SELECT once.invalidate_keys(prefix => 'soak/')", &[])
        .await?;
    let shared = Arc::new(Shared {
        ownerships: Mutex::default(),
        refusals: Mutex::default(),
        invalidations: Mutex::default(),
        killed: (0..args.clients).map(|_| AtomicBool::new(false)).collect(),
        pids: (0..args.clients).map(|_| AtomicU64::new(0)).collect(),
        tally: Tally::default(),
        violations: Mutex::default(),
        stop: AtomicBool::new(false),
    });
    println!(
        "soak: {} clients, {} keys, {} s, a client connection killed every ~{} ms",
        args.clients, args.keys, args.seconds, args.kill_every_ms
    );
    let clients: Vec<_> = (0..args.clients)
        .map(|id| tokio::spawn(client_loop(id, args.dsn.clone(), args.keys, shared.clone())))
        .collect();
    let killer = tokio::spawn(killer(
        once::connect(&args.dsn).await?,
        shared.clone(),
        args.clients,
        Duration::from_millis(args.kill_every_ms),
    ));

    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    let last_ops = AtomicU64::new(0);
    while Instant::now() < end {
        tokio::time::sleep(
            Duration::from_secs(1).min(end.saturating_duration_since(Instant::now())),
        )
        .await;
        let ops = shared.tally.get("operations");
        println!(
            "[{:>5.0}s] {:>7} ops ({:>5}/s)  claims {:>6}  completions {:>6}  kills {:>4}  violations {}",
            started.elapsed().as_secs_f64(),
            ops,
            ops - last_ops.swap(ops, Relaxed),
            shared.tally.get("claims"),
            shared.tally.get("completions"),
            shared.tally.get("kills"),
            shared.violations.lock().unwrap().len(),
        );
    }
    shared.stop.store(true, Relaxed);
    killer.await??;
    for c in clients {
        c.await??;
    }
    check_ownerships(&shared);
    final_checks(&admin, args.keys, &shared).await?;

    println!("\n| what | count |\n|---|---|");
    for (what, n) in shared.tally.0.lock().unwrap().iter() {
        println!("| {what} | {n} |");
    }
    let violations = shared.violations.lock().unwrap();
    let owned: usize = shared
        .ownerships
        .lock()
        .unwrap()
        .values()
        .map(Vec::len)
        .sum();
    println!("| ownerships checked for overlap | {owned} |");
    println!(
        "| refused writes checked for a cause | {} |",
        shared.refusals.lock().unwrap().len()
    );
    println!("| invariant violations | {} |", violations.len());
    anyhow::ensure!(
        violations.is_empty(),
        "{} invariant violations, first: {}",
        violations.len(),
        violations[0]
    );
    println!("\nall invariants held");
    Ok(())
}
