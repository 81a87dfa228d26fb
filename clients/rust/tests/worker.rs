//! The queue worker loop: every job completed exactly once across workers, and a worker
//! dropped while claiming. A graceful stop (W3) is the shared scenario
//! clients/conformance/scenarios/stopping.json.

mod common;

use common::proxy::{HoldingProxy, Server};
use common::{at_server, fresh, setups, Setup};
use pg_once_client::{raw, Options, WorkOptions};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A queue of this test's own: 3 attempts, backoff from 100 ms to 1 s.
async fn fresh_queue(admin: &tokio_postgres::Client, name: &str) -> String {
    let queue = fresh(name).replace('-', "_");
    raw::create_queue(
        admin,
        &queue,
        3,
        Duration::from_millis(100),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    queue
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_complete_every_job_once() {
    for setup in setups() {
        let admin = setup.admin().await;
        let queue = fresh_queue(&admin, "rust-q").await;
        let keys: Vec<String> = (0..60).map(|i| format!("{queue}/job/{i}")).collect();
        for key in &keys {
            let payload = json!({ "n": key });
            assert_eq!(
                raw::enqueue_key(&admin, key, Some(&payload), &queue, 0)
                    .await
                    .unwrap(),
                "queued"
            );
        }
        let seen: Arc<Mutex<HashMap<String, usize>>> = Default::default();
        let mut workers = Vec::new();
        let mut stops = Vec::new();
        for w in 0..3 {
            let client = setup
                .client(
                    &fresh("rust-worker"),
                    Options {
                        pool_size: 3,
                        ..Options::default()
                    },
                )
                .await;
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            let (seen, queue) = (seen.clone(), queue.clone());
            workers.push(tokio::spawn(async move {
                client
                    .work(
                        &queue,
                        move |job| {
                            let seen = seen.clone();
                            async move {
                                *seen.lock().unwrap().entry(job.key.clone()).or_default() += 1;
                                tokio::time::sleep(Duration::from_millis(30)).await;
                                Ok::<_, std::io::Error>(
                                    json!({ "done": job.key, "payload": job.payload }),
                                )
                            }
                        },
                        WorkOptions {
                            concurrency: 4,
                            worker: Some(format!("w{w}")),
                            ..WorkOptions::default()
                        },
                        async move {
                            let _ = stopped.await;
                        },
                    )
                    .await
            }));
        }
        let started = Instant::now();
        while seen.lock().unwrap().len() < keys.len() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "[{}] jobs not all handled",
                setup.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Let the last completions land, then stop the workers.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stopping = Instant::now();
        for stop in stops {
            let _ = stop.send(());
        }
        let mut completed = 0;
        for w in workers {
            let report = w.await.unwrap().expect("worker loop");
            assert_eq!(
                (report.failed, report.lost, report.errors),
                (0, 0, 0),
                "[{}] {report:?}",
                setup.name
            );
            completed += report.completed;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(3),
            "[{}] shutdown took {:?}",
            setup.name,
            stopping.elapsed()
        );
        assert_eq!(completed, keys.len() as u64, "[{}]", setup.name);
        assert!(
            seen.lock().unwrap().values().all(|&n| n == 1),
            "[{}] each job handled once",
            setup.name
        );
        for key in &keys {
            let claim = raw::claim_key(
                &admin,
                key,
                Duration::from_secs(5),
                Duration::ZERO,
                raw::Owner::Connection,
            )
            .await
            .unwrap();
            assert!(claim.is("hit"), "[{}] {key}: {claim:?}", setup.name);
            assert_eq!(claim.result.unwrap()["done"], Value::from(key.clone()));
        }

        raw::invalidate_keys(&admin, Some(&queue), None)
            .await
            .unwrap();
        raw::drop_queue(&admin, &queue).await.unwrap();
    }
}

/// enqueue_many: one statement for many keys, each answered as enqueue would, in order,
/// each with its own payload; a batch the server refuses changes nothing.
/// The state of `key` in once.entries, waited for (up to 10 s) to be other than `from`.
async fn state_after(
    admin: &tokio_postgres::Client,
    key: &str,
    from: Option<&str>,
) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state: Option<String> = admin
            .query_opt(
                "SELECT state::text FROM once.entries WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|row| row.get(0));
        if state.as_deref() != from || Instant::now() >= deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// R2: a worker loop whose future is dropped while its `claim_next` is on its way (the
/// server has claimed a job; the answer, held by a proxy, has not come) gives the job back
/// when the answer comes, rather than leave it held by nobody for its 60 s lease. Direct
/// only: the proxy stands before PG_ONCE_DSN's server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropped_while_claiming_gives_back_what_it_claimed() {
    let setup = &setups()[0];
    let admin = setup.admin().await;
    let queue = fresh_queue(&admin, "rust-q-dropped").await;
    let key = format!("{queue}/job");
    raw::enqueue_key(&admin, &key, None, &queue, 0)
        .await
        .unwrap();
    let queued = state_after(&admin, &key, None).await;
    let proxy = HoldingProxy::start(Server::of(&setup.direct_dsn)).await;
    let through = Setup {
        pool_dsn: at_server(&setup.pool_dsn, "127.0.0.1", proxy.port),
        ..setup.clone()
    };
    let client = through
        .client(&fresh("rust-worker-dropped"), Options::default())
        .await;
    client.ready(Duration::from_secs(10)).await.unwrap();
    // A pooled connection made before the pause, for claim_next to go out on.
    client.invalidate(&fresh("warm")).await.unwrap();
    proxy.pause();
    let handled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker = {
        let (client, queue, handled) = (client.clone(), queue.clone(), handled.clone());
        tokio::spawn(async move {
            let handler = move |_job| {
                handled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<_, std::io::Error>(Value::Null) }
            };
            let opts = WorkOptions {
                lease: Duration::from_secs(60),
                ..WorkOptions::default()
            };
            client
                .work(&queue, handler, opts, std::future::pending())
                .await
        })
    };
    assert_eq!(
        state_after(&admin, &key, queued.as_deref())
            .await
            .as_deref(),
        Some("running"),
        "claim_next never reached the server"
    );
    worker.abort();
    assert!(worker.await.unwrap_err().is_cancelled());
    proxy.resume();
    let after = state_after(&admin, &key, Some("running")).await;
    assert_eq!(after, queued, "the job was not given back");
    assert_eq!(handled.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn enqueue_many_answers_each_key_in_order() {
    for setup in setups() {
        let admin = setup.admin().await;
        let queue = fresh_queue(&admin, "rust-batch").await;
        let client = setup.client(&fresh("rust-batch"), Options::default()).await;
        let [old, a, b] = ["old", "a", "b"].map(|k| format!("{queue}/{k}"));
        assert_eq!(client.enqueue(&old, None, &queue).await.unwrap(), "queued");
        let payload = json!({ "n": 2 });
        let answered = client
            .enqueue_many(
                &[(&a, None), (&old, Some(&payload)), (&b, Some(&payload))],
                &queue,
            )
            .await
            .unwrap();
        assert_eq!(
            answered,
            vec![
                (a.clone(), "queued".to_owned()),
                (old.clone(), "duplicate".to_owned()),
                (b.clone(), "queued".to_owned()),
            ]
        );
        let row = admin
            .query_one("SELECT payload FROM once.entries WHERE key = $1", &[&b])
            .await
            .unwrap();
        assert_eq!(row.get::<_, Option<Value>>(0), Some(payload.clone()));
        assert!(client.enqueue_many(&[], &queue).await.unwrap().is_empty());
        // A key given twice: refused (22023), nothing written.
        let c = format!("{queue}/c");
        let err = client
            .enqueue_many(&[(&c, None), (&c, None)], &queue)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("are both"), "{err}");
        let count: i64 = admin
            .query_one("SELECT count(*) FROM once.entries WHERE key = $1", &[&c])
            .await
            .unwrap()
            .get(0);
        assert_eq!(count, 0);
        // An empty key is refused before anything is sent.
        assert!(client.enqueue_many(&[("", None)], &queue).await.is_err());
        raw::invalidate_keys(&admin, Some(&queue), None)
            .await
            .unwrap();
    }
}
