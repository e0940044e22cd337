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
        br#"{"cidr":"10.244.5.0/26","affinity":"a","allocations":{"x":{}},"next_seq":1}"#.to_vec();
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
    let rules: Vec<(String, Rule)> = s.ignored.iter().map(|i| (i.key.clone(), i.rule)).collect();
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
            let a =
                std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 200, 0, 0)) + i * 4);
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
