//! Routes to pods on other nodes in the kernel: the reconciler's part. What route
//! distribution wants and the pure plan of what the kernel should have for it are
//! `calix_core::reconcile::remote`'s ([`RemoteRoute`], [`plan`]); each planned route becomes
//! one kernel route ([`NodeRoute`], protocol 202), each planned VXLAN device `vxlan.calix` or
//! `vxlan-v6.calix` ([`device_spec`]: the kernel's name, and the MTU less the encapsulation).
//!
//! [`Remote::sync`] reads the kernel and writes the difference in dependency order (devices
//! and their entries, then routes; stale routes, then devices no route needs). Without a
//! complete set (an agent re-learning after a restart) nothing is removed: missing routes are
//! added, stale ones stay.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use calix_core::reconcile::remote::{
    plan, Family, Plan, RemoteRoute, Underlay, Uplink, Via, VxlanDevice,
};
use calix_kernel::host::HostKernel;
use calix_kernel::netlink::NetlinkError;
use calix_kernel::node_route::NodeRoute;
use calix_kernel::vxlan::{self, FdbEntry, VxlanSpec};
use ipnet::IpNet;

use super::{kernel_err, ReconcileError, Repair};

/// The kernel's underlay family of `f` (its VXLAN device's name, the encapsulation's size).
pub fn underlay_of(f: Family) -> vxlan::Underlay {
    match f {
        Family::V4 => vxlan::Underlay::V4,
        Family::V6 => vxlan::Underlay::V6,
    }
}

/// The kernel's VXLAN device for a planned one of family `f`: its name, and the uplink's MTU
/// less the encapsulation.
pub fn device_spec(f: Family, d: &VxlanDevice) -> VxlanSpec {
    let family = underlay_of(f);
    VxlanSpec {
        name: family.device(),
        vni: d.vni,
        port: d.port,
        local: d.local,
        underlay: d.uplink,
        mtu: d.uplink_mtu.saturating_sub(family.overhead()),
    }
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
                    .map_err(kernel_err(format!("reading uplink {name}")))?
                    .map(|u| Uplink {
                        index: u.index,
                        mtu: u.mtu,
                        addresses: u.addresses,
                    }),
            );
        }
        let plan = plan(&self.desired, &self.underlay, &uplinks);
        self.report_problems(&plan.problems);
        let mut done = Vec::new();
        let devices = sync_devices(kernel, &plan, self.complete, &mut done)?;
        sync_routes(kernel, &plan, &devices, self.complete, &mut done)?;
        if self.complete {
            for family in [Family::V4, Family::V6] {
                let name = underlay_of(family).device();
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
) -> Result<BTreeMap<Family, u32>, ReconcileError> {
    let mut indexes = BTreeMap::new();
    for (family, (device, peers)) in &plan.devices {
        let spec = &device_spec(*family, device);
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
    devices: &BTreeMap<Family, u32>,
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
