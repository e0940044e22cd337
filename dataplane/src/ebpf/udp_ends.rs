//! Connected UDP sockets sent to a backend that has left its frontend, ended (issue 24): a
//! UDP socket's destination is set once, at `connect`, so a client (a DNS resolver) would
//! keep sending to a backend that is gone. Its socket is ended instead (its next call fails
//! with `ECONNABORTED`) and the client's next socket goes to a backend that is there, as
//! kube-proxy's conntrack flush does. Only sockets the programs sent to that backend for that
//! frontend (the reverse table says so) are ended: a socket connected to the pod's address
//! itself is not the Service's.
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use calix_common::{SvcBackend, SvcRevValue, SVC_V4, SVC_V6};
use calix_kernel::netns::{self, NetNs};
use calix_kernel::sock_diag::{self, UdpSock};

use super::services::{Left, ServiceMaps};

/// `peer` as the maps hold a backend.
fn backend(peer: &SocketAddr) -> SvcBackend {
    let mut addr = [0u8; 16];
    let family = match peer.ip() {
        IpAddr::V4(v4) => {
            addr[..4].copy_from_slice(&v4.octets());
            SVC_V4
        }
        IpAddr::V6(v6) => {
            addr = v6.octets();
            SVC_V6
        }
    };
    SvcBackend {
        addr,
        port: peer.port().to_be(),
        family,
        _pad: 0,
    }
}

/// The sockets of `socks` to end: each connected to a backend of `left` that the programs
/// chose for that frontend (`translated`: the frontend a socket's peer stands for).
pub fn to_end(
    socks: &[UdpSock],
    left: &BTreeSet<Left>,
    translated: impl Fn(u64, &SvcBackend) -> Option<SvcRevValue>,
) -> Vec<UdpSock> {
    socks
        .iter()
        .filter(|s| {
            let b = backend(&s.peer_plain());
            let to_it = |l: &&Left| l.backend == (b.addr, b.port);
            if !left.iter().any(|l| to_it(&l)) {
                return false;
            }
            translated(s.cookie, &b).is_some_and(|front| {
                left.iter().filter(to_it).any(|l| {
                    // A NodePort's key has no address: it stands for each node's.
                    (l.front.addr == front.addr || l.front.addr == [0; 16])
                        && l.front.port == front.port
                })
            })
        })
        .copied()
        .collect()
}

/// Ends the sockets [`to_end`] names in the host's network namespace and in each of
/// `clients` (the node's pods'); how many. A namespace that cannot be entered (its pod just
/// went) is skipped.
pub fn end(left: &[Left], clients: &[PathBuf], maps: &dyn ServiceMaps) -> usize {
    if left.is_empty() {
        return 0;
    }
    let left: BTreeSet<Left> = left.iter().copied().collect();
    let mut ended = 0;
    let here = sock_diag::connected_udp().map(|socks| {
        for s in to_end(&socks, &left, |c, b| maps.translated(c, b)) {
            match sock_diag::destroy(&s) {
                Ok(()) => ended += 1,
                Err(e) => tracing::debug!(socket = ?s, error = %e, "a UDP socket not ended"),
            }
        }
    });
    if let Err(e) = here {
        tracing::warn!(error = %e, "the node's UDP sockets cannot be listed");
    }
    let unique: BTreeSet<&PathBuf> = clients.iter().collect();
    for path in unique {
        let socks = NetNs::open(path).map_err(|e| e.to_string()).and_then(|ns| {
            let listed = netns::run_in(&ns, sock_diag::connected_udp)
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            Ok((ns, listed))
        });
        let (ns, socks) = match socks {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(netns = %path.display(), error = %e, "a pod's UDP sockets not listed");
                continue;
            }
        };
        let doomed = to_end(&socks, &left, |c, b| maps.translated(c, b));
        if doomed.is_empty() {
            continue;
        }
        let done = netns::run_in(&ns, move || {
            doomed
                .iter()
                .filter(|s| sock_diag::destroy(s).is_ok())
                .count()
        });
        ended += done.unwrap_or(0);
    }
    ended
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_common::SvcKey;

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn only_the_services_sockets_to_a_backend_that_left_are_ended() {
        let front = |a: &str, port: u16| {
            let b = backend(&sa(&format!("{a}:{port}")));
            SvcKey {
                addr: b.addr,
                port: b.port,
                proto: 17,
                family: b.family,
            }
        };
        let gone = backend(&sa("10.244.1.5:53"));
        let left = BTreeSet::from([Left {
            front: front("10.96.0.10", 53),
            backend: (gone.addr, gone.port),
        }]);
        let socks = [
            // Sent there for the DNS Service: ended.
            UdpSock::new(sa("10.244.2.9:40000"), sa("10.244.1.5:53"), 1),
            // Connected to the pod's address itself: not the Service's.
            UdpSock::new(sa("10.244.2.9:40001"), sa("10.244.1.5:53"), 2),
            // Sent there for another Service, which keeps it.
            UdpSock::new(sa("10.244.2.9:40002"), sa("10.244.1.5:53"), 3),
            // Another backend.
            UdpSock::new(sa("10.244.2.9:40003"), sa("10.244.1.6:53"), 4),
        ];
        let via = |a: &str, port: u16| {
            let f = front(a, port);
            Some(SvcRevValue {
                addr: f.addr,
                port: f.port,
                _pad: 0,
            })
        };
        let ended = to_end(&socks, &left, |cookie, _| match cookie {
            1 | 4 => via("10.96.0.10", 53),
            3 => via("10.96.0.11", 53),
            _ => None,
        });
        assert_eq!(
            ended.iter().map(|s| s.cookie).collect::<Vec<_>>(),
            [1],
            "{ended:?}"
        );
    }
}
