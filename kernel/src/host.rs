//! The node's kernel as the agent's reconcilers see it: a narrow, synchronous trait over what
//! they read and repair (links, calix's host routes, sysctls, tc filters; the uplinks, routes
//! to other nodes, the VXLAN devices and their entries), with the real
//! implementation over netlink and `/proc/sys/net` ([`NetlinkHost`]) and an in-memory one for
//! unit tests without root ([`FakeHost`]).
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_route::route::RouteHeader;

use crate::netlink::{self, BpfFilter, Family, NetlinkError, ROUTE_PROTO};
use crate::netns::{self, NetnsError};
use crate::node_route::{self, NodeRoute};
use crate::pod::HostRoute;
use crate::vxlan::{self, FdbEntry, VxlanInfo, VxlanLink, VxlanSpec};

/// A link as the reconcilers need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    /// Administratively up.
    pub up: bool,
    /// `IFLA_IFALIAS` (calix's owner mark on host veths).
    pub alias: Option<String>,
}

/// An uplink as the route reconciler needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uplink {
    pub index: u32,
    pub mtu: u32,
    /// Its global-scope addresses, both families, in the kernel's order (its subnets: the
    /// next hops routes reach directly; the first of each family: the node's own address).
    pub addresses: Vec<IpNet>,
}

/// What the reconcilers do to the node's kernel. Every method acts on the namespace the
/// implementation was made in; writes are only ever made for a difference found by a read.
pub trait HostKernel: Send {
    /// The link called `name`; `None` when there is none.
    fn link(&mut self, name: &str) -> Result<Option<Link>, NetlinkError>;
    /// Sets link `index` up.
    fn set_up(&mut self, index: u32) -> Result<(), NetlinkError>;
    /// calix's host routes (protocol [`ROUTE_PROTO`], no gateway) in the main table, both
    /// families, as (destination, output interface).
    fn routes(&mut self) -> Result<Vec<HostRoute>, NetlinkError>;
    fn add_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError>;
    fn delete_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError>;
    /// The sysctl at `/proc/sys/net/<path>`, trimmed; `None` when it does not exist.
    fn sysctl(&mut self, path: &str) -> Result<Option<String>, NetlinkError>;
    fn set_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError>;
    /// The BPF filters on link `index`'s clsact hooks.
    fn bpf_filters(&mut self, index: u32) -> Result<Vec<BpfFilter>, NetlinkError>;

    /// The link called `name` with its MTU and global addresses; `None` when there is none.
    fn uplink(&mut self, name: &str) -> Result<Option<Uplink>, NetlinkError>;
    /// calix's routes to other nodes ([`NodeRoute`]: protocol [`ROUTE_PROTO`], a gateway).
    fn node_routes(&mut self) -> Result<Vec<NodeRoute>, NetlinkError>;
    /// Adds `route`; with `replace`, in place of the route to the same destination.
    fn add_node_route(&mut self, route: &NodeRoute, replace: bool) -> Result<(), NetlinkError>;
    fn delete_node_route(&mut self, route: &NodeRoute) -> Result<(), NetlinkError>;
    /// The link called `name`, with its VXLAN attributes if it is a VXLAN device.
    fn vxlan(&mut self, name: &str) -> Result<Option<VxlanLink>, NetlinkError>;
    /// Creates a VXLAN device, up; its index.
    fn create_vxlan(&mut self, spec: &VxlanSpec) -> Result<u32, NetlinkError>;
    /// Deletes the link called `name` (with its routes and entries); `false` when there was
    /// none.
    fn delete_link(&mut self, name: &str) -> Result<bool, NetlinkError>;
    fn set_mtu(&mut self, index: u32, mtu: u32) -> Result<(), NetlinkError>;
    /// The forwarding entries of VXLAN device `index` that send to a remote address.
    fn fdb(&mut self, index: u32) -> Result<Vec<FdbEntry>, NetlinkError>;
    /// Adds (or replaces) a permanent forwarding entry.
    fn add_fdb(&mut self, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError>;
    fn delete_fdb(&mut self, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError>;
    /// The permanent neighbour entries of link `index` (both families), address → MAC.
    fn permanent_neighbours(
        &mut self,
        index: u32,
    ) -> Result<BTreeMap<IpAddr, [u8; 6]>, NetlinkError>;
    /// Adds (or replaces) a permanent neighbour entry.
    fn set_neighbour(&mut self, index: u32, ip: IpAddr, mac: [u8; 6]) -> Result<(), NetlinkError>;
    fn delete_neighbour(&mut self, index: u32, ip: IpAddr) -> Result<(), NetlinkError>;
}

/// The real kernel: rtnetlink on a runtime of its own (the reconcilers run on a thread of
/// their own, never inside the agent's async runtime) and `/proc/sys/net` of the namespace it
/// was made in.
pub struct NetlinkHost {
    rt: tokio::runtime::Runtime,
    handle: rtnetlink::Handle,
}

impl NetlinkHost {
    /// Opens netlink in the calling thread's network namespace.
    pub fn new() -> Result<Self, NetlinkError> {
        let socket_err = |source| {
            NetlinkError::Netns(NetnsError::Netlink {
                path: netns::THREAD_SELF_NETNS.into(),
                source,
            })
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(socket_err)?;
        // The socket is made inside the runtime: rtnetlink registers it with the reactor.
        let (connection, handle, _) = rt
            .block_on(async { rtnetlink::new_connection() })
            .map_err(socket_err)?;
        rt.spawn(connection);
        Ok(Self { rt, handle })
    }
}

impl HostKernel for NetlinkHost {
    fn link(&mut self, name: &str) -> Result<Option<Link>, NetlinkError> {
        let details = self
            .rt
            .block_on(netlink::link_details(&self.handle, name))?;
        Ok(details.map(|d| Link {
            index: d.index,
            up: d.up,
            alias: d.alias,
        }))
    }

    fn set_up(&mut self, index: u32) -> Result<(), NetlinkError> {
        self.rt.block_on(netlink::set_link_up(&self.handle, index))
    }

    fn routes(&mut self) -> Result<Vec<HostRoute>, NetlinkError> {
        let main = u32::from(RouteHeader::RT_TABLE_MAIN);
        let mut out = Vec::new();
        for family in [Family::V4, Family::V6] {
            let routes = self.rt.block_on(netlink::routes(&self.handle, family))?;
            out.extend(
                routes
                    .into_iter()
                    .filter(|r| r.table == main && r.protocol == ROUTE_PROTO && r.gateway.is_none())
                    .filter_map(|r| {
                        Some(HostRoute {
                            dst: r.dst,
                            oif: r.oif?,
                        })
                    }),
            );
        }
        Ok(out)
    }

    fn add_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError> {
        let what = format!("{} dev {}", route.dst, route.oif);
        self.rt
            .block_on(netlink::add_route(&self.handle, route.message(), &what))
    }

    fn delete_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError> {
        let what = format!("{} dev {}", route.dst, route.oif);
        self.rt
            .block_on(netlink::delete_route_message(
                &self.handle,
                route.message(),
                &what,
            ))
            .map(|_| ())
    }

    fn sysctl(&mut self, path: &str) -> Result<Option<String>, NetlinkError> {
        match netns::read_sysctl(format!("/proc/sys/net/{path}")) {
            Ok(v) => Ok(Some(v)),
            Err(NetnsError::ReadSysctl { source, .. })
                if source.kind() == io::ErrorKind::NotFound =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn set_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError> {
        Ok(netns::write_sysctl(format!("/proc/sys/net/{path}"), value)?)
    }

    fn bpf_filters(&mut self, index: u32) -> Result<Vec<BpfFilter>, NetlinkError> {
        self.rt.block_on(netlink::bpf_filters(&self.handle, index))
    }

    fn uplink(&mut self, name: &str) -> Result<Option<Uplink>, NetlinkError> {
        let handle = &self.handle;
        self.rt.block_on(async {
            let Some(link) = netlink::link_details(handle, name).await? else {
                return Ok(None);
            };
            let addresses = netlink::addresses(handle, link.index)
                .await?
                .into_iter()
                .filter(|a| a.scope == 0)
                .map(|a| a.address)
                .collect();
            Ok(Some(Uplink {
                index: link.index,
                mtu: link.mtu.unwrap_or(1500),
                addresses,
            }))
        })
    }

    fn node_routes(&mut self) -> Result<Vec<NodeRoute>, NetlinkError> {
        self.rt.block_on(node_route::list(&self.handle))
    }

    fn add_node_route(&mut self, route: &NodeRoute, replace: bool) -> Result<(), NetlinkError> {
        self.rt
            .block_on(node_route::add(&self.handle, route, replace))
    }

    fn delete_node_route(&mut self, route: &NodeRoute) -> Result<(), NetlinkError> {
        self.rt
            .block_on(node_route::delete(&self.handle, route))
            .map(|_| ())
    }

    fn vxlan(&mut self, name: &str) -> Result<Option<VxlanLink>, NetlinkError> {
        self.rt.block_on(vxlan::get(&self.handle, name))
    }

    fn create_vxlan(&mut self, spec: &VxlanSpec) -> Result<u32, NetlinkError> {
        self.rt.block_on(vxlan::create(&self.handle, spec))
    }

    fn delete_link(&mut self, name: &str) -> Result<bool, NetlinkError> {
        self.rt.block_on(netlink::delete_link(&self.handle, name))
    }

    fn set_mtu(&mut self, index: u32, mtu: u32) -> Result<(), NetlinkError> {
        self.rt.block_on(vxlan::set_mtu(&self.handle, index, mtu))
    }

    fn fdb(&mut self, index: u32) -> Result<Vec<FdbEntry>, NetlinkError> {
        self.rt.block_on(vxlan::fdb(&self.handle, index))
    }

    fn add_fdb(&mut self, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError> {
        self.rt.block_on(vxlan::add_fdb(&self.handle, index, entry))
    }

    fn delete_fdb(&mut self, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError> {
        self.rt
            .block_on(vxlan::delete_fdb(&self.handle, index, entry))
            .map(|_| ())
    }

    fn permanent_neighbours(
        &mut self,
        index: u32,
    ) -> Result<BTreeMap<IpAddr, [u8; 6]>, NetlinkError> {
        let mut out = BTreeMap::new();
        for family in [Family::V4, Family::V6] {
            let entries = self
                .rt
                .block_on(netlink::neighbours(&self.handle, index, family))?;
            out.extend(
                entries
                    .into_iter()
                    .filter(|n| n.permanent)
                    .filter_map(|n| Some((n.ip, n.mac?))),
            );
        }
        Ok(out)
    }

    fn set_neighbour(&mut self, index: u32, ip: IpAddr, mac: [u8; 6]) -> Result<(), NetlinkError> {
        self.rt
            .block_on(vxlan::set_neighbour(&self.handle, index, ip, mac))
    }

    fn delete_neighbour(&mut self, index: u32, ip: IpAddr) -> Result<(), NetlinkError> {
        self.rt
            .block_on(vxlan::delete_neighbour(&self.handle, index, ip))
            .map(|_| ())
    }
}

/// An in-memory kernel for unit tests: links, calix's routes, sysctls and filters are plain
/// collections the test sets up and inspects; every write is logged in [`FakeHost::writes`].
#[derive(Debug, Default, Clone)]
pub struct FakeHost {
    pub links: BTreeMap<String, Link>,
    pub routes: BTreeSet<HostRoute>,
    /// Path under `/proc/sys/net/` → value.
    pub sysctls: BTreeMap<String, String>,
    pub filters: BTreeMap<u32, Vec<BpfFilter>>,
    /// Links with an MTU and addresses (uplinks), by name; also in `links`.
    pub uplinks: BTreeMap<String, Uplink>,
    /// calix's routes to other nodes.
    pub node_routes: BTreeSet<NodeRoute>,
    /// VXLAN devices (and links of their names), by name; also in `links`.
    pub vxlans: BTreeMap<String, VxlanLink>,
    /// Forwarding entries by device index.
    pub fdb: BTreeMap<u32, BTreeSet<FdbEntry>>,
    /// Permanent neighbour entries by device index.
    pub neighbours: BTreeMap<u32, BTreeMap<IpAddr, [u8; 6]>>,
    /// Every write made, in order (`"route add 10.0.0.1/32 dev 7"`, `"sysctl x=1"`...).
    pub writes: Vec<String>,
    /// Calls to fail, by method name (`"add_route"`...), each failing once per entry.
    pub fail: Vec<&'static str>,
}

impl FakeHost {
    /// A link called `name` with `index`, up.
    pub fn add_link(&mut self, name: &str, index: u32) {
        self.links.insert(
            name.to_string(),
            Link {
                index,
                up: true,
                alias: None,
            },
        );
    }

    /// An uplink called `name` with `index`, `mtu` and `addresses` (e.g. "172.31.1.1/24").
    pub fn add_uplink(&mut self, name: &str, index: u32, mtu: u32, addresses: &[&str]) {
        self.add_link(name, index);
        let addresses = addresses
            .iter()
            .map(|a| a.parse().expect("a CIDR"))
            .collect();
        self.uplinks.insert(
            name.to_string(),
            Uplink {
                index,
                mtu,
                addresses,
            },
        );
    }

    fn index_exists(&self, index: u32) -> bool {
        self.links.values().any(|l| l.index == index)
    }

    fn failing(&mut self, call: &'static str) -> Result<(), NetlinkError> {
        match self.fail.iter().position(|c| *c == call) {
            Some(i) => {
                self.fail.remove(i);
                Err(NetlinkError::Netns(NetnsError::Netlink {
                    path: "(fake)".into(),
                    source: io::Error::other(format!("{call} failed (fake)")),
                }))
            }
            None => Ok(()),
        }
    }
}

impl HostKernel for FakeHost {
    fn link(&mut self, name: &str) -> Result<Option<Link>, NetlinkError> {
        self.failing("link")?;
        Ok(self.links.get(name).cloned())
    }

    fn set_up(&mut self, index: u32) -> Result<(), NetlinkError> {
        self.failing("set_up")?;
        let link = self
            .links
            .values_mut()
            .find(|l| l.index == index)
            .ok_or(NetlinkError::IndexNotFound { index })?;
        link.up = true;
        self.writes.push(format!("link {index} up"));
        Ok(())
    }

    fn routes(&mut self) -> Result<Vec<HostRoute>, NetlinkError> {
        self.failing("routes")?;
        Ok(self.routes.iter().copied().collect())
    }

    fn add_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError> {
        self.failing("add_route")?;
        if !self.links.values().any(|l| l.index == route.oif) {
            return Err(NetlinkError::IndexNotFound { index: route.oif });
        }
        if self.routes.iter().any(|r| r.dst == route.dst) {
            return Err(NetlinkError::RouteExists { dst: route.dst });
        }
        self.routes.insert(*route);
        self.writes
            .push(format!("route add {} dev {}", route.dst, route.oif));
        Ok(())
    }

    fn delete_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError> {
        self.failing("delete_route")?;
        self.routes.remove(route);
        self.writes
            .push(format!("route del {} dev {}", route.dst, route.oif));
        Ok(())
    }

    fn sysctl(&mut self, path: &str) -> Result<Option<String>, NetlinkError> {
        self.failing("sysctl")?;
        Ok(self.sysctls.get(path).cloned())
    }

    fn set_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError> {
        self.failing("set_sysctl")?;
        self.sysctls.insert(path.to_string(), value.to_string());
        self.writes.push(format!("sysctl {path}={value}"));
        Ok(())
    }

    fn bpf_filters(&mut self, index: u32) -> Result<Vec<BpfFilter>, NetlinkError> {
        self.failing("bpf_filters")?;
        Ok(self.filters.get(&index).cloned().unwrap_or_default())
    }

    fn uplink(&mut self, name: &str) -> Result<Option<Uplink>, NetlinkError> {
        self.failing("uplink")?;
        Ok(self.uplinks.get(name).cloned())
    }

    fn node_routes(&mut self) -> Result<Vec<NodeRoute>, NetlinkError> {
        self.failing("node_routes")?;
        Ok(self.node_routes.iter().copied().collect())
    }

    fn add_node_route(&mut self, route: &NodeRoute, replace: bool) -> Result<(), NetlinkError> {
        self.failing("add_node_route")?;
        if !self.index_exists(route.oif) {
            return Err(NetlinkError::IndexNotFound { index: route.oif });
        }
        let same_dst: Vec<NodeRoute> = self
            .node_routes
            .iter()
            .filter(|r| r.dst == route.dst)
            .copied()
            .collect();
        let host_route = self.routes.iter().any(|r| r.dst == route.dst);
        if (!same_dst.is_empty() || host_route) && !replace {
            return Err(NetlinkError::RouteExists { dst: route.dst });
        }
        for r in same_dst {
            self.node_routes.remove(&r);
        }
        self.node_routes.insert(*route);
        let op = if replace { "replace" } else { "add" };
        self.writes.push(format!("route {op} {route}"));
        Ok(())
    }

    fn delete_node_route(&mut self, route: &NodeRoute) -> Result<(), NetlinkError> {
        self.failing("delete_node_route")?;
        self.node_routes.remove(route);
        self.writes.push(format!("route del {route}"));
        Ok(())
    }

    fn vxlan(&mut self, name: &str) -> Result<Option<VxlanLink>, NetlinkError> {
        self.failing("vxlan")?;
        Ok(self.vxlans.get(name).cloned())
    }

    fn create_vxlan(&mut self, spec: &VxlanSpec) -> Result<u32, NetlinkError> {
        self.failing("create_vxlan")?;
        if self.links.contains_key(spec.name) {
            return Err(NetlinkError::Exists {
                name: spec.name.to_string(),
            });
        }
        if !self.index_exists(spec.underlay) {
            return Err(NetlinkError::IndexNotFound {
                index: spec.underlay,
            });
        }
        let index = self.links.values().map(|l| l.index).max().unwrap_or(0) + 100;
        self.add_link(spec.name, index);
        self.vxlans.insert(
            spec.name.to_string(),
            VxlanLink {
                index,
                up: true,
                mtu: Some(spec.mtu),
                mac: Some(spec.mac()),
                vxlan: Some(VxlanInfo {
                    vni: Some(spec.vni),
                    port: Some(spec.port),
                    local: Some(spec.local),
                    underlay: Some(spec.underlay),
                    learning: Some(false),
                }),
            },
        );
        self.writes.push(format!(
            "vxlan add {} vni {} port {} local {} dev {} mtu {}",
            spec.name, spec.vni, spec.port, spec.local, spec.underlay, spec.mtu
        ));
        Ok(index)
    }

    fn delete_link(&mut self, name: &str) -> Result<bool, NetlinkError> {
        self.failing("delete_link")?;
        let Some(link) = self.links.remove(name) else {
            return Ok(false);
        };
        // The kernel takes the link's routes and entries with it.
        self.vxlans.remove(name);
        self.uplinks.remove(name);
        self.node_routes.retain(|r| r.oif != link.index);
        self.routes.retain(|r| r.oif != link.index);
        self.fdb.remove(&link.index);
        self.neighbours.remove(&link.index);
        self.writes.push(format!("link del {name}"));
        Ok(true)
    }

    fn set_mtu(&mut self, index: u32, mtu: u32) -> Result<(), NetlinkError> {
        self.failing("set_mtu")?;
        let link = self
            .vxlans
            .values_mut()
            .find(|l| l.index == index)
            .ok_or(NetlinkError::IndexNotFound { index })?;
        link.mtu = Some(mtu);
        self.writes.push(format!("link {index} mtu {mtu}"));
        Ok(())
    }

    fn fdb(&mut self, index: u32) -> Result<Vec<FdbEntry>, NetlinkError> {
        self.failing("fdb")?;
        Ok(self
            .fdb
            .get(&index)
            .map(|e| e.iter().copied().collect())
            .unwrap_or_default())
    }

    fn add_fdb(&mut self, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError> {
        self.failing("add_fdb")?;
        if !self.index_exists(index) {
            return Err(NetlinkError::IndexNotFound { index });
        }
        let entries = self.fdb.entry(index).or_default();
        // Replace: one destination per MAC.
        entries.retain(|e| e.mac != entry.mac);
        entries.insert(*entry);
        self.writes.push(format!(
            "fdb add {} dst {} dev {index}",
            crate::mac::format(&entry.mac),
            entry.dst
        ));
        Ok(())
    }

    fn delete_fdb(&mut self, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError> {
        self.failing("delete_fdb")?;
        if let Some(e) = self.fdb.get_mut(&index) {
            e.remove(entry);
        }
        self.writes.push(format!(
            "fdb del {} dst {} dev {index}",
            crate::mac::format(&entry.mac),
            entry.dst
        ));
        Ok(())
    }

    fn permanent_neighbours(
        &mut self,
        index: u32,
    ) -> Result<BTreeMap<IpAddr, [u8; 6]>, NetlinkError> {
        self.failing("permanent_neighbours")?;
        Ok(self.neighbours.get(&index).cloned().unwrap_or_default())
    }

    fn set_neighbour(&mut self, index: u32, ip: IpAddr, mac: [u8; 6]) -> Result<(), NetlinkError> {
        self.failing("set_neighbour")?;
        if !self.index_exists(index) {
            return Err(NetlinkError::IndexNotFound { index });
        }
        self.neighbours.entry(index).or_default().insert(ip, mac);
        self.writes.push(format!(
            "neigh replace {ip} lladdr {} dev {index}",
            crate::mac::format(&mac)
        ));
        Ok(())
    }

    fn delete_neighbour(&mut self, index: u32, ip: IpAddr) -> Result<(), NetlinkError> {
        self.failing("delete_neighbour")?;
        if let Some(n) = self.neighbours.get_mut(&index) {
            n.remove(&ip);
        }
        self.writes.push(format!("neigh del {ip} dev {index}"));
        Ok(())
    }
}
