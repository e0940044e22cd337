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
//! [`delete_link`] on the host side undoes all of them: the peer and every route through the
//! veth go with it. DEL is [`delete_link`] (idempotent) and, for routes that may outlive the
//! link, [`delete_route`].

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;

use futures::TryStreamExt;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::AddressFamily;
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

use crate::netns::{self, NetNs, NetnsError};

/// MAC address of every host-side veth. Fixed so the pod's IPv6 gateway (its EUI-64 link-local
/// address) is predictable, and so pods can carry a permanent neighbour entry for the gateway.
pub const HOST_VETH_MAC: [u8; 6] = [0xee; 6];

/// The pod's IPv4 gateway: a link-local address nobody owns. The host veth answers ARP for it
/// through proxy ARP, and the pod has a permanent neighbour entry for it anyway.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// The pod's IPv6 gateway: the host veth's own link-local address, `fe80::ecee:eeff:feee:eeee`.
pub const GATEWAY_V6: Ipv6Addr = eui64_link_local(HOST_VETH_MAC);

/// Route protocol (`rtm_protocol`) of every route calix adds, so the agent can tell its own
/// routes apart (`ip route show proto 202`). 202 (0xCA, "CAlix") is unused by the kernel
/// (`RTPROT_*` in linux/rtnetlink.h) and by iproute2's /etc/iproute2/rt_protos; it also stays
/// clear of Calico's 80, so both can run on one node. To have `ip` print the name, put
/// `202 calix` into /etc/iproute2/rt_protos.d/calix.conf.
pub const ROUTE_PROTO: u8 = 202;

/// `IFNAMSIZ - 1`.
pub const MAX_IFNAME_LEN: usize = 15;

/// The EUI-64 (RFC 4291 appendix A) link-local address the kernel gives an interface with
/// `mac`, with `addr_gen_mode` eui64 (the default).
pub const fn eui64_link_local(mac: [u8; 6]) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfe80,
        0,
        0,
        0,
        u16::from_be_bytes([mac[0] ^ 0x02, mac[1]]),
        u16::from_be_bytes([mac[2], 0xff]),
        u16::from_be_bytes([0xfe, mac[3]]),
        u16::from_be_bytes([mac[4], mac[5]]),
    )
}

#[derive(Debug, thiserror::Error)]
pub enum VethError {
    #[error("invalid interface name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    /// The name is taken (host side in the node namespace, or pod side in the pod namespace).
    /// Nothing was created.
    #[error("interface {name} already exists")]
    Exists { name: String },
    /// Somebody (maybe another pod, maybe not calix) already routes this prefix; it was left
    /// alone.
    #[error("a route to {dst} already exists")]
    RouteExists { dst: IpNet },
    #[error("interface {name} not found")]
    LinkNotFound { name: String },
    #[error("no interface with index {index}")]
    IndexNotFound { index: u32 },
    #[error("interface {name} has no usable MAC address (got {address:02x?})")]
    BadMac { name: String, address: Vec<u8> },
    #[error("netlink: cannot {op} {target}")]
    Netlink {
        op: &'static str,
        target: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

impl VethError {
    /// The kernel's errno behind a netlink failure, if that is what this is.
    pub fn errno(&self) -> Option<i32> {
        match self {
            VethError::Netlink { source, .. } => errno(source),
            _ => None,
        }
    }
}

fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(msg) => Some(msg.raw_code().saturating_neg()),
        _ => None,
    }
}

fn netlink_err(
    op: &'static str,
    target: impl Into<String>,
) -> impl FnOnce(rtnetlink::Error) -> VethError {
    let target = target.into();
    move |source| VethError::Netlink { op, target, source }
}

/// Checks a name the way the kernel's `dev_valid_name` does. Names end up in /proc/sys paths,
/// so this also keeps those paths inside the interface's directory.
pub fn validate_ifname(name: &str) -> Result<(), VethError> {
    let invalid = |reason| {
        Err(VethError::InvalidName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return invalid("empty");
    }
    if name.len() > MAX_IFNAME_LEN {
        return invalid("longer than 15 bytes");
    }
    if name == "." || name == ".." {
        return invalid("reserved");
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c == '\0' || c.is_whitespace())
    {
        return invalid("contains '/', ':', NUL or whitespace");
    }
    Ok(())
}

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
/// [`VethError::Exists`]; nothing is reused. Both sides are left down.
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
) -> Result<VethPair, VethError> {
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
) -> Result<(VethPair, Handle), VethError> {
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
            return Err(VethError::Exists {
                name: name.to_string(),
            });
        }
        return Err(VethError::Netlink {
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
) -> Result<(VethPair, Handle), VethError> {
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
            .ok_or_else(|| VethError::LinkNotFound {
                name: host_ifname.to_string(),
            })?;
    let pod_link =
        link_details(&pod, pod_ifname)
            .await?
            .ok_or_else(|| VethError::LinkNotFound {
                name: pod_ifname.to_string(),
            })?;
    let pod_mac = pod_link.mac.ok_or_else(|| VethError::BadMac {
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
pub async fn has_default_route(pod: &Handle, family: Family) -> Result<bool, VethError> {
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
pub async fn configure_pod(
    pod: &Handle,
    pod_ifindex: u32,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
    routing: PodRouting,
) -> Result<(), VethError> {
    set_link_up(pod, pod_ifindex).await?;
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
async fn add_source_rule(pod: &Handle, addr: IpAddr, table: u32) -> Result<(), VethError> {
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
pub async fn delete_source_rules(pod: &Handle, addrs: &[IpAddr]) -> Result<usize, VethError> {
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

/// Configures the host side; `host` must act on the calling thread's namespace, because the
/// sysctls are written through that thread's /proc/sys/net.
///
/// - v4: `conf/<if>/proxy_arp=1`, `neigh/<if>/proxy_delay=0`, `conf/<if>/forwarding=1`,
///   `conf/<if>/rp_filter=1`;
/// - v6: `conf/<if>/proxy_ndp=1`, `accept_ra=0`, `forwarding=1`;
/// - link up;
/// - `<v4>/32 dev <if> scope link proto 202`, `<v6>/128 dev <if> proto 202`.
///
/// A route for the same prefix (same table and metric) that is already there is
/// [`VethError::RouteExists`] and is left untouched.
pub async fn configure_host(
    host: &Handle,
    host_ifname: &str,
    host_ifindex: u32,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
) -> Result<(), VethError> {
    validate_ifname(host_ifname)?;
    // An IPv4-only pod needs no IPv6 on its host veth. Without this every host veth gets the
    // same link-local address (they all share the MAC ee:ee:ee:ee:ee:ee): N identical
    // fe80::ecee:eeff:feee:eeee addresses and /128 local routes for nothing. Set both ways, so
    // configuring a veth again for IPv6 works. Skipped when the kernel has no IPv6.
    let knob = format!("/proc/sys/net/ipv6/conf/{host_ifname}/disable_ipv6");
    if std::path::Path::new(&knob).exists() {
        netns::write_sysctl_if_changed(knob, if v6.is_none() { "1" } else { "0" })?;
    }
    if v4.is_some() {
        netns::write_sysctl(
            format!("/proc/sys/net/ipv4/conf/{host_ifname}/proxy_arp"),
            "1",
        )?;
        netns::write_sysctl(
            format!("/proc/sys/net/ipv4/neigh/{host_ifname}/proxy_delay"),
            "0",
        )?;
        netns::write_sysctl_if_changed(
            format!("/proc/sys/net/ipv4/conf/{host_ifname}/forwarding"),
            "1",
        )?;
        // Strict reverse-path filtering: the pod's packets must come from an address whose
        // route leads back out of this veth (its own). The kernel mode's only IPv4
        // anti-spoofing besides the agent's nftables table (which also covers `all=2`, loose,
        // overruling this); in eBPF mode `from_pod` has checked before the stack sees them.
        netns::write_sysctl_if_changed(
            format!("/proc/sys/net/ipv4/conf/{host_ifname}/rp_filter"),
            "1",
        )?;
    }
    if v6.is_some() {
        netns::write_sysctl(
            format!("/proc/sys/net/ipv6/conf/{host_ifname}/proxy_ndp"),
            "1",
        )?;
        netns::write_sysctl(
            format!("/proc/sys/net/ipv6/conf/{host_ifname}/accept_ra"),
            "0",
        )?;
        // The host side's link-local address is the pod's IPv6 gateway: usable at once.
        netns::write_sysctl(
            format!("/proc/sys/net/ipv6/conf/{host_ifname}/accept_dad"),
            "0",
        )?;
        netns::write_sysctl_if_changed(
            format!("/proc/sys/net/ipv6/conf/{host_ifname}/forwarding"),
            "1",
        )?;
    }

    set_link_up(host, host_ifindex).await?;

    if let Some(ip) = v4 {
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(ip, 32)
            .output_interface(host_ifindex)
            .scope(RouteScope::Link)
            .protocol(RouteProtocol::from(ROUTE_PROTO))
            .build();
        add_host_route(host, route, IpNet::V4(Ipv4Net::from(ip)), host_ifname).await?;
    }
    if let Some(ip) = v6 {
        let route = RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(ip, 128)
            .output_interface(host_ifindex)
            .protocol(RouteProtocol::from(ROUTE_PROTO))
            .build();
        add_host_route(host, route, IpNet::V6(Ipv6Net::from(ip)), host_ifname).await?;
    }
    Ok(())
}

async fn add_host_route(
    host: &Handle,
    route: RouteMessage,
    dst: IpNet,
    host_ifname: &str,
) -> Result<(), VethError> {
    // `add` sends NLM_F_CREATE|NLM_F_EXCL: an existing route is never replaced.
    match host.route().add(route).execute().await {
        Ok(()) => Ok(()),
        Err(source) if errno(&source) == Some(libc::EEXIST) => Err(VethError::RouteExists { dst }),
        Err(source) => Err(VethError::Netlink {
            op: "add route",
            target: format!("{dst} dev {host_ifname}"),
            source,
        }),
    }
}

async fn add_route(handle: &Handle, route: RouteMessage, what: &str) -> Result<(), VethError> {
    handle
        .route()
        .add(route)
        .execute()
        .await
        .map_err(netlink_err("add route", what))
}

async fn add_permanent_neighbour(
    handle: &Handle,
    ifindex: u32,
    ip: IpAddr,
) -> Result<(), VethError> {
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

async fn set_link_up(handle: &Handle, ifindex: u32) -> Result<(), VethError> {
    handle
        .link()
        .set(LinkUnspec::new_with_index(ifindex).up().build())
        .execute()
        .await
        .map_err(|source| {
            if errno(&source) == Some(libc::ENODEV) {
                VethError::IndexNotFound { index: ifindex }
            } else {
                VethError::Netlink {
                    op: "set link up",
                    target: format!("interface {ifindex}"),
                    source,
                }
            }
        })
}

/// Deletes a link by name: `Ok(true)` if it was deleted, `Ok(false)` if there was none (DEL is
/// idempotent). Deleting a veth's host side takes the peer and every route through it along.
pub async fn delete_link(host: &Handle, name: &str) -> Result<bool, VethError> {
    validate_ifname(name)?;
    let mut message = LinkMessage::default();
    message
        .attributes
        .push(LinkAttribute::IfName(name.to_string()));
    match host.link().del_with_message(message).execute().await {
        Ok(()) => Ok(true),
        Err(source) if errno(&source) == Some(libc::ENODEV) => Ok(false),
        Err(source) => Err(VethError::Netlink {
            op: "delete link",
            target: name.to_string(),
            source,
        }),
    }
}

/// Deletes the main-table routes to exactly `dst` that carry [`ROUTE_PROTO`] (any device, any
/// metric); routes of other protocols are never touched. `Ok(false)` if there was none.
pub async fn delete_route(host: &Handle, dst: IpNet) -> Result<bool, VethError> {
    // One RTM_DELROUTE removes one route; a prefix has only a handful of routes at most.
    const MAX_ROUTES: usize = 16;
    let mut deleted = false;
    for _ in 0..MAX_ROUTES {
        let mut route = RouteMessage::default();
        route.header.table = RouteHeader::RT_TABLE_MAIN;
        route.header.protocol = RouteProtocol::from(ROUTE_PROTO);
        route.header.kind = RouteType::Unspec;
        route.header.destination_prefix_length = dst.prefix_len();
        match dst {
            IpNet::V4(net) => {
                route.header.address_family = AddressFamily::Inet;
                // Any scope (what `ip route del` sends).
                route.header.scope = RouteScope::NoWhere;
                route
                    .attributes
                    .push(RouteAttribute::Destination(RouteAddress::Inet(
                        net.network(),
                    )));
            }
            IpNet::V6(net) => {
                route.header.address_family = AddressFamily::Inet6;
                route
                    .attributes
                    .push(RouteAttribute::Destination(RouteAddress::Inet6(
                        net.network(),
                    )));
            }
        }
        match host.route().del(route).execute().await {
            Ok(()) => deleted = true,
            Err(source) if errno(&source) == Some(libc::ESRCH) => return Ok(deleted),
            Err(source) => {
                return Err(VethError::Netlink {
                    op: "delete route",
                    target: dst.to_string(),
                    source,
                })
            }
        }
    }
    Ok(deleted)
}

// ---- reads (CHECK, tests) ----

/// What CHECK wants to know about a link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkDetails {
    pub index: u32,
    pub name: String,
    pub mac: Option<[u8; 6]>,
    pub mtu: Option<u32>,
    /// Administratively up (IFF_UP).
    pub up: bool,
    /// `IFLA_INFO_KIND`, e.g. "veth".
    pub kind: Option<String>,
    /// For a veth: the peer's index (in the peer's namespace).
    pub peer_index: Option<u32>,
    /// `IFLA_IFALIAS`: calix marks each host veth with its owner (see [`owner_alias`]).
    pub alias: Option<String>,
}

impl LinkDetails {
    fn from_message(message: &LinkMessage) -> LinkDetails {
        let mut details = LinkDetails {
            index: message.header.index,
            name: String::new(),
            mac: None,
            mtu: None,
            up: message.header.flags.contains(LinkFlags::Up),
            kind: None,
            peer_index: None,
            alias: None,
        };
        for attribute in &message.attributes {
            match attribute {
                LinkAttribute::IfName(name) => details.name = name.clone(),
                LinkAttribute::Address(mac) => {
                    details.mac = <[u8; 6]>::try_from(mac.as_slice()).ok()
                }
                LinkAttribute::Mtu(mtu) => details.mtu = Some(*mtu),
                LinkAttribute::Link(index) => details.peer_index = Some(*index),
                LinkAttribute::IfAlias(alias) => details.alias = Some(alias.clone()),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        if let LinkInfo::Kind(kind) = info {
                            details.kind = Some(kind.to_string());
                        }
                    }
                }
                _ => {}
            }
        }
        details
    }
}

fn not_found(e: &rtnetlink::Error) -> bool {
    errno(e) == Some(libc::ENODEV)
}

/// The link called `name`, if any.
pub async fn link_details(handle: &Handle, name: &str) -> Result<Option<LinkDetails>, VethError> {
    validate_ifname(name)?;
    match handle
        .link()
        .get()
        .match_name(name)
        .execute()
        .try_next()
        .await
    {
        Ok(message) => Ok(message.as_ref().map(LinkDetails::from_message)),
        Err(e) if not_found(&e) => Ok(None),
        Err(source) => Err(VethError::Netlink {
            op: "get link",
            target: name.to_string(),
            source,
        }),
    }
}

/// The link with index `index`, if any.
pub async fn link_details_by_index(
    handle: &Handle,
    index: u32,
) -> Result<Option<LinkDetails>, VethError> {
    match handle
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
    {
        Ok(message) => Ok(message.as_ref().map(LinkDetails::from_message)),
        Err(e) if not_found(&e) => Ok(None),
        Err(source) => Err(VethError::Netlink {
            op: "get link",
            target: format!("index {index}"),
            source,
        }),
    }
}

/// Index of the link called `name`, if any.
pub async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, VethError> {
    Ok(link_details(handle, name).await?.map(|link| link.index))
}

/// An address on an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressEntry {
    pub address: IpNet,
    /// `IFA_F_*` bits (IFA_FLAGS when present, else the header's 8 bits).
    pub flags: u32,
}

impl AddressEntry {
    pub fn nodad(&self) -> bool {
        self.flags & AddressFlags::Nodad.bits() != 0
    }
}

/// Addresses (both families) on interface `ifindex`.
pub async fn addresses(handle: &Handle, ifindex: u32) -> Result<Vec<AddressEntry>, VethError> {
    let messages: Vec<_> = handle
        .address()
        .get()
        .set_link_index_filter(ifindex)
        .execute()
        .try_collect()
        .await
        .map_err(netlink_err(
            "list addresses",
            format!("of interface {ifindex}"),
        ))?;
    let mut entries = Vec::new();
    for message in messages {
        let mut local = None;
        let mut address = None;
        let mut flags = u32::from(message.header.flags.bits());
        for attribute in &message.attributes {
            match attribute {
                AddressAttribute::Local(ip) => local = Some(*ip),
                AddressAttribute::Address(ip) => address = Some(*ip),
                AddressAttribute::Flags(f) => flags = f.bits(),
                _ => {}
            }
        }
        // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer's on p2p links.
        if let Some(ip) = local.or(address) {
            if let Ok(net) = IpNet::new(ip, message.header.prefix_len) {
                entries.push(AddressEntry {
                    address: net,
                    flags,
                });
            }
        }
    }
    Ok(entries)
}

/// Address family selector for [`routes`] and [`neighbours`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn address_family(self) -> AddressFamily {
        match self {
            Family::V4 => AddressFamily::Inet,
            Family::V6 => AddressFamily::Inet6,
        }
    }
}

/// A route, reduced to what CHECK compares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEntry {
    pub dst: IpNet,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
    /// `rtm_protocol`; ours is [`ROUTE_PROTO`].
    pub protocol: u8,
    /// `rtm_scope` (253 = link, 0 = universe).
    pub scope: u8,
    pub table: u32,
    pub priority: Option<u32>,
}

impl RouteEntry {
    fn from_message(message: &RouteMessage) -> Option<RouteEntry> {
        let mut dst = None;
        let mut gateway = None;
        let mut oif = None;
        let mut table = u32::from(message.header.table);
        let mut priority = None;
        for attribute in &message.attributes {
            match attribute {
                RouteAttribute::Destination(address) => dst = route_ip(address),
                RouteAttribute::Gateway(address) => gateway = route_ip(address),
                RouteAttribute::Oif(index) => oif = Some(*index),
                RouteAttribute::Table(t) => table = *t,
                RouteAttribute::Priority(p) => priority = Some(*p),
                _ => {}
            }
        }
        let unspecified = match message.header.address_family {
            AddressFamily::Inet => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => return None,
        };
        let dst = IpNet::new(
            dst.unwrap_or(unspecified),
            message.header.destination_prefix_length,
        )
        .ok()?;
        Some(RouteEntry {
            dst,
            gateway,
            oif,
            protocol: u8::from(message.header.protocol),
            scope: u8::from(message.header.scope),
            table,
            priority,
        })
    }
}

fn route_ip(address: &RouteAddress) -> Option<IpAddr> {
    match address {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

/// Every route of `family` in every table (filter on [`RouteEntry::table`]).
pub async fn routes(handle: &Handle, family: Family) -> Result<Vec<RouteEntry>, VethError> {
    let mut request = RouteMessage::default();
    request.header.address_family = family.address_family();
    // Without RTA_DST the request is a dump.
    let messages: Vec<_> = handle
        .route()
        .get(request)
        .execute()
        .try_collect()
        .await
        .map_err(netlink_err("list routes", format!("{family:?}")))?;
    Ok(messages
        .iter()
        .filter_map(RouteEntry::from_message)
        .collect())
}

/// Main-table routes to exactly `dst` (whoever owns them).
pub async fn routes_to(handle: &Handle, dst: IpNet) -> Result<Vec<RouteEntry>, VethError> {
    let family = match dst {
        IpNet::V4(_) => Family::V4,
        IpNet::V6(_) => Family::V6,
    };
    let main = u32::from(RouteHeader::RT_TABLE_MAIN);
    Ok(routes(handle, family)
        .await?
        .into_iter()
        .filter(|route| route.table == main && route.dst == dst.trunc())
        .collect())
}

/// A neighbour (ARP/NDP) entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeighbourEntry {
    pub ip: IpAddr,
    pub mac: Option<[u8; 6]>,
    pub ifindex: u32,
    pub permanent: bool,
}

/// Neighbour entries of `family` on interface `ifindex`.
pub async fn neighbours(
    handle: &Handle,
    ifindex: u32,
    family: Family,
) -> Result<Vec<NeighbourEntry>, VethError> {
    let messages: Vec<_> = handle
        .neighbours()
        .get()
        .set_address_family(family.address_family())
        .execute()
        .try_collect()
        .await
        .map_err(netlink_err(
            "list neighbours",
            format!("of interface {ifindex}"),
        ))?;
    let mut entries = Vec::new();
    for message in messages.iter().filter(|m| m.header.ifindex == ifindex) {
        let mut ip = None;
        let mut mac = None;
        for attribute in &message.attributes {
            match attribute {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                    ip = Some(IpAddr::V4(*v4))
                }
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                    ip = Some(IpAddr::V6(*v6))
                }
                NeighbourAttribute::LinkLayerAddress(lla) => {
                    mac = <[u8; 6]>::try_from(lla.as_slice()).ok()
                }
                _ => {}
            }
        }
        if let Some(ip) = ip {
            entries.push(NeighbourEntry {
                ip,
                mac,
                ifindex,
                permanent: message.header.state == NeighbourState::Permanent,
            });
        }
    }
    Ok(entries)
}

/// The alias calix gives a host veth: which attachment owns it. DEL and GC only delete a link
/// whose alias names their own (containerID, ifname), so a DEL can never take another pod's
/// veth even when two attachments would derive the same name.
pub fn owner_alias(container_id: &str, ifname: &str) -> String {
    format!("{OWNER_ALIAS_PREFIX}{container_id}/{ifname}")
}

const OWNER_ALIAS_PREFIX: &str = "calix:";

/// Whether `alias` is an [`owner_alias`] (of any attachment).
pub fn is_owner_alias(alias: &str) -> bool {
    alias
        .strip_prefix(OWNER_ALIAS_PREFIX)
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(cid, ifname)| !cid.is_empty() && !ifname.is_empty())
}

/// Sets a link's alias (`IFLA_IFALIAS`).
pub async fn set_alias(handle: &Handle, ifindex: u32, alias: &str) -> Result<(), VethError> {
    let mut message = LinkMessage::default();
    message.header.index = ifindex;
    message
        .attributes
        .push(LinkAttribute::IfAlias(alias.to_string()));
    handle
        .link()
        .set(message)
        .execute()
        .await
        .map_err(|source| VethError::Netlink {
            op: "set alias",
            target: format!("interface {ifindex}"),
            source,
        })
}

/// Sets the MAC address of a (down) link: CNI runtimeConfig `mac`.
pub async fn set_mac(handle: &Handle, ifindex: u32, mac: [u8; 6]) -> Result<(), VethError> {
    handle
        .link()
        .set(
            LinkUnspec::new_with_index(ifindex)
                .address(mac.to_vec())
                .build(),
        )
        .execute()
        .await
        .map_err(|source| VethError::Netlink {
            op: "set MAC address",
            target: format!("interface {ifindex}"),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_v6_is_the_eui64_link_local_of_the_host_mac() {
        assert_eq!(
            GATEWAY_V6,
            "fe80::ecee:eeff:feee:eeee"
                .parse::<Ipv6Addr>()
                .expect("literal")
        );
    }

    #[test]
    fn route_proto_is_not_a_well_known_protocol() {
        // linux/rtnetlink.h RTPROT_* and iproute2's rt_protos.
        let taken = [
            0u8, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 42, 99, 186, 187, 188, 189,
            192,
        ];
        assert!(!taken.contains(&ROUTE_PROTO));
        assert!(matches!(
            RouteProtocol::from(ROUTE_PROTO),
            RouteProtocol::Other(202)
        ));
    }

    #[test]
    fn ifname_validation_follows_the_kernel() {
        for good in ["eth0", "cali0123456789a", "a", "net1.100"] {
            validate_ifname(good).expect(good);
        }
        for bad in [
            "",
            "cali0123456789ab",
            ".",
            "..",
            "a/b",
            "a:b",
            "a b",
            "../../x",
        ] {
            assert!(
                matches!(validate_ifname(bad), Err(VethError::InvalidName { .. })),
                "{bad:?} accepted"
            );
        }
    }
}
