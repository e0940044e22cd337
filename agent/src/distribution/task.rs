//! Route distribution in the agent: the async shell around the [`Engine`]. It watches the
//! datastore's blocks and nodes, runs the TCP door, keeps a follower per peer, and after each
//! batch of events (everything queued, so a burst is one recomputation and a single event
//! costs no wait) publishes this node's routes to watchers and hands the desired routes to the
//! reconciler (on a task of its own: the reconciler's thread never holds up the streams; the
//! latest set wins).
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_core::ipam::pool::VxlanMode;
use calix_core::routes::advertise::NextHops;
use calix_core::routes::engine::{Engine, Outputs, Settings, SETTLE};
use calix_core::routes::peers::Target;
use calix_core::routes::peers::Topology;
use calix_core::routes::report::{self, RoutesReport};
use calix_core::routes::view::Part;
use calix_core::update::PeerEvent;
use ipnet::IpNet;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::client::{self, Dialer, PeerMessage};
use super::door::{DoorStats, Known, Throttle};
use super::feed::Feed;
use super::handover::{hand_over, hand_peers, peer_nodes, Desired, Handed, RouteSink};
use super::listener::{self, Limits};
use super::nodes::{NodeSource, Records};
use super::server::{Feeds, RoutesSvc, Verdicts};
use super::settings::{ListenOn, RoutesSettings};
use super::tls::{CertSource, LiveTls};
use super::watch::{watch_part, ViewInput};
use super::RoutesError;
use calix_dataplane::doors::PeerNodes;
use calix_datastore::Datastore;

/// What route distribution starts with.
pub struct Start {
    pub me: String,
    /// Where the Routes service listens (for the logs: the listeners are bound).
    pub listen: ListenOn,
    pub topology: Topology,
    /// This agent relays every node's routes (only with [`Topology::Reflectors`]).
    pub reflector: bool,
    /// How long a peer's routes stay after its stream drops.
    pub grace: Duration,
    /// Each configured pool and its `vxlan` mode.
    pub pools: Vec<(IpNet, VxlanMode)>,
    /// Every pool as the rule for blocks needs it.
    pub blocks: Vec<calix_core::ipam::Pool>,
    pub next_hops: NextHops,
    /// Where peers reach this agent (recorded in its node record).
    pub endpoint: String,
    /// This node's subnets (for `calixctl routes`' VIA).
    pub subnets: Vec<IpNet>,
    /// `None`: plain text (`routes.plaintext`). Live: renewed certificates and bundles are
    /// used by the next handshake.
    pub tls: Option<Arc<LiveTls>>,
    /// The Routes port on each address it listens on, bound before this node's record
    /// announces it (peers that dial early wait in its backlog instead of being refused).
    pub listeners: Vec<tokio::net::TcpListener>,
    /// Where the peers come from.
    pub nodes: Arc<dyn NodeSource>,
    /// What this node answers its peers' `Verdict` calls with (set once NetworkPolicy runs).
    pub verdicts: Option<Arc<dyn Verdicts>>,
}

impl Start {
    /// From route distribution's settings: the next hops (`node_addresses`, else the first
    /// uplink's addresses, else `recorded`, the node record's), the endpoint peers dial, this
    /// node's subnets, `tls` ([`tls_for`]) and where the peers come from (`nodes`); binds the
    /// Routes port.
    pub async fn new(
        s: RoutesSettings,
        recorded: &[String],
        tls: Option<Arc<LiveTls>>,
        nodes: Arc<dyn NodeSource>,
    ) -> Result<Self, RoutesError> {
        let next_hops =
            super::local::next_hops(&s.node_addresses, &uplink_addresses(&s.uplinks), recorded);
        let listen = s.listen;
        let endpoint = super::local::endpoint(listen, &next_hops).ok_or(RoutesError::NoAddress)?;
        let mut reflector = s.reflector;
        if reflector && s.topology != Topology::Reflectors {
            tracing::warn!("routes.reflector = true has no effect with topology = \"mesh\"");
            reflector = false;
        }
        let listeners = bind_all(&super::local::bind_addresses(listen, &next_hops))?;
        Ok(Self {
            listeners,
            nodes,
            me: s.me,
            listen,
            topology: s.topology,
            reflector,
            grace: s.grace,
            pools: s.pools,
            blocks: s.blocks,
            next_hops,
            endpoint,
            subnets: super::local::subnets(),
            tls,
            verdicts: None,
        })
    }
}

/// Route distribution's TLS material: none in plain text (`tls` is `None`); the files, read
/// and checked now (a bad file stops the agent); or, with [`CertSource::Kubernetes`], empty
/// until [`crate::kubernetes::certificates`] fills it.
pub fn tls_for(
    me: &str,
    tls: Option<&super::settings::TlsSettings>,
) -> Result<Option<Arc<LiveTls>>, RoutesError> {
    let Some(tls) = tls else {
        return Ok(None);
    };
    Ok(Some(match tls.source {
        CertSource::Files => LiveTls::from_files(&tls.files, me)?,
        CertSource::Kubernetes => LiveTls::pending(me, CertSource::Kubernetes),
    }))
}

/// A running route distribution.
pub struct RoutesHandle {
    requests: mpsc::Sender<Ask>,
    /// How this agent dials its peers (also for `Verdict` calls).
    dialer: Arc<Dialer>,
    shutdown: watch::Sender<bool>,
    server: Mutex<Option<JoinHandle<()>>>,
    engine: Mutex<Option<JoinHandle<()>>>,
}

/// What calixctl and /metrics ask the loop.
enum Ask {
    Report(oneshot::Sender<RoutesReport>),
    Metrics(oneshot::Sender<String>),
    /// New pools for the rule for blocks (a reload).
    Pools(Vec<calix_core::ipam::Pool>),
    /// The node holding an address and its endpoint ([`super::verdict::locate`]).
    Locate(IpAddr, oneshot::Sender<Option<(String, String)>>),
}

/// Binds the Routes port and starts everything. Fails (and the agent with it) when the port
/// cannot be bound or TLS cannot be set up.
pub async fn start(
    s: Start,
    store: Arc<dyn Datastore>,
    sink: Arc<dyn RouteSink>,
) -> Result<RoutesHandle, RoutesError> {
    let (server_tls, client_tls) = match &s.tls {
        Some(m) => (Some(m.server_config()?), Some(m.client_config()?)),
        None => {
            tracing::warn!(listen = %s.listen, "routes: PLAIN TEXT between nodes (routes.plaintext = true): peers are not authenticated; use only on a network you trust");
            (None, None)
        }
    };
    let listeners = s.listeners;
    let listening: Vec<String> = listeners
        .iter()
        .filter_map(|l| l.local_addr().ok())
        .map(|a| a.to_string())
        .collect();
    tracing::info!(listen = ?listening, endpoint = %s.endpoint, tls = server_tls.is_some(),
        topology = ?s.topology, reflector = s.reflector, "routes: serving calix.v1.Routes");
    let (shutdown, shutdown_rx) = watch::channel(false);
    let feeds = Arc::new(Feeds {
        own: Arc::new(Feed::default()),
        relay: Arc::new(Feed::default()),
        reflector: s.reflector,
    });
    let known = Arc::new(Known::default());
    let stats = Arc::new(DoorStats::default());
    let svc = RoutesSvc {
        feeds: feeds.clone(),
        known: known.clone(),
        stats: stats.clone(),
        shutdown: shutdown_rx.clone(),
        throttle: Arc::new(Throttle::default()),
        verdicts: s.verdicts.clone(),
    };
    let server = tokio::spawn(async move {
        if let Err(e) =
            listener::serve(listeners, server_tls, svc, Limits::default(), shutdown_rx).await
        {
            tracing::error!(error = %e, "routes: the Routes server failed");
        }
    });
    let (view_tx, view_rx) = mpsc::channel(1024);
    tokio::spawn(watch_part(
        store.clone(),
        Part::Blocks,
        Arc::new(Records),
        view_tx.clone(),
    ));
    tokio::spawn(watch_part(
        store.clone(),
        Part::Nodes,
        s.nodes,
        view_tx.clone(),
    ));
    let handed: Handed = Arc::default();
    let (desired_tx, desired_rx) = watch::channel(None);
    let (peers_tx, peers_rx) = watch::channel(None);
    tokio::spawn(hand_over(sink.clone(), desired_rx, handed.clone()));
    tokio::spawn(hand_peers(sink, peers_rx));
    let (requests, req_rx) = mpsc::channel(8);
    let (peer_tx, peer_rx) = mpsc::channel(1024);
    let dialer = Arc::new(Dialer {
        me: s.me.clone(),
        tls: client_tls,
        live: s.tls.clone(),
        connect_timeout: Duration::from_secs(3),
        source: s.next_hops,
    });
    let engine = Engine::new(Settings {
        me: s.me.clone(),
        topology: s.topology,
        reflector: s.reflector,
        grace: s.grace,
        settle: SETTLE,
        next_hops: s.next_hops,
        pools: s.pools,
        blocks: s.blocks,
    });
    let state = Loop {
        engine,
        feeds,
        known,
        stats,
        handed,
        desired_tx,
        last_desired: None,
        peers_tx,
        clients: HashMap::new(),
        next_id: 0,
        dialer: dialer.clone(),
        peer_tx,
        endpoint: s.endpoint,
        tls: s.tls,
        subnets: s.subnets,
    };
    let engine = tokio::spawn(state.run(view_rx, peer_rx, req_rx, shutdown.subscribe()));
    Ok(RoutesHandle {
        requests,
        dialer,
        shutdown,
        server: Mutex::new(Some(server)),
        engine: Mutex::new(Some(engine)),
    })
}

impl RoutesHandle {
    /// The report `calixctl routes` / `nodes` print.
    pub async fn report(&self) -> Option<RoutesReport> {
        let (tx, rx) = oneshot::channel();
        self.requests.send(Ask::Report(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Route distribution's lines of `/metrics` (counted, without building the report).
    pub async fn metrics(&self) -> String {
        let (tx, rx) = oneshot::channel();
        if self.requests.send(Ask::Metrics(tx)).await.is_err() {
            return String::new();
        }
        rx.await.unwrap_or_default()
    }

    /// The policy verdict of the node holding `pod` (another node) on the packet `req`
    /// describes (`req.node` is filled in): (that node, the step as JSON).
    pub async fn verdict_of(
        &self,
        pod: IpAddr,
        mut req: calix_proto::v1::VerdictRequest,
    ) -> Result<(String, String), String> {
        let (tx, rx) = oneshot::channel();
        self.requests
            .send(Ask::Locate(pod, tx))
            .await
            .map_err(|_| "route distribution has stopped".to_string())?;
        let (node, endpoint) = rx
            .await
            .map_err(|_| "route distribution has stopped".to_string())?
            .ok_or_else(|| format!("no node of route distribution's view holds {pod}"))?;
        if node == self.dialer.me {
            return Err(format!("{pod} is this node's, but no endpoint of it"));
        }
        req.node.clone_from(&self.dialer.me);
        let json = super::verdict::ask(&self.dialer, &node, &endpoint, req)
            .await
            .map_err(|e| format!("node {node} did not answer: {e}"))?;
        Ok((node, json))
    }

    /// New pools (a reload, an IPPool change): the blocks are sorted again by the rule for
    /// blocks, and every route judged again.
    pub async fn set_block_pools(&self, pools: Vec<calix_core::ipam::Pool>) {
        let _ = self.requests.send(Ask::Pools(pools)).await;
    }

    /// Ends every stream this agent serves (peers keep its routes for their grace period)
    /// and every stream it follows; returns when the server has stopped (at most 3 s).
    pub async fn shutdown(&self) {
        let _ = self.shutdown.send(true);
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(server) = server {
            if tokio::time::timeout(Duration::from_secs(3), server)
                .await
                .is_err()
            {
                tracing::warn!("routes: server did not stop within 3 s");
            }
        }
        let engine = self.engine.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(engine) = engine {
            let _ = tokio::time::timeout(Duration::from_secs(1), engine).await;
        }
        tracing::info!("routes: streams closed");
    }
}

/// The engine's loop and what it drives.
struct Loop {
    engine: Engine,
    feeds: Arc<Feeds>,
    known: Arc<Known>,
    stats: Arc<DoorStats>,
    handed: Handed,
    desired_tx: watch::Sender<Option<(Desired, bool)>>,
    last_desired: Option<(Desired, bool)>,
    /// The other nodes, for the dataplane's doors (latest wins).
    peers_tx: watch::Sender<Option<PeerNodes>>,
    /// Peer → (what it follows, follower id, task).
    clients: HashMap<String, (Target, u64, JoinHandle<()>)>,
    next_id: u64,
    dialer: Arc<Dialer>,
    peer_tx: mpsc::Sender<PeerMessage>,
    endpoint: String,
    tls: Option<Arc<LiveTls>>,
    subnets: Vec<IpNet>,
}

impl Loop {
    async fn run(
        mut self,
        mut view_rx: mpsc::Receiver<ViewInput>,
        mut peer_rx: mpsc::Receiver<PeerMessage>,
        mut req_rx: mpsc::Receiver<Ask>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            let deadline = self.engine.next_deadline(Instant::now());
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Some(v) = view_rx.recv() => {
                    self.view(v);
                }
                Some(m) = peer_rx.recv() => {
                    self.peer(m);
                }
                Some(ask) = req_rx.recv() => {
                    match ask {
                        Ask::Report(reply) => {
                            let _ = reply.send(self.report());
                            continue;
                        }
                        Ask::Metrics(reply) => {
                            let _ = reply.send(report::metrics(&self.counts()));
                            continue;
                        }
                        Ask::Locate(ip, reply) => {
                            let _ = reply.send(super::verdict::locate(self.engine.view(), ip));
                            continue;
                        }
                        // Then flushed like a view change.
                        Ask::Pools(pools) => {
                            tracing::info!(pools = ?pools.iter().map(|p| p.cidr.to_string()).collect::<Vec<_>>(),
                                "routes: blocks sorted again against new pools");
                            self.engine.set_block_pools(pools);
                        }
                    }
                }
                () = sleep => {
                    self.engine.tick(Instant::now());
                }
                _ = shutdown.changed() => break,
            }
            // Everything else already queued joins this batch.
            while let Ok(v) = view_rx.try_recv() {
                self.view(v);
            }
            while let Ok(m) = peer_rx.try_recv() {
                self.peer(m);
            }
            if self.engine.synced() {
                let now = Instant::now();
                self.engine.tick(now);
                let out = self.engine.flush(now);
                self.apply(out, now);
            }
        }
        for (_, (_, _, task)) in self.clients.drain() {
            task.abort();
        }
    }

    fn view(&mut self, v: ViewInput) {
        match v {
            ViewInput::Listed(part, kvs) => self.engine.view_listed(part, kvs),
            ViewInput::Event(ev) => {
                let changed = self.engine.view_event(&ev);
                tracing::debug!(
                    key = ev.key(),
                    revision = ev.revision(),
                    changed,
                    "routes: datastore event"
                );
            }
        }
    }

    fn peer(&mut self, m: PeerMessage) {
        let current = self.clients.get(&m.peer).map(|c| c.1);
        if current == Some(m.id) {
            self.engine.peer_event(&m.peer, m.event, Instant::now());
        }
    }

    fn apply(&mut self, out: Outputs, now: Instant) {
        if let Some(d) = self.feeds.own.publish(&out.own, now) {
            tracing::debug!(generation = d.generation,
                routes = ?d.routes.iter().map(|r| r.prefix).collect::<Vec<_>>(),
                withdrawn = ?d.withdrawn, "routes: this node's routes published");
        }
        // A restarted reflector relays nothing until it has heard from every peer: a partial
        // set would withdraw the others' routes from everyone following it.
        if self.feeds.reflector && out.complete {
            self.feeds.relay.publish(&out.relay, now);
        }
        let nodes = self.engine.view().nodes();
        let (names, addresses): (HashSet<_>, Vec<_>) = nodes
            .map(|n| (n.record.name.clone(), n.addresses.iter().copied()))
            .unzip();
        self.known
            .set(names, addresses.into_iter().flatten().collect());
        let peers = peer_nodes(self.engine.view(), &self.dialer.me);
        self.peers_tx.send_if_modified(|cur| {
            let changed = cur.as_ref() != Some(&peers);
            if changed {
                *cur = Some(peers);
            }
            changed
        });
        // Followers: one per wanted peer, replaced when its endpoint or role changes.
        self.clients.retain(|name, (_, _, task)| {
            let keep = out.peers.contains_key(name);
            if !keep {
                task.abort();
            }
            keep
        });
        for (name, target) in &out.peers {
            if self.clients.get(name).is_some_and(|c| c.0 == *target) {
                continue;
            }
            if let Some((_, _, old)) = self.clients.remove(name) {
                old.abort();
                self.engine.peer_event(
                    name,
                    PeerEvent::Down {
                        reason: format!("now following it at {}", target.endpoint),
                        broke: None,
                    },
                    now,
                );
            }
            self.next_id += 1;
            let task = tokio::spawn(client::follow(
                name.clone(),
                target.clone(),
                self.dialer.clone(),
                self.next_id,
                self.peer_tx.clone(),
            ));
            self.clients
                .insert(name.clone(), (target.clone(), self.next_id, task));
        }
        let same = self
            .last_desired
            .as_ref()
            .is_some_and(|(d, c)| **d == out.desired && *c == out.complete);
        if !same {
            tracing::debug!(
                routes = out.desired.len(),
                complete = out.complete,
                "routes: new desired routes for the reconciler"
            );
            let desired = Some((Arc::new(out.desired), out.complete));
            self.last_desired.clone_from(&desired);
            let _ = self.desired_tx.send(desired);
        }
    }

    fn context(&self) -> report::Context<'_> {
        let handed = self
            .handed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        report::Context {
            endpoint: &self.endpoint,
            tls: self
                .tls
                .as_ref()
                .map(|t| t.status(std::time::SystemTime::now())),
            own: &*self.feeds.own,
            relay: &*self.feeds.relay,
            handed,
            subnets: &self.subnets,
            door: self.stats.counts(),
        }
    }

    fn report(&self) -> RoutesReport {
        report::build(&self.engine, &self.context(), Instant::now())
    }

    fn counts(&self) -> report::Counts {
        report::counts(&self.engine, &self.context())
    }
}

/// Binds the Routes port on each of `addrs` ([`listener::bind`]). An address the node does
/// not have (yet) is bound all the same and warned about: peers reach it once it is there.
fn bind_all(addrs: &[std::net::SocketAddr]) -> Result<Vec<tokio::net::TcpListener>, RoutesError> {
    let own = calix_dataplane::host_addrs::own_addresses().unwrap_or_default();
    let mut out = Vec::new();
    for a in addrs {
        let l = listener::bind(*a).map_err(|source| RoutesError::Listen {
            addr: a.to_string(),
            source,
        })?;
        if a.ip().is_unspecified() {
            tracing::info!(listen = %a, "routes: the Routes port listens on every address of this node (routes.listen); sources other than the nodes are refused before TLS");
        } else if !own.contains(&a.ip()) {
            tracing::warn!(listen = %a, "routes: this address is not (yet) one of this node's: peers reach the Routes port once it is");
        }
        out.push(l);
    }
    Ok(out)
}

/// The next hops' addresses, for the node record (which must carry them: peers check a
/// route's next hop against it).
pub fn record_addresses(mut recorded: Vec<String>, hops: &NextHops) -> Vec<String> {
    for a in hops.all() {
        let text = a.to_string();
        if !recorded.contains(&text) {
            recorded.push(text);
        }
    }
    recorded
}

/// The uplink's addresses (the first uplink's), parsed.
pub fn uplink_addresses(uplinks: &[String]) -> Vec<IpAddr> {
    uplinks
        .first()
        .map(|u| super::local::interface_addresses(u))
        .unwrap_or_default()
}
