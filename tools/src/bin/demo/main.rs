//! The pg_once demo: a simulated fleet of clients asking for a handful of URLs whose
//! "scrape" takes seconds, narrated as it happens. Run it with scripts/demo.sh.
//!
//! The story (`story`) is told once; the fleet that plays it is either `direct` (one
//! connection per client, raw SQL) or, with --bouncer-dsn, `pooled` (pg_once_client
//! processes through PgBouncer). `fleet` holds what the two have in common.

use anyhow::Result;
use clap::Parser;
use std::time::Duration;

mod direct;
mod fleet;
mod narrator;
mod pooled;
mod story;

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
/// How long a failed scrape's error is handed to later requests before one tries again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let narrator = narrator::Narrator::new();
    match &args.bouncer_dsn {
        None => story::tell(&args, narrator, direct::Fleet::connect(&args)).await,
        Some(bouncer_dsn) => {
            story::tell(&args, narrator, pooled::Fleet::connect(&args, bouncer_dsn)).await
        }
    }
}
