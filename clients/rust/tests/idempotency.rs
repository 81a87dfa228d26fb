//! The idempotency middleware (docs/clients.md, rule I; feature `http`): the conformance
//! vectors of its pure parts (`clients/conformance/vectors/idempotency.json`, no server),
//! then `IdempotencyLayer` around an axum router against a real server, each test once
//! per setup (direct, PgBouncer, TLS where set). Its behaviour between processes, with
//! axum serving on hyper, is the shared HTTP scenarios' (clients/conformance/http).

mod common;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use bytes::Bytes;
use common::{fresh, setups, Setup};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use pg_once_client::http::rules::{self, InvalidKey};
use pg_once_client::http::{IdempotencyClaim, IdempotencyLayer, IdempotencyLayerBuilder, InFlight};
use pg_once_client::{Client, Error, Options};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tower::ServiceExt;

/// What the layers under test are keyed with (rule I2).
const SECRET: &str = "pg-once rust middleware tests, 32+ bytes";

// ---- the conformance vectors (no server) ----------------------------------------------

fn vectors() -> Option<Value> {
    let dir = std::env::var_os("PG_ONCE_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../conformance")));
    let path = dir.join("vectors/idempotency.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(serde_json::from_str(&text).expect("idempotency.json")),
        Err(e) => {
            eprintln!("{}: {e}: skipped", path.display());
            None
        }
    }
}

/// A string or `{"$repeat": [s, n]}`.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        _ => {
            let [s, n] = v["$repeat"]
                .as_array()
                .map(|a| [&a[0], &a[1]])
                .expect("$repeat");
            s.as_str().unwrap().repeat(n.as_u64().unwrap() as usize)
        }
    }
}

fn bytes_of(v: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(v["$bytes"].as_str().expect("$bytes"))
        .unwrap()
}

/// I2: the entry's key, and the default scope from `Authorization`.
#[test]
fn vectors_entry_keys() {
    let Some(v) = vectors() else { return };
    for case in v["keys"].as_array().unwrap() {
        let name = &case["name"];
        let key = rules::entry_key(
            case["namespace"].as_str().unwrap(),
            case["scope"].as_str(),
            case["header"].as_str().unwrap(),
            case["secret"].as_str().map(str::as_bytes),
        );
        assert_eq!(key, case["key"].as_str().unwrap(), "{name}");
        if let Some(auth) = case["authorization"].as_str() {
            let mut headers = HeaderMap::new();
            headers.insert("authorization", HeaderValue::from_str(auth).unwrap());
            assert_eq!(
                rules::default_scope(&headers).as_deref(),
                case["scope"].as_str(),
                "{name}"
            );
        }
    }
    assert_eq!(rules::default_scope(&HeaderMap::new()), None);
}

/// I3: the default fingerprint.
#[test]
fn vectors_fingerprints() {
    let Some(v) = vectors() else { return };
    for case in v["fingerprints"].as_array().unwrap() {
        let got = rules::default_fingerprint(
            case["method"].as_str().unwrap(),
            case["path"].as_str().unwrap(),
            case["query"].as_str().unwrap(),
            &bytes_of(&case["body"]),
        );
        let hex: String = got.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            case["fingerprint"].as_str().unwrap(),
            "{}",
            case["name"]
        );
        let keyed = rules::keyed_fingerprint(v["secret"].as_str().unwrap().as_bytes(), &got);
        let hex: String = keyed.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, case["keyed"].as_str().unwrap(), "{}", case["name"]);
    }
}

/// I1: which header values are keys.
#[test]
fn vectors_header_values() {
    let Some(v) = vectors() else { return };
    for case in v["headers"].as_array().unwrap() {
        let got = rules::key_from_header(text(&case["value"]).as_bytes());
        match case.get("key") {
            Some(key) => assert_eq!(got, Ok(text(key)), "{}", case["name"]),
            None => {
                assert_eq!(case["error"], "key_invalid");
                assert!(
                    matches!(got, Err(InvalidKey(_))),
                    "{}: {got:?}",
                    case["name"]
                );
            }
        }
    }
}

/// I5: the stored form of a response.
#[test]
fn vectors_stored_responses() {
    let Some(v) = vectors() else { return };
    for case in v["stored"].as_array().unwrap() {
        let mut headers = HeaderMap::new();
        for pair in case["response_headers"].as_array().unwrap() {
            headers.append(
                http::HeaderName::from_bytes(pair[0].as_str().unwrap().as_bytes()).unwrap(),
                // The vectors write a header value one character per byte (latin-1).
                HeaderValue::from_bytes(&latin1(pair[1].as_str().unwrap())).unwrap(),
            );
        }
        let body = (!case["body"].is_null()).then(|| bytes_of(&case["body"]));
        let stored = rules::stored_response(
            StatusCode::from_u16(case["status"].as_u64().unwrap() as u16).unwrap(),
            &headers,
            body.as_deref(),
            &stored_for(case),
        );
        assert_eq!(stored, case["stored"], "{}", case["name"]);
    }
}

/// What a vector's response is stored for: its entry, fingerprint, secret, store_cookies.
fn stored_for(case: &Value) -> rules::StoredFor {
    let hex = case["fingerprint"].as_str().map(|h| {
        (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
            .collect()
    });
    rules::StoredFor {
        entry: case["entry"].as_str().unwrap().to_owned(),
        fingerprint: hex,
        secret: case["secret"].as_str().map(|s| s.as_bytes().into()),
        store_cookies: case["store_cookies"].as_bool().unwrap(),
    }
}

/// I6: which stored entries are replayed: only what the middleware wrote for this request.
#[test]
fn vectors_replays() {
    let Some(v) = vectors() else { return };
    for case in v["replays"].as_array().unwrap() {
        let why = rules::untrusted(&stored_for(case), &case["stored"]);
        let verdict = if why.is_none() {
            "replayed"
        } else {
            "untrusted"
        };
        assert_eq!(verdict, case["verdict"], "{}: {why:?}", case["name"]);
        if why.is_none() {
            assert!(
                rules::replayed_response(&case["stored"]).is_some(),
                "{}",
                case["name"]
            );
        }
    }
}

/// I9: options are refused when the layer is built, before any request.
#[tokio::test]
async fn bad_options_are_refused_when_built() {
    let client = Client::connect(
        "host=127.0.0.1 port=1 user=nobody",
        Options {
            listen: false,
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let refused: Vec<(&str, IdempotencyLayerBuilder)> = vec![
        (
            "ttl 0",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .ttl(Duration::ZERO),
        ),
        (
            "lease 0",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .lease(Duration::ZERO),
        ),
        (
            "wait over a day",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .wait(Duration::from_secs(86_401)),
        ),
        (
            "no methods",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .methods([]),
        ),
        (
            "max_body 0",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .max_body(0),
        ),
        (
            "max_request_body 0",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .max_request_body(0),
        ),
        (
            "header",
            IdempotencyLayer::builder(client.clone())
                .secret(SECRET)
                .header("bad header"),
        ),
    ];
    for (name, builder) in refused {
        assert!(
            matches!(builder.build(), Err(Error::InvalidOption(_))),
            "{name}"
        );
    }
    assert!(matches!(
        "nope".parse::<InFlight>(),
        Err(Error::InvalidOption(_))
    ));
    assert_eq!("wait".parse::<InFlight>().unwrap(), InFlight::Wait);
    // I2: the default scope is a credential: no layer without the secret, nor a short one.
    for (name, builder) in [
        ("no secret", IdempotencyLayer::builder(client.clone())),
        (
            "a short secret",
            IdempotencyLayer::builder(client.clone()).secret([7; 31]),
        ),
    ] {
        assert!(
            matches!(builder.build(), Err(Error::Configuration(_))),
            "{name}"
        );
    }
    let principal = IdempotencyLayer::builder(client.clone()).scope(|_| Some("user:7".into()));
    assert!(
        principal.build().is_ok(),
        "a scope of the application's needs no secret"
    );
    assert!(IdempotencyLayer::builder(client)
        .secret(SECRET)
        .build()
        .is_ok());
}

/// I4: pg_once unreachable: `503` with `Retry-After`, and the handler does not run.
#[tokio::test]
async fn an_unreachable_server_is_503_and_runs_nothing() {
    let client = Client::connect(
        "host=127.0.0.1 port=1 user=nobody",
        Options {
            listen: false,
            connect_timeout: Duration::from_secs(1),
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let app = App::new(
        client.clone(),
        IdempotencyLayer::builder(client).secret(SECRET),
    );
    let r = app.post(Some("k"), json!({})).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(r.problem_code(), "unavailable");
    assert_eq!(app.runs(), 0);
}

// ---- the layer against a server ----------------------------------------------------------

/// A test handler's state: how many times it ran, and a gate a test can hold it at.
struct Handler {
    client: Client,
    runs: AtomicUsize,
    started: Notify,
    /// Streamed responses wait here after their first chunk.
    gate: Notify,
}

type Shared = Arc<Handler>;

/// What the request asks the handler (JSON body, every member optional): sleep, answer
/// `status`, panic, stream `chunks` chunks of `size` bytes (waiting at the gate after the
/// first with `gated`), break the stream after the first chunk, or complete the claim in a
/// transaction of its own (I8) after `hold_ms`.
async fn handle(
    State(h): State<Shared>,
    claim: Option<Extension<IdempotencyClaim>>,
    body: Bytes,
) -> Response<Body> {
    h.runs.fetch_add(1, Ordering::SeqCst);
    h.started.notify_waiters();
    let ask: Value = serde_json::from_slice(&body).unwrap_or(json!({}));
    let n = |name: &str| ask[name].as_u64().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(n("sleep_ms"))).await;
    if ask["panic"] == true {
        panic!("asked to panic");
    }
    if ask["empty"] == true {
        return Response::builder().status(204).body(Body::empty()).unwrap();
    }
    let status = StatusCode::from_u16(ask["status"].as_u64().unwrap_or(201) as u16).unwrap();
    if n("chunks") > 0 {
        let (chunks, size, gated, broken) = (
            n("chunks"),
            n("size") as usize,
            ask["gated"] == true,
            ask["broken"] == true,
        );
        let stream = futures_util::stream::unfold(0, move |sent| {
            let h = h.clone();
            async move {
                if sent == chunks {
                    return None;
                }
                if sent == 1 && gated {
                    h.gate.notified().await;
                }
                if sent == 1 && broken {
                    return Some((Err(std::io::Error::other("the stream broke")), sent + 1));
                }
                Some((Ok(Bytes::from(vec![b'a' + sent as u8; size])), sent + 1))
            }
        });
        return Response::builder()
            .status(status)
            .header("content-type", "text/plain")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let body =
        json!({"run": h.runs.load(Ordering::SeqCst), "padding": "x".repeat(n("size") as usize)})
            .to_string();
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("set-cookie", HeaderValue::from_static("visited=1"));
    headers.insert("location", HeaderValue::from_static("/orders/1"));
    if let (Some(table), Some(Extension(claim))) = (ask["i8_table"].as_str(), &claim) {
        // I8: the order and the stored response in one transaction.
        let mut conn = h.client.pool().get().await.unwrap();
        let tx = conn.transaction().await.unwrap();
        tx.execute(
            &format!("INSERT INTO {table} (key) VALUES ($1)"),
            &[&claim.key()],
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(n("hold_ms"))).await;
        match claim
            .complete(&*tx, status, &headers, body.as_bytes())
            .await
        {
            Ok(()) if ask["roll_back"] == true => {
                drop(tx); // a reason of the handler's own: its completion rolls back too
                return Response::builder()
                    .status(200)
                    .body(Body::from("rolled back"))
                    .unwrap();
            }
            Ok(()) => tx.commit().await.unwrap(),
            Err(Error::ClaimLost { .. }) => {
                drop(tx); // rolls the order back
                return Response::builder()
                    .status(500)
                    .body(Body::from("lost"))
                    .unwrap();
            }
            Err(e) => panic!("complete: {e}"),
        }
    }
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// An axum router with the handler behind the layer at `/orders`, and a GET route.
#[derive(Clone)]
struct App {
    router: Router,
    handler: Shared,
}

/// A response read whole.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn problem_code(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let problem: Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(problem["status"], self.status.as_u16());
        assert_eq!(problem["type"], "about:blank");
        // RFC 9110's phrases (I7), which http's canonical reasons are not for 413 and 422.
        let title = match self.status.as_u16() {
            413 => "Content Too Large",
            422 => "Unprocessable Content",
            _ => self.status.canonical_reason().unwrap(),
        };
        assert_eq!(problem["title"], title);
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()));
        problem["code"].as_str().unwrap().to_owned()
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

impl App {
    fn new(client: Client, layer: IdempotencyLayerBuilder) -> App {
        let handler = Arc::new(Handler {
            client,
            runs: AtomicUsize::new(0),
            started: Notify::new(),
            gate: Notify::new(),
        });
        let layer = layer.build().expect("layer");
        let router = Router::new()
            .route("/orders", post(handle).get(handle).layer(layer))
            .route("/plain", get(|| async { "plain" }))
            .with_state(handler.clone());
        App { router, handler }
    }

    fn runs(&self) -> usize {
        self.handler.runs.load(Ordering::SeqCst)
    }

    fn request(&self, method: Method, key: Option<&str>, body: Value) -> Request<Body> {
        let mut request = Request::builder()
            .method(method)
            .uri("/orders?a=1")
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.body(Body::from(body.to_string())).unwrap()
    }

    async fn send(&self, request: Request<Body>) -> Answer {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let (head, body) = response.into_parts();
        Answer {
            status: head.status,
            headers: head.headers,
            body: body.collect().await.expect("body").to_bytes(),
        }
    }

    async fn post(&self, key: Option<&str>, body: Value) -> Answer {
        self.send(self.request(Method::POST, key, body)).await
    }
}

async fn ready_client(setup: &Setup, tag: &str) -> Client {
    let client = setup.client(tag, Options::default()).await;
    client.ready(Duration::from_secs(10)).await.unwrap();
    client
}

fn ttl(client: &Client) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(client.clone())
        .secret(SECRET)
        .ttl(Duration::from_secs(600))
}

/// I4 `claimed`, I5, I6: the first request runs and its response is stored; a retry is
/// replayed (same status, body and headers, marked, without `set-cookie`), not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_runs_once_and_its_retry_is_replayed() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-replay").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("replay");
        let first = app.post(Some(&key), json!({"sku": 1})).await;
        assert_eq!(first.status, 201, "[{}]", setup.name);
        assert!(!first.replayed());
        assert_eq!(first.headers["set-cookie"], "visited=1");
        let again = app.post(Some(&key), json!({"sku": 1})).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed(), "{:?}", again.headers);
        assert_eq!(again.body, first.body);
        assert_eq!(again.headers["location"], "/orders/1");
        assert_eq!(again.headers["content-type"], "application/json");
        assert!(again.headers.get("set-cookie").is_none());
        assert_eq!(app.runs(), 1, "[{}]", setup.name);
        // The entry is the one rule I2 names, with the response stored as rule I5 says.
        let entry = rules::entry_key("", None, &key, Some(SECRET.as_bytes()));
        let stored: Value = setup
            .admin()
            .await
            .query_one("SELECT result FROM once.entries WHERE key = $1", &[&entry])
            .await
            .unwrap()
            .get(0);
        assert_eq!(stored["status"], 201);
        assert_eq!(
            stored["body"],
            base64::engine::general_purpose::STANDARD.encode(&first.body)
        );
    }
}

/// I1, I7: a covered request without the header passes through (runs each time), or
/// with `required` is `400 key_missing`; an invalid key is `400 key_invalid`; a method
/// not covered passes through, header or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn which_requests_are_covered() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-covered").await;
        let app = App::new(client.clone(), ttl(&client));
        app.post(None, json!({})).await;
        app.post(None, json!({})).await;
        assert_eq!(app.runs(), 2, "[{}] no header: not covered", setup.name);
        let invalid = app.post(Some("a b"), json!({})).await;
        assert_eq!(invalid.status, 400);
        assert_eq!(invalid.problem_code(), "key_invalid");
        let key = fresh("get");
        for _ in 0..2 {
            let got = app
                .send(app.request(Method::GET, Some(&key), json!({})))
                .await;
            assert!(!got.replayed());
        }
        assert_eq!(app.runs(), 4, "GET passes through");

        let strict = App::new(client.clone(), ttl(&client).required(true));
        let missing = strict.post(None, json!({})).await;
        assert_eq!(missing.status, 400);
        assert_eq!(missing.problem_code(), "key_missing");
        assert_eq!(strict.runs(), 0);
    }
}

/// I4 `mismatch`: the key again with another body is `422`, and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_for_another_request_is_422() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-mismatch").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("mismatch");
        assert_eq!(app.post(Some(&key), json!({"sku": 1})).await.status, 201);
        let other = app.post(Some(&key), json!({"sku": 2})).await;
        assert_eq!(other.status, 422, "[{}]", setup.name);
        assert_eq!(other.problem_code(), "fingerprint_mismatch");
        assert_eq!(app.runs(), 1);
    }
}

/// I6: an entry another role with pg_once's rights planted (claim_key without a
/// fingerprint, then complete_key) is `409 untrusted_entry`: none of its headers is sent,
/// and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_planted_by_another_role_is_not_replayed() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-planted").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("planted");
        let entry = rules::entry_key("", None, &key, Some(SECRET.as_bytes()));
        let planted = json!({"status": 200, "headers": [["set-cookie", "session=attacker"],
            ["content-length", "2"]], "body": "b2tIVFRQLzEuMSAyOTkgWA0KDQo="});
        setup
            .admin()
            .await
            .execute(
                "SELECT once.complete_key($1, token, $2) FROM once.claim_key($1)",
                &[&entry, &planted],
            )
            .await
            .unwrap();
        let r = app.post(Some(&key), json!({})).await;
        assert_eq!(r.status, 409, "[{}]", setup.name);
        assert_eq!(r.problem_code(), "untrusted_entry");
        assert!(r.headers.get("set-cookie").is_none() && !r.replayed());
        assert_eq!(app.runs(), 0);
    }
}

/// I2: the default scope is the `Authorization` header: two callers' one key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_callers_keys_never_meet() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-scope").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("scope");
        for who in ["Bearer a", "Bearer b"] {
            let mut request = app.request(Method::POST, Some(&key), json!({}));
            request
                .headers_mut()
                .insert("authorization", HeaderValue::from_static(who));
            let got = app.send(request).await;
            assert_eq!(got.status, 201, "[{}] {who}", setup.name);
            assert!(!got.replayed(), "[{}] {who}", setup.name);
        }
        assert_eq!(app.runs(), 2);
    }
}

/// I4 `wait` with `in_flight = "conflict"`: `409` with `Retry-After: 1` while the first
/// runs; with `in_flight = "wait"`, the duplicate waits and is replayed the response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_409_or_waits() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-inflight").await;
        for in_flight in [InFlight::Conflict, InFlight::Wait] {
            let app = App::new(client.clone(), ttl(&client).in_flight(in_flight));
            let key = fresh("inflight");
            let body = json!({"sleep_ms": 700});
            let first = {
                let (app, key, body) = (app.clone(), key.clone(), body.clone());
                tokio::spawn(async move { app.post(Some(&key), body).await })
            };
            setup
                .until_running(&rules::entry_key("", None, &key, Some(SECRET.as_bytes())))
                .await;
            let duplicate = app.post(Some(&key), body.clone()).await;
            let first = first.await.unwrap();
            assert_eq!(first.status, 201);
            match in_flight {
                InFlight::Conflict => {
                    assert_eq!(duplicate.status, 409, "[{}]", setup.name);
                    assert_eq!(duplicate.headers["retry-after"], "1");
                    assert_eq!(duplicate.problem_code(), "in_flight");
                }
                InFlight::Wait => {
                    assert_eq!(duplicate.status, 201, "[{}]", setup.name);
                    assert!(duplicate.replayed());
                    assert_eq!(duplicate.body, first.body);
                }
            }
            assert_eq!(app.runs(), 1, "{in_flight:?}");
        }
    }
}

/// I5: a 5xx and a handler that panics release the claim: a retry runs again. A panic is
/// answered `500 handler_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_release_the_claim() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-release").await;
        let asks = [json!({"status": 503}), json!({"panic": true})];
        for ask in asks {
            let app = App::new(client.clone(), ttl(&client));
            let key = fresh("release");
            let request = || {
                app.router
                    .clone()
                    .oneshot(app.request(Method::POST, Some(&key), ask.clone()))
            };
            let response = request().await.unwrap();
            let status = response.status();
            let read = response.into_body().collect().await;
            if ask["panic"] == true {
                assert_eq!(status, 500);
                let answer = Answer {
                    status,
                    headers: problem_headers(),
                    body: read.unwrap().to_bytes(),
                };
                assert_eq!(answer.problem_code(), "handler_failed");
            } else {
                assert_eq!(status, 503);
            }
            let retry = request().await.unwrap();
            assert!(retry.headers().get("idempotent-replayed").is_none());
            let _ = retry.into_body().collect().await;
            assert_eq!(app.runs(), 2, "[{}] {ask}: a retry runs again", setup.name);
        }
    }
}

/// I5: a response stream that breaks once its head went out keeps the claim: the handler
/// ran (its side effects may have committed), so the response is stored without its body
/// and a retry is replayed its status and headers, not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_broken_after_its_head_is_stored_without_its_body() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-broken").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("broken");
        let ask = json!({"chunks": 3, "size": 10, "broken": true});
        let response = app
            .router
            .clone()
            .oneshot(app.request(Method::POST, Some(&key), ask.clone()))
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let read = response.into_body().collect().await;
        assert!(read.is_err(), "a broken stream reaches the caller broken");
        // Stored in the background once the stream broke.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let retry = app.post(Some(&key), ask).await;
        assert_eq!(retry.status, 201, "[{}]", setup.name);
        assert!(retry.replayed(), "[{}] {:?}", setup.name, retry.headers);
        assert!(retry.body.is_empty());
        assert_eq!(retry.headers["content-type"], "text/plain");
        assert_eq!(app.runs(), 1, "[{}] the retry ran again", setup.name);
    }
}

/// I4: a caller that hangs up while the handler runs (its request future is dropped, as
/// hyper does) neither stops the handler half-way nor strands the key: the response is
/// stored whole, and the retry is its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_hanging_up_mid_request_does_not_strand_its_key() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-hangup").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("hangup");
        let ask = json!({"sleep_ms": 600});
        let request =
            app.router
                .clone()
                .oneshot(app.request(Method::POST, Some(&key), ask.clone()));
        let hung_up = tokio::time::timeout(Duration::from_millis(150), request).await;
        assert!(hung_up.is_err(), "the caller hung up before the answer");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let retry = app.post(Some(&key), ask).await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (StatusCode::CREATED, true),
            "[{}] the retry of a request whose caller hung up",
            setup.name
        );
        assert_eq!(retry.body, json!({"run": 1, "padding": ""}).to_string());
        assert_eq!(app.runs(), 1, "[{}]", setup.name);
    }
}

fn problem_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "content-type",
        HeaderValue::from_static("application/problem+json"),
    );
    headers
}

/// I5: a streamed response reaches its caller while the handler still produces it (its
/// first chunk before the handler is let go on), and is replayed byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_is_streamed_and_stored() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-stream").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("stream");
        let ask = json!({"chunks": 4, "size": 65536, "gated": true});
        let response = app
            .router
            .clone()
            .oneshot(app.request(Method::POST, Some(&key), ask.clone()))
            .await
            .unwrap();
        let mut body = response.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(
            first.len(),
            65536,
            "the first chunk arrives while the handler waits"
        );
        app.handler.gate.notify_one();
        let rest = body.collect().await.unwrap().to_bytes();
        let whole = [first, rest].concat();
        assert_eq!(whole.len(), 4 * 65536);
        let replay = app.post(Some(&key), ask).await;
        assert!(replay.replayed(), "[{}]", setup.name);
        assert_eq!(replay.body.as_ref(), &whole[..]);
        assert_eq!(app.runs(), 1);
    }
}

/// I5: a body over `max_body` is sent in full, stored without its body: the replay has
/// the status and headers and an empty body, and the handler ran once. I3: a request
/// body over `max_request_body` is `413` and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limits() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-limits").await;
        let app = App::new(
            client.clone(),
            ttl(&client).max_body(1000).max_request_body(100),
        );
        let key = fresh("large");
        let first = app.post(Some(&key), json!({"size": 5000})).await;
        assert_eq!(first.status, 201);
        assert!(first.body.len() > 5000, "sent in full");
        let replay = app.post(Some(&key), json!({"size": 5000})).await;
        assert!(replay.replayed(), "[{}]", setup.name);
        assert_eq!(replay.status, 201);
        assert_eq!(replay.headers["location"], "/orders/1");
        assert!(replay.body.is_empty());
        assert_eq!(app.runs(), 1);

        let big = app
            .post(Some(&fresh("big")), json!({"padding": "y".repeat(200)}))
            .await;
        assert_eq!(big.status, 413);
        assert_eq!(big.problem_code(), "body_too_large");
        assert_eq!(app.runs(), 1);
    }
}

/// I8: a handler that completes in its transaction, then rolls it back for a reason of
/// its own and answers: nothing was stored, so its claim goes back and a retry runs at
/// once (it stayed held, without heartbeats, until its lease ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_rolled_back_by_a_handler_that_answers_is_released() {
    for setup in setups() {
        let admin = setup.admin().await;
        let table = format!("pg_once_idem_{}", fresh("orders").replace('-', "_"));
        admin
            .batch_execute(&format!("CREATE TABLE {table} (key text)"))
            .await
            .unwrap();
        let client = ready_client(&setup, "rust-idem-i8-rollback").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("i8-rollback");
        let ask = json!({"i8_table": table, "roll_back": true});
        let first = app.post(Some(&key), ask.clone()).await;
        assert_eq!(first.status, 200, "[{}]", setup.name);
        let retry = app.post(Some(&key), ask).await;
        assert_eq!(
            (retry.status, app.runs()),
            (StatusCode::OK, 2),
            "[{}] the retry of a rolled-back completion: {:?}",
            setup.name,
            retry.body
        );
    }
}

/// I8: a handler that completes the claim in its own transaction stores the response
/// with its writes (replayed later, not stored again); and when its claim was taken over
/// meanwhile (its owner session ended, another process claimed the key), `complete`
/// raises `ClaimLost`, its writes roll back, and the middleware answers `409`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completing_in_the_handlers_transaction() {
    for setup in setups() {
        let admin = setup.admin().await;
        let table = format!("pg_once_idem_{}", fresh("orders").replace('-', "_"));
        admin
            .batch_execute(&format!("CREATE TABLE {table} (key text)"))
            .await
            .unwrap();
        let count = |key: String| {
            let (admin, table) = (&admin, &table);
            async move {
                let n: i64 = admin
                    .query_one(
                        &format!("SELECT count(*) FROM {table} WHERE key = $1"),
                        &[&key],
                    )
                    .await
                    .unwrap()
                    .get(0);
                n
            }
        };

        let client = ready_client(&setup, "rust-idem-i8").await;
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("i8");
        let entry = rules::entry_key("", None, &key, Some(SECRET.as_bytes()));
        let ask = json!({"i8_table": table});
        let first = app.post(Some(&key), ask.clone()).await;
        assert_eq!(first.status, 201, "[{}]", setup.name);
        assert_eq!(
            first.headers["set-cookie"], "visited=1",
            "the handler's own response"
        );
        let replay = app.post(Some(&key), ask.clone()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        assert_eq!(count(entry.clone()).await, 1);

        // Taken over: the handler holds its transaction while its owner session is
        // terminated and another process (a client of its own) claims the key.
        let key = fresh("i8-lost");
        let entry = rules::entry_key("", None, &key, Some(SECRET.as_bytes()));
        let ask = json!({"i8_table": table, "hold_ms": 1500});
        let zombie = {
            let (app, key, ask) = (app.clone(), key.clone(), ask.clone());
            tokio::spawn(async move { app.post(Some(&key), ask).await })
        };
        setup.until_running(&entry).await;
        let owner = client.owner_pid().expect("a LISTEN connection");
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&owner])
            .await
            .unwrap();
        let other_client = ready_client(&setup, "rust-idem-i8-other").await;
        let other = App::new(other_client.clone(), ttl(&other_client));
        let mut retried = None;
        for _ in 0..50 {
            let got = other.post(Some(&key), ask.clone()).await;
            if got.status == 201 {
                retried = Some(got);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let retried = retried.expect("the retry took the key over");
        assert!(!retried.replayed());
        let zombie = zombie.await.unwrap();
        assert_eq!(
            zombie.status, 409,
            "[{}] the lost claim is a duplicate",
            setup.name
        );
        assert_eq!(zombie.problem_code(), "in_flight");
        assert_eq!(
            count(entry.clone()).await,
            1,
            "the zombie's order rolled back"
        );
        admin
            .batch_execute(&format!("DROP TABLE {table}"))
            .await
            .unwrap();
    }
}

/// H1: a handler that outlives its lease keeps its claim (heartbeats every `lease / 3`),
/// so a duplicate is still `409` rather than a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_handler_keeps_its_claim() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-heartbeat").await;
        let app = App::new(client.clone(), ttl(&client).lease(Duration::from_secs(1)));
        let key = fresh("heartbeat");
        let body = json!({"sleep_ms": 2500});
        let first = {
            let (app, key, body) = (app.clone(), key.clone(), body.clone());
            tokio::spawn(async move { app.post(Some(&key), body).await })
        };
        setup
            .until_running(&rules::entry_key("", None, &key, Some(SECRET.as_bytes())))
            .await;
        tokio::time::sleep(Duration::from_millis(1800)).await;
        let duplicate = app.post(Some(&key), body).await;
        assert_eq!(
            duplicate.status, 409,
            "[{}] the claim outlived its lease",
            setup.name
        );
        assert_eq!(first.await.unwrap().status, 201);
        assert_eq!(app.runs(), 1);
    }
}

/// I5: served by hyper, a response is stored before its caller has all of it: a retry
/// sent the moment the last byte arrives is replayed, never told the key still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_right_after_the_response_is_replayed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-served").await;
        let app = App::new(client.clone(), ttl(&client));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let serve = axum::serve(listener, app.router.clone());
        let server = tokio::spawn(async move { serve.await });
        // One request on a connection of its own; the response's status and whether it
        // was replayed, read as soon as `content-length` bytes of body have arrived.
        let send = |key: String, body: &'static str| async move {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            let request = format!(
                "POST /orders HTTP/1.1\r\nhost: test\r\nidempotency-key: {key}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut seen = Vec::new();
            loop {
                let mut chunk = [0u8; 65536];
                let n = stream.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the connection closed early");
                seen.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&seen).to_lowercase();
                let Some(end) = text.find("\r\n\r\n") else {
                    continue;
                };
                let length: usize = text
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0);
                if seen.len() >= end + 4 + length {
                    return (
                        text[9..12].to_owned(),
                        text.contains("idempotent-replayed: true"),
                    );
                }
            }
        };
        let asks = [(r#"{"size": 20000}"#, "201"), (r#"{"empty": true}"#, "204")];
        for _ in 0..10 {
            for (body, status) in asks {
                let key = fresh("served");
                assert_eq!(send(key.clone(), body).await, (status.to_owned(), false));
                let retry = send(key, body).await;
                assert_eq!(retry, (status.to_owned(), true), "[{}] {body}", setup.name);
            }
        }
        server.abort();
    }
}

/// I5: a response that fits `max_body` but not the server's `once.max_result_size` is
/// kept without its body, as one over `max_body` is: the request still runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_too_large_for_the_server_is_kept_without_its_body() {
    for setup in setups() {
        if setup.name == "pgbouncer" {
            continue; // PgBouncer refuses the startup option that lowers the limit
        }
        if common::is_sql_edition(&common::connect(&setup.direct_dsn).await).await {
            // Its limit is a row of once.settings for the whole database, not a session's
            // setting: the extension's servers test this.
            eprintln!("skipped on the SQL edition: once.max_result_size cannot be lowered for one session");
            continue;
        }
        let client = Client::connect(
            &format!("{} options='-c once.max_result_size=10kB'", setup.pool_dsn),
            Options {
                listen_conninfo: Some(setup.direct_dsn.clone()),
                ..Options::default()
            },
        )
        .await
        .unwrap();
        let app = App::new(client.clone(), ttl(&client));
        let key = fresh("server-limit");
        let first = app.post(Some(&key), json!({"size": 50_000})).await;
        assert_eq!(first.status, 201);
        assert!(first.body.len() > 50_000);
        let replay = app.post(Some(&key), json!({"size": 50_000})).await;
        assert!(
            replay.replayed(),
            "[{}] stored without its body",
            setup.name
        );
        assert!(replay.body.is_empty());
        assert_eq!(app.runs(), 1);
    }
}

/// I2, I3: `namespace` prefixes the entry (a namespace that announces digests still wakes
/// a waiting duplicate), `scope` replaces the default, and a `fingerprint` of None lets
/// any request reuse a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_scope_and_fingerprint_options() {
    for setup in setups() {
        let admin = setup.admin().await;
        let namespace = format!("{}/", fresh("tenant"));
        // The connected role's, as in the Python and Node suites: not 'postgres', which
        // a database owner who is not a superuser (the SQL edition's tests) is no member of.
        admin
            .execute(
                "SELECT once.create_namespace($1, current_user::regrole)",
                &[&namespace],
            )
            .await
            .unwrap();
        // Rechecks too rare to answer in time: only the key's notification can.
        let options = Options {
            recheck: Duration::from_secs(10),
            ..Options::default()
        };
        let client = setup.client("rust-idem-options", options).await;
        client.ready(Duration::from_secs(10)).await.unwrap();
        let layer = ttl(&client)
            .namespace(namespace.clone())
            .scope(|parts| {
                let tenant = parts.headers.get("x-tenant")?;
                Some(tenant.to_str().ok()?.to_owned())
            })
            .fingerprint(|_, _, _, _| None)
            .in_flight(InFlight::Wait);
        let app = App::new(client.clone(), layer);
        let key = fresh("options");
        let send = |tenant: &'static str, body: Value| {
            let mut request = app.request(Method::POST, Some(&key), body);
            request
                .headers_mut()
                .insert("x-tenant", HeaderValue::from_static(tenant));
            app.send(request)
        };
        let first = {
            let (app, key) = (app.clone(), key.clone());
            tokio::spawn(async move {
                let mut request = app.request(Method::POST, Some(&key), json!({"sleep_ms": 300}));
                request
                    .headers_mut()
                    .insert("x-tenant", HeaderValue::from_static("t1"));
                app.send(request).await
            })
        };
        let entry = rules::entry_key(&namespace, Some("t1"), &key, Some(SECRET.as_bytes()));
        setup.until_running(&entry).await;
        let waited = std::time::Instant::now();
        let duplicate = send("t1", json!({"another": "body"})).await;
        assert!(
            duplicate.replayed(),
            "[{}] no fingerprint: any body",
            setup.name
        );
        assert!(
            waited.elapsed() < Duration::from_millis(900),
            "woken by the digest"
        );
        assert_eq!(duplicate.body, first.await.unwrap().body);
        assert!(!send("t2", json!({})).await.replayed(), "another scope");
        assert_eq!(app.runs(), 2);
        let stored: i64 = admin
            .query_one(
                "SELECT count(*) FROM once.entries WHERE key = $1",
                &[&entry],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(stored, 1, "the entry is {entry}");
        admin
            .execute("SELECT once.invalidate_keys(NULL, $1)", &[&namespace])
            .await
            .unwrap();
        admin
            .execute("SELECT once.drop_namespace($1)", &[&namespace])
            .await
            .unwrap();
    }
}

/// The bytes of a string whose characters are bytes (latin-1), as the vectors write header values.
fn latin1(text: &str) -> Vec<u8> {
    text.chars()
        .map(|c| u8::try_from(u32::from(c)).expect("a latin-1 character"))
        .collect()
}

/// I3: the fingerprint's path is the request target's as received. axum hands a nested
/// router a URI without its prefix, so a layer inside `nest("/v1", ..)` and
/// `nest("/v2", ..)` sees `/orders` for both: another endpoint under the same key is
/// replayed instead of refused with 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "design: the layer sees the URI axum hands the nested router; using axum's \
            OriginalUri would tie the tower layer to axum (see the attack report)"]
async fn a_nested_router_fingerprints_the_path_as_received() {
    for setup in setups() {
        let client = ready_client(&setup, "rust-idem-nested").await;
        let inner = App::new(client.clone(), ttl(&client)).router;
        let router = Router::new().nest("/v1", inner.clone()).nest("/v2", inner);
        let key = fresh("nested");
        let post_to = |path: &'static str| {
            Request::builder()
                .method(Method::POST)
                .uri(path)
                .header("content-type", "application/json")
                .header("idempotency-key", key.as_str())
                .body(Body::from("{}"))
                .unwrap()
        };
        let v1 = router.clone().oneshot(post_to("/v1/orders")).await.unwrap();
        assert_eq!(v1.status(), 201, "[{}]", setup.name);
        v1.into_body().collect().await.unwrap(); // read whole: stored
        let v2 = router.clone().oneshot(post_to("/v2/orders")).await.unwrap();
        assert_eq!(
            v2.status(),
            422,
            "[{}] the same key on another endpoint: {:?}",
            setup.name,
            v2.headers()
        );
    }
}
