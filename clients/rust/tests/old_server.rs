//! F7: a server whose pg_once is older than this client needs, imitated by a database with
//! a schema `once` of a few functions: without `once.owner_session()` (before 0.2.0) the
//! client warns once and claims as the pooled connection; `stale` or `beta` there, or
//! against a `claim_key` without `serve_stale`, is `Error::Configuration` before anything
//! is claimed. Its own file: it sets the process's tracing subscriber to read the warnings.

mod common;

use common::{connect, role_has, setups, with_param};
use pg_once_client::{CallOptions, Client, Error, Options};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Collects the message of every WARN event.
struct Warnings(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Warnings {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0 = format!("{v:?}");
                }
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

const DATABASE: &str = "pg_once_rust_old_server";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_server_is_warned_about_once_and_refuses_freshness_before_claiming() {
    let warnings = Arc::new(Mutex::new(Vec::new()));
    tracing::subscriber::set_global_default(Warnings(warnings.clone())).unwrap();
    let direct = setups()[0].direct_dsn.clone();
    let admin = connect(&direct).await;
    if !role_has(&admin, "rolsuper OR rolcreatedb").await {
        eprintln!("the role may not create databases (this test makes one): skipped");
        return;
    }
    for sql in [
        format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"),
        format!("CREATE DATABASE {DATABASE}"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    let old_dsn = with_param(&direct, "dbname", DATABASE);
    let old = connect(&old_dsn).await;
    // pg_once before 0.2.0 as far as the client can tell: claim_key without owner_pid or
    // serve_stale, and no owner_session(). Each call of it is counted by a sequence
    // (which a failing call does not roll back).
    old.batch_execute(
        "CREATE SCHEMA once; CREATE SEQUENCE once.claims; \
         CREATE FUNCTION once.claim_key(key text, lease interval DEFAULT '30s', \
                                        wait interval DEFAULT '0') RETURNS void \
           LANGUAGE plpgsql AS $$ BEGIN PERFORM nextval('once.claims'); \
           RAISE EXCEPTION 'claimed'; END $$;",
    )
    .await
    .unwrap();
    let claims = || async {
        let row = old
            .query_one("SELECT is_called FROM once.claims", &[])
            .await
            .unwrap();
        row.get::<_, bool>(0)
    };
    let fresh = CallOptions {
        ttl: Some(Some(Duration::from_secs(60))),
        stale: Some(Duration::from_secs(300)),
        ..CallOptions::default()
    };
    let never = || async { Ok::<_, std::io::Error>(1) };

    let client = Client::connect(&old_dsn, Options::default()).await.unwrap();
    client.ready(Duration::from_secs(10)).await.unwrap();
    let pid = client.owner_pid().expect("connected");
    let got = client.get_or_compute("f7", never, fresh.clone()).await;
    assert!(matches!(got, Err(Error::Configuration(_))), "{got:?}");
    assert!(!claims().await, "claim_key was called");
    // Once per client, not at every reconnection of its LISTEN connection.
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    for _ in 0..100 {
        if client.owner_pid().is_some_and(|p| p != pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        client.owner_pid().is_some_and(|p| p != pid),
        "not reconnected"
    );
    let legacy: Vec<String> = warnings
        .lock()
        .unwrap()
        .iter()
        .filter(|w| w.contains("no once.owner_session()"))
        .cloned()
        .collect();
    assert_eq!(legacy.len(), 1, "{legacy:?}");
    drop(client);

    // owner_session() but a claim_key without serve_stale (a hand-made or partial
    // install): the server's 42883 becomes the same configuration error.
    old.batch_execute(
        "CREATE FUNCTION once.owner_session() RETURNS int LANGUAGE sql \
           AS 'SELECT pg_backend_pid()'",
    )
    .await
    .unwrap();
    let client = Client::connect(&old_dsn, Options::default()).await.unwrap();
    client.ready(Duration::from_secs(10)).await.unwrap();
    let got = client.get_or_compute("f7", never, fresh).await;
    match got {
        Err(Error::Configuration(why)) => assert!(why.contains("0.2.0"), "{why}"),
        other => panic!("{other:?}"),
    }
    drop(client);
    drop(old);
    admin
        .batch_execute(&format!("DROP DATABASE {DATABASE} WITH (FORCE)"))
        .await
        .unwrap();
}
