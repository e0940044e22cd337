//! The node's kernel as the agent's reconcilers see it: a narrow, synchronous trait over what
//! they read and repair (links, calix's host routes, sysctls, tc filters), with the real
//! implementation over netlink and `/proc/sys/net` ([`NetlinkHost`]) and an in-memory one for
//! unit tests without root ([`FakeHost`]).
use std::collections::{BTreeMap, BTreeSet};
use std::io;

use netlink_packet_route::route::RouteHeader;

use crate::netlink::{self, BpfFilter, Family, NetlinkError, ROUTE_PROTO};
use crate::netns::{self, NetnsError};
use crate::pod::HostRoute;

/// A link as the reconcilers need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    /// Administratively up.
    pub up: bool,
    /// `IFLA_IFALIAS` (calix's owner mark on host veths).
    pub alias: Option<String>,
}

/// What the reconcilers do to the node's kernel. Every method acts on the namespace the
/// implementation was made in; writes are only ever made for a difference found by a read.
pub trait HostKernel: Send {
    /// The link called `name`; `None` when there is none.
    fn link(&mut self, name: &str) -> Result<Option<Link>, NetlinkError>;
    /// Sets link `index` up.
    fn set_up(&mut self, index: u32) -> Result<(), NetlinkError>;
    /// calix's routes (protocol [`ROUTE_PROTO`]) in the main table, both families, as
    /// (destination, output interface).
    fn routes(&mut self) -> Result<Vec<HostRoute>, NetlinkError>;
    fn add_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError>;
    fn delete_route(&mut self, route: &HostRoute) -> Result<(), NetlinkError>;
    /// The sysctl at `/proc/sys/net/<path>`, trimmed; `None` when it does not exist.
    fn sysctl(&mut self, path: &str) -> Result<Option<String>, NetlinkError>;
    fn set_sysctl(&mut self, path: &str, value: &str) -> Result<(), NetlinkError>;
    /// The BPF filters on link `index`'s clsact hooks.
    fn bpf_filters(&mut self, index: u32) -> Result<Vec<BpfFilter>, NetlinkError>;
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
                    .filter(|r| r.table == main && r.protocol == ROUTE_PROTO)
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
}
