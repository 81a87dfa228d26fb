//! A TCP proxy of the tests' own in front of the server, which can hold what the server
//! sends (clients/conformance/README.md, `"proxy": true`, `pause` and `resume`): a
//! statement sent while it is paused reaches the server and is run there, and its answer
//! is on its way for as long as the test likes.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where the proxy forwards to: the first server of a connection string.
#[derive(Debug, Clone)]
pub enum Server {
    Tcp(String, u16),
    /// A Unix-domain socket's directory and port (`.s.PGSQL.<port>` in it).
    Unix(PathBuf, u16),
}

impl Server {
    /// The first server `dsn` names (its `hostaddr` if it has one), as the client would
    /// try it first.
    pub fn of(dsn: &str) -> Server {
        let parsed = pg_once_client::Conninfo::parse(dsn).expect("conninfo");
        let config = parsed.config();
        let port = config.get_ports().first().copied().unwrap_or(5432);
        if let Some(addr) = config.get_hostaddrs().first() {
            return Server::Tcp(addr.to_string(), port);
        }
        match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => Server::Tcp(host.clone(), port),
            #[cfg(unix)]
            Some(tokio_postgres::config::Host::Unix(dir)) => Server::Unix(dir.clone(), port),
            None => Server::Tcp("localhost".into(), port),
        }
    }

    async fn connect(&self) -> std::io::Result<(BoxRead, BoxWrite)> {
        match self {
            Server::Tcp(host, port) => {
                let (r, w) = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await?
                    .into_split();
                Ok((Box::new(r), Box::new(w)))
            }
            #[cfg(unix)]
            Server::Unix(dir, port) => {
                let socket = dir.join(format!(".s.PGSQL.{port}"));
                let (r, w) = tokio::net::UnixStream::connect(socket).await?.into_split();
                Ok((Box::new(r), Box::new(w)))
            }
            #[cfg(not(unix))]
            Server::Unix(..) => Err(std::io::Error::other("no Unix-domain sockets here")),
        }
    }
}

type BoxRead = Box<dyn AsyncRead + Unpin + Send>;
type BoxWrite = Box<dyn AsyncWrite + Unpin + Send>;

/// A proxy on 127.0.0.1 (an ephemeral port) to one server. Bytes from the clients always
/// flow; bytes from the server flow unless it is paused. Dropped, it closes every
/// connection it made.
pub struct HoldingProxy {
    pub port: u16,
    paused: watch::Sender<bool>,
    accept: JoinHandle<()>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl HoldingProxy {
    pub async fn start(server: Server) -> HoldingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port for the proxy");
        let port = listener.local_addr().unwrap().port();
        let (paused, _) = watch::channel(false);
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (paused, links) = (paused.clone(), links.clone());
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let Ok((from_server, to_server)) = server.connect().await else {
                        continue; // the client sees its connection closed
                    };
                    let (from_client, to_client) = inbound.into_split();
                    let mut links = links.lock().unwrap();
                    links.push(tokio::spawn(forward(
                        Box::new(from_client),
                        to_server,
                        None,
                    )));
                    links.push(tokio::spawn(forward(
                        from_server,
                        Box::new(to_client),
                        Some(paused.subscribe()),
                    )));
                }
            })
        };
        HoldingProxy {
            port,
            paused,
            accept,
            links,
        }
    }

    /// Hold every byte the server sends from now on, on every connection, open or new.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Forward what was held, and go on forwarding.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}

/// Copy `from` to `to` until either end closes; with `held`, each chunk read waits while
/// it says the proxy is paused before it is written (later chunks stay in the socket
/// behind it, so nothing is reordered).
async fn forward(mut from: BoxRead, mut to: BoxWrite, mut held: Option<watch::Receiver<bool>>) {
    let mut buf = vec![0u8; 16384];
    while let Ok(n @ 1..) = from.read(&mut buf).await {
        if let Some(paused) = &mut held {
            if paused.wait_for(|paused| !*paused).await.is_err() {
                return; // the proxy is gone
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}
