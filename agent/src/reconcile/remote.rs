//! Routes to pods on other nodes: what route distribution (`crate::routes`) wants programmed,
//! and how the reconciler keeps it true in the kernel (desired state, like endpoints).
//!
//! Each [`RemoteRoute`] becomes one kernel route ([`NodeRoute`], protocol 202):
//!
//! - `vxlan = "always"`: through calix's VXLAN device of the prefix's family;
//! - `"crossSubnet"` (the default): straight to the next hop through the uplink whose subnet
//!   holds it, through VXLAN when none does;
//! - `"never"`: straight through such an uplink; a next hop on no uplink's subnet gets no
//!   route (the network must route pod addresses then) and is reported as a problem.
//!
//! An IPv6 prefix goes to the peer's IPv6 address (through `vxlan-v6.calix` when it needs
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
//! [`plan`] is pure: desired routes + the uplinks as the kernel has them → the routes, VXLAN
//! devices and their entries the kernel should have. [`sync`] reads the kernel and writes the
//! difference in dependency order (devices and their entries, then routes; stale routes, then
//! devices no route needs). Without a complete set (an agent re-learning after a restart)
//! nothing is removed: missing routes are added, stale ones stay.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use calix_kernel::host::{HostKernel, Uplink};
use calix_kernel::netlink::NetlinkError;
use calix_kernel::node_route::NodeRoute;
use calix_kernel::vxlan::{self, FdbEntry, VxlanSpec};
use ipnet::IpNet;

use super::{kernel_err, ReconcileError, Repair};
use crate::ipam::pool::VxlanMode;

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
pub fn guard(prefix: &IpNet, pools: &[crate::ipam::Pool]) -> Result<(), Guarded> {
    let inside: Vec<&crate::ipam::Pool> =
        pools.iter().filter(|p| p.cidr.contains(prefix)).collect();
    if inside.is_empty() {
        return Err(Guarded::OutsidePools);
    }
    let shortest = inside
        .iter()
        .flat_map(|p| std::iter::once(p.block_size).chain(p.previous_block_sizes.iter().copied()))
        .min()
        .unwrap_or(u8::MAX);
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

/// This node's side of the underlay (from `uplinks`, `[routes] node_addresses` and `[vxlan]`):
/// what routes leave through.
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
    fn local(&self, family: vxlan::Underlay, first: Option<&Uplink>) -> Option<IpAddr> {
        let of_family = |a: &IpAddr| vxlan::Underlay::of(*a) == family;
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
    Vxlan(vxlan::Underlay),
}

/// What the kernel should have for a set of [`RemoteRoute`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Destination → (gateway, how).
    pub routes: BTreeMap<IpNet, (IpAddr, Via)>,
    /// The VXLAN devices some route needs, with the peers each must reach.
    pub devices: BTreeMap<vxlan::Underlay, (VxlanSpec, BTreeSet<IpAddr>)>,
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
        let family = vxlan::Underlay::of(r.next_hop);
        if vxlan::Underlay::of(r.prefix.addr()) != family {
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
                let spec = VxlanSpec {
                    name: family.device(),
                    vni: underlay.vxlan.vni,
                    port: underlay.vxlan.port,
                    local,
                    underlay: up.index,
                    mtu: up.mtu.saturating_sub(family.overhead()),
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

/// Routes to other nodes and what carries them, desired and as last applied.
#[derive(Debug, Default)]
pub struct Remote {
    pub(super) desired: BTreeMap<IpNet, RemoteRoute>,
    /// Whether `desired` is the whole truth (stale routes may go).
    pub(super) complete: bool,
    pub(super) underlay: Underlay,
    /// The current desired set was applied fully: what a later pass finds wrong drifted.
    pub(super) applied: bool,
    /// The last plan's problems (logged when they change).
    pub(super) problems: BTreeMap<IpNet, String>,
}

impl Remote {
    pub fn new(underlay: Underlay) -> Self {
        Self {
            underlay,
            ..Self::default()
        }
    }

    /// Nothing to add and nothing that may be removed: no kernel access needed.
    pub(super) fn idle(&self) -> bool {
        self.desired.is_empty() && !self.complete
    }

    /// Reads the kernel and writes what differs from the plan; what was written, as repairs.
    pub(super) fn sync<K: HostKernel>(
        &mut self,
        kernel: &mut K,
    ) -> Result<Vec<Repair>, ReconcileError> {
        if self.idle() {
            return Ok(Vec::new());
        }
        let mut uplinks = Vec::with_capacity(self.underlay.uplinks.len());
        for name in &self.underlay.uplinks {
            uplinks.push(
                kernel
                    .uplink(name)
                    .map_err(kernel_err(format!("reading uplink {name}")))?,
            );
        }
        let plan = plan(&self.desired, &self.underlay, &uplinks);
        self.report_problems(&plan.problems);
        let mut done = Vec::new();
        let devices = sync_devices(kernel, &plan, self.complete, &mut done)?;
        sync_routes(kernel, &plan, &devices, self.complete, &mut done)?;
        if self.complete {
            for family in [vxlan::Underlay::V4, vxlan::Underlay::V6] {
                let name = family.device();
                if plan.devices.contains_key(&family)
                    || kernel
                        .vxlan(name)
                        .map_err(kernel_err(format!("reading {name}")))?
                        .is_none()
                {
                    continue;
                }
                kernel
                    .delete_link(name)
                    .map_err(kernel_err(format!("deleting {name}")))?;
                done.push(Repair {
                    kind: KIND_DEVICE,
                    what: format!("{name} removed: no route needs it"),
                });
            }
        }
        Ok(done)
    }

    fn report_problems(&mut self, problems: &BTreeMap<IpNet, String>) {
        for (prefix, why) in problems {
            if self.problems.get(prefix) != Some(why) {
                tracing::warn!(%prefix, problem = %why, "route to another node not programmed");
            }
        }
        self.problems = problems.clone();
    }
}

/// Repair kinds (`calix_repairs_total{kind}`).
pub const KIND_ROUTE: &str = "node_route";
pub const KIND_DEVICE: &str = "vxlan_device";
pub const KIND_FDB: &str = "vxlan_fdb";
pub const KIND_NEIGH: &str = "vxlan_neigh";

/// The VXLAN devices the plan needs, created or repaired, with their entries; their indexes.
fn sync_devices<K: HostKernel>(
    kernel: &mut K,
    plan: &Plan,
    complete: bool,
    done: &mut Vec<Repair>,
) -> Result<BTreeMap<vxlan::Underlay, u32>, ReconcileError> {
    let mut indexes = BTreeMap::new();
    for (family, (spec, peers)) in &plan.devices {
        let name = spec.name;
        let have = kernel
            .vxlan(name)
            .map_err(kernel_err(format!("reading {name}")))?;
        let create = |kernel: &mut K, done: &mut Vec<Repair>, why: String| {
            let index = kernel
                .create_vxlan(spec)
                .map_err(kernel_err(format!("creating {name}")))?;
            done.push(Repair {
                kind: KIND_DEVICE,
                what: why,
            });
            Ok::<u32, ReconcileError>(index)
        };
        let index = match have {
            None => create(kernel, done, format!("{name} was missing"))?,
            Some(link) => match link.mismatch(spec) {
                Some(why) => {
                    kernel
                        .delete_link(name)
                        .map_err(kernel_err(format!("deleting {name}")))?;
                    create(kernel, done, format!("{name} re-created: {why}"))?
                }
                None => {
                    if link.mtu != Some(spec.mtu) {
                        kernel
                            .set_mtu(link.index, spec.mtu)
                            .map_err(kernel_err(format!("setting {name}'s MTU")))?;
                        done.push(Repair {
                            kind: KIND_DEVICE,
                            what: format!("{name} had MTU {:?}, want {}", link.mtu, spec.mtu),
                        });
                    }
                    if !link.up {
                        kernel
                            .set_up(link.index)
                            .map_err(kernel_err(format!("setting {name} up")))?;
                        done.push(Repair {
                            kind: KIND_DEVICE,
                            what: format!("{name} was down"),
                        });
                    }
                    link.index
                }
            },
        };
        sync_entries(kernel, name, index, peers, complete, done)?;
        indexes.insert(*family, index);
    }
    Ok(indexes)
}

/// Device `index`'s forwarding and neighbour entries: one of each per peer.
fn sync_entries<K: HostKernel>(
    kernel: &mut K,
    name: &str,
    index: u32,
    peers: &BTreeSet<IpAddr>,
    complete: bool,
    done: &mut Vec<Repair>,
) -> Result<(), ReconcileError> {
    let fdb: BTreeSet<FdbEntry> = kernel
        .fdb(index)
        .map_err(kernel_err(format!("reading {name}'s forwarding entries")))?
        .into_iter()
        .collect();
    let want_fdb: BTreeSet<FdbEntry> = peers.iter().map(|p| FdbEntry::of_peer(*p)).collect();
    for e in want_fdb.difference(&fdb) {
        kernel
            .add_fdb(index, e)
            .map_err(kernel_err(format!("adding {name}'s entry for {}", e.dst)))?;
        done.push(Repair {
            kind: KIND_FDB,
            what: format!(
                "{name}: {} dst {} was missing",
                calix_kernel::mac::format(&e.mac),
                e.dst
            ),
        });
    }
    if complete {
        for e in fdb.difference(&want_fdb) {
            // An entry of the same MAC was replaced above.
            if want_fdb.iter().any(|w| w.mac == e.mac) {
                continue;
            }
            kernel
                .delete_fdb(index, e)
                .map_err(kernel_err(format!("deleting {name}'s entry for {}", e.dst)))?;
            done.push(Repair {
                kind: KIND_FDB,
                what: format!("{name}: stale entry for {} removed", e.dst),
            });
        }
    }
    let neigh = kernel
        .permanent_neighbours(index)
        .map_err(kernel_err(format!("reading {name}'s neighbours")))?;
    for p in peers {
        let mac = vxlan::vtep_mac(*p);
        if neigh.get(p) == Some(&mac) {
            continue;
        }
        kernel
            .set_neighbour(index, *p, mac)
            .map_err(kernel_err(format!("adding {name}'s neighbour {p}")))?;
        done.push(Repair {
            kind: KIND_NEIGH,
            what: format!(
                "{name}: neighbour {p} was {}",
                neigh
                    .get(p)
                    .map_or("missing".into(), calix_kernel::mac::format)
            ),
        });
    }
    if complete {
        for ip in neigh.keys().filter(|ip| !peers.contains(ip)) {
            kernel
                .delete_neighbour(index, *ip)
                .map_err(kernel_err(format!("deleting {name}'s neighbour {ip}")))?;
            done.push(Repair {
                kind: KIND_NEIGH,
                what: format!("{name}: stale neighbour {ip} removed"),
            });
        }
    }
    Ok(())
}

/// The routes of the plan (devices resolved to `devices`' indexes), added or replaced; with
/// `complete`, calix's other routes to nodes removed. A route to the same destination that is
/// not calix's (or is a pod's host route) is left alone and reported.
fn sync_routes<K: HostKernel>(
    kernel: &mut K,
    plan: &Plan,
    devices: &BTreeMap<vxlan::Underlay, u32>,
    complete: bool,
    done: &mut Vec<Repair>,
) -> Result<(), ReconcileError> {
    let have = kernel
        .node_routes()
        .map_err(kernel_err("reading the routes to other nodes"))?;
    // By destination: thousands of routes (hundreds of peers' blocks) stay a linear pass.
    let mut have_by_dst: BTreeMap<IpNet, Vec<NodeRoute>> = BTreeMap::new();
    for h in &have {
        have_by_dst.entry(h.dst).or_default().push(*h);
    }
    let mut want: BTreeMap<IpNet, NodeRoute> = BTreeMap::new();
    for (dst, (gateway, via)) in &plan.routes {
        let (oif, onlink) = match via {
            Via::Uplink(i) => (*i, false),
            Via::Vxlan(f) => match devices.get(f) {
                Some(i) => (*i, true),
                None => continue,
            },
        };
        want.insert(
            *dst,
            NodeRoute {
                dst: *dst,
                gateway: *gateway,
                oif,
                onlink,
            },
        );
    }
    let mut conflict = None;
    for w in want.values() {
        let ours = have_by_dst.get(&w.dst).map(Vec::as_slice).unwrap_or(&[]);
        if ours.contains(w) {
            continue;
        }
        match kernel.add_node_route(w, !ours.is_empty()) {
            Ok(()) => done.push(Repair {
                kind: KIND_ROUTE,
                what: match ours.first() {
                    Some(o) => format!("{o} replaced by {w}"),
                    None => format!("{w} was missing"),
                },
            }),
            // Not ours: left alone; the others still go in, and this one is retried.
            Err(e @ NetlinkError::RouteExists { .. }) => {
                conflict.get_or_insert((w.to_string(), e));
            }
            Err(e) => return Err(kernel_err(format!("adding {w}"))(e)),
        }
    }
    if complete {
        for h in have.iter().filter(|h| !want.contains_key(&h.dst)) {
            kernel
                .delete_node_route(h)
                .map_err(kernel_err(format!("deleting {h}")))?;
            done.push(Repair {
                kind: KIND_ROUTE,
                what: format!("stale {h} removed"),
            });
        }
    }
    match conflict {
        Some((w, e)) => Err(kernel_err(format!(
            "adding {w}: another route (not calix's) has that destination"
        ))(e)),
        None => Ok(()),
    }
}
