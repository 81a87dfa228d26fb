//! How a token is drawn (src/storage/tokens.rs), in both editions: a token sequence that
//! arrives from elsewhere, as a restore of another cluster's dump or (on Citus) a shard
//! moved from another node sets it, is moved one band above its own before a token is
//! handed out; and a claim commits durably whatever synchronous_commit says. The other
//! ways into a band, a new timeline and a restore of this cluster's dump, are
//! failover.rs's and tokens.rs's.

use anyhow::Result;
use pg_once_multi::{admin, claimed_token, fresh_key};

const COUNT_BITS: u32 = 48;

#[tokio::test(flavor = "multi_thread")]
async fn a_sequence_from_elsewhere_hands_out_tokens_a_band_above_its_own() -> Result<()> {
    let owner = admin().await?;
    let before = claimed_token(&owner, &fresh_key("band-before")).await?;
    // What another cluster's dump would bring: a value one band above this cluster's.
    let foreign = ((before >> COUNT_BITS) + 1) << COUNT_BITS | 12345;
    owner
        .query_one(
            "SELECT pg_catalog.setval('once_internal.token_seq', $1)",
            &[&foreign],
        )
        .await?;

    let after = claimed_token(&owner, &fresh_key("band-after")).await?;
    assert!(
        after >> COUNT_BITS > foreign >> COUNT_BITS,
        "after the sequence was set to {foreign} (band {}), a claim got {after} (band {}), \
         in the band that cluster may have handed out after its dump",
        foreign >> COUNT_BITS,
        after >> COUNT_BITS
    );
    let recorded: i64 = owner
        .query_one(
            "SELECT pg_catalog.pg_sequence_last_value('once_internal.token_history')",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(
        recorded & 0xffff,
        after >> COUNT_BITS,
        "the band is recorded"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_commits_with_its_wal_flushed_even_with_synchronous_commit_off() -> Result<()> {
    let mut client = admin().await?;
    let transaction = client.transaction().await?;
    transaction
        .batch_execute("SET LOCAL synchronous_commit = off")
        .await?;
    let outcome: String = transaction
        .query_one(
            "SELECT outcome::text FROM once.claim_key($1, lease => '60 s')",
            &[&fresh_key("durable")],
        )
        .await?
        .get(0);
    assert_eq!(outcome, "claimed");
    let level: String = transaction
        .query_one("SHOW synchronous_commit", &[])
        .await?
        .get(0);
    assert_eq!(
        level, "local",
        "a claim under synchronous_commit = off commits without flushing: a crash right \
         after it loses the claim while its owner holds the token, which is drawn again"
    );
    transaction.commit().await?;
    Ok(())
}
