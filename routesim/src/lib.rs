//! Simulated peers of route distribution: many "nodes" that are only their datastore records
//! and a `calix.v1.Routes` server each, with a certificate of their own, so one real agent can
//! be shown hundreds of peers on one machine. The servers are the agent's own
//! ([`calix_agent::distribution::listener::serve`] with [`RoutesSvc`]), speaking real gRPC over
//! mutual TLS; what they announce is whatever the [`Plan`] says (a rogue is a plan too).
//!
//! A simulation runs in three steps, in this order, so that no agent dials a server that is
//! not listening yet: the blocks are written to etcd, the servers listen, then the node records
//! (which carry the Routes endpoints agents dial) are written — "the peers appear".
//!
//! Used in the test process ([`Sim::start`], on a thread inside a node's namespace) by
//! tests/tests/routes.rs, and as the `calix-routesim` binary by `cargo xtask bench routes`
//! (xtask cannot depend on this crate: it builds before the eBPF toolchain exists).
//!
//! [`hostile`] is a peer of another kind: one that streams what a follower must survive.
pub mod hostile;

use std::collections::HashSet;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use calix_agent::distribution::door::Known;
use calix_agent::distribution::feed::Feed;
use calix_agent::distribution::listener::{self, Limits};
use calix_agent::distribution::server::{Feeds, RoutesSvc};
use calix_agent::distribution::tls::TlsMaterial;
use calix_core::ipam::Block;
use calix_core::model::NodeRecord;
use calix_core::store::keys;
use calix_core::Route;
use calix_datastore::{Datastore, Durability, EtcdConfig, EtcdStore, Op};
use calix_testbed::tls::{Ca, NodeCert};
use calix_testbed::Cluster;
use futures::StreamExt;
use ipnet::{IpNet, Ipv4Net};

/// Concurrent etcd writes while the blocks and records go in.
const WRITES_IN_FLIGHT: usize = 32;

/// One simulated peer's Routes server: it announces `routes` as node `name`, on `port` (every
/// address of its namespace).
pub struct Server {
    pub name: String,
    pub port: u16,
    pub routes: Vec<Route>,
}

/// What a simulation writes and serves.
#[derive(Default)]
pub struct Plan {
    /// Node records, written last.
    pub records: Vec<NodeRecord>,
    /// IPAM blocks, written first.
    pub blocks: Vec<Block>,
    pub servers: Vec<Server>,
    /// The nodes the servers let watch (the real agents).
    pub known: Vec<String>,
    /// The addresses those nodes connect from: the servers' doors refuse any other source
    /// before TLS, as an agent's does.
    pub known_addresses: Vec<IpAddr>,
}

/// How [`scale`] lays its peers out.
#[derive(Debug, Clone)]
pub struct Scale {
    pub peers: u32,
    pub blocks_per_peer: u32,
    /// Where the blocks are carved from, in order (peer 0's first).
    pub pool: Ipv4Net,
    pub block_len: u8,
    /// Peer `k`'s address (its routes' next hop) is this + `k`.
    pub first_hop: Ipv4Addr,
    /// Peer `k`'s server listens on this + `k`.
    pub first_port: u16,
    /// The address of the simulator's namespace, where every server is dialed.
    pub host: IpAddr,
    /// `Some((address, port))`: a reflector at that address relays every peer's routes, and the
    /// peers themselves serve nothing (the agent follows only the reflector). `None`: a mesh.
    pub reflector: Option<(Ipv4Addr, u16)>,
}

/// The reflector's node name in a [`scale`] plan.
pub const REFLECTOR: &str = "simr";

/// Peer `k`'s node name in a [`scale`] plan.
pub fn peer_name(k: u32) -> String {
    format!("sim{k:03}")
}

/// `s.peers` nodes with `s.blocks_per_peer` blocks each, every block announced with the peer
/// as next hop: by each peer's own server (mesh) or all by one reflector.
pub fn scale(s: &Scale, known: Vec<String>) -> Result<Plan> {
    let mut plan = Plan {
        known,
        ..Plan::default()
    };
    anyhow::ensure!(s.block_len <= 32, "block length {} is over 32", s.block_len);
    let size = 1u64 << (32 - u32::from(s.block_len));
    let base = u64::from(u32::from(s.pool.network()));
    let mut relayed = Vec::new();
    for k in 0..s.peers {
        let name = peer_name(k);
        let hop = u32::from(s.first_hop)
            .checked_add(k)
            .map(Ipv4Addr::from)
            .context("peer addresses beyond the address space")?;
        let port = u16::try_from(k)
            .ok()
            .and_then(|k| s.first_port.checked_add(k))
            .context("too many peers for the ports")?;
        let endpoint = s.reflector.is_none().then(|| endpoint(s.host, port));
        plan.records
            .push(record(&name, &hop.to_string(), endpoint, false));
        let mut routes = Vec::new();
        for b in 0..u64::from(s.blocks_per_peer) {
            let start = u64::from(k)
                .checked_mul(u64::from(s.blocks_per_peer))
                .and_then(|i| i.checked_add(b)?.checked_mul(size)?.checked_add(base))
                .and_then(|a| u32::try_from(a).ok())
                .context("blocks beyond the address space")?;
            let block = Ipv4Net::new(Ipv4Addr::from(start), s.block_len)?;
            anyhow::ensure!(s.pool.contains(&block), "{block} is outside {}", s.pool);
            let cidr = IpNet::V4(block);
            plan.blocks.push(Block::new(cidr, &name));
            routes.push(Route {
                prefix: cidr,
                node: name.clone(),
                next_hop: IpAddr::V4(hop),
            });
        }
        match s.reflector {
            None => plan.servers.push(Server { name, port, routes }),
            Some(_) => relayed.extend(routes),
        }
    }
    if let Some((address, port)) = s.reflector {
        plan.records.push(record(
            REFLECTOR,
            &address.to_string(),
            Some(endpoint(s.host, port)),
            true,
        ));
        plan.servers.push(Server {
            name: REFLECTOR.into(),
            port,
            routes: relayed,
        });
    }
    Ok(plan)
}

fn endpoint(host: IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(host, port).to_string()
}

/// A node record as an agent writes it: `address`, and a Routes endpoint (`None`: none).
pub fn record(name: &str, address: &str, endpoint: Option<String>, reflector: bool) -> NodeRecord {
    NodeRecord {
        name: name.into(),
        addresses: vec![address.into()],
        routes_endpoint: endpoint.unwrap_or_default(),
        reflector,
        ..Default::default()
    }
}

/// A node's TLS material from PEM text: the CA's certificate and the node's.
pub fn tls_material(ca_pem: &str, cert: &NodeCert) -> Result<TlsMaterial> {
    let p = Path::new("(simulated)");
    Ok(TlsMaterial::from_pem(
        (p, ca_pem.as_bytes()),
        (p, cert.cert_pem.as_bytes()),
        (p, cert.key_pem.as_bytes()),
    )?)
}

/// Milestones of a running simulation.
pub enum Event {
    /// The blocks are in etcd (after this long) and every server listens.
    Ready(Duration),
    /// The node records are in etcd (after this long).
    Announced(Duration),
}

/// What the servers of a plan present: the CA's certificate, and one certificate per server
/// (in the plan's order), each naming its server's node.
pub struct Credentials {
    pub ca_pem: String,
    pub certs: Vec<NodeCert>,
}

impl Credentials {
    /// Certificates from `ca` for every server of `plan`.
    pub fn issue(ca: &Ca, plan: &Plan) -> Result<Self> {
        Ok(Self {
            ca_pem: ca.pem(),
            certs: plan
                .servers
                .iter()
                .map(|s| ca.issue(&s.name))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Runs `plan` in the calling thread's network namespace against etcd at `etcd`, the servers
/// presenting `creds`: the blocks, the servers, then — once `announce` completes — the
/// records; `on` hears each step. Serves until `stop` turns true (or stops before writing the
/// records, when `stop` comes first).
pub async fn run(
    etcd: String,
    creds: Credentials,
    plan: Plan,
    announce: impl Future<Output = ()>,
    mut on: impl FnMut(Event),
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let store = Arc::new(
        EtcdStore::connect(EtcdConfig {
            endpoints: vec![etcd.clone()],
            prefix: "/calix/".into(),
            timeout: Duration::from_secs(5),
            attempts: 3,
        })
        .await
        .with_context(|| format!("connecting to etcd at {etcd}"))?,
    );
    let t = Instant::now();
    put_all(
        &store,
        plan.blocks
            .iter()
            .map(|b| Op::put_json(keys::block(&b.cidr), b)),
    )
    .await?;
    let written = t.elapsed();
    let known = Arc::new(Known::default());
    known.set(
        plan.known.iter().cloned().collect::<HashSet<_>>(),
        plan.known_addresses.iter().copied().collect(),
    );
    let mut served = Vec::new();
    anyhow::ensure!(
        creds.certs.len() == plan.servers.len(),
        "{} certificates for {} servers",
        creds.certs.len(),
        plan.servers.len()
    );
    for (s, cert) in plan.servers.into_iter().zip(&creds.certs) {
        let tls = tls_material(&creds.ca_pem, cert)?
            .server_config()
            .with_context(|| format!("{}'s server TLS", s.name))?;
        let feeds = Arc::new(Feeds {
            own: Arc::new(Feed::default()),
            relay: Arc::new(Feed::default()),
            reflector: false,
        });
        feeds.own.publish(
            &s.routes.into_iter().map(|r| (r.prefix, r)).collect(),
            Instant::now(),
        );
        let sock = tokio::net::TcpListener::bind(("0.0.0.0", s.port))
            .await
            .with_context(|| format!("{} listening on port {}", s.name, s.port))?;
        let svc = RoutesSvc {
            feeds,
            known: known.clone(),
            stats: Arc::default(),
            shutdown: stop.clone(),
            throttle: Arc::default(),
            verdicts: None,
        };
        served.push(tokio::spawn(listener::serve(
            vec![sock],
            Some(tls),
            svc,
            Limits::default(),
            stop.clone(),
        )));
    }
    on(Event::Ready(written));
    let mut stopped = stop.clone();
    tokio::select! {
        _ = announce => {}
        _ = stopped.wait_for(|s| *s) => return Ok(()),
    }
    let t = Instant::now();
    put_all(
        &store,
        plan.records
            .iter()
            .map(|r| Op::put_json(keys::node(&r.name), r)),
    )
    .await?;
    on(Event::Announced(t.elapsed()));
    for s in served {
        let _ = s.await;
    }
    Ok(())
}

async fn put_all(store: &Arc<EtcdStore>, ops: impl Iterator<Item = Op>) -> Result<()> {
    let results: Vec<_> = futures::stream::iter(ops)
        .map(|op| {
            let store = store.clone();
            async move { store.txn(&[], &[op], Durability::Process).await }
        })
        .buffer_unordered(WRITES_IN_FLIGHT)
        .collect()
        .await;
    for r in results {
        r.context("etcd put")?;
    }
    Ok(())
}

/// A simulation in the test process, on a thread inside node `i`'s namespace of `c` (whose
/// agent does not run), against the cluster's etcd. Stopped on drop.
pub struct Sim {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Sim {
    /// Starts `plan` and returns once the peers have appeared (records written). Panics on
    /// failure (for tests).
    pub fn start(c: &Cluster, i: usize, ca: &Ca, plan: Plan) -> Self {
        let etcd = c.etcd_url(i);
        let creds = Credentials::issue(ca, &plan).unwrap_or_else(|e| panic!("{e:#}"));
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let thread = c.nodes[i]
            .ns
            .spawn(None, move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let on = |e: Event| {
                    if let Event::Announced(_) = e {
                        let _ = done_tx.send(());
                    }
                };
                rt.block_on(run(etcd, creds, plan, async {}, on, stop_rx))
            })
            .unwrap_or_else(|e| panic!("simulator thread: {e}"));
        let mut sim = Self {
            stop,
            thread: Some(thread),
        };
        if done_rx.recv_timeout(Duration::from_secs(120)).is_err() {
            // Stopped first: a simulation still starting would never end by itself.
            let _ = sim.stop.send(true);
            let why = sim.thread.take().map(|t| t.join());
            panic!("the simulated peers did not come up: {why:?}");
        }
        sim
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS handshake in memory between `server` (as node `name`) and `client`: Ok when both
    /// sides accept each other.
    fn handshake(
        server: &TlsMaterial,
        client: &TlsMaterial,
        name: &str,
    ) -> Result<(), rustls::Error> {
        let mut s = rustls::ServerConnection::new(server.server_config().expect("server"))?;
        let sni = calix_agent::distribution::tls::server_name(name).expect("name");
        let mut c = rustls::ClientConnection::new(client.client_config().expect("client"), sni)?;
        for _ in 0..10 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).expect("client write");
            }
            s.read_tls(&mut buf.as_slice()).expect("server read");
            s.process_new_packets()?;
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).expect("server write");
            }
            c.read_tls(&mut buf.as_slice()).expect("client read");
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish");
    }

    #[test]
    fn a_saved_and_loaded_ca_issues_certificates_the_original_ca_vouches_for() {
        let dir = std::env::temp_dir().join(format!("cx-routesim-ca-{}", std::process::id()));
        let ca = Ca::new("calix-test-ca").expect("CA");
        ca.save(&dir).expect("save");
        let loaded = Ca::load(&dir, "calix-test-ca").expect("load");
        let _ = std::fs::remove_dir_all(&dir);
        // A peer issued by the loaded CA, an agent by the original: each trusts the original.
        let peer = tls_material(&ca.pem(), &loaded.issue("sim000").expect("cert")).expect("peer");
        let agent = tls_material(&ca.pem(), &ca.issue("node-a").expect("cert")).expect("agent");
        handshake(&peer, &agent, "sim000").expect("agent dials the peer");
        handshake(&agent, &peer, "node-a").expect("peer dials the agent");
        // Another CA's certificate is refused: the check is real.
        let other = Ca::new("calix-test-ca").expect("CA");
        let stranger =
            tls_material(&ca.pem(), &other.issue("sim001").expect("cert")).expect("stranger");
        assert!(handshake(&stranger, &agent, "sim001").is_err());
    }

    #[test]
    fn a_scale_plan_lays_out_blocks_hops_and_servers() {
        let s = Scale {
            peers: 3,
            blocks_per_peer: 2,
            pool: "10.240.0.0/12".parse().expect("pool"),
            block_len: 26,
            first_hop: Ipv4Addr::new(172, 31, 1, 100),
            first_port: 6000,
            host: "172.31.1.2".parse().expect("host"),
            reflector: None,
        };
        let mesh = scale(&s, vec!["a".into()]).expect("mesh");
        assert_eq!(mesh.blocks.len(), 6);
        assert_eq!(mesh.blocks[5].cidr.to_string(), "10.240.1.64/26");
        assert_eq!(mesh.servers.len(), 3);
        assert_eq!(mesh.servers[2].port, 6002);
        assert_eq!(mesh.records[2].routes_endpoint, "172.31.1.2:6002");
        assert_eq!(
            mesh.servers[2].routes[1].next_hop.to_string(),
            "172.31.1.102"
        );
        let refl = scale(
            &Scale {
                reflector: Some((Ipv4Addr::new(172, 31, 1, 99), 6999)),
                ..s.clone()
            },
            vec![],
        )
        .expect("reflector");
        assert_eq!(refl.servers.len(), 1);
        assert_eq!(refl.servers[0].routes.len(), 6);
        assert!(refl.records[..3]
            .iter()
            .all(|r| r.routes_endpoint.is_empty()));
        assert!(refl.records[3].reflector);
        // Blocks that do not fit the pool are refused.
        let small = Scale {
            pool: "10.240.0.0/24".parse().expect("pool"),
            ..s
        };
        assert!(scale(&small, vec![]).is_err());
    }
}
