//! The speaker's peers: a task per configured peer ([`super::peer_task`]), each with its own
//! stop signal, so the configuration can change while the agent runs: a peer that leaves is
//! ended with Cease "peer de-configured", one whose settings changed with "other
//! configuration change" and started again, a new one started. What each taught this node
//! (the routes to install) is kept here, by peer, in the order the peers were configured.
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_bgp::peer::Change;
use calix_bgp::Family;
use ipnet::IpNet;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::listen::Doors;
use super::peer_task::{self, Ctx, PeerEvent, PeerState, Shared, Stop};
use super::settings::PeerSettings;
use super::status::{self, PeerReport, RouteLine};

/// One running peer.
pub struct Peer {
    pub spec: PeerSettings,
    pub shared: Shared,
    /// The routes to install from it: prefix → next hop.
    pub learned: BTreeMap<IpNet, IpAddr>,
    /// Its routes are whole since it started.
    pub synced: bool,
    stop: watch::Sender<Option<Stop>>,
    task: JoinHandle<()>,
}

/// Every running peer, by id (ids grow: the order is the configuration's).
pub struct Peers {
    pub running: BTreeMap<usize, Peer>,
    next_id: usize,
    events: mpsc::Sender<PeerEvent>,
    /// Where the peers' own connections come in.
    pub doors: Arc<Doors>,
}

impl Peers {
    pub fn new(events: mpsc::Sender<PeerEvent>) -> Self {
        Self {
            running: BTreeMap::new(),
            next_id: 0,
            events,
            doors: Arc::default(),
        }
    }

    /// Starts `spec` with `ctx` (whose `stop` is replaced by the peer's own).
    pub fn start(&mut self, spec: PeerSettings, ctx: &Ctx) {
        let id = self.next_id;
        self.next_id += 1;
        let shared: Shared = Arc::new(Mutex::new(PeerState::new(&spec)));
        let (stop, stop_rx) = watch::channel(None);
        let ctx = Ctx {
            stop: stop_rx,
            ..ctx.clone()
        };
        let (incoming, incoming_rx) = mpsc::channel(1);
        self.doors
            .admit(id, spec.address, spec.password.clone(), incoming);
        let task = tokio::spawn(peer_task::run(
            id,
            spec.clone(),
            ctx,
            shared.clone(),
            self.events.clone(),
            incoming_rx,
        ));
        self.running.insert(
            id,
            Peer {
                spec,
                shared,
                learned: BTreeMap::new(),
                synced: false,
                stop,
                task,
            },
        );
    }

    /// Ends peer `id` as `how` says; its routes are no longer installed. Returns its task.
    pub fn stop(&mut self, id: usize, how: Stop) -> Option<JoinHandle<()>> {
        let p = self.running.remove(&id)?;
        self.doors.forget(id, p.spec.address);
        tracing::info!(peer = %p.spec.name, how = ?how, "bgp: peer stopped");
        let _ = p.stop.send(Some(how));
        Some(p.task)
    }

    /// Ends every peer as `how` says, and waits up to a second for their last words.
    pub async fn stop_all(&mut self, how: Stop) {
        let ids: Vec<usize> = self.running.keys().copied().collect();
        let tasks: Vec<_> = ids
            .into_iter()
            .filter_map(|id| self.stop(id, how))
            .collect();
        wait(tasks).await;
    }

    /// Takes an event of a running peer; `false` for a peer that is gone.
    pub fn event(&mut self, e: PeerEvent) -> bool {
        let Some(p) = self.running.get_mut(&e.peer) else {
            return false;
        };
        p.synced |= e.synced;
        for c in e.changes {
            match c {
                Change::Add(n, nh) => {
                    p.learned.insert(n, nh);
                }
                Change::Remove(n) => {
                    p.learned.remove(&n);
                }
            }
        }
        true
    }

    /// Moves to `wanted`: peers gone are de-configured, changed ones restarted, new ones
    /// started. Returns whether anything changed.
    pub async fn reconcile(&mut self, wanted: &[PeerSettings], ctx: &Ctx) -> bool {
        let mut ended = Vec::new();
        let ids: Vec<(usize, PeerSettings)> = self
            .running
            .iter()
            .map(|(id, p)| (*id, p.spec.clone()))
            .collect();
        for (id, spec) in &ids {
            match wanted.iter().find(|w| w.name == spec.name) {
                None => ended.extend(self.stop(*id, Stop::Deconfigured)),
                Some(w) if w != spec => ended.extend(self.stop(*id, Stop::Reconfigured)),
                Some(_) => {}
            }
        }
        let changed = !ended.is_empty();
        wait(ended).await;
        let mut started = false;
        for w in wanted {
            if !self.running.values().any(|p| p.spec.name == w.name) {
                self.start(w.clone(), ctx);
                started = true;
            }
        }
        changed || started
    }
}

impl Peers {
    /// Each peer's report, the routes learned (`installed`: the route installed for each
    /// prefix, by peer id) and those advertised (`wanted`) to each established peer.
    pub fn report(
        &self,
        installed: &BTreeMap<IpNet, (usize, IpAddr)>,
        wanted: &BTreeMap<IpNet, IpAddr>,
        now: Instant,
    ) -> (Vec<PeerReport>, Vec<RouteLine>, Vec<RouteLine>) {
        let (mut peers, mut learned, mut advertised) = (Vec::new(), Vec::new(), Vec::new());
        for (id, p) in &self.running {
            let st = p.shared.lock().unwrap_or_else(|e| e.into_inner());
            let mut r = st.report.clone();
            let (received, accepted) = st.rib.counts();
            r.received = received;
            r.accepted = accepted;
            r.stale = st.rib.stale_count();
            r.malformed_updates = st.rib.malformed_updates;
            r.refused_over_limit = st.rib.refused_over_limit;
            r.uptime_secs = status::since(st.established_at, now);
            r.graceful_restart = match (p.spec.graceful_restart, r.stale > 0, p.synced) {
                (false, _, _) => "off",
                (true, true, _) => "helping",
                (true, false, false) => "waiting",
                (true, false, true) => "offered",
            }
            .into();
            for (n, l) in st.rib.routes() {
                learned.push(RouteLine {
                    prefix: n.to_string(),
                    next_hop: l.next_hop.to_string(),
                    peer: p.spec.name.clone(),
                    as_path: l.as_path.clone(),
                    accepted: l.accepted,
                    stale: l.stale,
                    installed: installed.get(n).is_some_and(|(j, _)| j == id),
                });
            }
            if r.state == "Established" {
                // Only the routes of the session's families: an IPv4 session that carries
                // no IPv6 is sent no IPv6 block.
                let sent = wanted
                    .iter()
                    .filter(|(n, _)| st.families.contains(&Family::of(n)));
                for (n, nh) in sent {
                    advertised.push(RouteLine {
                        prefix: n.to_string(),
                        next_hop: nh.to_string(),
                        peer: p.spec.name.clone(),
                        as_path: Vec::new(),
                        accepted: true,
                        stale: false,
                        installed: false,
                    });
                }
            }
            peers.push(r);
        }
        (peers, learned, advertised)
    }
}

/// Waits up to a second for `tasks`; aborts what is left.
async fn wait(tasks: Vec<JoinHandle<()>>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    for t in tasks {
        let abort = t.abort_handle();
        if tokio::time::timeout_at(deadline, t).await.is_err() {
            abort.abort();
        }
    }
}
