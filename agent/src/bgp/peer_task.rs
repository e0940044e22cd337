//! One configured peer, for the agent's lifetime: connect (with back-off), run a session,
//! announce this node's routes and follow their changes, take the peer's routes through the
//! import rule into its [`PeerRib`], and tell the speaker what to install. Graceful restart
//! both ways: this node's sessions offer it (the R bit on the first session after a start, the
//! F bit always: the dataplane forwards while the agent is away), and a peer's routes are kept
//! as stale when its connection drops without a NOTIFICATION.
//!
//! Only this task reads and writes the connection. Writes never wait for longer than the hold
//! time (a peer that stops reading loses its session, not the node's memory: nothing is queued
//! beyond the socket's buffer).
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_bgp::advertise::Advertised;
use calix_bgp::import::ImportRule;
use calix_bgp::notification;
use calix_bgp::peer::{Change, PeerRib};
use calix_bgp::session::{LocalConfig, LocalRestart, Negotiated, Output, Session, State};
use calix_bgp::update::AsSegment;
use calix_bgp::{Family, PathAttributes, UpdateBuilder};
use ipnet::IpNet;
use tokio::sync::{mpsc, watch};

use super::conn::{self, sleep_until, Connection, Read};
use super::listen::Incoming;
use super::settings::{connect_backoff, PeerSettings};
use super::status::PeerReport;

/// The routes this node advertises: prefix → next hop.
pub type Wanted = BTreeMap<IpNet, IpAddr>;

/// How the agent stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// A restart (SIGTERM): connections close without a NOTIFICATION, so peers keep this
    /// node's routes for the restart time.
    Restart,
    /// For good (an uninstall): Cease, administrative shutdown; peers drop the routes now.
    ForGood,
    /// The peer left the configuration: Cease, peer de-configured.
    Deconfigured,
    /// The peer's or this speaker's settings changed: Cease, other configuration change; a
    /// new session follows with the new settings.
    Reconfigured,
}

impl Stop {
    /// The Cease subcode the session ends with; `None`: no NOTIFICATION (a restart).
    fn cease(self) -> Option<u8> {
        match self {
            Stop::Restart => None,
            Stop::ForGood => Some(notification::cease::ADMIN_SHUTDOWN),
            Stop::Deconfigured => Some(notification::cease::PEER_DECONFIGURED),
            Stop::Reconfigured => Some(notification::cease::CONFIG_CHANGE),
        }
    }
}

/// What every peer task shares.
#[derive(Clone)]
pub struct Ctx {
    pub asn: u32,
    pub router_id: Ipv4Addr,
    /// This node's next hops (also its source address toward a peer of that family).
    pub own: Vec<IpAddr>,
    pub restart_time: u16,
    /// What this node advertises; `None` until its blocks are listed.
    pub wanted: watch::Receiver<Option<Arc<Wanted>>>,
    pub import: watch::Receiver<Arc<ImportRule>>,
    pub stop: watch::Receiver<Option<Stop>>,
    /// Where a session going down is told (a Warning Event on the Node in Kubernetes).
    pub notices: Arc<crate::notice::Notifier>,
}

/// A peer's routes and report, shared with the speaker (for `calixctl bgp`).
pub struct PeerState {
    pub rib: PeerRib,
    pub report: PeerReport,
    pub established_at: Option<Instant>,
    /// The families the Established session carries (none when it is not): those of this
    /// node's routes it is sent.
    pub families: Vec<Family>,
}

impl PeerState {
    /// Before its first connection: Idle, nothing learned.
    pub fn new(spec: &PeerSettings) -> Self {
        Self {
            rib: PeerRib::new(spec.max_prefixes, spec.limit_action),
            report: PeerReport {
                name: spec.name.clone(),
                address: spec.address.to_string(),
                asn: spec.asn,
                state: "Idle".into(),
                ..PeerReport::default()
            },
            established_at: None,
            families: Vec::new(),
        }
    }
}

pub type Shared = Arc<Mutex<PeerState>>;

/// What a peer task tells the speaker: changes of the routes to install from it, and whether
/// its routes are whole (its End-of-RIB came in, for every family, since the agent started).
#[derive(Debug)]
pub struct PeerEvent {
    pub peer: usize,
    pub changes: Vec<Change>,
    pub synced: bool,
}

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, PeerState> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// The session's families: those this node has a next hop for.
fn families(own: &[IpAddr]) -> Vec<Family> {
    let mut f = Vec::new();
    if own.iter().any(IpAddr::is_ipv4) {
        f.push(Family::IPV4_UNICAST);
    }
    if own.iter().any(IpAddr::is_ipv6) {
        f.push(Family::IPV6_UNICAST);
    }
    f
}

/// Whether a route the peer announced is taken: the import rule's prefixes, a next hop of the
/// prefix's family that is not this node's, and no loop through this node's AS.
pub fn accepts(
    rule: &ImportRule,
    asn: u32,
    own: &[IpAddr],
    prefix: &IpNet,
    next_hop: &IpAddr,
    mut as_path: impl Iterator<Item = u32>,
) -> bool {
    let same_family = matches!(
        (prefix, next_hop),
        (IpNet::V4(_), IpAddr::V4(_)) | (IpNet::V6(_), IpAddr::V6(_))
    );
    same_family
        && !next_hop.is_unspecified()
        && !own.contains(next_hop)
        && rule.accepts(prefix)
        && !as_path.any(|a| a == asn)
}

/// Runs peer `idx` until the agent stops; `incoming`: the connections it opened to this node.
pub async fn run(
    idx: usize,
    spec: PeerSettings,
    mut ctx: Ctx,
    state: Shared,
    events: mpsc::Sender<PeerEvent>,
    mut incoming: mpsc::Receiver<Incoming>,
) {
    let mut p = Peer {
        idx,
        local: ctx
            .own
            .iter()
            .find(|a| a.is_ipv4() == spec.address.is_ipv4())
            .copied(),
        spec,
        state,
        events,
        synced: false,
        restarted: true,
    };
    let mut failures = 0u32;
    // A connection the peer opened, to run the next session on.
    let mut next: Option<Box<Incoming>> = None;
    loop {
        let start = if let Some(inc) = next.take() {
            Start::Accepted(inc)
        } else {
            p.set_state("Connect");
            let target = SocketAddr::new(p.spec.address, p.spec.port);
            let password = p.spec.password.clone();
            let connect =
                conn::connect(p.local, target, password.as_deref(), Duration::from_secs(5));
            tokio::pin!(connect);
            loop {
                let stale = lock(&p.state).rib.stale_deadline();
                tokio::select! {
                    r = &mut connect => break Start::Dialed(r.map_err(|e| format!("cannot connect to {target}: {e}"))),
                    Some(inc) = incoming.recv() => break Start::Accepted(Box::new(inc)),
                    () = sleep_until(stale) => p.expire().await,
                    r = ctx.import.changed() => {
                        if r.is_err() { return; }
                        p.reimport(&ctx).await;
                    }
                    _ = ctx.stop.changed() => return,
                }
            }
        };
        let run = match start {
            Start::Dialed(Ok(stream)) => {
                tracing::info!(peer = %p.spec.name, "bgp: connected");
                p.session(Connection::new(stream), None, &mut ctx, &mut incoming)
                    .await
            }
            Start::Accepted(inc) => {
                let Incoming { conn, first, from } = *inc;
                tracing::info!(peer = %p.spec.name, %from, "bgp: the peer connected");
                p.session(conn, Some(first), &mut ctx, &mut incoming).await
            }
            Start::Dialed(Err(why)) => Some(Ended::Failed(why)),
        };
        let Some(ended) = run else { return };
        match ended {
            Ended::Replaced(inc) => {
                // The collision is settled for the peer's connection: on at once.
                next = Some(inc);
                continue;
            }
            Ended::Failed(why) => {
                failures = failures.saturating_add(1);
                p.note_error(&why);
            }
            Ended::Down(why) => {
                failures = 1;
                p.note_error(&why);
                ctx.notices.warning(
                    "BGPSessionDown",
                    crate::notice::Subject::Node,
                    format!(
                        "BGP session with {} ({} AS {}) went down: {why}",
                        p.spec.name, p.spec.address, p.spec.asn
                    ),
                );
            }
        }
        // Nothing more to wait for from it: the routes installed need not wait for a peer
        // that cannot be reached (its stale routes, if any, keep their timer).
        p.mark_synced().await;
        p.set_state("Idle");
        let wait = connect_backoff(failures.saturating_sub(1));
        let until = Instant::now() + wait;
        loop {
            let stale = lock(&p.state).rib.stale_deadline();
            tokio::select! {
                () = sleep_until(Some(until)) => break,
                Some(inc) = incoming.recv() => {
                    next = Some(Box::new(inc));
                    break;
                }
                () = sleep_until(stale) => p.expire().await,
                r = ctx.import.changed() => {
                    if r.is_err() { return; }
                    p.reimport(&ctx).await;
                }
                _ = ctx.stop.changed() => return,
            }
        }
    }
}

/// How a session begins: on a connection this node opened, or on one the peer opened.
enum Start {
    Dialed(Result<tokio::net::TcpStream, String>),
    Accepted(Box<Incoming>),
}

/// Which connection a collision keeps (RFC 4271 §6.8): an Established session stays; else
/// the one opened by the speaker with the higher BGP identifier. `ours_dialed`: the running
/// connection is one this node opened (of two the peer opened, the first stays).
fn incoming_wins(
    established: bool,
    ours_dialed: bool,
    local_id: Ipv4Addr,
    remote_id: Option<Ipv4Addr>,
) -> bool {
    !established && ours_dialed && remote_id.is_some_and(|r| u32::from(local_id) < u32::from(r))
}

/// How a connection ended: it never reached Established, or a session went down.
enum Ended {
    Failed(String),
    Down(String),
    /// A collision: the peer's connection is kept, this one closed.
    Replaced(Box<Incoming>),
}

struct Peer {
    idx: usize,
    spec: PeerSettings,
    /// This node's address of the peer's family: the connection's source.
    local: Option<IpAddr>,
    state: Shared,
    events: mpsc::Sender<PeerEvent>,
    /// The peer's routes are whole since the agent started.
    synced: bool,
    /// No session reached Established since the agent started (the R bit).
    restarted: bool,
}

impl Peer {
    fn set_state(&self, s: &str) {
        let mut st = lock(&self.state);
        st.report.state = s.to_string();
        if s != "Established" {
            st.established_at = None;
        }
    }

    fn note_error(&self, why: &str) {
        tracing::warn!(peer = %self.spec.name, error = %why, "bgp: peer down");
        lock(&self.state).report.last_error = why.to_string();
    }

    async fn tell(&mut self, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        let ev = PeerEvent {
            peer: self.idx,
            changes,
            synced: self.synced,
        };
        let _ = self.events.send(ev).await;
    }

    /// The peer's routes are whole (or it has none to wait for): told once, even without
    /// changes, as the installed set may be whole now.
    async fn mark_synced(&mut self) {
        if self.synced {
            return;
        }
        self.synced = true;
        let ev = PeerEvent {
            peer: self.idx,
            changes: Vec::new(),
            synced: true,
        };
        let _ = self.events.send(ev).await;
    }

    async fn expire(&mut self) {
        let changes = lock(&self.state).rib.expire(Instant::now());
        if !changes.is_empty() {
            tracing::info!(peer = %self.spec.name, routes = changes.len(),
                "bgp: the peer's restart time ran out: its stale routes go");
        }
        self.tell(changes).await;
    }

    async fn reimport(&mut self, ctx: &Ctx) {
        let rule = ctx.import.borrow().clone();
        let changes = lock(&self.state)
            .rib
            .reimport(|n, nh, path| accepts(&rule, ctx.asn, &ctx.own, n, nh, path.iter().copied()));
        self.tell(changes).await;
    }

    fn local_config(&self, ctx: &Ctx) -> LocalConfig {
        LocalConfig {
            asn: ctx.asn,
            router_id: ctx.router_id,
            peer_asn: self.spec.asn,
            hold_time: self.spec.hold_time,
            families: families(&ctx.own),
            graceful_restart: self.spec.graceful_restart.then_some(LocalRestart {
                restart_time: ctx.restart_time,
                restarting: self.restarted,
                forwarding_preserved: true,
            }),
        }
    }

    fn builder(&self, ctx: &Ctx, n: &Negotiated) -> UpdateBuilder {
        let external = self.spec.external(ctx.asn);
        UpdateBuilder {
            four_octet_as: n.four_octet_as,
            attributes: PathAttributes {
                as_path: if external {
                    vec![AsSegment {
                        set: false,
                        asns: vec![ctx.asn],
                    }]
                } else {
                    Vec::new()
                },
                local_pref: (!external).then_some(100),
                communities: self.spec.communities.clone(),
                ..PathAttributes::default()
            },
        }
    }

    /// Runs one connection until it closes; `None`: the agent stops. `first`: the message
    /// already read from a connection the peer opened; `incoming`: the peer's connections
    /// that may collide with this one.
    async fn session(
        &mut self,
        mut c: Connection,
        first: Option<Result<calix_bgp::Message, calix_bgp::DecodeError>>,
        ctx: &mut Ctx,
        incoming: &mut mpsc::Receiver<Incoming>,
    ) -> Option<Ended> {
        let now = Instant::now();
        let (mut session, opening) = Session::start(self.local_config(ctx), now);
        self.set_state("OpenSent");
        let mut queue: VecDeque<Output> = opening.into();
        let ours_dialed = first.is_none();
        if let Some(m) = first {
            queue.extend(session.on_message(now, m));
        }
        let mut replaced: Option<Box<Incoming>> = None;
        let mut advertised = Advertised::default();
        // Established before this node's routes were known: End-of-RIB waits for them.
        let mut eor_pending = false;
        let mut negotiated: Option<Negotiated> = None;
        let mut builder: Option<UpdateBuilder> = None;
        let mut awaiting_eor: BTreeSet<Family> = BTreeSet::new();
        loop {
            // Everything the last step asked for, in order.
            while let Some(o) = queue.pop_front() {
                match o {
                    Output::Send(bytes) => {
                        let limit = negotiated
                            .as_ref()
                            .filter(|n| n.hold_time > 0)
                            .map_or(Duration::from_secs(90), |n| {
                                Duration::from_secs(u64::from(n.hold_time))
                            });
                        let r = tokio::time::timeout(limit, c.write(&bytes)).await;
                        let failed = match r {
                            Ok(Ok(())) => None,
                            Ok(Err(e)) => Some(e.to_string()),
                            Err(_) => Some(format!(
                                "the peer read nothing for {}s (its receive window stayed full)",
                                limit.as_secs()
                            )),
                        };
                        if let Some(why) = failed {
                            queue.clear();
                            queue.extend(session.connection_lost(&why));
                        }
                    }
                    Output::Established(n) => {
                        tracing::info!(peer = %self.spec.name, hold_time = n.hold_time,
                            families = ?n.families.iter().map(ToString::to_string).collect::<Vec<_>>(),
                            graceful_restart = n.peer_restart.is_some(), "bgp: session established");
                        self.restarted = false;
                        let changes = {
                            let mut st = lock(&self.state);
                            st.report.state = "Established".into();
                            st.report.established_total += 1;
                            st.established_at = Some(Instant::now());
                            st.families = n.families.clone();
                            st.rib.session_up(&n)
                        };
                        // Without graceful restart the peer sends no End-of-RIB.
                        awaiting_eor = if n.peer_restart.is_some() {
                            n.families.iter().copied().collect()
                        } else {
                            BTreeSet::new()
                        };
                        self.tell(changes).await;
                        if awaiting_eor.is_empty() {
                            self.mark_synced().await;
                        }
                        let b = self.builder(ctx, &n);
                        // Not listed yet: the routes and End-of-RIB go once they are.
                        eor_pending = true;
                        if let Some(wanted) = ctx.wanted.borrow_and_update().clone() {
                            for m in advertised.update_to(&wanted, &n.families, &b) {
                                queue.push_back(Output::Send(m));
                            }
                            for f in &n.families {
                                queue.push_back(Output::Send(UpdateBuilder::end_of_rib(*f)));
                            }
                            eor_pending = false;
                        }
                        lock(&self.state).report.sent = advertised.routes().len();
                        builder = Some(b);
                        negotiated = Some(n);
                    }
                    Output::Update(u) => {
                        let rule = ctx.import.borrow().clone();
                        let applied = lock(&self.state).rib.apply(&u, |n, nh, attrs| {
                            accepts(&rule, ctx.asn, &ctx.own, n, nh, attrs.asns())
                        });
                        for issue in &u.issues {
                            tracing::warn!(peer = %self.spec.name, attribute = issue.type_code,
                                disposition = ?issue.disposition, what = issue.what,
                                "bgp: malformed attribute (RFC 7606): the session stays up");
                        }
                        if applied.refused > 0 {
                            tracing::warn!(peer = %self.spec.name, refused = applied.refused,
                                limit = self.spec.max_prefixes,
                                "bgp: the peer is over its prefix limit: routes refused");
                        }
                        if let Some(f) = applied.end_of_rib {
                            awaiting_eor.remove(&f);
                            if awaiting_eor.is_empty() && !self.synced {
                                tracing::info!(peer = %self.spec.name, "bgp: the peer's routes are whole (End-of-RIB)");
                                self.mark_synced().await;
                            }
                        }
                        self.tell(applied.changes).await;
                        if let Some(n) = applied.reset {
                            lock(&self.state).report.limit_resets += 1;
                            tracing::warn!(peer = %self.spec.name, limit = self.spec.max_prefixes,
                                "bgp: the peer is over its prefix limit: the session is reset");
                            queue.extend(session.close_with(n, "over the prefix limit"));
                        }
                    }
                    Output::RouteRefresh(family) => {
                        if let (Some(b), Some(n)) = (&builder, &negotiated) {
                            // Everything of the family again, then its End-of-RIB.
                            let again: Wanted =
                                advertised.routes().iter().map(|(k, v)| (*k, *v)).collect();
                            let mut fresh = Advertised::default();
                            let only: Vec<Family> = n
                                .families
                                .iter()
                                .copied()
                                .filter(|f| *f == family)
                                .collect();
                            for m in fresh.update_to(&again, &only, b) {
                                queue.push_back(Output::Send(m));
                            }
                            queue.push_back(Output::Send(UpdateBuilder::end_of_rib(family)));
                        }
                    }
                    Output::Closed {
                        reason,
                        sent,
                        received,
                    } => {
                        let graceful =
                            sent.is_none() && received.is_none() && self.spec.graceful_restart;
                        let changes = {
                            let mut st = lock(&self.state);
                            if sent
                                .as_ref()
                                .is_some_and(|n| n.code == notification::OPEN_ERROR)
                            {
                                st.report.open_refused += 1;
                            }
                            st.report.sent = 0;
                            st.families.clear();
                            if negotiated.is_some() {
                                st.report.down_total += 1;
                                st.rib
                                    .session_down(Instant::now(), negotiated.as_ref(), graceful)
                            } else {
                                // Nothing came on this connection; routes kept from an
                                // earlier one (stale) keep their timer.
                                Vec::new()
                            }
                        };
                        if !changes.is_empty() || graceful {
                            tracing::info!(peer = %self.spec.name, removed = changes.len(),
                                stale = lock(&self.state).rib.stale_count(), "bgp: session down");
                        }
                        self.tell(changes).await;
                        if let Some(inc) = replaced.take() {
                            return Some(Ended::Replaced(inc));
                        }
                        return Some(if negotiated.is_some() {
                            Ended::Down(reason)
                        } else {
                            Ended::Failed(reason)
                        });
                    }
                }
            }
            if negotiated.is_none() && session.state() == State::OpenConfirm {
                self.set_state("OpenConfirm");
            }
            let four = session.four_octet_as();
            let deadline = session.next_deadline();
            let stale = lock(&self.state).rib.stale_deadline();
            let established = negotiated.is_some();
            tokio::select! {
                r = c.read(four) => {
                    let out = match r {
                        Ok(Read::Message(m)) => session.on_message(Instant::now(), m),
                        Ok(Read::Eof) => session.connection_lost("closed by the peer"),
                        Err(e) => session.connection_lost(&e.to_string()),
                    };
                    queue.extend(out);
                }
                () = sleep_until(deadline) => queue.extend(session.tick(Instant::now())),
                Some(inc) = incoming.recv(), if replaced.is_none() => {
                    if incoming_wins(established, ours_dialed, ctx.router_id, inc.router_id()) {
                        tracing::info!(peer = %self.spec.name, from = %inc.from,
                            "bgp: connection collision: the peer's connection is kept (its BGP identifier is higher)");
                        queue.extend(session.close_with(collision(), "connection collision: the peer's connection is kept"));
                        replaced = Some(Box::new(inc));
                    } else {
                        tracing::info!(peer = %self.spec.name, from = %inc.from, established,
                            "bgp: connection collision: the peer's new connection is closed");
                        refuse(inc).await;
                    }
                }
                () = sleep_until(stale) => self.expire().await,
                r = ctx.wanted.changed(), if established => {
                    if r.is_err() { return None; }
                    if let (Some(b), Some(n)) = (&builder, &negotiated) {
                        if let Some(wanted) = ctx.wanted.borrow_and_update().clone() {
                            for m in advertised.update_to(&wanted, &n.families, b) {
                                queue.push_back(Output::Send(m));
                            }
                            if std::mem::take(&mut eor_pending) {
                                for f in &n.families {
                                    queue.push_back(Output::Send(UpdateBuilder::end_of_rib(*f)));
                                }
                            }
                        }
                        lock(&self.state).report.sent = advertised.routes().len();
                    }
                }
                r = ctx.import.changed() => {
                    if r.is_err() { return None; }
                    self.reimport(ctx).await;
                }
                r = ctx.stop.changed() => {
                    let stop = if r.is_err() { Some(Stop::Restart) } else { *ctx.stop.borrow() };
                    if let Some(sub) = stop.and_then(Stop::cease) {
                        let n = calix_bgp::Notification::new(notification::CEASE, sub);
                        for o in session.close_with(n, "stopped") {
                            if let Output::Send(bytes) = o {
                                let _ = tokio::time::timeout(Duration::from_secs(1), c.write(&bytes)).await;
                            }
                        }
                    }
                    return None;
                }
            }
        }
    }
}

/// Cease, "connection collision resolution": what the losing connection of a collision hears.
fn collision() -> calix_bgp::Notification {
    calix_bgp::Notification::new(notification::CEASE, notification::cease::COLLISION)
}

/// Closes a connection the peer opened with [`collision`].
async fn refuse(mut inc: Incoming) {
    let bytes = calix_bgp::Message::Notification(collision()).encode(false);
    let _ = tokio::time::timeout(Duration::from_secs(1), inc.conn.write(&bytes)).await;
}

#[cfg(test)]
#[path = "peer_task_tests.rs"]
mod tests;
