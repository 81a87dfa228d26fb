//! Attacks on isolation, performed as an attacker with ordinary grants would try them
//! (issue 23, docs/security.md). Each test plays the attacker's side to the end and
//! asserts that it got nothing: no other tenant's data, no change to what it may not
//! change. Every test makes its own roles, prefixes and tables.

use anyhow::Result;
use pg_once_multi::roles::{app_role, refusal};
use pg_once_multi::{admin, fresh_key};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// A fresh identifier: role names, prefixes and tables of one test.
fn fresh_id(name: &str) -> String {
    fresh_key(name).replace(['/', '-'], "_")
}

/// Claim `key` with wait => 0 as `client`: (outcome, token, result).
async fn claim(client: &Client, key: &str) -> Result<(String, Option<i64>, Option<Value>)> {
    let row = client
        .query_one(
            "SELECT outcome, token, result FROM once.claim_key($1, wait => '0')",
            &[&key],
        )
        .await?;
    Ok((row.get(0), row.get(1), row.get(2)))
}

/// Claim and complete `key` as `client` with `result`, kept for a day.
async fn complete(client: &Client, key: &str, result: Value) -> Result<()> {
    let (outcome, token, _) = claim(client, key).await?;
    assert_eq!(outcome, "claimed");
    let done: bool = client
        .query_one(
            "SELECT once.complete_key($1, $2, $3, ttl => '1 day')",
            &[&key, &token, &result],
        )
        .await?
        .get(0);
    assert!(done);
    Ok(())
}

// 1. once.cached served a protected table's rows to a role without SELECT on it: the
// privilege check planned the caller's query text, not the one that produced the result.
#[tokio::test(flavor = "multi_thread")]
async fn cached_rows_reach_only_roles_that_may_run_the_query_that_produced_them() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("cached");
    let app1 = app_role(&admin, &format!("app1_{id}")).await?;
    admin
        .batch_execute(&format!(
            "CREATE TABLE secret_{id} (v int); INSERT INTO secret_{id} VALUES (42);
             CREATE TABLE log_{id} (n int); GRANT INSERT ON log_{id} TO app1_{id};
             GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO app1_{id};"
        ))
        .await?;
    let key = format!("report_{id}");
    let secret_query = format!("SELECT v FROM secret_{id}");
    let cached: Value = admin
        .query_one("SELECT once.cached($1, $2)", &[&key, &secret_query])
        .await?
        .get(0);
    assert_eq!(cached, json!([{"v": 42}]));

    // Another query under the same key computes its own rows.
    let other: Value = app1
        .query_one("SELECT once.cached($1, 'SELECT 1 AS one')", &[&key])
        .await?
        .get(0);
    assert_eq!(other, json!([{"one": 1}]));
    // The same query text, by a role that may not run it: refused as the query would be.
    let (code, message) = refusal(
        app1.query_one("SELECT once.cached($1, $2)", &[&key, &secret_query])
            .await,
    );
    assert_eq!(code, "42501", "{message}");
    // The plain protocol does not reach once.cached's entries.
    let (outcome, _, result) = claim(&app1, &key).await?;
    assert_eq!(
        outcome, "claimed",
        "once.cached's result under the plain key"
    );
    assert_eq!(result, None);

    // A query of several statements is refused before anything runs, on a miss and on
    // every later call.
    let smuggled = format!("SELECT 1 AS one; INSERT INTO log_{id} VALUES (1)");
    for _ in 0..2 {
        let (code, message) = refusal(
            app1.query_one(
                "SELECT once.cached($1, $2)",
                &[&format!("s_{id}"), &smuggled],
            )
            .await,
        );
        assert_eq!(code, "42601", "{message}");
    }
    let logged: i64 = admin
        .query_one(&format!("SELECT count(*) FROM log_{id}"), &[])
        .await?
        .get(0);
    assert_eq!(logged, 0, "the smuggled statement never ran");

    // A failure (whose text may embed row values) is served only under the same check.
    let failing = format!("SELECT 1 / (v - 42) FROM secret_{id}");
    let fkey = format!("failing_{id}");
    let (_, first) = refusal(
        admin
            .query_one(
                "CALL once.cached($1, $2, NULL, retry_after => '1 hour')",
                &[&fkey, &failing],
            )
            .await,
    );
    assert!(first.contains("division by zero"), "{first}");
    let (code, message) = refusal(
        app1.query_one("SELECT once.cached($1, $2)", &[&fkey, &failing])
            .await,
    );
    assert_eq!(code, "42501", "{message}");
    Ok(())
}

/// A login role with a schema of its own to create functions and tables in, which every
/// role may look into (the attacker wants its code called). It creates the schema itself:
/// the SQL edition's administrator, a database owner with CREATEROLE, is no member of it.
async fn attacker(admin: &Client, role: &str) -> Result<Client> {
    let client = app_role(admin, role).await?;
    admin
        .batch_execute(&format!(
            "GRANT CREATE ON DATABASE \"{}\" TO {role}",
            admin
                .query_one("SELECT current_database()::text", &[])
                .await?
                .get::<_, String>(0)
        ))
        .await?;
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {role}; GRANT USAGE ON SCHEMA {role} TO PUBLIC;
             SET search_path = {role}, public"
        ))
        .await?;
    Ok(client)
}

/// An attacker (a granted role with a schema of its own) and a tenant whose namespace it
/// goes after, made by an administrator.
struct Victim {
    admin: Client,
    id: String,
    attacker_role: String,
    attacker: Client,
    tenant_role: String,
    tenant: Client,
    /// The tenant's namespace.
    prefix: String,
}

async fn victim(name: &str) -> Result<Victim> {
    let admin = admin().await?;
    let id = fresh_id(name);
    let (attacker_role, tenant_role) = (format!("app1_{id}"), format!("app2_{id}"));
    let attacker = attacker(&admin, &attacker_role).await?;
    let tenant = app_role(&admin, &tenant_role).await?;
    let prefix = format!("{id}/tenant2/");
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&prefix, &tenant_role],
        )
        .await?;
    Ok(Victim {
        admin,
        id,
        attacker_role,
        attacker,
        tenant_role,
        tenant,
        prefix,
    })
}

// 2. Code owned by one role, running in another role's session, got that session's rights.
#[tokio::test(flavor = "multi_thread")]
async fn code_owned_by_one_role_is_judged_as_that_role_in_every_session() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let Victim {
        admin,
        id,
        attacker_role: role1,
        attacker: app1,
        tenant_role: role2,
        tenant: app2,
        prefix,
    } = victim("definer").await?;
    let secret = format!("{prefix}secret");
    complete(&app2, &secret, json!({"ssn": "078-05-1120"})).await?;

    // app1's SECURITY DEFINER function reads tenant2's key into app1's table, and app1
    // grants it to app2, who calls it.
    app1.batch_execute(&format!(
        "CREATE TABLE loot (v jsonb);
         CREATE FUNCTION steal() RETURNS void SECURITY DEFINER LANGUAGE plpgsql
           SET search_path = {role1}, pg_catalog AS $$
           BEGIN
             INSERT INTO loot SELECT result FROM once.claim_key('{secret}', wait => '0');
           END $$;
         GRANT EXECUTE ON FUNCTION steal() TO {role2};
         GRANT USAGE ON SCHEMA {role1} TO {role2};"
    ))
    .await?;
    let (code, message) = refusal(app2.execute(&format!("SELECT {role1}.steal()"), &[]).await);
    assert_eq!(code, "42501", "{message}");
    let loot: i64 = app1
        .query_one("SELECT count(*) FROM loot WHERE v IS NOT NULL", &[])
        .await?
        .get(0);
    assert_eq!(loot, 0);

    // An index expression of app1's runs as app1 when a superuser's ANALYZE evaluates it;
    // through it app1 tries to define a namespace for itself.
    let stolen = format!("{id}/tenant3/");
    app1.batch_execute(&format!(
        "CREATE FUNCTION grab(x int) RETURNS int IMMUTABLE LANGUAGE plpgsql AS $$
           BEGIN
             PERFORM once.create_namespace('{stolen}', '{role1}');
             RETURN x;
           EXCEPTION WHEN OTHERS THEN RETURN x;
           END $$;
         CREATE TABLE bait (x int);
         INSERT INTO bait SELECT generate_series(1, 10);
         CREATE INDEX ON bait (grab(x));"
    ))
    .await?;
    let superuser = pg_once_multi::superuser().await?;
    superuser
        .batch_execute(&format!("ANALYZE {role1}.bait"))
        .await?;
    // SECURITY DEFINER code of app1's, called by a superuser.
    app1.batch_execute(&format!(
        "CREATE FUNCTION promote() RETURNS void SECURITY DEFINER LANGUAGE sql
           AS $$ SELECT once.create_namespace('{stolen}', '{role1}') $$;"
    ))
    .await?;
    for (who, client) in [("the administrator", &admin), ("a superuser", &superuser)] {
        let (code, message) = refusal(
            client
                .execute(&format!("SELECT {role1}.promote()"), &[])
                .await,
        );
        assert_eq!(code, "42501", "{who}: {message}");
    }
    let created: i64 = admin
        .query_one(
            "SELECT count(*) FROM once.namespaces WHERE prefix = $1",
            &[&stolen],
        )
        .await?
        .get(0);
    assert_eq!(
        created, 0,
        "no namespace defined through another role's session"
    );
    Ok(())
}

// 3. A cheap leaky function in the WHERE clause saw every tenant's dead letters and queues.
#[tokio::test(flavor = "multi_thread")]
async fn a_leaky_function_sees_nothing_the_views_hide() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let Victim {
        id,
        attacker: app1,
        tenant: app2,
        prefix,
        ..
    } = victim("leak").await?;
    let queue = format!("payments_{id}");
    app2.execute(
        "SELECT once.create_queue($1, max_attempts => 1, namespace => $2)",
        &[&queue, &prefix],
    )
    .await?;
    let key = format!("{prefix}charge");
    app2.execute(
        "SELECT once.enqueue_key($1, '{\"card\": \"4111111111111111\"}', $2)",
        &[&key, &queue],
    )
    .await?;
    let row = app2
        .query_one("SELECT key, token FROM once.claim_next($1)", &[&queue])
        .await?;
    let token: i64 = row.get(1);
    app2.execute("SELECT once.fail_key($1, $2, 'declined')", &[&key, &token])
        .await?;

    // Raises what it is shown of the tenant's: the error text carries it out. Only the
    // tenant's own values: other tests' keys, visible to app1, happen to hold "4111".
    app1.batch_execute(&format!(
        "CREATE FUNCTION leak(t text) RETURNS boolean STABLE COST 0.000001 LANGUAGE plpgsql AS $$
           BEGIN
             IF strpos(t, '4111111111111111') > 0 OR strpos(t, '{prefix}') > 0 OR t = '{queue}' THEN
               RAISE EXCEPTION 'leaked: %', t;
             END IF;
             RETURN true;
           END $$;"
    ))
    .await?;
    // The function sees only rows the view shows app1: had it been shown tenant2's, it
    // would have raised them.
    let attempts = [
        "SELECT count(*) FROM once.dead_letters WHERE leak(payload::text)",
        "SELECT count(*) FROM once.dead_letters WHERE leak(key)",
        "SELECT count(*) FROM once.keys WHERE leak(key)",
        "SELECT count(*) FROM once.keys WHERE leak(payload::text)",
        "SELECT count(*) FROM once.queue_stats WHERE leak(queue)",
    ];
    for sql in attempts {
        if let Err(e) = app1.query_one(sql, &[]).await {
            panic!("{sql}: {:?}", e.as_db_error().map(|d| d.message()));
        }
    }
    Ok(())
}

// 4. A namespace member took over a shared queue, and any role rewrote its retry policy.
#[tokio::test(flavor = "multi_thread")]
async fn shared_queues_are_changed_only_by_administrators() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("queues");
    let (role1, role2) = (format!("app1_{id}"), format!("app2_{id}"));
    let app1 = app_role(&admin, &role1).await?;
    let app2 = app_role(&admin, &role2).await?;
    let prefix = format!("{id}/tenant1/");
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&prefix, &role1],
        )
        .await?;
    let queue = format!("default_{id}");
    admin
        .execute("SELECT once.create_queue($1)", &[&queue])
        .await?;

    let (code, message) = refusal(
        app1.execute(
            "SELECT once.create_queue($1, namespace => $2)",
            &[&queue, &prefix],
        )
        .await,
    );
    assert_eq!(code, "42501", "{message}");
    let (code, message) = refusal(
        app2.execute("SELECT once.create_queue($1, max_attempts => 1)", &[&queue])
            .await,
    );
    assert_eq!(code, "42501", "{message}");
    let (code, message) = refusal(app2.execute("SELECT once.drop_queue($1)", &[&queue]).await);
    assert_eq!(code, "42501", "{message}");
    // Asking for the queue as it is changes nothing, and stays allowed (applications
    // declare their queues as they start).
    app2.execute("SELECT once.create_queue($1)", &[&queue])
        .await?;

    // Every role still uses the queue as before.
    let key = fresh_key("job");
    app2.execute("SELECT once.enqueue_key($1, NULL, $2)", &[&key, &queue])
        .await?;
    let taken = app2
        .query(
            "SELECT key FROM once.claim_next($1, wait => '0')",
            &[&queue],
        )
        .await?;
    assert_eq!(taken.len(), 1);
    let attempts: i32 = admin
        .query_one(
            "SELECT max_attempts FROM once.queues WHERE name = $1 AND namespace IS NULL",
            &[&queue],
        )
        .await?
        .get(0);
    assert_eq!(attempts, 5, "the policy the administrator set");
    Ok(())
}

// 5. A new namespace inherited what another role had planted under its prefix.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_namespace_inherits_nothing_planted_under_its_prefix() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("plant");
    let (role1, role3) = (format!("app1_{id}"), format!("app3_{id}"));
    let app1 = app_role(&admin, &role1).await?;
    let app3 = app_role(&admin, &role3).await?;
    let prefix = format!("{id}/tenant3/");
    let config = format!("{prefix}config");
    complete(&app1, &config, json!({"admin": "evil"})).await?;

    let (code, message) = refusal(
        admin
            .execute(
                "SELECT once.create_namespace($1, $2::text::regrole)",
                &[&prefix, &role3],
            )
            .await,
    );
    assert_eq!(code, "55006", "{message}");
    assert!(message.contains("1 key"), "{message}");
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole, existing => 'purge')",
            &[&prefix, &role3],
        )
        .await?;
    let (outcome, _, result) = claim(&app3, &config).await?;
    assert_eq!(outcome, "claimed");
    assert_eq!(result, None);
    Ok(())
}

// 8. A wait answer carried the running claim's token, and with it any role could fail the
// claim for a year.
#[tokio::test(flavor = "multi_thread")]
async fn another_roles_claim_cannot_be_ended_with_its_token() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("tokens");
    let app1 = app_role(&admin, &format!("app1_{id}")).await?;
    let key = fresh_key("shared");
    let (outcome, token, _) = claim(&admin, &key).await?;
    assert_eq!(outcome, "claimed");

    let (outcome, seen, _) = claim(&app1, &key).await?;
    assert_eq!(outcome, "wait");
    assert_eq!(seen, None, "a waiter is not told the owner's token");
    let last: Option<i64> = app1
        .query_one("SELECT last_token FROM once.stats", &[])
        .await?
        .get(0);
    assert_eq!(last, None, "nor the sequence's last value");

    // Tokens come from a sequence: an attacker guesses them. A guess is not enough.
    let calls = [
        "SELECT once.fail_key($1, $2, 'forged', retry_after => '1 year')",
        "SELECT once.complete_key($1, $2, '\"forged\"')",
        "SELECT once.release_key($1, $2)",
        "SELECT once.heartbeat_key($1, $2, lease => '1 day') IS NOT NULL",
    ];
    for sql in calls {
        let done: bool = app1.query_one(sql, &[&key, &token]).await?.get(0);
        assert!(!done, "{sql}");
    }
    let done: bool = admin
        .query_one(
            "SELECT once.complete_key($1, $2, '\"real\"')",
            &[&key, &token],
        )
        .await?
        .get(0);
    assert!(done, "the owner's claim was left as it was");
    Ok(())
}

// 11. A backend that read the namespaces before create_namespace committed neither
// enforced the new namespace nor hashed its announcements until its transaction ended.
#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_is_enforced_at_once_inside_open_transactions() -> Result<()> {
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("open");
    let (role1, role2) = (format!("app1_{id}"), format!("app2_{id}"));
    let app1 = app_role(&admin, &role1).await?;
    app_role(&admin, &role2).await?;
    let prefix = format!("{id}/tenant2/");
    let before = fresh_key("before");
    complete(&admin, &before, json!(1)).await?;
    for isolation in ["READ COMMITTED", "REPEATABLE READ"] {
        app1.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}"))
            .await?;
        // A read: the namespaces are in this backend's memory now. (A write would make
        // create_namespace wait for this transaction, which is how it stays race-free.)
        assert_eq!(claim(&app1, &before).await?.0, "hit");
        admin
            .execute(
                "SELECT once.create_namespace($1, $2::text::regrole, existing => 'purge')",
                &[&prefix, &role2],
            )
            .await?;
        let (code, message) = refusal(
            app1.query_one(
                "SELECT outcome FROM once.claim_key($1, wait => '0')",
                &[&format!("{prefix}x")],
            )
            .await,
        );
        // The SQL edition reads the namespaces with the transaction's snapshot, and fails
        // a REPEATABLE READ call under a changed one with 40001 (docs/sql-edition.md).
        let want = if pg_once_multi::edition() && isolation == "REPEATABLE READ" {
            "40001"
        } else {
            "42501"
        };
        assert_eq!(code, want, "{isolation}: {message}");
        app1.batch_execute("ROLLBACK").await?;
        admin
            .execute("SELECT once.drop_namespace($1)", &[&prefix])
            .await?;
    }
    Ok(())
}

// 13. A waiting claim_key held a lock on the namespace table for its whole wait, so DDL
// on it queued behind every waiter, and every call behind the DDL.
#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_call_holds_no_lock_on_the_namespace_table() -> Result<()> {
    if pg_once_multi::edition() {
        // Known: a waiting claim_key of the SQL edition keeps the relation locks of its
        // first look (once.entries, once_internal.namespace_owners) until its transaction
        // ends, so DDL on them (a rerun of the script that alters a table) waits for every
        // waiter. Not fixed yet: each look would run in a subtransaction rolled back
        // unless it answered, as claim_next's do (docs/sql-edition.md, Known limits).
        println!("skipped on the SQL edition: a waiting claim_key keeps its relation locks");
        return Ok(());
    }
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("lock");
    let app1 = app_role(&admin, &format!("app1_{id}")).await?;
    let owner = app_role(&admin, &format!("app2_{id}")).await?;
    admin
        .execute(
            "SELECT once.create_namespace($1, $2::text::regrole)",
            &[&format!("{id}/tenant2/"), &format!("app2_{id}")],
        )
        .await?;
    let key = fresh_key("held");
    claim(&owner, &key).await?;
    let waiter = tokio::spawn(async move {
        app1.query_one(
            "SELECT outcome FROM once.claim_key($1, wait => '3 s')",
            &[&key],
        )
        .await
        .map(|row| row.get::<_, String>(0))
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    admin
        .batch_execute(
            "BEGIN; SET LOCAL lock_timeout = '1 s';
             LOCK TABLE once_internal.namespace_owners IN ACCESS EXCLUSIVE MODE;
             ROLLBACK;",
        )
        .await?;
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(waiter.await??, "wait");
    Ok(())
}

// 14. reap_stale folded the backends' key counts (once_internal.key_counts) into slot -1
// in its caller's transaction, keeping the rows it folded and slot -1's locked until that
// transaction ended: an application role that called it and left its transaction open (or
// prepared it) held up the next commit of every backend whose counts it had folded, and
// the worker's next round, notifications included.
#[tokio::test(flavor = "multi_thread")]
async fn an_open_reap_stale_holds_up_no_other_writer_nor_the_worker() -> Result<()> {
    // Claims with wait => 0, which a namespace being created answers `wait`.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("fold");
    let mallory = app_role(&admin, &format!("mallory_{id}")).await?;
    let victim = app_role(&admin, &format!("victim_{id}")).await?;
    // Both commit a change to the shared keys' counts: rows of their backends' own; then
    // at once (before the worker's next round folds them) mallory reaps, and stays.
    complete(&victim, &fresh_key("victim"), json!(1)).await?;
    complete(&mallory, &fresh_key("mallory"), json!(1)).await?;
    mallory
        .batch_execute("BEGIN; SELECT * FROM once.reap_stale()")
        .await?;
    let mallory_pid: i32 = mallory
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let victims_write = pg_once_multi::answers_in_time(
        complete(&victim, &fresh_key("victim"), json!(2)),
        "an open transaction that called reap_stale",
    )
    .await;
    // The worker reaps every second (once.reaper_naptime): give it a round.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let held_up: Vec<String> = admin
        .query(
            "SELECT backend_type FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))",
            &[&mallory_pid],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    mallory.batch_execute("ROLLBACK").await?;
    victims_write?;
    assert!(held_up.is_empty(), "waiting for mallory: {held_up:?}");
    Ok(())
}

// 15. A prepared transaction keeps the key counts it wrote locked until an administrator
// ends it, after its backend exited; they were written into a slot of that backend's
// number, which the next backend to connect gets, and whose first commit that changed
// the same namespace's counts then waited for the prepared transaction.
#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_transaction_holds_up_no_later_backend() -> Result<()> {
    // Claims with wait => 0, which a namespace being created answers `wait`.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let prepared = pg_once_multi::max_prepared_transactions(&admin).await?;
    if prepared < 4 {
        println!("skipped: max_prepared_transactions < 4");
        return Ok(());
    }
    let id = fresh_id("prepared");
    let mallory = format!("mallory_{id}");
    app_role(&admin, &mallory).await?;
    let victim = format!("victim_{id}");
    app_role(&admin, &victim).await?;
    // Several backends, so that the victim's is one of theirs whatever else connects in
    // between (PostgreSQL hands out the last one freed). A prepared transaction may not
    // announce: each forgets a result, which changes the counts and announces nothing.
    let mut gids = Vec::new();
    let mut backends = Vec::new();
    for i in 0..3 {
        let client = pg_once_multi::roles::connect_as(&mallory).await?;
        let key = fresh_key("planted");
        complete(&client, &key, json!(i)).await?;
        let gid = format!("{id}_{i}");
        client
            .batch_execute(&format!(
                "BEGIN; SELECT once.invalidate_key('{key}'); PREPARE TRANSACTION '{gid}'"
            ))
            .await?;
        gids.push(gid);
        backends.push(client);
    }
    drop(backends);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let client = pg_once_multi::roles::connect_as(&victim).await?;
    let victims_write = pg_once_multi::answers_in_time(
        complete(&client, &fresh_key("victim"), json!(1)),
        "a prepared transaction of a backend that had its number",
    )
    .await;
    // (Another role's prepared transaction: only a superuser may end it.)
    let superuser = pg_once_multi::superuser().await?;
    for gid in &gids {
        superuser
            .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
            .await?;
    }
    victims_write
}

// 16. once.stats sums counts kept by namespace, and once.cached's keys are counted under
// their namespace like any other: another role's cached results (which only that role
// may use) were in the totals every role sees, and so were their failures, errors and
// attempts, and when they changed.
#[tokio::test(flavor = "multi_thread")]
async fn stats_count_no_cached_result_of_another_role() -> Result<()> {
    // Claims with wait => 0, which a namespace being created answers `wait`.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("cachedcounts");
    let victim = app_role(&admin, &format!("victim_{id}")).await?;
    let mallory = format!("mallory_{id}");
    app_role(&admin, &mallory).await?;
    victim
        .query_one(
            "SELECT once.cached($1, 'SELECT 1 AS one')",
            &[&format!("report_{id}")],
        )
        .await?;
    // In one snapshot: the shared done keys but cached ones (mallory has none), and what
    // once.stats shows mallory (SET ROLE to it: a superuser may).
    let admin = pg_once_multi::superuser().await?;
    admin
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await?;
    let shared: i64 = admin
        .query_one(
            "SELECT count(*) FROM once.entries
              WHERE state = 'done' AND once_internal.key_namespace(key) IS NULL
                AND position('#cached:' IN key) = 0",
            &[],
        )
        .await?
        .get(0);
    admin
        .batch_execute(&format!("SET LOCAL ROLE {mallory}"))
        .await?;
    let seen: i64 = admin
        .query_one("SELECT done FROM once.stats", &[])
        .await?
        .get(0);
    admin.batch_execute("ROLLBACK").await?;
    assert_eq!(seen, shared, "done keys once.stats shows mallory");
    Ok(())
}

// 17. The SQL edition read once.history_retention and the size limits as custom settings
// any role may SET: an application role's `SET once.history_retention = 0` and
// reap_stale deleted every tenant's attempt history, and `SET once.max_result_size =
// '1GB'` let it store a 17 MB result (issue 36). The extension refuses the SET (only a
// superuser may change them); the edition ignores it (once.settings is the
// administrators').
#[tokio::test(flavor = "multi_thread")]
async fn protective_settings_are_not_an_application_roles_to_change() -> Result<()> {
    // Claims with wait => 0, which a namespace being created answers `wait`.
    let _one = pg_once_multi::NAMESPACE_TESTS.lock().await;
    let admin = admin().await?;
    let id = fresh_id("settings");
    let mallory = app_role(&admin, &format!("mallory_{id}")).await?;
    let victim = app_role(&admin, &format!("victim_{id}")).await?;
    // One row of the victim's history: an attempt at a queued key that failed.
    let queue = format!("q_{id}");
    admin
        .execute("SELECT once.create_queue($1)", &[&queue])
        .await?;
    let key = fresh_key("history");
    victim
        .execute("SELECT once.enqueue_key($1, NULL, $2)", &[&key, &queue])
        .await?;
    let token: i64 = victim
        .query_one("SELECT token FROM once.claim_next($1)", &[&queue])
        .await?
        .get(0);
    victim
        .execute("SELECT once.fail_key($1, $2, 'declined')", &[&key, &token])
        .await?;
    let history = "SELECT count(*) FROM once.attempts WHERE key = $1";
    let before: i64 = admin.query_one(history, &[&key]).await?.get(0);
    assert_eq!(before, 1);

    // Refused (the extension) or ignored (the edition): either way nothing changes.
    let _ = mallory
        .batch_execute("SET once.history_retention = '0'")
        .await;
    mallory
        .batch_execute("SELECT * FROM once.reap_stale()")
        .await?;
    let after: i64 = admin.query_one(history, &[&key]).await?.get(0);
    assert_eq!(after, 1, "the victim's history after mallory's reap_stale");

    let _ = mallory
        .batch_execute("SET once.max_result_size = '1GB'")
        .await;
    let big = fresh_key("big");
    let (outcome, token, _) = claim(&mallory, &big).await?;
    assert_eq!(outcome, "claimed");
    let (code, message) = refusal(
        mallory
            .query_one(
                "SELECT once.complete_key($1, $2, to_jsonb(repeat('x', 17 * 1024 * 1024)))",
                &[&big, &token],
            )
            .await,
    );
    assert_eq!(code, "54000", "a 17 MB result: {message}");
    Ok(())
}
