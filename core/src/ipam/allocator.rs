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

use super::*;

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

#[cfg(test)]
mod tests;
