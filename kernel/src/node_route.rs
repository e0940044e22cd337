//! Routes to other nodes' pods, in the main table with calix's protocol:
//!
//! ```text
//!   <block> via <peer address> dev <uplink> proto 202              the peer shares a subnet
//!   <block> via <peer address> dev vxlan.calix onlink proto 202    through VXLAN (crate::vxlan)
//! ```
//!
//! They are told apart from the pods' host routes (`<pod>/32 dev caliX scope link`, also
//! protocol 202: [`crate::pod::HostRoute`]) by their gateway: a host route never has one.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use netlink_packet_route::route::{RouteHeader, RouteMessage, RouteProtocol};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::netlink::{self, errno, Family, NetlinkError, RouteEntry, ROUTE_PROTO};

/// `<dst> via <gateway> dev <oif> [onlink] proto 202`, main table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeRoute {
    pub dst: IpNet,
    /// The peer node's address, of `dst`'s family.
    pub gateway: IpAddr,
    pub oif: u32,
    /// Through a VXLAN device: the gateway is on its link whatever the subnets say.
    pub onlink: bool,
}

impl NodeRoute {
    /// A main-table route with calix's protocol and a gateway of its destination's family.
    pub fn from_entry(e: &RouteEntry) -> Option<Self> {
        let main = u32::from(RouteHeader::RT_TABLE_MAIN);
        if e.table != main || e.protocol != ROUTE_PROTO {
            return None;
        }
        let gateway = e.gateway?;
        Some(Self {
            dst: e.dst,
            gateway,
            oif: e.oif?,
            onlink: e.onlink,
        })
    }

    /// The netlink message that adds (or deletes) exactly this route. `None` when the
    /// gateway's family is not the destination's.
    pub fn message(&self) -> Option<RouteMessage> {
        let proto = RouteProtocol::from(ROUTE_PROTO);
        Some(match (self.dst, self.gateway) {
            (IpNet::V4(n), IpAddr::V4(gw)) => {
                let mut b = RouteMessageBuilder::<Ipv4Addr>::new()
                    .destination_prefix(n.network(), n.prefix_len())
                    .gateway(gw)
                    .output_interface(self.oif)
                    .protocol(proto);
                if self.onlink {
                    b = b.onlink();
                }
                b.build()
            }
            (IpNet::V6(n), IpAddr::V6(gw)) => {
                let mut b = RouteMessageBuilder::<Ipv6Addr>::new()
                    .destination_prefix(n.network(), n.prefix_len())
                    .gateway(gw)
                    .output_interface(self.oif)
                    .protocol(proto);
                if self.onlink {
                    b = b.onlink();
                }
                b.build()
            }
            _ => return None,
        })
    }
}

impl std::fmt::Display for NodeRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} via {} dev {}", self.dst, self.gateway, self.oif)?;
        if self.onlink {
            write!(f, " onlink")?;
        }
        Ok(())
    }
}

/// calix's routes to other nodes (both families).
pub async fn list(handle: &Handle) -> Result<Vec<NodeRoute>, NetlinkError> {
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        out.extend(
            netlink::routes(handle, family)
                .await?
                .iter()
                .filter_map(NodeRoute::from_entry),
        );
    }
    Ok(out)
}

fn family_mismatch(route: &NodeRoute) -> NetlinkError {
    NetlinkError::InvalidRoute {
        route: route.to_string(),
        reason: "the gateway's family is not the destination's",
    }
}

/// Adds `route`; with `replace`, takes the place of the route to the same destination (one
/// atomic change: traffic never finds no route). Without it an existing route to the same
/// destination is [`NetlinkError::RouteExists`].
pub async fn add(handle: &Handle, route: &NodeRoute, replace: bool) -> Result<(), NetlinkError> {
    let message = route.message().ok_or_else(|| family_mismatch(route))?;
    let mut request = handle.route().add(message);
    if replace {
        request = request.replace();
    }
    request.execute().await.map_err(|source| {
        if errno(&source) == Some(libc::EEXIST) {
            NetlinkError::RouteExists { dst: route.dst }
        } else {
            NetlinkError::Netlink {
                op: "add route",
                target: route.to_string(),
                source,
            }
        }
    })
}

/// A change to calix's routes to nodes, as the kernel tells route listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Added(NodeRoute),
    Removed(NodeRoute),
}

/// The changes to calix's node routes in one datagram read from a netlink socket that listens
/// to the route groups (`RTMGRP_IPV4_ROUTE`, `RTMGRP_IPV6_ROUTE`): other routes and messages
/// are skipped, and so is the rest of a datagram after a message that does not parse.
pub fn changes(datagram: &[u8]) -> Vec<Change> {
    use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
    use netlink_packet_route::RouteNetlinkMessage;
    let mut out = Vec::new();
    let mut rest = datagram;
    while !rest.is_empty() {
        let Ok(m) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(rest) else {
            break;
        };
        // Messages are 4-byte aligned within a datagram.
        let len = (m.header.length as usize).next_multiple_of(4);
        let change = match &m.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(r)) => Some((true, r)),
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelRoute(r)) => Some((false, r)),
            _ => None,
        };
        let route = change.and_then(|(added, r)| {
            let route = NodeRoute::from_entry(&RouteEntry::from_message(r)?)?;
            Some(if added {
                Change::Added(route)
            } else {
                Change::Removed(route)
            })
        });
        out.extend(route);
        if len == 0 || len >= rest.len() {
            break;
        }
        rest = &rest[len..];
    }
    out
}

/// Deletes exactly `route`; `Ok(false)` when there was none.
pub async fn delete(handle: &Handle, route: &NodeRoute) -> Result<bool, NetlinkError> {
    let message = route.message().ok_or_else(|| family_mismatch(route))?;
    netlink::delete_route_message(handle, message, &route.to_string()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(gateway: Option<&str>, protocol: u8) -> RouteEntry {
        RouteEntry {
            dst: "10.244.1.0/26".parse().expect("net"),
            gateway: gateway.map(|g| g.parse().expect("ip")),
            oif: Some(2),
            protocol,
            scope: 0,
            table: 254,
            priority: None,
            onlink: true,
        }
    }

    #[test]
    fn only_calix_routes_with_a_gateway_are_node_routes() {
        let r = NodeRoute::from_entry(&entry(Some("172.31.2.3"), ROUTE_PROTO)).expect("ours");
        assert!(r.onlink);
        assert_eq!(r.to_string(), "10.244.1.0/26 via 172.31.2.3 dev 2 onlink");
        // A pod's host route (no gateway) and another protocol's route are not.
        assert_eq!(NodeRoute::from_entry(&entry(None, ROUTE_PROTO)), None);
        assert_eq!(NodeRoute::from_entry(&entry(Some("172.31.2.3"), 4)), None);
    }

    #[test]
    fn route_changes_are_read_from_a_datagram() {
        use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload};
        use netlink_packet_route::RouteNetlinkMessage;
        let ours = NodeRoute {
            dst: "10.244.1.0/26".parse().expect("net"),
            gateway: "172.31.1.2".parse().expect("ip"),
            oif: 2,
            onlink: false,
        };
        let pods = NodeRoute {
            dst: "10.244.0.7/32".parse().expect("net"),
            ..ours
        };
        let mut pods_host_route = pods.message().expect("message");
        pods_host_route
            .attributes
            .retain(|a| !matches!(a, netlink_packet_route::route::RouteAttribute::Gateway(_)));
        let messages = [
            RouteNetlinkMessage::NewRoute(ours.message().expect("message")),
            RouteNetlinkMessage::NewRoute(pods_host_route),
            RouteNetlinkMessage::DelRoute(pods.message().expect("message")),
        ];
        let mut datagram = Vec::new();
        for m in messages {
            let mut m = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(m));
            m.finalize();
            let mut buf = vec![0; m.buffer_len()];
            m.serialize(&mut buf);
            datagram.extend(buf);
        }
        assert_eq!(
            changes(&datagram),
            [Change::Added(ours), Change::Removed(pods)],
            "a host route (no gateway) is no node route"
        );
        assert_eq!(changes(&datagram[..10]), []);
    }

    #[test]
    fn a_gateway_of_the_other_family_has_no_message() {
        let r = NodeRoute {
            dst: "10.244.1.0/26".parse().expect("net"),
            gateway: "fd31:2::3".parse().expect("ip"),
            oif: 2,
            onlink: false,
        };
        assert!(r.message().is_none());
        let ok = NodeRoute {
            gateway: "172.31.1.2".parse().expect("ip"),
            ..r
        };
        assert!(ok.message().is_some());
    }
}
