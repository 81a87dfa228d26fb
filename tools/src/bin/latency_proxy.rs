//! A TCP proxy that adds a fixed delay to every byte in each direction, so benchmarks can
//! show what round trips cost between a pod and its database (this machine's loopback has
//! no netem). Order and pipelining are kept: each direction is a queue of (due, bytes).
//!
//!   latency_proxy --listen 127.0.0.1:6544 --upstream 127.0.0.1:5432 --delay-us 250

use anyhow::Result;
use clap::Parser;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "TCP proxy adding a one-way delay in each direction")]
struct Args {
    #[arg(long)]
    listen: String,
    #[arg(long)]
    upstream: String,
    /// One-way delay in microseconds (a round trip gains twice this).
    #[arg(long, default_value_t = 250)]
    delay_us: u64,
}

/// Copy `from` to `to`, each chunk released `delay` after it was read.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0
            || tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
        {
            break;
        }
    }
    drop(tx);
    let _ = writer.join();
}

fn main() -> Result<()> {
    let args = Args::parse();
    let delay = Duration::from_micros(args.delay_us);
    let listener = TcpListener::bind(&args.listen)?;
    for client in listener.incoming() {
        let client = client?;
        let upstream = TcpStream::connect(&args.upstream)?;
        client.set_nodelay(true)?;
        upstream.set_nodelay(true)?;
        let (c2, u2) = (client.try_clone()?, upstream.try_clone()?);
        thread::spawn(move || pipe(client, upstream, delay));
        thread::spawn(move || pipe(u2, c2, delay));
    }
    Ok(())
}
