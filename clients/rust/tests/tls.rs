//! TLS against a server role that may connect only over TLS (`PG_ONCE_TLS_DSN`, from
//! scripts/lib.sh's cluster_tls: a certificate of a private CA for 127.0.0.1 and
//! localhost). Skipped without it. Every other integration test also runs there (the `tls`
//! setup of `common::setups`); these check what is particular to TLS.

mod common;

use common::{fresh, tls_dsn};
use pg_once_client::{CallOptions, Client, Conninfo, Options, SslMode};
use std::time::Duration;

/// The TLS DSN with `extra` appended (a later keyword wins, as in libpq).
fn with(extra: &str) -> Option<String> {
    tls_dsn().map(|dsn| format!("{dsn} {extra}"))
}

/// Whether a connection could be made (and so a query answered).
async fn connects(dsn: &str) -> Result<(), String> {
    let conninfo = Conninfo::parse(dsn).map_err(|e| e.to_string())?;
    let c = conninfo.connect().await.map_err(|e| e.to_string())?;
    c.simple_query("SELECT 1")
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The pool and the LISTEN connection both go over TLS, verified (verify-full), and a
/// computation is stored and served through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_and_listen_connection_use_verified_tls() {
    let Some(dsn) = tls_dsn() else {
        eprintln!("PG_ONCE_TLS_DSN is not set: skipped");
        return;
    };
    assert_eq!(
        Conninfo::parse(&dsn).unwrap().ssl_mode(),
        SslMode::VerifyFull
    );
    let tag = fresh("tls");
    let client = Client::connect(
        &format!("{dsn} application_name={tag}"),
        Options {
            listen_conninfo: Some(format!("{dsn} application_name={tag}-listen")),
            ..Options::default()
        },
    )
    .await
    .unwrap();
    client.ready(Duration::from_secs(10)).await.unwrap();
    let key = fresh("tls-key");
    let v: String = client
        .get_or_compute(
            &key,
            || async { Ok::<_, std::io::Error>("over tls".to_string()) },
            CallOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(v, "over tls");
    let admin = common::connect(&dsn).await;
    let rows = admin
        .query(
            "SELECT a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name IN ($1, $2 || '-listen') ORDER BY 1",
            &[&tag, &tag],
        )
        .await
        .unwrap();
    let seen: Vec<(String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(seen, [(tag.clone(), true), (format!("{tag}-listen"), true)]);
}

/// The server refuses this role over plain TCP; `require` without a CA connects
/// unverified; a name the certificate is not for fails `verify-full` and passes
/// `verify-ca`; a CA file that is not there is a configuration error, before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_decides_what_is_verified() {
    let Some(dsn) = tls_dsn() else {
        eprintln!("PG_ONCE_TLS_DSN is not set: skipped");
        return;
    };
    let refused = connects(&with("sslmode=disable").unwrap())
        .await
        .unwrap_err();
    assert!(refused.contains("pg_hba.conf"), "{refused}");
    let unverified = dsn
        .split_whitespace()
        .filter(|kv| !kv.starts_with("sslrootcert="))
        .collect::<Vec<_>>()
        .join(" ");
    connects(&format!("{unverified} sslmode=require"))
        .await
        .unwrap();
    connects(&format!("{unverified} sslmode=prefer"))
        .await
        .unwrap();
    // Connect to 127.0.0.1 but verify the certificate as if for another name.
    let other_name = "host=db.invalid hostaddr=127.0.0.1";
    let err = connects(&with(&format!("{other_name} sslmode=verify-full")).unwrap())
        .await
        .unwrap_err();
    assert!(err.contains("certificate"), "{err}");
    connects(&with(&format!("{other_name} sslmode=verify-ca")).unwrap())
        .await
        .unwrap();
    connects(&with("host=localhost").unwrap()).await.unwrap();
    let err = Client::connect(
        &with("sslrootcert=/nonexistent/ca.crt").unwrap(),
        Options::default(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/ca.crt"), "{err}");
    // The same for the LISTEN connection's conninfo.
    let err = Client::connect(
        &dsn,
        Options {
            listen_conninfo: with("sslmode=verify-full sslrootcert=/nonexistent/ca.crt"),
            ..Options::default()
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("listen_conninfo"), "{err}");
}
