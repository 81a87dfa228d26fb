//! Freshness (pg_once 0.2) through get_or_compute, directly and through PgBouncer
//! (transaction mode): stale-while-revalidate, early (XFetch) refreshes in the background,
//! stale-if-error, and background refreshes given back when a client shuts down.
//!
//! "At once" means well inside the computation's duration: a call that waited for it
//! would take at least that long.

mod common;

use common::{fresh, setups, Setup};
use pg_once_client::raw::{self, Owner};
use pg_once_client::{CallOptions, Client, Options};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Counts the computations of one key and when each began.
#[derive(Clone, Default)]
struct Runs {
    started: Arc<Mutex<Vec<SystemTime>>>,
    failing: Arc<AtomicUsize>,
}

impl Runs {
    fn count(&self) -> usize {
        self.started.lock().unwrap().len()
    }

    /// A computation taking `ms` that returns `{"run": n}`, n counting from 1; the next
    /// `fail_next` ones fail instead (after `ms`).
    fn compute(
        &self,
        ms: u64,
    ) -> impl FnOnce() -> futures_util::future::BoxFuture<'static, Result<Value, std::io::Error>>
    {
        let runs = self.clone();
        move || {
            Box::pin(async move {
                let n = {
                    let mut started = runs.started.lock().unwrap();
                    started.push(SystemTime::now());
                    started.len()
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let fail = runs
                    .failing
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if fail {
                    return Err(std::io::Error::other("upstream returned 503"));
                }
                Ok(json!({ "run": n }))
            })
        }
    }

    fn fail_next(&self, n: usize) {
        self.failing.store(n, Ordering::SeqCst);
    }
}

/// One get_or_compute call of a computation taking `ms`: its value and how long it took.
async fn timed(
    client: &Client,
    key: &str,
    runs: &Runs,
    ms: u64,
    opts: &CallOptions,
) -> (Value, Duration) {
    let started = Instant::now();
    let value = client
        .get_or_compute::<Value, _, _, _>(key, runs.compute(ms), opts.clone())
        .await
        .expect("get_or_compute");
    (value, started.elapsed())
}

/// Wait (up to `patience`) until no client refreshes in the background.
async fn until_refreshed(clients: &[Client], patience: Duration) {
    let deadline = Instant::now() + patience;
    while clients.iter().any(|c| !c.refreshing().is_empty()) {
        assert!(
            Instant::now() < deadline,
            "a background refresh still runs after {patience:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn clients(setup: &Setup, tag: &str, n: usize) -> Vec<Client> {
    let mut clients = Vec::new();
    for i in 0..n {
        let client = setup
            .client(&fresh(&format!("rust-{tag}-{i}")), Options::default())
            .await;
        client.ready(Duration::from_secs(5)).await.unwrap();
        clients.push(client);
    }
    clients
}

fn stale_window(ttl_ms: u64) -> CallOptions {
    CallOptions {
        ttl: Some(Some(Duration::from_millis(ttl_ms))),
        stale: Some(Duration::from_secs(60)),
        retry_after: Some(Duration::ZERO),
        ..CallOptions::default()
    }
}

/// Past `ttl`, inside the stale window: 60 callers in 4 processes, in three waves while
/// the key is recomputed, all get the old value at once; one of them recomputes it, in
/// the background, exactly once; then everyone gets the new value.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_callers_get_the_old_value_at_once_while_one_process_refreshes() {
    const COMPUTE_MS: u64 = 2000;
    for setup in setups() {
        let clients = clients(&setup, "swr", 4).await;
        let key = fresh("swr");
        let runs = Runs::default();
        let opts = stale_window(1000);
        let (first, _) = timed(&clients[0], &key, &runs, 100, &opts).await;
        assert_eq!(first, json!({ "run": 1 }));
        tokio::time::sleep(Duration::from_millis(1200)).await; // past the ttl

        let window = Instant::now();
        for wave in 0..3 {
            let calls: Vec<_> = (0..20)
                .map(|i| {
                    let (client, key, runs, opts) = (
                        clients[i % 4].clone(),
                        key.clone(),
                        runs.clone(),
                        opts.clone(),
                    );
                    tokio::spawn(
                        async move { timed(&client, &key, &runs, COMPUTE_MS, &opts).await },
                    )
                })
                .collect();
            for call in calls {
                let (value, took) = call.await.unwrap();
                assert_eq!(value, json!({ "run": 1 }), "[{}] wave {wave}", setup.name);
                assert!(
                    took < Duration::from_millis(700),
                    "[{}] wave {wave}: a call in the stale window took {took:?}",
                    setup.name
                );
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert!(
            window.elapsed() < Duration::from_millis(COMPUTE_MS),
            "[{}] the waves outlasted the refresh: the test proves nothing",
            setup.name
        );
        assert_eq!(
            runs.count(),
            2,
            "[{}] one refresh for 60 callers",
            setup.name
        );
        let refreshers: usize = clients.iter().map(|c| c.refreshing().len()).sum();
        assert_eq!(refreshers, 1, "[{}] one process refreshes", setup.name);

        until_refreshed(&clients, Duration::from_secs(10)).await;
        for client in &clients {
            let (value, took) = timed(client, &key, &runs, COMPUTE_MS, &opts).await;
            assert_eq!(
                value,
                json!({ "run": 2 }),
                "[{}] the refresh's result",
                setup.name
            );
            assert!(took < Duration::from_millis(700), "[{}] a hit", setup.name);
        }
        assert_eq!(runs.count(), 2, "[{}] no more computations", setup.name);
        eprintln!(
            "[{}] 60 callers in the stale window, 1 background refresh",
            setup.name
        );
    }
}

/// A background refresh that fails keeps the old value served, and no caller sees its
/// error; the next caller, in another process, refreshes the key, and its result replaces
/// the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_refresh_keeps_the_old_value_and_the_next_caller_refreshes() {
    for setup in setups() {
        let clients = clients(&setup, "swr-fail", 2).await;
        let (a, b) = (&clients[0], &clients[1]);
        let key = fresh("swr-fail");
        let runs = Runs::default();
        let opts = stale_window(1000);
        timed(a, &key, &runs, 50, &opts).await;
        tokio::time::sleep(Duration::from_millis(1200)).await;

        runs.fail_next(1);
        let (value, took) = timed(a, &key, &runs, 500, &opts).await;
        assert_eq!(value, json!({ "run": 1 }), "[{}]", setup.name);
        assert!(
            took < Duration::from_millis(400),
            "[{}] {took:?}",
            setup.name
        );
        until_refreshed(&clients, Duration::from_secs(10)).await;
        assert_eq!(runs.count(), 2, "[{}] the failed refresh ran", setup.name);

        // Stale-if-error: the old value, at once, and this caller refreshes again.
        let (value, took) = timed(b, &key, &runs, 500, &opts).await;
        assert_eq!(value, json!({ "run": 1 }), "[{}]", setup.name);
        assert!(
            took < Duration::from_millis(400),
            "[{}] {took:?}",
            setup.name
        );
        assert_eq!(
            b.refreshing(),
            vec![key.clone()],
            "[{}] the next caller refreshes",
            setup.name
        );
        until_refreshed(&clients, Duration::from_secs(10)).await;
        assert_eq!(runs.count(), 3, "[{}]", setup.name);
        let (value, _) = timed(a, &key, &runs, 500, &opts).await;
        assert_eq!(
            value,
            json!({ "run": 3 }),
            "[{}] the new result",
            setup.name
        );
    }
}

/// With beta, a key is refreshed before it expires: one of the hits draws an early
/// refresh (the server's XFetch draw, with the measured 500 ms computation), returns the
/// cached value at once, and recomputes the key in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn beta_refreshes_early_before_the_expiry() {
    const COMPUTE_MS: u64 = 500;
    for setup in setups() {
        let admin = setup.admin().await;
        let clients = clients(&setup, "xfetch", 2).await;
        let key = fresh("xfetch");
        let runs = Runs::default();
        // With delta ~0.5 s and beta 4, a hit 1 s before the expiry draws a refresh with
        // probability exp(-1 / 2) ~ 0.6; at 20 calls a second, one is drawn before the
        // expiry all but surely (the chance of none is below exp(-18)).
        let opts = CallOptions {
            ttl: Some(Some(Duration::from_secs(4))),
            beta: Some(4.0),
            ..CallOptions::default()
        };
        timed(&clients[0], &key, &runs, COMPUTE_MS, &opts).await;
        let expiry: SystemTime = admin
            .query_one(
                "SELECT expires_at FROM once.entries WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        let mut calls = 0;
        while runs.count() < 2 && SystemTime::now() < expiry + Duration::from_secs(1) {
            let (value, took) = timed(&clients[calls % 2], &key, &runs, COMPUTE_MS, &opts).await;
            assert_eq!(value, json!({ "run": 1 }), "[{}]", setup.name);
            assert!(
                took < Duration::from_millis(COMPUTE_MS - 100),
                "[{}] a call took {took:?}",
                setup.name
            );
            calls += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let refreshed = runs.started.lock().unwrap().get(1).copied();
        let refreshed = refreshed.unwrap_or_else(|| panic!("[{}] no refresh at all", setup.name));
        let early = expiry.duration_since(refreshed).unwrap_or_else(|_| {
            panic!(
                "[{}] the refresh began {:?} after the expiry",
                setup.name,
                refreshed.duration_since(expiry).unwrap()
            )
        });
        until_refreshed(&clients, Duration::from_secs(10)).await;
        // (This hit may draw the next early refresh already: the value is the one stored.)
        let (value, _) = timed(&clients[0], &key, &runs, COMPUTE_MS, &opts).await;
        assert_eq!(
            value,
            json!({ "run": 2 }),
            "[{}] the refresh's result",
            setup.name
        );
        eprintln!(
            "[{}] early refresh {early:?} before the expiry, after {calls} hits",
            setup.name
        );
    }
}

/// A call without `stale` or `beta` is answered as before 0.2 (the contract of
/// docs/clients.md): on a key in its stale window that another process refreshes, it
/// waits for the refresh and gets its result, not the old value.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_without_the_options_waits_for_the_refresh() {
    const COMPUTE_MS: u64 = 1500;
    for setup in setups() {
        let clients = clients(&setup, "swr-plain", 2).await;
        let key = fresh("swr-plain");
        let runs = Runs::default();
        let opts = stale_window(500);
        timed(&clients[0], &key, &runs, 10, &opts).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        let (value, _) = timed(&clients[0], &key, &runs, COMPUTE_MS, &opts).await;
        assert_eq!(value, json!({ "run": 1 }), "[{}]", setup.name);
        assert_eq!(
            clients[0].refreshing(),
            vec![key.clone()],
            "[{}]",
            setup.name
        );
        let (value, took) = timed(&clients[1], &key, &runs, 10, &CallOptions::default()).await;
        assert_eq!(
            value,
            json!({ "run": 2 }),
            "[{}] the refresh's result",
            setup.name
        );
        assert!(
            took > Duration::from_millis(COMPUTE_MS / 2),
            "[{}] answered after {took:?}: it did not wait",
            setup.name
        );
        assert_eq!(runs.count(), 2, "[{}]", setup.name);
    }
}

/// The claim on the key, as another process sees it: `refresh` if it is free to
/// refresh, `stale` while someone holds it. A `refresh` is given back.
async fn probe(admin: &tokio_postgres::Client, key: &str) -> String {
    let claim = raw::claim_key_serving_stale(
        admin,
        key,
        Duration::from_secs(30),
        Duration::ZERO,
        Owner::LeaseOnly,
    )
    .await
    .unwrap();
    if claim.is("refresh") {
        assert!(raw::release_key(admin, key, claim.token.unwrap())
            .await
            .unwrap());
    }
    claim.outcome
}

/// A refresh still running when its client shuts down (after the drain) or is dropped is
/// stopped and its key given back: another process may refresh it at once, rather than
/// after the lease or never.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_and_drop_give_back_running_refreshes() {
    for setup in setups() {
        let admin = setup.admin().await;
        let opts = stale_window(500);
        let slow = 60_000;

        // shutdown: bounded by the drain, then the key is released.
        let key = fresh("swr-shutdown");
        let runs = Runs::default();
        let client = setup
            .client(&fresh("rust-shutdown"), Options::default())
            .await;
        timed(&client, &key, &runs, 10, &opts).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        timed(&client, &key, &runs, slow, &opts).await;
        assert_eq!(client.refreshing(), vec![key.clone()], "[{}]", setup.name);
        assert_eq!(probe(&admin, &key).await, "stale", "[{}]", setup.name);
        let started = Instant::now();
        client.shutdown(Duration::from_millis(300)).await;
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(2),
            "[{}] shutdown took {took:?}",
            setup.name
        );
        assert!(client.refreshing().is_empty(), "[{}]", setup.name);
        assert_eq!(
            probe(&admin, &key).await,
            "refresh",
            "[{}] released",
            setup.name
        );
        // Refreshes drawn after the shutdown are given back at once; the call still
        // gets the old value.
        let (value, _) = timed(&client, &key, &runs, slow, &opts).await;
        assert_eq!(value, json!({ "run": 1 }), "[{}]", setup.name);
        assert!(client.refreshing().is_empty(), "[{}]", setup.name);
        assert_eq!(probe(&admin, &key).await, "refresh", "[{}]", setup.name);

        // drop: the last clone gone, the refresh is stopped and its key released.
        let key = fresh("swr-drop");
        let client = setup.client(&fresh("rust-drop"), Options::default()).await;
        timed(&client, &key, &runs, 10, &opts).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        timed(&client, &key, &runs, slow, &opts).await;
        assert_eq!(probe(&admin, &key).await, "stale", "[{}]", setup.name);
        drop(client);
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let outcome = probe(&admin, &key).await;
            if outcome == "refresh" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "[{}] still {outcome} 2 s after the client was dropped",
                setup.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// refresh_key with a stale window: the next caller that takes stale answers gets the old
/// value at once and refreshes the key in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refresh_with_stale_serves_the_old_value_while_recomputing() {
    for setup in setups() {
        let client = setup
            .client(&fresh("rust-refresh"), Options::default())
            .await;
        let key = fresh("refreshed");
        let runs = Runs::default();
        assert_eq!(
            client.refresh(&key, None).await.unwrap(),
            "absent",
            "[{}]",
            setup.name
        );
        let opts = CallOptions {
            ttl: Some(Some(Duration::from_secs(3600))),
            stale: Some(Duration::from_secs(60)),
            ..CallOptions::default()
        };
        timed(&client, &key, &runs, 10, &opts).await;
        assert_eq!(
            client
                .refresh(&key, Some(Duration::from_secs(60)))
                .await
                .unwrap(),
            "expired",
            "[{}]",
            setup.name
        );
        let (value, took) = timed(&client, &key, &runs, 1000, &opts).await;
        assert_eq!(value, json!({ "run": 1 }), "[{}]", setup.name);
        assert!(
            took < Duration::from_millis(700),
            "[{}] {took:?}",
            setup.name
        );
        until_refreshed(std::slice::from_ref(&client), Duration::from_secs(10)).await;
        let (value, _) = timed(&client, &key, &runs, 1000, &opts).await;
        assert_eq!(value, json!({ "run": 2 }), "[{}]", setup.name);
    }
}

/// Options that cannot work without a ttl are refused before anything is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_without_ttl_is_refused_before_claiming() {
    for setup in setups() {
        let admin = setup.admin().await;
        let client = setup.client(&fresh("rust-nottl"), Options::default()).await;
        let key = fresh("no-ttl");
        let runs = Runs::default();
        let r = client
            .get_or_compute::<Value, _, _, _>(
                &key,
                runs.compute(10),
                CallOptions {
                    stale: Some(Duration::from_secs(10)),
                    ..CallOptions::default()
                },
            )
            .await;
        assert!(
            matches!(r, Err(pg_once_client::Error::InvalidOption(_))),
            "[{}] {r:?}",
            setup.name
        );
        assert_eq!(runs.count(), 0);
        let rows = admin
            .query("SELECT 1 FROM once.entries WHERE key = $1", &[&key])
            .await
            .unwrap();
        assert!(rows.is_empty(), "[{}] nothing claimed", setup.name);
    }
}

/// raw, on a connection through the setup's pool path: complete_keys_with stores each
/// key's stale window; claims with serve_stale get `refresh` (one) and `stale` (the rest),
/// claims without it `wait` and `claimed` (what a pre-0.2 client sees); once.cached runs
/// its query once and serves its rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_freshness_calls() {
    for setup in setups() {
        let c = setup.pooled().await;
        let (lease, now) = (Duration::from_secs(30), Duration::ZERO);
        let owner = Owner::LeaseOnly;
        let (k1, k2) = (fresh("raw-swr1"), fresh("raw-swr2"));
        let mut tokens = Vec::new();
        for k in [&k1, &k2] {
            let claim = raw::claim_key(&c, k, lease, now, owner).await.unwrap();
            assert!(claim.is("claimed"), "[{}] {claim:?}", setup.name);
            tokens.push(claim.token.unwrap());
        }
        let window = raw::Freshness {
            ttl: Some(Duration::from_millis(500)),
            stale: Some(Duration::from_secs(60)),
            ..raw::Freshness::default()
        };
        let stored =
            raw::complete_keys_with(&c, &[&k1, &k2], &tokens, &[json!(1), json!(2)], &window)
                .await
                .unwrap();
        assert_eq!(stored.len(), 2, "[{}]", setup.name);
        tokio::time::sleep(Duration::from_millis(700)).await;

        let refresh = raw::claim_key_serving_stale(&c, &k1, lease, now, owner)
            .await
            .unwrap();
        assert!(refresh.is("refresh"), "[{}] {refresh:?}", setup.name);
        assert_eq!(refresh.result, Some(json!(1)));
        let stale = raw::claim_key_serving_stale(&c, &k1, lease, Duration::from_secs(5), owner)
            .await
            .unwrap();
        assert!(stale.is("stale"), "[{}] {stale:?}", setup.name);
        assert_eq!(stale.result, Some(json!(1)));
        // Told that someone refreshes, never their token (C5; the server keeps a
        // claim's token to its holder).
        assert_eq!(stale.token, None, "[{}] the refresher's", setup.name);
        let old = raw::claim_key(&c, &k1, lease, now, owner).await.unwrap();
        assert!(old.is("wait"), "[{}] {old:?}", setup.name);
        let renewed = raw::Freshness::ttl(Some(Duration::from_secs(3600)));
        assert!(
            raw::complete_key_with(&c, &k1, refresh.token.unwrap(), &json!(10), &renewed)
                .await
                .unwrap()
        );
        let hit = raw::claim_key(&c, &k1, lease, now, owner).await.unwrap();
        assert_eq!((hit.outcome.as_str(), hit.result), ("hit", Some(json!(10))));

        let old = raw::claim_key(&c, &k2, lease, now, owner).await.unwrap();
        assert!(old.is("claimed"), "[{}] {old:?}", setup.name);
        assert_eq!(old.result, Some(json!(2)), "[{}]", setup.name);
        assert!(raw::release_key(&c, &k2, old.token.unwrap()).await.unwrap());

        let key = fresh("raw-cached");
        let sql = "SELECT clock_timestamp()::text AS at, 1 AS n";
        let options = raw::CachedSql {
            freshness: raw::Freshness::ttl(Some(Duration::from_secs(3600))),
            ..raw::CachedSql::default()
        };
        let first = raw::cached(&c, &key, sql, &options).await.unwrap();
        assert_eq!(first[0]["n"], json!(1), "[{}] {first}", setup.name);
        let again = raw::cached(&c, &key, sql, &options).await.unwrap();
        assert_eq!(again, first, "[{}] served from the cache", setup.name);
    }
}
