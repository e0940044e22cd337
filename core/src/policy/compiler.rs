//! The compiler of [`super::tables`]: this node's endpoint policies and their sets' members
//! into identities and entries, numbering identities and rules so that the numbers stay while
//! what they stand for lives. A compilation after the first starts from the one before and
//! recomputes only the prefixes whose sets changed ([`Compiler::compile_changed`]): a label
//! change touches a few addresses, not the 10,000 of the cluster.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use ipnet::IpNet;

use super::endpoint::{Direction, EndpointPolicy, PeerMatch, Ports};
use super::sets::{Member, SetKey};
use super::tables::{
    port_blocks, EndpointTables, EntryKey, Identity, RuleId, RuleRef, Tables, ANY_PEER, WORLD,
};

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
    /// What the last compilation found, for the next to start from (None: start afresh).
    memo: Option<Memo>,
}

/// A compilation's sets and prefixes, kept for the next.
#[derive(Debug, Default)]
struct Memo {
    /// Each named set (by number) and its members.
    members: HashMap<u32, BTreeSet<Member>>,
    /// Each member's network, and the sets (with the member) that have it.
    exact: HashMap<IpNet, Vec<(u32, Member)>>,
    blocks: Blocks,
    /// Each prefix's identity.
    prefixes: BTreeMap<IpNet, Identity>,
    /// How many prefixes each identity (not [`WORLD`]) has.
    uses: HashMap<Identity, usize>,
}

impl Default for Compiler {
    fn default() -> Self {
        Self {
            sets: Numbers::new(0),
            // 0 is WORLD.
            identities: Numbers::new(1),
            rules: Numbers::new(1),
            memo: None,
        }
    }
}

/// Whether a set member is a block (an ipBlock's CIDR or except), not one address.
fn is_block(m: &Member) -> bool {
    m.net.prefix_len() < m.net.max_prefix_len()
}

impl Compiler {
    pub fn new() -> Self {
        Self::default()
    }

    /// The tables of `endpoints` (this node's pods' policies), the sets' members coming from
    /// `members`: every prefix computed afresh.
    pub fn compile<K: Ord + Clone>(
        &mut self,
        endpoints: &BTreeMap<K, EndpointPolicy>,
        members: impl Fn(&SetKey) -> BTreeSet<Member>,
    ) -> Tables<K> {
        self.memo = None;
        self.compile_changed(endpoints, &BTreeSet::new(), members)
    }

    /// As [`Self::compile`], from the last compilation: only the sets in `changed` (those
    /// whose members may have moved since), the sets named or no longer named, and the
    /// prefixes of the addresses they gained or lost are looked at again. A change of a block
    /// (an ipBlock's CIDR or except) compiles everything afresh. The result is the same as
    /// [`Self::compile`]'s, numbers included.
    pub fn compile_changed<K: Ord + Clone>(
        &mut self,
        endpoints: &BTreeMap<K, EndpointPolicy>,
        changed: &BTreeSet<SetKey>,
        members: impl Fn(&SetKey) -> BTreeSet<Member>,
    ) -> Tables<K> {
        let named: BTreeSet<&SetKey> = endpoints.values().flat_map(|e| e.sets()).collect();
        let mut used_sets = BTreeSet::new();
        let mut memo = self.memo.take().unwrap_or_default();
        let mut dirty: BTreeSet<IpNet> = BTreeSet::new();
        let mut blocks_moved = false;
        let mut moved =
            |memo: &mut Memo, id: u32, old: &BTreeSet<Member>, new: &BTreeSet<Member>| {
                for m in old.difference(new) {
                    blocks_moved |= is_block(m);
                    if let Some(v) = memo.exact.get_mut(&m.net) {
                        v.retain(|(s, x)| !(*s == id && x == m));
                        if v.is_empty() {
                            memo.exact.remove(&m.net);
                        }
                    }
                    dirty.insert(m.net);
                }
                for m in new.difference(old) {
                    blocks_moved |= is_block(m);
                    memo.exact.entry(m.net).or_default().push((id, *m));
                    dirty.insert(m.net);
                }
            };
        for set in &named {
            let id = self.sets.get(set);
            used_sets.insert(id);
            let known = memo.members.contains_key(&id);
            if known && !changed.contains(*set) {
                continue;
            }
            let new = members(set);
            let old = memo.members.remove(&id).unwrap_or_default();
            moved(&mut memo, id, &old, &new);
            memo.members.insert(id, new);
        }
        let gone: Vec<u32> = memo
            .members
            .keys()
            .filter(|id| !used_sets.contains(id))
            .copied()
            .collect();
        for id in gone {
            let old = memo.members.remove(&id).unwrap_or_default();
            moved(&mut memo, id, &old, &BTreeSet::new());
        }
        if blocks_moved {
            // Every prefix under a block that moved may change: start afresh.
            memo.blocks = Blocks::default();
            for (id, ms) in &memo.members {
                for m in ms.iter().filter(|m| is_block(m)) {
                    memo.blocks.add(*id, *m);
                }
            }
            dirty = memo.exact.keys().copied().collect();
            dirty.extend(memo.prefixes.keys().copied());
        }
        // Each dirty prefix's signature, then its identity.
        for net in &dirty {
            let new = if memo.exact.contains_key(net) {
                let sig = signature(net, &memo.exact, &memo.blocks);
                Some(if sig.is_empty() {
                    WORLD
                } else {
                    self.identities.get(&sig)
                })
            } else {
                None
            };
            let old = match new {
                Some(id) => memo.prefixes.insert(*net, id),
                None => memo.prefixes.remove(net),
            };
            if old == new {
                continue;
            }
            if let Some(o) = old.filter(|o| *o != WORLD) {
                if let Some(n) = memo.uses.get_mut(&o) {
                    *n -= 1;
                    if *n == 0 {
                        memo.uses.remove(&o);
                    }
                }
            }
            if let Some(n) = new.filter(|n| *n != WORLD) {
                *memo.uses.entry(n).or_insert(0) += 1;
            }
        }
        let used_identities: BTreeSet<Identity> = memo.uses.keys().copied().collect();
        // Each set's identities (with their ports), from the identities' signatures.
        let mut by_set: HashMap<u32, BTreeSet<(Identity, Option<u16>)>> = HashMap::new();
        for (sig, id) in &self.identities.of {
            if used_identities.contains(id) {
                for (set, port) in sig {
                    by_set.entry(*set).or_default().insert((*id, *port));
                }
            }
        }
        let tables = self.entries(endpoints, memo.prefixes.clone(), &by_set);
        self.identities.retain(&used_identities);
        self.sets.retain(&used_sets);
        self.memo = Some(memo);
        tables
    }

    /// The tables: `prefixes`, and each endpoint's entries, its rules' peers' identities
    /// from `by_set`.
    fn entries<K: Ord + Clone>(
        &mut self,
        endpoints: &BTreeMap<K, EndpointPolicy>,
        prefixes: BTreeMap<IpNet, Identity>,
        by_set: &HashMap<u32, BTreeSet<(Identity, Option<u16>)>>,
    ) -> Tables<K> {
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
        tables
    }
}

/// The sets (with their ports) `net` is in: for each set, its longest member that covers
/// `net` decides; an excluded one (an ipBlock's except) keeps it out.
/// The members of the sets that are blocks (not a single address), by network, so that the
/// blocks covering a prefix are found with one lookup per block length rather than a pass over
/// every block (10,000 pods' addresses against a few hundred `ipBlock`s).
#[derive(Debug, Default)]
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
