//! The demo's four acts, told the same way whichever fleet plays them: the banner, each
//! act's plan and narration, the reports after each act, and the summary. What a fleet
//! says differently comes from its `Words`.

use crate::fleet::{self, Act, Fleet, Freshness, Plan, Served};
use crate::narrator::Narrator;
use crate::{Args, LEASE, RETRY_AFTER};
use anyhow::{Context, Result};
use pg_once_tools as once;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// What the story says differently for each fleet.
pub struct Words {
    /// The banner's title.
    pub title: &'static str,
    /// What the narration calls one member of the fleet, and several.
    pub member: &'static str,
    pub members: &'static str,
    /// Printed under the banner: how a request reaches the server with this fleet.
    pub setup: &'static str,
    pub act2_title: &'static str,
    /// Act 2's explanation, given the crowd size and the slow page: what gets killed.
    pub act2_explanation: fn(crowd: usize, slow: &str) -> String,
    /// Act 2's narration of the kill, given the victim and the backend pid.
    pub killing: fn(victim: usize, pid: i32) -> String,
    /// Act 2's report of the requests that lost their claim, given how many did.
    pub lost: fn(usize) -> String,
    pub waiters: WaiterReport,
}

/// How Act 1 reports the requests that waited for someone else's scrape.
pub enum WaiterReport {
    /// For each URL, how many waited and when they were answered: all within a few
    /// milliseconds of the store, since the server wakes them itself.
    PerUrl,
    /// One line: how many waited and how many were answered from the cache.
    Totals,
}

/// A request answered within this was answered from the cache; a slower one waited.
const WAITED: Duration = Duration::from_millis(100);

/// Print the banner, connect the fleet (`connect` is awaited only after the banner, so
/// the reader sees what is coming while the connections are made) and play the acts.
pub async fn tell<F: Fleet>(
    args: &Args,
    narrator: Narrator,
    connect: impl Future<Output = Result<F>>,
) -> Result<()> {
    let words = &F::WORDS;
    let admin = once::connect(&args.dsn).await?;
    // A fresh sequence value gives this run its own URLs, so earlier runs' cache entries
    // do not answer its requests.
    let run_id: i64 = admin
        .query_one("SELECT nextval('once_internal.token_seq')", &[])
        .await?
        .get(0);
    let site = format!("https://shop.example/{run_id}");
    println!(
        "\x1b[1m{}\x1b[0m: {} {}, {} URLs, each scrape takes {:.1} s",
        words.title,
        args.clients,
        words.members,
        args.urls,
        args.scrape_ms as f64 / 1000.0
    );
    println!("{}", words.setup);
    let fleet = Arc::new(connect.await?);
    let act = |fail_with, claimed| Act {
        narrator: narrator.clone(),
        member: words.member,
        scrape_takes: Duration::from_millis(args.scrape_ms),
        fail_with,
        claimed,
        freshness: None,
        scrapes: Default::default(),
    };

    // Act 1: the stampede.
    let urls: Vec<String> = (0..args.urls)
        .map(|i| format!("{site}/product/{}", i + 1))
        .collect();
    let requests = args.clients * urls.len();
    narrator
        .act(
            "Act 1: a stampede",
            &format!(
                "All {} {} ask for all {} URLs at the same moment ({requests} requests), each in its own order.",
                args.clients,
                words.members,
                urls.len()
            ),
        )
        .await;
    let plan: Plan = (0..args.clients)
        .map(|who| {
            let mut mine = urls.clone();
            mine.rotate_left(who % urls.len());
            (who, mine)
        })
        .collect();
    let act1 = fleet::run(&fleet, plan, &act(None, None)).await?;
    report_waiters(&narrator, &words.waiters, &act1).await;
    println!(
        "\n  => {} requests served, {} scrapes done. Without coordination: {requests} scrapes.",
        act1.len(),
        count(&act1, |s| matches!(s, Served::Scraped))
    );

    // Act 2: a claimer dies mid-scrape.
    let slow = format!("{site}/slow-page");
    let crowd = args.clients.min(10);
    narrator
        .act(words.act2_title, &(words.act2_explanation)(crowd, &slow))
        .await;
    let (claimed_tx, mut claimed_rx) = mpsc::unbounded_channel();
    let plan = (0..crowd).map(|who| (who, vec![slow.clone()])).collect();
    let act2 = {
        let (fleet, act) = (fleet.clone(), act(None, Some(claimed_tx)));
        tokio::spawn(async move { fleet::run(&fleet, plan, &act).await })
    };
    let (victim, _) = claimed_rx
        .recv()
        .await
        .context("somebody claims the slow page")?;
    let halfway = Duration::from_millis(args.scrape_ms) / 2;
    tokio::time::sleep(halfway).await;
    let pid = fleet.claim_owner_pid(victim)?;
    let killed_at = narrator.elapsed().await;
    narrator.say((words.killing)(victim, pid)).await;
    once::terminate_backend(&admin, pid).await?;
    let (successor, taken_at) = claimed_rx.recv().await.context("a waiter takes over")?;
    let takeover_ms = taken_at.saturating_sub(killed_at).as_secs_f64() * 1000.0;
    narrator
        .say(format!(
            "{} {successor:>2} took over {takeover_ms:.0} ms after the kill (waiting for the lease would have taken {:.0} s)",
            words.member,
            (LEASE - halfway).as_secs_f64()
        ))
        .await;
    let act2 = act2.await??;
    println!(
        "\n  => {} requests served, {} completed scrape{}. Takeover after {takeover_ms:.0} ms.",
        act2.len(),
        count(&act2, |s| matches!(s, Served::Scraped)),
        (words.lost)(count(&act2, |s| matches!(s, Served::Lost)))
    );

    // Act 3: a failure is shared. The victim of Act 2 sits it out.
    let broken = format!("{site}/broken-page");
    narrator
        .act(
            "Act 3: a failing upstream",
            &format!(
                "{crowd} {} ask for {broken}, whose scrape fails. The failure is cached for {} s (retry_after):\n\
                 waiters get the error at once instead of each trying the broken upstream again.",
                words.members,
                RETRY_AFTER.as_secs()
            ),
        )
        .await;
    let plan = (0..args.clients)
        .filter(|&who| who != victim)
        .take(crowd)
        .map(|who| (who, vec![broken.clone()]))
        .collect();
    let act3 = fleet::run(&fleet, plan, &act(Some("upstream returned 503"), None)).await?;
    println!(
        "\n  => {} requests, {} scrape attempted, {} requests got the failure without scraping.",
        act3.len(),
        scrapes_started(&act3),
        count(&act3, |s| matches!(s, Served::SharedFailure))
    );

    // Act 4: an expiry, served stale. Everyone but the victim of Act 2 takes part.
    let front = format!("{site}/front-page");
    let freshness = Freshness {
        ttl: Duration::from_secs(2),
        stale: Duration::from_secs(60),
    };
    narrator
        .act(
            "Act 4: an expiry",
            &format!(
                "{front} is cached for {} s (ttl), then may be served stale for {} s more (stale) while one\n\
                 {} refreshes it. Without that, everyone asking after the ttl would wait for the new scrape.",
                freshness.ttl.as_secs(),
                freshness.stale.as_secs(),
                words.member
            ),
        )
        .await;
    let members: Vec<usize> = (0..args.clients).filter(|&who| who != victim).collect();
    let act4 = Act {
        freshness: Some(freshness),
        ..act(None, None)
    };
    fleet::run(&fleet, vec![(members[0], vec![front.clone()])], &act4).await?;
    tokio::time::sleep(freshness.ttl + Duration::from_millis(200)).await;
    narrator
        .say(format!(
            "the page is {} s old, past its ttl: all {} {} ask for it at once",
            freshness.ttl.as_secs(),
            members.len(),
            words.members
        ))
        .await;
    let refreshes_before = act4.scrapes();
    let plan = members
        .iter()
        .map(|&who| (who, vec![front.clone()]))
        .collect();
    let asked = fleet::run(&fleet, plan, &act4).await?;
    let stale: Vec<Duration> = asked
        .iter()
        .filter_map(|s| match s {
            Served::Stale { waited } => Some(*waited),
            _ => None,
        })
        .collect();
    let slowest = stale.iter().max().copied().unwrap_or_default();
    // A request that does not take stale answers waits for the refresh, which may still
    // run in the background of a process, and then gets the new page.
    let outcome: String = admin
        .query_one(
            "SELECT outcome FROM once.claim_key($1, wait => '30 seconds')",
            &[&front],
        )
        .await?
        .get(0);
    let refreshed = act4.scrapes() - refreshes_before;
    println!(
        "\n  => {} of {} requests got the old page at once (slowest {:.1} ms) while {refreshed} scrape refreshed it;\n     \
         a request that waits for the refresh: {outcome}.",
        stale.len(),
        asked.len(),
        slowest.as_secs_f64() * 1000.0
    );

    let stats = admin
        .query_one("SELECT running, done, failed, errors FROM once.stats", &[])
        .await?;
    let served = act1.len() + act2.len() + act3.len() + asked.len();
    let scrapes =
        scrapes_started(&act1) + scrapes_started(&act2) + scrapes_started(&act3) + act4.scrapes();
    println!("\n\x1b[1mSummary\x1b[0m");
    println!("  requests served              {served:>6}");
    println!(
        "  scrapes started              {scrapes:>6}   ({:.0} requests per scrape)",
        served as f64 / scrapes as f64
    );
    println!(
        "  takeover after a killed claimer {takeover_ms:>4.0} ms  (lease: {} s)",
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

fn count(served: &[Served], which: impl Fn(&Served) -> bool) -> usize {
    served.iter().filter(|s| which(s)).count()
}

/// Scrapes begun, whether they were stored, failed or lost their claim.
fn scrapes_started(served: &[Served]) -> usize {
    count(served, |s| {
        matches!(s, Served::Scraped | Served::ScrapeFailed | Served::Lost)
    })
}

/// Act 1's report on the requests that did not scrape: which waited, which hit the cache.
async fn report_waiters(narrator: &Narrator, style: &WaiterReport, served: &[Served]) {
    let from_cache = count(
        served,
        |s| matches!(s, Served::Hit { waited, .. } if *waited <= WAITED),
    );
    match style {
        WaiterReport::PerUrl => {
            for (url, (n, first, last)) in waiters_per_url(served) {
                narrator
                    .say(format!(
                        "{n:>3} requests for {url} waited and were answered between +{:.3}s and +{:.3}s",
                        first.as_secs_f64(),
                        last.as_secs_f64()
                    ))
                    .await;
            }
            narrator
                .say(format!("{from_cache:>3} more requests came after the scrapes and were answered from the cache at once"))
                .await;
        }
        WaiterReport::Totals => {
            let waited = count(
                served,
                |s| matches!(s, Served::Hit { waited, .. } if *waited > WAITED),
            );
            narrator
                .say(format!("{waited:>3} requests waited for a scrape in progress; {from_cache} were answered from the cache at once"))
                .await;
        }
    }
}

/// Per URL: how many requests waited for its scrape, and the first and last time (into
/// the act) one of them was answered.
fn waiters_per_url(served: &[Served]) -> BTreeMap<&str, (usize, Duration, Duration)> {
    let mut report: BTreeMap<&str, (usize, Duration, Duration)> = BTreeMap::new();
    for s in served {
        if let Served::Hit {
            url,
            waited,
            answered_at,
        } = s
        {
            if *waited > WAITED {
                let e = report.entry(url).or_insert((0, *answered_at, *answered_at));
                e.0 += 1;
                e.1 = e.1.min(*answered_at);
                e.2 = e.2.max(*answered_at);
            }
        }
    }
    report
}
