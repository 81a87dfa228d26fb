//! The Rust client's load in the HA test (pg_test/ha/README.md): compute-once calls on the
//! keys the Python and Node loads ask for at the same moment, and a queue worker, through
//! the multi-host connection string (tokio-postgres tries each host and keeps the one that
//! `target_session_attrs=read-write` accepts), until the stop file appears. Every call is
//! one JSON line in --out. Here rather than in pg_test/ha with the other two loads: a Rust
//! program needs a crate, and tools is the one that already holds the client's drivers.
//!
//!   ha_load --dsn "host=a,b port=1,2 target_session_attrs=read-write ..." --mode sync \
//!       --stop FILE --out FILE.jsonl

use anyhow::Result;
use clap::Parser;
use pg_once_client::{CallOptions, Client, Job, Options, WorkOptions};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Each call's wait; an answer later than this plus SLACK is reported as slow.
const WAIT: Duration = Duration::from_secs(10);
const SLACK: Duration = Duration::from_secs(2);

#[derive(Parser)]
struct Args {
    #[arg(long)]
    dsn: String,
    #[arg(long)]
    mode: String,
    #[arg(long)]
    stop: PathBuf,
    #[arg(long)]
    out: PathBuf,
}

struct Log(Mutex<std::fs::File>);

impl Log {
    fn record(&self, mut rec: Value) {
        rec["t"] = json!(now());
        let mut f = self.0.lock().unwrap();
        let _ = writeln!(f, "{rec}");
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let log = Arc::new(Log(Mutex::new(std::fs::File::create(&args.out)?)));
    let options = Options {
        lease: Duration::from_secs(10),
        wait: WAIT,
        pool_size: 4,
        connect_timeout: Duration::from_secs(3),
        ..Options::default()
    };
    // The server may be failing over as this starts: connect until it answers.
    let client = loop {
        match Client::connect(&args.dsn, options.clone()).await {
            Ok(c) => break c,
            Err(e) => {
                log.record(json!({"op": "connect", "ok": false, "error": e.to_string()}));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    log.record(json!({"op": "start"}));
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pending = Arc::new(AtomicI64::new(0));
    let mine = Arc::new(Mutex::new(HashSet::<String>::new()));
    let reported = Arc::new(Mutex::new(HashSet::<String>::new()));
    let seq = Arc::new(AtomicU64::new(0));

    let mut getters = Vec::new();
    for _ in 0..2 {
        let (client, log, stopped, pending) = (
            client.clone(),
            log.clone(),
            stopped.clone(),
            pending.clone(),
        );
        let (mine, reported, seq, mode) = (
            mine.clone(),
            reported.clone(),
            seq.clone(),
            args.mode.clone(),
        );
        getters.push(tokio::spawn(async move {
            while !stopped.load(Relaxed) {
                // 0.5 s buckets: the three loads ask for the same key at about the same time.
                let key = format!("ha:{mode}:s:{}", (now() * 2.0) as u64);
                let started = Instant::now();
                let u = format!("{}-{}", std::process::id(), seq.fetch_add(1, Relaxed));
                let mine2 = mine.clone();
                pending.fetch_add(1, Relaxed);
                let got = client
                    .get_or_compute(
                        &key,
                        move || async move {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            mine2.lock().unwrap().insert(u.clone());
                            Ok::<_, std::io::Error>(
                                json!({"by": "rust", "pid": std::process::id(), "u": u}),
                            )
                        },
                        CallOptions::default(),
                    )
                    .await;
                pending.fetch_sub(1, Relaxed);
                let slow = started.elapsed() > WAIT + SLACK;
                match got {
                    Ok(v) => {
                        let v: Value = v;
                        let u = v["u"].as_str().unwrap_or_default().to_string();
                        let computed =
                            mine.lock().unwrap().contains(&u) && reported.lock().unwrap().insert(u);
                        let ms = started.elapsed().as_millis() as u64;
                        log.record(json!({"op": "get", "key": key, "ok": true, "value": v,
                                          "computed": computed, "ms": ms, "slow": slow}));
                    }
                    Err(e) => {
                        log.record(json!({"op": "get", "key": key, "ok": false,
                                          "error": e.to_string(), "slow": slow}));
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }

    // The queue worker; it returns on a failure it does not retry itself: start it again.
    let worker = {
        let (client, log, stop, stopped) =
            (client.clone(), log.clone(), stop.clone(), stopped.clone());
        let queue = format!("ha_{}", args.mode);
        tokio::spawn(async move {
            while !stopped.load(Relaxed) {
                let log2 = log.clone();
                let handler = move |job: Job| {
                    let log = log2.clone();
                    async move {
                        log.record(json!({"op": "job", "key": job.key, "token": job.token}));
                        Ok::<_, std::io::Error>(json!({"by": "rust", "token": job.token}))
                    }
                };
                let opts = WorkOptions {
                    concurrency: 2,
                    lease: Duration::from_secs(10),
                    idle_wait: Duration::from_secs(1),
                    drain: Duration::from_secs(5),
                    ..WorkOptions::default()
                };
                let stop = stop.clone();
                if let Err(e) = client
                    .work(&queue, handler, opts, async move { stop.notified().await })
                    .await
                {
                    log.record(json!({"op": "worker-stopped", "error": e.to_string()}));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        })
    };

    while !args.stop.exists() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stopped.store(true, Relaxed);
    stop.notify_waiters();
    let deadline = tokio::time::Instant::now() + WAIT + SLACK;
    let mut left = 0;
    for g in getters.into_iter().chain(std::iter::once(worker)) {
        if tokio::time::timeout_at(deadline, g).await.is_err() {
            left += 1;
        }
    }
    log.record(json!({"op": "end", "pending": pending.load(Relaxed).max(0) + left}));
    client.shutdown(Duration::from_secs(1)).await;
    Ok(())
}
