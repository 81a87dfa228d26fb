//! The rules of interval, integer and text arguments (src/api/argument_rules.json), in
//! both editions: each call refuses what its argument's rule refuses, with the rule's
//! SQLSTATE, message and hint, the extension's args.rs and the SQL edition's
//! usable_interval, usable_integer and text checks alike, all read from that one table.

use anyhow::{ensure, Context, Result};
use pg_once_multi::{admin, fresh_key};
use serde_json::Value;

const RULES: &str = include_str!("../../../src/api/argument_rules.json");

/// A call that takes the argument `name`, with `{}` where its value goes.
fn call_taking(name: &str, key: &str) -> String {
    match name {
        "lease" => format!("SELECT * FROM once.claim_key('{key}', lease => {{}})"),
        "wait" => format!("SELECT * FROM once.claim_key('{key}', wait => {{}})"),
        "ttl" => format!("SELECT once.complete_key('{key}', 1, '1', ttl => {{}})"),
        "stale" => format!("SELECT once.refresh_key('{key}', stale => {{}})"),
        "retry_after" => format!("SELECT once.fail_key('{key}', 1, 'e', retry_after => {{}})"),
        "token" => format!("SELECT once.release_key('{key}', {{}})"),
        "max_attempts" => {
            format!("SELECT once.enqueue_key('{key}', NULL, 'default', max_attempts => {{}})")
        }
        "n" => "SELECT * FROM once.claim_next('default', n => {})".to_owned(),
        other => panic!("no call taking {other}: add one here"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_interval_argument_is_refused_as_its_rule_says() -> Result<()> {
    let client = admin().await?;
    let rules: Value = serde_json::from_str(RULES)?;
    let rules = rules["intervals"].as_array().context("intervals")?;
    ensure!(rules.len() >= 5, "{} rules", rules.len());
    let mut wrong = Vec::new();
    for rule in rules {
        let name = rule["name"].as_str().context("name")?;
        let hint = rule["hint"].as_str().context("hint")?;
        let most = rule["most"].as_str().context("most")?;
        let nullable = rule["null"] == "allowed";
        let positive = rule["least"] == "positive";
        let call = call_taking(name, &fresh_key("argument-rules"));
        // (value, the SQLSTATE its rule raises or "" for none, the message's start)
        let mut cases: Vec<(String, &str, String)> = vec![
            (
                "'-1 second'".into(),
                "22023",
                if positive {
                    let or_null = if nullable { " or NULL" } else { "" };
                    format!("{name} must be positive{or_null}, got ")
                } else {
                    format!("{name} must not be negative, got ")
                },
            ),
            (
                "'0'".into(),
                if positive { "22023" } else { "" },
                format!("{name} must be positive"),
            ),
            (
                format!("'{most}'::interval + '1 second'"),
                "22023",
                format!("{name} must be at most {most}, got "),
            ),
        ];
        // Compared as 1 day and as 29 days 23:59:59, each spans a length that depends on
        // the date it is added to.
        for mixed in ["'-1 mon 31 days'", "'1 mon -1 second'"] {
            cases.push((
                mixed.into(),
                "22023",
                format!("{name} must not mix months with days or time of the other sign, got "),
            ));
        }
        if !nullable {
            cases.push(("NULL".into(), "22004", format!("{name} must not be NULL")));
        }
        for (value, code, message) in cases {
            let sql = call.replace("{}", &value);
            match client.simple_query(&sql).await {
                Err(e) => {
                    let db = e.as_db_error().context("a server error")?;
                    if code.is_empty() && db.message().starts_with(&message) {
                        wrong.push(format!(
                            "{sql}: refused ({}), which its rule allows",
                            db.message()
                        ));
                    } else if !code.is_empty()
                        && (db.code().code() != code
                            || !db.message().starts_with(&message)
                            || db.hint() != Some(hint))
                    {
                        wrong.push(format!(
                            "{sql}: {} {} (hint {:?}); the rule says {code} {message}...",
                            db.code().code(),
                            db.message(),
                            db.hint()
                        ));
                    }
                }
                Ok(_) if !code.is_empty() => wrong.push(format!("{sql}: accepted")),
                Ok(_) => {}
            }
        }
    }
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_integer_argument_is_refused_as_its_rule_says() -> Result<()> {
    let client = admin().await?;
    let rules: Value = serde_json::from_str(RULES)?;
    let rules = rules["integers"].as_array().context("integers")?;
    ensure!(rules.len() >= 3, "{} rules", rules.len());
    let mut wrong = Vec::new();
    for rule in rules {
        let name = rule["name"].as_str().context("name")?;
        let hint = rule["hint"].as_str().context("hint")?;
        let least = rule["least"].as_i64().context("least")?;
        let most = rule["most"].as_i64();
        let call = call_taking(name, &fresh_key("argument-rules"));
        let range = |v: i64| match most {
            Some(most) => format!("{name} must be between {least} and {most}, got {v}"),
            None => format!("{name} must be positive, got {v}"),
        };
        let mut cases = vec![(format!("{}", least - 1), "22023", range(least - 1))];
        if let Some(most) = most {
            cases.push((format!("{}", most + 1), "22023", range(most + 1)));
        }
        if rule["null"] != "allowed" {
            cases.push(("NULL".into(), "22004", format!("{name} must not be NULL")));
        }
        for (value, code, message) in cases {
            let sql = call.replace("{}", &value);
            match client.simple_query(&sql).await {
                Ok(_) => wrong.push(format!("{sql}: accepted")),
                Err(e) => {
                    let db = e.as_db_error().context("a server error")?;
                    if db.code().code() != code
                        || db.message() != message
                        || db.hint() != Some(hint)
                    {
                        wrong.push(format!(
                            "{sql}: {} {} (hint {:?}); the rule says {code} {message}",
                            db.code().code(),
                            db.message(),
                            db.hint()
                        ));
                    }
                }
            }
        }
    }
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
    Ok(())
}

/// The calls that take a text argument of rule `name`, each with `{}` where its value goes
/// and the name its errors give the argument.
fn calls_taking_text(name: &str, key: &str) -> Vec<(String, &'static str)> {
    match name {
        "key" => vec![
            (
                "SELECT * FROM once.claim_key({}, owner_pid => 0)".into(),
                "key",
            ),
            ("SELECT once.cached_key({}, 'SELECT 1')".into(), "key"),
            (
                format!("SELECT once.enqueue_keys(ARRAY['{key}', {{}}])"),
                "keys[2]",
            ),
        ],
        "prefix" => vec![("SELECT once.drop_namespace({})".into(), "prefix")],
        "queue" => vec![(
            format!("SELECT once.enqueue_key('{key}', NULL, {{}})"),
            "queue",
        )],
        "worker" => vec![(
            "SELECT * FROM once.claim_next('default', worker => {})".into(),
            "worker",
        )],
        other => panic!("no call taking {other}: add one here"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_text_argument_is_refused_as_its_rule_says() -> Result<()> {
    let client = admin().await?;
    let rules: Value = serde_json::from_str(RULES)?;
    let rules = rules["texts"].as_array().context("texts")?;
    ensure!(rules.len() >= 4, "{} rules", rules.len());
    let mut wrong = Vec::new();
    for rule in rules {
        let name = rule["name"].as_str().context("name")?;
        let hint = rule["hint"].as_str().context("hint")?;
        let hint_of = |which: &str| rule[which].as_str().unwrap_or(hint).to_owned();
        for (call, shown) in calls_taking_text(name, &fresh_key("argument-rules")) {
            // (value, SQLSTATE, message, hint)
            let mut cases = Vec::new();
            if rule["null"] == "refused" {
                cases.push((
                    "NULL".to_owned(),
                    "22004",
                    format!("{shown} must not be NULL"),
                    hint.to_owned(),
                ));
            }
            if rule["empty"] == "refused" {
                let message = format!("{shown} must not be empty");
                cases.push(("''".to_owned(), "22023", message, hint_of("empty_hint")));
            }
            if let Some(most) = rule["most_bytes"].as_u64() {
                cases.push((
                    format!("repeat('x', {})", most + 1),
                    "22001",
                    format!(
                        "{shown} is {} bytes long; the limit is {most} bytes",
                        most + 1
                    ),
                    hint_of("long_hint"),
                ));
            }
            ensure!(!cases.is_empty(), "rule {name} refuses nothing");
            for (value, code, message, hint) in cases {
                let sql = call.replace("{}", &value);
                match client.simple_query(&sql).await {
                    Ok(_) => wrong.push(format!("{name}: {sql}: accepted")),
                    Err(e) => {
                        let db = e.as_db_error().context("a server error")?;
                        if db.code().code() != code
                            || db.message() != message
                            || db.hint() != Some(hint.as_str())
                        {
                            wrong.push(format!(
                                "{name}: {sql}: {} {} (hint {:?}); the rule says {code} {message} (hint {hint:?})",
                                db.code().code(),
                                db.message(),
                                db.hint()
                            ));
                        }
                    }
                }
            }
        }
    }
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
    Ok(())
}

/// An error a PL/pgSQL block catches leaves the calls after it in the same statement as
/// they were. In the SQL edition they had been refused (42501, "only once.claim_key calls
/// its implementation"): after the aborted subtransaction PL/pgSQL ran the wrapper's call
/// through the executor, whose extra frame the check of the caller did not expect.
#[tokio::test(flavor = "multi_thread")]
async fn calls_after_a_caught_error_are_answered_as_before() -> Result<()> {
    let client = admin().await?;
    let key = fresh_key("after-a-caught-error");
    let answers: Vec<String> = client
        .simple_query(&format!(
            "CREATE FUNCTION pg_temp.attempt(q text) RETURNS text LANGUAGE plpgsql AS $$
               BEGIN EXECUTE q; RETURN 'ok'; EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE; END $$;
             SELECT pg_temp.attempt(format('SELECT once.claim_key(%L, lease => %s)', '{key}' || i, v))
               FROM (VALUES (1, 'NULL'), (2, '''-1 second'''), (3, '''10 seconds''')) t(i, v)
              ORDER BY i"
        ))
        .await?
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    ensure!(answers == ["22004", "22023", "ok"], "{answers:?}");
    Ok(())
}
