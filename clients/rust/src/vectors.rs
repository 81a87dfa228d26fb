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

/// A value in the vectors' notation (clients/conformance/README.md), as Rust would hold
/// it; None for a type Rust lacks (the case is skipped).
enum Vector {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Vector>),
    Set(Vec<Vector>),
    Object(Vec<(String, Vector)>),
    Map(Vec<(Vector, Vector)>),
}

impl Vector {
    fn read(v: &Value) -> Option<Vector> {
        Some(match v {
            Value::Null => Vector::Null,
            Value::Bool(b) => Vector::Bool(*b),
            Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Vector::Int(i.into()),
                (_, Some(u)) => Vector::Int(u.into()),
                _ => Vector::Float(n.as_f64()?),
            },
            Value::String(s) => Vector::Str(s.clone()),
            Value::Array(items) => {
                Vector::List(items.iter().map(Vector::read).collect::<Option<_>>()?)
            }
            Value::Object(m)
                if m.len() == 1 && m.keys().next().is_some_and(|k| k.starts_with('$')) =>
            {
                let (tag, inner) = m.iter().next().expect("one member");
                let list = || {
                    inner
                        .as_array()
                        .map(|a| a.iter().map(Vector::read).collect::<Option<Vec<_>>>())
                };
                match tag.as_str() {
                    "$int" => Vector::Int(inner.as_str()?.parse().ok()?),
                    "$float" => Vector::Float(match inner.as_str()? {
                        "NaN" => f64::NAN,
                        "Infinity" => f64::INFINITY,
                        "-Infinity" => f64::NEG_INFINITY,
                        other => other.parse().ok()?,
                    }),
                    "$bytes" => {
                        use base64::Engine as _;
                        Vector::Bytes(
                            base64::engine::general_purpose::STANDARD
                                .decode(inner.as_str()?)
                                .ok()?,
                        )
                    }
                    "$tuple" => Vector::List(list()??),
                    "$set" => Vector::Set(list()??),
                    "$map" => Vector::Map(
                        inner
                            .as_array()?
                            .iter()
                            .map(|pair| Some((Vector::read(&pair[0])?, Vector::read(&pair[1])?)))
                            .collect::<Option<_>>()?,
                    ),
                    _ => return None, // $datetime, $decimal, $unsupported: not in Rust
                }
            }
            Value::Object(m) => Vector::Object(
                m.iter()
                    .map(|(k, v)| Some((k.clone(), Vector::read(v)?)))
                    .collect::<Option<_>>()?,
            ),
        })
    }
}

impl serde::Serialize for Vector {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self {
            Vector::Null => s.serialize_unit(),
            Vector::Bool(b) => s.serialize_bool(*b),
            Vector::Int(i) => s.serialize_i128(*i),
            Vector::Float(f) => s.serialize_f64(*f),
            Vector::Str(v) => s.serialize_str(v),
            Vector::Bytes(b) => s.serialize_bytes(b),
            Vector::List(items) => items.serialize(s),
            Vector::Set(items) => s.serialize_newtype_struct(crate::key::SET_TOKEN, items),
            Vector::Object(members) => {
                let mut m = s.serialize_map(Some(members.len()))?;
                for (k, v) in members {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
            Vector::Map(members) => {
                let mut m = s.serialize_map(Some(members.len()))?;
                for (k, v) in members {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

/// K: default keys.
#[test]
fn key_vectors() {
    let Some(cases) = cases("keys.json") else {
        return;
    };
    let mut skipped = Vec::new();
    for case in &cases {
        let name = &case["name"];
        if case.get("kwargs").is_some() || case.get("python_params").is_some() {
            skipped.push(name);
            continue;
        }
        let Some(args) = Vector::read(&case["args"]) else {
            skipped.push(name);
            continue;
        };
        let function = case["function"].as_str().expect("function");
        let got = crate::key::derive(function, &args);
        match case.get("key") {
            Some(key) => assert_eq!(
                got.as_ref().ok(),
                key.as_str().map(str::to_owned).as_ref(),
                "{name}: {got:?}"
            ),
            None => assert!(
                matches!(got, Err(crate::Error::NotSerializable { .. })),
                "{name}: {got:?}"
            ),
        }
    }
    eprintln!(
        "keys.json: {} cases, skipped (types Rust lacks): {skipped:?}",
        cases.len()
    );
}
