//! Namespaces: a prefix of keys (and queues) that belongs to a role. Every test makes its
//! own roles and prefix, as an administrator would for two applications sharing one
//! database, and acts as each role on its own connection.

use anyhow::{Context, Result};
use pg_once_multi::roles::{app_role, refusal};
use pg_once_multi::{admin, fresh_key, once};
use serde_json::{json, Value};
use std::time::Duration;
use tokio_postgres::Client;

/// Two applications, each with its own role, and a namespace that belongs to the second.
struct Tenants {
    admin: Client,
    app1: Client,
    app2: Client,
    app2_role: String,
    /// The namespace of app2.
    prefix: String,
}

async fn tenants(notify: &str) -> Result<Tenants> {
    let admin = admin().await?;
    let id = fresh_key("t").replace(['/', '-'], "_");
    let (role1, role2) = (format!("app1_{id}"), format!("app2_{id}"));
    let app1 = app_role(&admin, &role1).await?;
    let app2 = app_role(&admin, &role2).await?;
    let prefix = format!("{id}/tenant2/");
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole, $3)",
            &[&prefix, &role2, &notify],
        )
        .await?;
    Ok(Tenants {
        admin,
        app1,
        app2,
        app2_role: role2,
        prefix,
    })
}

fn assert_refused<T: std::fmt::Debug>(result: Result<T, tokio_postgres::Error>, prefix: &str) {
    let (code, message) = refusal(result);
    assert_eq!(code, "42501", "{message}");
    assert!(
        message.contains(&format!("namespace \"{prefix}\"")),
        "the refusal names the namespace: {message}"
    );
}

/// Claim and complete `key` as `client`; returns the token.
async fn computed(client: &Client, key: &str, result: Value) -> Result<i64> {
    let claim = once::claim_key(client, key, Duration::from_secs(30), Duration::ZERO).await?;
    assert!(claim.is("claimed"), "{claim:?}");
    let token = claim.token.unwrap();
    assert!(once::complete_key(client, key, token, &result, None).await?);
    Ok(token)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_keeps_its_keys_from_other_roles() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let t = tenants("digest").await?;
    let secret = format!("{}secret", t.prefix);
    computed(&t.app2, &secret, json!({"ssn": "078-05-1120"})).await?;
    let running = format!("{}running", t.prefix);
    let claim = once::claim_key(&t.app2, &running, Duration::from_secs(30), Duration::ZERO).await?;
    let token = claim.token.unwrap();

    // Read, claim and every owner call with the owner's own token: refused, nothing changed.
    let key_calls = [
        "SELECT outcome FROM once.claim_key($1)",
        "SELECT once.get($1)::text",
        "SELECT once.invalidate_key($1)::text",
        "SELECT once.refresh_key($1)",
        "SELECT once.enqueue_key($1)",
    ];
    for sql in key_calls {
        assert_refused(t.app1.query_one(sql, &[&secret]).await, &t.prefix);
    }
    let token_calls = [
        "SELECT once.complete_key($1, $2, '\"forged\"')::text",
        "SELECT once.fail_key($1, $2, 'forged')::text",
        "SELECT once.heartbeat_key($1, $2)::text",
        "SELECT once.release_key($1, $2)::text",
    ];
    for sql in token_calls {
        assert_refused(t.app1.query_one(sql, &[&running, &token]).await, &t.prefix);
    }
    assert_refused(
        t.app1
            .query_one(
                "SELECT count(*) FROM once.complete_keys(ARRAY[$1], ARRAY[$2::bigint], ARRAY['1'::jsonb])",
                &[&running, &token],
            )
            .await,
        &t.prefix,
    );
    // invalidate_keys touches only keys the caller may use.
    let gone: i64 = t
        .app1
        .query_one("SELECT once.invalidate_keys(prefix => $1)", &[&t.prefix])
        .await?
        .get(0);
    assert_eq!(gone, 0);

    // The owner's role still has both keys as it left them.
    let hit = once::claim_key(&t.app2, &secret, Duration::from_secs(30), Duration::ZERO).await?;
    assert!(hit.is("hit"));
    assert_eq!(hit.result, Some(json!({"ssn": "078-05-1120"})));
    let got: Option<Value> = t
        .app2
        .query_one("SELECT once.get($1)", &[&secret])
        .await?
        .get(0);
    assert_eq!(got, Some(json!({"ssn": "078-05-1120"})));
    assert!(once::complete_key(&t.app2, &running, token, &json!(2), None).await?);

    // Keys outside every namespace stay shared, as before.
    let shared = fresh_key("shared");
    computed(&t.app1, &shared, json!("common")).await?;
    assert!(
        once::claim_key(&t.app2, &shared, Duration::from_secs(30), Duration::ZERO)
            .await?
            .is("hit")
    );
    // A superuser may use every namespace.
    assert!(
        once::claim_key(&t.admin, &secret, Duration::from_secs(30), Duration::ZERO)
            .await?
            .is("hit")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_queue_is_its_members_only() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let t = tenants("digest").await?;
    let queue = format!("q{}", fresh_key("").replace(['/', '-'], "_"));
    t.admin
        .execute(
            "SELECT once.create_queue($1, namespace => $2)",
            &[&queue, &t.prefix],
        )
        .await?;
    let job = format!("{}job", t.prefix);
    let outcome: String = t
        .app2
        .query_one(
            "SELECT once.enqueue_key($1, '{\"api_key\": \"sk-123\"}', $2)",
            &[&job, &queue],
        )
        .await?
        .get(0);
    assert_eq!(outcome, "queued");

    assert_refused(
        t.app1
            .query("SELECT * FROM once.claim_next($1)", &[&queue])
            .await,
        &t.prefix,
    );
    assert_refused(
        t.app1
            .query_one(
                "SELECT once.enqueue_key($1, NULL, $2)",
                &[&fresh_key("x"), &queue],
            )
            .await,
        &t.prefix,
    );
    assert_refused(
        t.app1
            .query_one("SELECT once.drop_queue($1)::text", &[&queue])
            .await,
        &t.prefix,
    );
    assert_refused(
        t.app1
            .query_one("SELECT once.create_queue($1, 9)::text", &[&queue])
            .await,
        &t.prefix,
    );
    // A namespace's key goes only into that namespace's queues: a shared queue's workers
    // could be anyone.
    let (code, message) = refusal(
        t.app2
            .query_one(
                "SELECT once.enqueue_key($1)",
                &[&format!("{}other", t.prefix)],
            )
            .await,
    );
    assert_eq!(code, "42501", "{message}");
    assert!(message.contains("belongs to namespace"), "{message}");

    // Its members take its jobs, payload included.
    let rows = t
        .app2
        .query("SELECT key, payload FROM once.claim_next($1)", &[&queue])
        .await?;
    assert_eq!(rows.len(), 1);
    let payload: Value = rows[0].get(1);
    assert_eq!(payload, json!({"api_key": "sk-123"}));
    Ok(())
}

/// Every backend keeps the namespace of each queue it used; a change to once.queues made by
/// another session must reach it, whichever way the queue moves.
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_moved_into_a_namespace_is_refused_at_once_by_every_session() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let t = tenants("digest").await?;
    let queue = format!("q{}", fresh_key("").replace(['/', '-'], "_"));
    t.admin
        .execute("SELECT once.create_queue($1)", &[&queue])
        .await?;
    // app1 uses the shared queue: its backend now keeps "shared" for it.
    let rows = t
        .app1
        .query("SELECT * FROM once.claim_next($1)", &[&queue])
        .await?;
    assert!(rows.is_empty());

    t.admin
        .execute(
            "SELECT once.create_queue($1, namespace => $2)",
            &[&queue, &t.prefix],
        )
        .await?;
    assert_refused(
        t.app1
            .query("SELECT * FROM once.claim_next($1)", &[&queue])
            .await,
        &t.prefix,
    );

    // And back out of it: shared again, for app1 too.
    t.admin
        .execute(
            "UPDATE once.queues SET namespace = NULL WHERE name = $1",
            &[&queue],
        )
        .await?;
    let rows = t
        .app1
        .query("SELECT * FROM once.claim_next($1)", &[&queue])
        .await?;
    assert!(rows.is_empty());
    t.admin
        .execute("SELECT once.drop_queue($1)", &[&queue])
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn views_show_a_role_only_what_it_may_use() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let t = tenants("digest").await?;
    let queue = format!("q{}", fresh_key("").replace(['/', '-'], "_"));
    t.admin
        .execute(
            "SELECT once.create_queue($1, max_attempts => 1, namespace => $2)",
            &[&queue, &t.prefix],
        )
        .await?;
    let doomed = format!("{}doomed", t.prefix);
    t.app2
        .execute("SELECT once.enqueue_key($1, NULL, $2)", &[&doomed, &queue])
        .await?;
    let row = t
        .app2
        .query_one("SELECT token FROM once.claim_next($1)", &[&queue])
        .await?;
    let token: i64 = row.get(0);
    t.app2
        .execute("SELECT once.fail_key($1, $2, 'boom')", &[&doomed, &token])
        .await?;
    for (client, expected) in [(&t.app1, 0i64), (&t.app2, 1)] {
        let dead: i64 = client
            .query_one(
                "SELECT count(*) FROM once.dead_letters WHERE starts_with(key, $1)",
                &[&t.prefix],
            )
            .await?
            .get(0);
        assert_eq!(dead, expected, "dead_letters");
        // once.keys: the dead letter, and no token for anyone.
        let keys: i64 = client
            .query_one(
                "SELECT count(*) FROM once.keys WHERE starts_with(key, $1) AND state = 'failed'",
                &[&t.prefix],
            )
            .await?
            .get(0);
        assert_eq!(keys, expected, "once.keys");
        let token_column: bool = client
            .query_one(
                "SELECT EXISTS (SELECT FROM information_schema.columns
                                 WHERE table_schema = 'once' AND table_name = 'keys'
                                   AND column_name IN ('token', 'fingerprint'))",
                &[],
            )
            .await?
            .get(0);
        assert!(!token_column, "once.keys shows no token or fingerprint");
        let queues: i64 = client
            .query_one(
                "SELECT count(*) FROM once.queue_stats WHERE queue = $1",
                &[&queue],
            )
            .await?
            .get(0);
        assert_eq!(queues, expected, "queue_stats");
        let member: bool = client
            .query_one(
                "SELECT member FROM once.namespaces WHERE prefix = $1",
                &[&t.prefix],
            )
            .await?
            .get(0);
        assert_eq!(member, expected == 1, "once.namespaces.member");
    }
    // once.stats counts the failed key for its namespace's members only.
    let (seen_by_1, seen_by_2) = (failed_keys(&t.app1).await?, failed_keys(&t.app2).await?);
    assert!(
        seen_by_2 > seen_by_1,
        "app2 sees its failed key, app1 does not ({seen_by_2} vs {seen_by_1})"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_listener_without_rights_sees_no_key_of_a_namespace() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let t = tenants("digest").await?;
    // A role with no grant at all can still LISTEN: any role that can connect can.
    let nobody = format!("nobody_{}", t.app2_role);
    t.admin
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock(20261201); CREATE ROLE {nobody} LOGIN; COMMIT;"
        ))
        .await?;
    let dsn = format!("{} user={nobody}", once::dsn_from_env()?);
    let (listener, mut rx) = once::connect_listening(&dsn).await?;
    listener.batch_execute("LISTEN once").await?;

    let secret = format!("{}user/alice@example.com/medical-record", t.prefix);
    computed(&t.app2, &secret, json!("x")).await?;
    let digest: String = t
        .admin
        .query_one("SELECT encode(once.key_hash($1), 'hex')", &[&secret])
        .await?
        .get(0);
    let payload = next_payload(&mut rx, |p| p == digest || p.contains("alice")).await?;
    assert_eq!(payload, digest, "the digest, never the key");

    // A namespace may choose to announce its keys verbatim; keys outside every namespace
    // are announced verbatim, as before.
    let verbatim = format!("{}/open/", t.prefix);
    t.admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole, 'key')",
            &[&verbatim, &t.app2_role],
        )
        .await?;
    let open_key = format!("{verbatim}page");
    computed(&t.app2, &open_key, json!(1)).await?;
    assert_eq!(next_payload(&mut rx, |p| p == open_key).await?, open_key);
    let shared = fresh_key("shared-announced");
    computed(&t.app1, &shared, json!(1)).await?;
    assert_eq!(next_payload(&mut rx, |p| p == shared).await?, shared);
    Ok(())
}

/// once.stats.failed as `client` sees it.
async fn failed_keys(client: &Client) -> Result<i64> {
    Ok(client
        .query_one("SELECT failed FROM once.stats", &[])
        .await?
        .get(0))
}

/// The next notification on channel `once` whose payload `wanted` accepts, within 5 s.
async fn next_payload(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
    wanted: impl Fn(&str) -> bool,
) -> Result<String> {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = rx.recv().await.context("listener closed")?;
            if n.channel() == "once" && wanted(n.payload()) {
                return Ok(n.payload().to_owned());
            }
        }
    })
    .await
    .context("no such notification within 5 s")?
}

#[tokio::test(flavor = "multi_thread")]
async fn only_administrators_define_namespaces_and_none_is_dropped_with_keys() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let t = tenants("digest").await?;
    for sql in [
        "SELECT once.create_namespace($1, current_user::regrole)::text",
        "SELECT once.drop_namespace($1)::text",
    ] {
        let (code, message) = refusal(t.app2.query_one(sql, &[&t.prefix]).await);
        assert_eq!(code, "42501", "{message}");
    }
    let key = format!("{}kept", t.prefix);
    computed(&t.app2, &key, json!(1)).await?;
    let (code, message) = refusal(
        t.admin
            .query_one("SELECT once.drop_namespace($1)::text", &[&t.prefix])
            .await,
    );
    assert_eq!(code, "55006", "{message}");
    // Once its keys are gone, it may be dropped, and its prefix is shared again.
    t.app2
        .execute("SELECT once.invalidate_keys(prefix => $1)", &[&t.prefix])
        .await?;
    t.admin
        .execute("SELECT once.drop_namespace($1)", &[&t.prefix])
        .await?;
    computed(&t.app1, &key, json!("mine now")).await?;
    Ok(())
}
