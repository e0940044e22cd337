//! The maps' keys of Services frontends and node addresses (`calix_common::services`), both
//! ways: an address in 16 bytes (an IPv4 one in the first 4) and its family, the port in
//! network byte order.
use std::net::IpAddr;

use calix_common::{SvcKey, SvcNodeKey, SVC_EXTERNAL, SVC_V4, SVC_V6};

/// IP protocol numbers a frontend carries.
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

/// A frontend: where a client sends. A NodePort's address is the unspecified one of its
/// family: it answers on every address of
/// [`ServiceProgrammer::set_nodes`](super::services::ServiceProgrammer::set_nodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Front {
    pub address: IpAddr,
    pub port: u16,
    /// [`TCP`] or [`UDP`].
    pub proto: u8,
    /// For clients outside the cluster, translated per packet where they arrive (a NodePort
    /// at one of this node's own addresses, an external or LoadBalancer address); else for
    /// clients inside, at their sockets.
    pub external: bool,
}

pub(super) fn octets(a: &IpAddr) -> ([u8; 16], u8) {
    let mut out = [0u8; 16];
    match a {
        IpAddr::V4(v4) => {
            out[..4].copy_from_slice(&v4.octets());
            (out, SVC_V4)
        }
        IpAddr::V6(v6) => (v6.octets(), SVC_V6),
    }
}

/// The maps' key of a node's address `a`.
pub fn node_key(a: &IpAddr) -> SvcNodeKey {
    let (addr, family) = octets(a);
    SvcNodeKey {
        addr,
        family,
        _pad: [0; 3],
    }
}

/// The frontend the maps' key `k` stands for (`None`: not a family the maps hold).
pub fn front(k: &SvcKey) -> Option<Front> {
    let address = match k.family & !SVC_EXTERNAL {
        SVC_V4 => IpAddr::from([k.addr[0], k.addr[1], k.addr[2], k.addr[3]]),
        SVC_V6 => IpAddr::from(k.addr),
        _ => return None,
    };
    Some(Front {
        address,
        port: u16::from_be(k.port),
        proto: k.proto,
        external: k.family & SVC_EXTERNAL != 0,
    })
}

/// The maps' key of `f`.
pub fn key(f: &Front) -> SvcKey {
    let (addr, family) = octets(&f.address);
    SvcKey {
        addr,
        port: f.port.to_be(),
        proto: f.proto,
        family: if f.external {
            family | SVC_EXTERNAL
        } else {
            family
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_reads_back_as_its_frontend() {
        for (address, port, proto, external) in [
            ("10.96.0.10", 80, TCP, false),
            ("::", 30080, UDP, false),
            ("192.0.2.1", 30080, TCP, true),
            ("2001:db8::1", 443, UDP, true),
        ] {
            let f = Front {
                address: address.parse().expect("ip"),
                port,
                proto,
                external,
            };
            let k = key(&f);
            assert_eq!(u16::from_be(k.port), port);
            assert_eq!(k.family & SVC_EXTERNAL != 0, external, "{f:?}");
            assert_eq!(front(&k), Some(f));
        }
        let mut odd = key(&Front {
            address: "10.96.0.10".parse().expect("ip"),
            port: 80,
            proto: TCP,
            external: false,
        });
        odd.family = 0;
        assert_eq!(front(&odd), None);
    }
}
