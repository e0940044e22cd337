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
//! [`Compiler`] keeps identity and rule numbers stable from one compilation to the next, so
//! that [`plan`] changes only what changed, in an order that never denies a flow allowed both
//! before and after the change.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use ipnet::IpNet;

use super::endpoint::{Direction, EndpointPolicy, PeerMatch, Ports};
use super::model::{PodKey, PolicyKey};
use super::sets::{Member, SetKey};

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

/// Numbers handed out and taken back, stable while their value lives.
#[derive(Debug)]
struct Numbers<T> {
    of: HashMap<T, u32>,
    next: u32,
    free: Vec<u32>,
}

impl<T: std::hash::Hash + Eq + Clone> Numbers<T> {
    fn new(first: u32) -> Self {
        Self {
            of: HashMap::new(),
            next: first,
            free: Vec::new(),
        }
    }

    fn get(&mut self, v: &T) -> u32 {
        if let Some(n) = self.of.get(v) {
            return *n;
        }
        let n = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.of.insert(v.clone(), n);
        n
    }

    /// Keeps the numbers of `used` only; the others are handed out again by a later
    /// compilation (never by this one: a plan may still name them).
    fn retain(&mut self, used: &BTreeSet<u32>) {
        let mut freed = Vec::new();
        self.of.retain(|_, n| {
            let keep = used.contains(n);
            if !keep {
                freed.push(*n);
            }
            keep
        });
        freed.sort_unstable_by(|a, b| b.cmp(a));
        self.free.extend(freed);
    }
}

/// A set's number (within one compiler), and a port where the set is a named-port set.
type Signature = Vec<(u32, Option<u16>)>;

/// Compiles endpoint policies into [`Tables`], numbering identities and rules so that they
/// stay the same from one compilation to the next while what they stand for lives.
#[derive(Debug)]
pub struct Compiler {
    sets: Numbers<SetKey>,
    identities: Numbers<Signature>,
    rules: Numbers<RuleRef>,
}

impl Default for Compiler {
    fn default() -> Self {
        Self {
            sets: Numbers::new(0),
            // 0 is WORLD.
            identities: Numbers::new(1),
            rules: Numbers::new(1),
        }
    }
}

impl Compiler {
    pub fn new() -> Self {
        Self::default()
    }

    /// The tables of `endpoints` (this node's pods' policies), the sets' members coming from
    /// `members`.
    pub fn compile<K: Ord + Clone>(
        &mut self,
        endpoints: &BTreeMap<K, EndpointPolicy>,
        members: impl Fn(&SetKey) -> BTreeSet<Member>,
    ) -> Tables<K> {
        let named: BTreeSet<&SetKey> = endpoints.values().flat_map(|e| e.sets()).collect();
        let mut exact: HashMap<IpNet, Vec<(u32, Member)>> = HashMap::new();
        let mut blocks = Blocks::default();
        let mut used_sets = BTreeSet::new();
        for set in named {
            let id = self.sets.get(set);
            used_sets.insert(id);
            for m in members(set) {
                exact.entry(m.net).or_default().push((id, m));
                if m.net.prefix_len() < m.net.max_prefix_len() {
                    blocks.add(id, m);
                }
            }
        }
        // Each prefix's signature, then its identity.
        let mut prefixes = BTreeMap::new();
        let mut by_set: HashMap<u32, BTreeSet<(Identity, Option<u16>)>> = HashMap::new();
        let mut used_identities = BTreeSet::new();
        for net in exact.keys() {
            let sig = signature(net, &exact, &blocks);
            let identity = if sig.is_empty() {
                WORLD
            } else {
                let id = self.identities.get(&sig);
                used_identities.insert(id);
                for (set, port) in &sig {
                    by_set.entry(*set).or_default().insert((id, *port));
                }
                id
            };
            prefixes.insert(*net, identity);
        }
        let mut tables = Tables {
            prefixes,
            ..Tables::default()
        };
        for (key, policy) in endpoints {
            let mut t = EndpointTables::default();
            for d in [Direction::Ingress, Direction::Egress] {
                let Some(allows) = policy.direction(d) else {
                    continue;
                };
                let mut entries = BTreeMap::new();
                for a in allows {
                    let rule = self.rules.get(&RuleRef {
                        policy: a.policy.clone(),
                        direction: d,
                        rule: a.rule,
                    });
                    let peers: Vec<(Identity, Option<u16>)> = match &a.peer {
                        PeerMatch::Any => vec![(ANY_PEER, None)],
                        PeerMatch::Set(s) => self
                            .sets
                            .of
                            .get(s)
                            .and_then(|id| by_set.get(id))
                            .map(|ids| ids.iter().copied().collect())
                            .unwrap_or_default(),
                    };
                    for (identity, member_port) in peers {
                        for k in entry_keys(identity, &a.ports, member_port) {
                            let r = entries.entry(k).or_insert(rule);
                            *r = (*r).min(rule);
                        }
                    }
                }
                match d {
                    Direction::Ingress => t.ingress = Some(entries),
                    Direction::Egress => t.egress = Some(entries),
                }
            }
            tables.endpoints.insert(key.clone(), t);
        }
        let used_rules: BTreeSet<RuleId> = tables
            .endpoints
            .values()
            .flat_map(|t| [&t.ingress, &t.egress])
            .flatten()
            .flat_map(|e| e.values().copied())
            .collect();
        for (r, n) in &self.rules.of {
            if used_rules.contains(n) {
                tables.rules.insert(*n, r.clone());
            }
        }
        self.rules.retain(&used_rules);
        self.identities.retain(&used_identities);
        self.sets.retain(&used_sets);
        tables
    }
}

/// The sets (with their ports) `net` is in: for each set, its longest member that covers
/// `net` decides; an excluded one (an ipBlock's except) keeps it out.
/// The members of the sets that are blocks (not a single address), by network, so that the
/// blocks covering a prefix are found with one lookup per block length rather than a pass over
/// every block (10,000 pods' addresses against a few hundred `ipBlock`s).
#[derive(Default)]
struct Blocks {
    by_net: HashMap<IpNet, Vec<(u32, Member)>>,
    /// The blocks' lengths, IPv4 then IPv6 (`false`, `true`).
    lengths: BTreeSet<(bool, u8)>,
}

impl Blocks {
    fn add(&mut self, set: u32, m: Member) {
        let net = m.net.trunc();
        self.lengths
            .insert((matches!(net, IpNet::V6(_)), net.prefix_len()));
        self.by_net.entry(net).or_default().push((set, m));
    }

    /// The blocks that contain `net` and are not `net` itself.
    fn covering<'a>(&'a self, net: &'a IpNet) -> impl Iterator<Item = &'a (u32, Member)> + 'a {
        let v6 = matches!(net, IpNet::V6(_));
        self.lengths
            .range((v6, 0)..=(v6, net.prefix_len()))
            .filter_map(move |(_, len)| {
                let outer = match net {
                    IpNet::V4(n) => ipnet::Ipv4Net::new(n.addr(), *len).ok().map(IpNet::V4),
                    IpNet::V6(n) => ipnet::Ipv6Net::new(n.addr(), *len).ok().map(IpNet::V6),
                }?;
                self.by_net.get(&outer.trunc())
            })
            .flatten()
            .filter(move |(_, m)| m.net != *net)
    }
}

fn signature(
    net: &IpNet,
    exact: &HashMap<IpNet, Vec<(u32, Member)>>,
    blocks: &Blocks,
) -> Signature {
    // Per set: the longest covering length, and the members at that length.
    let mut best: BTreeMap<u32, (u8, Vec<Member>)> = BTreeMap::new();
    let candidates = exact
        .get(net)
        .into_iter()
        .flatten()
        .chain(blocks.covering(net));
    for (set, m) in candidates {
        let len = m.net.prefix_len();
        let e = best.entry(*set).or_insert((len, Vec::new()));
        if len > e.0 {
            *e = (len, Vec::new());
        }
        if len == e.0 {
            e.1.push(*m);
        }
    }
    let mut sig = Signature::new();
    for (set, (_, ms)) in best {
        if ms.iter().any(|m| m.excluded) {
            continue;
        }
        let mut ports: Vec<Option<u16>> = ms.iter().map(|m| m.port).collect();
        ports.sort_unstable();
        ports.dedup();
        sig.extend(ports.into_iter().map(|p| (set, p)));
    }
    sig
}

/// The entries an allow of `ports` makes for peers of `identity` (whose port in a named-port
/// set is `member_port`).
fn entry_keys(identity: Identity, ports: &Ports, member_port: Option<u16>) -> Vec<EntryKey> {
    match ports {
        Ports::Any => vec![EntryKey {
            identity,
            proto: None,
            port: 0,
            port_bits: 0,
        }],
        Ports::Ranges(ranges) => ranges
            .iter()
            .flat_map(|r| {
                port_blocks(r.first, r.last)
                    .into_iter()
                    .map(move |(port, port_bits)| EntryKey {
                        identity,
                        proto: Some(r.protocol.number()),
                        port,
                        port_bits,
                    })
            })
            .collect(),
        Ports::OfMember(protocol) => member_port
            .map(|port| EntryKey {
                identity,
                proto: Some(protocol.number()),
                port,
                port_bits: 16,
            })
            .into_iter()
            .collect(),
    }
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
