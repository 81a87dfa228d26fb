//! pg-once-ui: a dashboard for pg_once (docs/dashboard.md). It connects as one role and
//! shows what that role may see through pg_once's views and functions; its actions are
//! pg_once's SQL functions, called as that role.

mod db;
mod live;
mod pages;
mod view;
mod web;

use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(name = "pg-once-ui", version, about = "A dashboard for pg_once")]
struct Args {
    /// Connection string (libpq keyword or URL form). Unset parts come from PGHOST,
    /// PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSSLMODE, PGSSLROOTCERT...
    #[arg(long, env = "DATABASE_URL", default_value = "", hide_env_values = true)]
    dsn: String,
    /// Address to listen on (loopback by default: put a proxy with TLS in front to
    /// serve others).
    #[arg(long, default_value = "127.0.0.1:8787")]
    bind: SocketAddr,
    /// Refuse every action (403): a dashboard to look at only.
    #[arg(long)]
    read_only: bool,
    /// Ask browsers for this user and password (user:pass).
    #[arg(long, env = "PG_ONCE_UI_BASIC_AUTH", hide_env_values = true)]
    basic_auth: Option<String>,
    /// The secret the CSRF tokens are made with (random at each start when unset): give
    /// replicas behind one address the same one.
    #[arg(long, env = "PG_ONCE_UI_CSRF_SECRET", hide_env_values = true)]
    csrf_secret: Option<String>,
    /// Connections for queries and actions (the LISTEN connection is one more).
    #[arg(long, default_value_t = 4)]
    pool_size: usize,
    /// Host names the dashboard answers to besides IP addresses and localhost (the Host
    /// header; repeat, or separate with commas): the name a reverse proxy forwards. A
    /// request for any other name is refused (421), so that a page of another site, whose
    /// name is made to resolve to this address (DNS rebinding), cannot read or act here.
    #[arg(
        long = "allowed-host",
        env = "PG_ONCE_UI_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    allowed_hosts: Vec<String>,
}

#[derive(Clone)]
pub struct App(Arc<Inner>);

pub struct Inner {
    pub pool: deadpool_postgres::Pool,
    pub hub: live::Hub,
    pub read_only: bool,
    pub basic_auth: Option<(String, String)>,
    /// --allowed-host, lowercased (see `host_allowed`).
    pub allowed_hosts: Vec<String>,
    csrf_key: ring::hmac::Key,
    /// For comparing basic-auth credentials in constant time.
    pub auth_key: ring::hmac::Key,
}

impl std::ops::Deref for App {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

const CSRF_MESSAGE: &[u8] = b"pg-once-ui: actions";

impl Inner {
    /// The token every action's form carries: an HMAC, with a secret drawn at start, of a
    /// fixed message (a page of another site cannot read it from ours).
    pub fn csrf(&self) -> String {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(ring::hmac::sign(&self.csrf_key, CSRF_MESSAGE).as_ref())
    }

    /// Whether a request naming `host` (its Host header, port included) is for this
    /// dashboard: an IP address (no site's page can take one over by DNS), localhost
    /// (which browsers resolve themselves), or a name given with --allowed-host.
    pub fn host_allowed(&self, host: &str) -> bool {
        let name = match host.strip_prefix('[') {
            // [IPv6 address] or [IPv6 address]:port
            Some(rest) => return rest.split_once(']').is_some(),
            None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        name.parse::<std::net::Ipv4Addr>().is_ok()
            || name == "localhost"
            || self.allowed_hosts.contains(&name)
    }

    pub fn csrf_ok(&self, token: &str) -> bool {
        use base64::Engine;
        match base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token) {
            Ok(tag) => ring::hmac::verify(&self.csrf_key, CSRF_MESSAGE, &tag).is_ok(),
            Err(_) => false,
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(e) = run(args).await {
        eprintln!("pg-once-ui: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), String> {
    let conninfo = pg_once_client::Conninfo::parse(&args.dsn).map_err(|e| e.to_string())?;
    let basic_auth = match args.basic_auth.as_deref() {
        None | Some("") => None,
        Some(s) => {
            let (u, p) = s
                .split_once(':')
                .ok_or("--basic-auth takes user:password")?;
            Some((u.to_owned(), p.to_owned()))
        }
    };
    let rng = ring::rand::SystemRandom::new();
    let csrf_key = match args.csrf_secret.as_deref() {
        Some(secret) if !secret.is_empty() => {
            ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes())
        }
        _ => ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng)
            .map_err(|_| "no randomness for the CSRF secret")?,
    };
    let auth_key =
        ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng).map_err(|_| "no randomness")?;
    let pool = db::pool(&conninfo, args.pool_size)?;
    let caps = db::caps(&pool).await?;
    // What is logged names the server and role, never the password.
    let c = conninfo.config();
    eprintln!(
        "pg-once-ui: connected to {:?} port {:?} database {:?} as role {:?} (reads once.entries: {}){}",
        c.get_hosts(),
        c.get_ports(),
        c.get_dbname().unwrap_or_default(),
        caps.role,
        caps.entries,
        if args.read_only { ", read-only" } else { "" }
    );
    let app = App(Arc::new(Inner {
        pool,
        hub: live::Hub::default(),
        read_only: args.read_only,
        basic_auth,
        allowed_hosts: args
            .allowed_hosts
            .iter()
            .map(|h| h.trim().trim_end_matches('.').to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect(),
        csrf_key,
        auth_key,
    }));
    *app.hub.caps.lock().unwrap() = caps;
    tokio::spawn(live::listener(app.clone(), conninfo));
    tokio::spawn(live::refresher(app.clone()));
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .map_err(|e| format!("bind {}: {e}", args.bind))?;
    eprintln!("pg-once-ui: serving http://{}", args.bind);
    axum::serve(listener, web::router(app))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app(allowed: &[&str]) -> Inner {
        let rng = ring::rand::SystemRandom::new();
        let key = || ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng).unwrap();
        let config = "host=127.0.0.1".parse::<tokio_postgres::Config>().unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        Inner {
            pool: deadpool_postgres::Pool::builder(manager).build().unwrap(),
            hub: live::Hub::default(),
            read_only: false,
            basic_auth: None,
            allowed_hosts: allowed.iter().map(|h| h.to_string()).collect(),
            csrf_key: key(),
            auth_key: key(),
        }
    }

    #[test]
    fn only_addresses_localhost_and_allowed_names_are_answered() {
        let plain = app(&[]);
        for host in [
            "127.0.0.1:8787",
            "10.1.2.3",
            "[::1]:8787",
            "[::1]",
            "localhost:8787",
            "LocalHost.",
        ] {
            assert!(plain.host_allowed(host), "{host}");
        }
        for host in [
            "rebound.example:8787",
            "rebound.example",
            "127.0.0.1.example:8787",
            "localhost.example",
            "",
            ":8787",
        ] {
            assert!(!plain.host_allowed(host), "{host}");
        }
        let proxied = app(&["dashboard.example"]);
        assert!(proxied.host_allowed("Dashboard.Example:443"));
        assert!(!proxied.host_allowed("other.example"));
    }
}
