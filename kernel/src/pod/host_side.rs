//! The node's side of an attachment: the host veth's sysctls, up, and the host routes to the
//! pod's addresses; and the node-wide settings pods need. The agent keeps these true.
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use netlink_packet_route::route::{RouteMessage, RouteProtocol, RouteScope};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::netlink::{errno, set_link_up_with_mtu, validate_ifname, NetlinkError, ROUTE_PROTO};
use crate::netns;

/// How a host-side setting is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Every time (cheap).
    Always,
    /// Only when it differs: writing it costs the RTNL lock (forwarding, rp_filter,
    /// disable_ipv6), which concurrent ADDs wait for.
    IfChanged,
}

/// One sysctl calix keeps (of a pod's host-side veth, or of the node) and the value it wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSetting {
    /// Under `/proc/sys/net/`, e.g. `ipv4/conf/cali0123456789a/proxy_arp`.
    pub path: String,
    pub value: &'static str,
    pub write: Write,
    /// Absent when the kernel lacks the feature (IPv6 disabled): skipped then.
    pub optional: bool,
}

impl HostSetting {
    /// Its file, `/proc/sys/net/<path>`.
    pub fn file(&self) -> String {
        format!("/proc/sys/net/{}", self.path)
    }
}

/// The node-wide sysctls pods need (relative to `/proc/sys/net`): forwarding on for both
/// families (pods reach each other and the node's uplink through it). The agent sets them at
/// start and keeps them true; IPv6's is optional (a kernel without IPv6).
pub fn node_settings() -> Vec<HostSetting> {
    vec![
        HostSetting {
            path: "ipv4/ip_forward".into(),
            value: "1",
            write: Write::IfChanged,
            optional: false,
        },
        HostSetting {
            path: "ipv6/conf/all/forwarding".into(),
            value: "1",
            write: Write::IfChanged,
            optional: true,
        },
    ]
}

/// The sysctls of a pod's host veth `ifname`, in the order they are written. The contract the
/// plugin applies in ADD ([`configure_host`]) and the agent keeps true.
///
/// - both: `ipv6/conf/<if>/disable_ipv6` = 1 for an IPv4-only pod (else every host veth gets
///   the same link-local address, `ee:ee:…` being every host veth's MAC, and a /128 local
///   route for nothing), 0 with IPv6; skipped when the kernel has no IPv6;
/// - v4: `proxy_arp=1`, `neigh/<if>/proxy_delay=0`, `forwarding=1`, and strict reverse-path
///   filtering `rp_filter=1`: the pod's packets must come from an address whose route leads
///   back out of this veth (kernel mode's IPv4 anti-spoofing besides the agent's nftables
///   table, which also covers `all=2` overruling this; in eBPF mode `from_pod` checks first);
/// - v6: `proxy_ndp=1`, `accept_ra=0`, `accept_dad=0` (the host side's link-local address is
///   the pod's gateway: usable at once), `forwarding=1`.
pub fn host_settings(ifname: &str, v4: bool, v6: bool) -> Vec<HostSetting> {
    let s = |path: String, value, write| HostSetting {
        path,
        value,
        write,
        optional: false,
    };
    let mut out = vec![HostSetting {
        path: format!("ipv6/conf/{ifname}/disable_ipv6"),
        value: if v6 { "0" } else { "1" },
        write: Write::IfChanged,
        optional: true,
    }];
    if v4 {
        out.push(s(
            format!("ipv4/conf/{ifname}/proxy_arp"),
            "1",
            Write::Always,
        ));
        out.push(s(
            format!("ipv4/neigh/{ifname}/proxy_delay"),
            "0",
            Write::Always,
        ));
        out.push(s(
            format!("ipv4/conf/{ifname}/forwarding"),
            "1",
            Write::IfChanged,
        ));
        out.push(s(
            format!("ipv4/conf/{ifname}/rp_filter"),
            "1",
            Write::IfChanged,
        ));
    }
    if v6 {
        out.push(s(
            format!("ipv6/conf/{ifname}/proxy_ndp"),
            "1",
            Write::Always,
        ));
        out.push(s(
            format!("ipv6/conf/{ifname}/accept_ra"),
            "0",
            Write::Always,
        ));
        out.push(s(
            format!("ipv6/conf/{ifname}/accept_dad"),
            "0",
            Write::Always,
        ));
        out.push(s(
            format!("ipv6/conf/{ifname}/forwarding"),
            "1",
            Write::IfChanged,
        ));
    }
    out
}

/// A host route to a pod address: `<addr>/32 dev <veth> scope link proto 202` (IPv6:
/// `<addr>/128 dev <veth> proto 202`), in the main table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostRoute {
    pub dst: IpNet,
    /// The host veth's ifindex.
    pub oif: u32,
}

impl HostRoute {
    /// The routes of a pod with `v4` / `v6` behind the host veth `oif`.
    pub fn of_pod(oif: u32, v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>) -> Vec<HostRoute> {
        let v4 = v4.map(|a| HostRoute {
            dst: IpNet::V4(Ipv4Net::from(a)),
            oif,
        });
        let v6 = v6.map(|a| HostRoute {
            dst: IpNet::V6(Ipv6Net::from(a)),
            oif,
        });
        v4.into_iter().chain(v6).collect()
    }

    /// The netlink message that adds (or deletes) exactly this route.
    pub fn message(&self) -> RouteMessage {
        match self.dst {
            IpNet::V4(n) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(n.addr(), n.prefix_len())
                .output_interface(self.oif)
                .scope(RouteScope::Link)
                .protocol(RouteProtocol::from(ROUTE_PROTO))
                .build(),
            IpNet::V6(n) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(n.addr(), n.prefix_len())
                .output_interface(self.oif)
                .protocol(RouteProtocol::from(ROUTE_PROTO))
                .build(),
        }
    }
}

/// Configures the host side; `host` must act on the calling thread's namespace, because the
/// sysctls are written through that thread's /proc/sys/net: [`host_settings`], link up (with
/// `mtu` when given, in the same request), then the [`HostRoute`]s.
///
/// A route for the same prefix (same table and metric) that is already there is
/// [`NetlinkError::RouteExists`] and is left untouched.
pub async fn configure_host(
    host: &Handle,
    host_ifname: &str,
    host_ifindex: u32,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
    mtu: Option<u32>,
) -> Result<(), NetlinkError> {
    validate_ifname(host_ifname)?;
    for setting in host_settings(host_ifname, v4.is_some(), v6.is_some()) {
        let file = setting.file();
        if setting.optional && !std::path::Path::new(&file).exists() {
            continue;
        }
        match setting.write {
            Write::Always => netns::write_sysctl(file, setting.value)?,
            Write::IfChanged => netns::write_sysctl_if_changed(file, setting.value)?,
        }
    }
    set_link_up_with_mtu(host, host_ifindex, mtu).await?;
    for route in HostRoute::of_pod(host_ifindex, v4, v6) {
        add_host_route(host, route.message(), route.dst, host_ifname).await?;
    }
    Ok(())
}

async fn add_host_route(
    host: &Handle,
    route: RouteMessage,
    dst: IpNet,
    host_ifname: &str,
) -> Result<(), NetlinkError> {
    // `add` sends NLM_F_CREATE|NLM_F_EXCL: an existing route is never replaced.
    match host.route().add(route).execute().await {
        Ok(()) => Ok(()),
        Err(source) if errno(&source) == Some(libc::EEXIST) => {
            Err(NetlinkError::RouteExists { dst })
        }
        Err(source) => Err(NetlinkError::Netlink {
            op: "add route",
            target: format!("{dst} dev {host_ifname}"),
            source,
        }),
    }
}
