//! [`Client`]: get a key's cached result or compute it once across every process, through
//! a connection pool.

use crate::conninfo::Conninfo;
use crate::error::{Error, Result};
use crate::key;
use crate::listener::{Interest, Listener};
use crate::options::{freshness, CallOptions, Options, Resolved};
use crate::outcome::{Outcome, OutcomeEvent};
use crate::raw::{self, Claim, Owner};
use crate::refresh::{self, Refreshes};
use crate::values::as_stored;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use futures_util::future::{BoxFuture, FutureExt, Shared};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;
use tracing::Instrument;

/// Run one pg_once call on a pooled connection, held only for that call:
/// `with_conn!(inner, |c| raw::claim_key(c, ...))` evaluates to the call's `Result`.
///
/// A call that fails because its connection did (a terminated backend, a restarted
/// PgBouncer, a pool that could not connect, a primary that died; [`Error::is_connection_error`],
/// rule R1) is tried again on another connection (R2): the second attempt at once, the
/// next ones after jittered pauses of 50 ms doubling to 1 s, as long as its budget lasts:
/// `connect_timeout` from the first attempt, long enough for a failover to another host of
/// the conninfo (N7). Every pg_once call is safe to repeat, and claims belong to the LISTEN
/// connection, not to the pooled one. (A macro rather than a function taking an async
/// closure: the closure's borrowed futures would not be provably `Send` for
/// `tokio::spawn`.)
///
/// `with_conn!(inner, until deadline, |c| ...)` gives a claim the caller's `wait` as its
/// budget instead (R2, N6): the first attempt is made as always (getting its connection
/// waits at most `connect_timeout`), the second at once, and a later one only if its
/// pause ends before the deadline; a retry's wait for a connection stops there; the
/// connection error is returned then. A statement already sent is never abandoned: a
/// claim it made would be held by nobody.
macro_rules! with_conn {
    ($inner:expr, |$c:ident| $call:expr) => {{
        let inner: &$crate::client::Inner = &$inner;
        with_conn!(inner, until std::time::Instant::now() + inner.options.connect_timeout, |$c| $call)
    }};
    ($inner:expr, until $deadline:expr, |$c:ident| $call:expr) => {{
        let inner: &$crate::client::Inner = &$inner;
        let deadline: std::time::Instant = $deadline;
        let mut attempt: u32 = 0;
        let mut pause = std::time::Duration::from_millis(50);
        let mut failed: Option<$crate::Error> = None;
        loop {
            attempt += 1;
            let conn = match failed.take() {
                Some(before) => {
                    match tokio::time::timeout_at(deadline.into(), inner.pool.get()).await {
                        Ok(conn) => conn.map_err($crate::Error::from),
                        Err(_) => break Err(before),
                    }
                }
                None => inner.pool.get().await.map_err($crate::Error::from),
            };
            let result: $crate::Result<_> = match conn {
                Ok(conn) => {
                    let $c: &tokio_postgres::Client = &conn;
                    $call.await
                }
                Err(e) => Err(e),
            };
            match result {
                Err(e) if e.is_connection_error() => {
                    if attempt > 1 {
                        let wait = $crate::jitter(pause);
                        if std::time::Instant::now() + wait >= deadline {
                            break Err(e);
                        }
                        tokio::time::sleep(wait).await;
                        pause = (pause * 2).min(std::time::Duration::from_secs(1));
                    }
                    failed = Some(e);
                }
                other => break other,
            }
        }
    }};
}

/// A key's shared answer: its value and how the computing call got it.
type Answer = Shared<BoxFuture<'static, Result<(Value, Outcome)>>>;

/// A key this process is resolving: its outcome, shared by every caller (C1), and who
/// still waits for it.
struct InFlight {
    answer: Answer,
    callers: Weak<Callers>,
    /// The span of the call that resolves the key, which coalesced calls follow from.
    span: Option<tracing::Id>,
}

/// Held by every caller waiting for one in-flight key. When the last is dropped (every
/// caller's future was dropped: cancelled, or timed out by its owner), the computation is
/// abandoned and its claim given back (rule X2).
struct Callers(watch::Sender<bool>);

impl Drop for Callers {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

pub(crate) struct Inner {
    pub pool: Pool,
    pub options: Options,
    pub listener: Option<Listener>,
    /// Keys this process is resolving right now, so concurrent calls make one claim.
    inflight: Mutex<HashMap<String, InFlight>>,
    /// The refreshes this process runs in the background.
    pub refreshes: Refreshes,
}

impl refresh::Refresher for Inner {
    fn refreshes(&self) -> &Refreshes {
        &self.refreshes
    }

    fn give_back<'a>(&'a self, key: &'a str, token: i64) -> BoxFuture<'a, ()> {
        async move {
            if let Err(e) = with_conn!(self, |c| raw::release_key(c, key, token)) {
                tracing::warn!(key, error = %e, "pg_once: could not release a refresh's claim");
            }
        }
        .boxed()
    }
}

/// Held by every clone of a [`Client`] and by nothing else (the client's own tasks hold
/// [`Inner`]): when the last clone is dropped, background refreshes are stopped and their
/// keys given back, rather than keeping the client's connections alive for them.
struct LastClone(Arc<Inner>);

impl Drop for LastClone {
    fn drop(&mut self) {
        self.0.refreshes.stop();
    }
}

/// A pg_once client for one process: a pool for the calls, one LISTEN connection for
/// owner liveness and wake-ups, and in-process coalescing. Cheap to clone (shared state);
/// dropping the last clone closes the LISTEN connection, which ends the process's claims.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
    _last: Arc<LastClone>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("options", &self.inner.options)
            .field("owner_pid", &self.owner_pid())
            .finish()
    }
}

impl Client {
    /// Connect to `conninfo` (libpq style, e.g. `host=... port=... user=... dbname=...`),
    /// which may be PgBouncer in transaction mode, with a pool of `options.pool_size`.
    /// Must be called inside a tokio runtime. Connections are made lazily; the LISTEN
    /// connection goes to `options.listen_conninfo`, or to `conninfo`.
    pub async fn connect(conninfo: &str, mut options: Options) -> Result<Client> {
        let parsed = Conninfo::parse(conninfo)?;
        let manager = Manager::from_config(
            parsed.config().clone(),
            parsed.connector()?,
            ManagerConfig {
                // A connection that died is noticed by its next call, which is retried on
                // another one (see `with_conn!`); no extra round trip per checkout.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(options.pool_size.max(1))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(options.connect_timeout))
            .create_timeout(Some(options.connect_timeout))
            .recycle_timeout(Some(options.connect_timeout))
            .build()
            .map_err(|e| Error::Configuration(format!("pool: {e}")))?;
        if options.listen_conninfo.is_none() {
            options.listen_conninfo = Some(conninfo.to_owned());
        }
        Client::from_pool(pool, options)
    }

    /// Use an existing deadpool-postgres pool (its connections must be in autocommit,
    /// which they are unless you leave a transaction open). With `listen` true,
    /// `options.listen_conninfo` must be set: a pool does not say where it connects.
    pub fn from_pool(pool: Pool, options: Options) -> Result<Client> {
        if options.lease.is_zero() {
            return Err(Error::Configuration("lease must be positive".into()));
        }
        let listener = if options.listen {
            let conninfo = options.listen_conninfo.clone().ok_or_else(|| {
                Error::Configuration(
                    "listen is true but listen_conninfo is not set: give the conninfo of a \
                     direct (or session-pooled) connection, or set listen: false"
                        .into(),
                )
            })?;
            Some(Listener::start(conninfo)?)
        } else {
            None
        };
        let inner = Arc::new(Inner {
            pool,
            options,
            listener,
            inflight: Mutex::new(HashMap::new()),
            refreshes: Refreshes::default(),
        });
        Ok(Client {
            _last: Arc::new(LastClone(inner.clone())),
            inner,
        })
    }

    /// The pool the calls go through.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The backend pid of the LISTEN connection (the `owner_pid` of this process's claims),
    /// while it is connected. None with `listen: false`.
    pub fn owner_pid(&self) -> Option<i32> {
        self.inner.listener.as_ref().and_then(|l| l.pid())
    }

    /// Wait until the LISTEN connection is up (claims would wait for it anyway). Useful at
    /// start-up to fail fast on a bad `listen_conninfo`.
    pub async fn ready(&self, patience: Duration) -> Result<()> {
        if let Some(l) = &self.inner.listener {
            l.owner(patience).await?;
        }
        Ok(())
    }

    /// The cached result of `key`, or compute it with `compute` if nobody else is; if
    /// somebody is, wait for their result. Across processes one caller computes; within
    /// this process concurrent calls for `key` share one claim and one outcome (the first
    /// caller's `compute` runs, the others' are dropped).
    ///
    /// The computation runs on its own task, heartbeated every `lease / 3`; it finishes
    /// (and stores its result) even if every caller stops waiting.
    ///
    /// With `stale` (and `ttl`), a key past its `ttl` but inside its stale window is never
    /// waited for: the call returns the previous result at once, and the first such call
    /// across every process recomputes the key in the background of its process (see
    /// [`Client::shutdown`]). With `beta`, a hit may likewise return the result and refresh
    /// it in the background before it expires. A background refresh that fails keeps the
    /// previous result served (its error is not returned to anyone: after `retry_after`
    /// the next caller refreshes again). Only calls with `stale` or `beta` are answered
    /// this way (`serve_stale => true`); a call without them behaves as before 0.2, and
    /// waits for a refresh someone else runs.
    ///
    /// Errors: the compute
    /// function's ([`Error::Compute`], after failing the key with its text), a failure
    /// shared by another process ([`Error::Failed`]), [`Error::Timeout`] after `wait`,
    /// [`Error::ClaimLost`], [`Error::NotSerializable`] / [`Error::Deserialize`], and
    /// connection errors.
    pub async fn get_or_compute<T, E, F, Fut>(
        &self,
        key: &str,
        compute: F,
        opts: CallOptions,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    {
        let value = self
            .get_or_compute_checked(key, compute, opts, reads_back::<T>)
            .await?;
        serde_json::from_value(value).map_err(|e| Error::Deserialize {
            key: key.to_owned(),
            source: Arc::new(e),
        })
    }

    /// [`Client::get_or_compute`] returning the JSON as stored.
    pub async fn get_or_compute_value<T, E, F, Fut>(
        &self,
        key: &str,
        compute: F,
        opts: CallOptions,
    ) -> Result<Value>
    where
        T: Serialize + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    {
        self.get_or_compute_checked(key, compute, opts, |_| Ok(()))
            .await
    }

    /// get_or_compute, where a computed value is stored only if `readback` accepts its
    /// JSON (V1, V3: what the caller gets back is what everyone reads, and a value that
    /// cannot be read back as its own type, such as a NaN that JSON writes as null, is
    /// refused before it is stored).
    async fn get_or_compute_checked<T, E, F, Fut>(
        &self,
        key: &str,
        compute: F,
        opts: CallOptions,
        readback: fn(&Value) -> serde_json::Result<()>,
    ) -> Result<Value>
    where
        T: Serialize + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    {
        key::check(key)?;
        let settings = self.inner.resolve(&opts)?;
        let own_wait = settings.wait;
        let started = Instant::now();
        let span = tracing::info_span!(
            "pg_once.get_or_compute",
            pg_once.key = key,
            pg_once.outcome = tracing::field::Empty
        );
        let (answer, _caller, coalesced) = {
            let mut inflight = self.inner.inflight.lock().unwrap();
            let joined = inflight.get(key).and_then(|f| {
                let callers = f.callers.upgrade()?;
                if let Some(leader) = &f.span {
                    span.follows_from(leader.clone());
                }
                Some((f.answer.clone(), callers, true))
            });
            match joined {
                Some(joined) => joined,
                None => {
                    let compute: Compute = Box::new(move || {
                        async move {
                            let value = compute().await.map_err(ComputeError::failed)?;
                            let value =
                                serde_json::to_value(value).map_err(ComputeError::Serialize)?;
                            readback(&value).map_err(ComputeError::Serialize)?;
                            Ok(value)
                        }
                        .boxed()
                    });
                    let (abandon, mut abandoned) = watch::channel(false);
                    let callers = Arc::new(Callers(abandon));
                    let mine = Arc::downgrade(&callers);
                    let inner = self.inner.clone();
                    let owned_key = key.to_owned();
                    // Its own task, so that a caller that stops waiting does not stop it
                    // for the others; once every caller has stopped, it gives its claim
                    // back rather than compute for nobody.
                    let compute_span = tracing::info_span!(parent: &span, "pg_once.resolve");
                    let task = tokio::spawn(async move {
                        let claimed = Mutex::new(None);
                        let result = tokio::select! {
                            result = resolve(&inner, &owned_key, compute, &settings, &claimed)
                                .instrument(compute_span) => result,
                            _ = async { drop(abandoned.wait_for(|gone| *gone).await) } => {
                                let token = claimed.lock().unwrap().take();
                                if let Some(token) = token {
                                    release_abandoned(&inner, &owned_key, token).await;
                                }
                                Err(Error::Cancelled { key: owned_key.clone() })
                            }
                        };
                        let mut inflight = inner.inflight.lock().unwrap();
                        if inflight
                            .get(&owned_key)
                            .is_some_and(|f| f.callers.ptr_eq(&mine))
                        {
                            inflight.remove(&owned_key);
                        }
                        result
                    });
                    let owned_key = key.to_owned();
                    let outcome = async move {
                        task.await.unwrap_or_else(|e| {
                            Err(Error::Compute {
                                key: owned_key,
                                source: Arc::new(std::io::Error::other(format!(
                                    "the task resolving the key ended: {e}"
                                ))),
                            })
                        })
                    }
                    .boxed()
                    .shared();
                    inflight.insert(
                        key.to_owned(),
                        InFlight {
                            answer: outcome.clone(),
                            callers: Arc::downgrade(&callers),
                            span: span.id(),
                        },
                    );
                    (outcome, callers, false)
                }
            }
        };
        let answer = if coalesced {
            // X1: a caller that joined another's computation keeps its own bound.
            let waited = tokio::time::timeout(own_wait, answer.instrument(span.clone())).await;
            waited.unwrap_or_else(|_| {
                Err(Error::Timeout {
                    key: key.to_owned(),
                    waited: started.elapsed(),
                })
            })
        } else {
            answer.instrument(span.clone()).await
        };
        let outcome = match &answer {
            Ok(_) if coalesced => Outcome::Coalesced,
            Ok((_, outcome)) => *outcome,
            Err(_) => Outcome::Failed,
        };
        span.record("pg_once.outcome", outcome.as_str());
        if let Some(hook) = &self.inner.options.on_outcome {
            hook.call(&OutcomeEvent {
                outcome,
                key,
                duration: started.elapsed(),
                error: answer.as_ref().err(),
            });
        }
        answer.map(|(value, _)| value)
    }

    /// Wrap an async function as a cached one, with keys of your own: `key` names the
    /// argument's result (at most [`key::MAX_KEY_BYTES`] bytes), `f` computes it. Calls go
    /// through [`Client::get_or_compute`]. See [`Client::cached_named`] for default keys.
    ///
    /// ```no_run
    /// # async fn demo(client: pg_once_client::Client) -> pg_once_client::Result<()> {
    /// use pg_once_client::CallOptions;
    /// let title = client.cached(
    ///     |url: &String| format!("title:{url}"),
    ///     |url: String| async move { Ok::<_, std::io::Error>(format!("Title of {url}")) },
    ///     CallOptions::default(),
    /// );
    /// let t: String = title.call("https://example.com".to_string()).await?;
    /// # Ok(()) }
    /// ```
    pub fn cached<A, K, F>(&self, key: K, f: F, opts: CallOptions) -> Cached<A, F>
    where
        K: Fn(&A) -> String + Send + Sync + 'static,
    {
        Cached {
            client: self.clone(),
            key: Arc::new(move |arg: &A| {
                let key = key(arg);
                key::check(&key)?;
                Ok(key)
            }),
            f,
            opts,
        }
    }

    /// Wrap an async function as a cached one whose keys are derived from its arguments
    /// by rule K of docs/clients.md: `name:[args...]`, the same key a Python or Node
    /// process derives for the same name and arguments. `name` must stay the same across
    /// processes and releases (a function's own name is not available, and would not be).
    /// The argument is a tuple of the function's arguments (`(x,)` for one).
    ///
    /// ```no_run
    /// # async fn demo(client: pg_once_client::Client) -> pg_once_client::Result<()> {
    /// use pg_once_client::CallOptions;
    /// let report = client.cached_named(
    ///     "report",
    ///     |(year, region): (i32, String)| async move {
    ///         Ok::<_, std::io::Error>(format!("{region} in {year}"))
    ///     },
    ///     CallOptions::default(),
    /// );
    /// let r: String = report.call((2026, "eu".to_string())).await?; // key report:[2026,"eu"]
    /// report.invalidate(&(2026, "eu".to_string())).await?;
    /// # Ok(()) }
    /// ```
    pub fn cached_named<A, F>(&self, name: &str, f: F, opts: CallOptions) -> Cached<A, F>
    where
        A: Serialize,
    {
        let name = name.to_owned();
        Cached {
            client: self.clone(),
            key: Arc::new(move |arg: &A| key::derive(&name, arg)),
            f,
            opts,
        }
    }

    /// Forget `key` (its result, failure or running claim); false if it was absent.
    pub async fn invalidate(&self, key: &str) -> Result<bool> {
        with_conn!(self.inner, |c| raw::invalidate_key(c, key))
    }

    /// Ask for `key` to be recomputed, without ever starting a second concurrent
    /// computation (`once.refresh_key`): `absent`, `expired` (its result expires now; with
    /// `stale` it is served as stale for that long while one caller refreshes it), `rerun`
    /// (it is being computed: it is computed once more after that run, whose result is
    /// served as stale for `stale`, or not at all) or `pending` (queued: it runs anyway).
    pub async fn refresh(&self, key: &str, stale: Option<Duration>) -> Result<String> {
        with_conn!(self.inner, |c| raw::refresh_key(c, key, stale))
    }

    /// The keys this client is refreshing in the background now.
    pub fn refreshing(&self) -> Vec<String> {
        self.inner.refreshes.running()
    }

    /// Stop this client's background refreshes: those running may finish for up to
    /// `drain`; the rest are stopped and their keys given back (another caller, in any
    /// process, refreshes them), waiting up to 5 s more for that. Refreshes drawn from now
    /// on are given back at once (their callers still get the previous result). Other
    /// calls keep working. Dropping the last clone of the client stops its refreshes the
    /// same way, without the drain.
    pub async fn shutdown(&self, drain: Duration) {
        self.inner.refreshes.shutdown(drain).await;
    }

    /// Add `key` to `queue` for the workers ([`Client::work`]): `queued`, `requeued`,
    /// `duplicate` or `cached`.
    pub async fn enqueue(&self, key: &str, payload: Option<&Value>, queue: &str) -> Result<String> {
        with_conn!(self.inner, |c| raw::enqueue_key(c, key, payload, queue, 0))
    }

    /// [`Client::enqueue`] for many `(key, payload)` pairs in one statement
    /// (`once.enqueue_keys`): each key with its outcome, in the order given. Every key is
    /// checked before anything is sent; at most 1,000 distinct keys a call (the server
    /// refuses more, or a repeated key, with 22023, and the whole batch, 42501, if one key
    /// is not the caller's).
    pub async fn enqueue_many(
        &self,
        jobs: &[(&str, Option<&Value>)],
        queue: &str,
    ) -> Result<Vec<(String, String)>> {
        for (key, _) in jobs {
            key::check(key)?;
        }
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        with_conn!(self.inner, |c| raw::enqueue_keys(c, jobs, queue, 0))
    }
}

/// How a [`Cached`] function names the result of an argument.
type KeyFn<A> = Arc<dyn Fn(&A) -> Result<String> + Send + Sync>;

/// An async function whose results are cached by pg_once, made by [`Client::cached`] or
/// [`Client::cached_named`].
pub struct Cached<A, F> {
    client: Client,
    key: KeyFn<A>,
    f: F,
    opts: CallOptions,
}

impl<A, F: Clone> Clone for Cached<A, F> {
    fn clone(&self) -> Self {
        Cached {
            client: self.client.clone(),
            key: self.key.clone(),
            f: self.f.clone(),
            opts: self.opts.clone(),
        }
    }
}

impl<A, F> Cached<A, F> {
    /// The key of `arg`'s result.
    pub fn key(&self, arg: &A) -> Result<String> {
        (self.key)(arg)
    }

    /// The result for `arg`: cached, computed elsewhere, or computed here with `f(arg)`.
    pub async fn call<Fut, T, E>(&self, arg: A) -> Result<T>
    where
        A: Send + 'static,
        F: Fn(A) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
    {
        let key = self.key(&arg)?;
        let f = self.f.clone();
        self.client
            .get_or_compute(&key, move || f(arg), self.opts.clone())
            .await
    }

    /// Forget `arg`'s result ([`Client::invalidate`]).
    pub async fn invalidate(&self, arg: &A) -> Result<bool> {
        self.client.invalidate(&self.key(arg)?).await
    }

    /// Ask for `arg`'s result to be recomputed ([`Client::refresh`]).
    pub async fn refresh(&self, arg: &A, stale: Option<Duration>) -> Result<String> {
        self.client.refresh(&self.key(arg)?, stale).await
    }
}

/// Whether `value` reads back as a `T`: see `get_or_compute_checked`.
fn reads_back<T: DeserializeOwned>(value: &Value) -> serde_json::Result<()> {
    T::deserialize(value).map(drop)
}

/// What a compute function can end with, before it is turned into an [`Error`].
pub(crate) enum ComputeError {
    /// The function's error, with the short name of its type (see [`failure_text`]).
    Failed(&'static str, Box<dyn std::error::Error + Send + Sync>),
    Serialize(serde_json::Error),
}

impl ComputeError {
    /// A compute function's error `e`, named after its type `E`.
    pub(crate) fn failed<E>(e: E) -> Self
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        ComputeError::Failed(type_name_of::<E>(), e.into())
    }
}

/// The short name of an error type for rule F2's `Type: message`: the last segment of its
/// path, without generic arguments (`my_app::Upstream` is `Upstream`, `std::io::Error` is
/// `Error`). A type that says nothing of the failure (`String`, `&str`, a `Box<dyn Error>`
/// whose concrete type is gone) is `Error`, as Node writes every error.
pub(crate) fn type_name_of<E>() -> &'static str {
    let full = std::any::type_name::<E>();
    let path = full.split('<').next().unwrap_or(full);
    let short = path
        .rsplit("::")
        .next()
        .unwrap_or(path)
        .trim_start_matches('&');
    match short {
        "" | "str" | "String" | "Box" | "Arc" | "Cow" => "Error",
        short => short,
    }
}

/// The text `fail_key` stores for a compute function's error (rule F2): `Type: message`,
/// or the type alone when the message is empty, as the Python and Node clients write it.
pub(crate) fn failure_text(kind: &str, e: &(dyn std::error::Error + Send + Sync)) -> String {
    let message = e.to_string();
    if message.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}: {message}")
    }
}

pub(crate) type Compute =
    Box<dyn FnOnce() -> BoxFuture<'static, std::result::Result<Value, ComputeError>> + Send>;

impl Inner {
    pub(crate) fn resolve(&self, opts: &CallOptions) -> Result<Resolved> {
        let o = &self.options;
        Ok(Resolved {
            lease: opts.lease.unwrap_or(o.lease),
            wait: opts.wait.unwrap_or(o.wait),
            freshness: freshness(
                opts.ttl.unwrap_or(o.ttl),
                opts.stale.unwrap_or(o.stale),
                opts.beta.unwrap_or(o.beta),
                opts.jitter.unwrap_or(o.jitter),
            )?,
            retry_after: opts.retry_after.unwrap_or(o.retry_after),
        })
    }

    /// Whether a claim refused with `e` should be asked again as another owner (rule R3):
    /// a 22023 naming an owner pid whose LISTEN connection has just died, which the
    /// listener notices within `patience` (it reconnects and gets a new pid).
    pub(crate) async fn owner_died(&self, e: &Error, owner: Owner, patience: Duration) -> bool {
        let (Some(listener), Owner::Session(pid)) = (&self.listener, owner) else {
            return false;
        };
        e.sqlstate() == Some("22023")
            && e.to_string().contains(&format!("pid {pid}"))
            && listener
                .replaced(owner, patience.min(Duration::from_secs(5)))
                .await
    }

    /// C2: the pause of a call told `wait` before it asks again, holding no connection:
    /// until the key's notification arrives on the LISTEN connection (`interest`,
    /// registered before the question, C4), just after the owner's lease runs out
    /// (`lease_expires_at`), a jittered recheck interval, or `deadline`, whichever comes
    /// first. Without a LISTEN connection it polls with jittered backoff (`poll_backoff`,
    /// 50 ms doubling to 1 s).
    pub(crate) async fn pause_while_running(
        &self,
        interest: Option<&mut Interest>,
        lease_expires_at: Option<SystemTime>,
        deadline: Instant,
        poll_backoff: &mut Duration,
    ) {
        let now = Instant::now();
        let mut until = deadline;
        if let Some(expiry) = lease_expires_at {
            let left = expiry
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            until = until.min(now + left + Duration::from_millis(20));
        }
        match interest {
            Some(interest) => {
                until = until.min(now + crate::jitter(self.options.recheck));
                tokio::select! {
                    _ = interest.changed() => {}
                    _ = tokio::time::sleep_until(until.into()) => {}
                }
            }
            None => {
                until = until.min(now + crate::jitter(*poll_backoff));
                *poll_backoff = (*poll_backoff * 2).min(Duration::from_secs(1));
                tokio::time::sleep_until(until.into()).await;
            }
        }
    }

    /// The owner to claim as: the LISTEN connection's pid, or the lease alone.
    pub(crate) async fn owner(&self, patience: Duration) -> Result<Owner> {
        match &self.listener {
            Some(l) => l.owner(patience.max(Duration::from_secs(5))).await,
            None => Ok(Owner::LeaseOnly),
        }
    }
}

/// Rule F7's refusal of `stale` and `beta` against a server older than 0.2.0.
const NO_FRESHNESS_SERVER: &str = "stale and beta need pg_once 0.2.0 or later on the server \
    (ALTER EXTENSION pg_once UPDATE)";

/// `claim_key(key, lease, wait => 0, owner_pid => owner)`, with `serve_stale => true` when
/// the call asks for stale or early-refreshed answers (`stale` or `beta`). Without them
/// the call is the one pg_once 0.1 took, and is answered as it was: it waits for a refresh
/// another caller runs rather than be served the old result.
///
/// F7: `stale` and `beta` need pg_once 0.2.0 on the server. An older one (no
/// `owner_session()`, so claims owned by their connection, or no `serve_stale` argument:
/// 42883) is a configuration error before anything is claimed.
async fn claim(c: &tokio_postgres::Client, key: &str, s: &Resolved, owner: Owner) -> Result<Claim> {
    if s.freshness.stale.is_some() || s.freshness.beta.is_some() {
        let too_old = || Error::Configuration(NO_FRESHNESS_SERVER.into());
        if owner == Owner::Connection {
            return Err(too_old());
        }
        match raw::claim_key_serving_stale(c, key, s.lease, Duration::ZERO, owner).await {
            Err(e) if e.sqlstate() == Some("42883") => Err(too_old()),
            other => other,
        }
    } else {
        raw::claim_key(c, key, s.lease, Duration::ZERO, owner).await
    }
}

/// Claim, wait or read `key` until it has an outcome (this runs once per key per process).
/// X2: every caller stopped waiting while this process held the claim: give it back, so
/// that another caller, here or elsewhere, computes the key at once.
async fn release_abandoned(inner: &Inner, key: &str, token: i64) {
    match with_conn!(inner, |c| raw::release_key(c, key, token)) {
        Ok(_) => tracing::debug!(
            key,
            "pg_once: every caller stopped waiting; the claim was released"
        ),
        Err(e) => {
            tracing::warn!(key, error = %e, "pg_once: could not release an abandoned claim; it ends with its lease")
        }
    }
}

/// `claimed` is where the token of a claim this call makes is kept, for the claim to be
/// given back if every caller stops waiting (see `get_or_compute_checked`).
async fn resolve(
    inner: &Arc<Inner>,
    key: &str,
    compute: Compute,
    s: &Resolved,
    claimed: &Mutex<Option<i64>>,
) -> Result<(Value, Outcome)> {
    let started = Instant::now();
    let mut waited = false;
    let deadline = started + s.wait;
    let mut poll_backoff = Duration::from_millis(50);
    let mut compute = Some(compute);
    loop {
        // Interest first, then the question: a completion in between still wakes us.
        let mut interest: Option<Interest> = inner.listener.as_ref().map(|l| l.interest(key));
        let owner = inner
            .owner(deadline.saturating_duration_since(Instant::now()))
            .await?;
        let claim = match with_conn!(inner, until deadline, |c| claim(c, key, s, owner)) {
            Ok(claim) => claim,
            Err(e) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if inner.owner_died(&e, owner, left).await {
                    continue;
                }
                return Err(e);
            }
        };
        match claim.outcome.as_str() {
            // `stale`: the previous result, while another caller refreshes it; answered at
            // once, never waited on.
            "hit" | "stale" => {
                let outcome = match (claim.outcome.as_str(), waited) {
                    ("stale", _) => Outcome::Stale,
                    (_, true) => Outcome::Waited,
                    _ => Outcome::Hit,
                };
                return Ok((claim.result.unwrap_or(Value::Null), outcome));
            }
            "refresh" => {
                drop(interest);
                let token = claim
                    .token
                    .ok_or_else(|| Error::Protocol("a refresh without a token".into()))?;
                let compute = compute
                    .take()
                    .expect("a key is claimed at most once per call");
                return match claim.result {
                    // Serve the previous result now; recompute in the background.
                    Some(previous) => {
                        let run = {
                            let (inner, key, s) = (inner.clone(), key.to_owned(), s.clone());
                            async move { run_claimed(&inner, &key, token, compute, &s).await }
                                .boxed()
                        };
                        refresh::start(inner, key, token, run).await;
                        Ok((previous, Outcome::Refresh))
                    }
                    // Nothing to serve meanwhile: compute now, as for `claimed`.
                    None => {
                        *claimed.lock().unwrap() = Some(token);
                        let value = run_claimed(inner, key, token, compute, s).await?;
                        Ok((value, Outcome::Claimed))
                    }
                };
            }
            "failed" => {
                return Err(Error::Failed {
                    key: key.to_owned(),
                    message: claim.error.unwrap_or_default(),
                    retry_at: claim.retry_at,
                })
            }
            "claimed" => {
                drop(interest);
                let token = claim
                    .token
                    .ok_or_else(|| Error::Protocol("a claim without a token".into()))?;
                let compute = compute
                    .take()
                    .expect("a key is claimed at most once per call");
                *claimed.lock().unwrap() = Some(token);
                let value = run_claimed(inner, key, token, compute, s).await?;
                return Ok((value, Outcome::Claimed));
            }
            "wait" => {
                waited = true;
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        key: key.to_owned(),
                        waited: started.elapsed(),
                    });
                }
                inner
                    .pause_while_running(
                        interest.as_mut(),
                        claim.lease_expires_at,
                        deadline,
                        &mut poll_backoff,
                    )
                    .await;
            }
            other => return Err(Error::Protocol(format!("claim_key outcome {other:?}"))),
        }
    }
}

/// How a claimed computation ended.
pub(crate) enum Ran {
    Done(std::result::Result<Value, ComputeError>),
    /// heartbeat_key said the claim was lost: the computation was stopped.
    Lost,
}

/// Run `compute` while heartbeating the claim every `lease / 3`. A panic counts as an error.
pub(crate) async fn compute_with_heartbeat(
    inner: &Inner,
    key: &str,
    token: i64,
    lease: Duration,
    compute: BoxFuture<'static, std::result::Result<Value, ComputeError>>,
) -> Ran {
    let work = AssertUnwindSafe(compute).catch_unwind().map(|r| match r {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(ComputeError::Failed(
                "panic",
                format!("the compute function panicked: {what}").into(),
            ))
        }
    });
    let heartbeats = heartbeat_until_lost(key, lease, || async move {
        with_conn!(inner, |c| raw::heartbeat_key(c, key, token, lease)).map(|a| a.is_some())
    });
    tokio::select! {
        done = work => Ran::Done(done),
        () = heartbeats => Ran::Lost,
    }
}

/// Heartbeat a claim with `beat` (true: extended, false: the claim is lost) every
/// `lease / 3` (H1) until a beat says it is lost (H3), the only way this returns.
///
/// H2: after a failed beat, the next comes within a second (`lease / 6` when shorter), not
/// a full third of the lease later, so that two blips in a row do not lose the claim.
pub(crate) async fn heartbeat_until_lost<F, Fut>(key: &str, lease: Duration, mut beat: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let every = lease / 3;
    let after_failure = every.min(Duration::from_secs(1)).min(lease / 6);
    let mut next = every;
    loop {
        tokio::time::sleep(next).await;
        match beat().await {
            Ok(true) => next = every,
            Ok(false) => return,
            Err(e) => {
                tracing::warn!(key, error = %e, "pg_once: a heartbeat failed; retrying");
                next = after_failure;
            }
        }
    }
}

/// This process holds the claim: compute, then complete or fail the key.
pub(crate) async fn run_claimed(
    inner: &Inner,
    key: &str,
    token: i64,
    compute: Compute,
    s: &Resolved,
) -> Result<Value> {
    let lost = || Error::ClaimLost {
        key: key.to_owned(),
    };
    let (error, fail_with) =
        match compute_with_heartbeat(inner, key, token, s.lease, compute()).await {
            Ran::Lost => return Err(lost()),
            Ran::Done(Ok(value)) => {
                let stored = with_conn!(inner, |c| raw::complete_key_with(
                    c,
                    key,
                    token,
                    &value,
                    &s.freshness
                ));
                match stored {
                    Ok(true) => return Ok(as_stored(value)),
                    Ok(false) => return Err(lost()),
                    // F3: the server refused the result (54000: too large, say). Fail the key
                    // with the refusal, so that waiters share it rather than each compute a
                    // result that would be refused again.
                    Err(e) if !e.is_connection_error() => {
                        let message = e.refusal_text();
                        (e, message)
                    }
                    // L4: no server answered within the budget (R2), which a release would
                    // only spend again: the caller gets the connection error, and the claim
                    // ends with its owner or its lease, as in the other clients.
                    Err(e) => return Err(e),
                }
            }
            Ran::Done(Err(ComputeError::Failed(kind, source))) => {
                let message = failure_text(kind, &*source);
                let error = Error::Compute {
                    key: key.to_owned(),
                    source: Arc::from(source),
                };
                (error, message)
            }
            // V4: nothing can be cached. Fail the key with the reason rather than release it:
            // released, every waiter would claim it in turn and fail the same way.
            Ran::Done(Err(ComputeError::Serialize(e))) => {
                let message = format!("the result is not JSON-serialisable: {e}");
                let error = Error::NotSerializable {
                    key: key.to_owned(),
                    reason: e.to_string(),
                };
                (error, message)
            }
        };
    // F4: the caller gets its own error, whatever becomes of fail_key.
    match with_conn!(inner, |c| raw::fail_key(
        c,
        key,
        token,
        &fail_with,
        s.retry_after
    )) {
        Ok(true) => {}
        Ok(false) => tracing::info!(
            key,
            "pg_once: the claim was lost before its failure was stored"
        ),
        Err(e) => {
            tracing::warn!(key, error = %e, "pg_once: could not fail the key; its claim ends with its lease")
        }
    }
    Err(error)
}

#[cfg(test)]
mod tests {
    use super::{failure_text, type_name_of};

    #[derive(Debug)]
    struct Upstream;
    impl std::fmt::Display for Upstream {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("the upstream said 503")
        }
    }
    impl std::error::Error for Upstream {}

    #[test]
    fn a_compute_error_is_stored_as_type_colon_message() {
        // F2: `Type: message`, the type named as a reader knows it.
        let text =
            |kind: &str, e: Box<dyn std::error::Error + Send + Sync>| failure_text(kind, &*e);
        assert_eq!(
            text(type_name_of::<Upstream>(), Box::new(Upstream)),
            "Upstream: the upstream said 503"
        );
        assert_eq!(
            text(
                type_name_of::<std::io::Error>(),
                std::io::Error::other("boom").into()
            ),
            "Error: boom"
        );
        assert_eq!(text(type_name_of::<&str>(), "boom".into()), "Error: boom");
        assert_eq!(
            text(type_name_of::<String>(), String::new().into()),
            "Error"
        );
        assert_eq!(
            type_name_of::<Box<dyn std::error::Error + Send + Sync>>(),
            "Error"
        );
    }

    /// H2: with a lease of 30 s the first beat comes at 10 s; when it fails, the next comes
    /// 1 s later, not at 20 s, and beats go back to every 10 s once one succeeds.
    #[tokio::test(start_paused = true)]
    async fn a_failed_heartbeat_is_retried_within_a_second() {
        use std::sync::{Arc, Mutex};
        use std::time::Duration;
        let start = tokio::time::Instant::now();
        let beats = Arc::new(Mutex::new(Vec::new()));
        let seen = beats.clone();
        super::heartbeat_until_lost("k", Duration::from_secs(30), move || {
            let seen = seen.clone();
            async move {
                let mut seen = seen.lock().unwrap();
                seen.push(start.elapsed());
                match seen.len() {
                    1 => Err(crate::Error::Listener("a blip".into())),
                    2 | 3 => Ok(true),
                    _ => Ok(false),
                }
            }
        })
        .await;
        let beats = beats.lock().unwrap().clone();
        let secs: Vec<u64> = beats.iter().map(|d| d.as_secs()).collect();
        assert_eq!(secs, [10, 11, 21, 31], "{beats:?}");
    }
}
