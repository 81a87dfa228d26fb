//! Rules of docs/clients.md that the Rust client once broke, each against a real server
//! (directly, through PgBouncer, and over TLS where those are set).

mod common;

use common::{fresh, setups, with_param};
use pg_once_client::{CallOptions, Client, Error, Options};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// N6: getting a pooled connection waits at most `connect_timeout`, even when every
/// connection of the pool is taken (it used to wait for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_times_out() {
    let setup = &setups()[0];
    let options = Options {
        pool_size: 1,
        connect_timeout: Duration::from_millis(300),
        listen: false,
        ..Options::default()
    };
    let client = setup.client("rust-busy-pool", options).await;
    let held = client.pool().get().await.unwrap();
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(5), client.invalidate(&fresh("busy")))
        .await
        .expect("waited past connect_timeout")
        .unwrap_err();
    assert!(matches!(err, Error::Pool(_)), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    drop(held);
    client.invalidate(&fresh("free")).await.unwrap();
}

/// V1/V3: a value that does not read back as its own type (a NaN, which JSON writes as
/// null) is refused before it is stored: the computing caller gets `Serialize`, and the
/// key is failed with the reason (V4), so another caller gets `Failed`, not a null.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_does_not_read_back_is_not_stored() {
    let setup = &setups()[0];
    let client = setup.client("rust-nan", Options::default()).await;
    let key = fresh("nan");
    let err = client
        .get_or_compute(
            &key,
            || async { Ok::<_, std::io::Error>(f64::NAN) },
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotSerializable { .. }), "{err}");
    let other = setup.client("rust-nan-2", Options::default()).await;
    let shared = other
        .get_or_compute(
            &key,
            || async { Ok::<_, std::io::Error>(1.0) },
            CallOptions::default(),
        )
        .await;
    assert!(matches!(shared, Err(Error::Failed { .. })), "{shared:?}");
}

/// C7, K: a function wrapped with `cached_named` stores its result under the key rule K
/// derives (what a Python or Node process calling `name(7, "eu")` would use), and its
/// `invalidate` forgets that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_named_uses_the_shared_default_key() {
    for setup in setups() {
        let client = setup.client("rust-cached-named", Options::default()).await;
        let name = fresh("report");
        let report =
            client.cached_named(
                &name,
                |(n, region): (i32, String)| async move {
                    Ok::<_, std::io::Error>(format!("{region}{n}"))
                },
                CallOptions::default(),
            );
        let args = (7, "eu".to_string());
        let got: String = report.call(args.clone()).await.unwrap();
        assert_eq!(got, "eu7");
        let key = format!("{name}:[7,\"eu\"]");
        assert_eq!(report.key(&args).unwrap(), key);
        let admin = setup.admin().await;
        let stored: i64 = admin
            .query_one(
                "SELECT count(*) FROM once.entries WHERE key = $1 AND state = 'done'",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(stored, 1, "[{}]", setup.name);
        assert!(report.invalidate(&args).await.unwrap(), "[{}]", setup.name);
    }
}

/// F2: a compute function's error is stored as `Type: message`, the form the Python and
/// Node clients store, so that every caller elsewhere reads the same kind of text; the
/// computing caller gets its own error back. (The unit test of `failure_text` has an
/// error type of its own; here a standard one, named the same way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compute_error_is_stored_as_type_colon_message() {
    for setup in setups() {
        let client = setup.client("rust-f2", Options::default()).await;
        let key = fresh("f2");
        let mine = client
            .get_or_compute(
                &key,
                || async { "x".parse::<i32>() },
                CallOptions::default(),
            )
            .await;
        match mine {
            Err(Error::Compute { source, .. }) => {
                assert!(
                    source.is::<std::num::ParseIntError>(),
                    "[{}] {source:?}",
                    setup.name
                )
            }
            other => panic!("[{}] {other:?}", setup.name),
        }
        let shared = client
            .get_or_compute(
                &key,
                || async { Ok::<_, std::io::Error>(1) },
                CallOptions::default(),
            )
            .await;
        match shared {
            Err(Error::Failed { message, .. }) => {
                assert_eq!(
                    message, "ParseIntError: invalid digit found in string",
                    "[{}]",
                    setup.name
                )
            }
            other => panic!("[{}] {other:?}", setup.name),
        }
    }
}

/// A client whose pool connects to `port` on 127.0.0.1, without a LISTEN connection.
async fn client_on(port: u16, connect_timeout: Duration) -> Client {
    Client::connect(
        &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres"),
        Options {
            listen: false,
            connect_timeout,
            ..Options::default()
        },
    )
    .await
    .expect("client")
}

/// A server that closes every connection at once: its port, how many connections it
/// accepted, and its task (abort it when done).
async fn closing_server() -> (u16, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closing.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let server = tokio::spawn(async move {
        while let Ok((socket, _)) = closing.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(socket);
        }
    });
    (port, accepted, server)
}

/// R2, N6: retries of a connection failure stop at the call's own `wait`. A server that
/// closes every connection at once: with `wait` 20 ms the call is tried twice (the second
/// at once; the third would come after a pause of at least 25 ms, past the wait) and
/// returns the connection error, where the retries alone would try it 4 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_retries_stop_at_the_calls_wait() {
    let (port, accepted, server) = closing_server().await;
    let client = client_on(port, Duration::from_secs(10)).await;
    let opts = CallOptions {
        wait: Some(Duration::from_millis(20)),
        ..CallOptions::default()
    };
    let got = client
        .get_or_compute("r2", || async { Ok::<_, std::io::Error>(1) }, opts)
        .await;
    server.abort();
    match got {
        Err(e) => assert!(e.is_connection_error(), "{e:?}"),
        Ok(v) => panic!("{v}"),
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

/// R2: a statement without a `wait` (here `invalidate_key`) is retried for the client's
/// `connect_timeout` (600 ms), long enough for a failover: more than the 4 attempts of
/// before, and no attempt starts past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_retries_last_connect_timeout() {
    let (port, accepted, server) = closing_server().await;
    let client = client_on(port, Duration::from_millis(600)).await;
    let started = Instant::now();
    let got = client.invalidate("r2-budget").await;
    let took = started.elapsed();
    server.abort();
    match got {
        Err(e) => assert!(e.is_connection_error(), "{e:?}"),
        Ok(v) => panic!("{v}"),
    }
    let attempts = accepted.load(Ordering::SeqCst);
    assert!(attempts > 4, "{attempts} attempts");
    assert!(took < Duration::from_millis(600 + 1000), "{took:?}"); // a loaded machine's slack
}

/// R2, N6: a server that accepts connections and never answers. The first attempt waits
/// its `connect_timeout` (1 s); no retry starts after the call's `wait` (300 ms) has run
/// out, where 4 attempts would take 4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_is_not_retried_past_the_wait() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            sockets.push(socket); // held open, never answered
        }
    });
    let client = client_on(port, Duration::from_secs(1)).await;
    let opts = CallOptions {
        wait: Some(Duration::from_millis(300)),
        ..CallOptions::default()
    };
    let started = Instant::now();
    let got = client
        .get_or_compute("r2-silent", || async { Ok::<_, std::io::Error>(1) }, opts)
        .await;
    let took = started.elapsed();
    held.abort();
    match got {
        Err(e) => assert!(e.is_connection_error(), "{e:?}"),
        Ok(v) => panic!("{v}"),
    }
    assert!(took < Duration::from_millis(1900), "{took:?}");
}

/// A TCP proxy to `target` that can go silent (every byte dropped, both ways, nothing
/// closed: a network that died without a FIN or RST) and close every connection.
struct Proxy {
    port: u16,
    silent: Arc<std::sync::atomic::AtomicBool>,
    links: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let silent = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let links = Arc::new(std::sync::Mutex::new(Vec::new()));
        let accept = {
            let (silent, links) = (silent.clone(), links.clone());
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        continue;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    for (mut from, mut to) in [(ri, wo), (ro, wi)].map(|(r, w)| {
                        (
                            Box::new(r) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                            w,
                        )
                    }) {
                        let silent = silent.clone();
                        links.lock().unwrap().push(tokio::spawn(async move {
                            let mut buf = vec![0u8; 16384];
                            while let Ok(n @ 1..) = from.read(&mut buf).await {
                                if !silent.load(Ordering::SeqCst)
                                    && to.write_all(&buf[..n]).await.is_err()
                                {
                                    break;
                                }
                            }
                        }));
                    }
                }
            })
        };
        Proxy {
            port,
            silent,
            links,
            accept,
        }
    }

    fn silence(&self, on: bool) {
        self.silent.store(on, Ordering::SeqCst);
    }

    /// Close every connection made so far (their sockets are dropped).
    fn cut(&self) {
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// N4: a LISTEN connection whose network goes silent (no FIN, no RST) is noticed by the
/// check after 5 s of silence, answered within 5 s, and replaced by a new connection
/// with a new owner pid; without the check nothing would notice for minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_connection_that_goes_silent_is_replaced() {
    let setup = &setups()[0];
    let dsn = &setup.direct_dsn;
    let param = |key: &str| {
        dsn.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .map(str::to_owned)
    };
    let target = format!(
        "{}:{}",
        param("host").unwrap_or_else(|| "127.0.0.1".into()),
        param("port").unwrap_or_else(|| "5432".into())
    );
    let proxy = Proxy::start(target).await;
    let via = with_param(
        &with_param(dsn, "host", "127.0.0.1"),
        "port",
        &proxy.port.to_string(),
    );
    let client = Client::connect(
        dsn,
        Options {
            listen_conninfo: Some(via),
            ..Options::default()
        },
    )
    .await
    .unwrap();
    client.ready(Duration::from_secs(10)).await.unwrap();
    let before = client.owner_pid().expect("connected");
    proxy.silence(true);
    let started = Instant::now();
    while client.owner_pid() == Some(before) && started.elapsed() < Duration::from_secs(12) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let noticed = started.elapsed();
    assert!(
        noticed < Duration::from_secs(12),
        "not noticed in {noticed:?}"
    );
    proxy.silence(false);
    proxy.cut(); // the old connection (and any attempt made while silent) is gone
    client.ready(Duration::from_secs(15)).await.unwrap();
    let after = client.owner_pid().expect("reconnected");
    assert_ne!(after, before, "noticed after {noticed:?}");
}
