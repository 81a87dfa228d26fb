//! Fencing tokens are never reused for the life of the cluster: not after DROP EXTENSION
//! and CREATE EXTENSION, nor when a dump is restored (once_internal.token_seq is anchored
//! to the clock: sql/schema.sql and src/storage/tokens.rs). DROP EXTENSION disturbs every
//! other test on the server, so scripts/test.sh runs this binary alone, one test at a
//! time, after the others.

use anyhow::{Context, Result};
use pg_once_multi::{admin, claimed_token, fresh_key, once, pg_bin};
use serde_json::json;
use std::process::{Command, Output};
use std::time::Duration;
use tokio_postgres::Client;

const LEASE: Duration = Duration::from_secs(600);
const NO_WAIT: Duration = Duration::ZERO;

/// The test server's connection string, for database `db`.
fn dsn_for(db: &str) -> Result<String> {
    Ok(format!("{} dbname={db}", once::dsn_from_env()?))
}

/// Every token the database has handed out so far is at most this: the sequence's value.
async fn highest_token(client: &Client) -> Result<i64> {
    Ok(client
        .query_one("SELECT last_value FROM once_internal.token_seq", &[])
        .await?
        .get(0))
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_keep_growing_across_drop_and_create_extension() -> Result<()> {
    let client = admin().await?;
    let key = fresh_key("recreated");
    let before = claimed_token(&client, &key).await?;
    let highest = highest_token(&client).await?;
    assert!(highest >= before);
    client
        .batch_execute("DROP EXTENSION pg_once CASCADE; CREATE EXTENSION pg_once")
        .await?;

    // A new session: the extension's objects are new ones.
    let client = once::connect(&once::dsn_from_env()?).await?;
    let again = claimed_token(&client, &key).await?;
    assert!(
        again > highest,
        "after DROP/CREATE EXTENSION the same key was claimed with token {again}, \
         not above {highest}, the highest token handed out before"
    );
    let other = claimed_token(&client, &fresh_key("recreated-other")).await?;
    assert!(
        other > again,
        "tokens still increase: {other} after {again}"
    );
    Ok(())
}

fn run(tool: &str, args: &[&str]) -> Result<Output> {
    Command::new(format!("{}/{tool}", pg_bin()))
        .args(args)
        .output()
        .with_context(|| format!("running {tool}"))
}

/// pg_dump of database `db` into `file` (custom format).
fn dump(db: &str, file: &str) -> Result<()> {
    let out = run("pg_dump", &["-Fc", "-f", file, "-d", &dsn_for(db)?])?;
    anyhow::ensure!(
        out.status.success(),
        "pg_dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A new, empty database `db` (one statement at a time: neither may run in a transaction
/// block, which several statements in one query string make).
async fn create_database(admin: &Client, db: &str) -> Result<()> {
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await?;
    Ok(())
}

/// A new database `db` with `file` restored into it in one transaction that stops at the
/// first error, as careful restores are run: pg_restore's exit status and stderr.
async fn restore(admin: &Client, db: &str, file: &str) -> Result<(bool, String)> {
    create_database(admin, db).await?;
    let out = run(
        "pg_restore",
        &[
            "--single-transaction",
            "--exit-on-error",
            "-d",
            &dsn_for(db)?,
            file,
        ],
    )?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restored_dump_hands_out_tokens_above_every_dumped_token() -> Result<()> {
    let admin = admin().await?;
    let (source, same, ahead) = (
        "pg_once_dump_source",
        "pg_once_restored",
        "pg_once_restored_ahead",
    );
    let dir = std::env::temp_dir();
    let file = |name: &str| dir.join(format!("{name}-{}.dump", std::process::id()));
    let (first, second) = (file("first"), file("second"));
    let (first, second) = (first.to_str().unwrap(), second.to_str().unwrap());
    create_database(&admin, source).await?;
    let src = once::connect(&dsn_for(source)?).await?;
    src.batch_execute("CREATE EXTENSION pg_once").await?;
    // A completed key, a running one, and one whose token may be kept elsewhere although
    // its row is gone.
    let done = fresh_key("dumped-done");
    let token = claimed_token(&src, &done).await?;
    assert!(once::complete_key(&src, &done, token, &json!("dumped"), None).await?);
    claimed_token(&src, &fresh_key("dumped-running")).await?;
    let gone = fresh_key("dumped-gone");
    claimed_token(&src, &gone).await?;
    // Its row removed (invalidate_keys cancels a running claim).
    src.execute("SELECT once.invalidate_keys(prefix => $1)", &[&gone])
        .await?;
    let dumped = highest_token(&src).await?;
    dump(source, first)?;

    // Tokens the source hands out after the dump: a restore into this cluster must never
    // hand them out again.
    for i in 0..3 {
        claimed_token(&src, &fresh_key(&format!("after-dump-{i}"))).await?;
    }
    let issued = highest_token(&src).await?;

    // Restored in the same cluster: the dump's setval takes the sequence back below tokens
    // issued since. The restore reports nothing, and
    // the first claims, made at once from many sessions, draw above every token issued,
    // each a different one.
    let (ok, stderr) = restore(&admin, same, first).await?;
    assert!(ok && stderr.is_empty(), "pg_restore: {stderr}");
    let restored = once::connect(&dsn_for(same)?).await?;
    // The keys were counted as they were restored (once.stats reads those counts).
    assert_eq!(pg_once_multi::stats_disagreement(&restored).await?, None);
    assert!(
        highest_token(&restored).await? <= dumped,
        "the restore set the sequence back to the dumped value"
    );
    let hit = once::claim_key(&restored, &done, LEASE, NO_WAIT).await?;
    assert_eq!(hit.result, Some(json!("dumped")), "{hit:?}");
    let dsn = dsn_for(same)?;
    let claims = (0..8).map(|i| {
        let dsn = dsn.clone();
        let key = if i == 0 {
            gone.clone()
        } else {
            fresh_key("restored-new")
        };
        tokio::spawn(async move {
            let client = once::connect(&dsn).await?;
            claimed_token(&client, &key).await
        })
    });
    let mut tokens = Vec::new();
    for claim in claims.collect::<Vec<_>>() {
        tokens.push(claim.await??);
    }
    tokens.sort_unstable();
    assert!(
        tokens[0] > issued,
        "tokens {tokens:?} after the restore, this cluster issued up to {issued}"
    );
    tokens.dedup();
    assert_eq!(tokens.len(), 8, "tokens handed out twice: {tokens:?}");
    drop(restored);

    // Restored from a cluster whose tokens are ahead of this one's clock (simulated by a
    // source whose sequence is 11 days ahead): the dumped value is carried over, never set
    // back to the clock.
    src.batch_execute(
        "SELECT setval('once_internal.token_seq', \
         (SELECT last_value FROM once_internal.token_seq) + 1000000000000)",
    )
    .await?;
    let far = claimed_token(&src, &fresh_key("dumped-far")).await?;
    dump(source, second)?;
    let (ok, stderr) = restore(&admin, ahead, second).await?;
    assert!(ok, "pg_restore: {stderr}");
    let restored = once::connect(&dsn_for(ahead)?).await?;
    let token = claimed_token(&restored, &fresh_key("restored-after-far")).await?;
    assert!(token > far, "token {token}, dumped up to {far}");
    drop((restored, src));

    for db in [source, same, ahead] {
        admin
            .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .await?;
    }
    for f in [first, second] {
        std::fs::remove_file(f)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn no_role_keeps_the_sequence_down_after_a_restore() -> Result<()> {
    // After a restore set the sequence back, the first backend to draw anchors it to the
    // clock, holding a lock so that two do not both; the others look again until it is
    // done. That lock was an advisory lock on pg_once's constant and the sequence's OID
    // (which pg_class shows to every role): any role that took it first kept the sequence
    // down, and every claim looked again for as long as the role liked.
    let admin = admin().await?;
    let db = format!("floor_{}", fresh_key("db").replace(['/', '-'], "_"));
    create_database(&admin, &db).await?;
    let owner = once::connect(&dsn_for(&db)?).await?;
    let mallory = format!("mallory_{db}");
    owner
        .batch_execute(&format!(
            "CREATE EXTENSION pg_once; CREATE ROLE {mallory} LOGIN;
             GRANT USAGE ON SCHEMA once TO {mallory};
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO {mallory};
             SELECT setval('once_internal.token_seq', 1);"
        ))
        .await?;
    let attacker = once::connect(&format!("{} user={mallory}", dsn_for(&db)?)).await?;
    let locked: bool = attacker
        .query_one(
            "SELECT pg_try_advisory_lock(x'6f6e6365'::int,
                    (SELECT oid FROM pg_class WHERE relname = 'token_seq')::int)",
            &[],
        )
        .await?
        .get(0);
    assert!(locked);
    owner.batch_execute("SET statement_timeout = '5 s'").await?;
    let claim = claimed_token(&owner, &fresh_key("after-restore")).await;
    drop(attacker);
    drop(owner);
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await?;
    admin.batch_execute(&format!("DROP ROLE {mallory}")).await?;
    claim.context("a claim while another role held pg_once's advisory lock")?;
    Ok(())
}
