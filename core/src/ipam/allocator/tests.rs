//! The allocator against its view of the blocks: own blocks first, then a new claim, then a
//! borrowed address (unless strict); fixed addresses, reserved ones, sequence numbers, pools
//! a choice leaves out.
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
fn refused(s: &mut IpamState, pools: &[Pool], policy: &Policy, node: &str, addr: &str) -> String {
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
        msg.contains("10.1.0.70") && msg.contains("block 10.1.0.64/26") && msg.contains("node n2"),
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
        msg.contains("10.1.0.192/26") && msg.contains("10.1.0.208/28") && msg.contains("node n2"),
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
