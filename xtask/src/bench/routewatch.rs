//! When calix's routes to other nodes reach a namespace's kernel, as the kernel tells it: a
//! netlink socket opened inside the namespace, listening to the IPv4 route group, read by a
//! thread of its own. No polling (a dump of 10,000 routes every few ms would compete for the
//! CPU with the agent being measured); each route to a node (protocol 202 with a gateway,
//! [`calix_kernel::node_route::changes`]) is stamped when its announcement is read. Or, with
//! [`Which::Protocol`], every main-table route another routing daemon installs (a router's
//! BIRD: protocol 12).
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_kernel::node_route::{changes, Change};
use calix_testbed::Netns;
use ipnet::{IpNet, Ipv4Net};

/// The socket's receive buffer: 10,000 route announcements arrive in a burst (~1.5 MB).
const RCVBUF: libc::c_int = 64 << 20;
/// `RTMGRP_IPV4_ROUTE`.
const IPV4_ROUTE_GROUP: u32 = 0x40;
/// How often the reader looks at its stop flag.
const TICK: libc::suseconds_t = 100_000;

/// Which routes a watch stamps.
#[derive(Clone, Copy, Debug)]
pub enum Which {
    /// calix's routes to other nodes (protocol 202 with a gateway).
    Calix,
    /// Every IPv4 route of the main table with this routing protocol (`rtm_protocol`).
    Protocol(u8),
}

#[derive(Default)]
struct State {
    /// Routes present, with when each appeared.
    present: HashMap<IpNet, Instant>,
    /// The kernel dropped announcements (`ENOBUFS`): what is present is incomplete.
    overflowed: bool,
    failed: Option<String>,
}

/// A watch of one namespace's routes to nodes; stopped on drop.
pub struct RouteWatch {
    shared: Arc<(Mutex<State>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RouteWatch {
    /// Starts watching `ns`'s routes to nodes (routes already there are not seen: only
    /// changes from now on).
    pub fn start(ns: &Netns) -> Result<Self> {
        Self::start_of(ns, Which::Calix)
    }

    /// Starts watching `ns`'s routes of `which` kind (only changes from now on).
    pub fn start_of(ns: &Netns, which: Which) -> Result<Self> {
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let (s, st) = (shared.clone(), stop.clone());
        let thread = ns.spawn(None, move || match open() {
            Ok(fd) => {
                let _ = opened_tx.send(Ok(()));
                read(&fd, &s, &st, which);
            }
            Err(e) => {
                let _ = opened_tx.send(Err(e));
            }
        })?;
        opened_rx
            .recv()
            .context("the route watch thread")?
            .with_context(|| format!("watching the routes of {}", ns.name))?;
        Ok(Self {
            shared,
            stop,
            thread: Some(thread),
        })
    }

    /// Waits up to `timeout` for a route to `dst`; when it appeared (`None`: not within).
    pub fn appeared(&self, dst: IpNet, timeout: Duration) -> Result<Option<Instant>> {
        self.wait(timeout, |s| s.present.get(&dst).copied())
    }

    /// Waits up to `timeout` until `n` routes are present; when the last of them appeared
    /// (`None`: not within).
    pub fn until_count(&self, n: usize, timeout: Duration) -> Result<Option<Instant>> {
        self.wait(timeout, |s| {
            (s.present.len() >= n).then(|| s.present.values().copied().max())?
        })
    }

    /// How many routes are present.
    pub fn count(&self) -> usize {
        self.lock().present.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<T>(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&State) -> Option<T>,
    ) -> Result<Option<T>> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some(e) = &s.failed {
                bail!("the route watch failed: {e}");
            }
            if s.overflowed {
                bail!("the route watch missed announcements (its socket's buffer overflowed)");
            }
            if let Some(v) = done(&s) {
                return Ok(Some(v));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            s = self
                .shared
                .1
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for RouteWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn last_error(what: &str) -> anyhow::Error {
    anyhow::anyhow!("{what}: {}", std::io::Error::last_os_error())
}

/// A netlink route socket in the calling thread's namespace, in the IPv4 route group, with a
/// big receive buffer and a read timeout of [`TICK`].
fn open() -> Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if raw < 0 {
        return Err(last_error("netlink socket"));
    }
    // SAFETY: `raw` is a new fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let set = |opt: libc::c_int, val: *const libc::c_void, len: usize, what: &str| {
        // SAFETY: `val` points to `len` readable bytes for the duration of the call.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                val,
                len as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(last_error(what));
        }
        Ok(())
    };
    let size = RCVBUF;
    set(
        libc::SO_RCVBUFFORCE,
        (&size as *const libc::c_int).cast(),
        std::mem::size_of_val(&size),
        "SO_RCVBUFFORCE",
    )?;
    let tick = libc::timeval {
        tv_sec: 0,
        tv_usec: TICK,
    };
    set(
        libc::SO_RCVTIMEO,
        (&tick as *const libc::timeval).cast(),
        std::mem::size_of_val(&tick),
        "SO_RCVTIMEO",
    )?;
    // SAFETY: sockaddr_nl is plain data; all zeroes then the fields we need.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = IPV4_ROUTE_GROUP;
    // SAFETY: `addr` is a valid sockaddr_nl of the size given.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of_val(&addr) as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(last_error("bind the netlink socket"));
    }
    Ok(fd)
}

/// Reads announcements of `which` routes into `shared` until `stop`.
fn read(fd: &OwnedFd, shared: &(Mutex<State>, Condvar), stop: &AtomicBool, which: Which) {
    let mut buf = vec![0u8; 1 << 20];
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let now = Instant::now();
        let mut s = shared.0.lock().unwrap_or_else(|p| p.into_inner());
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EINTR) => continue,
                Some(libc::ENOBUFS) => s.overflowed = true,
                _ => {
                    s.failed = Some(e.to_string());
                    shared.1.notify_all();
                    return;
                }
            }
        } else {
            let datagram = &buf[..n as usize];
            let found: Vec<(bool, IpNet)> = match which {
                Which::Calix => changes(datagram)
                    .into_iter()
                    .map(|c| match c {
                        Change::Added(r) => (true, r.dst),
                        Change::Removed(r) => (false, r.dst),
                    })
                    .collect(),
                Which::Protocol(p) => of_protocol(datagram, p),
            };
            for (added, dst) in found {
                if added {
                    s.present.entry(dst).or_insert(now);
                } else {
                    s.present.remove(&dst);
                }
            }
        }
        shared.1.notify_all();
    }
}

/// `(added, destination)` of every IPv4 main-table route of routing protocol `proto` that a
/// datagram of the route group announces (`RTM_NEWROUTE`, `RTM_DELROUTE`).
fn of_protocol(datagram: &[u8], proto: u8) -> Vec<(bool, IpNet)> {
    const HEADER: usize = 16; // struct nlmsghdr
    const RTMSG: usize = 12; // struct rtmsg
    const RTA_DST: u16 = 1;
    const RTA_TABLE: u16 = 15;
    let u16_at = |b: &[u8], i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    let mut out = Vec::new();
    let mut rest = datagram;
    while rest.len() >= HEADER {
        let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if len < HEADER || len > rest.len() {
            break;
        }
        let kind = u16_at(rest, 4);
        let body = &rest[HEADER..len];
        let route = kind == libc::RTM_NEWROUTE || kind == libc::RTM_DELROUTE;
        if route && body.len() >= RTMSG && i32::from(body[0]) == libc::AF_INET && body[5] == proto {
            let (dst_len, mut table) = (body[1], u32::from(body[4]));
            let mut dst = std::net::Ipv4Addr::UNSPECIFIED;
            let mut attrs = &body[RTMSG..];
            while attrs.len() >= 4 {
                let alen = usize::from(u16_at(attrs, 0));
                if alen < 4 || alen > attrs.len() {
                    break;
                }
                let v = &attrs[4..alen];
                match (u16_at(attrs, 2), <[u8; 4]>::try_from(v)) {
                    (RTA_DST, Ok(a)) => dst = a.into(),
                    (RTA_TABLE, Ok(t)) => table = u32::from_ne_bytes(t),
                    _ => {}
                }
                attrs = &attrs[alen.next_multiple_of(4).min(attrs.len())..];
            }
            if table == u32::from(libc::RT_TABLE_MAIN) {
                if let Ok(n) = Ipv4Net::new(dst, dst_len) {
                    out.push((kind == libc::RTM_NEWROUTE, IpNet::V4(n)));
                }
            }
        }
        rest = &rest[len.next_multiple_of(4).min(rest.len())..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route message as the kernel sends it: header, rtmsg, RTA_TABLE, RTA_DST.
    fn message(kind: u16, proto: u8, dst: [u8; 4], len: u8) -> Vec<u8> {
        let mut body = vec![libc::AF_INET as u8, len, 0, 0, 254, proto, 0, 1, 0, 0, 0, 0];
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&15u16.to_ne_bytes());
        body.extend_from_slice(&254u32.to_ne_bytes());
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&1u16.to_ne_bytes());
        body.extend_from_slice(&dst);
        let mut m = ((16 + body.len()) as u32).to_ne_bytes().to_vec();
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend(body);
        m
    }

    #[test]
    fn routes_of_a_protocol_are_read_from_raw_datagrams() {
        let mut d = message(libc::RTM_NEWROUTE, 12, [10, 244, 0, 7], 32);
        d.extend(message(libc::RTM_NEWROUTE, 202, [10, 244, 0, 8], 32));
        d.extend(message(libc::RTM_DELROUTE, 12, [10, 244, 1, 0], 26));
        let net = |s: &str| s.parse::<IpNet>().expect("net");
        assert_eq!(
            of_protocol(&d, 12),
            [(true, net("10.244.0.7/32")), (false, net("10.244.1.0/26"))]
        );
        assert!(of_protocol(&d[..20], 12).is_empty());
    }
}
