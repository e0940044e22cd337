//! Netlink, the calix way: links, addresses, routes, neighbours and rules, read and written
//! through rtnetlink with errors that name what failed. Every route calix adds carries
//! [`ROUTE_PROTO`], and every delete filters on it, so calix never removes what it does not own.
//! The pod wiring built on these is in [`crate::pod`].
//!
//! - `links.rs`: links set up, deleted, read (details, index, MTU), alias and MAC;
//! - `routes.rs`: routes added, read and deleted (calix's only);
//! - `addresses.rs`: addresses and neighbours, read;
//! - `tc.rs`: the BPF filters on a link's clsact hooks, read.

mod addresses;
mod links;
mod routes;
mod tc;

pub use addresses::{addresses, neighbours, AddressEntry, NeighbourEntry};
pub use links::{
    delete_link, link_details, link_details_by_index, link_index, link_mtu, set_alias, set_link_up,
    set_link_up_with_mtu, set_mac, LinkDetails,
};
pub use routes::{
    add_route, delete_all_calix_routes, delete_route, delete_route_message, routes, routes_to,
    Family, RouteEntry,
};
pub use tc::{bpf_filters, BpfFilter};

use crate::netns::NetnsError;
use ipnet::IpNet;

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

pub(crate) fn not_found(e: &rtnetlink::Error) -> bool {
    errno(e) == Some(libc::ENODEV)
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::route::RouteProtocol;

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
