//! Failover (docs/clients.md, N7, R2, L4): a client given both servers of a primary and its
//! hot standby (`PG_ONCE_FAILOVER_URL`, and `PG_ONCE_FAILOVER_DSN`, the key/value form) goes
//! on when the primary dies and the standby is promoted: a computation in flight is stored
//! on the new primary if its claim survived there (a lease-only claim, replicated before
//! the crash) and otherwise reported as `ClaimLost`, never stored twice; the LISTEN
//! connection and the pool move to the new primary. scripts/failover.sh
//! (`PG_ONCE_FAILOVER`) kills and promotes; scripts/test.sh step 6 starts the pair.

use pg_once_client::{CallOptions, Client, Conninfo, Error, Options};
use std::time::{Duration, Instant};

/// Seconds without a primary: as a failover manager's would, longer than the half second
/// of retries R2 allowed before 0.3.0. What is tested is the client across it, not how fast
/// the machine promotes.
const OUTAGE: Duration = Duration::from_secs(2);
/// What a loaded 2-core machine may take to replicate, kill, promote.
const BOUND: Duration = Duration::from_secs(60);

async fn failover(command: &str) {
    let script = std::env::var("PG_ONCE_FAILOVER").unwrap();
    let arg = command.to_owned();
    let status = tokio::time::timeout(
        BOUND,
        tokio::task::spawn_blocking(move || std::process::Command::new(script).arg(arg).status()),
    )
    .await
    .expect("failover.sh in time")
    .unwrap()
    .expect("failover.sh");
    assert!(status.success(), "failover.sh {command}: {status}");
}

/// One row of `sql` on the server of the pair that is `target` (`read-write`, `standby`).
async fn one(url: &str, target: &str, sql: &str, key: &str) -> Option<tokio_postgres::Row> {
    let dsn = url.replace(
        "target_session_attrs=read-write",
        &format!("target_session_attrs={target}"),
    );
    let conn = Conninfo::parse(&dsn)
        .unwrap()
        .connect()
        .await
        .expect(target);
    conn.query_opt(sql, &[&key]).await.expect(sql)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_follows_a_failover() {
    let (Ok(_), Ok(url), Ok(kv)) = (
        std::env::var("PG_ONCE_FAILOVER"),
        std::env::var("PG_ONCE_FAILOVER_URL"),
        std::env::var("PG_ONCE_FAILOVER_DSN"),
    ) else {
        eprintln!("PG_ONCE_FAILOVER and PG_ONCE_FAILOVER_URL / _DSN are not set (scripts/test.sh step 6): skipped");
        return;
    };
    failover("ready").await;
    // Claims owned by its LISTEN connection's backend; a URL.
    let owned = Client::connect(&url, Options::default()).await.unwrap();
    // Lease-only claims, which survive a promotion; the key/value form.
    let leased = Client::connect(
        &kv,
        Options {
            listen: false,
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let prefix = format!("rust-failover/{}", std::process::id());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let key = |k: &str| format!("{prefix}/{nanos}/{k}");
    let (k_owned, k_leased, k_after) = (key("owned"), key("leased"), key("after"));
    // Idle pooled connections to the server that will die.
    for client in [&owned, &leased] {
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(client.pool().get().await.unwrap());
        }
    }
    let (open, gate) = tokio::sync::watch::channel(false);
    let opts = || CallOptions {
        lease: Some(Duration::from_secs(60)),
        wait: Some(BOUND),
        ..CallOptions::default()
    };
    let call = |client: &Client, key: String, value: &'static str| {
        let (client, mut gate) = (client.clone(), gate.clone());
        tokio::spawn(async move {
            client
                .get_or_compute(
                    &key,
                    move || async move {
                        gate.wait_for(|open| *open).await.unwrap();
                        Ok::<_, std::io::Error>(value.to_owned())
                    },
                    opts(),
                )
                .await
        })
    };
    let owned_call = call(&owned, k_owned.clone(), "owned");
    let leased_call = call(&leased, k_leased.clone(), "leased");
    // Both claims replayed on the standby before the primary dies.
    let started = Instant::now();
    for k in [&k_owned, &k_leased] {
        while one(
            &url,
            "standby",
            "SELECT 1 FROM once.entries WHERE key = $1 AND state = 'running'",
            k,
        )
        .await
        .is_none()
        {
            assert!(
                started.elapsed() < BOUND,
                "{k} never replayed on the standby"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let old_pid = owned.owner_pid();
    failover("kill").await;
    open.send_replace(true); // the computations end while no server takes writes
    tokio::time::sleep(OUTAGE).await;
    failover("promote").await;
    let row = |k: String| {
        let url = url.clone();
        async move {
            one(
                &url,
                "read-write",
                "SELECT state::text, result #>> '{}' FROM once.entries WHERE key = $1",
                &k,
            )
            .await
            .map(|r| (r.get::<_, String>(0), r.get::<_, Option<String>>(1)))
        }
    };
    // L4: the lease-only claim survived on the new primary: its completion, retried across
    // the promotion (R2), is stored there, once.
    let leased_result = leased_call.await.unwrap();
    assert_eq!(leased_result.unwrap(), "leased");
    assert_eq!(
        row(k_leased).await,
        Some(("done".into(), Some("leased".into())))
    );
    // The owned claim named a backend of the old primary: stored if the completion came
    // before the new primary's reaper, else ClaimLost; never a connection error.
    let got = row(k_owned.clone()).await;
    match owned_call.await.unwrap() {
        Ok(value) => {
            assert_eq!(value, "owned");
            assert_eq!(got, Some(("done".into(), Some("owned".into()))));
        }
        Err(Error::ClaimLost { .. }) => {
            assert_ne!(got, Some(("done".into(), Some("owned".into()))))
        }
        Err(e) => panic!("the owned computation: {e}"),
    }
    // N4, N7: the pool's calls and the LISTEN connection are on the new primary.
    let after: String = owned
        .get_or_compute(
            &k_after,
            || async { Ok::<_, std::io::Error>("after".to_owned()) },
            CallOptions {
                wait: Some(BOUND),
                ..CallOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(after, "after");
    let new_pid = owned.owner_pid();
    assert!(
        new_pid.is_some() && new_pid != old_pid,
        "owner pid {old_pid:?} -> {new_pid:?}"
    );
    let listening = one(
        &url,
        "read-write",
        "SELECT 1 FROM pg_stat_activity WHERE pid = $1::text::int",
        &new_pid.unwrap().to_string(),
    )
    .await;
    assert!(
        listening.is_some(),
        "the LISTEN connection is not on the new primary"
    );
}
