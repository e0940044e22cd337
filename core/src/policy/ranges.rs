//! The prefix table's identities as address ranges: for a dataplane without longest-prefix
//! match (kernel mode's nftables interval sets), each identity's addresses as disjoint ranges
//! — a prefix less the more specific prefixes inside it that carry another identity.
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use super::tables::{Identity, WORLD};

/// An inclusive range of addresses of one family.
pub type Range = (IpAddr, IpAddr);

/// Each identity's addresses (but [`WORLD`]'s: those under no prefix, or under a prefix of
/// that identity) as disjoint, sorted, merged ranges, IPv4 then IPv6.
pub fn identity_ranges(prefixes: &BTreeMap<IpNet, Identity>) -> BTreeMap<Identity, Vec<Range>> {
    let mut out: BTreeMap<Identity, Vec<Range>> = BTreeMap::new();
    for v6 in [false, true] {
        let mut nets: Vec<(u128, u128, Identity)> = prefixes
            .iter()
            .filter(|(n, _)| matches!(n, IpNet::V6(_)) == v6)
            .map(|(n, id)| {
                let n = n.trunc();
                (to_int(n.network()), to_int(n.broadcast()), *id)
            })
            .collect();
        // By start, the wider first: a prefix is then inside the ones open before it, or past
        // their end (prefixes nest or are disjoint).
        nets.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut segments: Vec<(u128, u128, Identity)> = Vec::new();
        let mut open: Vec<(u128, Identity)> = Vec::new();
        // The first address not yet given to a segment (None: past the family's end).
        let mut cursor: Option<u128> = Some(0);
        let close_until = |limit: Option<u128>,
                           open: &mut Vec<(u128, Identity)>,
                           cursor: &mut Option<u128>,
                           segments: &mut Vec<(u128, u128, Identity)>| {
            while let Some(&(end, id)) = open.last() {
                if limit.is_some_and(|l| end >= l) {
                    break;
                }
                if let Some(c) = *cursor {
                    if c <= end {
                        segments.push((c, end, id));
                    }
                }
                *cursor = end.checked_add(1);
                open.pop();
            }
        };
        for (start, end, id) in nets {
            close_until(Some(start), &mut open, &mut cursor, &mut segments);
            if let (Some(&(_, outer)), Some(c)) = (open.last(), cursor) {
                if c < start {
                    segments.push((c, start - 1, outer));
                }
            }
            cursor = Some(start);
            open.push((end, id));
        }
        close_until(None, &mut open, &mut cursor, &mut segments);
        for (first, last, id) in segments {
            if id == WORLD {
                continue;
            }
            let ranges = out.entry(id).or_default();
            let (first, last) = (from_int(first, v6), from_int(last, v6));
            // Merge with the previous range when adjacent (same family).
            if let Some(prev) = ranges.last_mut() {
                if prev.1.is_ipv6() == v6 && next(prev.1) == Some(first) {
                    prev.1 = last;
                    continue;
                }
            }
            ranges.push((first, last));
        }
    }
    out
}

fn to_int(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

fn from_int(v: u128, v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(v))
    } else {
        IpAddr::V4(Ipv4Addr::from(v as u32))
    }
}

/// The address after `a` in its family.
fn next(a: IpAddr) -> Option<IpAddr> {
    match a {
        IpAddr::V4(a) => u32::from(a)
            .checked_add(1)
            .map(|v| Ipv4Addr::from(v).into()),
        IpAddr::V6(a) => u128::from(a)
            .checked_add(1)
            .map(|v| Ipv6Addr::from(v).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tables::Tables;
    use crate::test_rng::Rng;

    fn lookup(r: &BTreeMap<Identity, Vec<Range>>, ip: IpAddr) -> Identity {
        r.iter()
            .find(|(_, v)| v.iter().any(|(a, b)| *a <= ip && ip <= *b))
            .map_or(WORLD, |(id, _)| *id)
    }

    #[test]
    fn every_address_is_in_the_range_of_its_longest_prefix() {
        let net = |s: &str| s.parse::<IpNet>().expect("net");
        let fixed: BTreeMap<IpNet, Identity> = [
            (net("0.0.0.0/0"), 1),
            (net("10.0.0.0/8"), 2),
            (net("10.1.0.0/16"), 0),
            (net("10.1.2.3/32"), 3),
            (net("255.255.255.255/32"), 4),
            (net("::/0"), 5),
            (net("fd00::/8"), 6),
        ]
        .into();
        let r = identity_ranges(&fixed);
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert_eq!(lookup(&r, ip("9.255.255.255")), 1);
        assert_eq!(lookup(&r, ip("10.0.0.1")), 2);
        assert_eq!(
            lookup(&r, ip("10.1.0.1")),
            WORLD,
            "a WORLD prefix carves a hole"
        );
        assert_eq!(lookup(&r, ip("10.1.2.3")), 3);
        assert_eq!(lookup(&r, ip("255.255.255.255")), 4);
        assert_eq!(lookup(&r, ip("255.255.255.254")), 1);
        assert_eq!(lookup(&r, ip("fd12::1")), 6);
        assert_eq!(lookup(&r, ip("ffff::1")), 5);
        assert_eq!(
            r[&1].len(),
            2,
            "0/0 less 10/8 and the last address: {:?}",
            r[&1]
        );

        // Random tables: the ranges agree with the longest match, address by address.
        let mut rng = Rng(11);
        for round in 0..200 {
            let mut t: Tables = Tables::default();
            for _ in 0..(1 + rng.below(12)) {
                let len = rng.below(33) as u8;
                let a = Ipv4Addr::new(
                    10,
                    rng.below(4) as u8,
                    rng.below(4) as u8,
                    rng.below(8) as u8,
                );
                let n = IpNet::new(a.into(), len.max(6)).expect("net").trunc();
                t.prefixes.insert(n, rng.below(4) as u32);
            }
            let r = identity_ranges(&t.prefixes);
            for (id, v) in &r {
                for w in v.windows(2) {
                    assert!(next(w[0].1) < Some(w[1].0), "sorted, merged: {id} {v:?}");
                }
            }
            for _ in 0..200 {
                let a: IpAddr = Ipv4Addr::new(
                    10,
                    rng.below(4) as u8,
                    rng.below(4) as u8,
                    rng.below(16) as u8,
                )
                .into();
                assert_eq!(
                    lookup(&r, a),
                    t.identity_of(a),
                    "round {round}, {a}: {:?} {r:?}",
                    t.prefixes
                );
            }
        }
    }
}
