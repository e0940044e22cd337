//! `cargo xtask netperf <mode>` (hidden): the request/response tool of `bench dataplane`,
//! exec'd by the bench inside the pod namespaces (netperf is not packaged in Debian 12).
//!
//! - `server`: accepts connections one at a time; on each, answers every 1-byte request with
//!   a 1-byte reply until the peer closes.
//! - `crr` (netperf's TCP_CRR): connect, 1-byte request, 1-byte reply, close, again and again
//!   for `--secs`: plain blocking calls, no socket options, so each connection costs exactly
//!   `socket`, `connect`, `write`, `read`, `close`. The client closes first (its side keeps the
//!   TIME_WAIT): the bench widens the client namespace's port range and enables
//!   `tcp_tw_reuse`.
//! - `rr` (TCP_RR): one connection (`TCP_NODELAY`), 1-byte ping-pong for `--secs`, every
//!   round trip timed.
//!
//! The clients print one JSON line: `count`, `secs`, `rate` (per second) and, for `rr`, the
//! round trip's `p50_us`, `p99_us` and `mean_us`. A client that does not finish within
//! `--secs` + 10 s is killed by SIGALRM (a dataplane that drops a SYN must not hang the bench).
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Subcommand;
use serde_json::json;

use super::percentile;

#[derive(Subcommand)]
pub enum Mode {
    /// Serve 1-byte request/reply exchanges, one connection at a time, until killed.
    Server {
        #[arg(long)]
        listen: SocketAddr,
    },
    /// TCP_CRR: connect, 1-byte request, 1-byte reply, close, for `secs` seconds.
    Crr {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        secs: f64,
    },
    /// TCP_RR: 1-byte ping-pong on one connection for `secs` seconds.
    Rr {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        secs: f64,
    },
}

pub fn run(mode: Mode) -> Result<()> {
    match mode {
        Mode::Server { listen } => server(listen),
        Mode::Crr { to, secs } => {
            watchdog(secs);
            let (count, elapsed) = crr(to, secs)?;
            print_result(count, elapsed, None);
            Ok(())
        }
        Mode::Rr { to, secs } => {
            watchdog(secs);
            let (count, elapsed, rtts) = rr(to, secs)?;
            print_result(count, elapsed, Some(&rtts));
            Ok(())
        }
    }
}

/// SIGALRM (default action: terminate) `secs` + 10 s from now.
fn watchdog(secs: f64) {
    let limit = secs.max(0.0).ceil() as u32 + 10;
    // SAFETY: alarm(2) has no preconditions.
    unsafe { libc::alarm(limit) };
}

fn server(listen: SocketAddr) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    loop {
        let Ok((mut s, _)) = l.accept() else {
            continue;
        };
        // A client that vanished without closing must not block the server forever.
        if s.set_nodelay(true).is_err()
            || s.set_read_timeout(Some(Duration::from_secs(30))).is_err()
        {
            continue;
        }
        let mut b = [0u8; 1];
        loop {
            match s.read(&mut b) {
                Ok(1) => {
                    if s.write_all(&b).is_err() {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                _ => break,
            }
        }
    }
}

/// One request and its reply on `s`.
fn exchange(s: &mut TcpStream, b: &mut [u8; 1]) -> std::io::Result<()> {
    s.write_all(&b[..])?;
    s.read_exact(&mut b[..])
}

fn crr(to: SocketAddr, secs: f64) -> Result<(u64, f64)> {
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let mut count = 0u64;
    let mut b = [b'x'; 1];
    while Instant::now() < end {
        let mut s =
            TcpStream::connect(to).with_context(|| format!("connection {} to {to}", count + 1))?;
        exchange(&mut s, &mut b).with_context(|| format!("exchange {} with {to}", count + 1))?;
        drop(s);
        count += 1;
    }
    Ok((count, t0.elapsed().as_secs_f64()))
}

fn rr(to: SocketAddr, secs: f64) -> Result<(u64, f64, Vec<f64>)> {
    let mut s = TcpStream::connect(to).with_context(|| format!("cannot connect to {to}"))?;
    s.set_nodelay(true)?;
    let mut b = [b'x'; 1];
    // Round trips in ns; ~30k/s expected, reserve a little more.
    let mut rtts = Vec::with_capacity((secs * 50_000.0) as usize);
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    loop {
        let t = Instant::now();
        if t >= end {
            break;
        }
        exchange(&mut s, &mut b)
            .with_context(|| format!("round trip {} with {to}", rtts.len() + 1))?;
        rtts.push(t.elapsed().as_nanos() as f64);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    Ok((rtts.len() as u64, elapsed, rtts))
}

fn print_result(count: u64, secs: f64, rtts: Option<&[f64]>) {
    let mut v = json!({ "count": count, "secs": secs, "rate": count as f64 / secs });
    if let Some(r) = rtts {
        let mean = r.iter().sum::<f64>() / r.len().max(1) as f64;
        v["p50_us"] = json!(percentile(r, 50.0) / 1e3);
        v["p99_us"] = json!(percentile(r, 99.0) / 1e3);
        v["mean_us"] = json!(mean / 1e3);
    }
    println!("{v}");
}
