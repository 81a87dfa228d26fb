//! [`Client`]: get a key's cached result or compute it once across every process, through
//! a connection pool.

use crate::claim_task::release_abandoned;
use crate::coalesce::InFlightKeys;
use crate::conninfo::Conninfo;
use crate::error::{Error, Result};
use crate::inner::Inner;
use crate::key;
use crate::listener::Listener;
use crate::options::{CallOptions, Options, Resolved};
use crate::outcome::{Outcome, OutcomeEvent};
use crate::raw;
use crate::refresh::Refreshes;
use crate::run::{resolve, Compute, ComputeError};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use futures_util::future::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;

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
    /// Keys this process is resolving right now, so concurrent calls make one claim.
    inflight: Arc<InFlightKeys>,
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
            refreshes: Refreshes::default(),
        });
        Ok(Client {
            _last: Arc::new(LastClone(inner.clone())),
            inflight: Arc::default(),
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
        let started = Instant::now();
        let span = tracing::info_span!(
            "pg_once.get_or_compute",
            pg_once.key = key,
            pg_once.outcome = tracing::field::Empty
        );
        let compute: Compute = Box::new(move || {
            async move {
                let value = compute().await.map_err(ComputeError::failed)?;
                let value = serde_json::to_value(value).map_err(ComputeError::Serialize)?;
                readback(&value).map_err(ComputeError::Serialize)?;
                Ok(value)
            }
            .boxed()
        });
        let deadline = started + settings.wait;
        let mut compute = Some(compute);
        let (answer, coalesced) = loop {
            // A caller that leads the key's resolution gives it what is left of its wait.
            let leading = Resolved {
                wait: deadline.saturating_duration_since(Instant::now()),
                ..settings.clone()
            };
            let joined = self.inflight.join_or_start(key, &span, |mut abandoned| {
                let (inner, key) = (self.inner.clone(), key.to_owned());
                let compute = compute
                    .take()
                    .expect("a caller leads one resolution at most");
                let compute_span = tracing::info_span!(parent: &span, "pg_once.resolve");
                // Once every caller has stopped, the claim is given back rather than
                // computed for nobody. Biased, so that once they have, nothing more of the
                // resolution runs: a claim's answer that comes after they left does not
                // start the computation (its claim is released, see `claim_task`).
                async move {
                    let claimed = Mutex::new(None);
                    tokio::select! {
                        biased;
                        _ = async { drop(abandoned.wait_for(|gone| *gone).await) } => {
                            let token = claimed.lock().unwrap().take();
                            if let Some(token) = token {
                                release_abandoned(&inner, &key, token).await;
                            }
                            Err(Error::Cancelled { key })
                        }
                        result = resolve(&inner, &key, compute, &leading, &claimed)
                            .instrument(compute_span) => result,
                    }
                }
            });
            let answer = joined.answer.clone().instrument(span.clone());
            if !joined.coalesced {
                break (answer.await, false);
            }
            // X1: a caller that joined another's computation keeps its own bound.
            match tokio::time::timeout_at(deadline.into(), answer).await {
                Err(_) => {
                    let waited = started.elapsed();
                    let key = key.to_owned();
                    break (Err(Error::Timeout { key, waited }), true);
                }
                // The resolution ran out of the wait of the caller that led it, not of
                // this one's (X1): ask again, for what is left of this caller's wait.
                Ok(Err(Error::Timeout { .. })) if Instant::now() < deadline => continue,
                Ok(answer) => break (answer, true),
            }
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
