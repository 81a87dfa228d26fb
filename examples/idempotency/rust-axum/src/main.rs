//! The idempotency middleware's example service (clients/conformance/http/README.md):
//! one order handler behind four configurations of `IdempotencyLayer`, served by axum on
//! hyper. Environment: `PG_ONCE_DSN` (a database with pg_once and schema `idem_demo`),
//! `IDEMPOTENCY_SECRET` (what keys the entries, rule I2: 32 bytes or more, the same in
//! every process), `PORT` (or `--port N`).
//!
//! The handler's last step shows rule I8: the order and the stored response commit in one
//! transaction, and a claim taken over meanwhile rolls the order back.

use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use pg_once_client::http::{IdempotencyClaim, IdempotencyLayer, InFlight};
use pg_once_client::{Client, Options};
use serde_json::{json, Value};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dsn = std::env::var("PG_ONCE_DSN").map_err(|_| "set PG_ONCE_DSN")?;
    let secret = std::env::var("IDEMPOTENCY_SECRET")
        .map_err(|_| "set IDEMPOTENCY_SECRET (e.g. `openssl rand -hex 32`)")?;
    let port = port()?;
    let client = Client::connect(
        &dsn,
        Options {
            pool_size: 20,
            ..Options::default()
        },
    )
    .await?;
    client.ready(Duration::from_secs(10)).await?;

    // The four configurations of the shared scenarios: max_body 1 MiB (the default),
    // ttl 1 hour, everything else at its default unless the route says otherwise.
    let idempotent = || {
        IdempotencyLayer::builder(client.clone())
            .secret(&secret)
            .ttl(Duration::from_secs(3600))
    };
    let defaults = idempotent().build()?;
    let waiting = idempotent()
        .in_flight(InFlight::Wait)
        .wait(Duration::from_secs(10))
        .build()?;
    let strict = idempotent().required(true).build()?;
    let app = Router::new()
        .route("/orders", post(order).layer(defaults))
        .route("/wait/orders", post(order).layer(waiting))
        .route("/strict/orders", post(order).layer(strict))
        .route("/bare/orders", post(order))
        .route("/health", get(|| async { "ok" }))
        .with_state(client);

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    axum::serve(listener, app).await?;
    Ok(())
}

/// `--port N`, else `PORT`.
fn port() -> Result<u16, Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let given = match (args.next().as_deref(), args.next()) {
        (Some("--port"), Some(port)) => port,
        (None, _) => std::env::var("PORT").map_err(|_| "set PORT or pass --port N")?,
        _ => return Err("usage: pg_once_example_axum [--port N]".into()),
    };
    Ok(given.parse().map_err(|_| format!("not a port: {given}"))?)
}

/// What the request asks the handler to do (every member optional).
struct Ask {
    sku: Value,
    sleep_ms: u64,
    status: u16,
    raise: bool,
    size: usize,
    chunks: usize,
}

impl Ask {
    fn read(body: &[u8]) -> Ask {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let number = |name: &str, default: u64| v[name].as_u64().unwrap_or(default);
        Ask {
            sku: v["sku"].clone(),
            sleep_ms: number("sleep_ms", 0),
            status: number("status", 201) as u16,
            raise: v["raise"].as_bool().unwrap_or(false),
            size: number("size", 0) as usize,
            chunks: number("chunks", 0) as usize,
        }
    }
}

/// The handler of clients/conformance/http/README.md, steps 1 to 6.
async fn order(
    State(client): State<Client>,
    claim: Option<Extension<IdempotencyClaim>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Failure> {
    let ask = Ask::read(&body);
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let pid = std::process::id() as i32;
    let mut conn = client.pool().get().await?;

    // 1. It started (committed at once).
    conn.execute(
        "INSERT INTO idem_demo.started (idempotency_key, pid) VALUES ($1, $2)",
        &[&key, &pid],
    )
    .await?;
    // 2, 3, 4.
    tokio::time::sleep(Duration::from_millis(ask.sleep_ms)).await;
    if ask.raise {
        panic!("the request asked the handler to raise");
    }
    if ask.status >= 500 {
        let status = StatusCode::from_u16(ask.status).map_err(|e| Failure(e.to_string()))?;
        let json = [(header::CONTENT_TYPE, "application/json")];
        return Ok((status, json, json!({"error": "asked"}).to_string()).into_response());
    }
    // 5. A streamed response: the order first, committed at once.
    if ask.chunks > 0 {
        conn.execute(
            "INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES ($1, $2, $3)",
            &[&key, &ask.sku, &pid],
        )
        .await?;
        let chunk = Bytes::from(vec![b'x'; ask.size]);
        let chunks = futures_util::stream::unfold(0, move |sent| {
            let chunk = chunk.clone();
            async move {
                if sent == ask.chunks {
                    return None;
                }
                if sent > 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Some((Ok::<_, std::io::Error>(chunk), sent + 1))
            }
        });
        let mut response = Response::new(Body::from_stream(chunks));
        *response.status_mut() = StatusCode::CREATED;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        return Ok(response);
    }

    // 6. The order and its stored response in one transaction (rule I8).
    let tx = conn.transaction().await?;
    let id: i64 = tx
        .query_one(
            "INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES ($1, $2, $3) \
             RETURNING id",
            &[&key, &ask.sku, &pid],
        )
        .await?
        .get(0);
    let status = StatusCode::from_u16(ask.status).map_err(|e| Failure(e.to_string()))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::LOCATION,
        HeaderValue::try_from(format!("/orders/{id}")).expect("ASCII"),
    );
    headers.insert(header::SET_COOKIE, HeaderValue::from_static("visited=1"));
    headers.insert("x-handler-pid", HeaderValue::from(pid));
    let body = json!({"order_id": id, "sku": ask.sku, "pid": pid, "padding": "x".repeat(ask.size)})
        .to_string();
    if let Some(Extension(claim)) = &claim {
        // Error::ClaimLost: another request took the key over while this one was
        // stopped; returning drops `tx`, which rolls the order back, and the middleware
        // answers 409.
        claim
            .complete(&*tx, status, &headers, body.as_bytes())
            .await?;
    }
    tx.commit().await?;
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    Ok(response)
}

/// A handler error, answered `500` (a lost claim's answer is the middleware's).
struct Failure(String);

impl<E: std::error::Error> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0).into_response()
    }
}
