//! Many nodes (issue 13): nodes on a shared underlay, two subnets, one etcd.
use calix_testbed::{Cluster, Dataplane, Pod};

const POOLS: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n";

#[test]
fn nodes_share_etcd_and_reach_each_other_across_the_underlay() {
    let cluster = Cluster::create(Dataplane::Ebpf, &[1, 1, 2], |i, c| c.base_config(i) + POOLS);
    // The underlay: same subnet directly, the other subnet through the router.
    for (from, to) in [(0, 1), (0, 2), (2, 1)] {
        assert!(
            cluster.nodes[from].ns.ping(&cluster.address(to), 1),
            "node {from} → node {to} ({})",
            cluster.address(to)
        );
        assert!(
            cluster.nodes[from].ns.ping(&cluster.address6(to), 1),
            "node {from} → node {to} ({})",
            cluster.address6(to)
        );
    }
    cluster.start();
    // One etcd: each node allocates from a block of its own.
    let pods: Vec<Pod> = (0..3).map(|i| Pod::add(&cluster.nodes[i], "p")).collect();
    let blocks: std::collections::BTreeSet<String> = pods
        .iter()
        .map(|p| {
            let ip: std::net::Ipv4Addr = p.ip().parse().expect("ipv4");
            let o = ip.octets();
            format!("{}.{}.{}.{}", o[0], o[1], o[2], o[3] & 0xc0)
        })
        .collect();
    assert_eq!(blocks.len(), 3, "one /26 block per node: {blocks:?}");
}
