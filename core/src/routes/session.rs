//! One followed peer: what it said (its last snapshot and the deltas since) and the state of
//! its stream, with graceful restart: when the stream drops, the routes stay for the grace
//! period and go only if the peer has not come back by then; a reconnect's snapshot replaces
//! everything the peer said before. Time is passed in.
//!
//! It also keeps which prefixes changed since they were last judged, and can name the routes
//! a change of the datastore can affect (those inside a block's CIDR, those of one node), so
//! that judging costs what changed, not the peer's whole table.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;

use crate::Route;

/// The state of a peer's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Not heard from since this agent started following it (it may be starting too).
    Connecting { since: Instant },
    /// Streaming: its snapshot arrived.
    Up,
    /// The stream dropped; its routes are kept until `until`.
    Grace { until: Instant },
    /// The grace period ran out: its routes are withdrawn. Still retried.
    Expired,
}

impl State {
    pub fn name(&self) -> &'static str {
        match self {
            State::Connecting { .. } => "connecting",
            State::Up => "up",
            State::Grace { .. } => "grace",
            State::Expired => "down",
        }
    }
}

/// A followed peer.
#[derive(Debug, Clone)]
pub struct Session {
    /// The Routes endpoint followed.
    pub endpoint: String,
    pub state: State,
    /// What the peer says now, by prefix (not yet validated).
    pub routes: BTreeMap<IpNet, Route>,
    /// When each route took its current value.
    pub since: HashMap<IpNet, Instant>,
    /// The generation of the last update applied.
    pub generation: u64,
    pub last_update: Option<Instant>,
    /// Why the stream last ended (or could not start).
    pub last_error: Option<String>,
    /// Snapshots received (1 + reconnects).
    pub snapshots: u64,
    /// Prefixes whose route changed (or went) since they were last judged.
    pub changed: HashSet<IpNet>,
    /// Every route is to be judged again.
    pub changed_all: bool,
    /// Prefixes by a hash of their route's node (for a node record's change; a collision
    /// only re-judges more).
    by_node: HashMap<u64, HashSet<IpNet>>,
    /// Entries that did not parse, over every stream of this peer.
    pub malformed: u64,
    /// Withdrawals of prefixes it did not hold (ignored), over every stream.
    pub unknown_withdrawals: u64,
    /// Its streams dropped because it broke the protocol or a bound, by cause.
    pub dropped: BTreeMap<&'static str, u64>,
}

impl Session {
    pub fn new(endpoint: String, now: Instant) -> Self {
        Self {
            endpoint,
            state: State::Connecting { since: now },
            routes: BTreeMap::new(),
            since: HashMap::new(),
            generation: 0,
            last_update: None,
            last_error: None,
            snapshots: 0,
            changed: HashSet::new(),
            changed_all: false,
            by_node: HashMap::new(),
            malformed: 0,
            unknown_withdrawals: 0,
            dropped: BTreeMap::new(),
        }
    }

    /// A snapshot: replaces everything the peer said before.
    pub fn snapshot(&mut self, generation: u64, routes: Vec<Route>, now: Instant) {
        let new: BTreeMap<IpNet, Route> = routes.into_iter().map(|r| (r.prefix, r)).collect();
        self.since.retain(|p, _| new.contains_key(p));
        for (p, r) in &new {
            if self.routes.get(p) != Some(r) {
                self.since.insert(*p, now);
                self.changed.insert(*p);
            }
        }
        for p in self.routes.keys() {
            if !new.contains_key(p) {
                self.changed.insert(*p);
            }
        }
        self.by_node.clear();
        for r in new.values() {
            self.by_node
                .entry(node_hash(&r.node))
                .or_default()
                .insert(r.prefix);
        }
        self.routes = new;
        self.generation = generation;
        self.last_update = Some(now);
        self.last_error = None;
        self.snapshots += 1;
        self.state = State::Up;
    }

    /// A delta (the stream checked its generation follows).
    pub fn delta(
        &mut self,
        generation: u64,
        routes: Vec<Route>,
        withdrawn: &[IpNet],
        now: Instant,
    ) {
        for p in withdrawn {
            if let Some(old) = self.routes.remove(p) {
                self.unindex(node_hash(&old.node), p);
                self.changed.insert(*p);
            }
            self.since.remove(p);
        }
        for r in routes {
            let old = self.routes.get(&r.prefix);
            if old == Some(&r) {
                continue;
            }
            let (was, is) = (old.map(|o| node_hash(&o.node)), node_hash(&r.node));
            if let Some(was) = was.filter(|h| *h != is) {
                self.unindex(was, &r.prefix);
            }
            self.by_node.entry(is).or_default().insert(r.prefix);
            self.since.insert(r.prefix, now);
            self.changed.insert(r.prefix);
            self.routes.insert(r.prefix, r);
        }
        self.generation = generation;
        self.last_update = Some(now);
    }

    fn unindex(&mut self, hash: u64, p: &IpNet) {
        if let Some(set) = self.by_node.get_mut(&hash) {
            set.remove(p);
            if set.is_empty() {
                self.by_node.remove(&hash);
            }
        }
    }

    /// Marks for judging again the routes a change of the block `cidr` can affect: those
    /// inside it (the block itself, and addresses in it).
    pub fn touch_inside(&mut self, cidr: &IpNet) {
        let (first, last) = match (IpNet::new(cidr.network(), 0), bound(cidr.broadcast())) {
            (Ok(first), Some(last)) => (first, last),
            _ => {
                self.changed_all = true;
                return;
            }
        };
        // Ordered by address, then length: the nets inside `cidr` are between its network
        // address and its broadcast address; at most one shorter net per length is too.
        self.changed.extend(
            self.routes
                .range(first..=last)
                .map(|(p, _)| *p)
                .filter(|p| cidr.contains(p)),
        );
    }

    /// Marks for judging again the routes of node `node`.
    pub fn touch_node(&mut self, node: &str) {
        if let Some(set) = self.by_node.get(&node_hash(node)) {
            self.changed.extend(set.iter().copied());
        }
    }

    /// Whether anything is to be judged.
    pub fn stale(&self) -> bool {
        self.changed_all || !self.changed.is_empty()
    }

    /// The stream ended (or could not be opened): a streaming peer's routes go into grace. A
    /// peer already in grace keeps its deadline (failed reconnects do not extend it).
    pub fn down(&mut self, reason: String, now: Instant, grace: Duration) {
        self.last_error = Some(reason);
        if self.state == State::Up {
            self.state = State::Grace { until: now + grace };
        }
    }

    /// Expires the grace period when it is over; returns whether routes were withdrawn.
    pub fn tick(&mut self, now: Instant) -> bool {
        match self.state {
            State::Grace { until } if until <= now => {
                self.state = State::Expired;
                let had = !self.routes.is_empty();
                self.changed.extend(self.routes.keys().copied());
                self.routes.clear();
                self.since.clear();
                self.by_node.clear();
                had
            }
            _ => false,
        }
    }

    /// Its routes count (streaming, or kept in grace).
    pub fn keeps_routes(&self) -> bool {
        matches!(self.state, State::Up | State::Grace { .. })
    }

    /// Heard from (a snapshot arrived once), or waited for as long as the grace period.
    pub fn settled(&self, now: Instant, grace: Duration) -> bool {
        match self.state {
            State::Connecting { since } => since + grace <= now,
            _ => true,
        }
    }

    /// Time left before its routes are withdrawn, while in grace.
    pub fn grace_left(&self, now: Instant) -> Option<Duration> {
        match self.state {
            State::Grace { until } => Some(until.saturating_duration_since(now)),
            _ => None,
        }
    }
}

/// The last net of `addr`'s family starting at `addr` (its host route).
fn bound(addr: IpAddr) -> Option<IpNet> {
    let len = if addr.is_ipv4() { 32 } else { 128 };
    IpNet::new(addr, len).ok()
}

/// A node name's hash, for [`Session`]'s index (a fixed hasher: the same in every run).
fn node_hash(node: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    node.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(p: &str) -> Route {
        Route {
            prefix: p.parse().expect("net"),
            node: "b".into(),
            next_hop: "192.0.2.2".parse().expect("ip"),
        }
    }

    const GRACE: Duration = Duration::from_secs(120);

    #[test]
    fn routes_stay_through_the_grace_period_then_go() {
        let t0 = Instant::now();
        let mut s = Session::new("192.0.2.2:5474".into(), t0);
        assert!(!s.settled(t0, GRACE));
        s.snapshot(5, vec![route("10.0.0.0/26"), route("10.0.0.64/26")], t0);
        assert!(s.keeps_routes() && s.settled(t0, GRACE));
        s.delta(
            6,
            vec![route("10.0.1.0/26")],
            &["10.0.0.0/26".parse().expect("net")],
            t0,
        );
        assert_eq!(s.routes.len(), 2);
        // Dropped at t0+1s: kept until t0+121s.
        let down = t0 + Duration::from_secs(1);
        s.down("connection reset".into(), down, GRACE);
        assert_eq!(
            s.state,
            State::Grace {
                until: down + GRACE
            }
        );
        assert!(s.keeps_routes());
        // Reconnects that fail do not extend it.
        s.down("refused".into(), down + Duration::from_secs(60), GRACE);
        assert_eq!(
            s.state,
            State::Grace {
                until: down + GRACE
            }
        );
        assert_eq!(
            s.grace_left(down + Duration::from_secs(20)),
            Some(Duration::from_secs(100))
        );
        assert!(!s.tick(down + GRACE - Duration::from_millis(1)));
        assert_eq!(s.routes.len(), 2);
        assert!(s.tick(down + GRACE), "withdrawn when the grace runs out");
        assert!(s.routes.is_empty() && !s.keeps_routes());
        assert_eq!(s.state.name(), "down");
    }

    #[test]
    fn a_reconnect_snapshot_replaces_what_the_peer_said() {
        let t0 = Instant::now();
        let mut s = Session::new("x".into(), t0);
        s.snapshot(9, vec![route("10.0.0.0/26"), route("10.0.0.64/26")], t0);
        s.down("reset".into(), t0, GRACE);
        let t1 = t0 + Duration::from_secs(3);
        // The restarted peer starts its generations again, and no longer has one block.
        s.snapshot(1, vec![route("10.0.0.0/26")], t1);
        assert_eq!(s.state, State::Up);
        assert_eq!(s.routes.len(), 1);
        assert_eq!(s.generation, 1);
        assert_eq!(
            s.since[&"10.0.0.0/26".parse().expect("net")],
            t0,
            "unchanged route keeps its age"
        );
        assert_eq!(s.snapshots, 2);
        assert!(!s.tick(t1 + GRACE * 2), "no grace timer while up");
    }

    #[test]
    fn a_peer_never_heard_from_settles_after_the_grace_period() {
        let t0 = Instant::now();
        let mut s = Session::new("x".into(), t0);
        s.down("connection refused".into(), t0, GRACE);
        assert_eq!(s.state.name(), "connecting");
        assert!(!s.settled(t0 + GRACE - Duration::from_millis(1), GRACE));
        assert!(s.settled(t0 + GRACE, GRACE));
        assert!(!s.keeps_routes());
    }
}
