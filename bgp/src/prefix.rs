//! NLRI prefixes (RFC 4271 §4.3, RFC 4760 §5): a length in bits, then as many bytes as
//! that takes.
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Why a run of prefixes could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrefixError {
    /// A length longer than the family's addresses.
    TooLong,
    /// The bytes end inside a prefix.
    Truncated,
}

/// The prefixes in `bytes`, of a family whose addresses are `addr_len` bytes (4 or 16). Bits
/// past the length are ignored, as RFC 4271 says. At most `bytes.len()` prefixes: the
/// caller's message bounds what this allocates.
pub(crate) fn decode(mut bytes: &[u8], addr_len: usize) -> Result<Vec<IpNet>, PrefixError> {
    let mut out = Vec::new();
    while let [bits, rest @ ..] = bytes {
        let bits = *bits;
        if usize::from(bits) > addr_len * 8 {
            return Err(PrefixError::TooLong);
        }
        let n = usize::from(bits).div_ceil(8);
        let Some(addr) = rest.get(..n) else {
            return Err(PrefixError::Truncated);
        };
        let mut full = [0u8; 16];
        full[..n].copy_from_slice(addr);
        out.push(net(&full, addr_len, bits));
        bytes = &rest[n..];
    }
    Ok(out)
}

fn net(full: &[u8; 16], addr_len: usize, bits: u8) -> IpNet {
    if addr_len == 4 {
        let a = Ipv4Addr::new(full[0], full[1], full[2], full[3]);
        // Cannot fail: `bits` was checked against the family's length.
        IpNet::V4(Ipv4Net::new(a, bits).map_or_else(|_| Ipv4Net::default(), |n| n.trunc()))
    } else {
        let a = Ipv6Addr::from(*full);
        IpNet::V6(Ipv6Net::new(a, bits).map_or_else(|_| Ipv6Net::default(), |n| n.trunc()))
    }
}

/// The bytes `net` takes on the wire.
pub(crate) fn encoded_len(net: &IpNet) -> usize {
    1 + usize::from(net.prefix_len()).div_ceil(8)
}

/// Appends `net` as NLRI.
pub(crate) fn encode(net: &IpNet, out: &mut Vec<u8>) {
    let bits = net.prefix_len();
    let n = usize::from(bits).div_ceil(8);
    out.push(bits);
    match net.trunc() {
        IpNet::V4(v4) => out.extend_from_slice(&v4.addr().octets()[..n]),
        IpNet::V6(v6) => out.extend_from_slice(&v6.addr().octets()[..n]),
    }
}
