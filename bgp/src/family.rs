//! Address families (AFI/SAFI, RFC 4760).
use std::fmt;

use ipnet::IpNet;

/// An address family and subsequent address family, as the wire numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Family {
    pub afi: u16,
    pub safi: u8,
}

impl Family {
    /// IPv4 unicast (AFI 1, SAFI 1).
    pub const IPV4_UNICAST: Family = Family { afi: 1, safi: 1 };
    /// IPv6 unicast (AFI 2, SAFI 1).
    pub const IPV6_UNICAST: Family = Family { afi: 2, safi: 1 };

    /// The unicast family of `prefix`.
    pub fn of(prefix: &IpNet) -> Family {
        match prefix {
            IpNet::V4(_) => Family::IPV4_UNICAST,
            IpNet::V6(_) => Family::IPV6_UNICAST,
        }
    }

    /// The family's address length in bytes, for the two calix speaks; `None` for others.
    pub fn addr_len(self) -> Option<usize> {
        match self {
            Family::IPV4_UNICAST => Some(4),
            Family::IPV6_UNICAST => Some(16),
            _ => None,
        }
    }

    /// The 4 bytes a capability or ROUTE-REFRESH carries: AFI, a reserved byte, SAFI.
    pub(crate) fn encode(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.afi.to_be_bytes());
        out.push(0);
        out.push(self.safi);
    }

    pub(crate) fn from_wire(afi: u16, safi: u8) -> Family {
        Family { afi, safi }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Family::IPV4_UNICAST => f.write_str("ipv4-unicast"),
            Family::IPV6_UNICAST => f.write_str("ipv6-unicast"),
            Family { afi, safi } => write!(f, "afi {afi} safi {safi}"),
        }
    }
}
