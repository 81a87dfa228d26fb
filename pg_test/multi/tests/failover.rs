//! An asynchronous failover: a standby that missed the primary's last moment of WAL is
//! promoted, and a zombie that claimed a key in the lost WAL comes back with its token.
//! Its completion must be refused and no token handed out on the new primary may equal
//! one handed out on the old (src/storage/tokens.rs, docs/concepts.md "Fencing tokens").
//!
//! scripts/test.sh starts a streaming standby of the test server (PG_ONCE_PROMOTE_DATA_DIR,
//! reached at PG_ONCE_PROMOTE_DSN) and runs this binary alone: the test stops the
//! standby, crashes the primary (PG_ONCE_DATA_DIR) after handing out tokens the standby
//! never received, promotes the standby, and finally restarts the primary as it was. A
//! copy of the standby taken before the promotion is then promoted in turn, as a second
//! standby of the same primary would be after the first one died: its timeline has the
//! same number as the first one's.

use anyhow::{Context, Result};
use pg_once_multi::{claimed_token, fresh_key, once, pg_ctl, pg_ctl_on, start_test_server};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// How long a server may take to come up, replay or promote on a loaded machine.
const UP: Duration = Duration::from_secs(60);

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set: run through scripts/test.sh"))
}

/// Connect to `dsn` once the server there answers (and, with `writable`, accepts writes).
async fn connect_when(dsn: &str, writable: bool) -> Result<Client> {
    let deadline = Instant::now() + UP;
    loop {
        if let Ok(client) = once::connect(dsn).await {
            let in_recovery = client
                .query_one("SELECT pg_catalog.pg_is_in_recovery()", &[])
                .await
                .map(|row| row.get::<_, bool>(0));
            if matches!(in_recovery, Ok(r) if !(writable && r)) {
                return Ok(client);
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{dsn} did not come up within {UP:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait until the standby has replayed everything the primary had written.
async fn caught_up(primary: &Client, standby: &Client) -> Result<()> {
    let target: String = primary
        .query_one("SELECT pg_catalog.pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    let deadline = Instant::now() + UP;
    loop {
        let replayed: bool = standby
            .query_one(
                "SELECT pg_catalog.pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                &[&target],
            )
            .await?
            .get(0);
        if replayed {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the standby did not replay {target}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_zombie_of_a_lost_timeline_is_fenced_after_an_asynchronous_failover() -> Result<()> {
    let primary_dsn = once::dsn_from_env()?;
    let standby_dsn = env("PG_ONCE_PROMOTE_DSN")?;
    let standby_data = env("PG_ONCE_PROMOTE_DATA_DIR")?;
    let primary = connect_when(&primary_dsn, true).await?;
    let standby = connect_when(&standby_dsn, false).await?;
    let prefix = fresh_key("failover");

    // The standby has everything so far, then stops receiving: what follows is the
    // primary's last moment of WAL, which the failover loses.
    claimed_token(&primary, &format!("{prefix}/before")).await?;
    caught_up(&primary, &standby).await?;
    drop(standby);
    pg_ctl_on(&standby_data, &["stop", "-m", "fast"])?;
    let twin = format!("{standby_data}-twin");
    let _ = std::fs::remove_dir_all(&twin);
    let copied = std::process::Command::new("cp")
        .args(["-a", &standby_data, &twin])
        .status()?;
    anyhow::ensure!(copied.success(), "cp -a {standby_data} {twin} failed");

    // More tokens than the sequence logs ahead (32), so that the lost ones lie beyond
    // what the standby's copy of the sequence had reserved; the zombie's among them.
    let mut lost = Vec::new();
    for i in 0..100 {
        lost.push(claimed_token(&primary, &format!("{prefix}/lost-{i}")).await?);
    }
    let zombie_key = format!("{prefix}/zk");
    let zombie_token = claimed_token(&primary, &zombie_key).await?;
    lost.push(zombie_token);
    for i in 0..20 {
        lost.push(claimed_token(&primary, &format!("{prefix}/lost-after-{i}")).await?);
    }
    let highest_lost = *lost.iter().max().expect("tokens were drawn");
    drop(primary);

    // The primary dies; the standby is promoted.
    pg_ctl(&["stop", "-m", "immediate"])?;
    let outcome = async {
        pg_ctl_on(
            &standby_data,
            &["start", "-l", &format!("{standby_data}/../server.log")],
        )?;
        pg_ctl_on(&standby_data, &["promote"])?;
        let promoted = connect_when(&standby_dsn, true).await?;

        // The first claims on the new timeline come at once, from several sessions, as
        // when clients reconnect after a failover: one of them moves the tokens up, and
        // none may draw below while it does.
        let mut first = Vec::new();
        for i in 0..8 {
            let (dsn, key) = (standby_dsn.clone(), format!("{prefix}/first-{i}"));
            first.push(tokio::spawn(async move {
                let client = once::connect(&dsn).await?;
                claimed_token(&client, &key).await
            }));
        }
        let mut drawn = Vec::new();
        for claim in first {
            drawn.push(claim.await??);
        }
        drawn.sort();
        let distinct = drawn.len();
        drawn.dedup();
        anyhow::ensure!(
            drawn.len() == distinct,
            "the first claims drew one token twice: {drawn:?}"
        );
        // Claims until the new primary's tokens pass the zombie's (at most as many as
        // were lost), then the zombie's key, which the failover freed.
        while drawn.last().is_none_or(|t| *t < zombie_token - 1) && drawn.len() < lost.len() {
            drawn.push(claimed_token(&promoted, &fresh_key("failover-new")).await?);
        }
        let new_owner = claimed_token(&promoted, &zombie_key).await?;
        drawn.push(new_owner);

        // The zombie comes back (to the new primary, as a multi-host client would) and
        // completes with its token; then the new owner completes.
        let zombie = once::connect(&standby_dsn).await?;
        let zombie_won =
            once::complete_key(&zombie, &zombie_key, zombie_token, &json!("zombie"), None).await?;
        let owner_won =
            once::complete_key(&promoted, &zombie_key, new_owner, &json!("owner"), None).await?;
        let stored: serde_json::Value = promoted
            .query_one(
                "SELECT result FROM once.entries WHERE key_hash = once.key_hash($1)",
                &[&zombie_key],
            )
            .await?
            .get(0);
        let repeated: Vec<i64> = drawn.iter().filter(|t| lost.contains(t)).copied().collect();

        // The first new primary dies too, and the twin, which never saw its timeline, is
        // promoted: none of its tokens may be one the first handed out.
        drop((promoted, zombie));
        pg_ctl_on(&standby_data, &["stop", "-m", "immediate"])?;
        pg_ctl_on(&twin, &["start", "-l", &format!("{twin}/../twin.log")])?;
        pg_ctl_on(&twin, &["promote"])?;
        let second = connect_when(&standby_dsn, true).await?;
        let mut twin_drawn = Vec::new();
        for _ in 0..20 {
            twin_drawn.push(claimed_token(&second, &fresh_key("failover-twin")).await?);
        }
        anyhow::Ok((
            drawn, new_owner, zombie_won, owner_won, stored, repeated, twin_drawn,
        ))
    }
    .await;

    // Put the test server back as it was for the tests after this one.
    for data in [&standby_data, &twin] {
        if std::path::Path::new(&format!("{data}/postmaster.pid")).exists() {
            let _ = pg_ctl_on(data, &["stop", "-m", "immediate"]);
        }
    }
    std::fs::remove_dir_all(&twin)?;
    start_test_server()?;
    connect_when(&primary_dsn, true).await?;

    let (drawn, new_owner, zombie_won, owner_won, stored, repeated, twin_drawn) = outcome?;
    let mut broken = Vec::new();
    if let (Some(first), Some(last)) = (repeated.first(), repeated.last()) {
        broken.push(format!(
            "the new primary handed out {} tokens the lost WAL had handed out ({first} to {last})",
            repeated.len()
        ));
    }
    if let Some(low) = drawn.iter().find(|t| **t <= highest_lost) {
        broken.push(format!(
            "it handed out {low}, not above {highest_lost}, the highest of the lost WAL"
        ));
    }
    if zombie_won || !owner_won || stored != json!("owner") {
        broken.push(format!(
            "the zombie's completion with token {zombie_token} answered {zombie_won}, the new \
             owner's with {new_owner} answered {owner_won}, and the key holds {stored}"
        ));
    }
    let highest_first = *drawn.iter().max().expect("tokens were drawn");
    if let Some(low) = twin_drawn.iter().find(|t| **t <= highest_first) {
        let twice = twin_drawn.iter().filter(|t| drawn.contains(t)).count();
        broken.push(format!(
            "the second standby promoted handed out {low}, not above {highest_first}, the \
             highest the first one handed out ({twice} of its {} tokens were the first's)",
            twin_drawn.len()
        ));
    }
    assert!(broken.is_empty(), "{}", broken.join("; "));
    Ok(())
}
