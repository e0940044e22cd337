//! calix's VXLAN devices: what carries pod traffic to nodes on other subnets.
//!
//! One device per underlay family, each made only while a route needs it:
//!
//! ```text
//!   vxlan.calix     VNI 4096, UDP 4789, local <node IPv4>, dev <uplink>, nolearning,
//!                   MTU uplink - 50, MAC vtep_mac(<node IPv4>)
//!   vxlan-v6.calix  the same over IPv6: local <node IPv6>, MTU uplink - 70
//!
//!   <pod block> via <peer address> dev vxlan.calix onlink proto 202
//!   neighbour  <peer address> lladdr vtep_mac(<peer address>) PERMANENT   (ARP/NDP never asked)
//!   fdb        vtep_mac(<peer address>) dst <peer address> self permanent  (where to send it)
//! ```
//!
//! An IPv4 block goes through `vxlan.calix` to the peer's IPv4 address, an IPv6 block through
//! `vxlan-v6.calix` to its IPv6 address: each route needs nothing but its own next hop. A
//! peer's VTEP MAC is derived from its address ([`vtep_mac`]) by every node, so nothing but the
//! address is distributed. The names do not start with `cali`: everything `cali*` is a pod's
//! veth to the agent (the sweeps, kernel mode's anti-spoofing `iifname "cali*"`).
use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::link::{InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkInfo};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteProtocol, RouteType};
use netlink_packet_route::AddressFamily;
use rtnetlink::{Handle, LinkUnspec, LinkVxlan};

use crate::netlink::{errno, netlink_err, not_found, NetlinkError, ROUTE_PROTO};

/// The device over an IPv4 underlay (carries IPv4 pod blocks).
pub const DEVICE_V4: &str = "vxlan.calix";
/// The device over an IPv6 underlay (carries IPv6 pod blocks).
pub const DEVICE_V6: &str = "vxlan-v6.calix";
/// Both devices' names.
pub const DEVICES: [&str; 2] = [DEVICE_V4, DEVICE_V6];

/// What VXLAN adds to every frame over IPv4: outer IPv4 (20) + UDP (8) + VXLAN (8) + inner
/// Ethernet (14).
pub const OVERHEAD_V4: u32 = 50;
/// Over IPv6: outer IPv6 (40) + UDP + VXLAN + inner Ethernet.
pub const OVERHEAD_V6: u32 = 70;

/// The underlay family of a VXLAN device (and the family of the pod blocks it carries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Underlay {
    V4,
    V6,
}

impl Underlay {
    /// The family of `addr`.
    pub fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    /// Its device's name.
    pub fn device(self) -> &'static str {
        match self {
            Self::V4 => DEVICE_V4,
            Self::V6 => DEVICE_V6,
        }
    }

    /// The encapsulation's size over this family.
    pub fn overhead(self) -> u32 {
        match self {
            Self::V4 => OVERHEAD_V4,
            Self::V6 => OVERHEAD_V6,
        }
    }
}

/// The MAC of the VXLAN device whose underlay address is `addr` (its VTEP). Every node derives
/// a peer's from the peer's address, so no MAC is ever distributed: locally administered,
/// unicast (`0e:…`); IPv4 `0e:ca:` + the four address bytes (unique per address), IPv6 `0e:` +
/// 40 bits of the address's FNV-1a 64 hash (IPv6 devices only ever meet IPv6 peers).
pub fn vtep_mac(addr: IpAddr) -> [u8; 6] {
    match addr {
        IpAddr::V4(a) => {
            let o = a.octets();
            [0x0e, 0xca, o[0], o[1], o[2], o[3]]
        }
        IpAddr::V6(a) => {
            let h = fnv1a64(&a.octets()).to_be_bytes();
            [0x0e, h[0], h[1], h[2], h[3], h[4]]
        }
    }
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A VXLAN device as calix wants it. Learning is always off: calix writes every FDB and
/// neighbour entry itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanSpec {
    pub name: &'static str,
    pub vni: u32,
    pub port: u16,
    /// This node's underlay address (the outer source; the device's family).
    pub local: IpAddr,
    /// The uplink the encapsulated packets leave through (`IFLA_VXLAN_LINK`).
    pub underlay: u32,
    pub mtu: u32,
}

impl VxlanSpec {
    /// The device's MAC: [`vtep_mac`] of its local address.
    pub fn mac(&self) -> [u8; 6] {
        vtep_mac(self.local)
    }
}

/// The VXLAN attributes a device has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VxlanInfo {
    pub vni: Option<u32>,
    pub port: Option<u16>,
    pub local: Option<IpAddr>,
    pub underlay: Option<u32>,
    pub learning: Option<bool>,
}

/// A link of a VXLAN device's name, as the kernel has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanLink {
    pub index: u32,
    pub up: bool,
    pub mtu: Option<u32>,
    pub mac: Option<[u8; 6]>,
    /// `None`: the link of that name is not a VXLAN device.
    pub vxlan: Option<VxlanInfo>,
}

impl VxlanLink {
    /// What makes this link unfit for `spec` in a way only re-creating it fixes (the VXLAN
    /// attributes and the MAC); `None` when it fits. The MTU and the up flag are set in place.
    pub fn mismatch(&self, spec: &VxlanSpec) -> Option<String> {
        let Some(v) = &self.vxlan else {
            return Some("is not a VXLAN device".into());
        };
        let mut wrong = Vec::new();
        if v.vni != Some(spec.vni) {
            wrong.push(format!("VNI {:?}, want {}", v.vni, spec.vni));
        }
        if v.port != Some(spec.port) {
            wrong.push(format!("port {:?}, want {}", v.port, spec.port));
        }
        if v.local != Some(spec.local) {
            wrong.push(format!("local {:?}, want {}", v.local, spec.local));
        }
        if v.underlay != Some(spec.underlay) {
            wrong.push(format!(
                "underlay device {:?}, want {}",
                v.underlay, spec.underlay
            ));
        }
        if v.learning != Some(false) {
            wrong.push("learning on".into());
        }
        if self.mac != Some(spec.mac()) {
            wrong.push(format!(
                "MAC {}, want {}",
                self.mac.map_or("none".into(), |m| crate::mac::format(&m)),
                crate::mac::format(&spec.mac())
            ));
        }
        (!wrong.is_empty()).then(|| wrong.join(", "))
    }
}

/// A forwarding entry of a VXLAN device: frames to `mac` go to `dst` (a peer's VTEP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FdbEntry {
    pub mac: [u8; 6],
    pub dst: IpAddr,
}

impl FdbEntry {
    /// The entry that sends frames for `peer`'s VTEP to `peer`.
    pub fn of_peer(peer: IpAddr) -> Self {
        Self {
            mac: vtep_mac(peer),
            dst: peer,
        }
    }
}

/// Deletes both calix VXLAN devices (their routes and entries go with them): `calix-agent
/// --uninstall`. Returns the names of those that existed.
pub async fn delete_all(handle: &Handle) -> Result<Vec<&'static str>, NetlinkError> {
    let mut deleted = Vec::new();
    for name in DEVICES {
        if crate::netlink::delete_link(handle, name).await? {
            deleted.push(name);
        }
    }
    Ok(deleted)
}

/// Creates the device as `spec` says, up, in one request; its index.
pub async fn create(handle: &Handle, spec: &VxlanSpec) -> Result<u32, NetlinkError> {
    crate::netlink::validate_ifname(spec.name)?;
    let mut b = LinkVxlan::new(spec.name, spec.vni)
        .dev(spec.underlay)
        .port(spec.port)
        .learning(false);
    b = match spec.local {
        IpAddr::V4(a) => b.local(a),
        IpAddr::V6(a) => b.local6(a),
    };
    let message = b.mtu(spec.mtu).address(spec.mac().to_vec()).up().build();
    handle
        .link()
        .add(message)
        .execute()
        .await
        .map_err(|source| {
            if errno(&source) == Some(libc::EEXIST) {
                NetlinkError::Exists {
                    name: spec.name.to_string(),
                }
            } else {
                NetlinkError::Netlink {
                    op: "create VXLAN device",
                    target: spec.name.to_string(),
                    source,
                }
            }
        })?;
    crate::netlink::link_index(handle, spec.name)
        .await?
        .ok_or_else(|| NetlinkError::LinkNotFound {
            name: spec.name.to_string(),
        })
}

/// The link called `name` with its VXLAN attributes; `None` when there is none.
pub async fn get(handle: &Handle, name: &str) -> Result<Option<VxlanLink>, NetlinkError> {
    crate::netlink::validate_ifname(name)?;
    let message = match handle
        .link()
        .get()
        .match_name(name.to_string())
        .execute()
        .try_next()
        .await
    {
        Ok(Some(m)) => m,
        Ok(None) => return Ok(None),
        Err(e) if not_found(&e) => return Ok(None),
        Err(source) => {
            return Err(NetlinkError::Netlink {
                op: "get link",
                target: name.to_string(),
                source,
            })
        }
    };
    let details = crate::netlink::LinkDetails::from_message(&message);
    let mut vxlan = None;
    for a in &message.attributes {
        if let LinkAttribute::LinkInfo(infos) = a {
            let is_vxlan = infos
                .iter()
                .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Vxlan)));
            if !is_vxlan {
                continue;
            }
            let mut v = VxlanInfo::default();
            for i in infos {
                if let LinkInfo::Data(InfoData::Vxlan(attrs)) = i {
                    for attr in attrs {
                        match attr {
                            InfoVxlan::Id(id) => v.vni = Some(*id),
                            InfoVxlan::Port(p) => v.port = Some(*p),
                            InfoVxlan::Local(a) => v.local = Some(IpAddr::V4(*a)),
                            InfoVxlan::Local6(a) => v.local = Some(IpAddr::V6(*a)),
                            InfoVxlan::Link(l) => v.underlay = Some(*l),
                            InfoVxlan::Learning(l) => v.learning = Some(*l),
                            _ => {}
                        }
                    }
                }
            }
            vxlan = Some(v);
        }
    }
    Ok(Some(VxlanLink {
        index: details.index,
        up: details.up,
        mtu: details.mtu,
        mac: details.mac,
        vxlan,
    }))
}

/// Sets link `index`'s MTU.
pub async fn set_mtu(handle: &Handle, index: u32, mtu: u32) -> Result<(), NetlinkError> {
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).mtu(mtu).build())
        .execute()
        .await
        .map_err(netlink_err(
            "set MTU",
            format!("of interface {index} to {mtu}"),
        ))
}

fn fdb_message(index: u32, entry: &FdbEntry) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = AddressFamily::Bridge;
    m.header.ifindex = index;
    m.header.state = NeighbourState::Permanent;
    m.header.flags = NeighbourFlags::Own;
    m.header.kind = RouteType::Unspec;
    m.attributes
        .push(NeighbourAttribute::LinkLayerAddress(entry.mac.to_vec()));
    m.attributes
        .push(NeighbourAttribute::Destination(neighbour_address(
            entry.dst,
        )));
    m
}

fn neighbour_address(ip: IpAddr) -> NeighbourAddress {
    match ip {
        IpAddr::V4(a) => NeighbourAddress::Inet(a),
        IpAddr::V6(a) => NeighbourAddress::Inet6(a),
    }
}

/// An FDB entry's `NDA_DST`: its message is of family `AF_BRIDGE`, so the address comes
/// as bytes (4 or 16 of them).
fn address_of(a: &NeighbourAddress) -> Option<IpAddr> {
    match a {
        NeighbourAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        NeighbourAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        NeighbourAddress::Other(bytes) => match bytes.len() {
            4 => <[u8; 4]>::try_from(bytes.as_slice()).ok().map(IpAddr::from),
            16 => <[u8; 16]>::try_from(bytes.as_slice())
                .ok()
                .map(IpAddr::from),
            _ => None,
        },
        _ => None,
    }
}

/// The forwarding entries of VXLAN device `index` that send to a remote address.
pub async fn fdb(handle: &Handle, index: u32) -> Result<Vec<FdbEntry>, NetlinkError> {
    let mut request = handle
        .neighbours()
        .get()
        .set_address_family(AddressFamily::Bridge);
    // The kernel filters an FDB dump by device only when the request is an `ifinfomsg`
    // (16 bytes: what `bridge fdb show dev X` sends; rtnl_fdb_dump, valid_fdb_dump_legacy):
    // an `ndmsg` (12 bytes) with one empty attribute is that size, and its `ndm_ifindex`
    // lies where `ifi_index` does. Without this the dump lists every device's addresses.
    let m = request.message_mut();
    m.header.ifindex = index;
    m.attributes.push(NeighbourAttribute::Other(
        netlink_packet_core::DefaultNla::new(0, Vec::new()),
    ));
    let messages: Vec<NeighbourMessage> = request.execute().try_collect().await.map_err(
        netlink_err("list forwarding entries", format!("of interface {index}")),
    )?;
    let mut out = Vec::new();
    for m in messages.iter().filter(|m| m.header.ifindex == index) {
        let mut mac = None;
        let mut dst = None;
        for a in &m.attributes {
            match a {
                NeighbourAttribute::LinkLayerAddress(l) => {
                    mac = <[u8; 6]>::try_from(l.as_slice()).ok()
                }
                NeighbourAttribute::Destination(d) => dst = address_of(d),
                _ => {}
            }
        }
        if let (Some(mac), Some(dst)) = (mac, dst) {
            out.push(FdbEntry { mac, dst });
        }
    }
    Ok(out)
}

/// Adds (or replaces) a permanent forwarding entry on VXLAN device `index`.
pub async fn add_fdb(handle: &Handle, index: u32, entry: &FdbEntry) -> Result<(), NetlinkError> {
    let mut request = handle.neighbours().add_bridge(index, &entry.mac).replace();
    *request.message_mut() = fdb_message(index, entry);
    request.execute().await.map_err(netlink_err(
        "add forwarding entry",
        format!(
            "{} dst {} on interface {index}",
            crate::mac::format(&entry.mac),
            entry.dst
        ),
    ))
}

/// Deletes a forwarding entry of VXLAN device `index`; `Ok(false)` when there was none.
pub async fn delete_fdb(
    handle: &Handle,
    index: u32,
    entry: &FdbEntry,
) -> Result<bool, NetlinkError> {
    match handle
        .neighbours()
        .del(fdb_message(index, entry))
        .execute()
        .await
    {
        Ok(()) => Ok(true),
        Err(e) if matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => Ok(false),
        Err(source) => Err(NetlinkError::Netlink {
            op: "delete forwarding entry",
            target: format!(
                "{} dst {} on interface {index}",
                crate::mac::format(&entry.mac),
                entry.dst
            ),
            source,
        }),
    }
}

/// Adds (or replaces) the permanent neighbour `ip` → `mac` on interface `index`, marked with
/// calix's protocol.
pub async fn set_neighbour(
    handle: &Handle,
    index: u32,
    ip: IpAddr,
    mac: [u8; 6],
) -> Result<(), NetlinkError> {
    let mut request = handle
        .neighbours()
        .add(index, ip)
        .state(NeighbourState::Permanent)
        .link_layer_address(&mac)
        .replace();
    request
        .message_mut()
        .attributes
        .push(NeighbourAttribute::Protocol(RouteProtocol::from(
            ROUTE_PROTO,
        )));
    request.execute().await.map_err(netlink_err(
        "add neighbour",
        format!("{ip} on interface {index}"),
    ))
}

/// Deletes neighbour `ip` of interface `index`; `Ok(false)` when there was none.
pub async fn delete_neighbour(
    handle: &Handle,
    index: u32,
    ip: IpAddr,
) -> Result<bool, NetlinkError> {
    let mut m = NeighbourMessage::default();
    m.header.family = match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.ifindex = index;
    m.attributes
        .push(NeighbourAttribute::Destination(neighbour_address(ip)));
    match handle.neighbours().del(m).execute().await {
        Ok(()) => Ok(true),
        Err(e) if matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => Ok(false),
        Err(source) => Err(NetlinkError::Netlink {
            op: "delete neighbour",
            target: format!("{ip} on interface {index}"),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vtep_macs_are_local_unicast_and_follow_the_address() {
        let a: IpAddr = "172.31.1.2".parse().expect("v4");
        assert_eq!(vtep_mac(a), [0x0e, 0xca, 172, 31, 1, 2]);
        for ip in ["172.31.1.2", "fd31:1::2", "fd31:2::2", "::"] {
            let mac = vtep_mac(ip.parse().expect("ip"));
            assert_eq!(mac[0] & 0x01, 0, "{ip}: unicast");
            assert_eq!(mac[0] & 0x02, 0x02, "{ip}: locally administered");
        }
        // Addresses that differ only in the subnet get different MACs.
        let (x, y) = (
            vtep_mac("fd31:1::2".parse().expect("v6")),
            vtep_mac("fd31:2::2".parse().expect("v6")),
        );
        assert_ne!(x, y);
        // Stable: the same address gives the same MAC on every node, in every release.
        assert_eq!(
            crate::mac::format(&vtep_mac("fd31:1::2".parse().expect("v6"))),
            crate::mac::format(&vtep_mac("fd31:1::2".parse().expect("v6")))
        );
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn device_names_are_not_pod_veths_and_fit() {
        for name in DEVICES {
            assert!(!name.starts_with("cali"), "{name}");
            crate::netlink::validate_ifname(name).expect(name);
        }
        assert_eq!(Underlay::V4.overhead(), 50);
        assert_eq!(Underlay::V6.overhead(), 70);
    }

    #[test]
    fn a_link_fits_or_says_why_not() {
        let spec = VxlanSpec {
            name: DEVICE_V4,
            vni: 4096,
            port: 4789,
            local: "172.31.1.1".parse().expect("v4"),
            underlay: 2,
            mtu: 1450,
        };
        let good = VxlanLink {
            index: 9,
            up: true,
            mtu: Some(1400),
            mac: Some(spec.mac()),
            vxlan: Some(VxlanInfo {
                vni: Some(4096),
                port: Some(4789),
                local: Some(spec.local),
                underlay: Some(2),
                learning: Some(false),
            }),
        };
        assert_eq!(good.mismatch(&spec), None, "MTU is not a mismatch");
        let mut other = good.clone();
        other.vxlan.as_mut().expect("vxlan").vni = Some(1);
        other.vxlan.as_mut().expect("vxlan").learning = Some(true);
        let why = other.mismatch(&spec).expect("mismatch");
        assert!(why.contains("VNI") && why.contains("learning"), "{why}");
        let not_vxlan = VxlanLink {
            vxlan: None,
            ..good
        };
        assert!(not_vxlan.mismatch(&spec).is_some());
    }
}
