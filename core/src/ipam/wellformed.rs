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
use crate::store::{keys, KeyValue};

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
    pub block: Result<Block, String>,
}

impl Item {
    /// A stored key-value, decoded.
    pub fn of(kv: &KeyValue) -> Self {
        Self {
            key: kv.key.clone(),
            created: kv.created,
            block: kv
                .decode::<Block>()
                .map(|mut b| {
                    b.revision = kv.revision;
                    b
                })
                .map_err(|e| e.to_string()),
        }
    }
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
            Err(detail) => {
                out.ignored
                    .push(undecodable(item.key.clone(), detail.clone()));
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
mod tests {
    use super::*;
    use crate::ipam::Allocation;

    fn pool(cidr: &str, bs: u8, previous: &[u8]) -> Pool {
        Pool {
            cidr: cidr.parse().expect("cidr"),
            block_size: bs,
            disabled: false,
            previous_block_sizes: previous.to_vec(),
            restricted: false,
        }
    }

    fn pools() -> Vec<Pool> {
        vec![
            pool("10.244.0.0/16", 26, &[24, 28]),
            pool("fd00:10::/112", 122, &[]),
            pool("fd00:20::/48", 122, &[]),
        ]
    }

    /// A stored block: `cidr` affine to `node` with one allocation per offset, created at
    /// `created`.
    fn kv(cidr: &str, node: &str, offsets: &[u32], created: i64) -> KeyValue {
        let cidr: IpNet = cidr.parse().expect("cidr");
        let mut b = Block::new(cidr, node);
        for o in offsets {
            b.allocations.insert(
                *o,
                Allocation {
                    handle: format!("h{o}"),
                    ifname: "eth0".into(),
                    node: node.into(),
                    seq: u64::from(*o) + 1,
                    attributes: Default::default(),
                },
            );
        }
        KeyValue {
            key: keys::block(&cidr),
            value: serde_json::to_vec(&b).expect("json"),
            revision: created + 100,
            created,
        }
    }

    fn counted(s: &Sorted) -> Vec<String> {
        s.counted.iter().map(|b| b.cidr.to_string()).collect()
    }

    fn rule_of(s: &Sorted, key_cidr: &str) -> Option<Rule> {
        let key = keys::block(&key_cidr.parse().expect("cidr"));
        s.ignored.iter().find(|i| i.key == key).map(|i| i.rule)
    }

    #[test]
    fn blocks_the_pools_make_count() {
        let s = sort(
            &[
                kv("10.244.0.0/26", "a", &[1], 1),
                kv("10.244.1.0/24", "b", &[], 2),
                kv("10.244.2.16/28", "c", &[3], 3),
                kv("fd00:10::40/122", "a", &[], 4),
            ],
            &pools(),
        );
        assert_eq!(
            counted(&s),
            [
                "10.244.0.0/26",
                "10.244.1.0/24",
                "10.244.2.16/28",
                "fd00:10::40/122"
            ]
        );
        assert!(s.ignored.is_empty() && s.avoid.is_empty(), "{s:?}");
        assert_eq!(s.counted[0].revision, 101);
    }

    #[test]
    fn every_rule_names_what_it_caught() {
        let mut bad_json = kv("10.244.3.0/26", "a", &[], 1);
        bad_json.value = b"{\"cidr\": \"10.244.3.0/26\", \"affinity\": 7".to_vec();
        let mut bad_cidr = kv("10.244.4.0/26", "a", &[], 1);
        bad_cidr.value =
            br#"{"cidr":"nonsense","affinity":"a","allocations":{},"next_seq":1}"#.to_vec();
        let mut bad_offset = kv("10.244.5.0/26", "a", &[], 1);
        bad_offset.value =
            br#"{"cidr":"10.244.5.0/26","affinity":"a","allocations":{"x":{}},"next_seq":1}"#
                .to_vec();
        // The object says 0.0.0.0/0 under a /26's key.
        let mut lying = kv("0.0.0.0/0", "rogue", &[], 1);
        lying.key = keys::block(&"10.244.6.0/26".parse().expect("cidr"));
        let mut misaligned = kv("10.244.7.0/26", "a", &[], 1);
        misaligned.value =
            br#"{"cidr":"10.244.7.5/26","affinity":"a","allocations":{},"next_seq":1}"#.to_vec();
        misaligned.key = "ipam/blocks/10.244.7.5-26".into();
        let cases = [
            bad_json,
            bad_cidr,
            bad_offset,
            lying,
            misaligned,
            kv("0.0.0.0/0", "rogue", &[], 1),
            kv("10.244.7.9/32", "rogue", &[], 1),
            kv("10.245.0.0/26", "a", &[], 1),
            kv("10.244.8.0/26", "a", &[64], 1),
            kv("fd00:10::/64", "a", &[], 1),
            kv("fd00:20::/64", "a", &[], 1),
        ];
        let s = sort(&cases, &pools());
        assert!(s.counted.is_empty(), "{:?}", counted(&s));
        let rules: Vec<(String, Rule)> =
            s.ignored.iter().map(|i| (i.key.clone(), i.rule)).collect();
        let want = |cidr: &str, r: Rule| (keys::block(&cidr.parse().expect("cidr")), r);
        for w in [
            want("10.244.3.0/26", Rule::Undecodable),
            want("10.244.4.0/26", Rule::Undecodable),
            want("10.244.5.0/26", Rule::Undecodable),
            want("10.244.6.0/26", Rule::KeyMismatch),
            ("ipam/blocks/10.244.7.5-26".into(), Rule::NotAligned),
            want("0.0.0.0/0", Rule::OutsidePools),
            want("10.244.7.9/32", Rule::BlockSize),
            want("10.245.0.0/26", Rule::OutsidePools),
            want("10.244.8.0/26", Rule::AllocationOutside),
            // A /64 inside a /112 pool: not inside it at all.
            want("fd00:10::/64", Rule::OutsidePools),
            // An edited /64 "block" inside a /48 pool of /122s.
            want("fd00:20::/64", Rule::BlockSize),
        ] {
            assert!(rules.contains(&w), "{w:?} not in {rules:?}");
        }
        let forged = s
            .ignored
            .iter()
            .find(|i| i.rule == Rule::BlockSize)
            .expect("the /32");
        assert_eq!(forged.affinity, "rogue");
        assert!(forged.detail.contains("/26, /24, /28"), "{}", forged.detail);
        let names: std::collections::HashSet<_> = Rule::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Rule::ALL.len());
    }

    #[test]
    fn an_overlap_is_won_by_the_older_block() {
        // A victim's current-size block, then a rogue's older-size /24 over it.
        let s = sort(
            &[
                kv("10.244.0.64/26", "victim", &[1], 10),
                kv("10.244.0.0/24", "rogue", &[1, 2], 20),
            ],
            &pools(),
        );
        assert_eq!(counted(&s), ["10.244.0.64/26"]);
        assert_eq!(rule_of(&s, "10.244.0.0/24"), Some(Rule::Overlap));
        // The loser holds allocations: claims keep clear of it.
        assert_eq!(s.avoid, ["10.244.0.0/24".parse::<IpNet>().expect("cidr")]);
        // A victim's /24 of the old layout, then a rogue's current-size /26 inside it.
        let s = sort(
            &[
                kv("10.244.0.0/24", "victim", &[1, 200], 10),
                kv("10.244.0.192/26", "rogue", &[], 20),
                kv("10.244.0.192/28", "rogue", &[], 21),
            ],
            &pools(),
        );
        assert_eq!(counted(&s), ["10.244.0.0/24"]);
        assert_eq!(rule_of(&s, "10.244.0.192/26"), Some(Rule::Overlap));
        assert_eq!(rule_of(&s, "10.244.0.192/28"), Some(Rule::Overlap));
        assert!(
            s.avoid.is_empty(),
            "empty losers hold nothing: {:?}",
            s.avoid
        );
    }

    #[test]
    fn a_rogue_cannot_win_an_overlap_created_in_the_same_second() {
        // Kubernetes stamps to the second: the rogue's block of an old size, made in the same
        // second as the victim's claim of the current size, loses whichever it contains or
        // sits in.
        for rogue in ["10.244.0.0/24", "10.244.0.64/28"] {
            let s = sort(
                &[
                    kv(rogue, "rogue", &[1], 5),
                    kv("10.244.0.64/26", "victim", &[1], 5),
                ],
                &pools(),
            );
            assert_eq!(counted(&s), ["10.244.0.64/26"], "rogue {rogue}");
            assert_eq!(rule_of(&s, rogue), Some(Rule::Overlap));
        }
        // Equal age and neither of the current size: the smaller wins, on every node alike.
        let s = sort(
            &[
                kv("10.244.0.0/24", "x", &[], 5),
                kv("10.244.0.16/28", "y", &[], 5),
            ],
            &pools(),
        );
        assert_eq!(counted(&s), ["10.244.0.16/28"]);
    }

    #[test]
    fn chains_and_many_blocks_resolve_in_one_pass() {
        // /24 ⊃ /26 ⊃ /28, youngest first in the listing: the oldest (/28) wins and both
        // others lose, as does a fourth block inside the /26 only.
        let s = sort(
            &[
                kv("10.244.0.0/24", "a", &[], 3),
                kv("10.244.0.0/26", "b", &[], 2),
                kv("10.244.0.0/28", "c", &[], 1),
                kv("10.244.0.48/28", "d", &[], 4),
            ],
            &pools(),
        );
        assert_eq!(counted(&s), ["10.244.0.0/28", "10.244.0.48/28"]);
        // 16,384 blocks of a /16 pool of /30s (made allowed here): every one counts. (How
        // fast is for a benchmark to say, not a test.)
        let p = [pool("10.200.0.0/16", 30, &[])];
        let kvs: Vec<KeyValue> = (0..16_384u32)
            .map(|i| {
                let a = std::net::Ipv4Addr::from(
                    u32::from(std::net::Ipv4Addr::new(10, 200, 0, 0)) + i * 4,
                );
                kv(&format!("{a}/30"), "n", &[], i64::from(i))
            })
            .collect();
        let s = sort(&kvs, &p);
        assert_eq!(s.counted.len(), 16_384);
    }

    #[test]
    fn ignored_blocks_with_addresses_in_a_pool_are_kept_clear_of() {
        // A /26 the pool made before its blockSize went to 28, not declared: ignored, but it
        // holds a pod's address, so claims keep clear of it. Forgeries outside the pools and
        // the /32 holding nothing are not in the way of anyone.
        let p = [pool("10.244.0.0/16", 28, &[])];
        let s = sort(
            &[
                kv("10.244.0.0/26", "a", &[5], 1),
                kv("0.0.0.0/0", "rogue", &[5], 1),
                kv("10.244.7.9/32", "rogue", &[], 1),
            ],
            &p,
        );
        assert!(s.counted.is_empty());
        assert_eq!(s.avoid, ["10.244.0.0/26".parse::<IpNet>().expect("cidr")]);
    }
}
