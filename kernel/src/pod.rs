//! Wiring a pod, the Calico way (DESIGN.md §2): every kernel side effect of CNI ADD and DEL,
//! plus the reads CHECK needs.
//!
//! ```text
//!   node namespace                               pod namespace
//!   caliXXXXXXXXXXX  ee:ee:ee:ee:ee:ee  <--veth-->  eth0  <ip>/32, <ip6>/128 (nodad)
//!     proxy_arp=1, proxy_delay=0, forwarding=1,      169.254.1.1/32 scope link
//!     rp_filter=1                                    default via 169.254.1.1
//!     (v6: proxy_ndp=1, accept_ra=0, forwarding=1)   default via fe80::ecee:eeff:feee:eeee
//!   <ip>/32 dev caliX scope link proto 202           permanent neighbours for both gateways,
//!   <ip6>/128 dev caliX proto 202                    accept_dad=0
//! ```
//!
//! Order of an ADD: [`create_veth`], [`configure_pod`], [`configure_host`]. If any step fails,
//! [`delete_link`](crate::netlink::delete_link) on the host side undoes all of them: the peer
//! and every route through the veth go with it. DEL is `delete_link` (idempotent) and, for
//! routes that may outlive the link, [`delete_route`](crate::netlink::delete_route).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;

use futures::TryStreamExt;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::NeighbourState;
use netlink_packet_route::route::{RouteHeader, RouteMessage, RouteProtocol, RouteScope};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::netlink::{
    add_route, delete_link, errno, link_details, link_index, netlink_err, routes,
    set_link_up_with_mtu, validate_ifname, Family, NetlinkError, ROUTE_PROTO,
};
use crate::netns::{self, NetNs, NetnsError};

/// MAC address of every host-side veth. Fixed so the pod's IPv6 gateway (its EUI-64 link-local
/// address) is predictable, and so pods can carry a permanent neighbour entry for the gateway.
/// One definition for the programs, the agent and the plugin: calix-common's.
pub use calix_common::HOST_VETH_MAC;

/// The pod's IPv4 gateway: a link-local address nobody owns. The host veth answers ARP for it
/// through proxy ARP, and the pod has a permanent neighbour entry for it anyway.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// The pod's IPv6 gateway: the host veth's own link-local address, `fe80::ecee:eeff:feee:eeee`.
pub const GATEWAY_V6: Ipv6Addr =
    Ipv6Addr::from_bits(u128::from_be_bytes(calix_common::HOST_VETH_LINK_LOCAL));

/// The two ends of a freshly created veth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VethPair {
    /// Index of the host side, in the caller's namespace.
    pub host_ifindex: u32,
    /// Index of the pod side, in the pod's namespace.
    pub pod_ifindex: u32,
    /// MAC of the pod side (the CNI result reports it).
    pub pod_mac: [u8; 6],
}

/// Creates the veth in ONE `RTM_NEWLINK` request (NLM_F_CREATE|NLM_F_EXCL): the host side
/// `host_ifname` in `host`'s namespace with MAC [`HOST_VETH_MAC`], the peer `pod_ifname` born
/// directly in `pod_ns` (never moved: moving links between namespaces serialises concurrent
/// ADDs in the kernel). `mtu`, when given, is set on both sides. A taken name is
/// [`NetlinkError::Exists`]; nothing is reused. Both sides are left down.
///
/// While the pod side has never been up, this also sets its `accept_dad=0` (written from inside
/// `pod_ns`), so none of its IPv6 addresses, link-local included, ever waits for DAD: the only
/// other node on the link is the host side, whose MAC is fixed and different. Skipped when the
/// kernel has no IPv6. If anything after the RTM_NEWLINK fails, the veth is deleted again.
pub async fn create_veth(
    host: &Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
    pod_ifname: &str,
    mtu: Option<u32>,
) -> Result<VethPair, NetlinkError> {
    create_veth_with_handle(host, pod_ns, host_ifname, pod_ifname, mtu)
        .await
        .map(|(pair, _pod)| pair)
}

/// [`create_veth`], also returning a netlink handle in `pod_ns` (for [`configure_pod`]): made
/// on the thread that turned DAD off, so an ADD enters the pod's namespace once.
pub async fn create_veth_with_handle(
    host: &Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
    pod_ifname: &str,
    mtu: Option<u32>,
) -> Result<(VethPair, Handle), NetlinkError> {
    validate_ifname(host_ifname)?;
    validate_ifname(pod_ifname)?;

    let mut peer = LinkMessage::default();
    peer.attributes
        .push(LinkAttribute::IfName(pod_ifname.to_string()));
    // The fd is only read while the request is sent; `pod_ns` outlives this function.
    peer.attributes
        .push(LinkAttribute::NetNsFd(pod_ns.as_raw_fd()));
    let mut message = LinkMessage::default();
    message
        .attributes
        .push(LinkAttribute::IfName(host_ifname.to_string()));
    message
        .attributes
        .push(LinkAttribute::Address(HOST_VETH_MAC.to_vec()));
    if let Some(mtu) = mtu {
        peer.attributes.push(LinkAttribute::Mtu(mtu));
        message.attributes.push(LinkAttribute::Mtu(mtu));
    }
    message.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Veth),
        LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
    ]));

    // `add` sends NLM_F_REQUEST|NLM_F_ACK|NLM_F_CREATE|NLM_F_EXCL.
    if let Err(source) = host.link().add(message).execute().await {
        if errno(&source) == Some(libc::EEXIST) {
            // The request is atomic: nothing was created. Say which name clashed.
            let name = if link_index(host, host_ifname).await?.is_some() {
                host_ifname
            } else {
                pod_ifname
            };
            return Err(NetlinkError::Exists {
                name: name.to_string(),
            });
        }
        return Err(NetlinkError::Netlink {
            op: "create veth",
            target: format!(
                "{host_ifname} <-> {pod_ifname} in {}",
                pod_ns.path().display()
            ),
            source,
        });
    }

    match finish_pod_side(host, pod_ns, host_ifname, pod_ifname).await {
        Ok(pair) => Ok(pair),
        Err(e) => {
            // We created it (EXCL succeeded), so we remove it again.
            if let Err(cleanup) = delete_link(host, host_ifname).await {
                tracing::warn!(
                    link = host_ifname,
                    error = %cleanup,
                    "cannot remove the veth after a failed create"
                );
            }
            Err(e)
        }
    }
}

async fn finish_pod_side(
    host: &Handle,
    pod_ns: &NetNs,
    host_ifname: &str,
    pod_ifname: &str,
) -> Result<(VethPair, Handle), NetlinkError> {
    // One thread in the pod's namespace: DAD off, then the netlink socket.
    let path = format!("/proc/sys/net/ipv6/conf/{pod_ifname}/accept_dad");
    let (pod, dad) =
        netns::netlink_in_with(pod_ns, move || netns::write_sysctl(&path, "0")).await?;
    match dad {
        Ok(()) => {}
        // No IPv6 in this kernel (ipv6.disable=1): nothing to disable.
        Err(NetnsError::WriteSysctl { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
        }
        Err(e) => return Err(e.into()),
    }
    let host_ifindex =
        link_index(host, host_ifname)
            .await?
            .ok_or_else(|| NetlinkError::LinkNotFound {
                name: host_ifname.to_string(),
            })?;
    let pod_link =
        link_details(&pod, pod_ifname)
            .await?
            .ok_or_else(|| NetlinkError::LinkNotFound {
                name: pod_ifname.to_string(),
            })?;
    let pod_mac = pod_link.mac.ok_or_else(|| NetlinkError::BadMac {
        name: pod_ifname.to_string(),
        address: Vec::new(),
    })?;
    Ok((
        VethPair {
            host_ifindex,
            pod_ifindex: pod_link.index,
            pod_mac,
        },
        pod,
    ))
}

/// Where a pod attachment's routes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodRouting {
    /// The pod's first (primary) calix attachment: the main table, with its default route.
    Main,
    /// Another attachment of a pod that has a default route already: its routes in a table of
    /// its own, used by a rule for its own source addresses, so what it sends (replies above
    /// all) leaves through its own interface, where anti-spoofing expects its addresses.
    Secondary { table: u32 },
}

/// Tables of secondary attachments: `SECONDARY_TABLE_BASE | pod ifindex` (low 16 bits).
pub const SECONDARY_TABLE_BASE: u32 = 0xca11_0000;
/// Priority of the source rules of secondary attachments: before `main` (32766).
pub const SECONDARY_RULE_PRIORITY: u32 = 1000;

impl PodRouting {
    /// The routing of a secondary attachment whose pod-side interface is `pod_ifindex`.
    pub fn secondary(pod_ifindex: u32) -> Self {
        Self::Secondary {
            table: SECONDARY_TABLE_BASE | (pod_ifindex & 0xffff),
        }
    }

    fn table(self) -> Option<u32> {
        match self {
            Self::Main => None,
            Self::Secondary { table } => Some(table),
        }
    }
}

/// Whether the pod has a default route of `family` in its main table (any owner's): then a
/// new calix attachment is a secondary one.
pub async fn has_default_route(pod: &Handle, family: Family) -> Result<bool, NetlinkError> {
    let main = u32::from(RouteHeader::RT_TABLE_MAIN);
    Ok(routes(pod, family)
        .await?
        .iter()
        .any(|r| r.table == main && r.dst.prefix_len() == 0))
}

/// Configures the pod side of a veth made by [`create_veth`] (which already turned DAD off);
/// `pod` must be a handle in the pod's namespace (see [`netns::netlink_in`]). Expects a freshly
/// created interface: anything already there is an error.
///
/// - link up;
/// - v4: `<v4>/32`, `169.254.1.1/32 scope link`, `default via 169.254.1.1`, and a PERMANENT
///   neighbour `169.254.1.1 -> ee:ee:ee:ee:ee:ee`, so the pod never ARPs for its gateway and
///   does not depend on proxy ARP (which only answers when the node has a default route);
/// - v6: `<v6>/128 nodad`, a PERMANENT neighbour for [`GATEWAY_V6`] and
///   `default via fe80::ecee:eeff:feee:eeee`.
///
/// With [`PodRouting::Secondary`] the routes go to its table and a rule `from <addr> lookup
/// <table>` (priority [`SECONDARY_RULE_PRIORITY`], protocol [`ROUTE_PROTO`]) selects it.
/// `mtu`, when given, is set in the same request that sets the link up.
pub async fn configure_pod(
    pod: &Handle,
    pod_ifindex: u32,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
    routing: PodRouting,
    mtu: Option<u32>,
) -> Result<(), NetlinkError> {
    set_link_up_with_mtu(pod, pod_ifindex, mtu).await?;
    let table = routing.table();

    if let Some(ip) = v4 {
        pod.address()
            .add(pod_ifindex, IpAddr::V4(ip), 32)
            .execute()
            .await
            .map_err(netlink_err(
                "add address",
                format!("{ip}/32 to pod interface {pod_ifindex}"),
            ))?;
        let mut gateway_route = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(GATEWAY_V4, 32)
            .output_interface(pod_ifindex)
            .scope(RouteScope::Link)
            .protocol(RouteProtocol::from(ROUTE_PROTO));
        let mut default_route = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(GATEWAY_V4)
            .output_interface(pod_ifindex)
            .protocol(RouteProtocol::from(ROUTE_PROTO));
        if let Some(t) = table {
            gateway_route = gateway_route.table_id(t);
            default_route = default_route.table_id(t);
        }
        add_route(
            pod,
            gateway_route.build(),
            "169.254.1.1/32 scope link in the pod",
        )
        .await?;
        add_route(
            pod,
            default_route.build(),
            "default via 169.254.1.1 in the pod",
        )
        .await?;
        add_permanent_neighbour(pod, pod_ifindex, IpAddr::V4(GATEWAY_V4)).await?;
        if let Some(t) = table {
            add_source_rule(pod, IpAddr::V4(ip), t).await?;
        }
    }

    if let Some(ip) = v6 {
        let mut request = pod.address().add(pod_ifindex, IpAddr::V6(ip), 128);
        let message = request.message_mut();
        message.header.flags |= AddressHeaderFlags::Nodad;
        message
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
        request.execute().await.map_err(netlink_err(
            "add address",
            format!("{ip}/128 to pod interface {pod_ifindex}"),
        ))?;
        add_permanent_neighbour(pod, pod_ifindex, IpAddr::V6(GATEWAY_V6)).await?;
        let mut default_route = RouteMessageBuilder::<Ipv6Addr>::new()
            .gateway(GATEWAY_V6)
            .output_interface(pod_ifindex)
            .protocol(RouteProtocol::from(ROUTE_PROTO));
        if let Some(t) = table {
            default_route = default_route.table_id(t);
        }
        add_route(
            pod,
            default_route.build(),
            "default via fe80::ecee:eeff:feee:eeee in the pod",
        )
        .await?;
        if let Some(t) = table {
            add_source_rule(pod, IpAddr::V6(ip), t).await?;
        }
    }
    Ok(())
}

/// `from <addr> lookup <table>`, priority [`SECONDARY_RULE_PRIORITY`], protocol calix.
async fn add_source_rule(pod: &Handle, addr: IpAddr, table: u32) -> Result<(), NetlinkError> {
    let base = pod
        .rule()
        .add()
        .table_id(table)
        .action(RuleAction::ToTable)
        .priority(SECONDARY_RULE_PRIORITY);
    let result = match addr {
        IpAddr::V4(a) => {
            let mut r = base.v4().source_prefix(a, 32);
            r.message_mut()
                .attributes
                .push(RuleAttribute::Protocol(RouteProtocol::from(ROUTE_PROTO)));
            r.execute().await
        }
        IpAddr::V6(a) => {
            let mut r = base.v6().source_prefix(a, 128);
            r.message_mut()
                .attributes
                .push(RuleAttribute::Protocol(RouteProtocol::from(ROUTE_PROTO)));
            r.execute().await
        }
    };
    result.map_err(netlink_err(
        "add rule",
        format!("from {addr} lookup {table} in the pod"),
    ))
}

/// Removes calix's source rules (of secondary attachments) for `addrs` in the pod's namespace.
/// Missing rules are fine. Returns how many were removed.
pub async fn delete_source_rules(pod: &Handle, addrs: &[IpAddr]) -> Result<usize, NetlinkError> {
    let mut removed = 0;
    for version in [rtnetlink::IpVersion::V4, rtnetlink::IpVersion::V6] {
        let rules: Vec<RuleMessage> = pod
            .rule()
            .get(version)
            .execute()
            .try_collect()
            .await
            .map_err(netlink_err("list rules", "in the pod".to_string()))?;
        for rule in rules {
            let ours = rule
                .attributes
                .contains(&RuleAttribute::Protocol(RouteProtocol::from(ROUTE_PROTO)));
            let source = rule.attributes.iter().find_map(|a| match a {
                RuleAttribute::Source(ip) => Some(*ip),
                _ => None,
            });
            if ours && source.is_some_and(|s| addrs.contains(&s)) {
                match pod.rule().del(rule).execute().await {
                    Ok(()) => removed += 1,
                    Err(e) if errno(&e) == Some(libc::ENOENT) => {}
                    Err(e) => return Err(netlink_err("delete rule", "in the pod".to_string())(e)),
                }
            }
        }
    }
    Ok(removed)
}

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

/// How long [`wait_operational`] waits for the kernel to take a new veth into service.
pub const OPERATIONAL_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits until both ends of a new veth are operational (`IFLA_OPERSTATE` up), at most
/// `limit`; returns whether they are. Bringing the second end up gives both their carrier,
/// but the end brought up first starts transmitting only once the kernel's link watch (a
/// deferred work item that needs the RTNL lock) has run for it: until then its queue is the
/// noop qdisc, which drops every packet (`QDISC_DROP`). The link watch sets the operational
/// state just before it starts the queue. Returning from ADD before then let the pod drop its
/// first ARP reply to the node on a busy machine, and the node asked again only a second
/// later (`retrans_time_ms`): a new pod unreachable for a second (issue 20, item 9).
pub async fn wait_operational(
    pod: &Handle,
    pod_ifindex: u32,
    host: &Handle,
    host_ifindex: u32,
    limit: std::time::Duration,
) -> Result<bool, NetlinkError> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if operational(pod, pod_ifindex).await? && operational(host, host_ifindex).await? {
            return Ok(true);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Whether link `index` is operationally up.
async fn operational(handle: &Handle, index: u32) -> Result<bool, NetlinkError> {
    use netlink_packet_route::link::State;
    let message = handle
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(netlink_err("get link", format!("interface {index}")))?;
    Ok(message.is_some_and(|m| {
        m.attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::OperState(State::Up)))
    }))
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

/// The alias calix gives a host veth: which attachment owns it. DEL and GC only delete a link
/// whose alias names their own (containerID, ifname), so a DEL can never take another pod's
/// veth even when two attachments would derive the same name.
pub fn owner_alias(container_id: &str, ifname: &str) -> String {
    format!("{OWNER_ALIAS_PREFIX}{container_id}/{ifname}")
}

const OWNER_ALIAS_PREFIX: &str = "calix:";

/// The name prefix of every host veth calix makes (`cali` + 11 hex characters).
pub const HOST_VETH_PREFIX: &str = "cali";

/// Whether the host link `name` with `alias` carries calix's mark for the attachment
/// (`container_id`, `ifname`): a `cali…` name and that attachment's [`owner_alias`]. Only such
/// a link is ever programmed for an endpoint: a record naming anything else (the uplink, `lo`,
/// another tool's link, another attachment's veth) is not calix's to touch.
pub fn is_host_veth_of(name: &str, alias: Option<&str>, container_id: &str, ifname: &str) -> bool {
    name.starts_with(HOST_VETH_PREFIX) && alias == Some(owner_alias(container_id, ifname).as_str())
}

/// Whether `alias` is an [`owner_alias`] (of any attachment).
pub fn is_owner_alias(alias: &str) -> bool {
    alias
        .strip_prefix(OWNER_ALIAS_PREFIX)
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(cid, ifname)| !cid.is_empty() && !ifname.is_empty())
}

async fn add_permanent_neighbour(
    handle: &Handle,
    ifindex: u32,
    ip: IpAddr,
) -> Result<(), NetlinkError> {
    handle
        .neighbours()
        .add(ifindex, ip)
        .state(NeighbourState::Permanent)
        .link_layer_address(&HOST_VETH_MAC)
        .execute()
        .await
        .map_err(netlink_err(
            "add neighbour",
            format!("{ip} on interface {ifindex}"),
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_cali_link_with_the_attachments_alias_is_its_host_veth() {
        let ours = owner_alias("c1", "eth0");
        assert!(is_host_veth_of(
            "cali0123456789a",
            Some(&ours),
            "c1",
            "eth0"
        ));
        for (name, alias) in [
            ("eth0", Some(ours.as_str())),
            ("lo", None),
            ("cali0123456789a", None),
            ("cali0123456789a", Some("calix:c2/eth0")),
            ("cali0123456789a", Some("calix:c1/eth1")),
            ("cali0123456789a", Some("something else")),
        ] {
            assert!(
                !is_host_veth_of(name, alias, "c1", "eth0"),
                "{name} {alias:?}"
            );
        }
    }

    #[test]
    fn host_settings_follow_the_families() {
        let names = |v4, v6| -> Vec<(String, &str)> {
            host_settings("cali1", v4, v6)
                .into_iter()
                .map(|s| (s.path, s.value))
                .collect()
        };
        let v4 = names(true, false);
        assert!(v4.contains(&("ipv6/conf/cali1/disable_ipv6".into(), "1")));
        assert!(v4.contains(&("ipv4/conf/cali1/proxy_arp".into(), "1")));
        assert!(v4.contains(&("ipv4/conf/cali1/rp_filter".into(), "1")));
        assert!(!v4.iter().any(|(p, _)| p.contains("proxy_ndp")));
        let v6 = names(false, true);
        assert!(v6.contains(&("ipv6/conf/cali1/disable_ipv6".into(), "0")));
        assert!(v6.contains(&("ipv6/conf/cali1/proxy_ndp".into(), "1")));
        assert!(!v6.iter().any(|(p, _)| p.starts_with("ipv4/")));
        let route = HostRoute::of_pod(7, Some(Ipv4Addr::new(10, 0, 0, 1)), None);
        assert_eq!(route[0].dst.to_string(), "10.0.0.1/32");
    }

    #[test]
    fn gateway_v6_is_the_eui64_link_local_of_the_host_mac() {
        assert_eq!(
            GATEWAY_V6,
            "fe80::ecee:eeff:feee:eeee"
                .parse::<Ipv6Addr>()
                .expect("literal")
        );
    }
}
