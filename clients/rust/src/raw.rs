//! One function per pg_once SQL call, on any `tokio_postgres::Client` (a deadpool
//! `Object` derefs to one).
//!
//! These are the building blocks of [`crate::Client`], for code that manages its own
//! connections. Each call is one unnamed statement in autocommit
//! ([`tokio_postgres::Client::query_typed`]): nothing is prepared under a name, so they
//! work through PgBouncer in transaction mode. Intervals are passed as seconds.

use crate::error::Result;
use serde_json::Value;
use std::time::{Duration, SystemTime};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

/// Who a claim belongs to, besides its lease: the `owner_pid` argument of `claim_key` and
/// `claim_next`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Owner {
    /// `owner_pid => NULL` (the argument is left out): the server connection making the
    /// call. Right for a direct connection that lives as long as the process; wrong
    /// behind a transaction pooler, whose server connections belong to nobody.
    #[default]
    Connection,
    /// `owner_pid => 0`: the lease alone ends the claim (no liveness check).
    LeaseOnly,
    /// `owner_pid => pid`: the connection that called `once.owner_session()` and got `pid`;
    /// the claim ends when it does.
    Session(i32),
}

impl Owner {
    fn pid(self) -> Option<i32> {
        match self {
            Owner::Connection => None,
            Owner::LeaseOnly => Some(0),
            Owner::Session(pid) => Some(pid),
        }
    }
}

/// What `once.claim_key` returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// `hit`, `claimed`, `failed` or `wait`; with `serve_stale` (see
    /// [`claim_key_serving_stale`]) also `refresh` and `stale`.
    pub outcome: String,
    /// `claimed` / `refresh`: your fencing token; `wait`: the owner's; `stale`: the
    /// refresher's, when one is running.
    pub token: Option<i64>,
    /// `hit`: the cached result; `refresh` / `stale`: the previous result, to serve while
    /// the key is recomputed.
    pub result: Option<Value>,
    /// `failed`: the error of the last attempt; `stale`: the error of the last refresh,
    /// when it failed (the previous result is served anyway: stale-if-error).
    pub error: Option<String>,
    /// `claimed` / `refresh` / `wait`, and `stale` while a refresh runs: who owns the key.
    pub owner: Option<String>,
    /// `claimed` / `refresh` / `wait`, and `stale` while a refresh runs: when the current
    /// claim's lease runs out.
    pub lease_expires_at: Option<SystemTime>,
    /// How many claims the key has had since its last result.
    pub attempts: Option<i32>,
    /// `failed`: when the key may be computed again.
    pub retry_at: Option<SystemTime>,
    /// `hit` / `refresh` / `stale`: when the result expires (None: until invalidated). For
    /// `stale` it is past; for `refresh` it is past, or future when the hit drew an early
    /// (XFetch) refresh.
    pub expires_at: Option<SystemTime>,
}

impl Claim {
    /// Whether the outcome is `outcome` (`"hit"`, `"claimed"`, `"failed"`, `"wait"`,
    /// `"refresh"`, `"stale"`).
    pub fn is(&self, outcome: &str) -> bool {
        self.outcome == outcome
    }
}

/// How long a stored result stays fresh and servable: the arguments of `complete_key` and
/// `complete_keys` after the result. `Freshness::default()` caches until invalidated.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Freshness {
    /// Fresh for this long (None: until invalidated). `stale`, `beta` and `jitter` need it.
    pub ttl: Option<Duration>,
    /// After `ttl`, the result stays servable for this much longer: claims with
    /// `serve_stale` get it as `stale` while one of them (`refresh`) recomputes.
    pub stale: Option<Duration>,
    /// XFetch early-refresh factor, 0 < beta <= 100 (None: no early refresh): a hit may
    /// be answered `refresh` before `ttl` ends, the likelier the closer the expiry and the
    /// longer the last computation took (the server measures it).
    pub beta: Option<f64>,
    /// 0 <= jitter < 1: the `ttl` used is `ttl * (1 - jitter * random())`, so that keys
    /// filled together do not expire together.
    pub jitter: Option<f64>,
}

impl Freshness {
    /// Fresh for `ttl` (None: until invalidated), then gone: what `complete_key` did
    /// before 0.2.
    pub fn ttl(ttl: Option<Duration>) -> Freshness {
        Freshness {
            ttl,
            ..Freshness::default()
        }
    }
}

/// A key handed out by `once.claim_next`.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub key: String,
    pub token: i64,
    pub payload: Option<Value>,
    pub attempt: i32,
}

/// What `once.reap_stale` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    pub reclaimed: i64,
    pub expired: i64,
    pub history: i64,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

async fn one(client: &Client, sql: &str, params: &[(&(dyn ToSql + Sync), Type)]) -> Result<Row> {
    Ok(client.query_typed_one(sql, params).await?)
}

/// A call's SQL and parameters, built one argument at a time, so that an optional argument
/// left at its default is left out of the SQL: a call that uses none of the arguments a
/// release added also works on servers that predate it.
struct Call<'a> {
    sql: String,
    params: Vec<(&'a (dyn ToSql + Sync), Type)>,
}

impl<'a> Call<'a> {
    /// `head` is the statement up to the function's opening parenthesis, e.g.
    /// `SELECT once.complete_key(`; the arguments and the closing parenthesis follow.
    fn new(head: &str) -> Self {
        Call {
            sql: head.to_owned(),
            params: Vec::new(),
        }
    }

    /// The next argument: positional, or `name => ...`. `placeholder` is how the
    /// parameter appears in the SQL, `$` standing for its number (e.g. `make_interval(secs
    /// => $)` for an interval passed as seconds).
    fn arg(
        &mut self,
        name: Option<&str>,
        placeholder: &str,
        value: &'a (dyn ToSql + Sync),
        ty: Type,
    ) -> &mut Self {
        self.params.push((value, ty));
        if self.params.len() > 1 {
            self.sql.push_str(", ");
        }
        if let Some(name) = name {
            self.sql.push_str(name);
            self.sql.push_str(" => ");
        }
        let number = format!("${}", self.params.len());
        self.sql.push_str(&placeholder.replace('$', &number));
        self
    }

    /// A positional argument.
    fn value(&mut self, value: &'a (dyn ToSql + Sync), ty: Type) -> &mut Self {
        self.arg(None, "$", value, ty)
    }

    /// A positional interval, given in seconds (None: NULL).
    fn interval(&mut self, secs: &'a Option<f64>) -> &mut Self {
        self.arg(None, INTERVAL, secs, Type::FLOAT8)
    }

    /// `name => value`, left out when None (the server's default applies).
    fn named<T: ToSql + Sync>(&mut self, name: &str, value: &'a Option<T>, ty: Type) -> &mut Self {
        match value {
            Some(value) => self.arg(Some(name), "$", value, ty),
            None => self,
        }
    }

    /// `name => interval`, given in seconds, left out when None.
    fn named_interval(&mut self, name: &str, secs: &'a Option<f64>) -> &mut Self {
        match secs {
            Some(secs) => self.arg(Some(name), INTERVAL, secs, Type::FLOAT8),
            None => self,
        }
    }

    fn sql(&self) -> String {
        format!("{})", self.sql)
    }

    async fn one(&self, client: &Client) -> Result<Row> {
        one(client, &self.sql(), &self.params).await
    }

    async fn rows(&self, client: &Client) -> Result<Vec<Row>> {
        Ok(client.query_typed(&self.sql(), &self.params).await?)
    }
}

/// An interval parameter passed as seconds (float8), so that no interval type is needed
/// on the client side.
const INTERVAL: &str = "make_interval(secs => $)";

/// `once.claim_key(key, lease, wait, owner_pid)`. `Owner::Connection` leaves `owner_pid`
/// out, so that form also works on servers that predate it.
///
/// `serve_stale` is left out (false): a key being refreshed is answered `wait`, and the
/// caller that draws the refresh `claimed` (with the previous result in `result`). See
/// [`claim_key_serving_stale`].
pub async fn claim_key(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
) -> Result<Claim> {
    claim(client, key, lease, wait, owner, false).await
}

/// `once.claim_key(key, lease, wait, owner_pid, serve_stale => true)` (pg_once 0.2): as
/// [`claim_key`], with two more outcomes for keys completed with a stale window or an
/// early-refresh factor ([`Freshness`]): `refresh` (you own the key, as for `claimed`, and
/// `result` is the previous result, to serve while you recompute) and `stale` (`result`
/// is the previous result, answered at once even with `wait`, while someone else
/// refreshes it).
pub async fn claim_key_serving_stale(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
) -> Result<Claim> {
    claim(client, key, lease, wait, owner, true).await
}

/// `once.claim_key(key, lease, wait, owner_pid, fingerprint => fingerprint)` (pg_once
/// 0.3): as [`claim_key`], for a key that stands for one request (an `Idempotency-Key`):
/// the claim that takes the key stores `fingerprint` (1 to 64 bytes, a digest of the
/// request), and a call with another fingerprint while the key runs or its result is
/// served is answered `mismatch`, changing nothing. None leaves the argument out.
pub async fn claim_key_fingerprinted(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
    fingerprint: Option<&[u8]>,
) -> Result<Claim> {
    claim_with(client, key, lease, wait, owner, false, fingerprint, false).await
}

/// [`claim_key_fingerprinted`] for the HTTP layer, which judges every stored result it
/// reads (I6): a result serde_json cannot decode (nested past its 128 levels, where jsonb
/// takes thousands: none a client wrote) comes back as the JSON string
/// [`UNDECODABLE_RESULT`], which the layer refuses as an untrusted entry, instead of an
/// error that would read as the store being unavailable.
#[cfg(feature = "http")]
pub(crate) async fn claim_request_key(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
    fingerprint: Option<&[u8]>,
) -> Result<Claim> {
    claim_with(client, key, lease, wait, owner, false, fingerprint, true).await
}

/// What [`claim_request_key`] gives for a stored result that does not decode.
pub(crate) const UNDECODABLE_RESULT: &str = "pg_once: a stored result that does not decode";

async fn claim(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
    serve_stale: bool,
) -> Result<Claim> {
    claim_with(client, key, lease, wait, owner, serve_stale, None, false).await
}

#[allow(clippy::too_many_arguments)] // one private helper behind three public calls
async fn claim_with(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
    serve_stale: bool,
    fingerprint: Option<&[u8]>,
    undecodable_as_marker: bool,
) -> Result<Claim> {
    let (lease, wait, pid) = (Some(secs(lease)), Some(secs(wait)), owner.pid());
    let serve_stale = serve_stale.then_some(true);
    let row = Call::new(
        "SELECT outcome, token, result, error, owner, lease_expires_at, attempts, retry_at, \
         expires_at FROM once.claim_key(",
    )
    .value(&key, Type::TEXT)
    .interval(&lease)
    .interval(&wait)
    .named("owner_pid", &pid, Type::INT4)
    .named("serve_stale", &serve_stale, Type::BOOL)
    .named("fingerprint", &fingerprint, Type::BYTEA)
    .one(client)
    .await?;
    Ok(Claim {
        outcome: row.try_get(0)?,
        token: row.try_get(1)?,
        result: match row.try_get(2) {
            Ok(result) => result,
            Err(_) if undecodable_as_marker => Some(Value::String(UNDECODABLE_RESULT.into())),
            Err(e) => return Err(e.into()),
        },
        error: row.try_get(3)?,
        owner: row.try_get(4)?,
        lease_expires_at: row.try_get(5)?,
        attempts: row.try_get(6)?,
        retry_at: row.try_get(7)?,
        expires_at: row.try_get(8)?,
    })
}

/// `once.complete_key(key, token, result, ttl)`: false if the claim was lost.
pub async fn complete_key(
    client: &Client,
    key: &str,
    token: i64,
    result: &Value,
    ttl: Option<Duration>,
) -> Result<bool> {
    complete_key_with(client, key, token, result, &Freshness::ttl(ttl)).await
}

/// `once.complete_key(key, token, result, ttl, stale, beta, jitter)`: false if the claim
/// was lost. The options left at None are left out of the call (pg_once 0.2 added them).
pub async fn complete_key_with(
    client: &Client,
    key: &str,
    token: i64,
    result: &Value,
    freshness: &Freshness,
) -> Result<bool> {
    complete_key_in(client, key, token, result, freshness).await
}

/// [`complete_key_with`] on any connection or transaction
/// ([`tokio_postgres::GenericClient`]): run inside the caller's own transaction, the
/// result is stored (and announced) only if that transaction commits, together with its
/// other writes. False if the claim was lost.
pub async fn complete_key_in<C>(
    client: &C,
    key: &str,
    token: i64,
    result: &Value,
    freshness: &Freshness,
) -> Result<bool>
where
    C: tokio_postgres::GenericClient + Sync,
{
    let f = FreshnessArgs::from(freshness);
    let mut call = Call::new("SELECT once.complete_key(");
    call.value(&key, Type::TEXT)
        .value(&token, Type::INT8)
        .value(result, Type::JSONB)
        .interval(&f.ttl);
    f.add_to(&mut call);
    let row = client.query_typed_one(&call.sql(), &call.params).await?;
    Ok(row.try_get(0)?)
}

/// [`Freshness`] as the SQL arguments carry it (intervals in seconds).
struct FreshnessArgs {
    ttl: Option<f64>,
    stale: Option<f64>,
    beta: Option<f64>,
    jitter: Option<f64>,
}

impl From<&Freshness> for FreshnessArgs {
    fn from(f: &Freshness) -> Self {
        FreshnessArgs {
            ttl: f.ttl.map(secs),
            stale: f.stale.map(secs),
            beta: f.beta,
            jitter: f.jitter,
        }
    }
}

impl FreshnessArgs {
    /// `stale`, `beta` and `jitter`, those that are set (`ttl` is positional).
    fn add_to<'a>(&'a self, call: &mut Call<'a>) {
        call.named_interval("stale", &self.stale)
            .named("beta", &self.beta, Type::FLOAT8)
            .named("jitter", &self.jitter, Type::FLOAT8);
    }
}

/// `once.fail_key(key, token, error, retry_after)`: false if the claim was lost.
pub async fn fail_key(
    client: &Client,
    key: &str,
    token: i64,
    error: &str,
    retry_after: Duration,
) -> Result<bool> {
    let row = one(
        client,
        "SELECT once.fail_key($1, $2, $3, make_interval(secs => $4))",
        &[
            (&key, Type::TEXT),
            (&token, Type::INT8),
            (&error, Type::TEXT),
            (&secs(retry_after), Type::FLOAT8),
        ],
    )
    .await?;
    Ok(row.try_get(0)?)
}

/// `once.heartbeat_key(key, token, lease)`: the new expiry, or None if the claim was lost.
pub async fn heartbeat_key(
    client: &Client,
    key: &str,
    token: i64,
    lease: Duration,
) -> Result<Option<SystemTime>> {
    let row = one(
        client,
        "SELECT once.heartbeat_key($1, $2, make_interval(secs => $3))",
        &[
            (&key, Type::TEXT),
            (&token, Type::INT8),
            (&secs(lease), Type::FLOAT8),
        ],
    )
    .await?;
    Ok(row.try_get(0)?)
}

/// `once.release_key(key, token)`: give the claim back unfailed; false if it was lost.
pub async fn release_key(client: &Client, key: &str, token: i64) -> Result<bool> {
    let row = one(
        client,
        "SELECT once.release_key($1, $2)",
        &[(&key, Type::TEXT), (&token, Type::INT8)],
    )
    .await?;
    Ok(row.try_get(0)?)
}

/// `once.invalidate_key(key)`: false if the key was absent. A key being computed is not
/// dropped (pg_once 0.2): it is recomputed once more after the current run, whose result
/// is not served (as `refresh_key` without `stale`).
pub async fn invalidate_key(client: &Client, key: &str) -> Result<bool> {
    let row = one(
        client,
        "SELECT once.invalidate_key($1)",
        &[(&key, Type::TEXT)],
    )
    .await?;
    Ok(row.try_get(0)?)
}

/// `once.reap_stale()`.
pub async fn reap_stale(client: &Client) -> Result<Reaped> {
    let row = one(
        client,
        "SELECT reclaimed, expired, history FROM once.reap_stale()",
        &[],
    )
    .await?;
    Ok(Reaped {
        reclaimed: row.try_get(0)?,
        expired: row.try_get(1)?,
        history: row.try_get(2)?,
    })
}

/// `once.owner_session()`: name this connection as the owner of the claims made with
/// `Owner::Session(pid)`; returns its backend pid. Call it on a direct or session-pooled
/// connection that lives as long as the process.
pub async fn owner_session(client: &Client) -> Result<i32> {
    Ok(one(client, "SELECT once.owner_session()", &[])
        .await?
        .try_get(0)?)
}

/// `once.create_queue(name, max_attempts, backoff, max_backoff)`.
pub async fn create_queue(
    client: &Client,
    name: &str,
    max_attempts: i32,
    backoff: Duration,
    max_backoff: Duration,
) -> Result<()> {
    one(
        client,
        "SELECT once.create_queue($1, $2, make_interval(secs => $3), make_interval(secs => $4))::text",
        &[
            (&name, Type::TEXT),
            (&max_attempts, Type::INT4),
            (&secs(backoff), Type::FLOAT8),
            (&secs(max_backoff), Type::FLOAT8),
        ],
    )
    .await?;
    Ok(())
}

/// `once.drop_queue(name)`.
pub async fn drop_queue(client: &Client, name: &str) -> Result<()> {
    one(
        client,
        "SELECT once.drop_queue($1)::text",
        &[(&name, Type::TEXT)],
    )
    .await?;
    Ok(())
}

/// `once.enqueue_key(key, payload, queue, priority)`: `queued`, `requeued`, `duplicate`
/// or `cached`.
pub async fn enqueue_key(
    client: &Client,
    key: &str,
    payload: Option<&Value>,
    queue: &str,
    priority: i32,
) -> Result<String> {
    let row = one(
        client,
        "SELECT once.enqueue_key($1, $2, $3, $4)",
        &[
            (&key, Type::TEXT),
            (&payload, Type::JSONB),
            (&queue, Type::TEXT),
            (&priority, Type::INT4),
        ],
    )
    .await?;
    Ok(row.try_get(0)?)
}

/// `once.enqueue_keys(keys, payloads, queue, priority)` (pg_once 0.2): `enqueue_key` for
/// every `(key, payload)` of `jobs` in one statement; each key with its outcome, in the
/// order given. At most 1,000 distinct keys (22023 otherwise).
pub async fn enqueue_keys(
    client: &Client,
    jobs: &[(&str, Option<&Value>)],
    queue: &str,
    priority: i32,
) -> Result<Vec<(String, String)>> {
    let keys: Vec<&str> = jobs.iter().map(|(k, _)| *k).collect();
    let payloads: Vec<Option<&Value>> = jobs.iter().map(|(_, p)| *p).collect();
    client
        .query_typed(
            "SELECT key, outcome FROM once.enqueue_keys($1, $2, $3, $4)",
            &[
                (&keys, Type::TEXT_ARRAY),
                (&payloads, Type::JSONB_ARRAY),
                (&queue, Type::TEXT),
                (&priority, Type::INT4),
            ],
        )
        .await?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect()
}

/// `once.claim_next(queue, lease, worker, n, wait, owner_pid)`: up to `n` due keys. A zero
/// `wait` and `Owner::Connection` leave those arguments out (servers that predate them).
pub async fn claim_next(
    client: &Client,
    queue: &str,
    lease: Duration,
    worker: Option<&str>,
    n: i32,
    wait: Duration,
    owner: Owner,
) -> Result<Vec<Job>> {
    let lease = Some(secs(lease));
    let wait = (!wait.is_zero()).then(|| secs(wait));
    let pid = owner.pid();
    Call::new("SELECT key, token, payload, attempt FROM once.claim_next(")
        .value(&queue, Type::TEXT)
        .interval(&lease)
        .value(&worker, Type::TEXT)
        .value(&n, Type::INT4)
        .named_interval("wait", &wait)
        .named("owner_pid", &pid, Type::INT4)
        .rows(client)
        .await?
        .iter()
        .map(|row| {
            Ok(Job {
                key: row.try_get(0)?,
                token: row.try_get(1)?,
                payload: row.try_get(2)?,
                attempt: row.try_get(3)?,
            })
        })
        .collect()
}

/// `once.complete_keys(keys, tokens, results, ttl)`: the keys that were completed.
pub async fn complete_keys(
    client: &Client,
    keys: &[&str],
    tokens: &[i64],
    results: &[Value],
    ttl: Option<Duration>,
) -> Result<Vec<String>> {
    complete_keys_with(client, keys, tokens, results, &Freshness::ttl(ttl)).await
}

/// `once.complete_keys(keys, tokens, results, ttl, stale, beta, jitter)`: the keys that
/// were completed. The options left at None are left out of the call (pg_once 0.2 added
/// them).
pub async fn complete_keys_with(
    client: &Client,
    keys: &[&str],
    tokens: &[i64],
    results: &[Value],
    freshness: &Freshness,
) -> Result<Vec<String>> {
    let f = FreshnessArgs::from(freshness);
    let mut call = Call::new("SELECT key FROM once.complete_keys(");
    call.value(&keys, Type::TEXT_ARRAY)
        .value(&tokens, Type::INT8_ARRAY)
        .value(&results, Type::JSONB_ARRAY)
        .interval(&f.ttl);
    f.add_to(&mut call);
    call.rows(client)
        .await?
        .iter()
        .map(|row| Ok(row.try_get(0)?))
        .collect()
}

/// `once.refresh_key(key, stale)` (pg_once 0.2): ask for a recompute of `key` without ever
/// starting a second concurrent one. Returns `absent` (no such key: the next claim
/// computes it), `expired` (its result or failure expires now; with `stale`, the result is
/// served as stale for that long while one caller refreshes), `rerun` (it is being
/// computed: once that run ends, its result is stored already expired, served as stale for
/// `stale` if given, and the key is computed exactly once more) or `pending` (queued: it
/// runs anyway).
pub async fn refresh_key(client: &Client, key: &str, stale: Option<Duration>) -> Result<String> {
    let stale = stale.map(secs);
    let mut call = Call::new("SELECT once.refresh_key(");
    call.value(&key, Type::TEXT).named_interval("stale", &stale);
    Ok(call.one(client).await?.try_get(0)?)
}

/// The arguments of `once.cached` besides the key and the query; None leaves one at the
/// server's default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CachedSql {
    /// `ttl`, `stale`, `beta`, `jitter`: as for `complete_key`.
    pub freshness: Freshness,
    /// How long to wait for another caller's computation (server default 30 s). The call
    /// holds its connection while it waits.
    pub wait: Option<Duration>,
    /// Lease of the computation (server default 5 min).
    pub lease: Option<Duration>,
}

/// `once.cached(key, query, ttl, stale, beta, jitter, wait, lease)` (pg_once 0.2): the
/// cached rows of `query` (a JSON array of one object per row), or run it as the calling
/// role, in the calling transaction, store them and return them. Other callers wait for
/// the first (at most `wait`, in the call, holding their connection) or, within `stale`,
/// get the previous rows. A query that fails raises its error and records nothing.
pub async fn cached(client: &Client, key: &str, query: &str, options: &CachedSql) -> Result<Value> {
    let f = FreshnessArgs::from(&options.freshness);
    let wait = options.wait.map(secs);
    let lease = options.lease.map(secs);
    let mut call = Call::new("SELECT once.cached(");
    call.value(&key, Type::TEXT)
        .value(&query, Type::TEXT)
        .named_interval("ttl", &f.ttl);
    f.add_to(&mut call);
    call.named_interval("wait", &wait)
        .named_interval("lease", &lease);
    Ok(call.one(client).await?.try_get(0)?)
}

/// `once.invalidate_keys(queue, prefix)`: how many keys were forgotten.
pub async fn invalidate_keys(
    client: &Client,
    queue: Option<&str>,
    prefix: Option<&str>,
) -> Result<i64> {
    let row = one(
        client,
        "SELECT once.invalidate_keys($1, $2)",
        &[(&queue, Type::TEXT), (&prefix, Type::TEXT)],
    )
    .await?;
    Ok(row.try_get(0)?)
}
