//! Addresses and neighbours (ARP/NDP), read.
use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::{AddressAttribute, AddressFlags};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use rtnetlink::Handle;

use super::{netlink_err, Family, NetlinkError};

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
