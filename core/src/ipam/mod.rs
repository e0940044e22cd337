//! IP address management's plain types and its pure allocator: no I/O. Pools ([`Pool`], as
//! written: [`pool::PoolSpec`]) are carved into blocks ([`Block`]) of `blockSize`; a block
//! has an affinity to exactly one node. The records IPAM stores (the block, the truth; the
//! handle and affinity records, indexes that follow it) are these types, as JSON.
//!
//! - [`allocator`]: the view of the blocks and every decision on it
//!   ([`allocator::IpamState`]);
//! - [`wellformed`]: the rule for blocks (which stored blocks count);
//! - [`pool`]: a pool as written (config or IPPool), and its `vxlan` mode;
//! - [`annotations`]: a pod's IPAM annotations (which pools, which fixed address).
pub mod allocator;
pub mod annotations;
pub mod pool;
pub mod wellformed;

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// Why a new block would not count (the rule for blocks, [`wellformed`]).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum NotCounted {
    /// It breaks the rule on its own: `detail` says how.
    #[error("{detail}")]
    Breaks {
        rule: wellformed::Rule,
        detail: String,
    },
    /// It overlaps a block of the view (claimed or released) or one the view keeps clear of.
    #[error("{block} overlaps block {other}")]
    Overlaps { block: IpNet, other: IpNet },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IpamError {
    #[error("requested address {addr} is not in any enabled pool for this node")]
    NotInPool { addr: IpAddr },
    #[error("requested address {addr} is already in use")]
    InUse { addr: IpAddr },
    #[error("requested address {addr} is in pool {pool}, which hands out no addresses here (disabled, not selecting this node, or not one this allocation may use)")]
    PoolDisabled { addr: IpAddr, pool: IpNet },
    #[error("requested address {addr} is the {what} of pool {pool}, which is never handed out")]
    Reserved {
        addr: IpAddr,
        pool: IpNet,
        what: &'static str,
    },
    #[error(
        "requested address {addr} lies in block {block} of {}",
        owner_text(owner)
    )]
    ForeignBlock {
        addr: IpAddr,
        block: IpNet,
        owner: String,
    },
    #[error("requested address {addr} needs a new block {block}, which would overlap block {other} of {owner}")]
    Overlaps {
        addr: IpAddr,
        block: IpNet,
        other: IpNet,
        /// "node b", or what a block affine to nobody is.
        owner: String,
    },
    #[error("requested address {addr} needs a new block {block}, but node {node} already holds maxBlocksPerNode={max} blocks")]
    MaxBlocks {
        addr: IpAddr,
        block: IpNet,
        node: String,
        max: usize,
    },
    #[error("{handle}/{ifname} already holds {held}, not the requested {addr}")]
    HeldOther {
        handle: String,
        ifname: String,
        held: IpAddr,
        addr: IpAddr,
    },
    #[error("block {block} would not count, so it is not created: {why}")]
    BadBlock { block: IpNet, why: NotCounted },
    #[error("no enabled {family} pool is configured for this node")]
    NoPool { family: &'static str },
    #[error("every {family} pool is full ({pools}){why}: add a pool or free addresses (calixctl ipam check)")]
    Exhausted {
        family: &'static str,
        pools: String,
        /// Why borrowing or claiming did not help, e.g. " (strictAffinity: no borrowing)".
        why: String,
    },
}

/// A configured pool, as the allocator needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    pub cidr: IpNet,
    pub block_size: u8,
    pub disabled: bool,
    /// Block sizes the pool had before `block_size` (the operator's `previousBlockSizes`):
    /// blocks of these sizes still count (`super::wellformed`); new blocks are `block_size`.
    pub previous_block_sizes: Vec<u8>,
    /// The pool has a `namespaceSelector`: an allocation uses it only when its
    /// [`PoolChoice`] names it (the caller has matched the pod's namespace).
    pub restricted: bool,
}

/// Which pools one allocation may use, per family: `None`, every pool of the family without a
/// namespaceSelector ([`Pool::restricted`]); `Some(cidrs)`, only those (none when empty). A
/// pod's choice comes from its namespace and annotations (`crate::k8s::annotations`); an
/// allocation that names no pod has the default, so a restricted pool serves only the pods
/// it was matched for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolChoice {
    pub v4: Option<Vec<IpNet>>,
    pub v6: Option<Vec<IpNet>>,
}

impl PoolChoice {
    /// The choice of family `v4`.
    pub fn of(&self, v4: bool) -> Option<&[IpNet]> {
        if v4 {
            self.v4.as_deref()
        } else {
            self.v6.as_deref()
        }
    }

    /// `pools` as an allocation of family `v4` under this choice sees them: every pool of the
    /// family it may not use disabled (addresses in them stay valid, none are handed out).
    pub fn apply(&self, pools: Vec<Pool>, v4: bool) -> Vec<Pool> {
        let only = self.of(v4);
        pools
            .into_iter()
            .map(|mut p| {
                if p.cidr.addr().is_ipv4() == v4 {
                    let allowed = match only {
                        Some(only) => only.contains(&p.cidr),
                        None => !p.restricted,
                    };
                    p.disabled |= !allowed;
                }
                p
            })
            .collect()
    }
}

/// How a node may grow beyond its own blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Never borrow from another node's block.
    pub strict_affinity: bool,
    /// Most blocks one node may hold an affinity for (all pools together).
    pub max_blocks_per_node: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            strict_affinity: false,
            max_blocks_per_node: 1024,
        }
    }
}

/// One allocated address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Allocation {
    pub handle: String,
    pub ifname: String,
    /// The node that allocated it (differs from the block's affinity when borrowed).
    pub node: String,
    /// Sequence number of this allocation within its block: a release naming an older
    /// sequence can never free an address that has since been handed out again.
    pub seq: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
}

/// A block of a pool, affine to one node. `allocations` is keyed by offset in the block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Block {
    #[schemars(with = "String")]
    pub cidr: IpNet,
    /// The node that claimed it; empty once released to its pool.
    pub affinity: String,
    /// (The schema says string keys: JSON object keys are strings, offsets as text.)
    #[schemars(with = "BTreeMap<String, Allocation>")]
    pub allocations: BTreeMap<u32, Allocation>,
    pub next_seq: u64,
    /// Datastore revision this copy was read at; 0 for a block not yet stored.
    #[serde(skip)]
    pub revision: i64,
}

/// A block released to its pool (empty after its grace period), as the allocator sees it: the
/// next sequence number it would have used. A later claim of the same CIDR, by any node, starts
/// there, so sequence numbers never repeat across a block's lives.
///
/// Stored as the block object itself, affine to nobody ([`Block::is_released`]). Agents of the
/// previous version deleted the block and wrote this struct at `ipam/retired/<block>` instead;
/// such a record is still honoured, and folded into a released block object by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retired {
    pub cidr: IpNet,
    pub next_seq: u64,
    /// Revision of the released block object this was read from; 0 when there is none (only
    /// a record of the previous version): a claim then creates the block, compared absent.
    #[serde(skip)]
    pub revision: i64,
}

/// What a handle holds: an index of the blocks' allocations by (handle, ifname), written after
/// the block's commit (best effort) and repaired from the blocks. Never the truth: every read by
/// handle checks it against the blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct HandleRecord {
    pub node: String,
    pub addresses: Vec<Held>,
}

/// A block's affinity to a node (Calico's BlockAffinity), one record per (node, block) at
/// `ipam/affinities/<node>/<block>`: a node's blocks are listed without reading every block.
/// Like [`HandleRecord`] an index that follows the blocks (written after the block's commit,
/// repaired from them); the block's own `affinity` is the truth.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct AffinityRecord {
    pub node: String,
    #[schemars(with = "String")]
    pub cidr: IpNet,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Held {
    #[schemars(with = "String")]
    pub addr: IpAddr,
    #[schemars(with = "String")]
    pub pool: IpNet,
    pub seq: u64,
}

/// One address handed out by [`IpamState::allocate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub addr: IpAddr,
    pub pool: IpNet,
    pub seq: u64,
    /// The block it came from (its key in [`IpamState::blocks`]).
    pub block: String,
    pub borrowed: bool,
}

impl Block {
    pub fn new(cidr: IpNet, affinity: &str) -> Self {
        Self {
            cidr,
            affinity: affinity.to_string(),
            allocations: BTreeMap::new(),
            next_seq: 1,
            revision: 0,
        }
    }

    pub fn size(&self) -> u64 {
        host_count(&self.cidr)
    }

    /// Released to its pool: affine to nobody and empty (a block affine to nobody that holds
    /// allocations, which agents of the previous version could make by borrowing, is not).
    pub fn is_released(&self) -> bool {
        self.affinity.is_empty() && self.allocations.is_empty()
    }

    /// Free offsets in address order. The pool's reserved addresses ([`reserved_addresses`])
    /// are never handed out: routing would cope (/32s), but people and some tools don't.
    /// Bounded by the largest block any pool makes: the view holds only blocks that count
    /// (`super::wellformed`), and even an edited one cannot make this walk 2^63 addresses.
    fn free_offsets<'a>(&'a self, pool: &'a IpNet) -> impl Iterator<Item = u32> + 'a {
        (0..self.size().min(wellformed::MAX_BLOCK_ADDRESSES))
            .map(|o| o as u32)
            .filter(move |o| !self.allocations.contains_key(o) && !reserved(pool, self.address(*o)))
    }

    /// The lowest free offset.
    fn free_offset(&self, pool: &IpNet) -> Option<u32> {
        self.free_offsets(pool).next()
    }

    /// Records an allocation at `offset` with the block's next sequence number.
    fn take(
        &mut self,
        offset: u32,
        node: &str,
        handle: &str,
        ifname: &str,
        attributes: &BTreeMap<String, String>,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.allocations.insert(
            offset,
            Allocation {
                handle: handle.to_string(),
                ifname: ifname.to_string(),
                node: node.to_string(),
                seq,
                attributes: attributes.clone(),
            },
        );
        seq
    }

    pub fn address(&self, offset: u32) -> IpAddr {
        nth(&self.cidr, u128::from(offset))
    }

    pub fn offset_of(&self, addr: IpAddr) -> Option<u32> {
        self.cidr
            .contains(&addr)
            .then(|| offset_in(&self.cidr, addr))
    }
}

/// Number of addresses in a network, capped so IPv6 blocks stay countable.
fn host_count(net: &IpNet) -> u64 {
    let bits = u32::from(net.max_prefix_len() - net.prefix_len());
    if bits >= 63 {
        u64::MAX / 2
    } else {
        1u64 << bits
    }
}

fn nth(net: &IpNet, n: u128) -> IpAddr {
    match net {
        IpNet::V4(v4) => IpAddr::V4((u32::from(v4.network()).wrapping_add(n as u32)).into()),
        IpNet::V6(v6) => IpAddr::V6((u128::from(v6.network()).wrapping_add(n)).into()),
    }
}

/// The addresses of `pool` never handed out: an IPv4 pool's network and broadcast addresses;
/// an IPv6 pool's first address, the Subnet-Router anycast address of its prefix (RFC 4291
/// 2.6.1).
fn reserved_addresses(pool: &IpNet) -> Vec<IpAddr> {
    let mut out = match pool {
        IpNet::V4(p) => vec![IpAddr::V4(p.network()), IpAddr::V4(p.broadcast())],
        IpNet::V6(p) => vec![IpAddr::V6(p.network())],
    };
    out.dedup();
    out
}

fn reserved(pool: &IpNet, addr: IpAddr) -> bool {
    reserved_addresses(pool).contains(&addr)
}

/// Which of `pool`'s reserved addresses `addr` is, if it is one.
fn reserved_kind(pool: &IpNet, addr: IpAddr) -> Option<&'static str> {
    match pool {
        IpNet::V4(p) if IpAddr::V4(p.network()) == addr => Some("network address"),
        IpNet::V4(p) if IpAddr::V4(p.broadcast()) == addr => Some("broadcast address"),
        IpNet::V6(p) if IpAddr::V6(p.network()) == addr => {
            Some("Subnet-Router anycast address (its first)")
        }
        _ => None,
    }
}

/// A block's affinity as a refusal names it.
fn owner_text(affinity: &str) -> String {
    if affinity.is_empty() {
        "no node".to_string()
    } else {
        format!("node {affinity}")
    }
}

/// Whether `block` holds an address that is not one of the pool's reserved ones.
fn has_usable(pool: &IpNet, block: &IpNet) -> bool {
    let reserved_here = reserved_addresses(pool)
        .into_iter()
        .filter(|a| block.contains(a))
        .count();
    host_count(block) > reserved_here as u64
}

fn offset_in(net: &IpNet, addr: IpAddr) -> u32 {
    match (net, addr) {
        (IpNet::V4(n), IpAddr::V4(a)) => u32::from(a).wrapping_sub(u32::from(n.network())),
        (IpNet::V6(n), IpAddr::V6(a)) => u128::from(a).wrapping_sub(u128::from(n.network())) as u32,
        _ => u32::MAX,
    }
}

fn family_name(v4: bool) -> &'static str {
    if v4 {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// The pool containing `addr`, if any (disabled pools too: their addresses are still valid).
pub fn pool_of(pools: &[Pool], addr: IpAddr) -> IpNet {
    pools
        .iter()
        .find(|p| p.cidr.contains(&addr))
        .map_or_else(|| IpNet::from(addr), |p| p.cidr)
}

/// Whether two networks share an address.
pub fn overlap(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}
