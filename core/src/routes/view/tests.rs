pub use super::fixtures::node_kv;
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
fn a_new_block_over_counted_ones_is_found_whichever_way_is_cheaper() {
    let mut v = view();
    // Eight /26s: a /24 over the ones at 10.244.1.x holds four /26 starts, fewer than
    // the blocks there are, so they are looked up one by one.
    for i in 0..8 {
        let cidr = format!("10.244.{}.{}/26", i / 4, (i % 4) * 64);
        assert!(v.apply(&put(aged(&cidr, "a", 10 + i))));
    }
    let outer: IpNet = "10.244.1.0/24".parse().expect("cidr");
    assert_eq!(
        v.overlapping(&outer),
        Some("10.244.1.0/26".parse().expect("cidr"))
    );
    // A /26 inside a counted /24: found at the /24's length.
    assert!(v.apply(&put(aged("10.244.9.0/24", "b", 30))));
    let inner: IpNet = "10.244.9.128/26".parse().expect("cidr");
    assert_eq!(
        v.overlapping(&inner),
        Some("10.244.9.0/24".parse().expect("cidr"))
    );
    // Beside everything: none.
    assert_eq!(v.overlapping(&"10.244.7.0/24".parse().expect("cidr")), None);
    // Written, the younger overlapping blocks do not count.
    v.apply(&put(aged("10.244.1.0/24", "rogue", 40)));
    v.apply(&put(aged("10.244.9.128/26", "rogue", 41)));
    assert!(v.block(&outer).is_none() && v.block(&inner).is_none());
    assert_eq!(v.blocks(), 9);
}

#[test]
fn a_counted_block_sorted_again_keeps_its_allocations() {
    // The view keeps no stored bytes: a counted block sorted again is rebuilt from what
    // routes keep of it. Its allocations must survive leaving and rejoining the blocks
    // that count.
    let mut v = view();
    let cidr: IpNet = "10.244.0.0/24".parse().expect("cidr");
    let allocs = [("10.244.0.1", "a"), ("10.244.0.200", "b")];
    assert!(v.apply(&put(block_kv("10.244.0.0/24", "a", &allocs))));
    let before = v.block(&cidr).expect("counts").clone();
    // Pools without /24: it stops counting, reported with its allocations.
    let mut shrunk = pools();
    shrunk[0].previous_block_sizes.clear();
    assert!(v.set_pools(shrunk));
    assert!(v.block(&cidr).is_none() && v.is_ignored_block(&cidr));
    let ignored = &v.ignored()[0];
    assert_eq!(ignored.rule, Rule::BlockSize);
    assert_eq!(ignored.allocations.len(), 2);
    assert_eq!(v.allocated_by("b").count(), 0);
    // The old pools again: it counts as it did.
    assert!(v.set_pools(pools()));
    assert_eq!(v.block(&cidr), Some(&before));
    assert_eq!(v.allocated_by("b").count(), 1);
    assert!(v.ignored().is_empty());
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
    v.replace(Part::Nodes, vec![node_kv("r", &["192.0.2.9"], true)]);
    assert_eq!(v.nodes().count(), 1);
}
