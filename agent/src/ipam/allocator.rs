//! The pure IPAM allocator: no I/O. The caller loads [`IpamState`] from the datastore, calls
//! [`IpamState::allocate`] / [`IpamState::release`], and commits the state back.
//!
//! Pools are carved into blocks of `blockSize`; a block has an affinity to one node. A node
//! allocates from its own blocks first, then claims the next free block of the pool.
//! Allocation is by (handle, ifname): asking again returns the same address (idempotent ADD).
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IpamError {
    #[error("requested address {addr} is not in any enabled pool")]
    NotInPool { addr: IpAddr },
    #[error("requested address {addr} is already in use")]
    InUse { addr: IpAddr },
    #[error("requested address {addr} is in block {block}, which belongs to node {owner}")]
    ForeignBlock {
        addr: IpAddr,
        block: IpNet,
        owner: String,
    },
    #[error("{handle}/{ifname} already holds {held}, not the requested {addr}")]
    HeldOther {
        handle: String,
        ifname: String,
        held: IpAddr,
        addr: IpAddr,
    },
    #[error("no {family} pool is configured for this node")]
    NoPool { family: &'static str },
    #[error(
        "every {family} pool is full ({pools}): add a pool or free addresses (calixctl endpoints)"
    )]
    Exhausted { family: &'static str, pools: String },
}

/// A configured pool, as the allocator needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    pub cidr: IpNet,
    pub block_size: u8,
    pub disabled: bool,
}

/// One allocated address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub handle: String,
    pub ifname: String,
    /// Sequence number of this allocation within its block: a release naming an older
    /// sequence can never free an address that has since been handed out again.
    pub seq: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
}

/// A block of a pool, affine to one node. `allocations` is keyed by offset in the block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    pub cidr: IpNet,
    pub affinity: String,
    pub allocations: BTreeMap<u32, Allocation>,
    pub next_seq: u64,
}

impl Block {
    fn size(&self) -> u64 {
        host_count(&self.cidr)
    }

    /// Free offsets in address order. An IPv4 pool's own network and broadcast addresses are
    /// never handed out: routing would cope (/32s), but people and some tools don't.
    fn free_offsets<'a>(&'a self, pool: &'a IpNet) -> impl Iterator<Item = u32> + 'a {
        (0..self.size())
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
        handle: &str,
        ifname: &str,
        attributes: &BTreeMap<String, String>,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.allocations.insert(
            offset,
            Allocation {
                handle: handle.to_string(),
                ifname: ifname.to_string(),
                seq,
                attributes: attributes.clone(),
            },
        );
    }

    pub fn address(&self, offset: u32) -> IpAddr {
        nth(&self.cidr, u128::from(offset))
    }
}

/// The whole IPAM state held in the datastore.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpamState {
    /// Blocks keyed by their CIDR text, in address order within each pool.
    pub blocks: BTreeMap<String, Block>,
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

/// An IPv4 pool's network or broadcast address.
fn reserved(pool: &IpNet, addr: IpAddr) -> bool {
    match pool {
        IpNet::V4(p) => addr == IpAddr::V4(p.network()) || addr == IpAddr::V4(p.broadcast()),
        IpNet::V6(_) => false,
    }
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

impl IpamState {
    /// The address already held by (handle, ifname) in the given family, if any.
    pub fn lookup(&self, handle: &str, ifname: &str, v4: bool) -> Option<IpAddr> {
        self.blocks.values().find_map(|b| {
            if b.cidr.addr().is_ipv4() != v4 {
                return None;
            }
            b.allocations
                .iter()
                .find(|(_, a)| a.handle == handle && a.ifname == ifname)
                .map(|(o, _)| b.address(*o))
        })
    }

    /// Allocates one address of the family `v4` for (handle, ifname) on `node`.
    /// Returns the address and the pool it came from.
    pub fn allocate(
        &mut self,
        pools: &[Pool],
        node: &str,
        handle: &str,
        ifname: &str,
        v4: bool,
        attributes: &BTreeMap<String, String>,
    ) -> Result<(IpAddr, IpNet), IpamError> {
        let family = family_name(v4);
        let usable: Vec<&Pool> = pools
            .iter()
            .filter(|p| p.cidr.addr().is_ipv4() == v4 && !p.disabled)
            .collect();
        if usable.is_empty() {
            return Err(IpamError::NoPool { family });
        }
        if let Some(addr) = self.lookup(handle, ifname, v4) {
            let pool = pools
                .iter()
                .find(|p| p.cidr.contains(&addr))
                .map_or_else(|| IpNet::from(addr), |p| p.cidr);
            return Ok((addr, pool));
        }
        for pool in &usable {
            // 1. Our own blocks in this pool.
            let own = self.blocks.values_mut().find(|b| {
                b.affinity == node
                    && pool.cidr.contains(&b.cidr.addr())
                    && b.free_offset(&pool.cidr).is_some()
            });
            let block = match own {
                Some(b) => b,
                // 2. Claim the pool's next unclaimed block.
                None => match self.claim_block(pool, node) {
                    Some(b) => b,
                    None => continue,
                },
            };
            let Some(offset) = block.free_offset(&pool.cidr) else {
                continue;
            };
            block.take(offset, handle, ifname, attributes);
            return Ok((block.address(offset), pool.cidr));
        }
        Err(IpamError::Exhausted {
            family,
            pools: usable
                .iter()
                .map(|p| p.cidr.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// Allocates exactly `addr` for (handle, ifname) on `node` (CNI runtimeConfig "ips").
    pub fn allocate_specific(
        &mut self,
        pools: &[Pool],
        node: &str,
        handle: &str,
        ifname: &str,
        addr: IpAddr,
        attributes: &BTreeMap<String, String>,
    ) -> Result<(IpAddr, IpNet), IpamError> {
        let pool = pools
            .iter()
            .find(|p| !p.disabled && p.cidr.contains(&addr))
            .ok_or(IpamError::NotInPool { addr })?;
        if let Some(held) = self.lookup(handle, ifname, addr.is_ipv4()) {
            if held == addr {
                return Ok((addr, pool.cidr));
            }
            return Err(IpamError::HeldOther {
                handle: handle.into(),
                ifname: ifname.into(),
                held,
                addr,
            });
        }
        let block_cidr = IpNet::new(addr, pool.block_size)
            .map(|n| n.trunc())
            .map_err(|_| IpamError::NotInPool { addr })?;
        let block = self
            .blocks
            .entry(block_cidr.to_string())
            .or_insert_with(|| Block {
                cidr: block_cidr,
                affinity: node.to_string(),
                allocations: BTreeMap::new(),
                next_seq: 1,
            });
        if block.affinity != node {
            return Err(IpamError::ForeignBlock {
                addr,
                block: block_cidr,
                owner: block.affinity.clone(),
            });
        }
        let offset = offset_in(&block.cidr, addr);
        if block.allocations.contains_key(&offset) {
            return Err(IpamError::InUse { addr });
        }
        block.take(offset, handle, ifname, attributes);
        Ok((addr, pool.cidr))
    }

    /// Every address (handle, ifname) holds, with its pool (or the address itself when no
    /// configured pool contains it any more).
    pub fn lookup_all(&self, pools: &[Pool], handle: &str, ifname: &str) -> Vec<(IpAddr, IpNet)> {
        [true, false]
            .into_iter()
            .filter_map(|v4| self.lookup(handle, ifname, v4))
            .map(|a| {
                let pool = pools
                    .iter()
                    .find(|p| p.cidr.contains(&a))
                    .map_or_else(|| IpNet::from(a), |p| p.cidr);
                (a, pool)
            })
            .collect()
    }

    /// Addresses `node` can still hand out in the family: free addresses of its own blocks plus
    /// the unclaimed blocks of enabled pools (saturating).
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
            // The pool's network/broadcast addresses sit in its first/last block.
            if pool.cidr.addr().is_ipv4() && unclaimed > 0 {
                let first = pool
                    .cidr
                    .subnets(pool.block_size)
                    .ok()
                    .and_then(|mut s| s.next());
                let last = pool
                    .cidr
                    .subnets(pool.block_size)
                    .ok()
                    .and_then(|s| s.last());
                for b in [first, last].into_iter().flatten() {
                    if !self.blocks.contains_key(&b.to_string()) {
                        free = free.saturating_sub(1);
                    }
                }
            }
        }
        free
    }

    /// Releases every allocation whose handle is `"<network>.<containerID>"` and whose
    /// (containerID, ifname) is not in `valid`. Returns (handle, ifname, address) of each.
    pub fn gc(
        &mut self,
        network: &str,
        valid: &std::collections::HashSet<(String, String)>,
    ) -> Vec<(String, String, IpAddr)> {
        let prefix = format!("{network}.");
        let mut released = Vec::new();
        for block in self.blocks.values_mut() {
            let stale: Vec<u32> = block
                .allocations
                .iter()
                .filter(|(_, a)| {
                    a.handle
                        .strip_prefix(&prefix)
                        .is_some_and(|cid| !valid.contains(&(cid.to_string(), a.ifname.clone())))
                })
                .map(|(o, _)| *o)
                .collect();
            for o in stale {
                if let Some(a) = block.allocations.remove(&o) {
                    released.push((a.handle, a.ifname, block.address(o)));
                }
            }
        }
        released
    }

    fn claim_block(&mut self, pool: &Pool, node: &str) -> Option<&mut Block> {
        let subnets = pool.cidr.subnets(pool.block_size).ok()?;
        let cidr = subnets
            .into_iter()
            .find(|s| !self.blocks.contains_key(&s.to_string()))?;
        let block = Block {
            cidr,
            affinity: node.to_string(),
            allocations: BTreeMap::new(),
            next_seq: 1,
        };
        Some(self.blocks.entry(cidr.to_string()).or_insert(block))
    }

    /// Releases every address held by (handle, ifname); returns them. Idempotent.
    pub fn release(&mut self, handle: &str, ifname: &str) -> Vec<IpAddr> {
        let mut released = Vec::new();
        for block in self.blocks.values_mut() {
            let offsets: Vec<u32> = block
                .allocations
                .iter()
                .filter(|(_, a)| a.handle == handle && a.ifname == ifname)
                .map(|(o, _)| *o)
                .collect();
            for o in offsets {
                block.allocations.remove(&o);
                released.push(block.address(o));
            }
        }
        released
    }

    /// Number of addresses in use.
    pub fn in_use(&self) -> usize {
        self.blocks.values().map(|b| b.allocations.len()).sum()
    }
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
        }
    }

    fn alloc(s: &mut IpamState, pools: &[Pool], h: &str) -> Result<IpAddr, IpamError> {
        s.allocate(pools, "n1", h, "eth0", true, &BTreeMap::new())
            .map(|(a, _)| a)
    }

    #[test]
    fn same_handle_gets_same_address() {
        let pools = [pool("10.1.0.0/24", 28)];
        let mut s = IpamState::default();
        let a = alloc(&mut s, &pools, "net.c1").expect("a");
        let b = alloc(&mut s, &pools, "net.c1").expect("b");
        assert_eq!(a, b);
        assert_eq!(s.in_use(), 1);
        let c = alloc(&mut s, &pools, "net.c2").expect("c");
        assert_ne!(a, c);
        // A different ifname of the same handle is a different attachment.
        let d = s
            .allocate(&pools, "n1", "net.c1", "net1", true, &BTreeMap::new())
            .expect("d")
            .0;
        assert_ne!(a, d);
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
        assert_eq!(
            err,
            IpamError::Exhausted {
                family: "IPv4",
                pools: "10.1.0.0/27".into()
            }
        );
        assert!(err.to_string().contains("10.1.0.0/27"));
    }

    #[test]
    fn does_not_take_other_nodes_blocks() {
        let pools = [pool("10.1.0.0/27", 28)];
        let mut s = IpamState::default();
        let a = s
            .allocate(&pools, "other", "h0", "eth0", true, &BTreeMap::new())
            .expect("other")
            .0;
        let b = alloc(&mut s, &pools, "h1").expect("mine");
        let block_of = |ip: IpAddr| {
            s.blocks
                .values()
                .find(|bl| bl.cidr.contains(&ip))
                .map(|bl| bl.affinity.clone())
        };
        assert_eq!(block_of(a).as_deref(), Some("other"));
        assert_eq!(block_of(b).as_deref(), Some("n1"));
    }

    #[test]
    fn release_frees_and_is_idempotent() {
        let pools = [pool("10.1.0.0/29", 30)];
        let mut s = IpamState::default();
        let addrs: Vec<_> = (0..6)
            .map(|i| alloc(&mut s, &pools, &format!("h{i}")).expect("alloc"))
            .collect();
        assert!(alloc(&mut s, &pools, "h6").is_err());
        assert_eq!(s.release("h2", "eth0"), vec![addrs[2]]);
        assert!(s.release("h2", "eth0").is_empty());
        assert_eq!(alloc(&mut s, &pools, "h7").expect("reuse"), addrs[2]);
    }

    #[test]
    fn sequence_numbers_grow() {
        let pools = [pool("10.1.0.0/30", 30)];
        let mut s = IpamState::default();
        alloc(&mut s, &pools, "a").expect("a");
        s.release("a", "eth0");
        alloc(&mut s, &pools, "b").expect("b");
        let block = s.blocks.values().next().expect("block");
        assert_eq!(block.allocations[&1].seq, 2);
    }

    #[test]
    fn specific_addresses() {
        let pools = [pool("10.1.0.0/24", 28)];
        let mut s = IpamState::default();
        let want: IpAddr = "10.1.0.77".parse().expect("ip");
        let none = BTreeMap::new();
        assert_eq!(
            s.allocate_specific(&pools, "n1", "h", "eth0", want, &none)
                .expect("specific")
                .0,
            want
        );
        // Idempotent for the same handle; in use for another; the block is now ours.
        s.allocate_specific(&pools, "n1", "h", "eth0", want, &none)
            .expect("again");
        assert_eq!(
            s.allocate_specific(&pools, "n1", "h2", "eth0", want, &none),
            Err(IpamError::InUse { addr: want })
        );
        assert_eq!(s.blocks["10.1.0.64/28"].affinity, "n1");
        let other: IpAddr = "10.1.0.78".parse().expect("ip");
        assert!(matches!(
            s.allocate_specific(&pools, "n2", "h3", "eth0", other, &none),
            Err(IpamError::ForeignBlock { .. })
        ));
        assert!(matches!(
            s.allocate_specific(&pools, "n1", "h", "eth0", other, &none),
            Err(IpamError::HeldOther { .. })
        ));
        assert!(matches!(
            s.allocate_specific(
                &pools,
                "n1",
                "h4",
                "eth0",
                "10.2.0.1".parse().expect("ip"),
                &none
            ),
            Err(IpamError::NotInPool { .. })
        ));
        assert_eq!(
            s.lookup_all(&pools, "h", "eth0"),
            vec![(want, pools[0].cidr)]
        );
    }

    #[test]
    fn free_counts_own_blocks_and_unclaimed() {
        let pools = [pool("10.1.0.0/27", 28)];
        let mut s = IpamState::default();
        assert_eq!(s.free(&pools, "n1", true), 30);
        alloc(&mut s, &pools, "a").expect("a");
        assert_eq!(s.free(&pools, "n1", true), 29);
        // Another node's block is not free for n1.
        s.allocate(&pools, "n2", "b", "eth0", true, &BTreeMap::new())
            .expect("b");
        assert_eq!(s.free(&pools, "n1", true), 14);
        assert_eq!(s.free(&pools, "n1", false), 0);
    }

    #[test]
    fn gc_releases_only_invalid_attachments_of_the_network() {
        let pools = [pool("10.1.0.0/24", 26)];
        let mut s = IpamState::default();
        for h in ["net.c1", "net.c2", "other.c3"] {
            alloc(&mut s, &pools, h).expect("alloc");
        }
        let valid = [("c1".to_string(), "eth0".to_string())]
            .into_iter()
            .collect();
        let released = s.gc("net", &valid);
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].0, "net.c2");
        assert_eq!(s.in_use(), 2);
        assert!(s.lookup("other.c3", "eth0", true).is_some());
    }

    #[test]
    fn families_and_disabled_pools() {
        let mut pools = vec![pool("10.1.0.0/24", 26), pool("fd00::/120", 122)];
        let mut s = IpamState::default();
        let v6 = s
            .allocate(&pools, "n1", "h", "eth0", false, &BTreeMap::new())
            .expect("v6")
            .0;
        assert!(v6.is_ipv6());
        assert_eq!(v6, "fd00::".parse::<IpAddr>().expect("ip"));
        pools[0].disabled = true;
        assert_eq!(
            alloc(&mut s, &pools, "h"),
            Err(IpamError::NoPool { family: "IPv4" })
        );
    }
}
