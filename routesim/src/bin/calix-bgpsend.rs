//! `calix-bgpsend`: the agent's BGP peer task ([`calix_agent::bgp::peer_task::run`]) as a
//! sender of many prefixes to one peer, in the network namespace it runs in, for `cargo xtask
//! bench bgp` (xtask cannot depend on calix-agent: it builds before the eBPF toolchain exists).
//!
//! No IPAM and no datastore: the task's [`Ctx`] is built here, as the speaker's `start()` does,
//! its `wanted` watch holding `--prefixes` consecutive prefixes of length `--len` from
//! `--first`, all via `--local` (the session's source and the routes' next hop); the import
//! rule is empty (nothing the peer sends is taken).
//!
//! Talks on stdio:
//! - prints `encoded <announce ms> <withdraw ms> <messages> <bytes>` first: what
//!   `Advertised::update_to` takes to build the UPDATEs for the whole set and for its
//!   withdrawal, in this process, before any session (median of 5), and the announcement's
//!   message count and size;
//! - prints `established` once the session is up (the wanted set still empty);
//! - on the line `announce`, puts the whole set in the watch; on `withdraw`, the empty set;
//!   each answered `ok`;
//! - stops when stdin closes (a Cease to the peer). Errors go to stderr.
use std::io::{BufRead, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_agent::bgp::peer_task::{self, Ctx, PeerState, Stop, Wanted};
use calix_agent::bgp::settings::PeerSettings;
use calix_bgp::advertise::Advertised;
use calix_bgp::import::ImportRule;
use calix_bgp::peer::LimitAction;
use calix_bgp::update::AsSegment;
use calix_bgp::{Family, PathAttributes, UpdateBuilder};
use clap::Parser;
use ipnet::{IpNet, Ipv4Net};
use tokio::sync::{mpsc, watch};

#[derive(Parser)]
#[command(about = "calix's BGP peer task sending many prefixes to one peer (for the benches)")]
struct Args {
    /// This end's address: the session's source, the routes' next hop, the router ID.
    #[arg(long)]
    local: Ipv4Addr,
    /// The peer's address.
    #[arg(long)]
    peer: Ipv4Addr,
    #[arg(long)]
    asn: u32,
    #[arg(long)]
    peer_asn: u32,
    /// Proposed hold time (s).
    #[arg(long, default_value_t = 90)]
    hold_time: u16,
    /// How many prefixes the set holds.
    #[arg(long, default_value_t = 10_000)]
    prefixes: u32,
    /// The first prefix's address; the others follow it.
    #[arg(long)]
    first: Ipv4Addr,
    /// The prefixes' length.
    #[arg(long, default_value_t = 26)]
    len: u8,
}

/// `n` consecutive prefixes of length `len` from `first`, each via `hop`.
fn prefixes(first: Ipv4Addr, len: u8, n: u32, hop: IpAddr) -> Result<Wanted> {
    let step = 1u32
        .checked_shl(32 - u32::from(len))
        .context("--len must be 1–32")?;
    (0..n)
        .map(|k| {
            let addr = u32::from(first)
                .checked_add(k * step)
                .context("the prefixes run past 255.255.255.255")?;
            let net = Ipv4Net::new(addr.into(), len)?;
            Ok((IpNet::V4(net.trunc()), hop))
        })
        .collect()
}

/// What building the set's UPDATEs takes here (median of 5 each): announcing everything to a
/// fresh session, withdrawing everything; the announcement's messages and bytes.
fn encode_cost(wanted: &Wanted, asn: u32) -> (f64, f64, usize, usize) {
    // As the peer task builds it for an eBGP session (peer_task::Peer::builder).
    let builder = UpdateBuilder {
        four_octet_as: true,
        attributes: PathAttributes {
            as_path: vec![AsSegment {
                set: false,
                asns: vec![asn],
            }],
            ..PathAttributes::default()
        },
    };
    let families = [Family::IPV4_UNICAST];
    let empty = Wanted::new();
    let (mut up, mut down, mut shape) = (Vec::new(), Vec::new(), (0, 0));
    for _ in 0..5 {
        let mut adv = Advertised::default();
        let t = Instant::now();
        let msgs = adv.update_to(wanted, &families, &builder);
        up.push(t.elapsed().as_secs_f64() * 1e3);
        shape = (msgs.len(), msgs.iter().map(Vec::len).sum());
        let t = Instant::now();
        let gone = adv.update_to(&empty, &families, &builder);
        down.push(t.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(gone);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(&mut up), median(&mut down), shape.0, shape.1)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() -> Result<()> {
    calix_agent::memory::configure_allocator();
    let a = Args::parse();
    let hop = IpAddr::V4(a.local);
    let full = Arc::new(prefixes(a.first, a.len, a.prefixes, hop)?);
    let (enc_up, enc_down, messages, bytes) = encode_cost(&full, a.asn);
    say(&format!(
        "encoded {enc_up:.3} {enc_down:.3} {messages} {bytes}"
    ));
    // stdin's lines, read on a thread of their own; EOF closes the channel.
    let (cmd_tx, mut cmd_rx) = mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if cmd_tx.send(line.trim().to_string()).is_err() {
                break;
            }
        }
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let empty = Arc::new(Wanted::new());
        let (wanted_tx, wanted_rx) = watch::channel(Some(empty.clone()));
        let (_import_tx, import_rx) = watch::channel(Arc::new(ImportRule::default()));
        let (stop_tx, stop_rx) = watch::channel(None);
        let (events_tx, mut events_rx) = mpsc::channel(1024);
        let ctx = Ctx {
            asn: a.asn,
            router_id: a.local,
            own: vec![hop],
            restart_time: 120,
            wanted: wanted_rx,
            import: import_rx,
            stop: stop_rx,
            notices: Arc::default(),
        };
        let spec = PeerSettings {
            name: "receiver".into(),
            address: IpAddr::V4(a.peer),
            port: calix_agent::bgp::conn::PORT,
            asn: a.peer_asn,
            password: None,
            hold_time: a.hold_time,
            graceful_restart: false,
            max_prefixes: 1_000_000,
            limit_action: LimitAction::Refuse,
            communities: Vec::new(),
        };
        let shared = Arc::new(Mutex::new(PeerState::new(&spec)));
        // It only connects: nothing comes in.
        let (_incoming, incoming_rx) = tokio::sync::mpsc::channel(1);
        let task = tokio::spawn(peer_task::run(
            0,
            spec,
            ctx,
            shared.clone(),
            events_tx,
            incoming_rx,
        ));
        // The speaker's loop reads these; nothing is imported here, but the task must not
        // block on a full channel.
        tokio::spawn(async move { while events_rx.recv().await.is_some() {} });
        let state = || {
            let s = shared.lock().unwrap_or_else(|p| p.into_inner());
            (s.report.state.clone(), s.report.last_error.clone())
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while state().0 != "Established" {
            if Instant::now() > deadline {
                let (st, err) = state();
                bail!("no session within 60 s: {st}, last error {err:?}");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        say("established");
        while let Some(cmd) = cmd_rx.recv().await {
            let set = match cmd.as_str() {
                "announce" => full.clone(),
                "withdraw" => empty.clone(),
                _ => continue,
            };
            wanted_tx.send_replace(Some(set));
            say("ok");
        }
        let _ = stop_tx.send(Some(Stop::ForGood));
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        Ok(())
    })
}
