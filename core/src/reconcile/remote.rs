//! Routes to pods on other nodes: what route distribution (`crate::routes`) wants
//! programmed, and the pure plan of what the kernel should have for it (the agent's
//! reconciler reads the kernel and writes the difference).
//!
//! Each [`RemoteRoute`] becomes one kernel route:
//!
//! - `vxlan = "always"`: through calix's VXLAN device of the prefix's family;
//! - `"crossSubnet"` (the default): straight to the next hop through the uplink whose subnet
//!   holds it, through VXLAN when none does;
//! - `"never"`: straight through such an uplink; a next hop on no uplink's subnet gets no
//!   route (the network must route pod addresses then) and is reported as a problem.
//!
//! An IPv6 prefix goes to the peer's IPv6 address (through the IPv6 VXLAN device when it needs
//! VXLAN); a route whose next hop is not of its prefix's family is a problem, never
//! programmed: a peer without an IPv6 address has no IPv6 routes, its IPv6 pods are unreachable
//! from here.
//!
//! The route guard ([`guard`], [`covered`]): whatever route distribution's validation said, a
//! route outside every pool, shorter than its pool's blocks (a default route among them), or
//! covering a node's address or one of this node's uplink addresses is never programmed. The
//! engine applies it to the desired set (pools and node records: `crate::routes::engine`), and
//! [`plan`] once more against the uplinks' addresses as the kernel has them.
//!
//! [`plan`] is pure: desired routes + the uplinks as the kernel has them ([`Uplink`]) → the
//! routes, the VXLAN devices ([`VxlanDevice`]) and the peers each must reach. The kernel's own
//! facts (the devices' names, the encapsulation's size) are the agent's to add.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::ipam::pool::VxlanMode;
use crate::ipam::Pool;

/// One route to another node's pods: a block affine to `node`, or one address it borrowed
/// from another node's block (/32, /128).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RemoteRoute {
    pub prefix: IpNet,
    /// The node the addresses live on.
    pub node: String,
    /// That node's address (validated against its node record): the route's gateway, or the
    /// VXLAN peer.
    pub next_hop: IpAddr,
    /// The pool's `vxlan` setting: whether the route goes through the VXLAN device (always, or
    /// when `next_hop` is not on one of this node's subnets) or straight to `next_hop`.
    pub vxlan: VxlanMode,
}

/// Why the route guard keeps a route out of the kernel. Each has a stable name (metrics,
/// calixctl).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Guarded {
    /// Inside no pool (a default route, for one).
    OutsidePools,
    /// Shorter than every block its pool makes (`blockSize` and `previousBlockSizes`).
    TooShort,
    /// Covers an address of a node (its node record): traffic to a node must not follow a
    /// pod route.
    CoversNodeAddress,
    /// Covers an address of this node's uplinks.
    CoversUplinkAddress,
}

impl Guarded {
    pub const ALL: [Guarded; 4] = [
        Guarded::OutsidePools,
        Guarded::TooShort,
        Guarded::CoversNodeAddress,
        Guarded::CoversUplinkAddress,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Guarded::OutsidePools => "outside_pools",
            Guarded::TooShort => "too_short",
            Guarded::CoversNodeAddress => "covers_node_address",
            Guarded::CoversUplinkAddress => "covers_uplink_address",
        }
    }

    /// What it means, for the log.
    pub fn explain(self) -> &'static str {
        match self {
            Guarded::OutsidePools => "the prefix lies inside no pool",
            Guarded::TooShort => "the prefix is shorter than any block its pool makes",
            Guarded::CoversNodeAddress => "the prefix covers a node's address",
            Guarded::CoversUplinkAddress => "the prefix covers one of this node's uplink addresses",
        }
    }
}

impl std::fmt::Display for Guarded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The route guard's pool checks: `prefix` inside a pool (any, disabled ones too) and no
/// shorter than the smallest block that pool makes, or has made.
pub fn guard(prefix: &IpNet, pools: &[Pool]) -> Result<(), Guarded> {
    // Runs for every accepted route at every flush: no allocation.
    let shortest = pools
        .iter()
        .filter(|p| p.cidr.contains(prefix))
        .flat_map(|p| std::iter::once(p.block_size).chain(p.previous_block_sizes.iter().copied()))
        .min()
        .ok_or(Guarded::OutsidePools)?;
    if prefix.prefix_len() < shortest {
        return Err(Guarded::TooShort);
    }
    Ok(())
}

/// The first of `addresses` that `prefix` covers.
pub fn covered<'a>(
    prefix: &IpNet,
    addresses: impl IntoIterator<Item = &'a IpAddr>,
) -> Option<IpAddr> {
    addresses.into_iter().find(|a| prefix.contains(*a)).copied()
}

/// This node's side of the underlay (the agent's `uplinks`, `[routes] node_addresses` and
/// `[vxlan]`): what routes leave through.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Underlay {
    /// The uplinks (`uplinks`): a direct route leaves through the one whose subnet holds its
    /// next hop; the VXLAN devices sit on the first.
    pub uplinks: Vec<String>,
    /// This node's underlay addresses (`[routes] node_addresses`): the VXLAN devices' local
    /// addresses. Empty: the first global address of each family on the first uplink.
    pub node_addresses: Vec<IpAddr>,
    pub vxlan: VxlanSettings,
}

/// An address family: of a route's prefix and next hop, and of the VXLAN device (its
/// underlay) that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The family of `addr`.
    pub fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }
}

/// An uplink as the kernel has it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Uplink {
    pub index: u32,
    pub mtu: u32,
    /// Its global-scope addresses, both families, in the kernel's order (its subnets: the
    /// next hops routes reach directly; the first of each family: the node's own address).
    pub addresses: Vec<IpNet>,
}

/// A VXLAN device a plan needs, on the first uplink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VxlanDevice {
    pub vni: u32,
    pub port: u16,
    /// This node's underlay address (the outer source; the device's family).
    pub local: IpAddr,
    /// The uplink the encapsulated packets leave through, and its MTU (the device's is that
    /// less the encapsulation).
    pub uplink: u32,
    pub uplink_mtu: u32,
}

/// The VXLAN devices' network identifier and UDP port (`[vxlan]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VxlanSettings {
    /// 1–16777215.
    pub vni: u32,
    pub port: u16,
}

impl Default for VxlanSettings {
    /// The config's defaults (`[vxlan]`): VNI 4096, the IANA port 4789.
    fn default() -> Self {
        Self {
            vni: 4096,
            port: 4789,
        }
    }
}

impl Underlay {
    /// This node's address of `family`: configured, else the first uplink's first.
    fn local(&self, family: Family, first: Option<&Uplink>) -> Option<IpAddr> {
        let of_family = |a: &IpAddr| Family::of(*a) == family;
        if !self.node_addresses.is_empty() {
            return self.node_addresses.iter().copied().find(of_family);
        }
        first?
            .addresses
            .iter()
            .map(IpNet::addr)
            .find(|a| of_family(a))
    }
}

/// How a planned route leaves the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Straight to the next hop, through the uplink with this index.
    Uplink(u32),
    /// Through the VXLAN device of this family.
    Vxlan(Family),
}

/// What the kernel should have for a set of [`RemoteRoute`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Destination → (gateway, how).
    pub routes: BTreeMap<IpNet, (IpAddr, Via)>,
    /// The VXLAN devices some route needs, with the peers each must reach.
    pub devices: BTreeMap<Family, (VxlanDevice, BTreeSet<IpAddr>)>,
    /// Routes that cannot be programmed as asked, and why (not retried: they need another
    /// config or topology).
    pub problems: BTreeMap<IpNet, String>,
}

/// The routes, devices and entries `desired` needs, given the uplinks (`uplinks[i]` is the
/// kernel's view of `underlay.uplinks[i]`, `None` when it is missing).
pub fn plan(
    desired: &BTreeMap<IpNet, RemoteRoute>,
    underlay: &Underlay,
    uplinks: &[Option<Uplink>],
) -> Plan {
    let mut plan = Plan::default();
    let first = uplinks.first().and_then(Option::as_ref);
    let present: Vec<&Uplink> = uplinks.iter().flatten().collect();
    for r in desired.values() {
        // The route guard, against the uplinks as the kernel has them now.
        let mut uplink_addrs = present
            .iter()
            .flat_map(|u| u.addresses.iter().map(|a| a.addr()));
        if let Some(a) = uplink_addrs.find(|a| r.prefix.contains(a)) {
            plan.problems.insert(
                r.prefix,
                format!(
                    "route guard: {} of node {} covers this node's uplink address {a}: never \
                     programmed ({})",
                    r.prefix,
                    r.node,
                    Guarded::CoversUplinkAddress
                ),
            );
            continue;
        }
        let family = Family::of(r.next_hop);
        if Family::of(r.prefix.addr()) != family {
            plan.problems.insert(
                r.prefix,
                format!(
                    "next hop {} of node {} is not of the prefix's family",
                    r.next_hop, r.node
                ),
            );
            continue;
        }
        if present
            .iter()
            .any(|u| u.addresses.iter().any(|a| a.addr() == r.next_hop))
        {
            plan.problems.insert(
                r.prefix,
                format!(
                    "next hop {} of node {} is this node's own address",
                    r.next_hop, r.node
                ),
            );
            continue;
        }
        let direct = present
            .iter()
            .find(|u| u.addresses.iter().any(|a| a.contains(&r.next_hop)))
            .map(|u| u.index);
        let via = match (r.vxlan, direct) {
            (VxlanMode::Never, Some(i)) | (VxlanMode::CrossSubnet, Some(i)) => Via::Uplink(i),
            (VxlanMode::Never, None) => {
                plan.problems.insert(
                    r.prefix,
                    format!(
                        "next hop {} of node {} is on none of this node's subnets and the \
                         pool's vxlan is \"never\": no route (the network must route it)",
                        r.next_hop, r.node
                    ),
                );
                continue;
            }
            (VxlanMode::Always, _) | (VxlanMode::CrossSubnet, None) => Via::Vxlan(family),
        };
        if let Via::Vxlan(family) = via {
            if !plan.devices.contains_key(&family) {
                let Some(up) = first else {
                    plan.problems.insert(
                        r.prefix,
                        format!(
                            "needs VXLAN to node {}, and the first uplink ({}) is missing",
                            r.node,
                            underlay.uplinks.first().map_or("none configured", |s| s)
                        ),
                    );
                    continue;
                };
                let Some(local) = underlay.local(family, Some(up)) else {
                    plan.problems.insert(
                        r.prefix,
                        format!(
                            "needs VXLAN to node {} over {family:?}, and this node has no \
                             address of that family (routes.node_addresses, or a global \
                             address on {})",
                            r.node, underlay.uplinks[0]
                        ),
                    );
                    continue;
                };
                let spec = VxlanDevice {
                    vni: underlay.vxlan.vni,
                    port: underlay.vxlan.port,
                    local,
                    uplink: up.index,
                    uplink_mtu: up.mtu,
                };
                plan.devices.insert(family, (spec, BTreeSet::new()));
            }
            if let Some((_, peers)) = plan.devices.get_mut(&family) {
                peers.insert(r.next_hop);
            }
        }
        plan.routes.insert(r.prefix, (r.next_hop, via));
    }
    plan
}

#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
#[cfg(test)]
mod tests;
