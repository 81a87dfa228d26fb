//! What the two fleets (direct connections, and processes through PgBouncer) have in
//! common: the trait the story drives them through, how a request can end, the scrape
//! itself with its narration, and running an act's plan with everyone starting at once.

use crate::narrator::Narrator;
use crate::story::Words;
use crate::RETRY_AFTER;
use anyhow::Result;
use serde_json::{json, Value};
use std::fmt::Display;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Barrier};

/// A set of simulated clients that can each ask pg_once for a URL. The two fleets differ
/// in how a request reaches the server and which connection owns a claim; the story
/// (acts, plans, reports, summary) is the same for both and lives in `story`.
pub trait Fleet: Send + Sync + 'static {
    /// Everything the story says differently for this fleet.
    const WORDS: Words;

    /// One request from member `who` for `url`: answered from the cache, after waiting for
    /// someone else's scrape, or by scraping it (`act.scrape`) and storing the page.
    /// The future is `Send` so that the members' requests can run as separate tasks.
    fn request(
        &self,
        who: usize,
        url: &str,
        act: &Act,
    ) -> impl Future<Output = Result<Served>> + Send;

    /// The backend pid whose termination takes `who`'s claims away, as a crashed pod would.
    fn claim_owner_pid(&self, who: usize) -> Result<i32>;
}

/// How one request ended.
#[derive(Debug)]
pub enum Served {
    /// The cached result, after waiting this long (about zero: it was already there).
    Hit {
        url: String,
        waited: Duration,
        answered_at: Duration,
    },
    /// This request did the scrape and stored the page.
    Scraped,
    /// The last scrape failed; the request got that error without scraping again.
    SharedFailure,
    /// This request scraped, and the scrape failed.
    ScrapeFailed,
    /// This request scraped but lost its claim meanwhile (its claim owner was killed), so
    /// its result was not stored.
    Lost,
    /// The previous page, past its ttl, served after this long (about zero: it never waits)
    /// while someone refreshes it (Act 4).
    Stale { waited: Duration },
}

/// Act 4's pages: fresh for `ttl`, then served stale for `stale` while one member
/// refreshes them.
#[derive(Clone, Copy)]
pub struct Freshness {
    pub ttl: Duration,
    pub stale: Duration,
}

/// What every request of one act shares: the narrator, and how its scrapes go.
#[derive(Clone)]
pub struct Act {
    pub narrator: Narrator,
    /// "client" or "process", for the narration.
    pub member: &'static str,
    pub scrape_takes: Duration,
    /// Every scrape in this act fails with this error (Act 3's broken upstream).
    pub fail_with: Option<&'static str>,
    /// Told (who, when) as each scrape starts, so Act 2 can pick its victim and time
    /// the takeover.
    pub claimed: Option<mpsc::UnboundedSender<(usize, Duration)>>,
    /// Act 4: pages are stored with a ttl and a stale window, and requests take stale
    /// answers.
    pub freshness: Option<Freshness>,
    /// Scrapes started in this act, a process's refresh in the background included.
    pub scrapes: Arc<AtomicUsize>,
}

impl Act {
    /// The scrape, after `who` won the claim on `url` (`claim` adds what the fleet knows
    /// about the claim): narrate it, report it on `claimed`, take the time, and return
    /// the page, or the upstream's error.
    pub async fn scrape(&self, who: usize, url: &str, claim: &str) -> Result<Value, &'static str> {
        self.narrator
            .say(format!(
                "{} {who:>2} claimed {url}{claim}: scraping for {:.0?}",
                self.member, self.scrape_takes
            ))
            .await;
        self.scrapes.fetch_add(1, Ordering::SeqCst);
        if let Some(tx) = &self.claimed {
            let _ = tx.send((who, self.narrator.elapsed().await));
        }
        tokio::time::sleep(self.scrape_takes).await;
        match self.fail_with {
            Some(error) => Err(error),
            None => Ok(json!({"url": url, "title": format!("Page of {url}"), "scraped_by": who})),
        }
    }

    /// A request answered with the stored page, `asked` being when it was made.
    pub async fn hit(&self, url: &str, asked: Instant) -> Served {
        Served::Hit {
            url: url.to_string(),
            waited: asked.elapsed(),
            answered_at: self.narrator.elapsed().await,
        }
    }

    /// Scrapes started in this act so far.
    pub fn scrapes(&self) -> usize {
        self.scrapes.load(Ordering::SeqCst)
    }

    pub async fn stored(&self, who: usize, url: &str) -> Served {
        let whom = match self.freshness {
            Some(f) => format!("fresh for {} s, then stale", f.ttl.as_secs()),
            None => "everyone waiting for it is answered".to_owned(),
        };
        self.narrator
            .say(format!("{} {who:>2} stored {url}: {whom}", self.member))
            .await;
        Served::Scraped
    }

    pub async fn failed(&self, who: usize, url: &str, error: impl Display) -> Served {
        self.narrator
            .say(format!(
                "{} {who:>2} failed {url}: \"{error}\" (shared for {} s, then retried)",
                self.member,
                RETRY_AFTER.as_secs()
            ))
            .await;
        Served::ScrapeFailed
    }
}

/// Who asks for what in an act: (member, the URLs it asks for in order).
pub type Plan = Vec<(usize, Vec<String>)>;

/// Run `plan` concurrently, each member working through its own list in order, all
/// members starting at the same instant (that is what makes Act 1 a stampede).
pub async fn run<F: Fleet>(fleet: &Arc<F>, plan: Plan, act: &Act) -> Result<Vec<Served>> {
    let barrier = Arc::new(Barrier::new(plan.len()));
    let tasks: Vec<_> = plan
        .into_iter()
        .map(|(who, urls)| {
            let (fleet, barrier, act) = (fleet.clone(), barrier.clone(), act.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut served = Vec::new();
                for url in urls {
                    served.push(fleet.request(who, &url, &act).await?);
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
