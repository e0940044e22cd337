//! Who may say what. A route a peer announces is used only if the datastore backs it:
//! - a direct peer announces its own node's routes only; a route reflector (its node record
//!   says so) may relay other nodes' routes;
//! - the route's node has a node record, and the next hop is one of its recorded addresses,
//!   of the prefix's family;
//! - a block prefix is a block affine to the route's node;
//! - a /32 (/128) is an address allocated, in its block, by the route's node.
//!
//! Anything else is refused: a node cannot draw another node's pods' traffic to itself.
use std::net::IpAddr;

use ipnet::IpNet;

use super::view::View;
use crate::Route;

/// Why a route was refused. Each has a stable name (metrics, calixctl).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refusal {
    /// The route did not parse (bad prefix, next hop or node name).
    Malformed,
    /// A peer that is not a reflector announced another node's route.
    NotItsOwn,
    /// The route's node has no node record.
    UnknownNode,
    /// The next hop is not one of the node's recorded addresses.
    NextHopNotRecorded,
    /// The next hop is of the other family than the prefix.
    NextHopFamily,
    /// The block exists but is affine to another node (or to none).
    BlockNotAffine,
    /// A prefix that is no block, and no single address.
    NotABlock,
    /// A single address in no block, or not allocated.
    AddressNotAllocated,
    /// A single address allocated by another node.
    AddressOfOtherNode,
    /// The prefix is a stored block that breaks the rule for blocks (outside the pools, of a
    /// size its pool does not make, overlapping an older block...: `ipam::wellformed`).
    BlockIgnored,
}

impl Refusal {
    pub const ALL: [Refusal; 10] = [
        Refusal::Malformed,
        Refusal::NotItsOwn,
        Refusal::UnknownNode,
        Refusal::NextHopNotRecorded,
        Refusal::NextHopFamily,
        Refusal::BlockNotAffine,
        Refusal::NotABlock,
        Refusal::AddressNotAllocated,
        Refusal::AddressOfOtherNode,
        Refusal::BlockIgnored,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::NotItsOwn => "not_its_own",
            Refusal::UnknownNode => "unknown_node",
            Refusal::NextHopNotRecorded => "next_hop_not_recorded",
            Refusal::NextHopFamily => "next_hop_family",
            Refusal::BlockNotAffine => "block_not_affine",
            Refusal::NotABlock => "not_a_block",
            Refusal::AddressNotAllocated => "address_not_allocated",
            Refusal::AddressOfOtherNode => "address_of_other_node",
            Refusal::BlockIgnored => "block_ignored",
        }
    }

    /// What it means, for the log.
    pub fn explain(self) -> &'static str {
        match self {
            Refusal::Malformed => "the route does not parse",
            Refusal::NotItsOwn => {
                "the peer announced another node's route and is not a route reflector"
            }
            Refusal::UnknownNode => "the route's node has no node record in the datastore",
            Refusal::NextHopNotRecorded => {
                "the next hop is not one of the node's recorded addresses"
            }
            Refusal::NextHopFamily => "the next hop is not of the prefix's address family",
            Refusal::BlockNotAffine => "the block is not affine to the route's node",
            Refusal::NotABlock => "the prefix is neither a block nor a single address",
            Refusal::AddressNotAllocated => "the address is not allocated in any block",
            Refusal::AddressOfOtherNode => "the address was allocated by another node",
            Refusal::BlockIgnored => {
                "the prefix is a stored block that breaks the rule for blocks (calixctl ipam check)"
            }
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Checks `route`, announced by peer `source`, against the datastore's `view`. A prefix the
/// view knows as an ignored block is refused as such ([`Refusal::BlockIgnored`]) when nothing
/// else backs it.
pub fn validate(view: &View, source: &str, route: &Route) -> Result<(), Refusal> {
    match backed(view, source, route) {
        Err(Refusal::NotABlock | Refusal::AddressNotAllocated | Refusal::AddressOfOtherNode)
            if view.is_ignored_block(&route.prefix) =>
        {
            Err(Refusal::BlockIgnored)
        }
        other => other,
    }
}

fn backed(view: &View, source: &str, route: &Route) -> Result<(), Refusal> {
    if route.node != source {
        let relays = view.node(source).is_some_and(|n| n.record.reflector);
        if !relays {
            return Err(Refusal::NotItsOwn);
        }
    }
    let node = view.node(&route.node).ok_or(Refusal::UnknownNode)?;
    if !node.addresses.contains(&route.next_hop) {
        return Err(Refusal::NextHopNotRecorded);
    }
    if route.next_hop.is_ipv6() != matches!(route.prefix, IpNet::V6(_)) {
        return Err(Refusal::NextHopFamily);
    }
    if let Some(block) = view.block(&route.prefix) {
        return if block.affinity == route.node {
            Ok(())
        } else {
            Err(Refusal::BlockNotAffine)
        };
    }
    if route.prefix.prefix_len() != route.prefix.max_prefix_len() {
        return Err(Refusal::NotABlock);
    }
    let addr: IpAddr = route.prefix.addr();
    let (_, block) = view.block_of(addr).ok_or(Refusal::AddressNotAllocated)?;
    match block.allocations.get(&addr) {
        None => Err(Refusal::AddressNotAllocated),
        Some(n) if *n == route.node => Ok(()),
        Some(_) => Err(Refusal::AddressOfOtherNode),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::view::tests::{block_kv, node_kv, put};

    fn view() -> View {
        let mut v = crate::routes::view::tests::view();
        v.apply(&put(node_kv("a", &["172.31.1.1", "fd31:1::1"], false)));
        v.apply(&put(node_kv("b", &["172.31.1.2"], false)));
        v.apply(&put(node_kv("r", &["172.31.1.9"], true)));
        v.apply(&put(block_kv("10.244.0.0/26", "a", &[("10.244.0.1", "a")])));
        v.apply(&put(block_kv(
            "10.244.0.64/26",
            "b",
            &[("10.244.0.70", "a"), ("10.244.0.71", "b")],
        )));
        v.apply(&put(block_kv("fd00::/122", "a", &[])));
        v.apply(&put(block_kv("10.244.0.128/26", "", &[])));
        v
    }

    fn route(prefix: &str, node: &str, hop: &str) -> Route {
        Route {
            prefix: prefix.parse().expect("net"),
            node: node.into(),
            next_hop: hop.parse().expect("ip"),
        }
    }

    #[test]
    fn what_the_datastore_backs_is_accepted() {
        let v = view();
        for r in [
            route("10.244.0.0/26", "a", "172.31.1.1"),
            route("fd00::/122", "a", "fd31:1::1"),
            route("10.244.0.70/32", "a", "172.31.1.1"),
            route("10.244.0.64/26", "b", "172.31.1.2"),
        ] {
            assert_eq!(validate(&v, &r.node.clone(), &r), Ok(()), "{r:?}");
        }
        // A reflector relays others' routes.
        assert_eq!(
            validate(&v, "r", &route("10.244.0.0/26", "a", "172.31.1.1")),
            Ok(())
        );
    }

    #[test]
    fn every_refusal_cause() {
        let v = view();
        let cases = [
            // b (not a reflector) announces a's block.
            (
                "b",
                route("10.244.0.0/26", "a", "172.31.1.1"),
                Refusal::NotItsOwn,
            ),
            // ...or its own claim to a's block.
            (
                "b",
                route("10.244.0.0/26", "b", "172.31.1.2"),
                Refusal::BlockNotAffine,
            ),
            (
                "x",
                route("10.244.0.0/26", "x", "172.31.1.7"),
                Refusal::UnknownNode,
            ),
            // a's block, with b's address as the next hop.
            (
                "a",
                route("10.244.0.0/26", "a", "172.31.1.2"),
                Refusal::NextHopNotRecorded,
            ),
            (
                "a",
                route("fd00::/122", "a", "172.31.1.1"),
                Refusal::NextHopFamily,
            ),
            // A released block (affine to nobody).
            (
                "a",
                route("10.244.0.128/26", "a", "172.31.1.1"),
                Refusal::BlockNotAffine,
            ),
            (
                "a",
                route("10.244.0.0/25", "a", "172.31.1.1"),
                Refusal::NotABlock,
            ),
            (
                "a",
                route("10.244.0.72/32", "a", "172.31.1.1"),
                Refusal::AddressNotAllocated,
            ),
            (
                "a",
                route("10.245.0.1/32", "a", "172.31.1.1"),
                Refusal::AddressNotAllocated,
            ),
            // b's own allocation in its block, claimed by a.
            (
                "a",
                route("10.244.0.71/32", "a", "172.31.1.1"),
                Refusal::AddressOfOtherNode,
            ),
            // Through a reflector, the same checks hold.
            (
                "r",
                route("10.244.0.0/26", "b", "172.31.1.2"),
                Refusal::BlockNotAffine,
            ),
        ];
        for (source, r, want) in cases {
            assert_eq!(
                validate(&v, source, &r),
                Err(want),
                "{source} announcing {r:?}"
            );
        }
        let names: std::collections::HashSet<_> = Refusal::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Refusal::ALL.len());
    }

    #[test]
    fn a_block_claimed_elsewhere_withdraws_the_old_owner() {
        let mut v = view();
        let r = route("10.244.0.0/26", "a", "172.31.1.1");
        assert_eq!(validate(&v, "a", &r), Ok(()));
        v.apply(&put(block_kv("10.244.0.0/26", "", &[])));
        assert_eq!(validate(&v, "a", &r), Err(Refusal::BlockNotAffine));
        v.apply(&put(block_kv("10.244.0.0/26", "b", &[])));
        assert_eq!(validate(&v, "a", &r), Err(Refusal::BlockNotAffine));
        assert_eq!(
            validate(&v, "b", &route("10.244.0.0/26", "b", "172.31.1.2")),
            Ok(())
        );
    }
}
