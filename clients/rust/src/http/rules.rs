//! The pure parts of rule I (docs/clients.md), one home each, with no I/O: which header
//! value is a key (I1), the entry's key and default scope (I2), the default fingerprint
//! (I3), the stored form of a response (I5) and the middleware's own answers (I7). The
//! conformance vectors (`clients/conformance/vectors/idempotency.json`) pin each of them,
//! byte for byte the same in the three clients.

use crate::key;
use base64::Engine as _;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

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

/// I2: the pg_once key of a request's entry: `NAMESPACE + "idempotency:" +
/// ENCODE([scope, key])`, ENCODE being rule K2's, so that no two scopes or keys meet; a
/// key past the server's limit is hashed as K3 says, as every derived key is.
pub fn entry_key(namespace: &str, scope: Option<&str>, key: &str) -> String {
    key::derive(&format!("{namespace}idempotency"), &(scope, key))
        .expect("strings and null always encode")
}

/// I2: the default scope, the lowercase hex SHA-256 of the `Authorization` header (None
/// without one), so that two callers' identical keys never meet.
pub fn default_scope(headers: &HeaderMap) -> Option<String> {
    headers
        .get(http::header::AUTHORIZATION)
        .map(|auth| crate::listener::hex(&Sha256::digest(auth.as_bytes())))
}

/// I3: the default fingerprint, the SHA-256 of `METHOD "\n" PATH "\n" QUERY "\n" BODY`:
/// the method in upper case, the path as received (not decoded), the raw query without
/// `?` (empty when none).
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

/// I5: the stored form of a response, `{"status": 201, "headers": [[name, value], ...],
/// "body": "<base64>"}`: headers in order, names in lower case (as `http` keeps them),
/// without the headers never stored (hop-by-hop, `content-length`, `date`) and, unless `store_cookies`, `set-cookie`; `body` None (stored
/// as null) when it was longer than the middleware keeps. A value is written one character
/// per byte (latin-1), as the Python and Node middlewares write it, so that bytes past
/// ASCII are kept and replayed as they were.
pub fn stored_response(
    status: StatusCode,
    headers: &HeaderMap,
    body: Option<&[u8]>,
    store_cookies: bool,
) -> Value {
    let kept: Vec<Value> = headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            !NOT_STORED.contains(&name) && (store_cookies || name != "set-cookie")
        })
        .map(|(name, value)| json!([name.as_str(), latin1_text(value.as_bytes())]))
        .collect();
    json!({
        "status": status.as_u16(),
        "headers": kept,
        "body": body.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
    })
}

/// I6: the response a stored entry replays: its status, headers and body (empty when it
/// was stored without one), plus `Idempotent-Replayed: true`. None when `stored` is not
/// the form [`stored_response`] writes.
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
            Problem::InFlight => StatusCode::CONFLICT,
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
            Problem::InFlight => "Conflict",
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
        let stored = stored_response(StatusCode::OK, &headers, Some(b""), false);
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
        let stored = stored_response(StatusCode::CREATED, &headers, Some(b"hi"), false);
        let replay = replayed_response(&stored).unwrap();
        assert_eq!(replay.status(), 201);
        assert_eq!(replay.body().as_ref(), b"hi");
        let xa: Vec<_> = replay.headers().get_all("x-a").iter().collect();
        assert_eq!(xa, ["1", "2"]);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let without_body = stored_response(StatusCode::CREATED, &headers, None, false);
        assert_eq!(without_body["body"], Value::Null);
        assert!(replayed_response(&without_body).unwrap().body().is_empty());
    }
}
