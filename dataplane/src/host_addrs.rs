//! The node's own addresses (`CALIX_HOST_V4` / `CALIX_HOST_V6`), in the eBPF dataplane: the
//! XDP prefilter's failsafe ports apply only to packets addressed to the node itself, never to
//! a pod or anything else the node forwards to; and `from_pod` closes the agents' ports on
//! them to pods ([`super::doors`]).
//!
//! Why a map the agent fills rather than a FIB lookup in the program: `bpf_fib_lookup`
//! answers "not forwarded" alike for local, broadcast and multicast destinations, and gives no
//! answer at all (`FWD_DISABLED`) when forwarding is off on the uplink, so the program could
//! not tell the node's own port 22 from a pod's there; a map says exactly "one of the node's
//! addresses", costs one hash lookup (made only for denied sources), and is easy to test.
//! What a map needs is to be kept current: the agent fills it before the program attaches,
//! then a thread subscribed to the kernel's address notifications (rtnetlink
//! `RTMGRP_IPV4_IFADDR` / `RTMGRP_IPV6_IFADDR`) re-reads the addresses on every change (and
//! every [`RESYNC`] anyway). While the agent is down the map keeps the last addresses it saw.
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use aya::maps::{HashMap, MapData};
use aya::Ebpf;
use calix_common::{HOST_V4_MAP, HOST_V6_MAP};
use nix::sys::socket::{self, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockType};

use super::bpf::{map_err, take};
use super::DataplaneError;

/// How often the watcher re-reads the addresses without a notification (one may be lost when
/// the socket's buffer overflows).
pub const RESYNC: Duration = Duration::from_secs(30);

/// Interfaces whose addresses are not the node's own: pods' host veths (`cali*`, which hold
/// only the pods' gateway link-local address) and kube-proxy's IPVS dummy (`kube-ipvs0`, which
/// holds every Service address: IPVS forwards those to pods).
fn is_node_interface(name: &str) -> bool {
    !name.starts_with("cali") && name != "kube-ipvs0"
}

/// Every address of the node's interfaces: (interface, address).
pub fn interface_addresses() -> Result<Vec<(String, IpAddr)>, DataplaneError> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(DataplaneError::Addresses)?;
    Ok(addrs
        .filter_map(|a| {
            let sa = a.address?;
            let ip = match (sa.as_sockaddr_in(), sa.as_sockaddr_in6()) {
                (Some(v4), _) => IpAddr::V4(v4.ip()),
                (None, Some(v6)) => IpAddr::V6(v6.ip()),
                _ => return None,
            };
            Some((a.interface_name, ip))
        })
        .collect())
}

/// The node's own addresses: every address of its interfaces but pods' veths and the IPVS
/// dummy, loopback and link-local ones included (a packet to them is the node's too).
pub fn own_addresses() -> Result<BTreeSet<IpAddr>, DataplaneError> {
    Ok(interface_addresses()?
        .into_iter()
        .filter(|(ifname, _)| is_node_interface(ifname))
        .map(|(_, ip)| ip)
        .collect())
}

/// The node's addresses as its node record carries them (for peers and, later, route next
/// hops): global ones of every interface but loopback and pods' veths, sorted.
pub fn record_addresses() -> Vec<String> {
    let Ok(addrs) = interface_addresses() else {
        return Vec::new();
    };
    let mut out: Vec<String> = addrs
        .into_iter()
        .filter(|(ifname, _)| is_node_interface(ifname) && ifname != "lo")
        .filter_map(|(_, ip)| {
            let link_local = match ip {
                IpAddr::V4(v4) => v4.is_link_local(),
                IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
            };
            (!link_local && !ip.is_loopback()).then(|| ip.to_string())
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The maps of the node's own addresses.
pub struct HostAddrs {
    v4: HashMap<MapData, [u8; 4], u32>,
    v6: HashMap<MapData, [u8; 16], u32>,
}

impl HostAddrs {
    /// Takes the maps out of the loaded object.
    pub fn open(bpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            v4: take(bpf, HOST_V4_MAP, HashMap::try_from)?,
            v6: take(bpf, HOST_V6_MAP, HashMap::try_from)?,
        })
    }

    /// What the maps hold.
    pub fn get(&self) -> BTreeSet<IpAddr> {
        let v4 = self.v4.keys().filter_map(Result::ok).map(IpAddr::from);
        let v6 = self.v6.keys().filter_map(Result::ok).map(IpAddr::from);
        v4.chain(v6).collect()
    }

    /// Brings the maps to `want`: additions first, then removals (an address that stays is
    /// never missing meanwhile). Returns what was added and what removed.
    pub fn set(
        &mut self,
        want: &BTreeSet<IpAddr>,
    ) -> Result<(Vec<IpAddr>, Vec<IpAddr>), DataplaneError> {
        let have = self.get();
        let added: Vec<IpAddr> = want.difference(&have).copied().collect();
        let removed: Vec<IpAddr> = have.difference(want).copied().collect();
        for ip in &added {
            match ip {
                IpAddr::V4(a) => self.v4.insert(a.octets(), 1, 0),
                IpAddr::V6(a) => self.v6.insert(a.octets(), 1, 0),
            }
            .map_err(map_err(family_map(ip), "insert"))?;
        }
        for ip in &removed {
            match ip {
                IpAddr::V4(a) => self.v4.remove(&a.octets()),
                IpAddr::V6(a) => self.v6.remove(&a.octets()),
            }
            .map_err(map_err(family_map(ip), "remove"))?;
        }
        Ok((added, removed))
    }

    /// Reads the node's addresses and writes them.
    pub fn refresh(&mut self) -> Result<(), DataplaneError> {
        let (added, removed) = self.set(&own_addresses()?)?;
        if !added.is_empty() || !removed.is_empty() {
            tracing::info!(
                ?added,
                ?removed,
                "the node's own addresses (XDP failsafe, doors)"
            );
        }
        Ok(())
    }

    /// Keeps the maps current for the life of the process, on a thread of its own: a refresh
    /// on every address notification, and every [`RESYNC`].
    pub fn watch(mut self) {
        let spawned = std::thread::Builder::new()
            .name("calix-host-addrs".into())
            .spawn(move || {
                let notifications = match subscribe() {
                    Ok(fd) => Some(fd),
                    Err(e) => {
                        tracing::warn!(error = %e, "no address notifications: re-reading the node's addresses every {}s", RESYNC.as_secs());
                        None
                    }
                };
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match &notifications {
                        Some(fd) => wait(fd, &mut buf),
                        None => std::thread::sleep(RESYNC),
                    }
                    if let Err(e) = self.refresh() {
                        tracing::warn!(error = %super::error_chain(&e), "cannot update the node's addresses for the XDP failsafe and the doors");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the address watcher: the XDP failsafe and the doors keep the addresses they have");
        }
    }
}

fn family_map(ip: &IpAddr) -> &'static str {
    match ip {
        IpAddr::V4(_) => HOST_V4_MAP,
        IpAddr::V6(_) => HOST_V6_MAP,
    }
}

/// A netlink socket subscribed to address changes of both families, with [`RESYNC`] as its
/// receive timeout.
fn subscribe() -> nix::Result<OwnedFd> {
    let fd = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        socket::SockProtocol::NetlinkRoute,
    )?;
    let groups = (libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32;
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, groups))?;
    let timeout = nix::sys::time::TimeVal::new(RESYNC.as_secs() as _, 0);
    socket::setsockopt(&fd, sockopt::ReceiveTimeout, &timeout)?;
    Ok(fd)
}

/// Blocks until an address changes (or the timeout), then drains what else is queued: one
/// refresh covers a burst. Errors (the timeout, a buffer overrun) just mean "refresh now".
fn wait(fd: &OwnedFd, buf: &mut [u8]) {
    let _ = socket::recv(fd.as_raw_fd(), buf, MsgFlags::empty());
    while socket::recv(fd.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT).is_ok() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_veths_and_the_ipvs_dummy_are_not_the_nodes_own() {
        for own in ["eth0", "lo", "uplink0", "bond0.100", "kube-bridge"] {
            assert!(is_node_interface(own), "{own}");
        }
        for not in ["cali1234567890a", "kube-ipvs0"] {
            assert!(!is_node_interface(not), "{not}");
        }
    }
}
