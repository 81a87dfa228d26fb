//! Symbols of released declarations whose signature has since changed (CONTRIBUTING.md,
//! "Upgrades"). Between a package upgrade and ALTER EXTENSION pg_once UPDATE the old
//! declarations still name them: each takes no argument (so nothing is unboxed from a
//! call it no longer understands) and refuses with the version check's 55000 and its hint.
//! Once the versions agree nothing declares them.

use super::body;
use crate::errors;
use pgrx::prelude::*;

/// Refuse a call through a retired symbol.
fn retired(symbol: &str) -> bool {
    body(|| {
        errors::object_not_in_prerequisite_state(
            format!("{symbol} is not in this version of pg_once"),
            "Run ALTER EXTENSION pg_once UPDATE in this database.",
        )
    })
}

/// 0.1.0's once.runtime(), whose counters were a bigint[] (now runtime_0_2).
#[pg_extern(sql = false)]
fn runtime() -> bool {
    retired("runtime_wrapper")
}

/// 0.1.0's once.create_queue(text, integer, interval, interval) (now create_queue_0_2).
#[pg_extern(sql = false)]
fn create_queue() -> bool {
    retired("create_queue_wrapper")
}

/// 0.1.0's once.claim_key(text, interval, interval, integer) (then claim_key_0_2, now claim_key_0_3).
#[pg_extern(sql = false)]
fn claim_key() -> bool {
    retired("claim_key_wrapper")
}

/// 0.2.0's once.claim_key(text, interval, interval, integer, boolean) (now claim_key_0_3).
#[pg_extern(sql = false)]
fn claim_key_0_2() -> bool {
    retired("claim_key_0_2_wrapper")
}

/// 0.1.0's once.complete_key(text, bigint, jsonb, interval) (now complete_key_0_2).
#[pg_extern(sql = false)]
fn complete_key() -> bool {
    retired("complete_key_wrapper")
}

/// 0.1.0's once.complete_keys(text[], bigint[], jsonb[], interval) (now complete_keys_0_2).
#[pg_extern(sql = false)]
fn complete_keys() -> bool {
    retired("complete_keys_wrapper")
}
