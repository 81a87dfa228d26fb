//! The fleet on direct connections: every simulated client is one PostgreSQL connection
//! making raw SQL calls, and that connection owns its claims.

use crate::fleet::{self, Act, Served};
use crate::story::{WaiterReport, Words};
use crate::{Args, LEASE, RETRY_AFTER, WAIT};
use anyhow::{Context, Result};
use pg_once_tools as once;
use pg_once_tools::pg_once_client::raw;
use std::time::Instant;
use tokio_postgres::Client;

pub struct Fleet {
    /// For the reconnect of a client whose connection was killed.
    dsn: String,
    clients: Vec<Client>,
    /// Each client's backend pid, the owner of its claims.
    pids: Vec<i32>,
}

impl Fleet {
    pub async fn connect(args: &Args) -> Result<Self> {
        let mut clients = Vec::new();
        let mut pids = Vec::new();
        for i in 0..args.clients {
            let c = once::connect(&args.dsn).await?;
            c.batch_execute(&format!("SET application_name = 'demo-client-{i}'"))
                .await?;
            pids.push(once::backend_pid(&c).await?);
            clients.push(c);
        }
        Ok(Fleet {
            dsn: args.dsn.clone(),
            clients,
            pids,
        })
    }
}

impl fleet::Fleet for Fleet {
    const WORDS: Words = Words {
        title: "pg_once demo",
        member: "client",
        members: "clients",
        setup: "Every client has its own connection to PostgreSQL (think: one pod each). For each request it\n\
                makes ONE call:  SELECT * FROM once.claim_key(url, lease => '30 s', wait => '30 s')\n\
                and gets back the cached page (hit), or is told to scrape it (claimed) and then calls\n\
                once.complete_key(url, token, page). Waiting happens inside the server: no polling, no LISTEN.",
        act2_title: "Act 2: a claimer dies mid-scrape",
        act2_explanation: |crowd, slow| {
            format!(
                "{crowd} clients ask for {slow}. Halfway through the scrape, the claimer's connection is killed\n\
                 (pg_terminate_backend: its pod crashed). Its {} s lease has barely started; watch who takes over, and when.",
                LEASE.as_secs()
            )
        },
        killing: |victim, pid| format!("killing client {victim:>2}'s connection (backend pid {pid})"),
        lost: |n| format!(" (+{n} killed)"),
        waiters: WaiterReport::PerUrl,
    };

    /// A single claim_key call that either answers from the cache, waits (server side)
    /// for whoever is scraping, or hands this client the scrape.
    async fn request(&self, who: usize, url: &str, act: &Act) -> Result<Served> {
        let client = &self.clients[who];
        let asked = Instant::now();
        let claim = match act.freshness {
            None => once::claim_key(client, url, LEASE, WAIT).await?,
            Some(_) => {
                raw::claim_key_serving_stale(client, url, LEASE, WAIT, raw::Owner::Connection)
                    .await?
            }
        };
        let freshness = act.freshness.map(|f| raw::Freshness {
            ttl: Some(f.ttl),
            stale: Some(f.stale),
            ..raw::Freshness::default()
        });
        match claim.outcome.as_str() {
            "hit" => Ok(act.hit(url, asked).await),
            "stale" => Ok(Served::Stale {
                waited: asked.elapsed(),
            }),
            "failed" => Ok(Served::SharedFailure),
            "claimed" | "refresh" => {
                let token = claim.token.context("a claim has a token")?;
                let retry = match claim.attempts.unwrap_or(1) {
                    1 => String::new(),
                    attempt => format!(", attempt {attempt}"),
                };
                let page = match act
                    .scrape(who, url, &format!(" (token {token}{retry})"))
                    .await
                {
                    Ok(page) => page,
                    Err(error) => {
                        return match once::fail_key(client, url, token, error, RETRY_AFTER).await {
                            Ok(_) => Ok(act.failed(who, url, error).await),
                            Err(_) => Ok(Served::Lost),
                        };
                    }
                };
                let completed = match &freshness {
                    None => once::complete_key(client, url, token, &page, None).await,
                    Some(f) => raw::complete_key_with(client, url, token, &page, f).await,
                };
                match completed {
                    Ok(true) => Ok(act.stored(who, url).await),
                    Ok(false) => {
                        act.narrator
                            .say(format!(
                                "client {who:>2} lost its claim on {url}; result discarded"
                            ))
                            .await;
                        Ok(Served::Lost)
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
                        act.narrator
                            .say(format!(
                                "client {who:>2} reconnects with its finished scrape and old token {token}: complete_key -> {stored} ({verdict})"
                            ))
                            .await;
                        Ok(Served::Lost)
                    }
                }
            }
            other => anyhow::bail!("request for {url} ended with {other} after {WAIT:?}"),
        }
    }

    fn claim_owner_pid(&self, who: usize) -> Result<i32> {
        Ok(self.pids[who])
    }
}
