//! The pod's side of an attachment: its interface up with its addresses, the gateway as a
//! permanent neighbour, the default routes (in the main table, or in a table of its own with a
//! source rule for a secondary attachment).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::neighbour::NeighbourState;
use netlink_packet_route::route::{RouteHeader, RouteProtocol, RouteScope};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, RouteMessageBuilder};

use super::{GATEWAY_V4, GATEWAY_V6, HOST_VETH_MAC};
use crate::netlink::{
    add_route, errno, netlink_err, routes, set_link_up_with_mtu, Family, NetlinkError, ROUTE_PROTO,
};

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

/// Configures the pod side of a veth made by [`create_veth`](super::create_veth) (which already turned DAD off);
/// `pod` must be a handle in the pod's namespace (see [`netns::netlink_in`](crate::netns::netlink_in)). Expects a freshly
/// created interface: anything already there is an error.
///
/// - link up;
/// - v4: `<v4>/32`, `169.254.1.1/32 scope link`, `default via 169.254.1.1`, and a PERMANENT
///   neighbour `169.254.1.1 -> ee:ee:ee:ee:ee:ee`, so the pod never ARPs for its gateway and
///   does not depend on proxy ARP (which only answers when the node has a default route);
/// - v6: `<v6>/128 nodad`, a PERMANENT neighbour for [`GATEWAY_V6`] and
///   `default via fe80::ecee:eeff:feee:eeee`.
///
/// With [`PodRouting::Secondary`] the routes go to its table and a rule
/// `from <addr> lookup <table>` (priority [`SECONDARY_RULE_PRIORITY`], protocol
/// [`ROUTE_PROTO`]) selects it.
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
