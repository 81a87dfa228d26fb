//! Idempotent HTTP requests (rule I of docs/clients.md): [`IdempotencyLayer`], a
//! `tower::Layer` for axum and anything on hyper, runs a request that carries an
//! `Idempotency-Key` at most once per key, across every process of a service, and replays
//! its response to retries. Behind the cargo feature `http`.
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use pg_once_client::http::{IdempotencyLayer, InFlight};
//! use std::time::Duration;
//! # async fn demo(client: pg_once_client::Client, secret: String) -> pg_once_client::Result<()> {
//! // `secret`: 32 bytes or more, the same in every process (e.g. from an environment variable).
//! let idempotent = IdempotencyLayer::builder(client)
//!     .secret(secret)
//!     .ttl(Duration::from_secs(3600))
//!     .in_flight(InFlight::Wait)
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(idempotent);
//! # Ok(()) }
//! ```
//!
//! For each covered request (a method of `methods` with the header), the layer reads the
//! whole body (bounded by `max_request_body`), claims the entry (`idempotency:` and an
//! HMAC of scope and key under the secret, I2) with the request's fingerprint, and: runs
//! the handler (heartbeating the claim), then stores its response while streaming it
//! (I5); or replays a stored response the middleware wrote (I6); or
//! answers with a problem+json of its own (I7). A handler that writes to the same
//! database completes the claim in its own transaction through the [`IdempotencyClaim`]
//! request extension (I8).

mod body;
mod claim;
pub mod rules;

pub use body::{BoxError, ResponseBody};
pub use claim::IdempotencyClaim;

use crate::error::{Error, Result};
use crate::{key, Client};
use body::{Store, StoringBody};
use bytes::Bytes;
use claim::{Answer, Held};
use futures_util::future::{BoxFuture, FutureExt};
use http::header::HeaderName;
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use rules::{Problem, StoredFor};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};
use tower::{Layer, Service};

/// I4: what a request gets while another request with its key runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlight {
    /// `409 Conflict` with `Retry-After: 1` at once (the default).
    #[default]
    Conflict,
    /// Wait for the other request's response (up to `wait`, holding no pooled
    /// connection), then replay it; take the key over if its owner died; `409` when
    /// `wait` runs out.
    Wait,
}

impl std::str::FromStr for InFlight {
    type Err = Error;

    /// `"conflict"` or `"wait"`, as the other clients spell the option (I9).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "conflict" => Ok(InFlight::Conflict),
            "wait" => Ok(InFlight::Wait),
            other => Err(Error::InvalidOption(format!(
                "in_flight must be \"conflict\" or \"wait\", got {other:?}"
            ))),
        }
    }
}

/// I2: the scope of a request (None: no scope).
pub type ScopeFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
/// I3: a request's fingerprint from its method, path, raw query and body (None: none).
pub type FingerprintFn = Arc<dyn Fn(&Method, &str, &str, &[u8]) -> Option<Vec<u8>> + Send + Sync>;
/// I5: whether a response of this status is stored.
pub type StoreFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The options of rule I, checked once by [`IdempotencyLayerBuilder::build`].
#[derive(Clone)]
struct Config {
    client: Client,
    methods: Vec<Method>,
    header: HeaderName,
    /// The header's name as the application spells it, for the problems' details.
    header_label: String,
    required: bool,
    namespace: String,
    scope: ScopeFn,
    /// Whether `scope` is the application's (else the default: a credential, I2).
    custom_scope: bool,
    secret: Option<Arc<[u8]>>,
    fingerprint: FingerprintFn,
    ttl: Duration,
    lease: Duration,
    in_flight: InFlight,
    wait: Duration,
    max_body: usize,
    max_request_body: usize,
    store: StoreFn,
    store_cookies: bool,
}

/// The longest `ttl` `complete_key` takes (100 years), and the longest `lease` and
/// `wait` `claim_key` takes (1 day).
const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

/// Builds an [`IdempotencyLayer`]; every option has rule I's default.
pub struct IdempotencyLayerBuilder {
    config: Config,
    header: std::result::Result<HeaderName, String>,
}

impl IdempotencyLayerBuilder {
    /// Methods covered (default `POST` and `PATCH`); others pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// The request header carrying the key (default `Idempotency-Key`).
    pub fn header(mut self, name: &str) -> Self {
        self.header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header must be a header name, got {name:?}"));
        self.config.header_label = name.to_owned();
        self
    }

    /// Answer a covered request without the header `400` (`key_missing`) instead of
    /// letting it through (default false).
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// A prefix of every entry's key, such as `tenant2/`, a namespace made with
    /// `once.create_namespace` (default empty).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.config.namespace = namespace.into();
        self
    }

    /// Who the request is for (the authenticated principal or tenant), so that two
    /// callers' identical keys never meet. Default: the `Authorization` header, or None
    /// without one, which needs a [`secret`](Self::secret); pass your own if you
    /// authenticate by cookie or mTLS.
    pub fn scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.scope = Arc::new(scope);
        self.config.custom_scope = true;
        self
    }

    /// The application's secret, at least 32 bytes, the same in every process of the
    /// service (e.g. from an environment variable): each entry's key is then an HMAC of
    /// scope and key (I2), so that no credential's digest is stored or announced on
    /// channel `once`, and a replay needs the secret's MAC (I6). Required with the default
    /// scope, which comes from the caller's credentials.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.config.secret = Some(Arc::from(secret.as_ref()));
        self
    }

    /// The request's fingerprint, 1 to 64 bytes, from its method, path (as received),
    /// raw query and body; None for none (any request may reuse the key). Default: the
    /// SHA-256 of the four ([`rules::default_fingerprint`]).
    pub fn fingerprint(
        mut self,
        fingerprint: impl Fn(&Method, &str, &str, &[u8]) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> Self {
        self.config.fingerprint = Arc::new(fingerprint);
        self
    }

    /// How long a stored response is replayed (default 24 hours).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// The claim's lease, renewed every `lease / 3` while the handler runs (default
    /// 30 s). A process that dies loses its claims at once anyway (its LISTEN connection
    /// owns them); the lease bounds a process that hangs.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// What a request gets while another with its key runs (default
    /// [`InFlight::Conflict`]).
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.config.in_flight = in_flight;
        self
    }

    /// With [`InFlight::Wait`], how long a request waits for the other (default 10 s).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// The longest response body stored, in bytes (default 1 MiB): a longer one is sent
    /// in full and stored without its body (a replay has the status and headers).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.config.max_body = bytes;
        self
    }

    /// The longest request body read, in bytes (default 1 MiB): a longer one is answered
    /// `413` (`body_too_large`) and runs nothing.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// Which statuses are stored (default: below 500). A response not stored releases
    /// the claim, so that a retry runs again.
    pub fn store(mut self, store: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.config.store = Arc::new(store);
        self
    }

    /// Store and replay `set-cookie` headers (default false: a replay sets no cookie).
    pub fn store_cookies(mut self, store: bool) -> Self {
        self.config.store_cookies = store;
        self
    }

    /// The layer, or [`Error::InvalidOption`] for an option out of range (I9, F1).
    pub fn build(self) -> Result<IdempotencyLayer> {
        let mut config = self.config;
        let invalid = |why: String| Err(Error::InvalidOption(why));
        config.header = match self.header {
            Ok(header) => header,
            Err(why) => return invalid(why),
        };
        if config.ttl.is_zero() || config.ttl > MAX_TTL {
            return invalid(format!(
                "ttl must be above 0 and at most 100 years, got {:?}",
                config.ttl
            ));
        }
        if config.lease.is_zero() || config.lease > MAX_LEASE {
            return invalid(format!(
                "lease must be above 0 and at most 1 day, got {:?}",
                config.lease
            ));
        }
        if config.wait > MAX_LEASE {
            return invalid(format!("wait must be at most 1 day, got {:?}", config.wait));
        }
        if config.methods.is_empty() {
            return invalid("methods must name at least one method".into());
        }
        if config.max_body == 0 || config.max_request_body == 0 {
            return invalid("max_body and max_request_body must be positive".into());
        }
        match &config.secret {
            None if !config.custom_scope => {
                return Err(Error::Configuration(
                    "the idempotency layer's secret is required with the default scope, which \
                     comes from the caller's Authorization header: call .secret(...) (at least \
                     32 bytes, the same in every process of the service, e.g. \
                     IDEMPOTENCY_SECRET made with `openssl rand -hex 32`), so that no digest \
                     of a credential a dictionary could crack is stored or announced; or \
                     .scope(...) with the authenticated principal"
                        .into(),
                ))
            }
            Some(secret) if secret.len() < rules::MIN_SECRET_BYTES => {
                return Err(Error::Configuration(format!(
                    "the idempotency layer's secret must be at least {} bytes (e.g. `openssl \
                     rand -hex 32`), got {}",
                    rules::MIN_SECRET_BYTES,
                    secret.len()
                )))
            }
            _ => {}
        }
        Ok(IdempotencyLayer {
            config: Arc::new(config),
        })
    }
}

/// Makes the requests of a service idempotent with an `Idempotency-Key` header (rule I):
/// see the [module](self). Cheap to clone.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// The layer with every option at its default but the secret (see
    /// [`IdempotencyLayerBuilder::secret`]); [`Error::Configuration`] for one too short.
    pub fn new(client: Client, secret: impl AsRef<[u8]>) -> Result<Self> {
        Self::builder(client).secret(secret).build()
    }

    /// A builder, every option at its default.
    pub fn builder(client: Client) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            config: Config {
                client,
                methods: vec![Method::POST, Method::PATCH],
                header: HeaderName::from_static("idempotency-key"),
                header_label: "Idempotency-Key".into(),
                required: false,
                namespace: String::new(),
                scope: Arc::new(|parts: &Parts| rules::default_scope(&parts.headers)),
                custom_scope: false,
                secret: None,
                fingerprint: Arc::new(|method: &Method, path: &str, query: &str, body: &[u8]| {
                    Some(rules::default_fingerprint(
                        method.as_str(),
                        path,
                        query,
                        body,
                    ))
                }),
                ttl: Duration::from_secs(24 * 3600),
                lease: Duration::from_secs(30),
                in_flight: InFlight::Conflict,
                wait: Duration::from_secs(10),
                max_body: 1 << 20,
                max_request_body: 1 << 20,
                store: Arc::new(|status: StatusCode| status.as_u16() < 500),
                store_cookies: false,
            },
            header: Ok(HeaderName::from_static("idempotency-key")),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around another.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S, B, ResBody> Service<Request<B>> for Idempotency<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = BoxFuture<'static, std::result::Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone is for the next request; this one goes to the service that was ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(run(inner, config, request))
    }
}

/// A response of the service's own, with the body type every answer has.
fn boxed<ResBody>(response: Response<ResBody>) -> Response<ResponseBody>
where
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    response.map(|body| body.map_err(Into::into).boxed_unsync())
}

/// An answer the middleware makes itself (I7).
fn problem(problem: Problem, detail: &str, retry_after: Option<u64>) -> Response<ResponseBody> {
    boxed(problem.response(detail, retry_after).map(Full::new))
}

/// One request through the middleware (I1 to I8).
async fn run<S, B, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    request: Request<B>,
) -> std::result::Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // I1: which requests.
    if !config.methods.contains(request.method()) {
        return inner.call(request).await.map(boxed);
    }
    let mut values = request.headers().get_all(&config.header).iter();
    let key = match (values.next(), values.next()) {
        (None, _) if config.required => {
            let detail = format!(
                "This endpoint needs an {} header: send a unique key (such as a UUID) \
                     with the request, and the same key with its retries.",
                config.header_label
            );
            return Ok(problem(Problem::KeyMissing, &detail, None));
        }
        (None, _) => return inner.call(request).await.map(boxed),
        (Some(_), Some(_)) => {
            let detail = format!("Send one {} header, not several.", config.header_label);
            return Ok(problem(Problem::KeyInvalid, &detail, None));
        }
        (Some(value), None) => match rules::key_from_header(value.as_bytes()) {
            Ok(key) => key,
            Err(rules::InvalidKey(why)) => {
                let detail = format!("The {} header is not a key: {why}.", config.header_label);
                return Ok(problem(Problem::KeyInvalid, &detail, None));
            }
        },
    };
    // I3: the whole body, before claiming, handed on as it was read.
    let (parts, body) = request.into_parts();
    let body = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            let detail = format!(
                "The request body is over {} bytes, the most this endpoint reads for an \
                     idempotent request.",
                config.max_request_body
            );
            return Ok(problem(Problem::BodyTooLarge, &detail, None));
        }
        Err(e) => {
            let detail = format!("The request body could not be read ({e}); send it again.");
            return Ok(problem(Problem::HandlerFailed, &detail, None));
        }
    };
    // I2: the entry.
    let scope = (config.scope)(&parts);
    let entry = rules::entry_key(
        &config.namespace,
        scope.as_deref(),
        &key,
        config.secret.as_deref(),
    );
    if let Err(e) = key::check(&entry) {
        let detail = format!("The scope and key make no pg_once key: {e}.");
        return Ok(problem(Problem::KeyInvalid, &detail, None));
    }
    let path = parts.uri.path();
    let query = parts.uri.query().unwrap_or("");
    let fingerprint = (config.fingerprint)(&parts.method, path, query, &body);
    if let Some(bad) = fingerprint
        .as_ref()
        .filter(|f| f.is_empty() || f.len() > 64)
    {
        // The application's fingerprint function is wrong, not the request: say so in
        // its log, and run nothing.
        tracing::error!(
            key = entry,
            bytes = bad.len(),
            "pg_once: a fingerprint must be 1 to 64 bytes"
        );
        return Ok(handler_failed());
    }
    // I3: with a secret, what is claimed and stored is keyed, so that no digest of the
    // request (a token in its query) is readable through once.get.
    let fingerprint = match (&config.secret, fingerprint) {
        (Some(secret), Some(fingerprint)) => Some(rules::keyed_fingerprint(secret, &fingerprint)),
        (_, fingerprint) => fingerprint,
    };
    let wait = match config.in_flight {
        InFlight::Conflict => Duration::ZERO,
        InFlight::Wait => config.wait,
    };
    let answer = config
        .client
        .claim_request(&entry, fingerprint.as_deref(), config.lease, wait)
        .await;
    let stored_for = Arc::new(StoredFor {
        entry,
        fingerprint,
        secret: config.secret.clone(),
        store_cookies: config.store_cookies,
    });
    let held = match answer {
        Ok(Answer::Claimed(held)) => held,
        Ok(other) => return Ok(answer_without_running(other, &stored_for)),
        Err(e) => return Ok(unavailable(&stored_for.entry, &e)),
    };
    // I4 `claimed`: run the handler.
    let request = Request::from_parts(parts, B::from(body));
    Ok(run_to_the_end(inner, config, request, held, stored_for).await)
}

/// I4 `claimed`: the handler runs on a task of its own, so that a caller who hangs up
/// (hyper then drops the request's future) neither stops it half-way nor strands its
/// claim: its response is stored, or its claim given back, whether or not the caller is
/// still there, as under the other clients. Without a caller, the task reads the
/// response's body itself, so that it is stored whole.
async fn run_to_the_end<S, B, ResBody>(
    inner: S,
    config: Arc<Config>,
    request: Request<B>,
    held: Arc<Held>,
    stored_for: Arc<StoredFor>,
) -> Response<ResponseBody>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
    B: Body + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (answer, answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let response = run_claimed(inner, &config, request, held, stored_for).await;
        if let Err(unread) = answer.send(response) {
            let mut body = unread.into_body();
            while let Some(Ok(_)) = body.frame().await {}
        }
    });
    // An Err is a task that panicked outside the handler: its claim went with it.
    answered.await.unwrap_or_else(|_| handler_failed())
}

/// The handler under its claim, given as an extension (I8); then its response, stored
/// as it streams (I5), or an answer of the middleware's own.
async fn run_claimed<S, B, ResBody>(
    mut inner: S,
    config: &Config,
    mut request: Request<B>,
    held: Arc<Held>,
    stored_for: Arc<StoredFor>,
) -> Response<ResponseBody>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Error: std::fmt::Display,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    request.extensions_mut().insert(IdempotencyClaim {
        held: held.clone(),
        ttl: config.ttl,
        max_body: config.max_body,
        stored_for: stored_for.clone(),
    });
    let entry = &stored_for.entry;
    let ran = AssertUnwindSafe(inner.call(request)).catch_unwind().await;
    let response = match ran {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            tracing::error!(key = entry, error = %e, "pg_once: the handler of a request failed");
            held.release().await;
            return handler_failed();
        }
        Err(_panic) => {
            held.release().await;
            return handler_failed();
        }
    };
    if held.lost() {
        // I8: the handler's completion found its claim taken over: its writes rolled
        // back, and another request runs (or ran) the key.
        return answer_duplicate(config, &stored_for).await;
    }
    if held.completed_by_handler() || !(config.store)(response.status()) {
        // Given back even if the handler completed it: a completion that committed
        // makes this a no-op, one that rolled back leaves the key to a retry.
        held.release().await;
        return boxed(response);
    }
    let (head, body) = boxed(response).into_parts();
    let store = Store {
        held,
        status: head.status,
        headers: head.headers.clone(),
        ttl: config.ttl,
        max_body: config.max_body,
        stored_for: stored_for.clone(),
    };
    if body.is_end_stream() {
        // No body (a 204, say): hyper may never poll it, so it is stored now.
        store.finish(Some(&[])).await;
        return Response::from_parts(head, body);
    }
    let body = StoringBody::new(body, store).boxed_unsync();
    Response::from_parts(head, body)
}

/// I8: a request whose claim was lost is answered as a concurrent duplicate: `409`,
/// or with [`InFlight::Wait`] the other request's response once it is stored.
async fn answer_duplicate(config: &Config, stored_for: &StoredFor) -> Response<ResponseBody> {
    let entry = &stored_for.entry;
    if config.in_flight == InFlight::Wait {
        let answer = config
            .client
            .claim_request(
                entry,
                stored_for.fingerprint.as_deref(),
                config.lease,
                config.wait,
            )
            .await;
        match answer {
            Ok(Answer::Claimed(held)) => held.release().await, // not run twice here
            Ok(other) => return answer_without_running(other, stored_for),
            Err(e) => return unavailable(entry, &e),
        }
    }
    answer_without_running(Answer::Running, stored_for)
}

/// The answers of I4 that run nothing: a replay of what the middleware stored (I6), or a
/// problem.
fn answer_without_running(answer: Answer, stored_for: &StoredFor) -> Response<ResponseBody> {
    match answer {
        Answer::Hit(stored) => {
            let why = rules::untrusted(stored_for, &stored);
            if let Some(replay) = why
                .is_none()
                .then(|| rules::replayed_response(&stored))
                .flatten()
            {
                return boxed(replay.map(Full::new));
            }
            tracing::error!(
                key = stored_for.entry,
                why = why.as_deref().unwrap_or("it is not the stored form"),
                "pg_once: not replaying an entry this middleware did not write (a role \
                 with pg_once's rights in its key space?)"
            );
            problem(
                Problem::UntrustedEntry,
                "The response stored under this key was not written by this service's \
                 idempotency middleware, so it is not replayed and the request is not run: \
                 send a new key.",
                None,
            )
        }
        Answer::Mismatch => problem(
            Problem::FingerprintMismatch,
            "This key was used by a request with another method, path, query or body: \
             send a new key for a new request.",
            None,
        ),
        Answer::Running => problem(
            Problem::InFlight,
            "A request with this key is running: retry after it finishes to get its response.",
            Some(1),
        ),
        Answer::Failed { retry_at } => {
            let seconds = retry_at
                .and_then(|at| at.duration_since(SystemTime::now()).ok())
                .map_or(1, |left| left.as_secs_f64().ceil().max(1.0) as u64);
            problem(
                Problem::InFlight,
                "The request with this key failed; retry after Retry-After seconds.",
                Some(seconds),
            )
        }
        Answer::Claimed(_) => unreachable!("a claimed request runs"),
    }
}

/// I4: pg_once unreachable or refusing the call: the handler does not run without the
/// guarantee.
fn unavailable(entry: &str, e: &Error) -> Response<ResponseBody> {
    tracing::error!(key = entry, error = %e, "pg_once: could not claim a request's key");
    problem(
        Problem::Unavailable,
        "The idempotency store cannot be reached: retry with the same key shortly.",
        Some(1),
    )
}

fn handler_failed() -> Response<ResponseBody> {
    problem(
        Problem::HandlerFailed,
        "The request failed and nothing was stored: retry with the same key to run it again.",
        None,
    )
}
