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
    /// `hit`, `claimed`, `failed` or `wait`.
    pub outcome: String,
    /// `claimed`: your fencing token; `wait`: the owner's.
    pub token: Option<i64>,
    /// `hit`: the cached result.
    pub result: Option<Value>,
    /// `failed`: the error of the last attempt.
    pub error: Option<String>,
    /// `wait`: who owns the key.
    pub owner: Option<String>,
    /// `claimed` / `wait`: when the current claim's lease runs out.
    pub lease_expires_at: Option<SystemTime>,
    /// How many claims the key has had since its last result.
    pub attempts: Option<i32>,
    /// `failed`: when the key may be computed again.
    pub retry_at: Option<SystemTime>,
    /// `hit`: when the result expires (None: until invalidated).
    pub expires_at: Option<SystemTime>,
}

impl Claim {
    /// Whether the outcome is `outcome` (`"hit"`, `"claimed"`, `"failed"`, `"wait"`).
    pub fn is(&self, outcome: &str) -> bool {
        self.outcome == outcome
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

/// `once.claim_key(key, lease, wait, owner_pid)`. `Owner::Connection` leaves `owner_pid`
/// out, so that form also works on servers that predate it.
pub async fn claim_key(
    client: &Client,
    key: &str,
    lease: Duration,
    wait: Duration,
    owner: Owner,
) -> Result<Claim> {
    const COLUMNS: &str =
        "outcome, token, result, error, owner, lease_expires_at, attempts, retry_at, expires_at";
    let (lease, wait) = (secs(lease), secs(wait));
    let row = match owner.pid() {
        None => {
            one(
                client,
                &format!(
                    "SELECT {COLUMNS} FROM once.claim_key($1, make_interval(secs => $2), \
                     make_interval(secs => $3))"
                ),
                &[
                    (&key, Type::TEXT),
                    (&lease, Type::FLOAT8),
                    (&wait, Type::FLOAT8),
                ],
            )
            .await?
        }
        Some(pid) => {
            one(
                client,
                &format!(
                    "SELECT {COLUMNS} FROM once.claim_key($1, make_interval(secs => $2), \
                     make_interval(secs => $3), owner_pid => $4)"
                ),
                &[
                    (&key, Type::TEXT),
                    (&lease, Type::FLOAT8),
                    (&wait, Type::FLOAT8),
                    (&pid, Type::INT4),
                ],
            )
            .await?
        }
    };
    Ok(Claim {
        outcome: row.try_get(0)?,
        token: row.try_get(1)?,
        result: row.try_get(2)?,
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
    let ttl = ttl.map(secs);
    let row = one(
        client,
        "SELECT once.complete_key($1, $2, $3, make_interval(secs => $4))",
        &[
            (&key, Type::TEXT),
            (&token, Type::INT8),
            (result, Type::JSONB),
            (&ttl, Type::FLOAT8),
        ],
    )
    .await?;
    Ok(row.try_get(0)?)
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

/// `once.invalidate_key(key)`: false if the key was absent.
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
    let lease = secs(lease);
    let wait_secs = secs(wait);
    let pid = owner.pid();
    let mut sql = String::from(
        "SELECT key, token, payload, attempt FROM once.claim_next($1, make_interval(secs => $2), $3, $4",
    );
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
        (&queue, Type::TEXT),
        (&lease, Type::FLOAT8),
        (&worker, Type::TEXT),
        (&n, Type::INT4),
    ];
    if !wait.is_zero() {
        params.push((&wait_secs, Type::FLOAT8));
        sql.push_str(&format!(
            ", wait => make_interval(secs => ${})",
            params.len()
        ));
    }
    if let Some(pid) = &pid {
        params.push((pid, Type::INT4));
        sql.push_str(&format!(", owner_pid => ${}", params.len()));
    }
    sql.push(')');
    client
        .query_typed(&sql, &params)
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
    let ttl = ttl.map(secs);
    client
        .query_typed(
            "SELECT key FROM once.complete_keys($1, $2, $3, make_interval(secs => $4))",
            &[
                (&keys, Type::TEXT_ARRAY),
                (&tokens, Type::INT8_ARRAY),
                (&results, Type::JSONB_ARRAY),
                (&ttl, Type::FLOAT8),
            ],
        )
        .await?
        .iter()
        .map(|row| Ok(row.try_get(0)?))
        .collect()
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
