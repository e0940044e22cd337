//! The peer task's pure parts: the import rule, collisions.
use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

#[test]
fn the_import_rule_and_more() {
    let rule = ImportRule {
        within: vec![net("10.244.0.0/16"), net("fd44::/48")],
        own: vec![net("10.244.1.0/26")],
    };
    let own = [ip("172.31.1.1")];
    let ok = |p: &str, nh: &str, path: &[u32]| {
        accepts(&rule, 64512, &own, &net(p), &ip(nh), path.iter().copied())
    };
    assert!(ok("10.244.2.0/26", "172.31.1.254", &[65000, 64513]));
    assert!(ok("fd44::/122", "fd31:1::fe", &[65000]));
    assert!(!ok("10.244.1.0/26", "172.31.1.254", &[65000]), "own block");
    assert!(
        !ok("10.245.0.0/26", "172.31.1.254", &[65000]),
        "outside the pools"
    );
    assert!(!ok("0.0.0.0/0", "172.31.1.254", &[65000]), "default route");
    assert!(
        !ok("10.244.2.0/26", "fd31:1::fe", &[65000]),
        "another family's next hop"
    );
    assert!(
        !ok("10.244.2.0/26", "172.31.1.1", &[65000]),
        "via this node"
    );
    assert!(
        !ok("10.244.2.0/26", "0.0.0.0", &[65000]),
        "unspecified next hop"
    );
    assert!(
        !ok("10.244.2.0/26", "172.31.1.254", &[65000, 64512]),
        "an AS loop"
    );
}

#[test]
fn a_collision_keeps_the_higher_identifiers_connection() {
    let (low, high) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
    assert!(incoming_wins(false, true, low, Some(high)));
    assert!(!incoming_wins(false, true, high, Some(low)));
    assert!(
        !incoming_wins(false, true, low, Some(low)),
        "equal: ours stays"
    );
    assert!(
        !incoming_wins(true, true, low, Some(high)),
        "Established stays"
    );
    assert!(
        !incoming_wins(false, false, low, Some(high)),
        "the peer's first stays"
    );
    assert!(!incoming_wins(false, true, low, None), "no OPEN: no claim");
}

#[test]
fn families_follow_the_next_hops() {
    assert_eq!(families(&[ip("172.31.1.1")]), [Family::IPV4_UNICAST]);
    assert_eq!(
        families(&[ip("172.31.1.1"), ip("fd31:1::1")]),
        [Family::IPV4_UNICAST, Family::IPV6_UNICAST]
    );
    assert!(families(&[]).is_empty());
}
