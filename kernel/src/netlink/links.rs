//! Links: set up (with an MTU), deleted, read (details, index, MTU), alias and MAC.
use futures::TryStreamExt;
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use rtnetlink::{Handle, LinkUnspec};

use super::{errno, not_found, validate_ifname, NetlinkError};
use crate::netns::NetnsError;

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
    /// `IFLA_IFALIAS`: calix marks each host veth with its owner (see
    /// [`owner_alias`](crate::pod::owner_alias)).
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

/// Sets a link's alias (`IFLA_IFALIAS`).
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
