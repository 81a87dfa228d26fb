//! The pure parts of rule I (docs/clients.md), one home each, with no I/O: which header
//! value is a key (I1), the entry's key and default scope (I2), the default fingerprint
//! (I3), the stored form of a response (I5), which stored entries are replayed (I6) and
//! the middleware's own answers (I7). The
//! conformance vectors (`clients/conformance/vectors/idempotency.json`) pin each of them,
//! byte for byte the same in the three clients.

use crate::key;
use base64::Engine as _;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// I1: the longest key a header may carry.
pub const MAX_KEY_CHARS: usize = 255;

/// Why a request's header cannot be a key (I1, I7's `key_invalid`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidKey(pub String);

/// I1: the key a header value carries: 1 to 255 visible ASCII characters (`0x21`-`0x7e`).
/// A value written as a structured-field string (`"..."`, RFC 8941, as the IETF draft
/// writes it) is unquoted first, its `\"` and `\\` escapes read.
pub fn key_from_header(value: &[u8]) -> Result<String, InvalidKey> {
    let unquoted;
    let key = match value {
        [b'"', inner @ .., b'"'] => {
            unquoted = unquote(inner)?;
            &unquoted[..]
        }
        plain => plain,
    };
    if key.is_empty() || key.len() > MAX_KEY_CHARS {
        return Err(InvalidKey(format!(
            "the key must be 1 to {MAX_KEY_CHARS} characters, this one has {}",
            key.len()
        )));
    }
    if let Some(bad) = key.iter().find(|b| !(0x21..=0x7e).contains(*b)) {
        return Err(InvalidKey(format!(
            "the key must be visible ASCII characters (no spaces), it has byte 0x{bad:02x}"
        )));
    }
    Ok(String::from_utf8(key.to_vec()).expect("checked to be ASCII"))
}

/// The content of a structured-field string between its quotes.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, InvalidKey> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(InvalidKey("a quoted key may escape only \" and \\".into())),
            },
            b'"' => return Err(InvalidKey("a quoted key has an unescaped \"".into())),
            b => out.push(b),
        }
    }
    Ok(out)
}

/// I2: the shortest secret taken: HMAC-SHA-256's output size, below which RFC 2104 says
/// the key weakens the MAC.
pub const MIN_SECRET_BYTES: usize = 32;

/// HMAC-SHA-256 of ENCODE(fields) (rule K2) under `secret`.
fn hmac_of(secret: &[u8], fields: &Value) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(key::encode(fields).expect("JSON values encode").as_bytes());
    mac
}

/// Lowercase hex HMAC-SHA-256 of ENCODE(fields) under `secret`.
fn mac(secret: &[u8], fields: &Value) -> String {
    crate::listener::hex(&hmac_of(secret, fields).finalize().into_bytes())
}

/// I2: the pg_once key of a request's entry. With a secret: `NAMESPACE +
/// "idempotency:#hmac-sha256:" + hex(HMAC-SHA-256(secret, ENCODE(["idempotency-key", scope,
/// key])))`, so that neither scope nor key is stored or announced, nor can be checked
/// against a guess without the secret. Without one (a scope that is a principal, not a
/// credential): `NAMESPACE + "idempotency:" + ENCODE([scope, key])`, ENCODE being rule
/// K2's, so that no two scopes or keys meet; a key past the server's limit is hashed as K3
/// says, as every derived key is.
pub fn entry_key(namespace: &str, scope: Option<&str>, key: &str, secret: Option<&[u8]>) -> String {
    match secret {
        Some(secret) => format!(
            "{namespace}idempotency:#hmac-sha256:{}",
            mac(secret, &json!(["idempotency-key", scope, key]))
        ),
        None => key::derive(&format!("{namespace}idempotency"), &(scope, key))
            .expect("strings and null always encode"),
    }
}

/// I2: the default scope, the `Authorization` header as received, one character per byte
/// (None without one), so that two callers' identical keys never meet. It only ever enters
/// the entry's key keyed by the secret, which the default scope requires.
pub fn default_scope(headers: &HeaderMap) -> Option<String> {
    headers
        .get(http::header::AUTHORIZATION)
        .map(|auth| latin1_text(auth.as_bytes()))
}

/// I3: a fingerprint (the default's or the application's) as a middleware with a secret
/// claims and stores it, `HMAC-SHA-256(secret, ENCODE(["idempotency-fingerprint",
/// hex(fingerprint)]))`, so that what is stored (`once.get`, `once.entries` and its dumps)
/// is no digest of the request a dictionary could be tried against: a token in the query,
/// a password in the body.
pub fn keyed_fingerprint(secret: &[u8], fingerprint: &[u8]) -> Vec<u8> {
    let fields = json!(["idempotency-fingerprint", crate::listener::hex(fingerprint)]);
    hmac_of(secret, &fields).finalize().into_bytes().to_vec()
}

/// I3: the default fingerprint, the SHA-256 of `METHOD "\n" PATH "\n" QUERY "\n" BODY`:
/// the method in upper case, the path as received (not decoded), the raw query without
/// `?` (empty when none). Stored as is only without a secret ([`keyed_fingerprint`]).
pub fn default_fingerprint(method: &str, path: &str, query: &str, body: &[u8]) -> Vec<u8> {
    let mut digest = Sha256::new();
    for part in [
        method.to_ascii_uppercase().as_bytes(),
        path.as_bytes(),
        query.as_bytes(),
    ] {
        digest.update(part);
        digest.update(b"\n");
    }
    digest.update(body);
    digest.finalize().to_vec()
}

/// I5: response headers that are never stored: hop-by-hop, and those the server writes
/// again (`content-length`, `date`).
const NOT_STORED: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "date",
];

/// What a request's stored response is written for and checked against (I5, I6): its
/// entry and fingerprint, and the middleware's secret and `store_cookies`.
#[derive(Clone, Debug)]
pub struct StoredFor {
    pub entry: String,
    pub fingerprint: Option<Vec<u8>>,
    pub secret: Option<Arc<[u8]>>,
    pub store_cookies: bool,
}

/// I5: the stored form of a response, `{"status": 201, "headers": [[name, value], ...],
/// "body": "<base64>", "fingerprint": "<hex>"}`, with `"mac"` when the middleware has a
/// secret: headers in order, names in lower case (as `http` keeps them), without the
/// headers never stored (hop-by-hop, `content-length`, `date`) and, unless
/// `store_cookies`, `set-cookie`; `body` None (stored as null) when it was longer than
/// the middleware keeps. A value is written one character per byte (latin-1), as the
/// Python and Node middlewares write it, so that bytes past ASCII are kept and replayed
/// as they were.
pub fn stored_response(
    status: StatusCode,
    headers: &HeaderMap,
    body: Option<&[u8]>,
    stored_for: &StoredFor,
) -> Value {
    let kept: Vec<Value> = headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            !NOT_STORED.contains(&name) && (stored_for.store_cookies || name != "set-cookie")
        })
        .map(|(name, value)| json!([name.as_str(), latin1_text(value.as_bytes())]))
        .collect();
    let mut form = json!({
        "status": status.as_u16(),
        "headers": kept,
        "body": body.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
        "fingerprint": stored_for.fingerprint.as_deref().map(crate::listener::hex),
    });
    if let Some(secret) = &stored_for.secret {
        form["mac"] = Value::String(response_mac(secret, &stored_for.entry, &form));
    }
    form
}

/// I5: `hex(HMAC-SHA-256(secret, ENCODE(["idempotency-response", entry, status, headers,
/// body, fingerprint])))` of a stored form.
pub fn response_mac(secret: &[u8], entry: &str, form: &Value) -> String {
    mac(secret, &response_fields(entry, form))
}

fn response_fields(entry: &str, form: &Value) -> Value {
    json!([
        "idempotency-response",
        entry,
        form["status"],
        form["headers"],
        form["body"],
        form["fingerprint"]
    ])
}

/// I6: a stored header's name is a token in lower case (I5 writes them so).
fn header_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        })
}

/// I6: a stored header's value is a field value (RFC 9110 5.5), one character per byte:
/// no CR, LF, NUL or other control character but tab, no whitespace at either end.
fn header_value_ok(value: &str) -> bool {
    let visible = |c: char| matches!(u32::from(c), 0x21..=0x7e | 0x80..=0xff);
    value.chars().all(|c| c == '\t' || c == ' ' || visible(c))
        && value.chars().next().is_none_or(visible)
        && value.chars().last().is_none_or(visible)
}

/// I6: why a stored entry is not one this middleware wrote for this request, or None.
/// Anyone with pg_once's rights in the key space can write an entry: only one in the
/// middleware's form, holding this request's fingerprint and, with a secret, its MAC, is
/// replayed, and none of its headers can frame the response (`content-length`,
/// hop-by-hop headers) or set a cookie the middleware would not have stored.
pub fn untrusted(stored_for: &StoredFor, stored: &Value) -> Option<String> {
    let Some(form) = stored.as_object() else {
        return Some("it is not an object".into());
    };
    let mut members = vec!["body", "fingerprint", "headers", "status"];
    if stored_for.secret.is_some() {
        members.push("mac");
        members.sort_unstable();
    }
    let mut found: Vec<&str> = form.keys().map(String::as_str).collect();
    found.sort_unstable();
    if found != members {
        return Some(format!("its members are not {members:?}"));
    }
    if !form["status"]
        .as_u64()
        .is_some_and(|s| (200..=599).contains(&s))
    {
        return Some(format!("its status {} is not 200 to 599", form["status"]));
    }
    let Some(headers) = form["headers"].as_array() else {
        return Some("its headers are not a list".into());
    };
    for pair in headers {
        let (Some(name), Some(value)) = (pair[0].as_str(), pair[1].as_str()) else {
            return Some(format!(
                "a header is not a [name, value] pair of strings: {pair}"
            ));
        };
        if pair.as_array().map(Vec::len) != Some(2) {
            return Some(format!(
                "a header is not a [name, value] pair of strings: {pair}"
            ));
        }
        if !header_name_ok(name) || !header_value_ok(value) {
            return Some(format!(
                "header {name:?} is not a lower-case token with a field value"
            ));
        }
        if NOT_STORED.contains(&name)
            || name == "idempotent-replayed"
            || (name == "set-cookie" && !stored_for.store_cookies)
        {
            return Some(format!(
                "it holds a {name} header, which the middleware never stores"
            ));
        }
    }
    match &form["body"] {
        Value::Null => {}
        Value::String(b64)
            if base64::engine::general_purpose::STANDARD
                .decode(b64)
                .is_ok() => {}
        _ => return Some("its body is not base64".into()),
    }
    let want = stored_for.fingerprint.as_deref().map(crate::listener::hex);
    match &form["fingerprint"] {
        Value::Null if want.is_none() => {}
        Value::String(held) if Some(held) == want.as_ref() => {}
        Value::Null | Value::String(_) => {
            return Some("it was not stored for this request's fingerprint".into())
        }
        _ => return Some("its fingerprint is not hex".into()),
    }
    let Some(secret) = &stored_for.secret else {
        return want.is_none().then(|| {
            "the request has no fingerprint and the middleware no secret to check".into()
        });
    };
    let held = form["mac"].as_str().and_then(hex_bytes).unwrap_or_default();
    // Compared in constant time (verify_slice), so that a forger learns nothing per byte.
    hmac_of(secret, &response_fields(&stored_for.entry, stored))
        .verify_slice(&held)
        .err()
        .map(|_| "its MAC is not the secret's".into())
}

/// Lowercase hex as bytes; None for anything else (`u8::from_str_radix` alone also reads
/// a sign: "+f" would be 0x0f).
fn hex_bytes(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// I6: the response a stored entry replays: its status, headers and body (empty when it
/// was stored without one), plus `Idempotent-Replayed: true`. None when `stored` is not
/// the form [`stored_response`] writes; check it with [`untrusted`] first.
pub fn replayed_response(stored: &Value) -> Option<Response<Bytes>> {
    let status = StatusCode::from_u16(u16::try_from(stored["status"].as_u64()?).ok()?).ok()?;
    let body = match &stored["body"] {
        Value::Null => Vec::new(),
        Value::String(b64) => base64::engine::general_purpose::STANDARD.decode(b64).ok()?,
        _ => return None,
    };
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for pair in stored["headers"].as_array()? {
        let name = HeaderName::from_bytes(pair[0].as_str()?.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(&latin1_bytes(pair[1].as_str()?)?).ok()?;
        headers.append(name, value);
    }
    headers.insert(
        HeaderName::from_static("idempotent-replayed"),
        HeaderValue::from_static("true"),
    );
    Some(response)
}

/// Header bytes as text, one character per byte (latin-1).
fn latin1_text(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

/// The bytes of text written one character per byte; None past U+00FF.
fn latin1_bytes(text: &str) -> Option<Vec<u8>> {
    text.chars()
        .map(|c| u8::try_from(u32::from(c)).ok())
        .collect()
}

/// I7: the `code` of each answer the middleware makes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// 400: a covered request without the header, with `required`.
    KeyMissing,
    /// 400: a header that is not a key (I1).
    KeyInvalid,
    /// 413: a request body over `max_request_body`.
    BodyTooLarge,
    /// 409: another request with the key is running, or its key failed.
    InFlight,
    /// 409: the entry holds a response the middleware did not write (I6).
    UntrustedEntry,
    /// 422: the key was used by a request with another fingerprint.
    FingerprintMismatch,
    /// 500: the handler panicked or its service failed.
    HandlerFailed,
    /// 503: pg_once could not be reached, or refused the call.
    Unavailable,
}

impl Problem {
    pub fn status(self) -> StatusCode {
        match self {
            Problem::KeyMissing | Problem::KeyInvalid => StatusCode::BAD_REQUEST,
            Problem::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::InFlight | Problem::UntrustedEntry => StatusCode::CONFLICT,
            Problem::FingerprintMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::HandlerFailed => StatusCode::INTERNAL_SERVER_ERROR,
            Problem::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// RFC 9110's reason phrase, the same in every middleware (`http`'s canonical reasons
    /// still say "Payload Too Large" and "Unprocessable Entity").
    pub fn title(self) -> &'static str {
        match self {
            Problem::KeyMissing | Problem::KeyInvalid => "Bad Request",
            Problem::BodyTooLarge => "Content Too Large",
            Problem::InFlight | Problem::UntrustedEntry => "Conflict",
            Problem::FingerprintMismatch => "Unprocessable Content",
            Problem::HandlerFailed => "Internal Server Error",
            Problem::Unavailable => "Service Unavailable",
        }
    }

    pub fn code(self) -> &'static str {
        match self {
            Problem::KeyMissing => "key_missing",
            Problem::KeyInvalid => "key_invalid",
            Problem::BodyTooLarge => "body_too_large",
            Problem::InFlight => "in_flight",
            Problem::UntrustedEntry => "untrusted_entry",
            Problem::FingerprintMismatch => "fingerprint_mismatch",
            Problem::HandlerFailed => "handler_failed",
            Problem::Unavailable => "unavailable",
        }
    }

    /// The `application/problem+json` response (RFC 9457) with `detail`, a sentence a
    /// person can act on, and `Retry-After` in seconds when a retry may succeed later.
    pub fn response(self, detail: &str, retry_after: Option<u64>) -> Response<Bytes> {
        let status = self.status();
        let body = json!({
            "type": "about:blank",
            "title": self.title(),
            "status": status.as_u16(),
            "detail": detail,
            "code": self.code(),
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = retry_after {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> StoredFor {
        StoredFor {
            entry: "idempotency:[null,\"k\"]".into(),
            fingerprint: Some(vec![1; 32]),
            secret: None,
            store_cookies: false,
        }
    }

    #[test]
    fn a_problem_names_its_status_and_code() {
        let response = Problem::InFlight.response("Retry later.", Some(1));
        assert_eq!(response.status(), 409);
        assert_eq!(response.headers()["retry-after"], "1");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let body: Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(
            body,
            json!({"type": "about:blank", "title": "Conflict", "status": 409,
                   "detail": "Retry later.", "code": "in_flight"})
        );
    }

    #[test]
    fn problem_titles_are_rfc_9110s() {
        // I7: the same titles from every middleware; http's canonical reasons are older.
        for (problem, title) in [
            (Problem::BodyTooLarge, "Content Too Large"),
            (Problem::FingerprintMismatch, "Unprocessable Content"),
        ] {
            let body: Value = serde_json::from_slice(problem.response("x", None).body()).unwrap();
            assert_eq!(body["title"], title);
        }
    }

    #[test]
    fn a_header_value_past_ascii_is_stored_and_replayed_byte_for_byte() {
        // I5: Python and Node keep such a value (one character per byte); dropping it
        // replays a response without, e.g., its content-disposition.
        let raw = b"attachment; filename=\"caf\xe9.txt\"";
        let mut headers = HeaderMap::new();
        headers.append("content-disposition", HeaderValue::from_bytes(raw).unwrap());
        let stored = stored_response(StatusCode::OK, &headers, Some(b""), &plain());
        assert_eq!(
            stored["headers"],
            json!([[
                "content-disposition",
                "attachment; filename=\"caf\u{e9}.txt\""
            ]])
        );
        let replay = replayed_response(&stored).unwrap();
        assert_eq!(replay.headers()["content-disposition"].as_bytes(), raw);
    }

    #[test]
    fn escapes_in_a_quoted_key_are_read() {
        assert_eq!(key_from_header(br#""a\"b""#).unwrap(), "a\"b");
        assert!(key_from_header(br#""a"b""#).is_err());
        assert!(key_from_header(br#""a\b""#).is_err());
    }

    #[test]
    fn a_replay_reads_what_was_stored() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("text/plain"));
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        let stored = stored_response(StatusCode::CREATED, &headers, Some(b"hi"), &plain());
        let replay = replayed_response(&stored).unwrap();
        assert_eq!(replay.status(), 201);
        assert_eq!(replay.body().as_ref(), b"hi");
        let xa: Vec<_> = replay.headers().get_all("x-a").iter().collect();
        assert_eq!(xa, ["1", "2"]);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let without_body = stored_response(StatusCode::CREATED, &headers, None, &plain());
        assert_eq!(without_body["body"], Value::Null);
        assert!(replayed_response(&without_body).unwrap().body().is_empty());
    }
}
