//! In-process coalescing: concurrent calls for one key in one process make one claim_key
//! call. Measured with the server's counters (once.stats, which only a preloaded server
//! keeps: on the other, only the single computation is checked), so this test is alone in
//! its binary: nothing else calls claim_key while it counts.
//!
//! "Concurrent" is made exact, not left to timing: the runtime has one thread and a batch
//! is one `join_all`, whose first poll starts every call before the task that resolves
//! the key can run. (With tasks on four threads, a late-scheduled task on a loaded
//! machine could begin after a fast hit had already returned, and rightly make a second
//! claim_key call.)

mod common;

use common::{fresh, setups};
use futures_util::future::join_all;
use pg_once_client::{CallOptions, Options};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// claims, hits and waits counted by the server since it started.
async fn counters(admin: &tokio_postgres::Client) -> Option<(i64, i64, i64)> {
    let row = admin
        .query_one("SELECT claims, hits, waits FROM once.stats", &[])
        .await
        .unwrap();
    Some((
        row.get::<_, Option<i64>>(0)?,
        row.get::<_, Option<i64>>(1)?,
        row.get::<_, Option<i64>>(2)?,
    ))
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_calls_in_one_process_make_one_claim() {
    for setup in setups() {
        let admin = setup.admin().await;
        let client = setup
            .client(
                &fresh("rust-coalesce"),
                Options {
                    pool_size: 4,
                    ..Options::default()
                },
            )
            .await;
        client.ready(Duration::from_secs(5)).await.unwrap();
        let key = fresh("coalesced");
        let runs = Arc::new(AtomicUsize::new(0));
        let before = counters(&admin).await;
        // n calls for the key, all begun in the same poll.
        let batch = |n: usize| {
            join_all((0..n).map(|i| {
                let runs = runs.clone();
                client.get_or_compute::<usize, _, _, _>(
                    &key,
                    move || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        Ok::<_, std::io::Error>(i)
                    },
                    CallOptions::default(),
                )
            }))
        };
        let results: Vec<usize> = batch(50).await.into_iter().map(|r| r.unwrap()).collect();
        assert!(
            results.iter().all(|&r| r == results[0]),
            "[{}] one outcome",
            setup.name
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let Some(before) = before else {
            eprintln!(
                "[{}] no once.stats counters (pg_once not preloaded): claim_key calls not counted",
                setup.name
            );
            continue;
        };
        let after = counters(&admin).await.unwrap();
        assert_eq!(
            (after.0 - before.0, after.2 - before.2),
            (1, 0),
            "[{}] 50 concurrent calls: one claim_key call (claimed), none told to wait",
            setup.name
        );
        // Once resolved, the next concurrent batch is one claim_key call: a hit.
        for result in batch(50).await {
            assert_eq!(result.unwrap(), results[0]);
        }
        let last = counters(&admin).await.unwrap();
        assert_eq!(
            (last.0 - after.0, last.1 - after.1, last.2 - after.2),
            (0, 1, 0),
            "[{}] 50 more calls: one hit",
            setup.name
        );
    }
}
