//! The SQL edition's claim decision (once_internal.claim_decision) against the vectors
//! the extension's (src/protocol/decision.rs) is held to by `cargo test`:
//! src/protocol/claim_decisions.json. A fact a vector leaves out is passed as NULL, and
//! the function must then decide without it, as the Rust side must never ask for it.
//! scripts/test-sql-edition.sh runs this; against the extension there is nothing to run.

use anyhow::{ensure, Context, Result};
use pg_once_multi::{admin, edition};
use serde_json::Value;

const VECTORS: &str = include_str!("../../../src/protocol/claim_decisions.json");

#[tokio::test(flavor = "multi_thread")]
async fn the_sql_editions_claim_decision_decides_every_vector_as_written() -> Result<()> {
    if !edition() {
        eprintln!(
            "the extension's claim decision is src/protocol/decision.rs's, run by cargo test"
        );
        return Ok(());
    }
    let client = admin().await?;
    let vectors: Vec<Value> = serde_json::from_str(VECTORS)?;
    ensure!(vectors.len() >= 20, "{} vectors", vectors.len());
    let mut wrong = Vec::new();
    for v in &vectors {
        let seen = &v["seen"];
        let flag = |name: &str| seen[name].as_bool();
        let decided: String = client
            .query_one(
                "SELECT once_internal.claim_decision($1::text::once.key_state, $2, $3, $4, $5, \
                 $6, $7, $8, $9, $10)",
                &[
                    &seen["state"].as_str(),
                    &flag("fresh"),
                    &flag("servable_stale"),
                    &flag("retry_later"),
                    &flag("fingerprint_differs"),
                    &v["caller"]["standby"].as_bool().context("caller.standby")?,
                    &v["caller"]["serve_stale"]
                        .as_bool()
                        .context("caller.serve_stale")?,
                    &v["owner"].as_str(),
                    &v["early_refresh_drawn"].as_bool(),
                    &v["held_elsewhere"].as_bool(),
                ],
            )
            .await?
            .get(0);
        if decided != v["decision"].as_str().context("decision")? {
            wrong.push(format!("{}: decided {decided}", v["name"]));
        }
    }
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
    Ok(())
}
