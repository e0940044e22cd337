//! The well-formedness rule for IPAM blocks, defined once and pure (no I/O). Every reader of
//! the stored blocks sorts them through [`sort`]: the IPAM service's view (claims, allocation,
//! borrowing, release, leak GC, reports) and route distribution's view (what this node
//! advertises, what it accepts from peers). A block that breaks the rule is ignored by all of
//! them and reported with the rule it broke ([`Ignored`]).
//!
//! A stored block counts only if
//! 1. it decodes ([`Rule::Undecodable`]);
//! 2. its object key is the key of its CIDR ([`Rule::KeyMismatch`]);
//! 3. its CIDR lies inside a pool ([`Rule::OutsidePools`]);
//! 4. it is a block that pool makes: aligned on its own size ([`Rule::NotAligned`]), of the
//!    pool's `blockSize` or one of its `previousBlockSizes` ([`Rule::BlockSize`]) — the
//!    operator's objects, which no node can write;
//! 5. every allocation sits inside it ([`Rule::AllocationOutside`]);
//! 6. it overlaps no block that counts ([`Rule::Overlap`]). Overlaps are resolved by age, the
//!    store's own creation stamp ([`KeyValue::created`], which no client sets): blocks are
//!    taken oldest first, and one that overlaps a block already taken is ignored. A legitimate
//!    claim never overlaps a block it can see, so of two overlapping blocks the younger one is
//!    the forgery (or lost a race); a rogue cannot make its block older than the victim's.
//!    Two blocks created in the same second (the Kubernetes stamp's resolution) are told apart
//!    by size: one of its pool's current `blockSize` wins, as only that size is made now (an
//!    old size created "now" is forged or made by a node with a stale config); then the
//!    smaller block, then the key, so every node decides the same.
//!
//! The rule bounds a block's size (at most [`MAX_BLOCK_ADDRESSES`]), so nothing that walks a
//! counted block's addresses can be made to walk 2^63 of them.
use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use ipnet::IpNet;

use super::{Block, Pool};
use crate::store::{keys, BadValue, KeyValue};

/// Block sizes a pool may have, IPv4 and IPv6 (the config refuses others).
pub const fn block_sizes(v4: bool) -> RangeInclusive<u8> {
    if v4 {
        20..=32
    } else {
        116..=128
    }
}

/// The most addresses a block of any allowed size holds (2^12: an IPv4 /20, an IPv6 /116).
pub const MAX_BLOCK_ADDRESSES: u64 = 1 << 12;

/// Which part of the rule a block broke. Each has a stable name (metrics, `ipam check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    Undecodable,
    KeyMismatch,
    OutsidePools,
    NotAligned,
    BlockSize,
    AllocationOutside,
    Overlap,
}

impl Rule {
    pub const ALL: [Rule; 7] = [
        Rule::Undecodable,
        Rule::KeyMismatch,
        Rule::OutsidePools,
        Rule::NotAligned,
        Rule::BlockSize,
        Rule::AllocationOutside,
        Rule::Overlap,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rule::Undecodable => "undecodable",
            Rule::KeyMismatch => "key_mismatch",
            Rule::OutsidePools => "outside_pools",
            Rule::NotAligned => "not_aligned",
            Rule::BlockSize => "block_size",
            Rule::AllocationOutside => "allocation_outside",
            Rule::Overlap => "overlap",
        }
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A stored block that does not count, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ignored {
    /// Its datastore key.
    pub key: String,
    /// What it says its CIDR is (`None`: it does not decode).
    pub cidr: Option<IpNet>,
    /// The node it says it is affine to.
    pub affinity: String,
    /// The allocations it says it holds: (address, the node that allocated it).
    pub allocations: Vec<(std::net::IpAddr, String)>,
    pub rule: Rule,
    /// What exactly, for people: "10.244.7.9/32 is a /32; pool 10.244.0.0/16 makes /26".
    pub detail: String,
}

/// The stored blocks, sorted by the rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sorted {
    /// The blocks that count, each with its revision, in key order.
    pub counted: Vec<Block>,
    pub ignored: Vec<Ignored>,
    /// CIDRs a claim must keep clear of although they do not count: ignored blocks inside a
    /// pool, aligned and of an allowed size, that hold allocations (a claim over one could hand
    /// out an address its pods still use: e.g. a block of a size the pool had before, which the
    /// operator did not list in `previousBlockSizes`, or the younger of two overlapping blocks).
    pub avoid: Vec<IpNet>,
}

/// Checks one decoded block stored at `key` against `pools`, all but the overlap rule.
/// `Ok(current)`: it may count; `current` says whether it is of its pool's current
/// `blockSize`.
pub fn check(key: &str, b: &Block, pools: &[Pool]) -> Result<bool, (Rule, String)> {
    let cidr = b.cidr;
    if keys::block(&cidr) != key {
        return Err((
            Rule::KeyMismatch,
            format!(
                "object {key} says its CIDR is {cidr}, whose key is {}",
                keys::block(&cidr)
            ),
        ));
    }
    let inside: Vec<&Pool> = pools.iter().filter(|p| p.cidr.contains(&cidr)).collect();
    if inside.is_empty() {
        return Err((Rule::OutsidePools, format!("{cidr} lies inside no pool")));
    }
    if cidr.trunc() != cidr {
        return Err((
            Rule::NotAligned,
            format!("{cidr} does not start on a /{} boundary", cidr.prefix_len()),
        ));
    }
    let len = cidr.prefix_len();
    let current = inside.iter().any(|p| p.block_size == len);
    if !current && !inside.iter().any(|p| p.previous_block_sizes.contains(&len)) {
        let p = inside[0];
        let mut sizes = vec![p.block_size];
        sizes.extend(&p.previous_block_sizes);
        let sizes: Vec<String> = sizes.iter().map(|s| format!("/{s}")).collect();
        return Err((
            Rule::BlockSize,
            format!(
                "{cidr} is a /{len}; pool {} makes {} (blockSize, previousBlockSizes)",
                p.cidr,
                sizes.join(", ")
            ),
        ));
    }
    let size = host_count(&cidr);
    if let Some(off) = b.allocations.keys().find(|o| u64::from(**o) >= size) {
        return Err((
            Rule::AllocationOutside,
            format!("an allocation at offset {off}, outside the {size} addresses of {cidr}"),
        ));
    }
    Ok(current)
}

/// One stored block as [`sort_items`] takes it: its key, the store's creation stamp, and its
/// value decoded (its revision set) or why it does not decode.
#[derive(Debug, Clone)]
pub struct Item {
    pub key: String,
    pub created: i64,
    pub block: Result<Block, BadValue>,
}

impl Item {
    /// A stored key-value, decoded.
    pub fn of(kv: &KeyValue) -> Self {
        Self {
            key: kv.key.clone(),
            created: kv.created,
            block: decode(kv),
        }
    }
}

/// [`Item::of`] for a key-value no longer needed: its key is moved, its value dropped.
impl From<KeyValue> for Item {
    fn from(kv: KeyValue) -> Self {
        let block = decode(&kv);
        Self {
            key: kv.key,
            created: kv.created,
            block,
        }
    }
}

fn decode(kv: &KeyValue) -> Result<Block, BadValue> {
    kv.decode::<Block>().map(|mut b| {
        b.revision = kv.revision;
        b
    })
}

/// Sorts stored blocks (`ipam/blocks/` key-values) by the rule, against `pools` (every pool of
/// the cluster, disabled ones included).
pub fn sort<'a>(kvs: impl IntoIterator<Item = &'a KeyValue>, pools: &[Pool]) -> Sorted {
    sort_items(kvs.into_iter().map(Item::of).collect(), pools).sorted
}

/// [`sort`]'s answer for blocks already decoded, and the items themselves back: each counted
/// block's creation stamp, and the items that do not count as they were given.
#[derive(Debug, Default)]
pub struct SortedItems {
    pub sorted: Sorted,
    /// The creation stamp of each block of `sorted.counted`, in its order.
    pub created: Vec<i64>,
    /// The items that do not count.
    pub rest: Vec<Item>,
}

/// [`sort`] of blocks already decoded, taking them (a reader that keeps decoded blocks, not
/// their bytes, gets back what it keeps): nothing is copied.
pub fn sort_items(items: Vec<Item>, pools: &[Pool]) -> SortedItems {
    let (sorted, winners) = judge(&items, pools);
    let mut wins = vec![false; items.len()];
    for i in winners {
        wins[i] = true;
    }
    let mut counted = Vec::new();
    let mut rest = Vec::new();
    for (item, wins) in items.into_iter().zip(wins) {
        match item.block {
            Ok(b) if wins => counted.push((keys::block(&b.cidr), b, item.created)),
            block => rest.push(Item { block, ..item }),
        }
    }
    counted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = SortedItems {
        sorted,
        created: Vec::with_capacity(counted.len()),
        rest,
    };
    for (_, b, created) in counted {
        out.sorted.counted.push(b);
        out.created.push(created);
    }
    out.sorted.ignored.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

/// The rule over `items`: what is ignored and avoided, and the indexes of the items that
/// count (in `Sorted::counted`'s place).
fn judge(items: &[Item], pools: &[Pool]) -> (Sorted, Vec<usize>) {
    let mut out = Sorted::default();
    let mut candidates: Vec<Candidate> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let b = match &item.block {
            Ok(b) => b,
            Err(bad) => {
                out.ignored
                    .push(undecodable(item.key.clone(), bad.to_string()));
                continue;
            }
        };
        match check(&item.key, b, pools) {
            Ok(current) => candidates.push(Candidate {
                index,
                created: item.created,
                current,
                block: b,
            }),
            Err((rule, detail)) => {
                if plausible(&item.key, b, pools) {
                    out.avoid.push(b.cidr);
                }
                out.ignored.push(ignored(item.key.clone(), b, rule, detail));
            }
        }
    }
    let verdicts = arbitrate(
        candidates
            .iter()
            .map(|c| Contender {
                cidr: c.block.cidr,
                created: c.created,
                current: c.current,
            })
            .collect(),
    );
    let mut winners = Vec::new();
    for (c, verdict) in candidates.into_iter().zip(verdicts) {
        match verdict {
            Some(lost) => {
                if !c.block.allocations.is_empty() {
                    out.avoid.push(c.block.cidr);
                }
                let key = keys::block(&c.block.cidr);
                out.ignored.push(ignored(
                    key,
                    c.block,
                    Rule::Overlap,
                    lost.detail(&c.block.cidr),
                ));
            }
            None => winners.push(c.index),
        }
    }
    (out, winners)
}

/// Whether a block that broke the rule could still hold pods' addresses a claim must not hand
/// out again: its key is its CIDR's, it is aligned, of an allowed size, inside a pool, and
/// holds allocations.
fn plausible(key: &str, b: &Block, pools: &[Pool]) -> bool {
    let v4 = matches!(b.cidr, IpNet::V4(_));
    keys::block(&b.cidr) == key
        && b.cidr.trunc() == b.cidr
        && block_sizes(v4).contains(&b.cidr.prefix_len())
        && pools.iter().any(|p| p.cidr.contains(&b.cidr))
        && !b.allocations.is_empty()
}

/// What is reported of a block stored at `key` that does not decode.
pub fn undecodable(key: String, detail: String) -> Ignored {
    Ignored {
        key,
        cidr: None,
        affinity: String::new(),
        allocations: Vec::new(),
        rule: Rule::Undecodable,
        detail,
    }
}

/// What is reported of block `b`, stored at `key`, that breaks `rule`.
pub fn ignored(key: String, b: &Block, rule: Rule, detail: String) -> Ignored {
    Ignored {
        key,
        cidr: Some(b.cidr),
        affinity: b.affinity.clone(),
        allocations: b
            .allocations
            .iter()
            .map(|(o, a)| (b.address(*o), a.node.clone()))
            .collect(),
        rule,
        detail,
    }
}

struct Candidate<'a> {
    /// Its place among the items.
    index: usize,
    created: i64,
    current: bool,
    block: &'a Block,
}

/// A block that passed [`check`], contending for its addresses with the others: rule 6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contender {
    pub cidr: IpNet,
    /// The store's creation stamp.
    pub created: i64,
    /// Of its pool's current `blockSize` ([`check`]'s answer).
    pub current: bool,
}

/// Why a contender does not count: the older block it overlaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    pub to: IpNet,
    /// Created at the same stamp, and won on size or key.
    pub same_stamp: bool,
}

impl Lost {
    /// What [`Ignored::detail`] says of the loser `cidr`.
    pub fn detail(&self, cidr: &IpNet) -> String {
        format!(
            "{cidr} overlaps {}, which was created {}",
            self.to,
            if self.same_stamp {
                "at the same time and wins (of its pool's blockSize, or smaller)"
            } else {
                "before it"
            }
        )
    }
}

/// Rule 6 over `contenders`: for each, in their order, `None` when it counts, else what it
/// lost to. Taken oldest first; at the same stamp current sizes, then the smaller block, then
/// by key; one that overlaps a block already taken loses.
pub fn arbitrate(contenders: Vec<Contender>) -> Vec<Option<Lost>> {
    let mut order: Vec<usize> = (0..contenders.len()).collect();
    order.sort_by_cached_key(|&i| {
        let c = &contenders[i];
        (
            c.created,
            !c.current,
            std::cmp::Reverse(c.cidr.prefix_len()),
            keys::block(&c.cidr),
        )
    });
    let mut verdicts = vec![None; contenders.len()];
    let mut taken = Taken::default();
    for i in order {
        let c = &contenders[i];
        match taken.overlapping(&c.cidr) {
            Some(older) => {
                verdicts[i] = Some(Lost {
                    to: older,
                    same_stamp: c.created == taken.created[&older],
                })
            }
            None => taken.insert(c.cidr, c.created),
        }
    }
    verdicts
}

/// Blocks that do not overlap each other, for overlap checks in O(log n): aligned networks
/// overlap only by containment, so a block overlaps one of them iff one starts inside it, or
/// it starts inside one (found by truncating its start to each length present).
#[derive(Debug, Default, Clone)]
pub struct Index {
    /// (IPv6, first address) → the block starting there.
    by_start: BTreeMap<(bool, u128), IpNet>,
    /// (IPv6, prefix length) → how many blocks have it.
    lengths: BTreeMap<(bool, u8), usize>,
}

impl Index {
    /// A block of the index that shares an address with `cidr`.
    pub fn overlapping(&self, cidr: &IpNet) -> Option<IpNet> {
        let (v6, first, last) = span(cidr);
        if let Some((_, b)) = self.by_start.range((v6, first)..=(v6, last)).next() {
            return Some(*b);
        }
        self.lengths
            .keys()
            .filter(|(f, len)| *f == v6 && *len < cidr.prefix_len())
            .find_map(|(_, len)| {
                let outer = IpNet::new(cidr.addr(), *len).ok()?.trunc();
                let (_, start, _) = span(&outer);
                self.by_start
                    .get(&(v6, start))
                    .filter(|b| b.prefix_len() == *len)
                    .copied()
            })
    }

    /// Adds `cidr`, which must overlap none of the index.
    pub fn insert(&mut self, cidr: IpNet) {
        let (v6, first, _) = span(&cidr);
        self.by_start.insert((v6, first), cidr);
        *self.lengths.entry((v6, cidr.prefix_len())).or_default() += 1;
    }

    /// Takes `cidr` out (nothing when it is not in).
    pub fn remove(&mut self, cidr: &IpNet) {
        let (v6, first, _) = span(cidr);
        if self.by_start.get(&(v6, first)) != Some(cidr) {
            return;
        }
        self.by_start.remove(&(v6, first));
        let len = (v6, cidr.prefix_len());
        if let Some(n) = self.lengths.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&len);
            }
        }
    }
}

/// The blocks taken so far by [`arbitrate`], with their creation stamps.
#[derive(Default)]
struct Taken {
    index: Index,
    created: BTreeMap<IpNet, i64>,
}

impl Taken {
    fn overlapping(&self, cidr: &IpNet) -> Option<IpNet> {
        self.index.overlapping(cidr)
    }

    fn insert(&mut self, cidr: IpNet, created: i64) {
        self.index.insert(cidr);
        self.created.insert(cidr, created);
    }
}

/// (IPv6, first address, last address) of a network, as numbers.
fn span(n: &IpNet) -> (bool, u128, u128) {
    match n {
        IpNet::V4(n) => (
            false,
            u128::from(u32::from(n.network())),
            u128::from(u32::from(n.broadcast())),
        ),
        IpNet::V6(n) => (true, u128::from(n.network()), u128::from(n.broadcast())),
    }
}

/// Addresses in `net`, saturating at `u64::MAX`.
fn host_count(net: &IpNet) -> u64 {
    let bits = u32::from(net.max_prefix_len() - net.prefix_len());
    1u64.checked_shl(bits).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
