//! once.stats counts keys from counts kept as keys change (once_internal.key_counts), not
//! by scanning them: after any mix of calls, committed, rolled back, concurrent, under
//! namespaces created over existing keys, they equal a count of the keys themselves, for
//! an administrator and for a role that sees only some namespaces.

use anyhow::Result;
use pg_once_multi::roles::app_role;
use pg_once_multi::{admin, fresh_key, stats_disagreement};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// A small xorshift: the workload is random but reproducible from the seed it prints.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, sides: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % sides
    }
}

/// One connection's random calls on `keys` for `run`: claims, completions, failures
/// (with and without retries left), releases, invalidations, refreshes, enqueues and
/// claim_next, reap_stale, and transactions and savepoints that roll back.
async fn workload(client: Client, keys: Vec<String>, seed: u64, run: Duration) -> Result<()> {
    let mut dice = Dice(seed);
    let started = Instant::now();
    while started.elapsed() < run {
        let key = &keys[dice.roll(keys.len() as u64) as usize];
        let in_transaction = dice.roll(4) == 0;
        if in_transaction {
            client.batch_execute("BEGIN").await?;
        }
        let with_savepoint = in_transaction && dice.roll(2) == 0;
        if with_savepoint {
            client.batch_execute("SAVEPOINT s").await?;
        }
        let sql = match dice.roll(11) {
            0..=2 => "SELECT outcome FROM once.claim_key($1, lease => '30 s')",
            3 => "SELECT once.complete_key($1, e.token, '1')::text FROM once.entries e WHERE e.key_hash = once.key_hash($1)",
            4 => "SELECT once.fail_key($1, e.token, 'no', retry_after => '0 s')::text FROM once.entries e WHERE e.key_hash = once.key_hash($1)",
            5 => "SELECT once.release_key($1, e.token)::text FROM once.entries e WHERE e.key_hash = once.key_hash($1)",
            6 => "SELECT once.invalidate_key($1)::text",
            7 => "SELECT once.refresh_key($1)::text",
            8 => "SELECT once.enqueue_key($1, max_attempts => 2)",
            9 => "SELECT count(*)::text FROM once.claim_next(n => 3) c, LATERAL (SELECT CASE WHEN length(c.key) % 2 = 0 THEN once.complete_key(c.key, c.token, '2') ELSE once.fail_key(c.key, c.token, 'no') END) x WHERE $1 IS NOT NULL",
            _ => "SELECT reaped::text FROM (SELECT (once.reap_stale()).reclaimed AS reaped) r WHERE $1 IS NOT NULL",
        };
        // Wrong tokens, keys in another state, a key another connection holds: errors
        // and refusals are part of the workload, and roll back what they did.
        let failed = client.query(sql, &[key]).await.is_err();
        if with_savepoint && (failed || dice.roll(2) == 0) {
            client.batch_execute("ROLLBACK TO SAVEPOINT s").await?;
        }
        if in_transaction {
            let end = if failed || dice.roll(3) == 0 {
                "ROLLBACK"
            } else {
                "COMMIT"
            };
            client.batch_execute(end).await?;
        }
    }
    Ok(())
}

/// once.stats' counts as `client`'s role sees them.
async fn seen(client: &Client) -> Result<String> {
    let row = client
        .query_one(
            "SELECT format('%s/%s/%s/%s/%s/%s', queued, running, done, failed, errors, attempts) FROM once.stats",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// once.stats' counts as `reader` sees them, and a count of the keys `filter` selects
/// (its `$1` is `id`), read while the keys stay as they are: the two are read by two
/// sessions, one statement each, and a preloaded server's worker still takes back the
/// claims of the workload's closed connections for a while.
async fn seen_and_counted(
    admin: &Client,
    reader: &Client,
    filter: &str,
    id: &str,
) -> Result<(String, String)> {
    let count = format!(
        "SELECT format('%s/%s/%s/%s/%s/%s', count(*) FILTER (WHERE state = 'queued'),
                count(*) FILTER (WHERE state = 'running'), count(*) FILTER (WHERE state = 'done'),
                count(*) FILTER (WHERE state = 'failed'), coalesce(sum(errors), 0), coalesce(sum(attempts), 0))
           FROM once.entries WHERE {filter}"
    );
    for _ in 0..100 {
        let before: String = admin.query_one(&count, &[&id]).await?.get(0);
        let seen = seen(reader).await?;
        let after: String = admin.query_one(&count, &[&id]).await?.get(0);
        if before == after {
            return Ok((seen, after));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("the keys did not stop changing for 10 s")
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_equal_a_count_of_the_keys_after_a_random_workload() -> Result<()> {
    // It creates a namespace over existing keys: one such test at a time.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_key("counts").replace(['/', '-'], "_");
    let tenant = format!("tenant_{id}");
    let app = app_role(&admin, &tenant).await?;
    let early = format!("{id}/early/");
    let late = format!("{id}/late/");
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&early, &tenant],
        )
        .await?;
    let keys: Vec<String> = (0..60)
        .map(|i| match i % 3 {
            0 => format!("{early}{i}"),
            1 => format!("{late}{i}"),
            _ => format!("{id}/shared/{i}"),
        })
        .collect();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        | 1;
    println!("seed {seed}");
    let mut workers = Vec::new();
    for i in 0..4 {
        let client = if i == 0 {
            pg_once_multi::roles::connect_as(&tenant).await?
        } else {
            pg_once_multi::session().await?
        };
        workers.push(tokio::spawn(workload(
            client,
            keys.clone(),
            seed.wrapping_mul(i + 1) | 1,
            Duration::from_secs(3),
        )));
    }
    // Meanwhile a namespace is created over keys that exist (their counts move to it).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole, existing => 'adopt')",
            &[&late, &tenant],
        )
        .await?;
    for worker in workers {
        worker.await??;
    }
    // A takeover: the key stays running, its attempts grow.
    let taken = format!("{id}/shared/taken");
    let gone = pg_once_multi::session().await?;
    gone.query_one("SELECT outcome FROM once.claim_key($1)", &[&taken])
        .await?;
    drop(gone);
    let outcome: String = admin
        .query_one(
            "SELECT outcome || '/' || attempts FROM once.claim_key($1, wait => '5 s')",
            &[&taken],
        )
        .await?
        .get(0);
    assert_eq!(outcome, "claimed/2");
    assert_eq!(stats_disagreement(&admin).await?, None, "seed {seed}");

    // The tenant's view: the keys of both its namespaces and the shared ones; and a role
    // outside them sees neither namespace's counts. Neither sees once.cached results of
    // other roles (other tests') and neither has any of its own.
    let (seen_by_app, expected) = seen_and_counted(
        &admin,
        &app,
        "(once_internal.key_namespace(key) IS NULL OR left(key, length($1)) = $1)
         AND position('#cached:' IN key) = 0",
        &id,
    )
    .await?;
    assert_eq!(seen_by_app, expected, "seed {seed}");
    let outsider = format!("outsider_{id}");
    let outsider = app_role(&admin, &outsider).await?;
    let (seen_outside, expected_outside) = seen_and_counted(
        &admin,
        &outsider,
        "once_internal.key_namespace(key) IS NULL AND position('#cached:' IN key) = 0
         AND $1::text IS NOT NULL",
        &id,
    )
    .await?;
    assert_eq!(seen_outside, expected_outside, "seed {seed}");

    // Clean up: the namespaces' keys, then the namespaces.
    for prefix in [&early, &late] {
        admin
            .execute("SELECT once.invalidate_keys(prefix => $1)", &[prefix])
            .await?;
        admin
            .execute("SELECT once.drop_namespace($1)", &[prefix])
            .await?;
    }
    assert_eq!(stats_disagreement(&admin).await?, None, "seed {seed}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_transaction_does_not_hold_up_its_backends_next_writes() -> Result<()> {
    // Its claims are told `wait => 0`: not while another test creates a namespace.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    // Counts are written into a row of the writing backend's own; a prepared transaction
    // keeps that row locked after the backend moved on. Needs max_prepared_transactions.
    let admin = admin().await?;
    let prepared = pg_once_multi::max_prepared_transactions(&admin).await?;
    if prepared == 0 {
        println!("skipped: max_prepared_transactions = 0");
        return Ok(());
    }
    // Keys whose forgetting changes the counts (done, not running: nothing to announce,
    // which a prepared transaction may not do).
    let (first, second) = (fresh_key("prepared"), fresh_key("after-prepare"));
    for key in [&first, &second] {
        admin
            .execute(
                "SELECT once.complete_key($1, token, '1') FROM once.claim_key($1)",
                &[key],
            )
            .await?;
    }
    let client = pg_once_multi::session().await?;
    let gid = fresh_key("gid");
    client
        .batch_execute(&format!(
            "BEGIN; SELECT once.invalidate_key('{first}'); PREPARE TRANSACTION '{gid}'"
        ))
        .await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&second];
    let next = client.query_one("SELECT once.invalidate_key($1)", &params);
    let answered = pg_once_multi::answers_in_time(next, "the backend's prepared transaction").await;
    admin
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await?;
    answered?;
    assert_eq!(stats_disagreement(&admin).await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_repeatable_read_transaction_commits_across_a_fold() -> Result<()> {
    // Claims with wait => 0, which the other test's create_namespace answers `wait`.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    // A transaction's counts are written when it commits; under REPEATABLE READ (and
    // SERIALIZABLE) an update of a row that another transaction deleted after the snapshot
    // fails (40001), and reap_stale's fold deletes the backends' rows every round: every
    // such transaction that wrote keys and lasted past a round failed at COMMIT.
    let admin = admin().await?;
    let client = pg_once_multi::session().await?;
    let done = "SELECT once.complete_key($1, token, '1') FROM once.claim_key($1, wait => '0')";
    // A row of this backend's for the shared keys, then a transaction that writes there.
    client.execute(done, &[&fresh_key("before")]).await?;
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await?;
    client.execute(done, &[&fresh_key("inside")]).await?;
    // The fold, as the worker's next round does it (an administrator's reap_stale).
    admin.execute("SELECT once.reap_stale()", &[]).await?;
    let committed = client.batch_execute("COMMIT").await;
    if let Err(e) = &committed {
        let detail = e.as_db_error().and_then(|d| d.detail()).unwrap_or("");
        assert!(
            !detail.contains("pgrx"),
            "a backtrace reached the client: {detail}"
        );
    }
    committed?;
    assert_eq!(stats_disagreement(&admin).await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_administrators_open_reap_stale_holds_up_no_writer() -> Result<()> {
    // Claims with wait => 0, which a namespace being created answers `wait`.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    // An administrator's reap_stale folded every backend's counts into slot -1, keeping
    // the rows it folded locked until its transaction ended: the next commit of each of
    // those backends waited for it, and two such folds at once deadlocked at commit (the
    // soak against 10M keys, bench/soak-scale.sh, with administrators reaping beside the
    // worker). Only pg_once's worker folds the backends' rows now.
    let admin = admin().await?;
    // The tests' DSN names a superuser: a second administrator's connection.
    let reaper = pg_once_multi::session().await?;
    let client = pg_once_multi::session().await?;
    let done = "SELECT once.complete_key($1, token, '1') FROM once.claim_key($1, wait => '0')";
    // A row of the client's backend, then an administrator reaps and stays.
    client.execute(done, &[&fresh_key("before")]).await?;
    reaper
        .batch_execute("BEGIN; SELECT * FROM once.reap_stale()")
        .await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&fresh_key("after")];
    let next = client.execute(done, &params);
    let answered = pg_once_multi::answers_in_time(next, "an administrator's open reap_stale").await;
    reaper.batch_execute("ROLLBACK").await?;
    answered?;
    assert_eq!(stats_disagreement(&admin).await?, None);
    Ok(())
}
