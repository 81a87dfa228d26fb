//! Connection strings as libpq reads them, for tokio-postgres.
//!
//! tokio-postgres parses libpq's two forms (`host=... port=...` and `postgres://...`) but
//! knows only `sslmode=disable|prefer|require`, refuses `sslrootcert`, and reads no `PG*`
//! environment variable. [`Conninfo::parse`] takes `sslmode` (all five of libpq's modes)
//! and `sslrootcert` out of the string, fills what the string leaves unset from the
//! environment as libpq does (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`,
//! `PGAPPNAME`, `PGCONNECT_TIMEOUT`, `PGOPTIONS`, `PGSSLMODE`, `PGSSLROOTCERT`), and
//! hands the rest to tokio-postgres. The pool and the LISTEN connection both connect
//! through it, so they agree on TLS and on which server to use.
//!
//! Several hosts (docs/clients.md, N7): `host=db1,db2 port=5432,5433` and
//! `postgresql://db1:5432,db2:5433/app` are tokio-postgres's own, which tries them in
//! order; `target_session_attrs` (or `PGTARGETSESSIONATTRS`) is taken out here, as libpq
//! spells it, and given to tokio-postgres as the nearest it knows: `any`, `read-write`,
//! `read-only`, `primary` (as `read-write`) and `standby` (as `read-only`).

use crate::error::{Error, Result};
use crate::tls::{RootCerts, SslMode};
use std::path::PathBuf;
use std::time::Duration;

/// A parsed connection string: where to connect and how to secure it.
#[derive(Debug, Clone)]
pub struct Conninfo {
    config: tokio_postgres::Config,
    ssl_mode: SslMode,
    root_certs: Option<RootCerts>,
}

impl Conninfo {
    /// Parse `conninfo` (either libpq form), filling what it leaves unset from the `PG*`
    /// environment variables.
    pub fn parse(conninfo: &str) -> Result<Conninfo> {
        Conninfo::parse_with_env(conninfo, |name| std::env::var(name).ok())
    }

    /// [`Conninfo::parse`] with `env` in place of the process's environment.
    pub fn parse_with_env(
        conninfo: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Conninfo> {
        let (rest, mut taken) = take_tls_params(conninfo)?;
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e| Error::Configuration(format!("conninfo: {e}")))?;
        apply_env(&mut config, &env)?;
        for (key, var) in [
            ("sslmode", "PGSSLMODE"),
            ("sslrootcert", "PGSSLROOTCERT"),
            ("target_session_attrs", "PGTARGETSESSIONATTRS"),
        ] {
            if !taken.iter().any(|(k, _)| k == key) {
                if let Some(v) = env(var) {
                    taken.push((key.to_owned(), v));
                }
            }
        }
        let mut ssl_mode = SslMode::Prefer;
        let mut root_certs = None;
        for (key, value) in taken {
            match key.as_str() {
                "sslmode" => ssl_mode = value.parse()?,
                "target_session_attrs" => {
                    config.target_session_attrs(target_session_attrs(&value)?);
                }
                _ => {
                    root_certs = Some(match value.as_str() {
                        "system" => RootCerts::System,
                        path => RootCerts::File(path.into()),
                    })
                }
            }
        }
        if root_certs.is_none()
            && matches!(
                ssl_mode,
                SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
            )
        {
            // libpq's default CA file, used when present.
            root_certs = env("HOME")
                .map(|home| PathBuf::from(home).join(".postgresql/root.crt"))
                .filter(|p| p.is_file())
                .map(RootCerts::File);
        }
        config.ssl_mode(match ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        let parsed = Conninfo {
            config,
            ssl_mode,
            root_certs,
        };
        parsed.connector()?; // a missing CA file or feature is a configuration error now
        Ok(parsed)
    }

    /// The tokio-postgres configuration (its `ssl_mode` says only whether TLS is used).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// libpq's `sslmode`, from the string or `PGSSLMODE`.
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// The CAs trusted, from `sslrootcert`, `PGSSLROOTCERT` or `~/.postgresql/root.crt`.
    pub fn root_certs(&self) -> Option<&RootCerts> {
        self.root_certs.as_ref()
    }

    /// What connections made from this conninfo secure themselves with (TLS as `sslmode`
    /// and `sslrootcert` say): for connections the client does not make itself, e.g. one
    /// that must read its notifications (`connect` drops them) or a pool of another crate.
    pub fn connector(&self) -> Result<crate::tls::Connector> {
        crate::tls::connector(self.ssl_mode, self.root_certs.as_ref())
    }

    /// Open one connection, its driver on a task of its own (it ends when the client is
    /// dropped).
    pub async fn connect(&self) -> Result<tokio_postgres::Client> {
        let (client, connection) = self.config.connect(self.connector()?).await?;
        tokio::spawn(connection);
        Ok(client)
    }
}

/// libpq's `target_session_attrs` as tokio-postgres knows it (N7). tokio-postgres checks
/// `transaction_read_only` only: `primary` (not in recovery) is read as `read-write`, which
/// a primary is unless configured read-only, and `standby` as `read-only`.
fn target_session_attrs(value: &str) -> Result<tokio_postgres::config::TargetSessionAttrs> {
    use tokio_postgres::config::TargetSessionAttrs as T;
    Ok(match value {
        "any" => T::Any,
        "read-write" | "primary" => T::ReadWrite,
        "read-only" | "standby" => T::ReadOnly,
        other => {
            return Err(Error::Configuration(format!(
                "target_session_attrs={other:?}: expected any, read-write, read-only, primary \
                 or standby (tokio-postgres has no prefer-standby)"
            )))
        }
    })
}

/// Take `sslmode`, `sslrootcert` and `target_session_attrs` out of a conninfo: the rest,
/// and what was taken (decoded), in order.
fn take_tls_params(conninfo: &str) -> Result<(String, Vec<(String, String)>)> {
    let ours = |k: &str| k == "sslmode" || k == "sslrootcert" || k == "target_session_attrs";
    let trimmed = conninfo.trim_start();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = trimmed.split_once('?') else {
            return Ok((conninfo.to_owned(), Vec::new()));
        };
        let (mut kept, mut taken) = (Vec::new(), Vec::new());
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let k = decode(k)?;
            if ours(&k) {
                taken.push((k, decode(v)?));
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, taken));
    }
    let (mut kept, mut taken) = (Vec::new(), Vec::new());
    let pairs = keyword_pairs(conninfo)?;
    for (i, (k, v)) in pairs.iter().cloned().enumerate() {
        if pairs[i + 1..].iter().any(|(later, _)| *later == k) {
            continue; // as in libpq, a keyword given twice takes its last value
        }
        if ours(&k) {
            taken.push((k, v));
        } else {
            // Quoted again, so that any value survives tokio-postgres's parser.
            kept.push(format!(
                "{k}='{}'",
                v.replace('\\', "\\\\").replace('\'', "\\'")
            ));
        }
    }
    Ok((kept.join(" "), taken))
}

fn decode(s: &str) -> Result<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|e| Error::Configuration(format!("conninfo URL: {e}")))
}

/// The `key=value` pairs of libpq's keyword form: values unquoted (up to whitespace) or
/// in single quotes, `\` escaping the next character in both.
fn keyword_pairs(s: &str) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(Error::Configuration(format!(
                "conninfo: {key:?} has no \"=\" after it"
            )));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let quoted = chars.next_if_eq(&'\'').is_some();
        let mut value = String::new();
        loop {
            match chars.next() {
                None if quoted => {
                    return Err(Error::Configuration(format!(
                        "conninfo: the value of {key} has no closing quote"
                    )))
                }
                None => break,
                Some('\'') if quoted => break,
                Some(c) if c.is_whitespace() && !quoted => break,
                Some('\\') => value.extend(chars.next()),
                Some(c) => value.push(c),
            }
        }
        pairs.push((key, value));
    }
}

/// What the conninfo leaves unset, from libpq's environment variables.
fn apply_env(
    config: &mut tokio_postgres::Config,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<()> {
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        if let Some(hosts) = env("PGHOST") {
            for host in hosts.split(',') {
                config.host(host);
            }
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = env("PGPORT") {
            for port in ports.split(',') {
                let port = port.trim().parse().map_err(|_| {
                    Error::Configuration(format!("PGPORT={ports:?} is not a port number"))
                })?;
                config.port(port);
            }
        }
    }
    type Setter = fn(&mut tokio_postgres::Config, String);
    let texts: [(&str, bool, Setter); 5] = [
        ("PGUSER", config.get_user().is_none(), |c, v| {
            c.user(v);
        }),
        ("PGPASSWORD", config.get_password().is_none(), |c, v| {
            c.password(v);
        }),
        ("PGDATABASE", config.get_dbname().is_none(), |c, v| {
            c.dbname(v);
        }),
        (
            "PGAPPNAME",
            config.get_application_name().is_none(),
            |c, v| {
                c.application_name(v);
            },
        ),
        ("PGOPTIONS", config.get_options().is_none(), |c, v| {
            c.options(v);
        }),
    ];
    for (var, unset, set) in texts {
        // libpq's last resort for the user is the operating system's.
        let value = env(var).or_else(|| (var == "PGUSER").then(|| env("USER")).flatten());
        if let (true, Some(value)) = (unset, value) {
            set(config, value);
        }
    }
    if config.get_connect_timeout().is_none() {
        if let Some(secs) = env("PGCONNECT_TIMEOUT") {
            let secs: u64 = secs.trim().parse().map_err(|_| {
                Error::Configuration(format!(
                    "PGCONNECT_TIMEOUT={secs:?} is not a number of seconds"
                ))
            })?;
            config.connect_timeout(Duration::from_secs(secs));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn all_five_sslmodes_are_read_from_either_form() {
        for (mode, want) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
        ] {
            let kw = Conninfo::parse_with_env(&format!("host=h user=u sslmode={mode}"), env(&[]))
                .unwrap();
            let url =
                Conninfo::parse_with_env(&format!("postgres://u@h/db?sslmode={mode}"), env(&[]))
                    .unwrap();
            assert_eq!((kw.ssl_mode(), url.ssl_mode()), (want, want));
        }
        let bad = Conninfo::parse_with_env("host=h sslmode=verify", env(&[])).unwrap_err();
        assert!(bad.to_string().contains("verify-full"), "{bad}");
    }

    #[test]
    fn sslrootcert_is_taken_out_and_the_rest_kept() {
        let (rest, taken) = take_tls_params(
            r"host=h  port = 5 sslrootcert='/a b/ca.crt' password='it\'s' sslmode=verify-full",
        )
        .unwrap();
        assert_eq!(rest, r"host='h' port='5' password='it\'s'");
        assert_eq!(
            taken,
            [
                ("sslrootcert".into(), "/a b/ca.crt".into()),
                ("sslmode".into(), "verify-full".into())
            ]
        );
        let (rest, taken) = take_tls_params(
            "postgres://u@h:5/db?application_name=x&sslrootcert=%2Fa%20b%2Fca.crt&sslmode=require",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@h:5/db?application_name=x");
        assert_eq!(taken[0], ("sslrootcert".into(), "/a b/ca.crt".into()));
        let c = Conninfo::parse_with_env(&rest, env(&[])).unwrap();
        assert_eq!(c.config().get_password(), None);
        assert!(keyword_pairs("host='h").is_err());
        let (rest, _) = take_tls_params("host=a port=1 host=b").unwrap();
        assert_eq!(rest, "port='1' host='b'");
        assert!(keyword_pairs("host").is_err());
    }

    #[test]
    fn the_environment_fills_what_the_conninfo_leaves_unset() {
        let vars = [
            ("PGHOST", "db1,db2"),
            ("PGPORT", "6432,6433"),
            ("PGUSER", "app"),
            ("PGDATABASE", "appdb"),
            ("PGPASSWORD", "pw"),
            ("PGSSLMODE", "require"),
            ("PGAPPNAME", "a"),
            ("PGCONNECT_TIMEOUT", "7"),
        ];
        let c = Conninfo::parse_with_env("", env(&vars)).unwrap();
        let cfg = c.config();
        assert_eq!(cfg.get_hosts().len(), 2);
        assert_eq!(cfg.get_ports(), [6432, 6433]);
        assert_eq!(cfg.get_user(), Some("app"));
        assert_eq!(cfg.get_dbname(), Some("appdb"));
        assert_eq!(cfg.get_password(), Some(&b"pw"[..]));
        assert_eq!(cfg.get_application_name(), Some("a"));
        assert_eq!(cfg.get_connect_timeout(), Some(&Duration::from_secs(7)));
        assert_eq!(c.ssl_mode(), SslMode::Require);
        // The string wins over the environment.
        let c = Conninfo::parse_with_env("user=me port=1 sslmode=disable", env(&vars)).unwrap();
        assert_eq!(
            (c.config().get_user(), c.config().get_ports(), c.ssl_mode()),
            (Some("me"), &[1][..], SslMode::Disable)
        );
        let bad = Conninfo::parse_with_env("", env(&[("PGPORT", "x")])).unwrap_err();
        assert!(bad.to_string().contains("PGPORT"), "{bad}");
    }

    /// N7: several hosts in either form, and target_session_attrs as libpq spells it, from
    /// the string or PGTARGETSESSIONATTRS.
    #[test]
    fn several_hosts_and_a_target_pass_through() {
        use tokio_postgres::config::{Host, TargetSessionAttrs};
        let hosts = |c: &Conninfo| -> Vec<String> {
            c.config()
                .get_hosts()
                .iter()
                .map(|h| match h {
                    Host::Tcp(h) => h.clone(),
                    #[allow(unreachable_patterns)]
                    _ => "socket".into(),
                })
                .collect()
        };
        for s in [
            "host=db1,db2 port=5432,5433 user=u target_session_attrs=read-write",
            "postgresql://u@db1:5432,db2:5433/app?target_session_attrs=read-write",
            "postgresql://u@db1:5432,db2:5433/app?sslmode=disable&target_session_attrs=primary",
        ] {
            let c = Conninfo::parse_with_env(s, env(&[])).unwrap();
            assert_eq!(hosts(&c), ["db1", "db2"], "{s}");
            assert_eq!(c.config().get_ports(), [5432, 5433], "{s}");
            assert_eq!(
                c.config().get_target_session_attrs(),
                TargetSessionAttrs::ReadWrite,
                "{s}"
            );
        }
        let c = Conninfo::parse_with_env(
            "host=a,b",
            env(&[("PGTARGETSESSIONATTRS", "standby"), ("PGPORT", "1")]),
        )
        .unwrap();
        assert_eq!(
            (
                c.config().get_target_session_attrs(),
                c.config().get_ports()
            ),
            (TargetSessionAttrs::ReadOnly, &[1][..])
        );
        let e = Conninfo::parse_with_env("host=a,b target_session_attrs=prefer-standby", env(&[]))
            .unwrap_err();
        assert!(e.to_string().contains("prefer-standby"), "{e}");
    }

    #[test]
    fn a_verified_mode_needs_a_ca_that_exists() {
        let e = Conninfo::parse_with_env("host=h sslmode=verify-full", env(&[])).unwrap_err();
        assert!(e.to_string().contains("sslrootcert"), "{e}");
        let e = Conninfo::parse_with_env(
            "host=h sslmode=verify-ca sslrootcert=/nonexistent/ca.crt",
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
    }
}
