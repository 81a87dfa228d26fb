//! Queue mode across real connections: many workers, one queue.

use anyhow::Result;
use pg_once_multi::{admin, fresh_key, session};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use tokio_postgres::Client;

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_workers_never_get_the_same_key() -> Result<()> {
    const KEYS: usize = 500;
    const WORKERS: usize = 8;
    let admin = admin().await?;
    let queue = format!("q{}", fresh_key("").replace(['/', ' '], ""));
    admin
        .execute("SELECT once.create_queue($1)", &[&queue])
        .await?;
    admin
        .execute(
            "SELECT once.enqueue_key($1 || '/' || i, jsonb_build_object('i', i), $1)
               FROM generate_series(1, $2::int) i",
            &[&queue, &(KEYS as i32)],
        )
        .await?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (client, queue, seen) = (session().await?, queue.clone(), seen.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let rows = client
                    .query(
                        "SELECT key, token FROM once.claim_next($1, worker => $2, n => 5)",
                        &[&queue, &format!("worker-{w}")],
                    )
                    .await?;
                if rows.is_empty() {
                    return anyhow::Ok(());
                }
                let keys: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
                let tokens: Vec<i64> = rows.iter().map(|r| r.get(1)).collect();
                let results: Vec<serde_json::Value> =
                    keys.iter().map(|k| serde_json::json!(k)).collect();
                let done = client
                    .query(
                        "SELECT key FROM once.complete_keys($1, $2, $3)",
                        &[&keys, &tokens, &results],
                    )
                    .await?;
                anyhow::ensure!(done.len() == keys.len(), "a fresh claim was refused");
                seen.lock().unwrap().extend(keys);
            }
        }));
    }
    for w in workers {
        w.await??;
    }
    let seen: Vec<String> = seen.lock().unwrap().clone();
    let distinct: HashSet<&String> = seen.iter().collect();
    assert_eq!(seen.len(), KEYS, "every key handed out exactly once");
    assert_eq!(distinct.len(), KEYS);
    let (done, attempts): (i64, i64) = {
        let row = admin
            .query_one(
                "SELECT count(*) FILTER (WHERE state = 'done'),
                        (SELECT count(*) FROM once.attempts WHERE queue = $1)
                   FROM once.entries WHERE queue = $1",
                &[&queue],
            )
            .await?;
        (row.get(0), row.get(1))
    };
    assert_eq!((done, attempts), (KEYS as i64, KEYS as i64));
    admin
        .execute("SELECT once.invalidate_keys(queue => $1)", &[&queue])
        .await?;
    admin
        .execute("SELECT once.drop_queue($1)", &[&queue])
        .await?;
    Ok(())
}

/// once_internal.row_taken(tid) for a ctid given as text.
async fn taken(client: &Client, tid: &str) -> Result<Option<bool>> {
    let row = client
        .query_one("SELECT once_internal.row_taken($1::text::tid)", &[&tid])
        .await?;
    Ok(row.get(0))
}

/// once_internal.row_taken, claim_next's filter, says yes only for a row version that a committed
/// transaction replaced or deleted, or that another transaction in progress holds: never
/// for the current version once its holder has finished, nor for one whose update was
/// rolled back, nor for what the asking transaction holds itself. (A wrong yes would make
/// claim_next pass over a key that is free to take.)
#[tokio::test(flavor = "multi_thread")]
async fn row_taken_is_true_only_for_versions_held_or_replaced_elsewhere() -> Result<()> {
    let admin = admin().await?;
    let other = session().await?;
    let key = fresh_key("taken");
    // A snapshot older than every change below, so that no old version of the row is
    // pruned while the test asks about it: a pruned version is simply not there, and
    // row_taken rightly answers false (a "no" never does harm). Without it, another
    // test's access to the same page pruned the deleted version under load.
    let horizon = session().await?;
    horizon
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await?;
    admin
        .execute("SELECT once.enqueue_key($1)", &[&key])
        .await?;
    let ctid = || async {
        let row = admin
            .query_one(
                "SELECT ctid::text FROM once.entries WHERE key = $1",
                &[&key],
            )
            .await?;
        anyhow::Ok(row.get::<_, String>(0))
    };
    let queued = ctid().await?;
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(false),
        "current version"
    );

    let lock = "SELECT 1 FROM once.entries WHERE key = $1 FOR UPDATE";
    other.batch_execute("BEGIN").await?;
    other.execute(lock, &[&key]).await?;
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(true),
        "locked by another transaction in progress"
    );
    assert_eq!(
        taken(&other, &queued).await?,
        Some(false),
        "locked by the asking transaction"
    );
    other.batch_execute("SAVEPOINT s").await?;
    other
        .execute(
            "UPDATE once.entries SET priority = priority WHERE key = $1",
            &[&key],
        )
        .await?;
    assert_eq!(
        taken(&other, &queued).await?,
        Some(false),
        "locked and updated by the asking transaction and its subtransaction"
    );
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(true),
        "locked and updated by another transaction in progress (a multixact)"
    );
    other.batch_execute("ROLLBACK TO s").await?;
    other.batch_execute("COMMIT").await?;
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(false),
        "locked, committed: the lock is gone"
    );

    let update = "UPDATE once.entries SET priority = priority + 1 WHERE key = $1";
    other.batch_execute("BEGIN").await?;
    other.execute(update, &[&key]).await?;
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(true),
        "update in progress"
    );
    other.batch_execute("ROLLBACK").await?;
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(false),
        "update rolled back"
    );

    other.execute(update, &[&key]).await?;
    assert_eq!(
        taken(&admin, &queued).await?,
        Some(true),
        "updated, committed"
    );
    let updated = ctid().await?;
    assert_ne!(updated, queued);
    assert_eq!(
        taken(&admin, &updated).await?,
        Some(false),
        "the new version"
    );

    other
        .execute("SELECT once.invalidate_key($1)", &[&key])
        .await?;
    assert_eq!(
        taken(&admin, &updated).await?,
        Some(true),
        "deleted, committed"
    );

    horizon.batch_execute("COMMIT").await?;

    // Bad input: no such row version, or NULL.
    assert_eq!(taken(&admin, "(4294967294,1)").await?, Some(false));
    let row = admin
        .query_one("SELECT once_internal.row_taken(NULL)", &[])
        .await?;
    assert_eq!(row.get::<_, Option<bool>>(0), None);
    Ok(())
}

/// row_taken is not SECURITY DEFINER (it runs once per claim_next candidate), so it checks
/// privileges itself: a role that may execute it but not SELECT from once.entries gets
/// 42501, not a look at the rows' lock state. (The README's grants do not reach it at all:
/// nobody has USAGE on once_internal; this role is given it to get past that.)
#[tokio::test(flavor = "multi_thread")]
async fn row_taken_refuses_roles_that_cannot_read_entries() -> Result<()> {
    let admin = admin().await?;
    // All in one transaction that is rolled back: the role never outlives the test.
    admin
        .batch_execute(
            "BEGIN;
             CREATE ROLE once_multi_no_select;
             GRANT USAGE ON SCHEMA once TO once_multi_no_select;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO once_multi_no_select;
             GRANT USAGE ON SCHEMA once_internal TO once_multi_no_select;
             GRANT EXECUTE ON FUNCTION once_internal.row_taken(tid) TO once_multi_no_select;
             SET LOCAL ROLE once_multi_no_select;",
        )
        .await?;
    let error = taken(&admin, "(0,1)")
        .await
        .expect_err("row_taken answered a role without SELECT on once.entries");
    let db_error = error
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(|e| e.as_db_error())
        .unwrap_or_else(|| panic!("not a server error: {error:?}"));
    assert_eq!(
        db_error.code(),
        &tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE
    );
    assert_eq!(
        db_error.message(),
        "permission denied for function once_internal.row_taken"
    );
    admin.batch_execute("ROLLBACK").await?;
    Ok(())
}
