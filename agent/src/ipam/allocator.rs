//! The pure IPAM allocator: no I/O. [`IpamState`] is a view of the datastore's blocks; the
//! agent calls [`IpamState::allocate`] / [`IpamState::release_address`], which change ONE block
//! in place and say which, and commits that block alone with compare-and-swap on the revision it
//! was read at ([`Block::revision`]; 0 = a block never stored, created only if absent). The
//! block is the truth: each allocation in it carries its handle, ifname, node, sequence number
//! and attributes; handle records ([`HandleRecord`]) are an index that follows.
//!
//! Pools are carved into blocks of `blockSize`; a block has an affinity to exactly one node
//! (whoever claimed it). A node allocates from its own blocks, then claims a new block (up to
//! `maxBlocksPerNode`), then — unless `strictAffinity` — borrows a free address from another
//! node's block. A block released to its pool stays stored, affine to nobody and empty, with
//! its next sequence number ([`Block::is_released`], kept in [`IpamState::retired`]): claiming
//! it again is a compare-and-swap on that object, so its sequence numbers never repeat.
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

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
    BadBlock { block: IpNet, why: String },
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
        (0..self.size().min(super::wellformed::MAX_BLOCK_ADDRESSES))
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

/// The blocks this agent knows, keyed by CIDR text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpamState {
    /// Claimed blocks.
    pub blocks: BTreeMap<String, Block>,
    /// Released blocks, keyed by CIDR text; a claim moves the entry back to `blocks`.
    pub retired: BTreeMap<String, Retired>,
    /// The datastore revision of the last read (or, higher, of a later write). Every sequence
    /// number a block's earlier life handed out is at most the revision its release was
    /// written at, so a new block starts above this.
    pub revision: i64,
    /// Stored blocks that do not count but hold addresses (`wellformed::Sorted::avoid`): no
    /// claim overlaps them.
    pub avoid: Vec<IpNet>,
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

impl IpamState {
    /// Replaces the view with the block objects (released ones included) and the previous
    /// version's retired records, freshly read from the datastore at `revision`.
    pub fn replace(
        &mut self,
        blocks: impl IntoIterator<Item = Block>,
        legacy_retired: impl IntoIterator<Item = Retired>,
        revision: i64,
    ) {
        self.blocks.clear();
        self.retired.clear();
        for b in blocks {
            self.put_block(b);
        }
        for r in legacy_retired {
            let key = r.cidr.to_string();
            if self.blocks.contains_key(&key) {
                continue;
            }
            let entry = self
                .retired
                .entry(key)
                .or_insert(Retired { revision: 0, ..r });
            entry.next_seq = entry.next_seq.max(r.next_seq);
        }
        self.revision = revision;
    }

    /// Puts a block object read (or written) at `b.revision` into the view: a released one
    /// among the retired, any other among the blocks.
    pub fn put_block(&mut self, b: Block) {
        let key = b.cidr.to_string();
        if b.is_released() {
            self.blocks.remove(&key);
            let next_seq = self.retired.get(&key).map_or(0, |r| r.next_seq);
            self.retired.insert(
                key,
                Retired {
                    cidr: b.cidr,
                    next_seq: b.next_seq.max(next_seq),
                    revision: b.revision,
                },
            );
        } else {
            self.retired.remove(&key);
            self.blocks.insert(key, b);
        }
    }

    /// A block for `node` to claim. A released block continues its own sequence numbers, and
    /// is compared on its object's revision. A block never stored (compared absent) starts above
    /// the revision of the view, which the agent lists afresh before such a claim: every
    /// allocation is a write of its own, so an earlier life of the CIDR (deleted by an agent of
    /// the previous version, by hand, or because its pool's layout changed) handed out sequence
    /// numbers no higher than the revision it was deleted at.
    fn fresh_block(&self, cidr: IpNet, node: &str) -> Block {
        let mut b = Block::new(cidr, node);
        let retired = self.retired.get(&cidr.to_string());
        let above_revision = u64::try_from(self.revision).unwrap_or(0).saturating_add(1);
        b.next_seq = retired.map_or(1, |r| r.next_seq).max(above_revision);
        b.revision = retired.map_or(0, |r| r.revision);
        b
    }

    /// The block containing `addr`.
    pub fn block_of(&self, addr: IpAddr) -> Option<&Block> {
        self.blocks.values().find(|b| b.cidr.contains(&addr))
    }

    /// Allocates one address of the family `v4` for (handle, ifname) on `node`.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate(
        &mut self,
        pools: &[Pool],
        policy: &Policy,
        node: &str,
        handle: &str,
        ifname: &str,
        v4: bool,
        attributes: &BTreeMap<String, String>,
    ) -> Result<Allocated, IpamError> {
        let family = family_name(v4);
        let usable: Vec<&Pool> = pools
            .iter()
            .filter(|p| p.cidr.addr().is_ipv4() == v4 && !p.disabled)
            .collect();
        if usable.is_empty() {
            return Err(IpamError::NoPool { family });
        }
        let mut why = String::new();
        // 1. Our own blocks, pool by pool.
        for pool in &usable {
            let own = self.blocks.iter().find(|(_, b)| {
                b.affinity == node
                    && pool.cidr.contains(&b.cidr.addr())
                    && b.free_offset(&pool.cidr).is_some()
            });
            if let Some((key, _)) = own {
                let key = key.clone();
                return Ok(self.take_in(&key, pool, node, handle, ifname, attributes, false));
            }
        }
        // 2. Claim a new block.
        let owned = self.blocks.values().filter(|b| b.affinity == node).count();
        if owned < policy.max_blocks_per_node {
            for pool in &usable {
                if let Some(key) = self.claim_block(pool, node) {
                    return Ok(self.take_in(&key, pool, node, handle, ifname, attributes, false));
                }
            }
        } else {
            why = format!(
                " and this node holds maxBlocksPerNode={} blocks",
                policy.max_blocks_per_node
            );
        }
        // 3. Borrow from another node's block.
        if policy.strict_affinity {
            why.push_str(" (strictAffinity: no borrowing from other nodes' blocks)");
        } else {
            for pool in &usable {
                let other = self.blocks.iter().find(|(_, b)| {
                    b.affinity != node
                        && pool.cidr.contains(&b.cidr.addr())
                        && b.free_offset(&pool.cidr).is_some()
                });
                if let Some((key, _)) = other {
                    let key = key.clone();
                    return Ok(self.take_in(&key, pool, node, handle, ifname, attributes, true));
                }
            }
        }
        Err(IpamError::Exhausted {
            family,
            pools: usable
                .iter()
                .map(|p| p.cidr.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            why,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn take_in(
        &mut self,
        key: &str,
        pool: &Pool,
        node: &str,
        handle: &str,
        ifname: &str,
        attributes: &BTreeMap<String, String>,
        borrowed: bool,
    ) -> Allocated {
        // Callers pass a key they just found or inserted, with a free offset.
        let block = self
            .blocks
            .get_mut(key)
            .expect("take_in: the caller found this block");
        let offset = block
            .free_offset(&pool.cidr)
            .expect("take_in: the caller checked for a free offset");
        let seq = block.take(offset, node, handle, ifname, attributes);
        Allocated {
            addr: block.address(offset),
            pool: pool.cidr,
            seq,
            block: key.to_string(),
            borrowed,
        }
    }

    /// Allocates exactly `addr` for (handle, ifname) on `node` (CNI runtimeConfig "ips", a
    /// pod's `calix.dev/ipAddrs`), checked like every other allocation: in an enabled pool, not
    /// one of the pool's reserved addresses, free. The block holding it is whichever block
    /// contains it, whatever block size it was made with; it must be `node`'s (no borrowing of
    /// a chosen address). When no block contains it, a new block of the pool's size is claimed,
    /// as [`IpamState::allocate`] would: not overlapping any block (of any size, released ones
    /// until they are deleted) and within `maxBlocksPerNode`. A refusal changes nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_specific(
        &mut self,
        pools: &[Pool],
        policy: &Policy,
        node: &str,
        handle: &str,
        ifname: &str,
        addr: IpAddr,
        attributes: &BTreeMap<String, String>,
    ) -> Result<Allocated, IpamError> {
        let pool = pools
            .iter()
            .find(|p| p.cidr.contains(&addr))
            .ok_or(IpamError::NotInPool { addr })?;
        if pool.disabled {
            return Err(IpamError::PoolDisabled {
                addr,
                pool: pool.cidr,
            });
        }
        if let Some(what) = reserved_kind(&pool.cidr, addr) {
            return Err(IpamError::Reserved {
                addr,
                pool: pool.cidr,
                what,
            });
        }
        let key = match self.blocks.iter().find(|(_, b)| b.cidr.contains(&addr)) {
            Some((key, block)) => {
                if block.affinity != node {
                    return Err(IpamError::ForeignBlock {
                        addr,
                        block: block.cidr,
                        owner: block.affinity.clone(),
                    });
                }
                if block
                    .allocations
                    .contains_key(&offset_in(&block.cidr, addr))
                {
                    return Err(IpamError::InUse { addr });
                }
                key.clone()
            }
            None => {
                let cidr = IpNet::new(addr, pool.block_size)
                    .map(|n| n.trunc())
                    .map_err(|_| IpamError::NotInPool { addr })?;
                self.check_claim(&cidr, policy, node, addr)?;
                let key = cidr.to_string();
                let fresh = self.fresh_block(cidr, node);
                self.blocks.insert(key.clone(), fresh);
                key
            }
        };
        let block = self
            .blocks
            .get_mut(&key)
            .expect("allocate_specific: the block was just found or inserted");
        let seq = block.take(
            offset_in(&block.cidr, addr),
            node,
            handle,
            ifname,
            attributes,
        );
        Ok(Allocated {
            addr,
            pool: pool.cidr,
            seq,
            block: key,
            borrowed: false,
        })
    }

    /// Whether `node` may claim the new block `cidr` for `addr`: it overlaps no block of the
    /// view (of any size), nor a stored released block of another layout (until housekeeping
    /// deletes it), and `node` holds fewer than `maxBlocksPerNode` blocks.
    fn check_claim(
        &self,
        cidr: &IpNet,
        policy: &Policy,
        node: &str,
        addr: IpAddr,
    ) -> Result<(), IpamError> {
        if let Some(b) = self.blocks.values().find(|b| overlap(&b.cidr, cidr)) {
            return Err(IpamError::Overlaps {
                addr,
                block: *cidr,
                other: b.cidr,
                owner: owner_text(&b.affinity),
            });
        }
        if let Some(r) = self
            .retired
            .values()
            .find(|r| r.revision != 0 && r.cidr != *cidr && overlap(&r.cidr, cidr))
        {
            return Err(IpamError::Overlaps {
                addr,
                block: *cidr,
                other: r.cidr,
                owner: "no node (released, stored until housekeeping deletes it)".into(),
            });
        }
        let owned = self.blocks.values().filter(|b| b.affinity == node).count();
        if owned >= policy.max_blocks_per_node {
            return Err(IpamError::MaxBlocks {
                addr,
                block: *cidr,
                node: node.to_string(),
                max: policy.max_blocks_per_node,
            });
        }
        Ok(())
    }

    /// Frees `addr` if it is allocated, and — when `seq` is given — only if it is still that
    /// allocation. Returns the key of the changed block and the freed allocation.
    pub fn release_address(
        &mut self,
        addr: IpAddr,
        seq: Option<u64>,
    ) -> Option<(String, Allocation)> {
        let (key, block) = self
            .blocks
            .iter_mut()
            .find(|(_, b)| b.cidr.contains(&addr))?;
        let offset = offset_in(&block.cidr, addr);
        match block.allocations.get(&offset) {
            Some(a) if seq.is_none_or(|s| s == a.seq) => {}
            _ => return None,
        }
        let gone = block.allocations.remove(&offset)?;
        Some((key.clone(), gone))
    }

    /// Addresses `node` can still hand out in the family: free addresses of its own blocks
    /// plus the unclaimed blocks of enabled pools (saturating). Borrowable addresses are not
    /// counted: STATUS reports what this node can rely on.
    pub fn free(&self, pools: &[Pool], node: &str, v4: bool) -> u64 {
        let mut free: u64 = 0;
        for pool in pools
            .iter()
            .filter(|p| !p.disabled && p.cidr.addr().is_ipv4() == v4)
        {
            let mut claimed: u64 = 0;
            for b in self
                .blocks
                .values()
                .filter(|b| pool.cidr.contains(&b.cidr.addr()))
            {
                claimed += 1;
                if b.affinity == node {
                    free = free.saturating_add(b.free_offsets(&pool.cidr).count() as u64);
                }
            }
            let bits = u32::from(pool.block_size - pool.cidr.prefix_len());
            let total_blocks: u64 = if bits >= 63 {
                u64::MAX / 2
            } else {
                1u64 << bits
            };
            let per_block =
                host_count(&IpNet::new(pool.cidr.addr(), pool.block_size).unwrap_or(pool.cidr));
            let unclaimed = total_blocks.saturating_sub(claimed);
            free = free.saturating_add(unclaimed.saturating_mul(per_block));
            // The pool's reserved addresses in blocks not claimed yet.
            for addr in reserved_addresses(&pool.cidr) {
                let block = IpNet::new(addr, pool.block_size).map(|b| b.trunc());
                if let Ok(b) = block {
                    if !self.blocks.contains_key(&b.to_string()) {
                        free = free.saturating_sub(1);
                    }
                }
            }
        }
        free
    }

    /// Every allocation made by `node` (in its own blocks or borrowed): (address, allocation).
    pub fn allocations_of<'a>(
        &'a self,
        node: &'a str,
    ) -> impl Iterator<Item = (IpAddr, &'a Allocation)> + 'a {
        self.blocks.values().flat_map(move |b| {
            b.allocations
                .iter()
                .filter(move |(_, a)| a.node == node)
                .map(move |(o, a)| (b.address(*o), a))
        })
    }

    fn claim_block(&mut self, pool: &Pool, node: &str) -> Option<String> {
        let subnets = pool.cidr.subnets(pool.block_size).ok()?;
        // A block overlapping any known block (possibly of another pool layout) is not free,
        // nor is one overlapping another layout's released block until that one is deleted.
        // A block made only of the pool's reserved addresses (a /32 block on the pool's
        // network or broadcast address) has nothing to hand out and is never claimed.
        let cidr = subnets.into_iter().find(|s| {
            has_usable(&pool.cidr, s)
                && !self.blocks.values().any(|b| overlap(&b.cidr, s))
                && !self.avoid.iter().any(|a| overlap(a, s))
                && !self
                    .retired
                    .values()
                    .any(|r| r.revision != 0 && r.cidr != *s && overlap(&r.cidr, s))
        })?;
        let key = cidr.to_string();
        let fresh = self.fresh_block(cidr, node);
        self.blocks.insert(key.clone(), fresh);
        Some(key)
    }

    /// Number of addresses in use.
    pub fn in_use(&self) -> usize {
        self.blocks.values().map(|b| b.allocations.len()).sum()
    }

    /// Every allocation of (handle, ifname), whatever node made it: (block key, address,
    /// allocation), IPv4 first, in address order.
    pub fn held_by<'a>(
        &'a self,
        handle: &str,
        ifname: &str,
    ) -> Vec<(&'a str, IpAddr, &'a Allocation)> {
        let mut held: Vec<(&str, IpAddr, &Allocation)> = self
            .blocks
            .iter()
            .flat_map(|(key, b)| {
                b.allocations
                    .iter()
                    .filter(|(_, a)| a.handle == handle && a.ifname == ifname)
                    .map(move |(o, a)| (key.as_str(), b.address(*o), a))
            })
            .collect();
        held.sort_by_key(|(_, addr, _)| (addr.is_ipv6(), *addr));
        held
    }
}

/// Whether two networks share an address.
pub fn overlap(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn pool(cidr: &str, bs: u8) -> Pool {
        Pool {
            cidr: cidr.parse().expect("cidr"),
            block_size: bs,
            disabled: false,
            restricted: false,
            previous_block_sizes: Vec::new(),
        }
    }

    fn alloc_on(
        s: &mut IpamState,
        pools: &[Pool],
        policy: &Policy,
        node: &str,
        h: &str,
    ) -> Result<Allocated, IpamError> {
        s.allocate(pools, policy, node, h, "eth0", true, &BTreeMap::new())
    }

    fn alloc(s: &mut IpamState, pools: &[Pool], h: &str) -> Result<IpAddr, IpamError> {
        alloc_on(s, pools, &Policy::default(), "n1", h).map(|a| a.addr)
    }

    #[test]
    fn fills_own_block_then_claims_next_then_exhausts() {
        let pools = [pool("10.1.0.0/27", 28)]; // two blocks of 16, minus .0 and .31
        let mut s = IpamState::default();
        let mut seen = HashSet::new();
        for i in 0..30 {
            let a = alloc(&mut s, &pools, &format!("h{i}")).expect("alloc");
            assert!(seen.insert(a), "duplicate {a}");
            assert!(pools[0].cidr.contains(&a));
        }
        assert_eq!(s.blocks.len(), 2);
        assert!(s.blocks.values().all(|b| b.affinity == "n1"));
        assert!(!seen.contains(&"10.1.0.0".parse::<IpAddr>().expect("ip")));
        assert!(!seen.contains(&"10.1.0.31".parse::<IpAddr>().expect("ip")));
        let err = alloc(&mut s, &pools, "h30").expect_err("full");
        assert!(matches!(err, IpamError::Exhausted { family: "IPv4", .. }));
        assert!(err.to_string().contains("10.1.0.0/27"), "{err}");
    }

    #[test]
    fn single_address_blocks_skip_the_pools_reserved_addresses() {
        // blockSize 32: the blocks on .0 and .3 (network, broadcast) hold nothing usable.
        let pools = [pool("10.1.0.0/30", 32)];
        let mut s = IpamState::default();
        let a = alloc(&mut s, &pools, "h0").expect("first");
        let b = alloc(&mut s, &pools, "h1").expect("second");
        assert_eq!(a, "10.1.0.1".parse::<IpAddr>().expect("ip"));
        assert_eq!(b, "10.1.0.2".parse::<IpAddr>().expect("ip"));
        let err = alloc(&mut s, &pools, "h2").expect_err("full");
        assert!(matches!(err, IpamError::Exhausted { .. }), "{err}");
        assert_eq!(s.blocks.len(), 2, "no empty unusable block claimed");
        // A /32 pool has one address, which is both its network and broadcast address.
        let mut s = IpamState::default();
        let one = [pool("10.9.0.7/32", 32)];
        assert!(matches!(
            alloc(&mut s, &one, "h0"),
            Err(IpamError::Exhausted { .. })
        ));
        // IPv6: the pool's first address (Subnet-Router anycast) is reserved, the last is not.
        let v6 = [pool("fd00::/127", 128)];
        let mut s = IpamState::default();
        let mut take = |h: &str| {
            s.allocate(
                &v6,
                &Policy::default(),
                "n1",
                h,
                "eth0",
                false,
                &BTreeMap::new(),
            )
        };
        let got = take("h0").expect("v6");
        assert_eq!(got.addr, "fd00::1".parse::<IpAddr>().expect("ip"));
        assert!(matches!(take("h1"), Err(IpamError::Exhausted { .. })));
    }

    #[test]
    fn claims_its_own_block_beside_another_nodes() {
        let pools = [pool("10.1.0.0/27", 28)];
        let mut s = IpamState::default();
        let p = Policy::default();
        let a = alloc_on(&mut s, &pools, &p, "other", "h0").expect("other");
        let b = alloc_on(&mut s, &pools, &p, "n1", "h1").expect("mine");
        assert_ne!(a.block, b.block);
        assert_eq!(s.blocks[&a.block].affinity, "other");
        assert_eq!(s.blocks[&b.block].affinity, "n1");
        assert!(!b.borrowed);
    }

    #[test]
    fn borrows_when_no_block_is_left_unless_strict() {
        // One block only: node A claims it; B must borrow.
        let pools = [pool("10.1.0.0/28", 28)];
        let mut s = IpamState::default();
        let p = Policy::default();
        alloc_on(&mut s, &pools, &p, "a", "h0").expect("a");
        let strict = Policy {
            strict_affinity: true,
            ..p
        };
        let err = alloc_on(&mut s, &pools, &strict, "b", "h1").expect_err("strict");
        assert!(err.to_string().contains("strictAffinity"), "{err}");
        let got = alloc_on(&mut s, &pools, &p, "b", "h1").expect("borrow");
        assert!(got.borrowed);
        let block = &s.blocks[&got.block];
        assert_eq!(block.affinity, "a");
        assert_eq!(
            block.allocations[&block.offset_of(got.addr).expect("in")].node,
            "b"
        );
        assert_eq!(s.allocations_of("b").count(), 1);
        assert_eq!(s.allocations_of("a").count(), 1);
    }

    #[test]
    fn max_blocks_per_node_then_borrow() {
        let pools = [pool("10.1.0.0/26", 30)]; // 16 blocks of 4 (first has .0 reserved)
        let mut s = IpamState::default();
        let p = Policy {
            strict_affinity: false,
            max_blocks_per_node: 1,
        };
        alloc_on(&mut s, &pools, &p, "b", "x").expect("b's block");
        for i in 0..4 {
            alloc_on(&mut s, &pools, &p, "a", &format!("h{i}")).expect("own block");
        }
        let next = alloc_on(&mut s, &pools, &p, "a", "h4").expect("borrowed");
        assert!(next.borrowed);
        assert_eq!(s.blocks.values().filter(|b| b.affinity == "a").count(), 1);
        let strict = Policy {
            strict_affinity: true,
            ..p
        };
        let err = alloc_on(&mut s, &pools, &strict, "a", "h5").expect_err("limit");
        assert!(err.to_string().contains("maxBlocksPerNode=1"), "{err}");
    }

    #[test]
    fn release_checks_the_sequence_number() {
        let pools = [pool("10.1.0.0/29", 30)];
        let mut s = IpamState::default();
        let p = Policy::default();
        let first = alloc_on(&mut s, &pools, &p, "n1", "h1").expect("h1");
        assert!(s.release_address(first.addr, Some(first.seq)).is_some());
        // Released twice: nothing.
        assert!(s.release_address(first.addr, Some(first.seq)).is_none());
        let again = alloc_on(&mut s, &pools, &p, "n1", "h2").expect("h2");
        assert_eq!(again.addr, first.addr);
        assert!(again.seq > first.seq);
        // A late release of the old allocation cannot free the new one.
        assert!(s.release_address(first.addr, Some(first.seq)).is_none());
        assert_eq!(s.in_use(), 1);
        let (_, gone) = s
            .release_address(again.addr, None)
            .expect("unconditional release");
        assert_eq!(gone.handle, "h2");
    }

    #[test]
    fn specific_addresses() {
        let pools = [pool("10.1.0.0/24", 28)];
        let mut s = IpamState::default();
        let want: IpAddr = "10.1.0.77".parse().expect("ip");
        let none = BTreeMap::new();
        let got = s
            .allocate_specific(&pools, &Policy::default(), "n1", "h", "eth0", want, &none)
            .expect("specific");
        assert_eq!((got.addr, got.block.as_str()), (want, "10.1.0.64/28"));
        assert_eq!(
            s.allocate_specific(&pools, &Policy::default(), "n1", "h2", "eth0", want, &none),
            Err(IpamError::InUse { addr: want })
        );
        let other: IpAddr = "10.1.0.78".parse().expect("ip");
        assert!(matches!(
            s.allocate_specific(&pools, &Policy::default(), "n2", "h3", "eth0", other, &none),
            Err(IpamError::ForeignBlock { .. })
        ));
        assert!(matches!(
            s.allocate_specific(
                &pools,
                &Policy::default(),
                "n1",
                "h4",
                "eth0",
                "10.2.0.1".parse().expect("ip"),
                &none
            ),
            Err(IpamError::NotInPool { .. })
        ));
    }

    /// `allocate_specific`'s refusal of `addr` for `node`: its message; the view unchanged.
    fn refused(
        s: &mut IpamState,
        pools: &[Pool],
        policy: &Policy,
        node: &str,
        addr: &str,
    ) -> String {
        let before = s.clone();
        let addr: IpAddr = addr.parse().expect("ip");
        let e = s
            .allocate_specific(pools, policy, node, "fixed", "eth0", addr, &BTreeMap::new())
            .map(|a| format!("{a:?}"))
            .expect_err(&format!("{addr} refused"));
        assert_eq!(*s, before, "a refusal of {addr} changes nothing: {e}");
        e.to_string()
    }

    #[test]
    fn a_fixed_address_never_lands_in_two_blocks_of_different_block_sizes() {
        let p = Policy::default();
        let old = [pool("10.1.0.0/24", 26)];
        let mut s = IpamState::default();
        // n1's block of the old size 26 holds 10.1.0.1-3.
        for h in ["a", "b", "c"] {
            alloc_on(&mut s, &old, &p, "n1", h).expect("old layout");
        }
        // n2's block 10.1.0.64/26, of the old size too.
        alloc_on(&mut s, &old, &p, "n2", "d").expect("n2");
        // A released block of the old layout, stored (revision 7): 10.1.0.128/26.
        let mut released = Block::new("10.1.0.128/26".parse().expect("cidr"), "");
        released.revision = 7;
        s.put_block(released);
        let new = [pool("10.1.0.0/24", 28)];
        let msg = refused(&mut s, &new, &p, "n1", "10.1.0.2");
        assert!(msg.contains("10.1.0.2") && msg.contains("in use"), "{msg}");
        let msg = refused(&mut s, &new, &p, "n1", "10.1.0.70");
        assert!(
            msg.contains("10.1.0.70")
                && msg.contains("block 10.1.0.64/26")
                && msg.contains("node n2"),
            "{msg}"
        );
        let msg = refused(&mut s, &new, &p, "n1", "10.1.0.130");
        assert!(msg.contains("10.1.0.128/26"), "{msg}");
        // The other way round: n2 holds 10.1.0.208/28 of the new size; back at size 26, a
        // new block for 10.1.0.195 would be 10.1.0.192/26, which contains it.
        let mut s2 = s.clone();
        let taken = s2
            .allocate_specific(
                &new,
                &p,
                "n2",
                "e",
                "eth0",
                "10.1.0.210".parse().expect("ip"),
                &BTreeMap::new(),
            )
            .expect("n2's new block");
        assert_eq!(taken.block, "10.1.0.208/28");
        let msg = refused(&mut s2, &old, &p, "n1", "10.1.0.195");
        assert!(
            msg.contains("10.1.0.192/26")
                && msg.contains("10.1.0.208/28")
                && msg.contains("node n2"),
            "{msg}"
        );
        // n1's own old block takes a fixed address beside its others.
        let got = s
            .allocate_specific(
                &new,
                &p,
                "n1",
                "f",
                "eth0",
                "10.1.0.9".parse().expect("ip"),
                &BTreeMap::new(),
            )
            .expect("n1's own old block");
        assert_eq!(got.block, "10.1.0.0/26");
        assert_eq!(
            s.blocks.len(),
            2,
            "no block of the new size beside it: {:?}",
            s.blocks.keys()
        );
    }

    #[test]
    fn a_fixed_address_is_never_a_reserved_one_nor_beyond_max_blocks_per_node() {
        let p = Policy::default();
        let pools = [pool("10.1.0.0/24", 26), pool("fd00::/120", 122)];
        let mut s = IpamState::default();
        let msg = refused(&mut s, &pools, &p, "n1", "10.1.0.0");
        assert!(
            msg.contains("network address") && msg.contains("10.1.0.0/24"),
            "{msg}"
        );
        let msg = refused(&mut s, &pools, &p, "n1", "10.1.0.255");
        assert!(
            msg.contains("broadcast address") && msg.contains("10.1.0.0/24"),
            "{msg}"
        );
        let msg = refused(&mut s, &pools, &p, "n1", "fd00::");
        assert!(
            msg.contains("Subnet-Router anycast") && msg.contains("fd00::/120"),
            "{msg}"
        );
        // Inside a block already claimed, too.
        alloc(&mut s, &pools, "a").expect("10.1.0.1");
        let msg = refused(&mut s, &pools, &p, "n1", "10.1.0.0");
        assert!(msg.contains("network address"), "{msg}");
        let one = Policy {
            max_blocks_per_node: 1,
            ..p
        };
        let msg = refused(&mut s, &pools, &one, "n1", "10.1.0.200");
        assert!(
            msg.contains("maxBlocksPerNode=1")
                && msg.contains("node n1")
                && msg.contains("10.1.0.192/26"),
            "{msg}"
        );
        // In a block the node holds, the limit does not matter.
        s.allocate_specific(
            &pools,
            &one,
            "n1",
            "b",
            "eth0",
            "10.1.0.9".parse().expect("ip"),
            &BTreeMap::new(),
        )
        .expect("in n1's block");
    }

    #[test]
    fn a_pool_choice_disables_the_pools_an_allocation_may_not_use() {
        let cidr = |s: &str| s.parse::<IpNet>().expect("cidr");
        let mut tenant = pool("10.2.0.0/24", 28);
        tenant.restricted = true;
        let pools = vec![pool("10.1.0.0/24", 28), tenant, pool("fd00::/120", 122)];
        let enabled = |c: &PoolChoice, v4: bool| -> Vec<String> {
            c.apply(pools.clone(), v4)
                .into_iter()
                .filter(|p| !p.disabled)
                .map(|p| p.cidr.to_string())
                .collect()
        };
        // No choice: never a restricted pool; the other family untouched.
        let none = PoolChoice::default();
        assert_eq!(enabled(&none, true), ["10.1.0.0/24", "fd00::/120"]);
        // The namespace may use the restricted pool only.
        let only = PoolChoice {
            v4: Some(vec![cidr("10.2.0.0/24")]),
            v6: Some(vec![]),
        };
        assert_eq!(enabled(&only, true), ["10.2.0.0/24", "fd00::/120"]);
        assert_eq!(enabled(&only, false), ["10.1.0.0/24", "10.2.0.0/24"]);
        let mut s = IpamState::default();
        let p = Policy::default();
        let got = s
            .allocate(
                &only.apply(pools.clone(), true),
                &p,
                "n1",
                "h",
                "eth0",
                true,
                &BTreeMap::new(),
            )
            .expect("from the tenant's pool");
        assert_eq!(got.pool, cidr("10.2.0.0/24"));
        assert_eq!(
            s.allocate(
                &only.apply(pools.clone(), false),
                &p,
                "n1",
                "h",
                "eth0",
                false,
                &BTreeMap::new()
            ),
            Err(IpamError::NoPool { family: "IPv6" })
        );
        // A fixed address in the restricted pool, without a choice naming it: refused.
        let msg = refused(
            &mut s,
            &none.apply(pools.clone(), true),
            &p,
            "n1",
            "10.2.0.99",
        );
        assert!(
            msg.contains("10.2.0.0/24") && msg.contains("no addresses here"),
            "{msg}"
        );
    }

    #[test]
    fn free_counts_own_blocks_and_unclaimed() {
        let pools = [pool("10.1.0.0/27", 28)];
        let mut s = IpamState::default();
        let p = Policy::default();
        assert_eq!(s.free(&pools, "n1", true), 30);
        alloc(&mut s, &pools, "a").expect("a");
        assert_eq!(s.free(&pools, "n1", true), 29);
        // Another node's block is not free for n1.
        alloc_on(&mut s, &pools, &p, "n2", "b").expect("b");
        assert_eq!(s.free(&pools, "n1", true), 14);
        assert_eq!(s.free(&pools, "n1", false), 0);
    }

    #[test]
    fn families_and_disabled_pools() {
        let mut pools = vec![pool("10.1.0.0/24", 26), pool("fd00::/120", 122)];
        let mut s = IpamState::default();
        let v6 = s
            .allocate(
                &pools,
                &Policy::default(),
                "n1",
                "h",
                "eth0",
                false,
                &BTreeMap::new(),
            )
            .expect("v6")
            .addr;
        assert_eq!(
            v6,
            "fd00::1".parse::<IpAddr>().expect("ip"),
            "fd00:: is reserved"
        );
        pools[0].disabled = true;
        assert_eq!(
            alloc(&mut s, &pools, "h"),
            Err(IpamError::NoPool { family: "IPv4" })
        );
    }

    #[test]
    fn claim_skips_blocks_overlapping_a_known_one() {
        // A block from an older, larger blockSize covers several of the new layout's blocks.
        let pools = [pool("10.1.0.0/24", 28)];
        let mut s = IpamState::default();
        s.replace(
            [Block::new("10.1.0.0/26".parse().expect("cidr"), "old")],
            [],
            0,
        );
        let got = alloc_on(
            &mut s,
            &pools,
            &Policy {
                strict_affinity: true,
                ..Policy::default()
            },
            "n1",
            "h",
        )
        .expect("alloc");
        assert_eq!(got.block, "10.1.0.64/28");
    }
}
