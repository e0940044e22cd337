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

use crate::ipam::wellformed::{self, Ignored, Item, Rule, SortedItems};
use crate::ipam::{Allocation, Block, Pool};
use crate::model::NodeRecord;
use crate::store::{keys, BadValue, KeyValue, WatchEvent};

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

/// A block that counts, as routes keep it.
#[derive(Debug, Clone)]
struct Counted {
    entry: BlockEntry,
    /// The store's creation stamp: its age under the overlap rule.
    created: i64,
}

/// A stored block that does not count now, kept as decoded (or why it does not decode) to be
/// sorted again when blocks, pools or overlaps change. Rare: only forged, stale or broken
/// objects are held.
#[derive(Debug, Clone)]
struct Held {
    created: i64,
    block: Result<Block, BadValue>,
}

/// The blocks and node records of the datastore.
///
/// Nothing keeps a block's stored bytes: a block that counts is its [`BlockEntry`] and
/// its age, and sorting again rebuilds it as a [`Block`] from that ([`block_of_entry`]).
#[derive(Debug, Default)]
pub struct View {
    /// The pools, as the rule for blocks needs them.
    pools: Vec<Pool>,
    /// The blocks that count, by CIDR.
    blocks: HashMap<IpNet, Counted>,
    /// The stored blocks that do not count, by key.
    held: HashMap<String, Held>,
    /// The blocks that do not, and why (one per held block, by key).
    ignored: Vec<Ignored>,
    /// Their CIDRs.
    ignored_cidrs: HashSet<IpNet>,
    /// (key, rule) already logged.
    logged: HashSet<(String, Rule)>,
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
    /// Taken by value: each stored value is dropped once decoded, so a big listing is never
    /// held twice (as stored, and decoded).
    pub fn replace(&mut self, part: Part, kvs: Vec<KeyValue>) {
        match part {
            Part::Blocks => {
                let items: Vec<Item> = kvs
                    .into_iter()
                    .filter(|kv| kv.key.starts_with(keys::BLOCKS))
                    .map(Item::from)
                    .collect();
                self.blocks.clear();
                self.held.clear();
                self.sort(items, HashMap::new());
            }
            Part::Nodes => {
                self.nodes.clear();
                for kv in &kvs {
                    self.put(kv);
                }
            }
        }
    }

    /// Sorts every stored block by the rule again and rebuilds the indexes; returns the CIDRs
    /// of the counted blocks that appeared, changed or went.
    fn resort(&mut self) -> Vec<IpNet> {
        let before = std::mem::take(&mut self.blocks);
        let held = std::mem::take(&mut self.held);
        // A held block of a counted one's key is its newer value.
        let mut items: Vec<Item> = before
            .iter()
            .map(|(cidr, c)| (keys::block(cidr), cidr, c))
            .filter(|(key, _, _)| !held.contains_key(key))
            .map(|(key, cidr, c)| Item {
                key,
                created: c.created,
                block: Ok(block_of_entry(*cidr, &c.entry)),
            })
            .collect();
        items.extend(held.into_iter().map(|(key, h)| Item {
            key,
            created: h.created,
            block: h.block,
        }));
        self.sort(items, before)
    }

    /// Sorts `items` (every stored block) into the blocks that count and those held; returns
    /// the CIDRs whose counted block differs from `before`'s.
    fn sort(&mut self, items: Vec<Item>, before: HashMap<IpNet, Counted>) -> Vec<IpNet> {
        let SortedItems {
            sorted,
            created,
            rest,
        } = wellformed::sort_items(items, &self.pools);
        self.blocks.clear();
        self.lengths.clear();
        self.affine.clear();
        self.allocated_by.clear();
        for (b, created) in sorted.counted.into_iter().zip(created) {
            self.add_block(
                b.cidr,
                Counted {
                    entry: entry_of(&b),
                    created,
                },
            );
        }
        self.held = rest
            .into_iter()
            .map(|i| {
                (
                    i.key,
                    Held {
                        created: i.created,
                        block: i.block,
                    },
                )
            })
            .collect();
        self.ignored = sorted.ignored;
        self.log_ignored();
        let mut touched: Vec<IpNet> = before
            .iter()
            .filter(|(cidr, c)| self.block(cidr) != Some(&c.entry))
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

    /// The CIDR of the block of `key` if it counts. A block counts only under its own key
    /// ([`Rule`]: the key matches the CIDR), so the key names the CIDR: no index of keys.
    fn counted_cidr(&self, key: &str) -> Option<IpNet> {
        keys::block_cidr(key).filter(|cidr| self.blocks.contains_key(cidr))
    }

    fn put_block(&mut self, kv: &KeyValue) -> Touched {
        let item = Item::of(kv);
        // Everything of the rule but overlaps: it passes, or what is reported of it.
        let judged: Result<bool, Ignored> = match &item.block {
            Ok(b) => wellformed::check(&item.key, b, &self.pools)
                .map_err(|(rule, detail)| wellformed::ignored(item.key.clone(), b, rule, detail)),
            Err(bad) => Err(wellformed::undecodable(item.key.clone(), bad.to_string())),
        };
        let verdict = judged.as_ref().ok().copied();
        let counted = self.counted_cidr(&kv.key);
        match (counted, verdict, &item.block) {
            // Counted, and counts as before (same CIDR and age; its size's verdict follows from
            // the CIDR, and new pools sort everything again): only its content may have
            // changed.
            (Some(cidr), Some(_), Ok(b))
                if b.cidr == cidr
                    && self
                        .blocks
                        .get(&cidr)
                        .is_some_and(|c| c.created == item.created) =>
            {
                let entry = entry_of(b);
                if self.block(&cidr) == Some(&entry) {
                    return Touched::Nothing;
                }
                self.remove_block(&cidr);
                self.add_block(
                    cidr,
                    Counted {
                        entry,
                        created: item.created,
                    },
                );
                Touched::Blocks(vec![cidr])
            }
            // A new block: counts at once when it overlaps none that counts (it is the
            // youngest).
            (None, Some(_), Ok(b))
                if !self.held.contains_key(&kv.key) && self.overlapping(&b.cidr).is_none() =>
            {
                let cidr = b.cidr;
                self.add_block(
                    cidr,
                    Counted {
                        entry: entry_of(b),
                        created: item.created,
                    },
                );
                Touched::Blocks(vec![cidr])
            }
            // Breaks the rule, and did not count: only the list of ignored blocks changes.
            (None, None, _) => {
                self.ignored.retain(|i| i.key != item.key);
                self.ignored.extend(judged.err());
                self.ignored.sort_by(|a, b| a.key.cmp(&b.key));
                self.held.insert(
                    item.key,
                    Held {
                        created: item.created,
                        block: item.block,
                    },
                );
                self.log_ignored();
                Touched::Nothing
            }
            // Anything else may change which blocks count: held, then everything sorted again.
            _ => {
                self.held.insert(
                    item.key,
                    Held {
                        created: item.created,
                        block: item.block,
                    },
                );
                Touched::blocks(self.resort())
            }
        }
    }

    fn delete_block(&mut self, key: &str) -> Touched {
        if self.held.remove(key).is_some() {
            // It counted for nothing: only the list of ignored blocks changes.
            self.ignored.retain(|i| i.key != key);
            self.log_ignored();
            return Touched::Nothing;
        }
        let Some(cidr) = self.counted_cidr(key) else {
            return Touched::Nothing;
        };
        self.remove_block(&cidr);
        let mut touched = vec![cidr];
        // Blocks that lost an overlap to it may count now.
        if self.ignored.iter().any(|i| i.rule == Rule::Overlap) {
            touched.extend(self.resort());
        }
        Touched::Blocks(touched)
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

    fn add_block(&mut self, cidr: IpNet, counted: Counted) {
        let entry = &counted.entry;
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
        self.blocks.insert(cidr, counted);
    }

    fn remove_block(&mut self, cidr: &IpNet) -> bool {
        let Some(Counted { entry, .. }) = self.blocks.remove(cidr) else {
            return false;
        };
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

    /// A counted block that shares an address with `cidr`, a block that passed the rule (of
    /// an allowed size). Aligned networks overlap only by containment: one of the lengths
    /// present at or above its own holds it (its start truncated to that length), or one of
    /// the longer lengths has a block inside it — looked up one by one (at most
    /// [`wellformed::MAX_BLOCK_ADDRESSES`] of each length, as the rule bounds a block's size),
    /// or, when fewer blocks have that length, among those. No index beyond the blocks' own
    /// map: it was a megabyte at 10,000 blocks.
    fn overlapping(&self, cidr: &IpNet) -> Option<IpNet> {
        let v6 = is_v6(cidr);
        let len = cidr.prefix_len();
        for (&(_, l), &count) in self.lengths.iter().filter(|((f, _), _)| *f == v6) {
            if l <= len {
                let outer = IpNet::new(cidr.network(), l).ok()?.trunc();
                if self.blocks.contains_key(&outer) {
                    return Some(outer);
                }
                continue;
            }
            let inside = 1u64.checked_shl(u32::from(l - len)).unwrap_or(u64::MAX);
            if inside > count as u64 && inside > self.blocks.len() as u64 {
                let found = self
                    .blocks
                    .keys()
                    .find(|b| b.prefix_len() == l && cidr.contains(&b.network()));
                if found.is_some() {
                    return found.copied();
                }
            } else if let Ok(subnets) = cidr.subnets(l) {
                if let Some(b) = subnets.into_iter().find(|s| self.blocks.contains_key(s)) {
                    return Some(b);
                }
            }
        }
        None
    }

    /// The block with exactly this CIDR.
    pub fn block(&self, cidr: &IpNet) -> Option<&BlockEntry> {
        self.blocks.get(cidr).map(|c| &c.entry)
    }

    /// The block holding `addr`.
    pub fn block_of(&self, addr: IpAddr) -> Option<(IpNet, &BlockEntry)> {
        let v6 = addr.is_ipv6();
        self.lengths
            .keys()
            .filter(|(f, _)| *f == v6)
            .find_map(|(_, len)| {
                let cidr = IpNet::new(addr, *len).ok()?.trunc();
                self.blocks.get(&cidr).map(|c| (cidr, &c.entry))
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

/// A counted block as the rule reads it again, from what routes keep of it: its CIDR,
/// affinity and each allocation's offset and node (the rest of an allocation is not kept).
fn block_of_entry(cidr: IpNet, entry: &BlockEntry) -> Block {
    let mut b = Block::new(cidr, &entry.affinity);
    for (addr, node) in &entry.allocations {
        if let Some(off) = b.offset_of(*addr) {
            b.allocations.insert(
                off,
                Allocation {
                    handle: String::new(),
                    ifname: String::new(),
                    node: node.clone(),
                    seq: 0,
                    attributes: Default::default(),
                },
            );
        }
    }
    b
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

#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
#[cfg(test)]
pub mod tests;
