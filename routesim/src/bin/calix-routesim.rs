//! `calix-routesim`: simulated route-distribution peers ([`calix_routesim::scale`]) in the
//! network namespace it runs in, for `cargo xtask bench routes`.
//!
//! Talks on stdio: prints `ready <ms>` once the blocks are in etcd (`<ms>` to write them) and
//! every server listens; writes the node records when it reads the line `announce`, then
//! prints `announced <ms>`; stops when stdin closes. Errors go to stderr.
use std::io::{BufRead, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use anyhow::{Context, Result};
use calix_routesim::{scale, Credentials, Event, Scale};
use calix_testbed::tls::Ca;
use clap::Parser;
use ipnet::Ipv4Net;

#[derive(Parser)]
#[command(about = "simulated calix route-distribution peers (for the benches)")]
struct Args {
    /// etcd client URL.
    #[arg(long)]
    etcd: String,
    /// The directory `Ca::save` wrote the CA into.
    #[arg(long)]
    ca_dir: PathBuf,
    /// The CA's name (its common name).
    #[arg(long)]
    ca_name: String,
    #[arg(long, default_value_t = 100)]
    peers: u32,
    #[arg(long, default_value_t = 100)]
    blocks: u32,
    /// The pool the blocks are carved from.
    #[arg(long)]
    pool: Ipv4Net,
    #[arg(long, default_value_t = 26)]
    block_len: u8,
    /// Peer k's address (next hop) is this + k.
    #[arg(long)]
    first_hop: Ipv4Addr,
    /// Peer k's server listens on this + k.
    #[arg(long, default_value_t = 6000)]
    first_port: u16,
    /// This namespace's address, where the agent dials the servers.
    #[arg(long)]
    host: IpAddr,
    /// A reflector (its node address and port) relays every peer's routes; without: a mesh.
    #[arg(long)]
    reflector: Option<SocketAddrV4>,
    /// The node allowed to watch (the agent under test); repeatable.
    #[arg(long, required = true)]
    known: Vec<String>,
    /// An address the known nodes connect from (every other source is refused before TLS);
    /// repeatable.
    #[arg(long, required = true)]
    known_address: Vec<IpAddr>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let ca = Ca::load(&a.ca_dir, &a.ca_name).context("loading the CA")?;
    let mut plan = scale(
        &Scale {
            peers: a.peers,
            blocks_per_peer: a.blocks,
            pool: a.pool,
            block_len: a.block_len,
            first_hop: a.first_hop,
            first_port: a.first_port,
            host: a.host,
            reflector: a.reflector.map(|r| (*r.ip(), r.port())),
        },
        a.known,
    )?;
    plan.known_addresses = a.known_address;
    let creds = Credentials::issue(&ca, &plan)?;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let (announce_tx, announce_rx) = tokio::sync::oneshot::channel::<()>();
    // stdin: the line `announce`, then EOF (stop). Read on a thread of its own.
    std::thread::spawn(move || {
        let mut announce = Some(announce_tx);
        for line in std::io::stdin().lock().lines() {
            match line.as_deref().map(str::trim) {
                Ok("announce") => {
                    if let Some(tx) = announce.take() {
                        let _ = tx.send(());
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let _ = stop.send(true);
    });
    let say = |e: Event| {
        let line = match e {
            Event::Ready(d) => format!("ready {:.0}", d.as_secs_f64() * 1e3),
            Event::Announced(d) => format!("announced {:.0}", d.as_secs_f64() * 1e3),
        };
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let announce = async {
            if announce_rx.await.is_err() {
                // stdin closed before `announce`: nothing to announce; `stop` ends the run.
                std::future::pending::<()>().await;
            }
        };
        calix_routesim::run(a.etcd, creds, plan, announce, say, stop_rx).await
    })?;
    Ok(())
}
