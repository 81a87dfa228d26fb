//! Queue mode across real connections: many workers, one queue.

use anyhow::Result;
use pg_once_multi::{admin, fresh_key, session};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

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
