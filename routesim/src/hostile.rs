//! A hostile peer: a node with a valid certificate of its own and a node record, whose
//! `calix.v1.Routes` server streams whatever a follower must survive. Each watch of one
//! follower gets the next [`Phase`], in turn, forever; each starts with a snapshot (the
//! follower takes it) and goes on until the follower drops the stream:
//! - [`Phase::Flood`]: deltas without end, each with 2048 routes never seen before (its own,
//!   in 100.64.0.0/10: no block backs them), 256 withdrawals of prefixes it never announced and
//!   32 malformed routes;
//! - [`Phase::BigMore`]: one delta continued (`more: true`) forever, in messages of ~3.5 MiB
//!   of malformed withdrawals;
//! - [`Phase::SmallMore`]: one delta continued forever in empty messages;
//! - [`Phase::TooLarge`]: a message of 5 MiB (over the receivers' 4 MiB);
//! - [`Phase::Withdrawals`]: for 5 s, deltas of 2048 withdrawals of prefixes never announced
//!   each (not a protocol error: ignored and counted), then the stream ends.
//!
//! It serves on port 5474 of the calling thread's namespace through the agent's own TCP door
//! ([`listener::serve_with`]: mutual TLS, the same limits), so only the stream is hostile.
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use calix_agent::distribution::listener::{self, Limits};
use calix_core::store::keys;
use calix_core::wire::pb;
use calix_datastore::{Datastore, Durability, EtcdConfig, EtcdStore, Op};
use calix_testbed::tls::Ca;
use calix_testbed::Cluster;
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::{record, tls_material};

/// The port it serves on.
pub const PORT: u16 = 5474;

/// What one watch gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Flood,
    BigMore,
    SmallMore,
    TooLarge,
    Withdrawals,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Flood,
        Phase::BigMore,
        Phase::SmallMore,
        Phase::TooLarge,
        Phase::Withdrawals,
    ];
}

/// What the hostile peer sent, over every watch.
#[derive(Debug, Default)]
pub struct Sent {
    pub watches: AtomicU64,
    pub messages: AtomicU64,
    pub bytes: AtomicU64,
}

struct Svc {
    name: String,
    hop: Ipv4Addr,
    /// Watches so far by watching node (each follower goes through every phase).
    turns: Mutex<HashMap<String, usize>>,
    sent: Arc<Sent>,
}

type Updates = Pin<Box<dyn Stream<Item = Result<pb::RouteUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl pb::routes_server::Routes for Svc {
    type WatchStream = Updates;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let node = req.into_inner().node;
        let turn = {
            let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
            let t = turns.entry(node).or_default();
            *t += 1;
            *t - 1
        };
        self.sent.watches.fetch_add(1, Ordering::Relaxed);
        let phase = Phase::ALL[turn % Phase::ALL.len()];
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(feed(
            phase,
            self.name.clone(),
            self.hop,
            tx,
            self.sent.clone(),
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn verdict(
        &self,
        _req: Request<pb::VerdictRequest>,
    ) -> Result<Response<pb::VerdictResponse>, Status> {
        Err(Status::unimplemented("a hostile peer traces nothing"))
    }
}

fn route(prefix: String, node: &str, hop: Ipv4Addr) -> pb::Route {
    pb::Route {
        prefix,
        node: node.to_string(),
        next_hop: hop.to_string(),
    }
}

/// The `i`-th address of 100.64.0.0/10, as a /32.
fn host(i: u32) -> String {
    format!("{}/32", Ipv4Addr::from(0x6440_0000 | (i & 0x003f_ffff)))
}

fn update(kind: pb::route_update::Kind, generation: u64, more: bool) -> pb::RouteUpdate {
    pb::RouteUpdate {
        kind: kind as i32,
        generation,
        routes: vec![],
        withdrawn: vec![],
        more,
    }
}

/// Streams `phase` into `tx` until the follower goes.
async fn feed(
    phase: Phase,
    name: String,
    hop: Ipv4Addr,
    tx: mpsc::Sender<Result<pb::RouteUpdate, Status>>,
    sent: Arc<Sent>,
) {
    use pb::route_update::Kind;
    let send = |m: pb::RouteUpdate| {
        let tx = tx.clone();
        let sent = sent.clone();
        async move {
            use prost::Message as _;
            sent.messages.fetch_add(1, Ordering::Relaxed);
            sent.bytes
                .fetch_add(m.encoded_len() as u64, Ordering::Relaxed);
            tx.send(Ok(m)).await.is_ok()
        }
    };
    let mut snap = update(Kind::Snapshot, 1, false);
    snap.routes = (0..4).map(|i| route(host(i), &name, hop)).collect();
    if !send(snap).await {
        return;
    }
    match phase {
        Phase::Flood => {
            // Never-announced withdrawals come from the top of the range, routes from below.
            let mut next = 4u32;
            for generation in 2.. {
                let mut m = update(Kind::Delta, generation, false);
                m.routes = (0..2048)
                    .map(|k| route(host(next + k), &name, hop))
                    .collect();
                m.routes
                    .extend((0..32).map(|_| route(String::new(), &name, hop)));
                m.withdrawn = (0..256)
                    .map(|k| host(0x003f_ffff - (generation as u32 * 256 + k) % 0x0010_0000))
                    .collect();
                next += 2048;
                if !send(m).await {
                    return;
                }
            }
        }
        Phase::BigMore => {
            let garbage = "x".repeat(1000);
            loop {
                let mut m = update(Kind::Delta, 2, true);
                m.withdrawn = vec![garbage.clone(); 3500];
                if !send(m).await {
                    return;
                }
            }
        }
        Phase::SmallMore => loop {
            if !send(update(Kind::Delta, 2, true)).await {
                return;
            }
        },
        Phase::TooLarge => {
            let mut m = update(Kind::Delta, 2, false);
            m.withdrawn = vec!["y".repeat(5 << 20)];
            if send(m).await {
                // The follower drops the stream; nothing more to say.
                tx.closed().await;
            }
        }
        Phase::Withdrawals => {
            let until = Instant::now() + Duration::from_secs(5);
            let mut generation = 2;
            while Instant::now() < until {
                let mut m = update(Kind::Delta, generation, false);
                m.withdrawn = (0..2048u32)
                    .map(|k| host(0x0030_0000 + (generation as u32 * 2048 + k) % 0x000f_0000))
                    .collect();
                generation += 1;
                if !send(m).await {
                    return;
                }
            }
        }
    }
}

/// A hostile peer in node `i`'s namespace of `c` (whose agent does not run), named after that
/// node and with its address, its certificate from `ca`. Stopped on drop.
pub struct Hostile {
    pub name: String,
    pub sent: Arc<Sent>,
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Hostile {
    /// Serves, then writes its node record (peers start following it); returns once the
    /// record is written. Panics on failure (for tests).
    pub fn start(c: &Cluster, i: usize, ca: &Ca) -> Self {
        let name = c.name(i).to_string();
        let address = c.address(i);
        let hop: Ipv4Addr = address.parse().expect("an IPv4 node address");
        let etcd = c.etcd_url(i);
        let cert = ca.issue(&name).unwrap_or_else(|e| panic!("{e}"));
        let tls = tls_material(&ca.pem(), &cert)
            .and_then(|m| Ok(m.server_config()?))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let sent = Arc::new(Sent::default());
        // The door admits the cluster's nodes (its followers) and refuses anyone else.
        let known = Arc::new(calix_agent::distribution::door::Known::default());
        known.set(
            (0..c.nodes.len()).map(|j| c.name(j).to_string()).collect(),
            (0..c.nodes.len())
                .flat_map(|j| [c.address(j), c.address6(j)])
                .filter_map(|a| a.parse().ok())
                .collect(),
        );
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let svc = Svc {
            name: name.clone(),
            hop,
            turns: Mutex::default(),
            sent: sent.clone(),
        };
        let thread = c.nodes[i]
            .ns
            .spawn(None, move || -> Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let sock = tokio::net::TcpListener::bind(("0.0.0.0", PORT))
                        .await
                        .with_context(|| format!("listening on port {PORT}"))?;
                    let serving = tokio::spawn(listener::serve_with(
                        vec![sock],
                        Some(tls),
                        svc,
                        Arc::default(),
                        Arc::default(),
                        known,
                        Limits::default(),
                        stop_rx.clone(),
                    ));
                    let store = EtcdStore::connect(EtcdConfig {
                        endpoints: vec![etcd.clone()],
                        prefix: "/calix/".into(),
                        timeout: Duration::from_secs(5),
                        attempts: 3,
                    })
                    .await
                    .with_context(|| format!("connecting to etcd at {etcd}"))?;
                    let r = record(&name, &address, Some(format!("{address}:{PORT}")), false);
                    store
                        .txn(
                            &[],
                            &[Op::put_json(keys::node(&r.name), &r)],
                            Durability::Process,
                        )
                        .await
                        .context("writing the hostile peer's node record")?;
                    let _ = ready_tx.send(());
                    let _ = serving.await;
                    Ok(())
                })
            })
            .unwrap_or_else(|e| panic!("hostile peer thread: {e}"));
        let mut h = Self {
            name: c.name(i).to_string(),
            sent,
            stop,
            thread: Some(thread),
        };
        if ready_rx.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = h.stop.send(true);
            let why = h.thread.take().map(|t| t.join());
            panic!("the hostile peer did not come up: {why:?}");
        }
        h
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
