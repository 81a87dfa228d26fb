//! The fleet through PgBouncer in transaction mode with pg_once_client: every simulated
//! process is a `pg_once_client::Client` whose calls go through the bouncer's few server
//! connections, and whose one direct LISTEN connection owns its claims.

use crate::fleet::{self, Act, Served};
use crate::story::{WaiterReport, Words};
use crate::{Args, LEASE, RETRY_AFTER, WAIT};
use anyhow::{Context, Result};
use pg_once_tools::pg_once_client::{CallOptions, Client, Error, Options};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

pub struct Fleet {
    processes: Vec<Client>,
}

impl Fleet {
    pub async fn connect(args: &Args, bouncer_dsn: &str) -> Result<Self> {
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
        Ok(Fleet { processes })
    }
}

impl fleet::Fleet for Fleet {
    const WORDS: Words = Words {
        title: "pg_once demo through PgBouncer",
        member: "process",
        members: "processes",
        setup: "Each simulated process (think: pod) is a pg_once_client::Client. Its calls go through PgBouncer in\n\
                transaction mode, a handful of server connections shared by everyone; waiting holds none of them.\n\
                Its one direct connection LISTENs on channel \"once\" and owns its claims (once.owner_session()),\n\
                so a pod that dies loses them at once while the bouncer's connections come and go.",
        act2_title: "Act 2: a process dies mid-scrape",
        act2_explanation: |crowd, slow| {
            format!(
                "{crowd} processes ask for {slow}. Halfway through the scrape, the claimer's LISTEN connection is killed\n\
                 (pg_terminate_backend: its pod crashed, as far as the server can tell). Its {} s lease has barely started.",
                LEASE.as_secs()
            )
        },
        killing: |victim, pid| {
            format!("killing process {victim:>2}'s LISTEN connection (backend pid {pid}), which owns its claims")
        },
        lost: |n| format!(", {n} late completion refused"),
        waiters: WaiterReport::Totals,
    };

    /// get_or_compute, whose compute is the scrape.
    async fn request(&self, who: usize, url: &str, act: &Act) -> Result<Served> {
        let asked = Instant::now();
        // The compute runs as its own task inside the client, so it gets its own copies.
        let (for_compute, owned_url) = (act.clone(), url.to_owned());
        let compute = move || async move {
            for_compute
                .scrape(who, &owned_url, "")
                .await
                .map_err(std::io::Error::other)
        };
        let opts = CallOptions {
            retry_after: Some(RETRY_AFTER),
            ttl: act.freshness.map(|f| Some(f.ttl)),
            stale: act.freshness.map(|f| f.stale),
            ..CallOptions::default()
        };
        match self.processes[who]
            .get_or_compute::<Value, _, _, _>(url, compute, opts)
            .await
        {
            // With a stale window every answer is immediate: the old page while one
            // process refreshes it in the background.
            Ok(_) if act.freshness.is_some() && asked.elapsed() < act.scrape_takes => {
                Ok(Served::Stale {
                    waited: asked.elapsed(),
                })
            }
            // The client does not say whether this call computed the page; the page does.
            Ok(page) if page["scraped_by"] == json!(who) => Ok(act.stored(who, url).await),
            Ok(_) => Ok(act.hit(url, asked).await),
            Err(Error::Failed { .. }) => Ok(Served::SharedFailure),
            Err(Error::Compute { source, .. }) => Ok(act.failed(who, url, source).await),
            Err(Error::ClaimLost { .. }) => {
                act.narrator
                    .say(format!("process {who:>2} finishes its scrape of {url} and tries to store it: complete_key -> false (refused: the newer claim stands)"))
                    .await;
                Ok(Served::Lost)
            }
            Err(e) => Err(e).with_context(|| format!("process {who} asking for {url}")),
        }
    }

    fn claim_owner_pid(&self, who: usize) -> Result<i32> {
        self.processes[who]
            .owner_pid()
            .context("the victim is connected")
    }
}
