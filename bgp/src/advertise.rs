//! What a session has announced to its peer, and what a new set of routes to advertise
//! changes: the UPDATEs to send, as few as fit (routes grouped by next hop), announcements
//! before withdrawals so that a route moving to a new prefix length is never absent.
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::update::UpdateBuilder;
use crate::Family;

/// The routes one session announced, by prefix, with their next hops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Advertised {
    routes: BTreeMap<IpNet, IpAddr>,
}

impl Advertised {
    pub fn routes(&self) -> &BTreeMap<IpNet, IpAddr> {
        &self.routes
    }

    /// The messages that take the peer from what it was sent to `wanted` (only the routes of
    /// `families`, the session's), and the new state. A new session starts from
    /// [`Advertised::default`], so its first call announces everything.
    pub fn update_to(
        &mut self,
        wanted: &BTreeMap<IpNet, IpAddr>,
        families: &[Family],
        builder: &UpdateBuilder,
    ) -> Vec<Vec<u8>> {
        let wanted: BTreeMap<IpNet, IpAddr> = wanted
            .iter()
            .filter(|(n, _)| families.contains(&Family::of(n)))
            .map(|(n, h)| (*n, *h))
            .collect();
        let mut announce: BTreeMap<(Family, IpAddr), Vec<IpNet>> = BTreeMap::new();
        for (n, h) in &wanted {
            if self.routes.get(n) != Some(h) {
                announce.entry((Family::of(n), *h)).or_default().push(*n);
            }
        }
        let mut withdraw: BTreeMap<Family, Vec<IpNet>> = BTreeMap::new();
        for n in self.routes.keys() {
            if !wanted.contains_key(n) {
                withdraw.entry(Family::of(n)).or_default().push(*n);
            }
        }
        let mut out = Vec::new();
        for ((family, hop), nets) in &announce {
            out.extend(builder.announce(*family, *hop, None, nets));
        }
        for (family, nets) in &withdraw {
            out.extend(builder.withdraw(*family, nets));
        }
        self.routes = wanted;
        out
    }
}
