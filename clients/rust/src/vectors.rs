//! The conformance suite's offline vectors (clients/conformance/vectors, README there),
//! run with no server: each file proves a rule of docs/clients.md. The suite is read from
//! `PG_ONCE_CONFORMANCE_DIR`, or the repository's `clients/conformance`.

use serde_json::Value;
use std::path::PathBuf;

/// The cases of `vectors/<file>`, or None (with a message) when the suite has no such
/// file yet.
pub(crate) fn cases(file: &str) -> Option<Vec<Value>> {
    let dir = std::env::var_os("PG_ONCE_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../conformance")));
    let path = dir.join("vectors").join(file);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("{}: {e}: skipped", path.display());
            return None;
        }
    };
    let suite: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cases = suite["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no cases", path.display()));
    assert!(!cases.is_empty(), "{}: no cases", path.display());
    Some(cases.clone())
}

/// R1: which failed calls are retried.
#[test]
fn retry_vectors() {
    let Some(cases) = cases("retry.json") else {
        return;
    };
    for case in cases {
        let sqlstate = case["sqlstate"].as_str();
        let lost = case["connection_lost"].as_bool().expect("connection_lost");
        assert_eq!(
            crate::error::retryable(sqlstate, lost),
            case["retry"].as_bool().expect("retry"),
            "{}",
            case["name"]
        );
    }
}
