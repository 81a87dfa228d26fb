//! get_or_compute against a real server, directly and through PgBouncer (transaction mode).

mod common;

use common::{fresh, setups, Setup};
use pg_once_client::{CallOptions, Client, Error, Options};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Counts = Arc<std::sync::Mutex<HashMap<String, usize>>>;

/// A compute function that counts its runs per key, takes `ms`, and returns the key.
fn counted(
    counts: &Counts,
    key: &str,
    ms: u64,
) -> impl FnOnce() -> futures_util::future::BoxFuture<'static, Result<Value, std::io::Error>> {
    let (counts, key) = (counts.clone(), key.to_owned());
    move || {
        Box::pin(async move {
            *counts.lock().unwrap().entry(key.clone()).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(json!({ "key": key }))
        })
    }
}

/// 100 concurrent callers in 20 processes (Clients with pools of 4), 5 keys: each key is
/// computed once and every caller gets its result. Through PgBouncer (pool of a few
/// server connections) this also shows waiters hold no connection: if they did, the
/// owners could not complete within the time limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_computation_per_key_with_100_callers() {
    for setup in setups() {
        let keys: Vec<String> = (0..5).map(|i| fresh(&format!("stampede{i}"))).collect();
        let counts = Counts::default();
        let mut clients = Vec::new();
        for p in 0..20 {
            let options = Options {
                pool_size: 4,
                ..Options::default()
            };
            clients.push(setup.client(&format!("rust-stampede-{p}"), options).await);
        }
        let started = Instant::now();
        let mut calls = Vec::new();
        for caller in 0..100 {
            let client = clients[caller % 20].clone();
            let key = keys[caller % 5].clone();
            let compute = counted(&counts, &key, 500);
            calls.push(tokio::spawn(async move {
                let v: Value = client
                    .get_or_compute(&key, compute, CallOptions::default())
                    .await
                    .expect("get_or_compute");
                (key, v)
            }));
        }
        for call in calls {
            let (key, value) = call.await.unwrap();
            assert_eq!(value, json!({ "key": key }), "[{}]", setup.name);
        }
        let elapsed = started.elapsed();
        for key in &keys {
            assert_eq!(
                counts.lock().unwrap()[key],
                1,
                "[{}] {key} computed once",
                setup.name
            );
        }
        assert!(
            elapsed < Duration::from_secs(5),
            "[{}] 100 callers took {elapsed:?}: waiters starved the owners?",
            setup.name
        );
        eprintln!(
            "[{}] 100 callers, 5 keys, 5 computations, {elapsed:?}",
            setup.name
        );
    }
}

/// The owner's pooled server connection is terminated mid-compute: its claim belongs to
/// its LISTEN connection, so it keeps it, completes, and nobody computes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owner_survives_its_pooled_connection_being_terminated() {
    for setup in setups() {
        let admin = setup.admin().await;
        let key = fresh("pooled-killed");
        let tag = fresh("rust-pooled");
        let owner = setup.client(&tag, Options::default()).await;
        let other = setup.client(&fresh("rust-other"), Options::default()).await;
        let counts = Counts::default();
        let first = {
            let (owner, key, compute) = (owner.clone(), key.clone(), counted(&counts, &key, 1500));
            tokio::spawn(async move {
                owner
                    .get_or_compute::<Value, _, _, _>(&key, compute, CallOptions::default())
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let killed: i64 = admin
            .query_one(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
                  WHERE application_name = $1) t",
                &[&tag],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            killed >= 1,
            "[{}] no pooled server connection to kill",
            setup.name
        );
        let second = {
            let (other, key, compute) = (other.clone(), key.clone(), counted(&counts, &key, 10));
            tokio::spawn(async move {
                other
                    .get_or_compute::<Value, _, _, _>(&key, compute, CallOptions::default())
                    .await
            })
        };
        let a = first.await.unwrap().expect("the owner completes");
        let b = second
            .await
            .unwrap()
            .expect("the other process gets its result");
        assert_eq!(a, json!({ "key": key }));
        assert_eq!(b, a);
        assert_eq!(
            counts.lock().unwrap()[&key],
            1,
            "[{}] computed once",
            setup.name
        );
    }
}

/// Wait for `counts[key]` to reach `n`; the instant it did.
async fn until_computed(counts: &Counts, key: &str, n: usize) -> Instant {
    loop {
        if counts.lock().unwrap().get(key).copied().unwrap_or(0) >= n {
            return Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A claim whose owner process dies (its LISTEN connection is terminated, or the whole
/// runtime goes away) is taken over by a waiting process within about a second, far
/// inside the 30 s lease; the dead owner's late result is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_owner_is_taken_over_within_about_a_second() {
    for setup in setups() {
        let admin = setup.admin().await;

        // (a) The LISTEN connection is terminated; the process lives on and finds out.
        let key = fresh("listener-killed");
        let counts = Counts::default();
        let owner = setup.client(&fresh("rust-owner"), Options::default()).await;
        let waiter = setup
            .client(&fresh("rust-waiter"), Options::default())
            .await;
        owner.ready(Duration::from_secs(5)).await.unwrap();
        let pid = owner.owner_pid().expect("connected");
        let first = {
            let (owner, key, compute) = (owner.clone(), key.clone(), counted(&counts, &key, 3000));
            tokio::spawn(async move {
                owner
                    .get_or_compute::<Value, _, _, _>(&key, compute, CallOptions::default())
                    .await
            })
        };
        until_computed(&counts, &key, 1).await;
        let second = {
            let (waiter, key, compute) = (waiter.clone(), key.clone(), counted(&counts, &key, 10));
            tokio::spawn(async move {
                waiter
                    .get_or_compute::<Value, _, _, _>(&key, compute, CallOptions::default())
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let killed = Instant::now();
        let done: bool = admin
            .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(done);
        let took_over = until_computed(&counts, &key, 2).await - killed;
        assert!(
            took_over < Duration::from_millis(1600),
            "[{}] takeover after {took_over:?}",
            setup.name
        );
        assert_eq!(second.await.unwrap().unwrap(), json!({ "key": key }));
        let late = first.await.unwrap();
        assert!(
            matches!(late, Err(Error::ClaimLost { .. })),
            "[{}] the dead owner's late result is refused: {late:?}",
            setup.name
        );
        // The process got a new LISTEN connection.
        owner.ready(Duration::from_secs(5)).await.unwrap();
        assert_ne!(owner.owner_pid(), Some(pid));
        eprintln!(
            "[{}] takeover after the LISTEN connection died: {took_over:?}",
            setup.name
        );

        // (b) The whole process goes away mid-compute: its runtime is shut down.
        let key = fresh("process-died");
        let counts2 = counts.clone();
        let (setup2, key2) = (setup.clone(), key.clone());
        let doomed = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let client = setup2
                    .client(&fresh("rust-doomed"), Options::default())
                    .await;
                let compute = counted(&counts2, &key2, 60_000);
                let k = key2.clone();
                tokio::spawn(async move {
                    let _ = client
                        .get_or_compute::<Value, _, _, _>(&k, compute, CallOptions::default())
                        .await;
                });
                until_computed(&counts2, &key2, 1).await;
            });
            rt // handed back so that the test decides when the process dies
        });
        let rt = tokio::task::spawn_blocking(move || doomed.join().unwrap())
            .await
            .unwrap();
        let second = {
            let (waiter, key, compute) = (waiter.clone(), key.clone(), counted(&counts, &key, 10));
            tokio::spawn(async move {
                waiter
                    .get_or_compute::<Value, _, _, _>(&key, compute, CallOptions::default())
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let died = Instant::now();
        rt.shutdown_background();
        let took_over = until_computed(&counts, &key, 2).await - died;
        assert!(
            took_over < Duration::from_millis(1600),
            "[{}] takeover after the process died: {took_over:?}",
            setup.name
        );
        assert_eq!(second.await.unwrap().unwrap(), json!({ "key": key }));
        eprintln!(
            "[{}] takeover after the process died: {took_over:?}",
            setup.name
        );
    }
}

/// A compute error is failed on the key: this process's callers get the error, another
/// process's waiter gets the shared failure with its retry time, and once that passes the
/// key is computed again. A result that is not JSON is an error too, and no key is stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compute_error_is_shared_and_the_key_is_not_stuck() {
    for setup in setups() {
        let key = fresh("failing");
        let a = setup
            .client(&fresh("rust-fail-a"), Options::default())
            .await;
        let b = setup
            .client(&fresh("rust-fail-b"), Options::default())
            .await;
        let runs = Arc::new(AtomicUsize::new(0));
        let opts = CallOptions {
            retry_after: Some(Duration::from_secs(2)),
            ..CallOptions::default()
        };
        let failing = |runs: &Arc<AtomicUsize>| {
            let runs = runs.clone();
            move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(500)).await;
                Err::<Value, _>(std::io::Error::other("upstream returned 503"))
            }
        };
        let call = |c: &Client| {
            let (c, key, f, opts) = (c.clone(), key.clone(), failing(&runs), opts.clone());
            tokio::spawn(async move { c.get_or_compute::<Value, _, _, _>(&key, f, opts).await })
        };
        let (a1, a2) = (call(&a), call(&a));
        setup.until_running(&key).await;
        let b1 = call(&b);
        for r in [a1.await.unwrap(), a2.await.unwrap()] {
            match r {
                Err(Error::Compute { source, .. }) => {
                    assert_eq!(source.to_string(), "upstream returned 503")
                }
                other => panic!("[{}] expected the compute error, got {other:?}", setup.name),
            }
        }
        match b1.await.unwrap() {
            Err(Error::Failed {
                message, retry_at, ..
            }) => {
                assert_eq!(message, "Error: upstream returned 503"); // F2: io::Error
                assert!(retry_at.is_some());
            }
            other => panic!(
                "[{}] expected the shared failure, got {other:?}",
                setup.name
            ),
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "[{}] one attempt",
            setup.name
        );
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let v: String = b
            .get_or_compute(
                &key,
                || async { Ok::<_, std::io::Error>("ok".to_string()) },
                opts,
            )
            .await
            .expect("computed again after retry_after");
        assert_eq!(v, "ok");

        // Not JSON: a map with non-string keys. The key is failed, not left claimed.
        let key = fresh("not-json");
        let opts = CallOptions {
            retry_after: Some(Duration::ZERO),
            ..CallOptions::default()
        };
        let bad = a
            .get_or_compute::<HashMap<(u8, u8), u8>, _, _, _>(
                &key,
                || async { Ok::<_, std::io::Error>(HashMap::from([((1, 2), 3)])) },
                opts.clone(),
            )
            .await;
        assert!(
            matches!(bad, Err(Error::NotSerializable { .. })),
            "[{}] {bad:?}",
            setup.name
        );
        let v: u8 = b
            .get_or_compute(&key, || async { Ok::<_, std::io::Error>(7) }, opts)
            .await
            .expect("not stuck");
        assert_eq!(v, 7);
    }
}

/// The overall wait runs out: a timeout error naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_times_out_with_the_key() {
    for setup in setups() {
        let key = fresh("slow");
        let a = setup
            .client(&fresh("rust-slow-a"), Options::default())
            .await;
        let b = setup
            .client(&fresh("rust-slow-b"), Options::default())
            .await;
        let k = key.clone();
        let slow = tokio::spawn(async move {
            a.get_or_compute::<u8, _, _, _>(
                &k,
                || async {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Ok::<_, std::io::Error>(1)
                },
                CallOptions::default(),
            )
            .await
        });
        setup.until_running(&key).await;
        let started = Instant::now();
        let r = b
            .get_or_compute::<u8, _, _, _>(
                &key,
                || async { Ok::<_, std::io::Error>(2) },
                CallOptions {
                    wait: Some(Duration::from_millis(800)),
                    ..CallOptions::default()
                },
            )
            .await;
        assert!(
            matches!(&r, Err(Error::Timeout { key: k, .. }) if *k == key),
            "[{}] {r:?}",
            setup.name
        );
        assert!(started.elapsed() < Duration::from_millis(1500));
        assert_eq!(slow.await.unwrap().unwrap(), 1);
        let _ = Setup::admin; // keep the helper in use for every test binary
    }
}
