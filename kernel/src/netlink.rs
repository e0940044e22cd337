//! Netlink, the calix way: links, addresses, routes, neighbours and rules, read and written
//! through rtnetlink with errors that name what failed. Every route calix adds carries
//! [`ROUTE_PROTO`], and every delete filters on it, so calix never removes what it does not own.
//! The pod wiring built on these is in [`crate::pod`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::{AddressAttribute, AddressFlags};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::AddressFamily;
use rtnetlink::{Handle, LinkUnspec};

use crate::netns::NetnsError;

/// Route protocol (`rtm_protocol`) of every route calix adds, so the agent can tell its own
/// routes apart (`ip route show proto 202`). 202 (0xCA, "CAlix") is unused by the kernel
/// (`RTPROT_*` in linux/rtnetlink.h) and by iproute2's /etc/iproute2/rt_protos; it also stays
/// clear of Calico's 80, so both can run on one node. To have `ip` print the name, put
/// `202 calix` into /etc/iproute2/rt_protos.d/calix.conf.
pub const ROUTE_PROTO: u8 = 202;

/// `IFNAMSIZ - 1`.
pub const MAX_IFNAME_LEN: usize = 15;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
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
    #[error("invalid route {route}: {reason}")]
    InvalidRoute { route: String, reason: &'static str },
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

impl NetlinkError {
    /// The kernel's errno behind a netlink failure, if that is what this is.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Netlink { source, .. } => errno(source),
            _ => None,
        }
    }
}

pub(crate) fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(msg) => Some(msg.raw_code().saturating_neg()),
        _ => None,
    }
}

pub(crate) fn netlink_err(
    op: &'static str,
    target: impl Into<String>,
) -> impl FnOnce(rtnetlink::Error) -> NetlinkError {
    let target = target.into();
    move |source| NetlinkError::Netlink { op, target, source }
}

/// Checks a name the way the kernel's `dev_valid_name` does. Names end up in /proc/sys paths,
/// so this also keeps those paths inside the interface's directory.
pub fn validate_ifname(name: &str) -> Result<(), NetlinkError> {
    let invalid = |reason| {
        Err(NetlinkError::InvalidName {
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

pub async fn add_route(
    handle: &Handle,
    route: RouteMessage,
    what: &str,
) -> Result<(), NetlinkError> {
    handle
        .route()
        .add(route)
        .execute()
        .await
        .map_err(netlink_err("add route", what))
}

pub async fn set_link_up(handle: &Handle, ifindex: u32) -> Result<(), NetlinkError> {
    set_link_up_with_mtu(handle, ifindex, None).await
}

/// Sets a link up and, with `mtu`, its MTU, in one request.
pub async fn set_link_up_with_mtu(
    handle: &Handle,
    ifindex: u32,
    mtu: Option<u32>,
) -> Result<(), NetlinkError> {
    let mut link = LinkUnspec::new_with_index(ifindex).up();
    if let Some(mtu) = mtu {
        link = link.mtu(mtu);
    }
    handle
        .link()
        .set(link.build())
        .execute()
        .await
        .map_err(|source| {
            if errno(&source) == Some(libc::ENODEV) {
                NetlinkError::IndexNotFound { index: ifindex }
            } else {
                NetlinkError::Netlink {
                    op: "set link up",
                    target: format!("interface {ifindex}"),
                    source,
                }
            }
        })
}

/// Deletes exactly the route `route` describes (destination, output interface, protocol):
/// `Ok(false)` when there was none.
pub async fn delete_route_message(
    handle: &Handle,
    route: RouteMessage,
    what: &str,
) -> Result<bool, NetlinkError> {
    match handle.route().del(route).execute().await {
        Ok(()) => Ok(true),
        Err(source) if errno(&source) == Some(libc::ESRCH) => Ok(false),
        Err(source) => Err(NetlinkError::Netlink {
            op: "delete route",
            target: what.to_string(),
            source,
        }),
    }
}

/// A BPF classifier (tc) filter on an interface's clsact hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpfFilter {
    /// Ingress (`true`) or egress.
    pub ingress: bool,
    pub priority: u16,
    /// The filter's handle (`tcm_handle`).
    pub handle: u32,
    /// The program it runs (`TCA_BPF_ID`).
    pub prog_id: u32,
    /// `TCA_BPF_NAME`.
    pub name: String,
}

/// The BPF filters on interface `ifindex`'s clsact ingress and egress hooks (none without the
/// qdisc).
pub async fn bpf_filters(handle: &Handle, ifindex: u32) -> Result<Vec<BpfFilter>, NetlinkError> {
    use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
    let mut out = Vec::new();
    for ingress in [true, false] {
        let index =
            i32::try_from(ifindex).map_err(|_| NetlinkError::IndexNotFound { index: ifindex })?;
        let mut request = handle.traffic_filter(index).get();
        request = if ingress {
            request.ingress()
        } else {
            request.egress()
        };
        let messages: Vec<_> = match request.execute().try_collect().await {
            Ok(m) => m,
            // No such device, or no clsact qdisc: no filters.
            Err(e) if matches!(errno(&e), Some(libc::ENODEV | libc::EINVAL | libc::ENOENT)) => {
                Vec::new()
            }
            Err(source) => {
                return Err(NetlinkError::Netlink {
                    op: "list tc filters",
                    target: format!("interface {ifindex}"),
                    source,
                })
            }
        };
        for m in messages {
            let mut prog_id = None;
            let mut name = String::new();
            for a in &m.attributes {
                if let TcAttribute::Options(opts) = a {
                    for o in opts {
                        match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => prog_id = Some(*id),
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = n.clone(),
                            _ => {}
                        }
                    }
                }
            }
            if let Some(prog_id) = prog_id {
                out.push(BpfFilter {
                    ingress,
                    // tcm_info: the priority in the upper 16 bits.
                    priority: (m.header.info >> 16) as u16,
                    handle: u32::from(m.header.handle),
                    prog_id,
                    name,
                });
            }
        }
    }
    Ok(out)
}

/// Deletes a link by name: `Ok(true)` if it was deleted, `Ok(false)` if there was none (DEL is
/// idempotent). Deleting a veth's host side takes the peer and every route through it along.
pub async fn delete_link(host: &Handle, name: &str) -> Result<bool, NetlinkError> {
    validate_ifname(name)?;
    let mut message = LinkMessage::default();
    message
        .attributes
        .push(LinkAttribute::IfName(name.to_string()));
    match host.link().del_with_message(message).execute().await {
        Ok(()) => Ok(true),
        Err(source) if errno(&source) == Some(libc::ENODEV) => Ok(false),
        Err(source) => Err(NetlinkError::Netlink {
            op: "delete link",
            target: name.to_string(),
            source,
        }),
    }
}

/// Deletes the main-table routes to exactly `dst` that carry [`ROUTE_PROTO`] (any device, any
/// metric); routes of other protocols are never touched. `Ok(false)` if there was none.
pub async fn delete_route(host: &Handle, dst: IpNet) -> Result<bool, NetlinkError> {
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
                return Err(NetlinkError::Netlink {
                    op: "delete route",
                    target: dst.to_string(),
                    source,
                })
            }
        }
    }
    Ok(deleted)
}

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
    pub(crate) fn from_message(message: &LinkMessage) -> LinkDetails {
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

pub(crate) fn not_found(e: &rtnetlink::Error) -> bool {
    errno(e) == Some(libc::ENODEV)
}

/// The link called `name`, if any.
pub async fn link_details(
    handle: &Handle,
    name: &str,
) -> Result<Option<LinkDetails>, NetlinkError> {
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
        Err(source) => Err(NetlinkError::Netlink {
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
) -> Result<Option<LinkDetails>, NetlinkError> {
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
        Err(source) => Err(NetlinkError::Netlink {
            op: "get link",
            target: format!("index {index}"),
            source,
        }),
    }
}

/// Index of the link called `name`, if any.
pub async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, NetlinkError> {
    Ok(link_details(handle, name).await?.map(|link| link.index))
}

/// An address on an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressEntry {
    pub address: IpNet,
    /// `IFA_F_*` bits (IFA_FLAGS when present, else the header's 8 bits).
    pub flags: u32,
    /// `ifa_scope` (0 = global, 253 = link).
    pub scope: u8,
}

impl AddressEntry {
    pub fn nodad(&self) -> bool {
        self.flags & AddressFlags::Nodad.bits() != 0
    }
}

/// Addresses (both families) on interface `ifindex`.
pub async fn addresses(handle: &Handle, ifindex: u32) -> Result<Vec<AddressEntry>, NetlinkError> {
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
                    scope: u8::from(message.header.scope),
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
    /// `RTNH_F_ONLINK`: the gateway is taken to be on the link whatever the subnets say.
    pub onlink: bool,
}

impl RouteEntry {
    pub(crate) fn from_message(message: &RouteMessage) -> Option<RouteEntry> {
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
            onlink: message
                .header
                .flags
                .contains(netlink_packet_route::route::RouteFlags::Onlink),
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
pub async fn routes(handle: &Handle, family: Family) -> Result<Vec<RouteEntry>, NetlinkError> {
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
pub async fn routes_to(handle: &Handle, dst: IpNet) -> Result<Vec<RouteEntry>, NetlinkError> {
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

/// Deletes every main-table route carrying [`ROUTE_PROTO`], both families (an uninstall):
/// how many were deleted. Routes of other protocols are never touched.
pub async fn delete_all_calix_routes(handle: &Handle) -> Result<usize, NetlinkError> {
    let main = u32::from(RouteHeader::RT_TABLE_MAIN);
    let mut n = 0;
    for family in [Family::V4, Family::V6] {
        let mut dsts: Vec<IpNet> = routes(handle, family)
            .await?
            .into_iter()
            .filter(|r| r.protocol == ROUTE_PROTO && r.table == main)
            .map(|r| r.dst)
            .collect();
        dsts.sort();
        dsts.dedup();
        for dst in dsts {
            if delete_route(handle, dst).await? {
                n += 1;
            }
        }
    }
    Ok(n)
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
) -> Result<Vec<NeighbourEntry>, NetlinkError> {
    let mut request = handle
        .neighbours()
        .get()
        .set_address_family(family.address_family());
    // NDA_IFINDEX: the kernel dumps only this device's entries (neigh_valid_dump_req).
    request
        .message_mut()
        .attributes
        .push(NeighbourAttribute::IfIndex(ifindex));
    let messages: Vec<_> = request.execute().try_collect().await.map_err(netlink_err(
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

/// The MTU of the link called `name` in the calling thread's namespace: one `SIOCGIFMTU`
/// ioctl, for callers that have no netlink socket at hand (the agent's gRPC handlers).
pub fn link_mtu(name: &str) -> Result<u32, NetlinkError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    validate_ifname(name)?;
    let failed = |source: std::io::Error| {
        NetlinkError::Netns(NetnsError::Netlink {
            path: format!("SIOCGIFMTU {name}").into(),
            source,
        })
    };
    // SAFETY: socket(2) with constant arguments; the descriptor is owned right away.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a new descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads `ifr_name` (NUL-terminated: the name is at most 15 bytes and
    // the array 16 zeroed) and writes `ifr_mtu` of the ifreq we pass, valid for the call.
    // (The request is a c_ulong for glibc and a c_int for musl, which the image is built for.)
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFMTU as _, &mut req) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENODEV) {
            return Err(NetlinkError::LinkNotFound {
                name: name.to_string(),
            });
        }
        return Err(failed(e));
    }
    // SAFETY: SIOCGIFMTU filled the `ifru_mtu` member of the union.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).map_err(|_| failed(std::io::Error::other(format!("MTU {mtu}"))))
}

/// Sets a link's alias (`IFLA_IFALIAS`)./// Sets a link's alias (`IFLA_IFALIAS`).
pub async fn set_alias(handle: &Handle, ifindex: u32, alias: &str) -> Result<(), NetlinkError> {
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
        .map_err(|source| NetlinkError::Netlink {
            op: "set alias",
            target: format!("interface {ifindex}"),
            source,
        })
}

/// Sets the MAC address of a (down) link: CNI runtimeConfig `mac`.
pub async fn set_mac(handle: &Handle, ifindex: u32, mac: [u8; 6]) -> Result<(), NetlinkError> {
    handle
        .link()
        .set(
            LinkUnspec::new_with_index(ifindex)
                .address(mac.to_vec())
                .build(),
        )
        .execute()
        .await
        .map_err(|source| NetlinkError::Netlink {
            op: "set MAC address",
            target: format!("interface {ifindex}"),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

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
                matches!(validate_ifname(bad), Err(NetlinkError::InvalidName { .. })),
                "{bad:?} accepted"
            );
        }
    }
}
