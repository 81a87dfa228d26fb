//! How a token is drawn (src/storage/tokens.rs), in both editions: a token sequence set
//! back, as pg_restore of a dump sets it (into this database, another one, or another
//! cluster), is anchored to the clock before a token is handed out, so no token handed
//! out since the dump is handed out again; and no role without pg_once's grants can keep
//! it from being anchored. The other ways back, a crash and a new timeline, are crash.rs's
//! and failover.rs's.

use anyhow::Result;
use pg_once_multi::{admin, answers_in_time, claimed_token, fresh_key, once, superuser};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// storage::tokens::LAG: how far behind the clock a draw may be and still be handed out.
const LAG: i64 = 10_000;

/// The server's clock in the unit of tokens: microseconds since 2000-01-01.
async fn clock(client: &Client) -> Result<i64> {
    Ok(client
        .query_one(
            "SELECT (pg_catalog.date_part('epoch', pg_catalog.clock_timestamp() - \
             '2000-01-01 00:00:00+00'::pg_catalog.timestamptz) * 1000000)::bigint",
            &[],
        )
        .await?
        .get(0))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sequence_set_back_by_a_restore_never_hands_a_token_out_again() -> Result<()> {
    let owner = admin().await?;
    // What a dump taken now saves: the sequence's value.
    let dumped: i64 = claimed_token(&owner, &fresh_key("dumped")).await?;
    // Claims after the dump, whose tokens their owners keep (in object storage, in a
    // zombie worker).
    let mut issued = Vec::new();
    for i in 0..40 {
        issued.push(claimed_token(&owner, &fresh_key(&format!("after-dump-{i}"))).await?);
    }
    let highest = *issued.iter().max().expect("tokens were drawn");
    // A restore comes later than LAG after the last of them (pg_restore alone takes
    // longer): wait until the server's clock says so, then set the sequence back as the
    // dump's `SELECT pg_catalog.setval(...)` does.
    until_an_anchor_is_due(&owner, highest).await?;
    owner
        .query_one(
            "SELECT pg_catalog.setval('once_internal.token_seq', $1)",
            &[&dumped],
        )
        .await?;

    // The first claims after it come at once from several sessions.
    let dsn = once::dsn_from_env()?;
    let claims: Vec<_> = (0..8)
        .map(|_| {
            let dsn = dsn.clone();
            tokio::spawn(async move {
                let client = once::connect(&dsn).await?;
                claimed_token(&client, &fresh_key("after-restore")).await
            })
        })
        .collect();
    let mut after = Vec::new();
    for claim in claims {
        after.push(claim.await??);
    }
    after.sort_unstable();
    let again: Vec<i64> = after
        .iter()
        .filter(|t| issued.contains(t))
        .copied()
        .collect();
    assert!(
        again.is_empty() && after[0] > highest,
        "after the sequence was set back to {dumped}, claims got {after:?}: {} of them handed \
         out after the dump already, the highest of which was {highest}",
        again.len()
    );
    let distinct = after.len();
    after.dedup();
    assert_eq!(after.len(), distinct, "a token drawn twice: {after:?}");
    Ok(())
}

/// Wait until the server's clock is LAG past `token`: the next draw is behind it, and
/// anchors.
async fn until_an_anchor_is_due(client: &Client, token: i64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while clock(client).await? <= token + LAG {
        anyhow::ensure!(Instant::now() < deadline, "the server's clock stands still");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn no_role_without_grants_keeps_the_sequence_from_being_anchored() -> Result<()> {
    // The lock an anchor takes was SHARE ROW EXCLUSIVE on the SQL edition's
    // once_internal.token_lock, whose schema every role may use there. A role with no
    // grant at all held ROW EXCLUSIVE on it: the parser locks the target of an INSERT,
    // and privileges are checked only when it runs, which PREPARE never does. Every
    // claim that needed an anchor then looked again until its statement_timeout, whatever
    // its `wait`. (On the extension, the schema is closed to such a role: the PREPARE
    // fails.)
    let owner = admin().await?;
    owner
        .batch_execute("SET statement_timeout = '10 s'")
        .await?;
    let last = claimed_token(&owner, &fresh_key("anchor-before")).await?;
    let root = superuser().await?;
    let mallory = format!("mallory_{}", fresh_key("anchor").replace(['/', '-'], "_"));
    root.batch_execute(&format!("CREATE ROLE {mallory} LOGIN"))
        .await?;
    let attacker = once::connect(&format!("{} user={mallory}", once::dsn_from_env()?)).await?;
    attacker.batch_execute("BEGIN").await?;
    let held = attacker
        .batch_execute("PREPARE hold AS INSERT INTO once_internal.token_lock DEFAULT VALUES")
        .await
        .is_ok();

    until_an_anchor_is_due(&owner, last).await?;
    let claim = answers_in_time(
        owner.query_one(
            "SELECT outcome::text FROM once.claim_key($1, lease => '60 s', wait => '1 s')",
            &[&fresh_key("anchor-after")],
        ),
        &format!("an anchor, while {mallory} held a lock on token_lock: {held}"),
    )
    .await;
    drop(attacker);
    root.batch_execute(&format!("DROP ROLE {mallory}")).await?;
    claim
}
