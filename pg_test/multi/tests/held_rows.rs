//! A look at a key never waits for a lock it can do without, in both editions: a fresh
//! result whose read draws an early refresh, while another transaction holds its row, is a
//! hit at once (protocol::decision: held elsewhere, the early refresh is not taken). The
//! extension reads the row's header; the SQL edition tries the refresh with a 1 ms
//! lock_timeout. It had waited the caller's whole `wait` there, up to a day.

use anyhow::{ensure, Result};
use pg_once_multi::{admin, claimed_token, fresh_key, once};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread")]
async fn an_early_refresh_of_a_held_row_is_a_hit_at_once() -> Result<()> {
    let client = admin().await?;
    let key = fresh_key("held-early-refresh");
    // A result most reads of which draw an early refresh (XFetch: 1 s to compute, beta 100,
    // at most 30 s left: drawn unless the uniform draw is above 0.74), fresh long enough
    // for a loaded machine to make every look below before it expires.
    let token = claimed_token(&client, &key).await?;
    client.execute("SELECT pg_sleep(1)", &[]).await?;
    client
        .execute(
            "SELECT once.complete_key($1, $2, '\"v1\"', ttl => '30 seconds', beta => 100)",
            &[&key, &token],
        )
        .await?;
    // Another transaction takes that refresh and stays open: it holds the row.
    let holder = once::connect(&once::dsn_from_env()?).await?;
    holder.batch_execute("BEGIN").await?;
    let mut outcome = String::new();
    for _ in 0..100 {
        outcome = holder
            .query_one("SELECT outcome FROM once.claim_key($1)", &[&key])
            .await?
            .get(0);
        if outcome == "claimed" {
            break;
        }
    }
    ensure!(
        outcome == "claimed",
        "the holder never drew the early refresh"
    );
    // Looks from elsewhere, each told it may wait 20 s: hits, each well before that (one
    // that draws the refresh, three in four, would wait it all out for the holder's lock).
    for look in 0..5 {
        let started = Instant::now();
        let answer: String = client
            .query_one(
                "SELECT outcome FROM once.claim_key($1, wait => '20 seconds')",
                &[&key],
            )
            .await?
            .get(0);
        let took = started.elapsed();
        ensure!(answer == "hit", "look {look}: {answer}");
        ensure!(
            took < Duration::from_secs(10),
            "look {look} waited {} ms for the holder's lock",
            took.as_millis()
        );
    }
    holder.batch_execute("ROLLBACK").await?;
    Ok(())
}
