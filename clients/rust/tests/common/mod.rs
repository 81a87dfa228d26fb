//! Shared by the integration tests: the two setups (direct, and PgBouncer in transaction
//! mode) and helpers. Each test runs once per setup.

#![allow(dead_code)]

pub mod proxy;

use pg_once_client::{Client, Options};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// One way of reaching the server.
#[derive(Debug, Clone)]
pub struct Setup {
    pub name: &'static str,
    /// Where the pooled calls go.
    pub pool_dsn: String,
    /// The server itself: LISTEN connections and the test's own admin connection.
    pub direct_dsn: String,
    /// The LISTEN connection's, when it is not `direct_dsn` (several hosts: N7).
    pub listen_dsn: Option<String>,
}

/// `PG_ONCE_DSN` (direct) and, if set, `PG_ONCE_BOUNCER_DSN` (PgBouncer, transaction mode).
pub fn setups() -> Vec<Setup> {
    let direct = std::env::var("PG_ONCE_DSN")
        .expect("set PG_ONCE_DSN to a server with pg_once preloaded and created");
    let mut setups = vec![Setup {
        name: "direct",
        pool_dsn: direct.clone(),
        direct_dsn: direct.clone(),
        listen_dsn: None,
    }];
    match std::env::var("PG_ONCE_BOUNCER_DSN") {
        Ok(bouncer) => setups.push(Setup {
            name: "pgbouncer",
            pool_dsn: bouncer,
            direct_dsn: direct,
            listen_dsn: None,
        }),
        Err(_) => eprintln!("PG_ONCE_BOUNCER_DSN is not set: the PgBouncer setup is skipped"),
    }
    match tls_dsn() {
        Some(tls) => setups.push(Setup {
            name: "tls",
            pool_dsn: tls.clone(),
            direct_dsn: tls,
            listen_dsn: None,
        }),
        None => eprintln!("PG_ONCE_TLS_DSN is not set: the TLS-only setup is skipped"),
    }
    setups
}

/// `PG_ONCE_STANDBY_FIRST_DSN` (key/value, `target_session_attrs=read-write`) and
/// `PG_ONCE_STANDBY_FIRST_URL` (a URL, `primary`): a hot standby of the server listed before
/// it (docs/clients.md, N7), pool and LISTEN connection alike; the admin connection is
/// `PG_ONCE_DSN`. Only the conformance scenarios that name the setup run there.
pub fn standby_first_setups() -> Vec<Setup> {
    let Ok(direct) = std::env::var("PG_ONCE_DSN") else {
        return Vec::new();
    };
    [
        ("standby_first_kv", "PG_ONCE_STANDBY_FIRST_DSN"),
        ("standby_first_url", "PG_ONCE_STANDBY_FIRST_URL"),
    ]
    .into_iter()
    .filter_map(|(name, var)| {
        let dsn = std::env::var(var).ok()?;
        Some(Setup {
            name,
            pool_dsn: dsn.clone(),
            direct_dsn: direct.clone(),
            listen_dsn: Some(dsn),
        })
    })
    .collect()
}

/// `dsn` with `application_name` set, in either form.
fn named(dsn: &str, tag: &str) -> String {
    if dsn.starts_with("postgres://") || dsn.starts_with("postgresql://") {
        let sep = if dsn.contains('?') { '&' } else { '?' };
        format!("{dsn}{sep}application_name={tag}")
    } else {
        format!("{dsn} application_name={tag}")
    }
}

/// `PG_ONCE_TLS_DSN`: a role of the server that may connect only over TLS, with
/// `sslmode=verify-full` and the private CA as `sslrootcert` (scripts/lib.sh, cluster_tls).
pub fn tls_dsn() -> Option<String> {
    std::env::var("PG_ONCE_TLS_DSN").ok()
}

impl Setup {
    /// A client like one process's: pooled calls through this setup, LISTEN direct.
    /// `tag` becomes the application_name of its connections (`tag` pooled, `tag-listen`).
    pub async fn client(&self, tag: &str, options: Options) -> Client {
        let listen = self.listen_dsn.as_deref().unwrap_or(&self.direct_dsn);
        self.client_listening_at(tag, listen, options).await
    }

    /// A client of this setup whose LISTEN connection goes to `listen`.
    pub async fn client_listening_at(&self, tag: &str, listen: &str, options: Options) -> Client {
        Client::connect(
            &named(&self.pool_dsn, tag),
            Options {
                listen_conninfo: Some(named(listen, &format!("{tag}-listen"))),
                ..options
            },
        )
        .await
        .expect("client")
    }

    pub async fn admin(&self) -> tokio_postgres::Client {
        connect(&self.direct_dsn).await
    }

    /// A connection of the pooled kind (through PgBouncer in that setup).
    pub async fn pooled(&self) -> tokio_postgres::Client {
        connect(&self.pool_dsn).await
    }
}

impl Setup {
    /// Wait (up to 10 s) until `key` is being computed somewhere: a test that starts a
    /// second caller after the first has claimed must not guess how long connecting takes
    /// (a TLS handshake on a busy machine takes longer than a fixed sleep allows).
    pub async fn until_running(&self, key: &str) {
        let admin = self.admin().await;
        for _ in 0..1000 {
            let running: bool = admin
                .query_one(
                    "SELECT EXISTS (SELECT FROM once.entries WHERE key = $1 AND state = 'running')",
                    &[&key],
                )
                .await
                .expect("entries")
                .get(0);
            if running {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("{key} was never claimed");
    }
}

/// One connection to `dsn`, TLS as its sslmode says.
pub async fn connect(dsn: &str) -> tokio_postgres::Client {
    pg_once_client::Conninfo::parse(dsn)
        .expect("conninfo")
        .connect()
        .await
        .expect("connection")
}

/// Whether the role `client` is connected as has `attribute` of pg_roles (`rolsuper`,
/// `rolcreatedb`): the SQL edition (docs/sql-edition.md) is tested as a database owner who
/// is not a superuser, where the few tests that need one are skipped, saying so.
pub async fn role_has(client: &tokio_postgres::Client, attribute: &str) -> bool {
    client
        .query_one(
            &format!("SELECT {attribute} FROM pg_roles WHERE rolname = current_user"),
            &[],
        )
        .await
        .expect("pg_roles")
        .get(0)
}

/// Whether the server runs pg_once's SQL edition (docs/sql-edition.md), whose limits are
/// rows of once.settings that only administrators write, not settings a session may set.
pub async fn is_sql_edition(client: &tokio_postgres::Client) -> bool {
    client
        .query_one("SELECT to_regclass('once.settings') IS NOT NULL", &[])
        .await
        .expect("to_regclass")
        .get(0)
}

/// A key (or name) unique to this test run.
pub fn fresh(name: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{nanos}-{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// `dsn` (libpq key/value) with `key` set to `value`.
pub fn with_param(dsn: &str, key: &str, value: &str) -> String {
    let mut out: Vec<String> = dsn
        .split_whitespace()
        .filter(|kv| !kv.starts_with(&format!("{key}=")))
        .map(str::to_owned)
        .collect();
    out.push(format!("{key}={value}"));
    out.join(" ")
}

/// `dsn` (either libpq form) pointed at one server, `host` and `port`, and nowhere else: the
/// hosts, ports and `hostaddr` it named are taken out (tokio-postgres reads a repeated
/// `host` as one more host to try, so appending would not replace them), the rest kept.
pub fn at_server(dsn: &str, host: &str, port: u16) -> String {
    const SERVER_KEYS: [&str; 3] = ["host", "hostaddr", "port"];
    if let Some((scheme, rest)) = dsn
        .split_once("://")
        .filter(|(scheme, _)| matches!(*scheme, "postgres" | "postgresql"))
    {
        // postgresql://[userinfo@]hosts[/dbname][?params]: the hosts end at '/' or '?'.
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let userinfo = authority.rfind('@').map_or("", |at| &authority[..=at]);
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let params: Vec<&str> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .filter(|p| !SERVER_KEYS.contains(&p.split('=').next().unwrap_or("")))
            .collect();
        let query = if params.is_empty() {
            String::new()
        } else {
            format!("?{}", params.join("&"))
        };
        return format!("{scheme}://{userinfo}{host}:{port}{path}{query}");
    }
    let mut kept: Vec<String> = keyword_values(dsn)
        .into_iter()
        .filter(|(k, _)| !SERVER_KEYS.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'")))
        .collect();
    kept.push(format!("host={host}"));
    kept.push(format!("port={port}"));
    kept.join(" ")
}

/// A libpq key/value string's pairs, as libpq reads them: `key = value`, the value
/// single-quoted when it holds spaces, with `\\` and `\'` escapes.
fn keyword_values(dsn: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = dsn.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let key: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && !c.is_whitespace())).collect();
        if key.is_empty() {
            return pairs;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        assert_eq!(chars.next(), Some('='), "{dsn}: {key} has no value");
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars
                    .next()
                    .unwrap_or_else(|| panic!("{dsn}: an unclosed quote"))
                {
                    '\'' => break,
                    '\\' => value.extend(chars.next()),
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                match c {
                    '\\' => value.extend(chars.next()),
                    c => value.push(c),
                }
            }
        }
        pairs.push((key, value));
    }
}
