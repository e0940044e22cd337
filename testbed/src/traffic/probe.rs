//! Reachability in milliseconds: ICMP echo requests from inside a namespace on a raw socket,
//! one every `interval` until the first reply, several probes driven by one thread. Cheaper
//! and much finer than exec'ing `ping` in a loop (a fork, `setns` and exec each time).
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::netns::Netns;
use crate::packets::ipv4_checksum;
use crate::{Error, Result};

const ECHO_REPLY: u8 = 0;
const ECHO_REQUEST: u8 = 8;

/// A raw ICMP socket in one namespace, with an echo identifier of its own.
pub struct Pinger {
    fd: OwnedFd,
    id: u16,
    seq: u16,
    /// Where the namespace is (for errors).
    ns: String,
}

fn os_error(what: String) -> Error {
    Error::io(what)(std::io::Error::last_os_error())
}

impl Pinger {
    /// A pinger sending from `ns` (the socket is opened on a thread inside it and keeps that
    /// namespace whichever thread uses it).
    pub fn open(ns: &Netns) -> Result<Self> {
        static IDS: AtomicU16 = AtomicU16::new(0);
        let name = ns.name.clone();
        let raw = ns
            .spawn(None, || {
                // SAFETY: socket(2) with constant arguments.
                let fd = unsafe {
                    libc::socket(
                        libc::AF_INET,
                        libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                        libc::IPPROTO_ICMP,
                    )
                };
                (fd >= 0)
                    .then_some(fd)
                    .ok_or_else(std::io::Error::last_os_error)
            })?
            .join()
            .map_err(|_| Error::Panicked {
                what: format!("opening a raw socket in {name}"),
            })?
            .map_err(Error::io(format!("raw ICMP socket in {name}")))?;
        // SAFETY: `raw` is a new fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let id = (std::process::id() as u16) ^ IDS.fetch_add(1, Ordering::Relaxed).rotate_left(8);
        Ok(Self {
            fd,
            id,
            seq: 0,
            ns: name,
        })
    }

    /// Sends one echo request to `to`.
    pub fn send(&mut self, to: Ipv4Addr) -> Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let mut msg = [ECHO_REQUEST, 0, 0, 0, 0, 0, 0, 0, b'c', b'x'];
        msg[4..6].copy_from_slice(&self.id.to_be_bytes());
        msg[6..8].copy_from_slice(&self.seq.to_be_bytes());
        let sum = ipv4_checksum(&msg);
        msg[2..4].copy_from_slice(&sum.to_be_bytes());
        // SAFETY: sockaddr_in is plain data; all zeroes then the fields we need.
        let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from(to).to_be();
        // SAFETY: `msg` and `sa` are valid for the sizes given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of_val(&sa) as libc::socklen_t,
            )
        };
        // No route yet (ENETUNREACH and the like) is what a probe expects to see at first.
        if n < 0 && !unreachable(std::io::Error::last_os_error().raw_os_error()) {
            return Err(os_error(format!("send an echo request from {}", self.ns)));
        }
        Ok(())
    }

    /// Reads what the socket holds; whether it held an echo reply from `from` to this pinger.
    pub fn replied(&mut self, from: Ipv4Addr) -> bool {
        let mut buf = [0u8; 1500];
        let mut seen = false;
        loop {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return seen;
            }
            seen |= is_reply(&buf[..n as usize], from, self.id);
        }
    }
}

/// Errors of a send that only say the destination is not reachable (yet).
fn unreachable(errno: Option<i32>) -> bool {
    matches!(
        errno,
        Some(
            libc::ENETUNREACH
                | libc::EHOSTUNREACH
                | libc::ECONNREFUSED
                | libc::EINVAL
                | libc::EAGAIN
                | libc::ENOBUFS
        )
    )
}

/// Whether `packet` (an IPv4 packet as a raw socket reads it) is an echo reply from `from`
/// with identifier `id`.
fn is_reply(packet: &[u8], from: Ipv4Addr, id: u16) -> bool {
    let Some(&first) = packet.first() else {
        return false;
    };
    let ihl = usize::from(first & 0x0f) * 4;
    let (Some(src), Some(icmp)) = (packet.get(12..16), packet.get(ihl..ihl + 8)) else {
        return false;
    };
    src == from.octets() && icmp[0] == ECHO_REPLY && icmp[4..6] == id.to_be_bytes()
}

/// Each `(pinger, address)` pings its address every `interval` until the first reply, at most
/// `limit`: when each first reply was read (`None`: none within the limit), the probes driven
/// together from this thread.
pub fn first_replies(
    probes: &mut [(&mut Pinger, Ipv4Addr)],
    interval: Duration,
    limit: Duration,
) -> Result<Vec<Option<Instant>>> {
    let start = Instant::now();
    let mut got: Vec<Option<Instant>> = vec![None; probes.len()];
    while got.iter().any(Option::is_none) && start.elapsed() < limit {
        for (i, (p, to)) in probes.iter_mut().enumerate() {
            if got[i].is_none() {
                p.send(*to)?;
            }
        }
        let next = Instant::now() + interval;
        // Until the next round: wait for any socket to become readable.
        loop {
            let left = next.saturating_duration_since(Instant::now());
            let mut fds: Vec<libc::pollfd> = probes
                .iter()
                .map(|(p, _)| libc::pollfd {
                    fd: p.fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // Rounded up: a 0 ms poll would spin.
            let ms = left.as_micros().div_ceil(1000) as libc::c_int;
            // SAFETY: `fds` is a valid array of its length.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            let now = Instant::now();
            for (i, (p, to)) in probes.iter_mut().enumerate() {
                if got[i].is_none() && fds[i].revents & libc::POLLIN != 0 && p.replied(*to) {
                    got[i] = Some(now);
                }
            }
            if got.iter().all(Option::is_some) || Instant::now() >= next {
                break;
            }
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_replies_are_matched_by_source_and_identifier() {
        let icmp = [ECHO_REPLY, 0, 0, 0, 0x12, 0x34, 0, 1];
        let ip = crate::packets::Ip4::new([10, 0, 0, 2], [10, 0, 0, 1], 1, icmp.to_vec()).bytes();
        let from = Ipv4Addr::new(10, 0, 0, 2);
        assert!(is_reply(&ip, from, 0x1234));
        assert!(!is_reply(&ip, from, 0x1235), "another pinger's");
        assert!(
            !is_reply(&ip, Ipv4Addr::new(10, 0, 0, 3), 0x1234),
            "another host's"
        );
        let request = crate::packets::with_byte(&ip, 20, ECHO_REQUEST);
        assert!(!is_reply(&request, from, 0x1234), "a request");
        assert!(!is_reply(&ip[..22], from, 0x1234), "truncated");
        assert!(!is_reply(&[], from, 0x1234));
    }
}
