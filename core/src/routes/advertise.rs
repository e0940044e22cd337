//! What this node advertises: every block affine to it, and a /32 (/128) for each address it
//! allocated from a block that is not its own (borrowed), each via this node's address of the
//! prefix's family. Computed from the datastore's view, so what peers learn is what the
//! datastore says, whoever wrote it.
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::view::View;
use crate::Route;

/// This node's addresses, the next hops of its routes (at most one per family).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NextHops {
    pub v4: Option<IpAddr>,
    pub v6: Option<IpAddr>,
}

impl NextHops {
    /// The next hop for `prefix`'s family.
    pub fn for_prefix(&self, prefix: &IpNet) -> Option<IpAddr> {
        match prefix {
            IpNet::V4(_) => self.v4,
            IpNet::V6(_) => self.v6,
        }
    }

    /// Every one of them.
    pub fn all(&self) -> impl Iterator<Item = IpAddr> {
        self.v4.into_iter().chain(self.v6)
    }
}

/// The routes `me` advertises, by prefix. A family without a next hop advertises nothing
/// (reported by [`unroutable`]).
pub fn own_routes(view: &View, me: &str, hops: &NextHops) -> BTreeMap<IpNet, Route> {
    let mut out = BTreeMap::new();
    let mut add = |prefix: IpNet| {
        if let Some(next_hop) = hops.for_prefix(&prefix) {
            out.insert(
                prefix,
                Route {
                    prefix,
                    node: me.to_string(),
                    next_hop,
                },
            );
        }
    };
    for block in view.affine_to(me) {
        add(*block);
    }
    for addr in view.allocated_by(me) {
        let borrowed = view.block_of(*addr).is_none_or(|(_, b)| b.affinity != me);
        if borrowed {
            add(IpNet::from(*addr));
        }
    }
    out
}

/// Prefixes `me` holds but cannot advertise: no address of their family (what the agent
/// warns about).
pub fn unroutable(view: &View, me: &str, hops: &NextHops) -> Vec<IpNet> {
    view.affine_to(me)
        .copied()
        .chain(view.allocated_by(me).map(|a| IpNet::from(*a)))
        .filter(|p| hops.for_prefix(p).is_none())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::view::tests::{block_kv, put};

    fn hops() -> NextHops {
        NextHops {
            v4: Some("172.31.1.1".parse().expect("ip")),
            v6: Some("fd31:1::1".parse().expect("ip")),
        }
    }

    #[test]
    fn own_blocks_and_borrowed_addresses() {
        let mut v = crate::routes::view::tests::view();
        v.apply(&put(block_kv("10.244.0.0/26", "a", &[("10.244.0.1", "a")])));
        v.apply(&put(block_kv("fd00::/122", "a", &[])));
        // b's block: a borrowed .70 from it; b's own allocation is b's.
        v.apply(&put(block_kv(
            "10.244.0.64/26",
            "b",
            &[("10.244.0.70", "a"), ("10.244.0.71", "b")],
        )));
        let r = own_routes(&v, "a", &hops());
        let prefixes: Vec<String> = r.keys().map(ToString::to_string).collect();
        assert_eq!(
            prefixes,
            ["10.244.0.0/26", "10.244.0.70/32", "fd00::/122"],
            "own blocks and the borrowed /32; not a's allocation inside its own block"
        );
        assert_eq!(
            r[&"fd00::/122".parse::<IpNet>().expect("net")].next_hop,
            "fd31:1::1".parse::<IpAddr>().expect("ip")
        );
        let b = own_routes(&v, "b", &hops());
        assert_eq!(b.len(), 1, "b advertises its block only: {b:?}");
        // No IPv6 address: IPv6 is not advertised, and said so.
        let v4_only = NextHops { v6: None, ..hops() };
        assert_eq!(own_routes(&v, "a", &v4_only).len(), 2);
        assert_eq!(unroutable(&v, "a", &v4_only).len(), 1);
        // A released block with a's allocation in it (mixed versions): a /32.
        v.apply(&put(block_kv("10.244.1.0/26", "", &[("10.244.1.5", "a")])));
        assert!(own_routes(&v, "a", &hops()).contains_key(&"10.244.1.5/32".parse().expect("net")));
    }
}
