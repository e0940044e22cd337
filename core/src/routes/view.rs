//! The datastore as route distribution needs it: every block that counts (its affine node, who
//! allocated each address) and every node record, indexed so that advertising and validating a
//! route are a few hash lookups, never a datastore read. Kept current by a watch on
//! `ipam/blocks/` and `nodes/` ([`crate::routes::task`]); a value that does not decode is logged
//! and skipped. The blocks are sorted by IPAM's rule for blocks
//! ([`crate::ipam::wellformed`]) against the pools: a block that breaks it is in no index
//! (neither advertised nor accepted) and is logged once, with the rule it broke.
//!
//! A change re-sorts every block only when it can change which blocks count: a block's CIDR,
//! creation or verdict changing, a new block overlapping one that counts, a block deleted that
//! others lost an overlap to, new pools. A new block, an allocation or a release is a few map
//! updates.
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::ipam::wellformed::{self, Ignored, Rule};
use crate::ipam::{Block, Pool};
use crate::model::NodeRecord;
use crate::store::{keys, KeyValue, WatchEvent};

/// One block, as far as routes care.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockEntry {
    /// The node it is affine to; empty once released.
    pub affinity: String,
    /// Each allocated address and the node that allocated it.
    pub allocations: HashMap<IpAddr, String>,
}

/// One node record and its addresses, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEntry {
    pub record: NodeRecord,
    pub addresses: HashSet<IpAddr>,
}

/// A stored block as last seen, and what decides whether it counts.
#[derive(Debug, Clone)]
struct Stored {
    kv: KeyValue,
    /// (CIDR, creation stamp, the rule's verdict but for overlaps); `None`: it does not decode.
    shape: Option<(IpNet, i64, Result<(), Rule>)>,
}

/// The blocks and node records of the datastore.
#[derive(Debug, Default)]
pub struct View {
    /// The pools, as the rule for blocks needs them.
    pools: Vec<Pool>,
    /// Every stored block by key, counted or not.
    stored: HashMap<String, Stored>,
    /// The blocks that count, by CIDR.
    blocks: HashMap<IpNet, BlockEntry>,
    /// The blocks that count, for overlap checks.
    index: wellformed::Index,
    /// The blocks that do not, and why.
    ignored: Vec<Ignored>,
    /// Their CIDRs.
    ignored_cidrs: HashSet<IpNet>,
    /// (key, rule) already logged.
    logged: HashSet<(String, Rule)>,
    /// Key → CIDR of the blocks that count (a delete event carries only the key).
    block_keys: HashMap<String, IpNet>,
    /// Prefix lengths of the blocks (family, length) → how many: an address's block is found
    /// by truncating it to each length present.
    lengths: BTreeMap<(bool, u8), usize>,
    /// Node → blocks affine to it.
    affine: HashMap<String, BTreeSet<IpNet>>,
    /// Node → addresses it allocated (in any block).
    allocated_by: HashMap<String, BTreeSet<IpAddr>>,
    nodes: BTreeMap<String, NodeEntry>,
}

/// Which part of the view an event touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Blocks,
    Nodes,
}

impl Part {
    pub fn prefix(self) -> &'static str {
        match self {
            Part::Blocks => keys::BLOCKS,
            Part::Nodes => keys::NODES,
        }
    }
}

/// What one watch event changed, for validation: a route's verdict depends on the block of
/// its prefix (exactly, or the one holding its address: either is a block its prefix is
/// inside), on its node's record, and on its peer's record (may it relay?).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Touched {
    Nothing,
    /// The counted blocks of these CIDRs appeared, changed or went (a block that starts or
    /// stops counting is one of them).
    Blocks(Vec<IpNet>),
    /// This node's record appeared, changed or went.
    Node(String),
}

impl Touched {
    fn blocks(cidrs: Vec<IpNet>) -> Self {
        if cidrs.is_empty() {
            Touched::Nothing
        } else {
            Touched::Blocks(cidrs)
        }
    }
}

impl View {
    /// An empty view whose blocks are sorted against `pools` (every pool of the cluster).
    pub fn with_pools(pools: Vec<Pool>) -> Self {
        Self {
            pools,
            ..Self::default()
        }
    }

    /// New pools: every block sorted again. Returns whether anything changed.
    pub fn set_pools(&mut self, pools: Vec<Pool>) -> bool {
        if pools == self.pools {
            return false;
        }
        self.pools = pools;
        self.resort();
        true
    }

    /// The stored blocks that do not count, and why.
    pub fn ignored(&self) -> &[Ignored] {
        &self.ignored
    }

    /// Whether `cidr` is the CIDR of a stored block that does not count.
    pub fn is_ignored_block(&self, cidr: &IpNet) -> bool {
        self.ignored_cidrs.contains(cidr)
    }

    /// Applies one watch event; returns whether the blocks that count or the node records
    /// changed (a block that is stored and ignored changes neither).
    pub fn apply(&mut self, ev: &WatchEvent) -> bool {
        self.change_counted(ev) != Touched::Nothing
    }

    /// Applies one watch event; returns what it changed: the counted blocks that appeared,
    /// changed or went, and the stored blocks that started or stopped being ignored (a route
    /// for one is refused as such).
    pub fn change(&mut self, ev: &WatchEvent) -> Touched {
        let ignored_before = self.ignored_cidrs.clone();
        let touched = self.change_counted(ev);
        let flipped: Vec<IpNet> = ignored_before
            .symmetric_difference(&self.ignored_cidrs)
            .copied()
            .collect();
        match touched {
            _ if flipped.is_empty() => touched,
            Touched::Blocks(mut cidrs) => {
                cidrs.extend(flipped);
                Touched::Blocks(cidrs)
            }
            _ => Touched::Blocks(flipped),
        }
    }

    fn change_counted(&mut self, ev: &WatchEvent) -> Touched {
        match ev {
            WatchEvent::Put(kv) => self.put(kv),
            WatchEvent::Delete { key, .. } => {
                if key.starts_with(keys::BLOCKS) {
                    self.delete_block(key)
                } else if let Some(name) = key.strip_prefix(keys::NODES) {
                    match self.nodes.remove(name) {
                        Some(_) => Touched::Node(name.to_string()),
                        None => Touched::Nothing,
                    }
                } else {
                    Touched::Nothing
                }
            }
        }
    }

    /// Replaces one part with a fresh listing (after a compacted watch, or the first one).
    pub fn replace(&mut self, part: Part, kvs: &[KeyValue]) {
        match part {
            Part::Blocks => {
                self.stored = kvs
                    .iter()
                    .filter(|kv| kv.key.starts_with(keys::BLOCKS))
                    .map(|kv| (kv.key.clone(), self.stored_of(kv).0))
                    .collect();
                self.resort();
            }
            Part::Nodes => {
                self.nodes.clear();
                for kv in kvs {
                    self.put(kv);
                }
            }
        }
    }

    /// A stored block and, when it decodes, the block.
    fn stored_of(&self, kv: &KeyValue) -> (Stored, Option<Block>) {
        let block = kv.decode::<Block>().ok();
        let shape = block.as_ref().map(|b| {
            let verdict = wellformed::check(&kv.key, b, &self.pools)
                .map(|_| ())
                .map_err(|(rule, _)| rule);
            (b.cidr, kv.created, verdict)
        });
        (
            Stored {
                kv: kv.clone(),
                shape,
            },
            block,
        )
    }

    /// Sorts every stored block by the rule again and rebuilds the indexes; returns the CIDRs
    /// of the counted blocks that appeared, changed or went.
    fn resort(&mut self) -> Vec<IpNet> {
        let before = std::mem::take(&mut self.blocks);
        let sorted = wellformed::sort(self.stored.values().map(|s| &s.kv), &self.pools);
        self.blocks.clear();
        self.index = wellformed::Index::default();
        self.block_keys.clear();
        self.lengths.clear();
        self.affine.clear();
        self.allocated_by.clear();
        for b in sorted.counted {
            self.block_keys.insert(keys::block(&b.cidr), b.cidr);
            self.add_block(b.cidr, entry_of(&b));
        }
        self.ignored = sorted.ignored;
        self.log_ignored();
        let mut touched: Vec<IpNet> = before
            .iter()
            .filter(|(cidr, entry)| self.blocks.get(cidr) != Some(entry))
            .map(|(cidr, _)| *cidr)
            .collect();
        touched.extend(self.blocks.keys().filter(|c| !before.contains_key(c)));
        touched
    }

    /// Logs each ignored block once per rule (and indexes their CIDRs).
    fn log_ignored(&mut self) {
        self.ignored_cidrs = self.ignored.iter().filter_map(|i| i.cidr).collect();
        let now: HashSet<(String, Rule)> = self
            .ignored
            .iter()
            .map(|i| (i.key.clone(), i.rule))
            .collect();
        for i in &self.ignored {
            if !self.logged.contains(&(i.key.clone(), i.rule)) {
                tracing::warn!(key = %i.key, rule = %i.rule, affinity = %i.affinity,
                    detail = %i.detail,
                    "routes: block ignored: it breaks the rule for blocks; its routes are neither advertised nor accepted");
            }
        }
        self.logged = now;
    }

    fn put_block(&mut self, kv: &KeyValue) -> Touched {
        let (new, block) = self.stored_of(kv);
        let shape = new.shape;
        let old = self.stored.insert(kv.key.clone(), new);
        let counted = self.block_keys.get(&kv.key).copied();
        match (old.map(|o| o.shape), shape, block) {
            // Same CIDR, age and verdict: counted or not as before.
            (Some(was), Some(now), Some(b)) if was == Some(now) => match counted {
                Some(cidr) => {
                    let entry = entry_of(&b);
                    if self.blocks.get(&cidr) == Some(&entry) {
                        return Touched::Nothing;
                    }
                    self.remove_block(&cidr);
                    self.add_block(cidr, entry);
                    Touched::Blocks(vec![cidr])
                }
                None => Touched::Nothing,
            },
            // A new block: counts at once when it overlaps none that counts (it is the
            // youngest); one that breaks the rule changes nothing else.
            (None, Some((cidr, _, verdict)), Some(b)) => match verdict {
                Ok(()) if self.index.overlapping(&cidr).is_none() => {
                    self.block_keys.insert(kv.key.clone(), cidr);
                    self.add_block(cidr, entry_of(&b));
                    Touched::Blocks(vec![cidr])
                }
                Ok(()) => Touched::blocks(self.resort()),
                Err(_) => {
                    self.resort_ignored_only();
                    Touched::Nothing
                }
            },
            (None, None, _) => {
                self.resort_ignored_only();
                Touched::Nothing
            }
            _ => Touched::blocks(self.resort()),
        }
    }

    /// A block that cannot count was stored or changed: only the list of ignored blocks (and
    /// what a claim keeps clear of) changes, but the list comes from one sort.
    fn resort_ignored_only(&mut self) {
        let sorted = wellformed::sort(self.stored.values().map(|s| &s.kv), &self.pools);
        self.ignored = sorted.ignored;
        self.log_ignored();
    }

    fn delete_block(&mut self, key: &str) -> Touched {
        let Some(old) = self.stored.remove(key) else {
            return Touched::Nothing;
        };
        match self.block_keys.remove(key) {
            Some(cidr) => {
                self.remove_block(&cidr);
                let mut touched = vec![cidr];
                // Blocks that lost an overlap to it may count now.
                if self.ignored.iter().any(|i| i.rule == Rule::Overlap) {
                    touched.extend(self.resort());
                }
                Touched::Blocks(touched)
            }
            None => {
                if old.shape.is_none() || old.shape.is_some_and(|s| s.2.is_err()) {
                    self.ignored.retain(|i| i.key != key);
                    self.log_ignored();
                    Touched::Nothing
                } else {
                    Touched::blocks(self.resort())
                }
            }
        }
    }

    fn put(&mut self, kv: &KeyValue) -> Touched {
        if kv.key.starts_with(keys::BLOCKS) {
            self.put_block(kv)
        } else if let Some(name) = kv.key.strip_prefix(keys::NODES) {
            let record: NodeRecord = match kv.decode() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(key = %kv.key, error = %e, "routes: node record not understood; ignored");
                    return Touched::Nothing;
                }
            };
            if record.name != name {
                tracing::warn!(key = %kv.key, name = %record.name, "routes: node record names another node; ignored");
                return Touched::Nothing;
            }
            let addresses = record
                .addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect();
            let entry = NodeEntry { record, addresses };
            let changed = self.nodes.get(name) != Some(&entry);
            self.nodes.insert(name.to_string(), entry);
            if changed {
                Touched::Node(name.to_string())
            } else {
                Touched::Nothing
            }
        } else {
            Touched::Nothing
        }
    }

    fn add_block(&mut self, cidr: IpNet, entry: BlockEntry) {
        self.index.insert(cidr);
        *self
            .lengths
            .entry((is_v6(&cidr), cidr.prefix_len()))
            .or_default() += 1;
        if !entry.affinity.is_empty() {
            self.affine
                .entry(entry.affinity.clone())
                .or_default()
                .insert(cidr);
        }
        for (addr, node) in &entry.allocations {
            self.allocated_by
                .entry(node.clone())
                .or_default()
                .insert(*addr);
        }
        self.blocks.insert(cidr, entry);
    }

    fn remove_block(&mut self, cidr: &IpNet) -> bool {
        let Some(entry) = self.blocks.remove(cidr) else {
            return false;
        };
        self.index.remove(cidr);
        let len = (is_v6(cidr), cidr.prefix_len());
        if let Some(n) = self.lengths.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&len);
            }
        }
        if let Some(set) = self.affine.get_mut(&entry.affinity) {
            set.remove(cidr);
            if set.is_empty() {
                self.affine.remove(&entry.affinity);
            }
        }
        for (addr, node) in &entry.allocations {
            if let Some(set) = self.allocated_by.get_mut(node) {
                set.remove(addr);
                if set.is_empty() {
                    self.allocated_by.remove(node);
                }
            }
        }
        true
    }

    /// The block with exactly this CIDR.
    pub fn block(&self, cidr: &IpNet) -> Option<&BlockEntry> {
        self.blocks.get(cidr)
    }

    /// The block holding `addr`.
    pub fn block_of(&self, addr: IpAddr) -> Option<(IpNet, &BlockEntry)> {
        let v6 = addr.is_ipv6();
        self.lengths
            .keys()
            .filter(|(f, _)| *f == v6)
            .find_map(|(_, len)| {
                let cidr = IpNet::new(addr, *len).ok()?.trunc();
                self.blocks.get(&cidr).map(|b| (cidr, b))
            })
    }

    /// Blocks affine to `node`.
    pub fn affine_to(&self, node: &str) -> impl Iterator<Item = &IpNet> {
        self.affine.get(node).into_iter().flatten()
    }

    /// Addresses `node` allocated, in any block.
    pub fn allocated_by(&self, node: &str) -> impl Iterator<Item = &IpAddr> {
        self.allocated_by.get(node).into_iter().flatten()
    }

    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.values()
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

/// What routes keep of a block.
fn entry_of(b: &Block) -> BlockEntry {
    BlockEntry {
        affinity: b.affinity.clone(),
        allocations: b
            .allocations
            .iter()
            .map(|(off, a)| (b.address(*off), a.node.clone()))
            .collect(),
    }
}

fn is_v6(n: &IpNet) -> bool {
    matches!(n, IpNet::V6(_))
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::ipam::Allocation;

    /// The pools the routes tests' blocks come from: 10.0.0.0/8 (/26 blocks, /24 before) and
    /// fd00::/64 (/122).
    pub fn pools() -> Vec<Pool> {
        vec![
            Pool {
                cidr: "10.0.0.0/8".parse().expect("cidr"),
                block_size: 26,
                disabled: false,
                previous_block_sizes: vec![24],
                restricted: false,
            },
            Pool {
                cidr: "fd00::/64".parse().expect("cidr"),
                block_size: 122,
                disabled: false,
                previous_block_sizes: Vec::new(),
                restricted: false,
            },
        ]
    }

    /// An empty view over [`pools`].
    pub fn view() -> View {
        View::with_pools(pools())
    }

    /// A block put event: `cidr` affine to `affinity`, with `allocs` (address, node).
    pub fn block_kv(cidr: &str, affinity: &str, allocs: &[(&str, &str)]) -> KeyValue {
        let cidr: IpNet = cidr.parse().expect("cidr");
        let mut b = Block::new(cidr, affinity);
        for (i, (addr, node)) in allocs.iter().enumerate() {
            let off = b
                .offset_of(addr.parse().expect("addr"))
                .expect("address in block");
            b.allocations.insert(
                off,
                Allocation {
                    handle: format!("h{i}"),
                    ifname: "eth0".into(),
                    node: node.to_string(),
                    seq: i as u64,
                    attributes: Default::default(),
                },
            );
        }
        KeyValue {
            key: keys::block(&cidr),
            value: serde_json::to_vec(&b).expect("json"),
            revision: 1,
            created: 1,
        }
    }

    pub fn node_kv(name: &str, addresses: &[&str], reflector: bool) -> KeyValue {
        let r = NodeRecord {
            name: name.into(),
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            routes_endpoint: format!("{}:5474", addresses.first().copied().unwrap_or("")),
            reflector,
            ..Default::default()
        };
        KeyValue {
            key: keys::node(name),
            value: serde_json::to_vec(&r).expect("json"),
            revision: 1,
            created: 1,
        }
    }

    pub fn put(kv: KeyValue) -> WatchEvent {
        WatchEvent::Put(kv)
    }

    #[test]
    fn blocks_index_by_affinity_and_allocating_node() {
        let mut v = view();
        assert!(v.apply(&put(block_kv(
            "10.244.0.0/26",
            "a",
            &[("10.244.0.1", "a"), ("10.244.0.2", "b")]
        ))));
        assert!(v.apply(&put(block_kv("fd00::/122", "a", &[]))));
        assert_eq!(v.affine_to("a").count(), 2);
        assert_eq!(
            v.allocated_by("b").collect::<Vec<_>>(),
            vec![&"10.244.0.2".parse::<IpAddr>().expect("ip")]
        );
        let (cidr, b) = v
            .block_of("10.244.0.2".parse().expect("ip"))
            .expect("found");
        assert_eq!(cidr.to_string(), "10.244.0.0/26");
        assert_eq!(b.allocations.len(), 2);
        assert!(v.block_of("10.244.0.64".parse().expect("ip")).is_none());
        assert!(v.block_of("fd00::3".parse().expect("ip")).is_some());
        // The same value again changes nothing.
        assert!(!v.apply(&put(block_kv(
            "10.244.0.0/26",
            "a",
            &[("10.244.0.1", "a"), ("10.244.0.2", "b")]
        ))));
        // Released: affine to nobody, b's borrowed address gone.
        assert!(v.apply(&put(block_kv("10.244.0.0/26", "", &[]))));
        assert_eq!(v.affine_to("a").count(), 1);
        assert_eq!(v.allocated_by("b").count(), 0);
        assert!(v.apply(&WatchEvent::Delete {
            key: keys::block(&"fd00::/122".parse().expect("cidr")),
            revision: 3
        }));
        assert_eq!(v.affine_to("a").count(), 0);
        assert!(v.block_of("fd00::3".parse().expect("ip")).is_none());
        assert_eq!(v.blocks(), 1);
    }

    /// [`block_kv`] created at `created`.
    fn aged(cidr: &str, affinity: &str, created: i64) -> KeyValue {
        KeyValue {
            created,
            ..block_kv(cidr, affinity, &[])
        }
    }

    #[test]
    fn overlaps_follow_age_as_blocks_come_and_go() {
        let mut v = view();
        let victim: IpNet = "10.244.0.64/26".parse().expect("cidr");
        let rogue: IpNet = "10.244.0.0/24".parse().expect("cidr");
        assert!(v.apply(&put(aged("10.244.0.64/26", "victim", 10))));
        // A younger /24 (a size the pool had before) over it: ignored.
        v.apply(&put(aged("10.244.0.0/24", "rogue", 20)));
        assert!(v.block(&victim).is_some() && v.block(&rogue).is_none());
        assert!(v.is_ignored_block(&rogue));
        assert_eq!(v.affine_to("rogue").count(), 0);
        // Writing it again (a release, an allocation) changes nothing.
        v.apply(&put(aged("10.244.0.0/24", "rogue", 20)));
        assert!(v.block(&rogue).is_none());
        // The victim's block goes: the /24 counts now.
        assert!(v.apply(&WatchEvent::Delete {
            key: keys::block(&victim),
            revision: 30
        }));
        assert!(v.block(&rogue).is_some() && !v.is_ignored_block(&rogue));
        // A block created later inside it is the one ignored.
        v.apply(&put(aged("10.244.0.64/26", "victim", 40)));
        assert!(v.block(&victim).is_none() && v.block(&rogue).is_some());
        // A new block beside everything counts at once; a forged one changes nothing else.
        assert!(v.apply(&put(aged("10.244.1.0/26", "c", 50))));
        assert!(!v.apply(&put(aged("0.0.0.0/0", "rogue", 60))));
        assert_eq!(v.blocks(), 2);
        assert_eq!(v.ignored().len(), 2);
        // New pools: the /24 is no size the pool makes any more; the /26 inside counts.
        let mut pools = pools();
        pools[0].previous_block_sizes.clear();
        assert!(v.set_pools(pools));
        assert!(v.block(&victim).is_some() && v.block(&rogue).is_none());
    }

    #[test]
    fn node_records_parse_old_and_new_and_bad_ones_are_skipped() {
        let mut v = view();
        // A record of an older agent: no routes endpoint, no reflector flag.
        let old = KeyValue {
            key: keys::node("old"),
            value: br#"{"name":"old","addresses":["192.0.2.1","nonsense"],"labels":{},"agent_version":"0.1.0"}"#.to_vec(),
            revision: 1,
            created: 1,
        };
        assert!(v.apply(&put(old)));
        let n = v.node("old").expect("parsed");
        assert!(n.record.routes_endpoint.is_empty() && !n.record.reflector);
        assert_eq!(n.addresses.len(), 1, "the unparsable address is left out");
        let bad = KeyValue {
            key: keys::node("bad"),
            value: b"{not json".to_vec(),
            revision: 2,
            created: 2,
        };
        assert!(!v.apply(&put(bad)));
        // A record whose name is not its key's.
        let mut liar = node_kv("c", &["192.0.2.3"], false);
        liar.key = keys::node("d");
        assert!(!v.apply(&put(liar)));
        assert!(v.node("d").is_none());
        assert!(v.apply(&put(node_kv("r", &["192.0.2.9"], true))));
        assert!(v.node("r").expect("r").record.reflector);
        v.replace(Part::Nodes, &[node_kv("r", &["192.0.2.9"], true)]);
        assert_eq!(v.nodes().count(), 1);
    }
}
