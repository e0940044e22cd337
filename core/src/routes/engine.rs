//! Route distribution's state, pure: the datastore's view, the followed peers' sessions and
//! their routes' verdicts in, and out of [`Engine::flush`] everything the agent acts on — its
//! own routes (served), what a reflector relays, the peers to follow, and the desired routes
//! to other nodes' pods with whether that set is complete. No sockets, no clock: the async
//! shell ([`super::task`]) feeds it events and the time.
//!
//! A refused route is not used, and is counted and logged once its refusal has lasted
//! `settle` (the datastore watch of this agent and the peer's stream race: a route for a block
//! claimed a moment ago may arrive before this agent's view has the claim). Logged once per
//! peer and cause, counted every time a route is refused.
//!
//! Judging costs what changed: a peer's update re-judges the prefixes it changed; a block's
//! change, the routes inside its CIDR; a node record's change, that node's routes and
//! everything its own peer says; only a fresh listing of the datastore re-judges everything.
//! Merging reads only the accepted routes, settling only the refusals due: what a peer says
//! that no datastore backs costs nothing after it was judged once
//! (`incremental_verdicts_equal_a_judge_from_scratch` holds the incremental verdicts to a
//! full judge over random sequences).
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;

use super::advertise::{self, NextHops};
use super::peers::Topology;
use super::peers::{self, Target};
use super::session::Session;
use super::validate::{validate, Refusal};
use super::view::{Part, Touched, View};
use crate::ipam::pool::VxlanMode;
use crate::reconcile::remote::{self, Guarded, RemoteRoute};
use crate::store::{KeyValue, WatchEvent};
use crate::update::{PeerEvent, Unused};
use crate::Route;

/// What route distribution is configured with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// This node's name.
    pub me: String,
    pub topology: Topology,
    pub reflector: bool,
    /// How long a dropped peer's routes stay.
    pub grace: Duration,
    /// How long a refusal lasts before it is counted and logged.
    pub settle: Duration,
    pub next_hops: NextHops,
    /// Each configured pool and its `vxlan` mode.
    pub pools: Vec<(IpNet, VxlanMode)>,
    /// Every pool of the cluster as the rule for blocks needs it ([`crate::ipam::wellformed`]):
    /// blocks that break it are neither advertised nor accepted. Follows config reloads and
    /// IPPool changes ([`Engine::set_block_pools`]).
    pub blocks: Vec<crate::ipam::Pool>,
}

/// Time a route's refusal must last before it is counted and logged.
pub const SETTLE: Duration = Duration::from_secs(2);

/// What this agent makes of one route a peer announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    /// A route to this node itself (a reflector relays it back): not used, not a refusal.
    Own,
    /// Refused, for less than `settle` so far.
    Pending {
        cause: Refusal,
        since: Instant,
    },
    Refused(Refusal),
}

/// The verdicts of one peer's routes, with the accepted ones and the pending ones (by when
/// their refusal began) indexed: merging reads only the accepted, settling only the due.
#[derive(Debug, Default)]
struct Judged {
    verdicts: HashMap<IpNet, Verdict>,
    accepted: BTreeSet<IpNet>,
    pending: BTreeSet<(Instant, IpNet)>,
}

impl Judged {
    /// Sets (`None`: removes) the verdict of `p`, keeping the indexes.
    fn set(&mut self, p: IpNet, v: Option<Verdict>) {
        let old = match v {
            Some(v) => self.verdicts.insert(p, v),
            None => self.verdicts.remove(&p),
        };
        match old {
            Some(Verdict::Accepted) => {
                self.accepted.remove(&p);
            }
            Some(Verdict::Pending { since, .. }) => {
                self.pending.remove(&(since, p));
            }
            _ => {}
        }
        match v {
            Some(Verdict::Accepted) => {
                self.accepted.insert(p);
            }
            Some(Verdict::Pending { since, .. }) => {
                self.pending.insert((since, p));
            }
            _ => {}
        }
    }
}

/// What the agent acts on after a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outputs {
    /// This node's routes (served to every watcher).
    pub own: BTreeMap<IpNet, Route>,
    /// What a reflector relays: its own routes and every validated route its peers announced
    /// as their own (equal to `own` on other agents).
    pub relay: BTreeMap<IpNet, Route>,
    /// The routes to other nodes' pods.
    pub desired: Vec<RemoteRoute>,
    /// Whether `desired` is the whole truth (see [`Engine`]).
    pub complete: bool,
    /// The peers to follow.
    pub peers: BTreeMap<String, Target>,
}

/// A peer's update in a few words, for the debug log: its kind, generation, and the first
/// few prefixes it adds and withdraws.
pub fn describe(ev: &PeerEvent) -> String {
    fn some<T: std::fmt::Display>(items: &[T]) -> String {
        const SHOWN: usize = 4;
        let mut text: Vec<String> = items.iter().take(SHOWN).map(|i| i.to_string()).collect();
        if items.len() > SHOWN {
            text.push(format!("… {} more", items.len() - SHOWN));
        }
        format!("[{}]", text.join(", "))
    }
    let prefixes = |routes: &[Route]| some(&routes.iter().map(|r| r.prefix).collect::<Vec<_>>());
    match ev {
        PeerEvent::Snapshot {
            generation, routes, ..
        } => format!("snapshot {generation}: {}", prefixes(routes)),
        PeerEvent::Delta {
            generation,
            routes,
            withdrawn,
            ..
        } => format!(
            "delta {generation}: +{} -{}",
            prefixes(routes),
            some(withdrawn)
        ),
        PeerEvent::Down { reason, .. } => format!("down: {reason}"),
    }
}

/// Route distribution's state.
pub struct Engine {
    s: Settings,
    view: View,
    /// Whether each part of the view (blocks, nodes) has been listed.
    listed: [bool; 2],
    /// Every route is to be judged again (the view was listed afresh).
    rejudge_all: bool,
    sessions: BTreeMap<String, Session>,
    verdicts: HashMap<String, Judged>,
    refusals: BTreeMap<Refusal, u64>,
    /// (peer, cause) already logged.
    logged: HashSet<(String, Refusal)>,
    /// Withdrawals of prefixes their peer did not hold, ignored.
    unknown_withdrawals: u64,
    /// Peers whose ignored withdrawals were logged.
    logged_withdrawals: HashSet<String>,
    /// Streams dropped because the peer broke the protocol or a bound, by cause.
    dropped: BTreeMap<&'static str, u64>,
    /// Every peer known at the first sync has answered (or waited out its grace). Latched:
    /// peers that appear later have no routes of old in the kernel to protect.
    complete: bool,
    /// Prefixes warned about for lack of a next hop of their family.
    unroutable_warned: bool,
    /// Routes judged so far (what judging costs).
    judged: u64,
    /// Accepted routes the route guard keeps out of the desired set, and why.
    guarded: BTreeMap<IpNet, (Route, Guarded)>,
    /// Routes the guard kept out, by cause (each counted when it starts being kept out).
    guard_counts: BTreeMap<Guarded, u64>,
    /// The guard's log, throttled per cause: when it last logged, and what it held back since.
    guard_logged: HashMap<Guarded, (Instant, u64)>,
}

/// The route guard logs at most one line per cause this often.
pub const GUARD_LOG_EVERY: Duration = Duration::from_secs(60);

impl Engine {
    pub fn new(s: Settings) -> Self {
        Self {
            view: View::with_pools(s.blocks.clone()),
            s,
            listed: [false; 2],
            rejudge_all: true,
            sessions: BTreeMap::new(),
            verdicts: HashMap::new(),
            refusals: BTreeMap::new(),
            logged: HashSet::new(),
            unknown_withdrawals: 0,
            logged_withdrawals: HashSet::new(),
            dropped: BTreeMap::new(),
            complete: false,
            unroutable_warned: false,
            judged: 0,
            guarded: BTreeMap::new(),
            guard_counts: BTreeMap::new(),
            guard_logged: HashMap::new(),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.s
    }

    pub fn view(&self) -> &View {
        &self.view
    }

    /// A fresh listing of one part of the datastore.
    pub fn view_listed(&mut self, part: Part, kvs: Vec<KeyValue>) {
        self.view.replace(part, kvs);
        self.listed[part as usize] = true;
        self.rejudge_all = true;
    }

    /// One change in the datastore; returns whether the view changed. Only the routes it can
    /// affect are judged again: those inside a changed block's CIDR; for a node record, that
    /// node's routes, and every route its own peer announces (the record says whether it may
    /// relay).
    pub fn view_event(&mut self, ev: &WatchEvent) -> bool {
        match self.view.change(ev) {
            Touched::Nothing => false,
            Touched::Blocks(cidrs) => {
                for s in self.sessions.values_mut() {
                    for cidr in &cidrs {
                        s.touch_inside(cidr);
                    }
                }
                true
            }
            Touched::Node(node) => {
                for (peer, s) in &mut self.sessions {
                    if *peer == node {
                        s.changed_all = true;
                    } else {
                        s.touch_node(&node);
                    }
                }
                true
            }
        }
    }

    /// New pools for the rule for blocks (a reload, an IPPool change): every block is sorted
    /// again, and every route judged again at the next flush.
    pub fn set_block_pools(&mut self, pools: Vec<crate::ipam::Pool>) {
        self.s.blocks.clone_from(&pools);
        self.rejudge_all |= self.view.set_pools(pools);
    }

    /// Both parts of the datastore are listed: peers and validation can be trusted.
    pub fn synced(&self) -> bool {
        self.listed.iter().all(|l| *l)
    }

    /// What peer `name`'s stream delivered. Events of a peer not followed (any more) are
    /// ignored.
    pub fn peer_event(&mut self, name: &str, ev: PeerEvent, now: Instant) {
        let grace = self.s.grace;
        let Some(session) = self.sessions.get_mut(name) else {
            return;
        };
        tracing::debug!(peer = %name, update = %describe(&ev), "routes: peer's update taken");
        let unused = match ev {
            PeerEvent::Snapshot {
                generation,
                routes,
                unused,
            } => {
                session.snapshot(generation, routes, now);
                unused
            }
            PeerEvent::Delta {
                generation,
                routes,
                withdrawn,
                unused,
            } => {
                session.delta(generation, routes, &withdrawn, now);
                unused
            }
            PeerEvent::Down { reason, broke } => {
                if session.keeps_routes()
                    && !matches!(session.state, super::session::State::Grace { .. })
                {
                    tracing::warn!(peer = %name, %reason, grace_secs = grace.as_secs(),
                        "routes: peer's stream ended; its routes stay for the grace period");
                }
                if let Some(e) = broke {
                    *session.dropped.entry(e.name()).or_default() += 1;
                    *self.dropped.entry(e.name()).or_default() += 1;
                }
                session.down(reason, now, grace);
                Unused::default()
            }
        };
        session.malformed += unused.malformed;
        session.unknown_withdrawals += unused.unknown_withdrawals;
        if unused.malformed > 0 {
            *self.refusals.entry(Refusal::Malformed).or_default() += unused.malformed;
            if self.logged.insert((name.to_string(), Refusal::Malformed)) {
                let example = unused.examples.first().map(String::as_str).unwrap_or("");
                tracing::warn!(peer = %name, route = %example, count = unused.malformed,
                    "routes: refused a route that does not parse (logged once per peer)");
            }
        }
        if unused.unknown_withdrawals > 0 {
            self.unknown_withdrawals += unused.unknown_withdrawals;
            if self.logged_withdrawals.insert(name.to_string()) {
                tracing::warn!(peer = %name, count = unused.unknown_withdrawals,
                    "routes: ignored withdrawals of prefixes the peer does not hold (counted, logged once per peer)");
            }
        }
    }

    /// Advances the timers: grace periods that ran out, refusals that lasted `settle`.
    pub fn tick(&mut self, now: Instant) {
        for (name, s) in &mut self.sessions {
            if s.tick(now) {
                tracing::warn!(peer = %name, "routes: peer did not come back within the grace period; its routes are withdrawn");
            }
        }
        self.settle_refusals(now);
    }

    /// When [`Engine::tick`] (grace periods, refusals to settle: due until ticked, even if
    /// already past) or [`Engine::flush`] (a peer never heard from counting as settled, for
    /// `complete`: only while ahead of `now`) next have something to do.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        use super::session::State;
        let sessions = self.sessions.values().filter_map(|s| match s.state {
            State::Grace { until } => Some(until),
            State::Connecting { since } if !self.complete => {
                Some(since + self.s.grace).filter(|d| *d > now)
            }
            _ => None,
        });
        let pending = self
            .verdicts
            .values()
            .filter_map(|j| j.pending.first().map(|(since, _)| *since + self.s.settle));
        sessions.chain(pending).min()
    }

    /// Recomputes everything from the view and the sessions.
    pub fn flush(&mut self, now: Instant) -> Outputs {
        let peers = peers::wanted(&self.view, &self.s.me, self.s.topology, self.s.reflector);
        self.sessions.retain(|name, s| {
            let keep = peers.contains_key(name);
            if !keep && s.keeps_routes() {
                tracing::info!(peer = %name, "routes: no longer following this peer (its node record is gone or changed role); its routes are withdrawn");
            }
            keep
        });
        self.verdicts.retain(|name, _| peers.contains_key(name));
        for (name, t) in &peers {
            let s = self
                .sessions
                .entry(name.clone())
                .or_insert_with(|| Session::new(t.endpoint.clone(), now));
            s.endpoint.clone_from(&t.endpoint);
        }
        let names: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| self.rejudge_all || s.stale())
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            self.judge(&name, self.rejudge_all, now);
        }
        self.settle_refusals(now);
        self.rejudge_all = false;

        let own = advertise::own_routes(&self.view, &self.s.me, &self.s.next_hops);
        if !self.unroutable_warned {
            let lost = advertise::unroutable(&self.view, &self.s.me, &self.s.next_hops);
            if let Some(p) = lost.first() {
                self.unroutable_warned = true;
                tracing::warn!(prefix = %p, count = lost.len(), "routes: this node has no address of this family to advertise its routes with (routes.node_addresses)");
            }
        }
        let mut relay = own.clone();
        let mut best: BTreeMap<IpNet, (&Route, bool)> = BTreeMap::new();
        for (peer, s) in &self.sessions {
            if !s.keeps_routes() {
                continue;
            }
            let Some(judged) = self.verdicts.get(peer) else {
                continue;
            };
            for r in accepted_routes(&judged.accepted, &s.routes) {
                let p = &r.prefix;
                let direct = r.node == *peer;
                if direct && self.s.reflector {
                    relay.entry(*p).or_insert_with(|| r.clone());
                }
                match best.get(p) {
                    Some((_, true)) => {}
                    Some((_, false)) if !direct => {}
                    _ => {
                        best.insert(*p, (r, direct));
                    }
                }
            }
        }
        let (desired, guarded) = guard(
            best.values().map(|(r, _)| *r),
            &self.s.blocks,
            &self.protected(),
            |p| self.vxlan_for(p),
        );
        self.count_guarded(guarded, now);
        if !self.complete
            && self.synced()
            && self.sessions.values().all(|s| s.settled(now, self.s.grace))
        {
            self.complete = true;
            tracing::info!(peers = self.sessions.len(), "routes: every peer answered (or its grace ran out): stale routes may go from now on");
        }
        Outputs {
            own,
            relay,
            desired,
            complete: self.complete,
            peers,
        }
    }

    /// The addresses no route may cover: every node record's, and this node's next hops'.
    /// Only those inside a pool: a route that passed the pool checks covers no other.
    fn protected(&self) -> Vec<IpAddr> {
        let pools = &self.s.blocks;
        self.view
            .nodes()
            .flat_map(|n| n.addresses.iter().copied())
            .chain(self.s.next_hops.all())
            .filter(|a| pools.iter().any(|p| p.cidr.contains(a)))
            .collect()
    }

    /// Counts and logs the routes the guard keeps out ([`guard`]): each counted when it starts
    /// being kept out, logged at most once per cause per [`GUARD_LOG_EVERY`].
    fn count_guarded(&mut self, guarded: BTreeMap<IpNet, (Route, Guarded)>, now: Instant) {
        for (prefix, (r, cause)) in &guarded {
            if self.guarded.get(prefix).is_some_and(|(_, c)| c == cause) {
                continue;
            }
            *self.guard_counts.entry(*cause).or_default() += 1;
            let logged = self.guard_logged.get(cause).copied();
            match logged {
                Some((at, held)) if now.saturating_duration_since(at) < GUARD_LOG_EVERY => {
                    self.guard_logged.insert(*cause, (at, held + 1));
                }
                _ => {
                    let held = logged.map_or(0, |(_, h)| h);
                    tracing::warn!(cause = %cause, %prefix, node = %r.node, next_hop = %r.next_hop,
                        held_back = held,
                        "routes: route guard: {}; never programmed (at most one line per cause a minute)",
                        cause.explain());
                    self.guard_logged.insert(*cause, (now, 0));
                }
            }
        }
        self.guarded = guarded;
    }

    /// Accepted routes the route guard keeps out, and why.
    pub fn guarded(&self) -> &BTreeMap<IpNet, (Route, Guarded)> {
        &self.guarded
    }

    /// Routes the route guard kept out so far, by cause.
    pub fn guard_counts(&self) -> &BTreeMap<Guarded, u64> {
        &self.guard_counts
    }

    /// Judges the routes of `peer` that changed since it was last judged (`all`: every one).
    fn judge(&mut self, peer: &str, all: bool, now: Instant) {
        let Some(s) = self.sessions.get_mut(peer) else {
            return;
        };
        let judged = self.verdicts.entry(peer.to_string()).or_default();
        let relays = self.view.node(peer).is_some_and(|n| n.record.reflector);
        let prefixes: Vec<IpNet> = if all || s.changed_all {
            // Verdicts of prefixes gone, and every route there is.
            let gone = judged.verdicts.keys().filter(|p| !s.routes.contains_key(p));
            gone.chain(s.routes.keys()).copied().collect()
        } else {
            s.changed.iter().copied().collect()
        };
        s.changed.clear();
        s.changed_all = false;
        for p in prefixes {
            let Some(r) = s.routes.get(&p) else {
                judged.set(p, None);
                continue;
            };
            self.judged += 1;
            let v = if r.node == self.s.me && relays {
                Verdict::Own
            } else {
                match validate(&self.view, peer, r) {
                    Ok(()) => Verdict::Accepted,
                    Err(cause) => match judged.verdicts.get(&p) {
                        Some(Verdict::Pending { cause: c, since }) if *c == cause => {
                            Verdict::Pending {
                                cause,
                                since: *since,
                            }
                        }
                        Some(Verdict::Refused(c)) if *c == cause => Verdict::Refused(cause),
                        _ => Verdict::Pending { cause, since: now },
                    },
                }
            };
            match (judged.verdicts.get(&p), v) {
                (Some(old), new) if *old == new => {}
                (Some(Verdict::Pending { since, .. }), Verdict::Accepted) => {
                    tracing::debug!(%peer, prefix = %p, pending_for = ?now.saturating_duration_since(*since),
                        "routes: route accepted (was pending)");
                }
                (old, Verdict::Pending { cause, .. }) => {
                    tracing::debug!(%peer, prefix = %p, %cause, was = ?old,
                        "routes: route pending (refused for now; judged again when the datastore changes)");
                }
                (old, new) => {
                    tracing::debug!(%peer, prefix = %p, verdict = ?new, was = ?old, "routes: route judged");
                }
            }
            judged.set(p, Some(v));
        }
    }

    /// Refusals that lasted `settle`: counted, and logged once per peer and cause.
    fn settle_refusals(&mut self, now: Instant) {
        for (peer, judged) in &mut self.verdicts {
            while let Some(&(since, p)) = judged.pending.first() {
                if since + self.s.settle > now {
                    break;
                }
                let Some(Verdict::Pending { cause, .. }) = judged.verdicts.get(&p).copied() else {
                    judged.pending.remove(&(since, p));
                    continue;
                };
                judged.set(p, Some(Verdict::Refused(cause)));
                *self.refusals.entry(cause).or_default() += 1;
                if self.logged.insert((peer.clone(), cause)) {
                    let route = self.sessions.get(peer).and_then(|s| s.routes.get(&p));
                    tracing::warn!(peer = %peer, cause = %cause, prefix = %p,
                        node = route.map(|r| r.node.as_str()).unwrap_or(""),
                        next_hop = %route.map(|r| r.next_hop.to_string()).unwrap_or_default(),
                        "routes: refused a route: {}; it is not used (further refusals of this peer for this cause are counted, not logged)",
                        cause.explain());
                }
            }
        }
    }

    /// The `vxlan` mode of the pool holding `prefix` (the default when none does).
    pub fn vxlan_for(&self, prefix: &IpNet) -> VxlanMode {
        self.s
            .pools
            .iter()
            .find(|(pool, _)| pool.contains(prefix))
            .map(|(_, m)| *m)
            .unwrap_or_default()
    }

    pub fn sessions(&self) -> &BTreeMap<String, Session> {
        &self.sessions
    }

    pub fn verdict(&self, peer: &str, prefix: &IpNet) -> Option<Verdict> {
        self.verdicts.get(peer)?.verdicts.get(prefix).copied()
    }

    /// How many routes of `peer` are accepted.
    pub fn accepted(&self, peer: &str) -> usize {
        self.verdicts.get(peer).map_or(0, |j| j.accepted.len())
    }

    /// Routes refused so far, by cause.
    pub fn refusals(&self) -> &BTreeMap<Refusal, u64> {
        &self.refusals
    }

    pub fn complete(&self) -> bool {
        self.complete
    }

    /// Routes judged (validated, or found to be this node's own) so far: what judging costs.
    pub fn judged(&self) -> u64 {
        self.judged
    }

    /// Withdrawals of prefixes their peer did not hold, ignored so far.
    pub fn unknown_withdrawals(&self) -> u64 {
        self.unknown_withdrawals
    }

    /// Streams dropped so far because the peer broke the protocol or a bound, by cause
    /// ([`WireError::name`]).
    pub fn dropped(&self) -> &BTreeMap<&'static str, u64> {
        &self.dropped
    }
}

/// The route guard over the accepted routes, whatever validation said: a route outside every
/// pool, shorter than its pool's blocks, or covering one of the `protected` addresses never
/// reaches the reconciler. The routes to program, and those kept out with why.
fn guard<'a>(
    accepted: impl Iterator<Item = &'a Route>,
    pools: &[crate::ipam::Pool],
    protected: &[IpAddr],
    vxlan_for: impl Fn(&IpNet) -> VxlanMode,
) -> (Vec<RemoteRoute>, BTreeMap<IpNet, (Route, Guarded)>) {
    let mut desired = Vec::with_capacity(accepted.size_hint().0);
    let mut guarded = BTreeMap::new();
    for r in accepted {
        let verdict = remote::guard(&r.prefix, pools).and_then(|()| {
            match remote::covered(&r.prefix, protected) {
                Some(_) => Err(Guarded::CoversNodeAddress),
                None => Ok(()),
            }
        });
        match verdict {
            Ok(()) => desired.push(RemoteRoute {
                prefix: r.prefix,
                node: r.node.clone(),
                next_hop: r.next_hop,
                vxlan: vxlan_for(&r.prefix),
            }),
            Err(cause) => {
                guarded.insert(r.prefix, (r.clone(), cause));
            }
        }
    }
    (desired, guarded)
}

/// The routes of `routes` whose prefix is in `accepted` (a subset of its keys), in order: by
/// lookup when few are accepted (what a peer says that is refused costs nothing here), by
/// walking both in step when most are.
fn accepted_routes<'a>(
    accepted: &'a BTreeSet<IpNet>,
    routes: &'a BTreeMap<IpNet, Route>,
) -> Box<dyn Iterator<Item = &'a Route> + 'a> {
    // A lookup costs about log2(routes) steps of a walk.
    let lookup = routes.len().max(2).ilog2() as usize;
    if accepted.len().saturating_mul(lookup) < routes.len() {
        Box::new(accepted.iter().filter_map(|p| routes.get(p)))
    } else {
        let mut wanted = accepted.iter().peekable();
        Box::new(routes.iter().filter_map(move |(p, r)| {
            while wanted.next_if(|w| *w < p).is_some() {}
            wanted.next_if(|w| *w == p).map(|_| r)
        }))
    }
}

#[cfg(test)]
mod tests;
