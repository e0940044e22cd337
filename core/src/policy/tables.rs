//! This node's endpoints' policies as lookup tables: the layout the eBPF dataplane programs
//! (docs/decisions.md, "NetworkPolicy in eBPF: identities").
//!
//! - **Identities.** Addresses that are in exactly the same sets (with the same port, in a
//!   named-port set) share one identity. A prefix table maps an address to its identity by
//!   longest match; it is shared by every endpoint of the node. An address under no prefix is
//!   [`WORLD`], in no set.
//! - **Entries.** Per endpoint and direction: {the peer's identity or [`ANY_PEER`], a protocol
//!   or every protocol, an aligned block of ports} → the rule that allows it. Entries only
//!   allow: a packet is allowed when its endpoint is not isolated in that direction, or when an
//!   entry of its peer's identity or of `ANY_PEER` covers it.
//!
//! Per packet that costs one longest match on the address and two on the entries, however many
//! rules the endpoint has; a pod's label change moves its address to another identity, and
//! touches the entries of the endpoints whose rules name a set it joins.
//!
//! [`super::compiler::Compiler`] builds them, and keeps identity and rule numbers stable from
//! one compilation to the next, so that [`plan`] changes only what changed, in an order that
//! never denies a flow allowed both before and after the change.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use super::endpoint::Direction;
use super::model::{PodKey, PolicyKey};

/// A class of addresses: those in the same sets.
pub type Identity = u32;
/// The identity of an address under no prefix of the table.
pub const WORLD: Identity = 0;
/// The identity entries use for a rule that allows every peer.
pub const ANY_PEER: Identity = u32::MAX;
/// The identity of the Service ranges ([`Tables::with_services`]): no entry names it.
pub const SERVICE: Identity = u32::MAX - 1;
/// A rule's number on this node (counters, traces): stable while the rule exists.
pub type RuleId = u32;

/// What one entry matches beyond its endpoint and direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EntryKey {
    pub identity: Identity,
    /// None: every protocol, every port.
    pub proto: Option<u8>,
    /// The first port of the block of `2^(16 - port_bits)` ports that starts here (aligned);
    /// `port_bits` 0: every port of `proto`.
    pub port: u16,
    pub port_bits: u8,
}

impl EntryKey {
    /// Whether it covers a packet of `proto` to (ingress) or from (egress) `port` whose peer
    /// has identity `identity`.
    pub fn covers(&self, identity: Identity, proto: u8, port: u16) -> bool {
        if self.identity != identity {
            return false;
        }
        match self.proto {
            None => true,
            Some(p) if p != proto => false,
            Some(_) => {
                let shift = 16 - u32::from(self.port_bits);
                u32::from(port) >> shift == u32::from(self.port) >> shift
            }
        }
    }
}

/// Which policy rule a number stands for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleRef {
    pub policy: PolicyKey,
    pub direction: Direction,
    /// The rule's index in the policy's `ingress` or `egress`.
    pub rule: usize,
}

/// One direction of an endpoint: None when it is not isolated there (everything allowed).
pub type Entries = Option<BTreeMap<EntryKey, RuleId>>;

/// One endpoint's entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointTables {
    pub ingress: Entries,
    pub egress: Entries,
}

impl EndpointTables {
    pub fn direction(&self, d: Direction) -> &Entries {
        match d {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }

    /// Whether it is isolated (ingress, egress).
    pub fn isolation(&self) -> (bool, bool) {
        (self.ingress.is_some(), self.egress.is_some())
    }
}

/// What a packet meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The endpoint is not isolated in that direction.
    Open,
    Allowed(RuleId),
    Denied,
}

/// Everything the node's dataplane holds for policy, its endpoints named by `K` (the pods, or
/// the dataplane's own endpoint keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables<K = PodKey> {
    /// Prefix → identity, looked up by longest match.
    pub prefixes: BTreeMap<IpNet, Identity>,
    pub endpoints: BTreeMap<K, EndpointTables>,
    /// The rules entries name.
    pub rules: BTreeMap<RuleId, RuleRef>,
}

impl<K> Default for Tables<K> {
    fn default() -> Self {
        Self {
            prefixes: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            rules: BTreeMap::new(),
        }
    }
}

impl<K> Tables<K> {
    /// These tables with the Service ranges `services` (the addresses the host stack
    /// translates: kube-proxy's cluster IPs) as identity [`SERVICE`]. The dataplane judges a
    /// pod's egress to such an address after the translation, against the backend it was
    /// given, so what the rules say of the Service address itself never applies: a prefix
    /// inside a Service range (an ipBlock naming cluster IPs) is left out, and a wider one
    /// (an ipBlock around the range) no longer covers it.
    pub fn with_services(mut self, services: &[IpNet]) -> Self {
        self.prefixes = with_services(&self.prefixes, services);
        self
    }
}

/// `prefixes` with the Service ranges `services` as identity [`SERVICE`], and without the
/// prefixes inside them ([`Tables::with_services`]).
pub fn with_services(
    prefixes: &BTreeMap<IpNet, Identity>,
    services: &[IpNet],
) -> BTreeMap<IpNet, Identity> {
    let services: Vec<IpNet> = services.iter().map(IpNet::trunc).collect();
    let mut out: BTreeMap<IpNet, Identity> = prefixes
        .iter()
        .filter(|(p, _)| !services.iter().any(|s| s.contains(*p)))
        .map(|(p, i)| (*p, *i))
        .collect();
    for s in services {
        out.insert(s, SERVICE);
    }
    out
}

impl<K: Ord + Clone> Tables<K> {
    /// The identity of `ip`: its longest prefix's, or [`WORLD`].
    pub fn identity_of(&self, ip: IpAddr) -> Identity {
        let host = IpNet::from(ip);
        // Walk from the host route to the shortest prefix of the family.
        let max = host.max_prefix_len();
        (0..=max)
            .rev()
            .find_map(|len| {
                let net = IpNet::new(ip, len).ok()?.trunc();
                self.prefixes.get(&net).copied()
            })
            .unwrap_or(WORLD)
    }

    /// What a packet of `proto` between endpoint `ep` and `peer` meets in direction `d`;
    /// `port` is the endpoint's port on ingress, the peer's on egress (0 for a protocol
    /// without ports). What the programs do, for tests and `calixctl trace`.
    pub fn verdict(&self, ep: &K, d: Direction, peer: IpAddr, proto: u8, port: u16) -> Verdict {
        let Some(Some(entries)) = self.endpoints.get(ep).map(|t| t.direction(d)) else {
            return Verdict::Open;
        };
        let identity = self.identity_of(peer);
        entries
            .iter()
            .filter(|(k, _)| k.covers(identity, proto, port) || k.covers(ANY_PEER, proto, port))
            .map(|(_, r)| *r)
            .min()
            .map_or(Verdict::Denied, Verdict::Allowed)
    }

    /// How many entries, over every endpoint and direction.
    pub fn entry_count(&self) -> usize {
        self.endpoints
            .values()
            .flat_map(|t| [&t.ingress, &t.egress])
            .flatten()
            .map(BTreeMap::len)
            .sum()
    }
}

/// The aligned blocks of ports `first..=last` covers: (first port, prefix bits).
pub fn port_blocks(first: u16, last: u16) -> Vec<(u16, u8)> {
    let mut out = Vec::new();
    let (mut start, end) = (u32::from(first), u32::from(last));
    while start <= end {
        // The largest block aligned at `start` that ends at or before `end`.
        let mut size: u32 = if start == 0 {
            1 << 16
        } else {
            start & start.wrapping_neg()
        };
        while start + size - 1 > end {
            size >>= 1;
        }
        out.push((start as u16, (16 - size.trailing_zeros()) as u8));
        start += size;
    }
    out
}

/// One endpoint direction's entry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct EntryRef<K = PodKey> {
    pub endpoint: K,
    pub direction: Direction,
    pub key: EntryKey,
}

/// How to go from one [`Tables`] to the next, step by step in this order. A flow allowed both
/// before and after is allowed at every step: entries are added before any address moves to
/// the identity they are for and removed only once none is left on it; prefixes are written
/// longest first and removed shortest first, so that an address's longest match is at every
/// step either its old prefix (with its old identity, whose entries are all still there) or
/// its new one. A direction of an endpoint opens before anything else moves, and becomes
/// isolated only once everything else is in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan<K = PodKey> {
    /// Endpoints with a direction no longer isolated: their isolation (ingress, egress) with
    /// those directions open, first.
    pub open: Vec<(K, (bool, bool))>,
    /// Entries new or with another rule.
    pub add_entries: Vec<(EntryRef<K>, RuleId)>,
    /// Prefixes new or with another identity, longest first.
    pub set_prefixes: Vec<(IpNet, Identity)>,
    /// Prefixes gone, shortest first.
    pub remove_prefixes: Vec<IpNet>,
    /// Endpoints whose isolation (ingress, egress) is not yet the new one, with the new one.
    pub isolation: Vec<(K, (bool, bool))>,
    pub remove_entries: Vec<EntryRef<K>>,
    /// Isolated endpoints whose verdicts may have changed: their established flows are checked
    /// again (a revoked one is refused from then on).
    pub recheck: Vec<K>,
}

impl<K> Default for Plan<K> {
    fn default() -> Self {
        Self {
            open: Vec::new(),
            add_entries: Vec::new(),
            set_prefixes: Vec::new(),
            remove_prefixes: Vec::new(),
            isolation: Vec::new(),
            remove_entries: Vec::new(),
            recheck: Vec::new(),
        }
    }
}

impl<K> Plan<K> {
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
            && self.add_entries.is_empty()
            && self.set_prefixes.is_empty()
            && self.remove_prefixes.is_empty()
            && self.isolation.is_empty()
            && self.remove_entries.is_empty()
            && self.recheck.is_empty()
    }
}

/// The steps from `old` to `new`.
pub fn plan<K: Ord + Clone>(old: &Tables<K>, new: &Tables<K>) -> Plan<K> {
    let mut p = Plan::default();
    let none = EndpointTables::default();
    let keys: BTreeSet<&K> = old.endpoints.keys().chain(new.endpoints.keys()).collect();
    let mut changed: BTreeSet<K> = BTreeSet::new();
    for key in keys {
        let o = old.endpoints.get(key).unwrap_or(&none);
        let n = new.endpoints.get(key).unwrap_or(&none);
        for d in [Direction::Ingress, Direction::Egress] {
            let (oe, ne) = (o.direction(d), n.direction(d));
            let empty = BTreeMap::new();
            let (oe, ne) = (oe.as_ref().unwrap_or(&empty), ne.as_ref().unwrap_or(&empty));
            let at = |k: &EntryKey| EntryRef {
                endpoint: key.clone(),
                direction: d,
                key: *k,
            };
            for (k, r) in ne {
                if oe.get(k) != Some(r) {
                    p.add_entries.push((at(k), *r));
                    changed.insert(key.clone());
                }
            }
            for k in oe.keys().filter(|k| !ne.contains_key(k)) {
                p.remove_entries.push(at(k));
                changed.insert(key.clone());
            }
        }
        let (was, now) = (o.isolation(), n.isolation());
        let between = (was.0 && now.0, was.1 && now.1);
        if new.endpoints.contains_key(key) {
            if between != was {
                p.open.push((key.clone(), between));
            }
            if now != between {
                p.isolation.push((key.clone(), now));
            }
            if was != now {
                changed.insert(key.clone());
            }
        }
    }
    for (net, id) in &new.prefixes {
        if old.prefixes.get(net) != Some(id) {
            p.set_prefixes.push((*net, *id));
        }
    }
    p.remove_prefixes = old
        .prefixes
        .keys()
        .filter(|n| !new.prefixes.contains_key(n))
        .copied()
        .collect();
    p.set_prefixes
        .sort_by_key(|(n, _)| std::cmp::Reverse(n.prefix_len()));
    p.remove_prefixes.sort_by_key(IpNet::prefix_len);
    let prefixes_moved = !p.set_prefixes.is_empty() || !p.remove_prefixes.is_empty();
    for (key, t) in &new.endpoints {
        let isolated = t.ingress.is_some() || t.egress.is_some();
        if (isolated && prefixes_moved) || changed.contains(key) {
            p.recheck.push(key.clone());
        }
    }
    p
}
