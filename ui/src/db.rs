//! Every statement the dashboard runs. Each reads through what pg_once grants an
//! application role (once.stats, once.queue_stats, once.dead_letters, the functions),
//! and reads once.entries and once.attempts only when the role may SELECT them
//! (administrators; docs/security.md, "Roles cannot reach the tables"). Every list is
//! keyset-paginated with a bounded LIMIT.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use serde::Serialize;
use serde_json::{Map, Value};
use tokio_postgres::types::Type;
use tokio_postgres::Row;

/// Rows shown per page; one more is read to know whether there is a next page.
pub const PAGE: i64 = 50;
/// A filtered page of keys reads at most this many index entries of once.entries: a
/// sparse prefix or queue may fill fewer than PAGE rows, and the next page goes on from
/// the last entry read, never scanning the table in one page view.
pub const SCAN: i64 = 5000;

pub type Json = Map<String, Value>;

pub fn pool(conninfo: &pg_once_client::Conninfo, size: usize) -> Result<Pool, String> {
    let mut config = conninfo.config().clone();
    config.application_name("pg-once-ui");
    let manager = Manager::from_config(
        config,
        conninfo.connector().map_err(|e| e.to_string())?,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .build()
        .map_err(|e| e.to_string())
}

/// What the connected role may read, found at start and after each reconnection of the
/// listener.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Caps {
    pub role: String,
    pub entries: bool,
    /// May SELECT once.keys: the keys of its namespaces and the shared ones.
    pub keys: bool,
    pub attempts: bool,
    pub stats: bool,
    pub queue_stats: bool,
    pub dead_letters: bool,
}

pub async fn caps(pool: &Pool) -> Result<Caps, String> {
    let c = pool.get().await.map_err(describe_pool)?;
    let r = c
        .query_one(
            "SELECT current_user::text,
                    has_table_privilege('once.entries', 'SELECT'),
                    has_table_privilege('once.attempts', 'SELECT'),
                    has_table_privilege('once.stats', 'SELECT'),
                    has_table_privilege('once.queue_stats', 'SELECT'),
                    has_table_privilege('once.dead_letters', 'SELECT'),
                    to_regclass('once.keys') IS NOT NULL
                        AND has_table_privilege('once.keys', 'SELECT')",
            &[],
        )
        .await
        .map_err(describe)?;
    Ok(Caps {
        role: r.get(0),
        entries: r.get(1),
        attempts: r.get(2),
        stats: r.get(3),
        queue_stats: r.get(4),
        dead_letters: r.get(5),
        keys: r.get(6),
    })
}

/// A database error as the dashboard shows it: PostgreSQL's message and SQLSTATE.
pub fn describe(e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
            // "error performing TLS handshake: <why>", and so on down the chain.
            let mut s = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                s = format!("{s}: {cause}");
                source = cause.source();
            }
            s
        }
    }
}

pub fn describe_pool(e: deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::Backend(e) => describe(e),
        other => other.to_string(),
    }
}

/// A row as JSON, by column type (the statements cast what has no JSON form to text).
pub fn to_json(row: &Row) -> Json {
    let mut m = Map::new();
    for (i, col) in row.columns().iter().enumerate() {
        let v = match *col.type_() {
            Type::BOOL => row.get::<_, Option<bool>>(i).map(Value::from),
            Type::INT2 => row.get::<_, Option<i16>>(i).map(Value::from),
            Type::INT4 => row.get::<_, Option<i32>>(i).map(Value::from),
            Type::INT8 => row.get::<_, Option<i64>>(i).map(Value::from),
            Type::FLOAT8 => row.get::<_, Option<f64>>(i).map(Value::from),
            Type::JSON | Type::JSONB => row.get::<_, Option<Value>>(i),
            _ => row.get::<_, Option<String>>(i).map(Value::from),
        };
        m.insert(col.name().to_owned(), v.unwrap_or(Value::Null));
    }
    m
}

async fn query(
    pool: &Pool,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Json>, String> {
    let c = pool.get().await.map_err(describe_pool)?;
    let rows = c.query(sql, params).await.map_err(describe)?;
    Ok(rows.iter().map(to_json).collect())
}

const STATS: &str = "SELECT queued, running, done, failed, running_past_lease, expired_unpurged,
       extract(epoch FROM clock_timestamp() - oldest_claimed_at)::float8 AS oldest_claim_age_s,
       errors, attempts, shared_memory, notify, workers, claims, hits, waits, wakeups,
       takeovers, completions, failures, releases, invalidations, reaped, purged,
       notified_direct, notified_relayed, stale, refreshes
  FROM once.stats";

pub async fn stats(pool: &Pool) -> Result<Json, String> {
    Ok(query(pool, STATS, &[]).await?.pop().unwrap_or_default())
}

const QUEUES: &str = "SELECT queue, depth, due, running, dead,
       extract(epoch FROM oldest_due_age)::float8 AS lag_s,
       completed_last_minute, failed_last_minute, completed_last_hour
  FROM once.queue_stats ORDER BY queue";

pub async fn queues(pool: &Pool) -> Result<Vec<Json>, String> {
    query(pool, QUEUES, &[]).await
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, serde::Deserialize, Serialize)]
pub struct KeyFilter {
    #[serde(default, deserialize_with = "empty_none")]
    pub state: Option<String>,
    #[serde(default, deserialize_with = "empty_none")]
    pub prefix: Option<String>,
    #[serde(default, deserialize_with = "empty_none")]
    pub queue: Option<String>,
    /// The page starts after this (hex key_hash when reading once.entries; the key itself
    /// when reading once.dead_letters).
    #[serde(default, deserialize_with = "empty_none")]
    pub after: Option<String>,
}

fn empty_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s: Option<String> = serde::Deserialize::deserialize(d)?;
    Ok(s.filter(|s| !s.is_empty()))
}

pub const STATES: [&str; 4] = ["queued", "running", "done", "failed"];

#[derive(Debug, Clone, Serialize, Default)]
pub struct Page {
    pub rows: Vec<Json>,
    /// Where the next page starts, if there is one.
    pub next: Option<String>,
    /// What this role's page is read from, when it is not once.entries.
    pub source: &'static str,
    pub notice: Option<String>,
}

const KEY_COLUMNS: &str = "encode(key_hash, 'hex') AS hash, key, state::text AS state, queue, owner,
       CASE WHEN state = 'running' THEN (extract(epoch FROM lease_expires_at) - extract(epoch FROM clock_timestamp()))::float8 END AS lease_left_s,
       CASE WHEN state = 'running' THEN (extract(epoch FROM clock_timestamp()) - extract(epoch FROM claimed_at))::float8 END AS claim_age_s,
       left(error, 300) AS error,
       (extract(epoch FROM retry_at) - extract(epoch FROM clock_timestamp()))::float8 AS retry_in_s,
       (extract(epoch FROM expires_at) - extract(epoch FROM clock_timestamp()))::float8 AS expires_in_s,
       attempts, errors, last_outcome, updated_at::text AS updated_at,
       (state = 'running' AND CASE WHEN lease_only OR owner_pid IS NULL
                                   THEN lease_expires_at <= clock_timestamp()
                                   ELSE NOT EXISTS (SELECT FROM pg_catalog.pg_stat_activity a
                                                     WHERE a.pid = owner_pid) END) AS owner_gone";

pub const NO_ENTRIES: &str = "This role may SELECT neither once.entries nor once.keys (docs/security.md, \"Roles cannot reach the tables\"): the keys listed are its dead letters (once.dead_letters), and the counts by state on the overview come from once.stats. Grant it SELECT on once.keys to list the keys of its namespaces.";

/// The notice of a page read from once.keys: what an application role sees.
pub const FROM_KEYS: &str = "Read from once.keys: the keys of this role's namespaces and the shared ones; administrators see every key.";

impl Caps {
    /// The relation this role's keys are read from: once.entries for administrators,
    /// else once.keys (the same columns but the token, filtered to the keys the role may
    /// use), else none (its dead letters only).
    pub fn keys_source(&self) -> Option<&'static str> {
        if self.entries {
            Some("once.entries")
        } else if self.keys {
            Some("once.keys")
        } else {
            None
        }
    }
}

pub async fn keys(pool: &Pool, caps: &Caps, f: &KeyFilter) -> Result<Page, String> {
    if let Some(s) = &f.state {
        if !STATES.contains(&s.as_str()) {
            return Err(format!("state must be one of {}", STATES.join(", ")));
        }
    }
    let Some(source) = caps.keys_source() else {
        if f.state.as_deref().is_some_and(|s| s != "failed") {
            return Ok(Page {
                source: "once.dead_letters",
                notice: Some(NO_ENTRIES.into()),
                ..Page::default()
            });
        }
        let mut page = dead_letters(pool, f).await?;
        page.notice = Some(NO_ENTRIES.into());
        return Ok(page);
    };
    // The state is one of four literals (checked above), so that the planner matches the
    // partial indexes (running keys in key_hash order; failed and queued keys).
    let state = f
        .state
        .as_deref()
        .map(|s| format!("AND state = '{s}'"))
        .unwrap_or_default();
    let after = f.after.clone().unwrap_or_default();
    let filtered = f.prefix.is_some() || f.queue.is_some();
    let sql = if filtered {
        format!(
            "WITH scanned AS MATERIALIZED (
                 SELECT key_hash, key, state, queue, owner, owner_pid, lease_only,
                        lease_expires_at, claimed_at, left(error, 300) AS error, retry_at,
                        expires_at, attempts, errors, last_outcome, updated_at
                   FROM {source}
                  WHERE key_hash > decode($1, 'hex') {state}
                  ORDER BY key_hash LIMIT {SCAN}),
             hits AS (
                 SELECT {KEY_COLUMNS} FROM scanned
                  WHERE ($2::text IS NULL OR starts_with(key, $2))
                    AND ($3::text IS NULL OR queue = $3)
                  ORDER BY key_hash LIMIT {limit})
             SELECT h.*, (SELECT encode(key_hash, 'hex') FROM scanned ORDER BY key_hash DESC LIMIT 1) AS scanned_to,
                    (SELECT count(*) FROM scanned) AS scanned
               FROM hits h ORDER BY hash",
            limit = PAGE + 1
        )
    } else {
        format!(
            "SELECT {KEY_COLUMNS}, NULL::text AS scanned_to, 0::int8 AS scanned
               FROM {source}
              WHERE key_hash > decode($1, 'hex') {state}
              ORDER BY key_hash LIMIT {limit}",
            limit = PAGE + 1
        )
    };
    if !after.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err("after must be a key_hash in hex".into());
    }
    let mut rows = if filtered {
        query(pool, &sql, &[&after, &f.prefix, &f.queue]).await?
    } else {
        query(pool, &sql, &[&after]).await?
    };
    let mut next = cut_page(&mut rows, "hash");
    if next.is_none() && filtered {
        // Fewer hits than a page: more may follow the entries scanned, if the scan
        // stopped at its bound.
        next = rows.first().and_then(scan_stopped_at);
    }
    if filtered && rows.is_empty() {
        // No hit in this stretch: say where the scan stopped, so that the next page can
        // go on from there.
        let probe = format!(
            "SELECT encode((array_agg(key_hash ORDER BY key_hash DESC))[1], 'hex') AS scanned_to,
                    count(*) AS scanned FROM (
                 SELECT key_hash FROM {source} WHERE key_hash > decode($1, 'hex') {state}
                  ORDER BY key_hash LIMIT {SCAN}) s"
        );
        next = query(pool, &probe, &[&after])
            .await?
            .first()
            .and_then(scan_stopped_at);
    }
    for r in &mut rows {
        r.remove("scanned");
        r.remove("scanned_to");
    }
    Ok(Page {
        rows,
        next,
        source,
        notice: (!caps.entries).then(|| FROM_KEYS.into()),
    })
}

/// Rows are read one past a page: keep a page, and say where the next one starts (the
/// `field` of its last row), if there is one.
fn cut_page(rows: &mut Vec<Json>, field: &str) -> Option<String> {
    if rows.len() as i64 <= PAGE {
        return None;
    }
    rows.truncate(PAGE as usize);
    rows.last()
        .and_then(|r| r[field].as_str())
        .map(str::to_owned)
}

/// Where a bounded scan of index entries stopped, if it stopped at its bound (SCAN
/// entries read): the next page goes on from there.
fn scan_stopped_at(r: &Json) -> Option<String> {
    (r["scanned"].as_i64() == Some(SCAN))
        .then(|| r["scanned_to"].as_str().map(str::to_owned))
        .flatten()
}

pub async fn dead_letters(pool: &Pool, f: &KeyFilter) -> Result<Page, String> {
    let after = f.after.clone().unwrap_or_default();
    let mut rows = query(
        pool,
        "SELECT key, 'failed' AS state, queue, left(payload::text, 300) AS payload, attempts, errors,
                left(error, 300) AS error, failed_at::text AS failed_at, failed_at::text AS updated_at
           FROM once.dead_letters
          WHERE key > $1 AND ($2::text IS NULL OR starts_with(key, $2))
            AND ($3::text IS NULL OR queue = $3)
          ORDER BY key LIMIT $4",
        &[&after, &f.prefix, &f.queue, &(PAGE + 1)],
    )
    .await?;
    let next = cut_page(&mut rows, "key");
    Ok(Page {
        rows,
        next,
        source: "once.dead_letters",
        notice: None,
    })
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct KeyDetail {
    pub key: String,
    pub row: Option<Json>,
    pub attempts: Vec<Json>,
    pub source: &'static str,
    pub notice: Option<String>,
}

pub async fn key(pool: &Pool, caps: &Caps, key: &str) -> Result<KeyDetail, String> {
    let mut d = KeyDetail {
        key: key.to_owned(),
        ..KeyDetail::default()
    };
    if let Some(source) = caps.keys_source() {
        d.source = source;
        d.notice = (!caps.entries).then(|| FROM_KEYS.into());
        d.row = query(
            pool,
            &format!(
                "SELECT {KEY_COLUMNS}, owner_pid, lease_only, lease_expires_at::text AS lease_expires_at,
                        claimed_at::text AS claimed_at, completed_at::text AS completed_at,
                        created_at::text AS created_at, expires_at::text AS expires_at,
                        stale_until::text AS stale_until, retry_at::text AS retry_at,
                        priority, run_at::text AS run_at, enqueued_at::text AS enqueued_at,
                        rerun, pg_column_size(result) AS result_bytes,
                        left(result::text, 2000) AS result, left(payload::text, 2000) AS payload,
                        owner_role::regrole::text AS owner_role
                   FROM {source} WHERE key_hash = once.key_hash($1)"
            ),
            &[&key],
        )
        .await?
        .pop();
    } else {
        d.source = "once.dead_letters";
        d.notice = Some(NO_ENTRIES.into());
        d.row = query(
            pool,
            "SELECT key, 'failed' AS state, queue, left(payload::text, 2000) AS payload, attempts,
                    errors, error, failed_at::text AS failed_at
               FROM once.dead_letters WHERE key = $1",
            &[&key],
        )
        .await?
        .pop();
    }
    if caps.attempts {
        d.attempts = query(
            pool,
            "SELECT queue, worker, started_at::text AS started_at, finished_at::text AS finished_at,
                    outcome, left(error, 500) AS error
               FROM once.attempts WHERE key_hash = once.key_hash($1)
              ORDER BY finished_at DESC LIMIT 100",
            &[&key],
        )
        .await?;
    }
    Ok(d)
}

/// The actions, each one statement of pg_once's SQL API per key, run as the connected
/// role: its rights and namespaces decide, and a refusal is reported for that key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Invalidate,
    Refresh,
    Retry,
    Release,
    Reap,
}

impl Action {
    pub fn parse(s: &str) -> Option<Action> {
        serde_json::from_value(Value::from(s)).ok()
    }
    pub fn name(self) -> &'static str {
        match self {
            Action::Invalidate => "invalidate",
            Action::Refresh => "refresh",
            Action::Retry => "retry",
            Action::Release => "release",
            Action::Reap => "reap",
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            Action::Invalidate => "Invalidate (once.invalidate_key): forget the result or failure; a running key is computed once more when its run ends",
            Action::Refresh => "Refresh (once.refresh_key): have the key computed again",
            Action::Retry => "Retry (once.enqueue_key(key, payload, queue)): re-enqueue the dead letter with its payload for a new set of attempts",
            Action::Release => "Release (once.release_key with the claim's token): give back a claim whose owner is gone (its backend has exited, or a lease-only claim's lease has run out)",
            Action::Reap => "Reap (once.reap_stale): turn every claim whose owner is gone into a failure that may be retried at once, and purge expired results",
        }
    }
    fn sql(self) -> &'static str {
        match self {
            Action::Invalidate => "SELECT once.invalidate_key($1)::text",
            Action::Refresh => "SELECT once.refresh_key($1)",
            Action::Retry => {
                "SELECT coalesce((SELECT once.enqueue_key(key, payload, queue) FROM once.dead_letters WHERE key = $1),
                                 'not a dead letter of this role')"
            }
            Action::Release => {
                "SELECT coalesce((SELECT once.release_key(e.key, e.token)::text FROM once.entries e
                                   WHERE e.key_hash = once.key_hash($1) AND e.state = 'running'
                                     AND CASE WHEN e.lease_only OR e.owner_pid IS NULL
                                              THEN e.lease_expires_at <= clock_timestamp()
                                              ELSE NOT EXISTS (SELECT FROM pg_catalog.pg_stat_activity a
                                                                WHERE a.pid = e.owner_pid) END),
                                 'not released: not running, or its owner is alive')"
            }
            Action::Reap => {
                "SELECT format('reclaimed %s, expired %s, history %s', reclaimed, expired, history)
                   FROM once.reap_stale()"
            }
        }
    }
}

/// Runs `action` on each key (reap: once), each in its own transaction (autocommit);
/// returns (key, what the function answered or the error).
pub async fn act(
    pool: &Pool,
    action: Action,
    keys: &[String],
) -> Result<Vec<(String, String)>, String> {
    let c = pool.get().await.map_err(describe_pool)?;
    let mut out = Vec::new();
    if action == Action::Reap {
        let r = c.query_one(action.sql(), &[]).await.map_err(describe)?;
        out.push((String::new(), r.get::<_, String>(0)));
        return Ok(out);
    }
    for k in keys {
        let answer = match c.query_one(action.sql(), &[k]).await {
            Ok(r) => r
                .get::<_, Option<String>>(0)
                .unwrap_or_else(|| "null".into()),
            Err(e) => format!("refused: {}", describe(e)),
        };
        out.push((k.clone(), answer));
    }
    Ok(out)
}
