//! The pg_once demo: a simulated fleet of clients asking for a handful of URLs whose
//! "scrape" takes seconds, narrated as it happens. Run it with scripts/demo.sh.

use anyhow::{Context, Result};
use clap::Parser;
use pg_once_tools as once;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Barrier, Mutex};
use tokio_postgres::Client;

mod pooled;

#[derive(Parser, Debug)]
#[command(about = "pg_once demo: many clients, few URLs, each URL scraped once")]
pub(crate) struct Args {
    /// libpq connection string of a database with pg_once installed.
    #[arg(long, env = "PG_ONCE_DSN")]
    dsn: String,
    /// Simulated clients, each on its own connection (think: pods).
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// Distinct URLs they all ask for.
    #[arg(long, default_value_t = 5)]
    urls: usize,
    /// How long one scrape takes, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    scrape_ms: u64,
    /// Reach the server through this PgBouncer (transaction mode) with pg_once_client:
    /// one Client per simulated process, each with a direct LISTEN connection (--dsn).
    #[arg(long)]
    bouncer_dsn: Option<String>,
}

/// Lease of a claim: long on purpose, so a takeover well under it shows liveness at work.
const LEASE: Duration = Duration::from_secs(30);
/// How long a request is willing to wait inside claim_key for someone else's scrape.
const WAIT: Duration = Duration::from_secs(30);

/// Timestamped narration relative to the start of the current act.
#[derive(Clone)]
struct Narrator {
    start: Arc<Mutex<Instant>>,
}

impl Narrator {
    async fn act(&self, title: &str, explanation: &str) {
        *self.start.lock().await = Instant::now();
        println!("\n\x1b[1m{title}\x1b[0m");
        for line in explanation.lines() {
            println!("  {line}");
        }
        println!();
    }
    async fn elapsed(&self) -> Duration {
        self.start.lock().await.elapsed()
    }
    async fn say(&self, line: impl AsRef<str>) {
        let t = self.elapsed().await;
        println!("  [+{:>6.3}s] {}", t.as_secs_f64(), line.as_ref());
    }
}

/// What happened to one request.
#[derive(Debug)]
enum Served {
    /// The cached result, after waiting this long (zero: it was already there).
    Hit {
        url: String,
        waited: Duration,
        answered_at: Duration,
    },
    /// This request did the scrape.
    Scraped,
    /// The last scrape failed; the request got that error without scraping again.
    SharedFailure,
    /// This request scraped, and the scrape failed.
    ScrapeFailed,
    /// This request's connection was killed mid-scrape.
    Killed,
}

struct Fleet {
    dsn: String,
    clients: Vec<Arc<Client>>,
    pids: Vec<i32>,
    narrator: Narrator,
    scrape: Duration,
}

impl Fleet {
    /// One request: a single claim_key call that either answers from the cache, waits
    /// (server side) for whoever is scraping, or hands this client the scrape.
    async fn request(
        &self,
        who: usize,
        url: &str,
        fail_with: Option<&str>,
        claimed: Option<&mpsc::UnboundedSender<(usize, Duration)>>,
    ) -> Result<Served> {
        let client = &self.clients[who];
        let asked = Instant::now();
        let claim = once::claim_key(client, url, LEASE, WAIT).await?;
        match claim.outcome.as_str() {
            "hit" => Ok(Served::Hit {
                url: url.to_string(),
                waited: asked.elapsed(),
                answered_at: self.narrator.elapsed().await,
            }),
            "failed" => Ok(Served::SharedFailure),
            "claimed" => {
                let token = claim.token.context("a claim has a token")?;
                let attempt = claim.attempts.unwrap_or(1);
                let retry = if attempt > 1 {
                    format!(", attempt {attempt}")
                } else {
                    String::new()
                };
                self.narrator
                    .say(format!(
                        "client {who:>2} claimed {url} (token {token}{retry}): scraping for {:.0?}",
                        self.scrape
                    ))
                    .await;
                if let Some(tx) = claimed {
                    let _ = tx.send((who, self.narrator.elapsed().await));
                }
                tokio::time::sleep(self.scrape).await;
                if let Some(error) = fail_with {
                    let retry_after = Duration::from_secs(5);
                    match once::fail_key(client, url, token, error, retry_after).await {
                        Ok(_) => {
                            self.narrator
                                .say(format!("client {who:>2} failed {url}: \"{error}\" (shared for {retry_after:?}, then retried)"))
                                .await;
                            return Ok(Served::ScrapeFailed);
                        }
                        Err(_) => return Ok(Served::Killed),
                    }
                }
                let page =
                    json!({"url": url, "title": format!("Page of {url}"), "scraped_by": who});
                match once::complete_key(client, url, token, &page, None).await {
                    Ok(true) => {
                        self.narrator
                            .say(format!(
                                "client {who:>2} stored {url}: everyone waiting for it is answered"
                            ))
                            .await;
                        Ok(Served::Scraped)
                    }
                    Ok(false) => {
                        self.narrator
                            .say(format!(
                                "client {who:>2} lost its claim on {url}; result discarded"
                            ))
                            .await;
                        Ok(Served::Killed)
                    }
                    Err(_) => {
                        // Its connection died mid-scrape. Like a pod that was only partitioned,
                        // it reconnects and tries to store its result anyway: the fencing token
                        // it holds is no longer current, so the write is refused.
                        let again = once::connect(&self.dsn).await?;
                        let stored = once::complete_key(&again, url, token, &page, None).await?;
                        let verdict = if stored {
                            "accepted: nobody had taken the claim over yet"
                        } else {
                            "refused: the newer claim stands"
                        };
                        self.narrator
                            .say(format!(
                                "client {who:>2} reconnects with its finished scrape and old token {token}: complete_key -> {stored} ({verdict})"
                            ))
                            .await;
                        Ok(Served::Killed)
                    }
                }
            }
            other => anyhow::bail!("request for {url} ended with {other} after {WAIT:?}"),
        }
    }

    /// Run `plan` (client, url) requests concurrently, each client working through its
    /// own list in order, all clients starting at the same instant.
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
                        served.push(
                            fleet
                                .request(who, &url, fail_with, claimed.as_ref())
                                .await?,
                        );
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

fn scrapes(served: &[Served]) -> usize {
    served
        .iter()
        .filter(|s| matches!(s, Served::Scraped))
        .count()
}

/// Scrapes begun, whether they completed, failed or were killed.
fn scrapes_started(served: &[Served]) -> usize {
    served
        .iter()
        .filter(|s| matches!(s, Served::Scraped | Served::ScrapeFailed | Served::Killed))
        .count()
}

/// Per URL: how many requests waited for a scrape and how soon after it they were answered.
fn waiter_report(served: &[Served]) -> BTreeMap<String, (usize, Duration, Duration)> {
    let mut report: BTreeMap<String, (usize, Duration, Duration)> = BTreeMap::new();
    for s in served {
        if let Served::Hit {
            url,
            waited,
            answered_at,
        } = s
        {
            if *waited > Duration::from_millis(100) {
                let e = report
                    .entry(url.clone())
                    .or_insert((0, *answered_at, *answered_at));
                e.0 += 1;
                e.1 = e.1.min(*answered_at);
                e.2 = e.2.max(*answered_at);
            }
        }
    }
    report
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let narrator = Narrator {
        start: Arc::new(Mutex::new(Instant::now())),
    };
    if let Some(bouncer_dsn) = &args.bouncer_dsn {
        return pooled::run(&args, bouncer_dsn, narrator).await;
    }
    let admin = once::connect(&args.dsn).await?;
    let run_id = admin
        .query_one("SELECT nextval('once.token_seq')", &[])
        .await?
        .get::<_, i64>(0);
    let site = format!("https://shop.example/{run_id}");

    println!(
        "\x1b[1mpg_once demo\x1b[0m: {} clients, {} URLs, each scrape takes {:.1} s",
        args.clients,
        args.urls,
        args.scrape_ms as f64 / 1000.0
    );
    println!("Every client has its own connection to PostgreSQL (think: one pod each). For each request it");
    println!("makes ONE call:  SELECT * FROM once.claim_key(url, lease => '30 s', wait => '30 s')");
    println!(
        "and gets back the cached page (hit), or is told to scrape it (claimed) and then calls"
    );
    println!("once.complete_key(url, token, page). Waiting happens inside the server: no polling, no LISTEN.");

    let mut clients = Vec::new();
    let mut pids = Vec::new();
    for i in 0..args.clients {
        let c = once::connect(&args.dsn).await?;
        c.batch_execute(&format!("SET application_name = 'demo-client-{i}'"))
            .await?;
        pids.push(once::backend_pid(&c).await?);
        clients.push(Arc::new(c));
    }
    let fleet = Arc::new(Fleet {
        dsn: args.dsn.clone(),
        clients,
        pids,
        narrator: narrator.clone(),
        scrape: Duration::from_millis(args.scrape_ms),
    });

    // Act 1: the stampede.
    let urls: Vec<String> = (0..args.urls)
        .map(|i| format!("{site}/product/{}", i + 1))
        .collect();
    let requests = args.clients * urls.len();
    narrator
        .act(
            "Act 1: a stampede",
            &format!("All {} clients ask for all {} URLs at the same moment ({requests} requests), each in its own order.", args.clients, urls.len()),
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
    for (url, (n, first, last)) in waiter_report(&act1) {
        narrator
            .say(format!(
                "{n:>3} requests for {url} waited and were answered between +{:.3}s and +{:.3}s",
                first.as_secs_f64(),
                last.as_secs_f64()
            ))
            .await;
    }
    let from_cache = act1
        .iter()
        .filter(
            |s| matches!(s, Served::Hit { waited, .. } if *waited <= Duration::from_millis(100)),
        )
        .count();
    narrator.say(format!("{from_cache:>3} more requests came after the scrapes and were answered from the cache at once")).await;
    println!(
        "\n  => {} requests served, {} scrapes done. Without coordination: {requests} scrapes.",
        act1.len(),
        scrapes(&act1)
    );

    // Act 2: a claimer dies mid-scrape.
    let slow = format!("{site}/slow-page");
    let crowd = args.clients.min(10);
    narrator
        .act(
            "Act 2: a claimer dies mid-scrape",
            &format!(
                "{crowd} clients ask for {slow}. Halfway through the scrape, the claimer's connection is killed\n\
                 (pg_terminate_backend: its pod crashed). Its {} s lease has barely started; watch who takes over, and when.",
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
    let killed_at = narrator.elapsed().await;
    narrator
        .say(format!(
            "killing client {victim:>2}'s connection (backend pid {})",
            fleet.pids[victim]
        ))
        .await;
    once::terminate_backend(&admin, fleet.pids[victim]).await?;
    let (successor, taken_at) = claimed_rx.recv().await.context("a waiter takes over")?;
    let takeover = taken_at.saturating_sub(killed_at);
    narrator.say(format!("client {successor:>2} took over {:.0} ms after the kill (waiting for the lease would have taken {:.0} s)", takeover.as_secs_f64() * 1000.0, (LEASE - fleet.scrape / 2).as_secs_f64())).await;
    let act2 = act2.await??;
    let act2_scrapes = scrapes(&act2);
    println!("\n  => {} requests served, {act2_scrapes} completed scrape (+1 killed). Takeover after {:.0} ms.", act2.len(), takeover.as_secs_f64() * 1000.0);

    // Act 3: a failure is shared.
    let broken = format!("{site}/broken-page");
    narrator
        .act(
            "Act 3: a failing upstream",
            &format!("{crowd} clients ask for {broken}, whose scrape fails. The failure is cached for 5 s (retry_after):\nwaiters get the error at once instead of each trying the broken upstream again."),
        )
        .await;
    let survivors: Vec<usize> = (0..args.clients)
        .filter(|&c| c != victim)
        .take(crowd)
        .collect();
    let plan = survivors
        .iter()
        .map(|&who| (who, vec![broken.clone()]))
        .collect();
    let act3 = fleet.run(plan, Some("upstream returned 503"), None).await?;
    let shared = act3
        .iter()
        .filter(|s| matches!(s, Served::SharedFailure))
        .count();
    println!("\n  => {} requests, {} scrape attempted, {shared} requests got the failure without scraping.", act3.len(), scrapes_started(&act3));

    let stats = admin
        .query_one("SELECT running, done, failed, errors FROM once.stats", &[])
        .await?;
    let served = act1.len() + act2.len() + act3.len();
    let done_scrapes = scrapes_started(&act1) + scrapes_started(&act2) + scrapes_started(&act3);
    println!("\n\x1b[1mSummary\x1b[0m");
    println!("  requests served              {served:>6}");
    println!(
        "  scrapes started              {done_scrapes:>6}   ({:.0} requests per scrape)",
        served as f64 / done_scrapes as f64
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
