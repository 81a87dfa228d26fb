//! Single-session tests of the state machine and of every bad-input rule.
//! Each #[pg_test] runs in one transaction that is rolled back afterwards, so these cannot
//! see NOTIFY delivery, other sessions or crashes: pg_test/ covers those.
//!
//! One file per concern; this module holds the helpers they share. Each file's tests sit in
//! a `#[pgrx::pg_schema] mod tests`: pgrx creates a test's SQL function in the schema named
//! after its module, and pgrx-tests calls it as `tests.<name>()`.

mod bad_input;
mod claims;
mod compat;
mod fingerprints;
mod freshness;
mod get;
mod keys;
mod owners;
mod queue;
mod stats;

use pgrx::prelude::*;

/// Run one SQL statement and return its single value.
fn one<T: FromDatum + IntoDatum>(sql: &str) -> Option<T> {
    Spi::get_one::<T>(sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A claim_key answer's outcome and token, for an answer that carries one (claimed, the
/// only one without serve_stale): no other answer tells a token (see `answer`).
fn outcome_and_token(key: &str) -> (String, i64) {
    let (outcome, token) = Spi::get_two_with_args::<String, i64>(
        "SELECT outcome, token FROM once.claim_key($1)",
        &[key.into()],
    )
    .unwrap();
    (outcome.unwrap(), token.unwrap())
}

/// A claim_key answer's outcome and token, whatever it is.
fn answer(key: &str) -> (String, Option<i64>) {
    let (outcome, token) = Spi::get_two_with_args::<String, i64>(
        "SELECT outcome, token FROM once.claim_key($1)",
        &[key.into()],
    )
    .unwrap();
    (outcome.unwrap(), token)
}

/// The SQLSTATE and message of the error `sql` raises, or None if it succeeds.
/// A PL/pgSQL exception block rolls back just the failed statement, like a client would.
fn error_of(sql: &str) -> Option<String> {
    Spi::run(
        "CREATE OR REPLACE FUNCTION pg_temp.error_of(sql text) RETURNS text
         LANGUAGE plpgsql AS $$
         BEGIN EXECUTE sql; RETURN NULL;
         EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE || ': ' || SQLERRM; END $$",
    )
    .unwrap();
    Spi::get_one_with_args::<String>("SELECT pg_temp.error_of($1)", &[sql.into()]).unwrap()
}

/// The hint of the error `sql` raises; None if it succeeds (or its error has no hint).
fn hint_of(sql: &str) -> Option<String> {
    Spi::run(
        "CREATE OR REPLACE FUNCTION pg_temp.hint_of(sql text) RETURNS text
         LANGUAGE plpgsql AS $$
         DECLARE hint text;
         BEGIN EXECUTE sql; RETURN NULL;
         EXCEPTION WHEN OTHERS THEN
             GET STACKED DIAGNOSTICS hint = PG_EXCEPTION_HINT;
             RETURN nullif(hint, '');
         END $$",
    )
    .unwrap();
    Spi::get_one_with_args::<String>("SELECT pg_temp.hint_of($1)", &[sql.into()]).unwrap()
}

fn assert_error(sql: &str, sqlstate: &str, message_part: &str) {
    let error = error_of(sql).unwrap_or_else(|| panic!("{sql} succeeded; expected {sqlstate}"));
    assert!(
        error.starts_with(&format!("{sqlstate}: ")) && error.contains(message_part),
        "{sql}: expected {sqlstate} mentioning {message_part:?}, got {error:?}"
    );
}

/// Everything about every key, to prove a failed call changed nothing.
fn snapshot() -> String {
    one::<String>("SELECT coalesce(string_agg(e::text, ',' ORDER BY key), '') FROM once.entries e")
        .unwrap()
}

fn state_of(key: &str) -> Option<String> {
    Spi::get_one_with_args::<String>(
        "SELECT (SELECT state::text FROM once.entries WHERE key_hash = once.key_hash($1))",
        &[key.into()],
    )
    .unwrap()
}

/// Make the owner of `key` look like a backend that has exited.
fn kill_owner(key: &str) {
    Spi::run_with_args(
        "UPDATE once.entries SET owner_pid = 2147483647 WHERE key_hash = once.key_hash($1)",
        &[key.into()],
    )
    .unwrap();
}

fn text(sql: &str) -> String {
    one::<String>(sql).unwrap_or_else(|| panic!("{sql} returned NULL"))
}

/// claim_next on queue `q`: (key, token, attempt) of each claimed key.
fn claim_next(q: &str, n: i32) -> Vec<(String, i64, i32)> {
    Spi::connect(|client| {
        client
            .select(
                "SELECT key, token, attempt FROM once.claim_next($1, n => $2)",
                None,
                &[q.into(), n.into()],
            )
            .unwrap()
            .map(|row| {
                (
                    row.get::<String>(1).unwrap().unwrap(),
                    row.get::<i64>(2).unwrap().unwrap(),
                    row.get::<i32>(3).unwrap().unwrap(),
                )
            })
            .collect()
    })
}
