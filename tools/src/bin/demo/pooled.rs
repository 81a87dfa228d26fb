//! The demo's story told through PgBouncer in transaction mode with pg_once_client: every
//! simulated process is a `pg_once_client::Client` whose calls go through the bouncer's few
//! server connections, and whose one direct LISTEN connection owns its claims.

use crate::{Narrator, LEASE, WAIT};
use anyhow::{Context, Result};
use pg_once_tools as once;
use pg_once_tools::pg_once_client::{CallOptions, Client, Error, Options};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Barrier};

/// How one request ended.
enum Served {
    Answered { waited: Duration },
    Scraped,
    SharedFailure,
    ScrapeFailed,
    Refused,
}

struct Fleet {
    processes: Vec<Client>,
    narrator: Narrator,
    scrape: Duration,
    scrapes: AtomicUsize,
}

impl Fleet {
    /// One request from process `who`: get_or_compute, whose compute is the scrape.
    async fn request(
        self: &Arc<Self>,
        who: usize,
        url: &str,
        fail_with: Option<&'static str>,
        claimed: Option<mpsc::UnboundedSender<(usize, Duration)>>,
    ) -> Result<Served> {
        let asked = Instant::now();
        let fleet = self.clone();
        let owned_url = url.to_owned();
        let compute = move || async move {
            fleet.scrapes.fetch_add(1, Ordering::SeqCst);
            fleet
                .narrator
                .say(format!(
                    "process {who:>2} claimed {owned_url}: scraping for {:.0?}",
                    fleet.scrape
                ))
                .await;
            if let Some(tx) = claimed {
                let _ = tx.send((who, fleet.narrator.elapsed().await));
            }
            tokio::time::sleep(fleet.scrape).await;
            match fail_with {
                Some(error) => Err(std::io::Error::other(error)),
                None => Ok(
                    json!({"url": owned_url, "title": format!("Page of {owned_url}"), "scraped_by": who}),
                ),
            }
        };
        let opts = CallOptions {
            retry_after: Some(Duration::from_secs(5)),
            ..CallOptions::default()
        };
        match self.processes[who]
            .get_or_compute::<Value, _, _, _>(url, compute, opts)
            .await
        {
            Ok(page) if page["scraped_by"] == json!(who) => {
                self.narrator
                    .say(format!(
                        "process {who:>2} stored {url}: everyone waiting for it is answered"
                    ))
                    .await;
                Ok(Served::Scraped)
            }
            Ok(_) => Ok(Served::Answered {
                waited: asked.elapsed(),
            }),
            Err(Error::Failed { .. }) => Ok(Served::SharedFailure),
            Err(Error::Compute { source, .. }) => {
                self.narrator
                    .say(format!("process {who:>2} failed {url}: \"{source}\" (shared for 5 s, then retried)"))
                    .await;
                Ok(Served::ScrapeFailed)
            }
            Err(Error::ClaimLost { .. }) => {
                self.narrator
                    .say(format!("process {who:>2} finishes its scrape of {url} and tries to store it: complete_key -> false (refused: the newer claim stands)"))
                    .await;
                Ok(Served::Refused)
            }
            Err(e) => Err(e).with_context(|| format!("process {who} asking for {url}")),
        }
    }

    /// Every (process, urls) in `plan` starts at once and works through its urls in order.
    async fn run(
        self: &Arc<Self>,
        plan: Vec<(usize, Vec<String>)>,
        fail_with: Option<&'static str>,
        claimed: Option<mpsc::UnboundedSender<(usize, Duration)>>,
    ) -> Result<Vec<Served>> {
        let barrier = Arc::new(Barrier::new(plan.len()));
        let tasks: Vec<_> = plan
            .into_iter()
            .map(|(who, urls)| {
                let (fleet, barrier, claimed) = (self.clone(), barrier.clone(), claimed.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let mut served = Vec::new();
                    for url in urls {
                        served.push(fleet.request(who, &url, fail_with, claimed.clone()).await?);
                    }
                    anyhow::Ok(served)
                })
            })
            .collect();
        let mut all = Vec::new();
        for task in tasks {
            all.extend(task.await??);
        }
        Ok(all)
    }
}

pub async fn run(args: &crate::Args, bouncer_dsn: &str, narrator: Narrator) -> Result<()> {
    let admin = once::connect(&args.dsn).await?;
    let run_id: i64 = admin
        .query_one("SELECT nextval('once.token_seq')", &[])
        .await?
        .get(0);
    let site = format!("https://shop.example/{run_id}");
    println!(
        "\x1b[1mpg_once demo through PgBouncer\x1b[0m: {} processes, {} URLs, each scrape takes {:.1} s",
        args.clients,
        args.urls,
        args.scrape_ms as f64 / 1000.0
    );
    println!("Each simulated process (think: pod) is a pg_once_client::Client. Its calls go through PgBouncer in");
    println!("transaction mode, a handful of server connections shared by everyone; waiting holds none of them.");
    println!("Its one direct connection LISTENs on channel \"once\" and owns its claims (once.owner_session()),");
    println!("so a pod that dies loses them at once while the bouncer's connections come and go.");

    let mut processes = Vec::new();
    for i in 0..args.clients {
        let client = Client::connect(
            &format!("{bouncer_dsn} application_name=demo-process-{i}"),
            Options {
                lease: LEASE,
                wait: WAIT,
                pool_size: 2,
                listen_conninfo: Some(format!(
                    "{} application_name=demo-process-{i}-listen",
                    args.dsn
                )),
                ..Options::default()
            },
        )
        .await?;
        client.ready(Duration::from_secs(10)).await?;
        processes.push(client);
    }
    let fleet = Arc::new(Fleet {
        processes,
        narrator: narrator.clone(),
        scrape: Duration::from_millis(args.scrape_ms),
        scrapes: AtomicUsize::new(0),
    });

    // Act 1: the stampede.
    let urls: Vec<String> = (0..args.urls)
        .map(|i| format!("{site}/product/{}", i + 1))
        .collect();
    let requests = args.clients * urls.len();
    narrator
        .act(
            "Act 1: a stampede",
            &format!("All {} processes ask for all {} URLs at the same moment ({requests} requests), each in its own order.", args.clients, urls.len()),
        )
        .await;
    let plan = (0..args.clients)
        .map(|who| {
            let mut mine = urls.clone();
            mine.rotate_left(who % urls.len());
            (who, mine)
        })
        .collect();
    let act1 = fleet.run(plan, None, None).await?;
    let waited = act1
        .iter()
        .filter(
            |s| matches!(s, Served::Answered { waited } if *waited > Duration::from_millis(100)),
        )
        .count();
    let scraped = act1.iter().filter(|s| matches!(s, Served::Scraped)).count();
    narrator
        .say(format!("{waited:>3} requests waited for a scrape in progress; {} were answered from the cache at once", act1.len() - waited - scraped))
        .await;
    println!(
        "\n  => {} requests served, {scraped} scrapes done. Without coordination: {requests} scrapes.",
        act1.len()
    );

    // Act 2: a process dies mid-scrape.
    let slow = format!("{site}/slow-page");
    let crowd = args.clients.min(10);
    narrator
        .act(
            "Act 2: a process dies mid-scrape",
            &format!(
                "{crowd} processes ask for {slow}. Halfway through the scrape, the claimer's LISTEN connection is killed\n\
                 (pg_terminate_backend: its pod crashed, as far as the server can tell). Its {} s lease has barely started.",
                LEASE.as_secs()
            ),
        )
        .await;
    let (claimed_tx, mut claimed_rx) = mpsc::unbounded_channel();
    let plan = (0..crowd).map(|who| (who, vec![slow.clone()])).collect();
    let act2 = {
        let fleet = fleet.clone();
        tokio::spawn(async move { fleet.run(plan, None, Some(claimed_tx)).await })
    };
    let (victim, _) = claimed_rx
        .recv()
        .await
        .context("somebody claims the slow page")?;
    tokio::time::sleep(fleet.scrape / 2).await;
    let pid = fleet.processes[victim]
        .owner_pid()
        .context("the victim is connected")?;
    let killed_at = narrator.elapsed().await;
    narrator
        .say(format!("killing process {victim:>2}'s LISTEN connection (backend pid {pid}), which owns its claims"))
        .await;
    once::terminate_backend(&admin, pid).await?;
    let (successor, taken_at) = claimed_rx.recv().await.context("a waiter takes over")?;
    let takeover = taken_at.saturating_sub(killed_at);
    narrator
        .say(format!("process {successor:>2} took over {:.0} ms after the kill (waiting for the lease would have taken {:.0} s)", takeover.as_secs_f64() * 1000.0, (LEASE - fleet.scrape / 2).as_secs_f64()))
        .await;
    let act2 = act2.await??;
    let refused = act2.iter().filter(|s| matches!(s, Served::Refused)).count();
    println!(
        "\n  => {} requests served, {} completed scrape, {refused} late completion refused. Takeover after {:.0} ms.",
        act2.len(),
        act2.iter().filter(|s| matches!(s, Served::Scraped)).count(),
        takeover.as_secs_f64() * 1000.0
    );

    // Act 3: a failure is shared.
    let broken = format!("{site}/broken-page");
    narrator
        .act(
            "Act 3: a failing upstream",
            &format!("{crowd} processes ask for {broken}, whose scrape fails. The failure is cached for 5 s (retry_after):\nwaiters get the error at once instead of each trying the broken upstream again."),
        )
        .await;
    let plan = (0..args.clients)
        .filter(|&p| p != victim)
        .take(crowd)
        .map(|who| (who, vec![broken.clone()]))
        .collect();
    let act3 = fleet.run(plan, Some("upstream returned 503"), None).await?;
    let shared = act3
        .iter()
        .filter(|s| matches!(s, Served::SharedFailure))
        .count();
    let attempted = act3
        .iter()
        .filter(|s| matches!(s, Served::ScrapeFailed))
        .count();
    println!("\n  => {} requests, {attempted} scrape attempted, {shared} requests got the failure without scraping.", act3.len());

    let served = act1.len() + act2.len() + act3.len();
    let scrapes = fleet.scrapes.load(Ordering::SeqCst);
    let stats = admin
        .query_one("SELECT running, done, failed, errors FROM once.stats", &[])
        .await?;
    println!("\n\x1b[1mSummary\x1b[0m");
    println!("  requests served              {served:>6}");
    println!(
        "  scrapes started              {scrapes:>6}   ({:.0} requests per scrape)",
        served as f64 / scrapes as f64
    );
    println!(
        "  takeover after a killed claimer {:>4.0} ms  (lease: {} s)",
        takeover.as_secs_f64() * 1000.0,
        LEASE.as_secs()
    );
    println!(
        "  once.stats: running {}, done {}, failed {}, errors counted {}",
        stats.get::<_, i64>(0),
        stats.get::<_, i64>(1),
        stats.get::<_, i64>(2),
        stats.get::<_, i64>(3)
    );
    Ok(())
}
