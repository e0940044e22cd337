//! The speaker in the agent: it follows the datastore's blocks (what this node advertises is
//! what IPAM says: a block affine to it, a /32 or /128 for each address it borrowed), runs a
//! task per configured peer ([`super::peer_task`]), and hands the routes the peers taught it
//! to the reconciler (through [`RouteSink`], as route distribution does: the same kernel
//! routes, the same protocol number). The set handed over is incomplete (nothing is removed
//! from the kernel) until every peer's routes are whole since the start, or the restart time
//! ran out: a restarted agent keeps forwarding on the routes it had. It listens on its next
//! hops' BGP port for the configured peers' own connections ([`super::listen`]). New settings
//! (a reload) apply while it runs ([`BgpHandle::reconfigure`]).
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_bgp::import::ImportRule;
use calix_core::ipam::pool::VxlanMode;
use calix_core::reconcile::remote::RemoteRoute;
use calix_core::routes::advertise::{own_routes, NextHops};
use calix_core::routes::view::{Part, View};
use calix_datastore::Datastore;
use ipnet::IpNet;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::conn::sleep_until;
use super::listen::{listen, Listeners};
use super::peer_task::{Ctx, PeerEvent, Stop, Wanted};
use super::peers::Peers;
use super::settings::BgpSettings;
use super::status::{self, BgpReport};
use crate::distribution::handover::{hand_over, Handed, RouteSink};
use crate::distribution::nodes::Records;
use crate::distribution::watch::{watch_part, ViewInput};

/// Why the speaker could not start.
#[derive(Debug, thiserror::Error)]
pub enum BgpError {
    #[error("this node has no IPv4 address for a router ID: set bgp.router_id")]
    NoRouterId,
    #[error("this node has no address to advertise routes with: set bgp.node_addresses, or give the first uplink a global address")]
    NoAddress,
}

/// What calixctl and /metrics ask the loop.
enum Ask {
    Report(oneshot::Sender<BgpReport>),
    Pools(Vec<calix_core::ipam::Pool>),
    Settings(Box<BgpSettings>),
}

/// A running speaker.
pub struct BgpHandle {
    requests: mpsc::Sender<Ask>,
    stop: watch::Sender<Option<Stop>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// The node's next hops and router ID from the settings (`node_addresses`, else the first
/// uplink's addresses).
pub fn next_hops(s: &BgpSettings) -> Result<(NextHops, Ipv4Addr), BgpError> {
    let hops = crate::distribution::local::next_hops(
        &s.node_addresses,
        &crate::distribution::task::uplink_addresses(&s.uplinks),
        &[],
    );
    if hops.v4.is_none() && hops.v6.is_none() {
        return Err(BgpError::NoAddress);
    }
    let router_id = match (s.router_id, hops.v4) {
        (Some(id), _) => id,
        (None, Some(IpAddr::V4(v4))) => v4,
        _ => return Err(BgpError::NoRouterId),
    };
    Ok((hops, router_id))
}

/// Starts the speaker: the blocks' watch, a task per peer, the hand-over to `sink`; a
/// session that goes down is told to `notices`.
pub fn start(
    s: BgpSettings,
    store: Arc<dyn Datastore>,
    sink: Arc<dyn RouteSink>,
    notices: Arc<crate::notice::Notifier>,
) -> Result<BgpHandle, BgpError> {
    let (hops, router_id) = next_hops(&s)?;
    tracing::info!(asn = s.asn, %router_id, next_hops = ?hops.all().collect::<Vec<_>>(),
        peers = ?s.peers.iter().map(|p| format!("{} {} AS{}", p.name, p.address, p.asn)).collect::<Vec<_>>(),
        "bgp: speaker starting");
    let (view_tx, view_rx) = mpsc::channel(1024);
    let mut tasks = vec![tokio::spawn(watch_part(
        store,
        Part::Blocks,
        Arc::new(Records),
        view_tx,
    ))];
    // None until the blocks are listed: a session that comes up before must not advertise
    // nothing and then End-of-RIB (its peer would drop this node's stale routes).
    let (wanted_tx, wanted_rx) = watch::channel(None::<Arc<Wanted>>);
    let (import_tx, import_rx) = watch::channel(Arc::new(ImportRule {
        within: s.pools.clone(),
        own: Vec::new(),
    }));
    let (stop, stop_rx) = watch::channel(None);
    let (events_tx, events_rx) = mpsc::channel(1024);
    let ctx = Ctx {
        asn: s.asn,
        router_id,
        own: hops.all().collect(),
        restart_time: u16::try_from(s.restart_time.as_secs()).unwrap_or(u16::MAX),
        wanted: wanted_rx,
        import: import_rx,
        stop: stop_rx.clone(),
        notices,
    };
    let mut peers = Peers::new(events_tx);
    let listeners = listen(&ctx.own, s.listen_port, &peers.doors);
    for p in &s.peers {
        peers.start(p.clone(), &ctx);
    }
    let (desired_tx, desired_rx) = watch::channel(None);
    let handed: Handed = Arc::default();
    tasks.push(tokio::spawn(hand_over(sink, desired_rx, handed)));
    let (requests, req_rx) = mpsc::channel(8);
    let l = Loop {
        me: s.me.clone(),
        hops,
        view: View::with_pools(s.blocks.clone()),
        listed: false,
        pools: s.pools.clone(),
        services: s.services.clone(),
        settings: s.clone(),
        ctx,
        peers,
        listeners,
        wanted_tx,
        import_tx,
        desired_tx,
        complete: false,
        complete_by: Instant::now() + s.restart_time,
    };
    tasks.push(tokio::spawn(l.run(view_rx, events_rx, req_rx, stop_rx)));
    Ok(BgpHandle {
        requests,
        stop,
        tasks: Mutex::new(tasks),
    })
}

impl BgpHandle {
    /// The report `calixctl bgp` prints.
    pub async fn report(&self) -> Option<BgpReport> {
        let (tx, rx) = oneshot::channel();
        self.requests.send(Ask::Report(tx)).await.ok()?;
        rx.await.ok()
    }

    /// The speaker's lines of `/metrics`.
    pub async fn metrics(&self) -> String {
        self.report()
            .await
            .map(|r| status::metrics(&r))
            .unwrap_or_default()
    }

    /// New pools (a reload): the blocks are sorted again and the import rule follows.
    pub async fn set_pools(&self, pools: Vec<calix_core::ipam::Pool>) {
        let _ = self.requests.send(Ask::Pools(pools)).await;
    }

    /// New settings (a reload): the peers that left are ended (Cease, peer de-configured),
    /// those whose settings changed are restarted (Cease, other configuration change), new
    /// ones start; a new AS number, router ID, next hops or restart time restart every peer;
    /// the Service ranges and pools apply at once.
    pub async fn reconfigure(&self, s: BgpSettings) {
        let _ = self.requests.send(Ask::Settings(Box::new(s))).await;
    }

    /// Ends every session: on a restart without a NOTIFICATION (peers keep this node's
    /// routes for the restart time), for good with Cease. Returns within two seconds.
    pub async fn shutdown(&self, how: Stop) {
        let _ = self.stop.send(Some(how));
        let tasks: Vec<_> =
            std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        // The loop (last) ends the peers and waits for them.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            if let Some(l) = tasks.last() {
                while !l.is_finished() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        })
        .await;
        for t in tasks {
            t.abort();
        }
        tracing::info!(how = ?how, "bgp: sessions closed");
    }
}

struct Loop {
    me: String,
    /// The settings running.
    settings: BgpSettings,
    /// What every peer task starts with.
    ctx: Ctx,
    hops: NextHops,
    view: View,
    /// The blocks were listed once: what to advertise is known.
    listed: bool,
    pools: Vec<IpNet>,
    /// Service ranges advertised besides the pods'.
    services: Vec<IpNet>,
    peers: Peers,
    /// The sockets the peers' connections come in on (closed when dropped).
    listeners: Listeners,
    wanted_tx: watch::Sender<Option<Arc<Wanted>>>,
    import_tx: watch::Sender<Arc<ImportRule>>,
    desired_tx: watch::Sender<Option<(Arc<Vec<RemoteRoute>>, bool)>>,
    /// The installed set has been whole once (it stays so).
    complete: bool,
    /// When it is taken as whole at the latest.
    complete_by: Instant,
}

impl Loop {
    async fn run(
        mut self,
        mut view_rx: mpsc::Receiver<ViewInput>,
        mut events: mpsc::Receiver<PeerEvent>,
        mut asks: mpsc::Receiver<Ask>,
        mut stop: watch::Receiver<Option<Stop>>,
    ) {
        loop {
            let (mut view_changed, mut routes_changed) = (false, false);
            let by = (!self.complete).then_some(self.complete_by);
            tokio::select! {
                Some(v) = view_rx.recv() => view_changed |= self.view(v),
                Some(e) = events.recv() => routes_changed |= self.event(e),
                Some(a) = asks.recv() => match a {
                    Ask::Report(reply) => {
                        let _ = reply.send(self.report());
                        continue;
                    }
                    Ask::Pools(pools) => {
                        self.view.set_pools(pools.clone());
                        self.pools = pools.iter().map(|p| p.cidr).collect();
                        view_changed = true;
                    }
                    Ask::Settings(s) => {
                        routes_changed |= self.reconfigure(*s).await;
                        view_changed = true;
                    }
                },
                () = sleep_until(by) => {
                    tracing::info!("bgp: the restart time ran out: the learned routes are taken as whole");
                    routes_changed = true;
                }
                _ = stop.changed() => {
                    let how = (*stop.borrow()).unwrap_or(Stop::Restart);
                    self.peers.stop_all(how).await;
                    return;
                }
            }
            // Everything already queued joins this batch.
            while let Ok(v) = view_rx.try_recv() {
                view_changed |= self.view(v);
            }
            while let Ok(e) = events.try_recv() {
                routes_changed |= self.event(e);
            }
            if view_changed && self.listed {
                self.advertise();
            }
            if routes_changed {
                self.hand_over();
            }
        }
    }

    fn view(&mut self, v: ViewInput) -> bool {
        match v {
            ViewInput::Listed(part, kvs) => {
                self.view.replace(part, kvs);
                self.listed = true;
                true
            }
            ViewInput::Event(ev) => self.view.apply(&ev),
        }
    }

    fn event(&mut self, e: PeerEvent) -> bool {
        self.peers.event(e)
    }

    /// New settings; returns whether the routes to install changed.
    async fn reconfigure(&mut self, s: BgpSettings) -> bool {
        let whole = |b: &BgpSettings| {
            (
                b.asn,
                b.router_id,
                b.node_addresses.clone(),
                b.uplinks.clone(),
                b.restart_time,
                b.listen_port,
            )
        };
        let mut changed = false;
        if whole(&s) != whole(&self.settings) {
            match next_hops(&s) {
                Ok((hops, router_id)) => {
                    tracing::info!(asn = s.asn, %router_id, "bgp: the speaker's settings changed: every session starts again");
                    self.peers.stop_all(Stop::Reconfigured).await;
                    changed = true;
                    self.hops = hops;
                    self.ctx.asn = s.asn;
                    self.ctx.router_id = router_id;
                    self.ctx.own = hops.all().collect();
                    self.ctx.restart_time =
                        u16::try_from(s.restart_time.as_secs()).unwrap_or(u16::MAX);
                    // The old sockets close before the new ones bind.
                    self.listeners = listen(&[], 0, &self.peers.doors);
                    self.listeners = listen(&self.ctx.own, s.listen_port, &self.peers.doors);
                }
                Err(e) => {
                    tracing::error!(error = %e, "bgp: new settings refused; keeping the running ones");
                    return false;
                }
            }
        }
        changed |= self.peers.reconcile(&s.peers, &self.ctx).await;
        self.services.clone_from(&s.services);
        self.settings = s;
        changed
    }

    /// What this node advertises now, to every peer task; and the import rule (never this
    /// node's own prefixes).
    fn advertise(&mut self) {
        let own = own_routes(&self.view, &self.me, &self.hops);
        let mut wanted: Wanted = own.iter().map(|(n, r)| (*n, r.next_hop)).collect();
        for s in &self.services {
            if let Some(hop) = self.hops.for_prefix(s) {
                wanted.entry(*s).or_insert(hop);
            }
        }
        let prefixes: Vec<IpNet> = wanted.keys().copied().collect();
        self.wanted_tx.send_if_modified(|cur| {
            let changed = cur.as_deref() != Some(&wanted);
            if changed {
                tracing::debug!(routes = wanted.len(), "bgp: this node's routes changed");
                *cur = Some(Arc::new(wanted));
            }
            changed
        });
        let rule = ImportRule {
            within: self.pools.clone(),
            own: prefixes,
        };
        self.import_tx.send_if_modified(|cur| {
            let changed = **cur != rule;
            if changed {
                *cur = Arc::new(rule);
            }
            changed
        });
    }

    /// The route installed for each prefix: the first configured peer's that has one.
    fn installed(&self) -> BTreeMap<IpNet, (usize, IpAddr)> {
        let mut out = BTreeMap::new();
        for (id, p) in &self.peers.running {
            for (n, nh) in &p.learned {
                out.entry(*n).or_insert((*id, *nh));
            }
        }
        out
    }

    fn hand_over(&mut self) {
        if !self.complete
            && (Instant::now() >= self.complete_by || self.peers.running.values().all(|p| p.synced))
        {
            self.complete = true;
        }
        let routes: Vec<RemoteRoute> = self
            .installed()
            .into_iter()
            .map(|(prefix, (i, next_hop))| RemoteRoute {
                prefix,
                node: format!(
                    "bgp:{}",
                    self.peers
                        .running
                        .get(&i)
                        .map_or("", |p| p.spec.name.as_str())
                ),
                next_hop,
                vxlan: VxlanMode::Never,
            })
            .collect();
        let desired = Some((Arc::new(routes), self.complete));
        self.desired_tx.send_if_modified(|cur| {
            let changed = *cur != desired;
            if changed {
                *cur = desired;
            }
            changed
        });
    }

    fn report(&self) -> BgpReport {
        let wanted = self.wanted_tx.borrow().clone().unwrap_or_default();
        let (peers, learned, advertised) =
            self.peers
                .report(&self.installed(), &wanted, Instant::now());
        BgpReport {
            asn: self.ctx.asn,
            router_id: self.ctx.router_id.to_string(),
            peers,
            advertised,
            learned,
            complete: self.complete,
            listening: self.peers.doors.listening(),
            refused_connections: self.peers.doors.refused(),
        }
    }
}
