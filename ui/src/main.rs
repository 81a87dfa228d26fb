//! pg-once-ui: a dashboard for pg_once (docs/dashboard.md). It connects as one role and
//! shows what that role may see through pg_once's views and functions; its actions are
//! pg_once's SQL functions, called as that role.

mod db;
mod live;
mod pages;
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
}

#[derive(Clone)]
pub struct App(Arc<Inner>);

pub struct Inner {
    pub pool: deadpool_postgres::Pool,
    pub hub: live::Hub,
    pub read_only: bool,
    pub basic_auth: Option<(String, String)>,
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
