//! Routes: added, read, and deleted (only those carrying [`ROUTE_PROTO`]).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::AddressFamily;
use rtnetlink::Handle;

use super::{errno, netlink_err, NetlinkError, ROUTE_PROTO};

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

/// Address family selector for [`routes`] and [`neighbours`](super::neighbours).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub(super) fn address_family(self) -> AddressFamily {
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
