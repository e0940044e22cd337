//! Connected UDP sockets, listed and ended through `NETLINK_SOCK_DIAG`, in the calling
//! thread's network namespace: when a Service's backend goes, a client's UDP socket connected
//! to it would keep sending there (its destination was set once, at `connect`); ending it
//! makes its next call fail with `ECONNABORTED`, and the client (a DNS resolver) opens a new
//! one, which goes to a backend that is there. kube-proxy does the same with conntrack.
//! Needs `CONFIG_INET_DIAG_DESTROY` and `CAP_NET_ADMIN`.
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;
/// `struct inet_diag_msg`.
const MSG_LEN: usize = 72;
const IPPROTO_UDP: u8 = 17;
/// A connected UDP socket's state (`TCP_ESTABLISHED`).
const ESTABLISHED: u32 = 1;
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error("{op} on the sock_diag netlink socket failed")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the kernel answered {0}")]
    Errno(nix::errno::Errno),
    #[error("a malformed sock_diag answer: {0}")]
    Malformed(&'static str),
}

/// A connected UDP socket: its two ends and its cookie (`bpf_get_socket_cookie`'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpSock {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub cookie: u64,
    /// The device it is bound to (0: none), as the kernel gave it.
    ifindex: u32,
    family: u8,
}

impl UdpSock {
    /// A socket of these ends and cookie, bound to no device.
    pub fn new(local: SocketAddr, peer: SocketAddr, cookie: u64) -> Self {
        let family = if peer.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        Self {
            local,
            peer,
            cookie,
            ifindex: 0,
            family: family as u8,
        }
    }

    /// The peer, an IPv4-mapped IPv6 address read as the IPv4 address it is.
    pub fn peer_plain(&self) -> SocketAddr {
        match self.peer {
            SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
                Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
                None => self.peer,
            },
            v4 => v4,
        }
    }
}

struct Socket(OwnedFd);

impl Socket {
    fn open() -> Result<Self, SockDiagError> {
        let io = |op| move |source| SockDiagError::Io { op, source };
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return Err(io("open")(io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let s = Socket(unsafe { OwnedFd::from_raw_fd(fd) });
        let tv = libc::timeval {
            tv_sec: TIMEOUT.as_secs().try_into().unwrap_or(5),
            tv_usec: 0,
        };
        // SAFETY: SO_RCVTIMEO takes a timeval of this size.
        let rc = unsafe {
            libc::setsockopt(
                s.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io("set its timeout")(io::Error::last_os_error()));
        }
        Ok(s)
    }

    fn send(&self, bytes: &[u8]) -> Result<(), SockDiagError> {
        // SAFETY: sockaddr_nl is plain data; all zeroes but the family addresses the kernel.
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `bytes` and `to` are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                0,
                (&to as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 || n as usize != bytes.len() {
            return Err(SockDiagError::Io {
                op: "send",
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Receives messages until `NLMSG_DONE` or an error message (an ack, `code` 0, ends it
    /// too), handing the others to `f`.
    fn answers(
        &self,
        f: &mut dyn FnMut(&[u8]) -> Result<(), SockDiagError>,
    ) -> Result<(), SockDiagError> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: `buf` is valid for writes of its length.
            let n =
                unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(SockDiagError::Io {
                    op: "receive",
                    source: e,
                });
            }
            let mut rest = &buf[..n as usize];
            while rest.len() >= NLMSG_HDRLEN {
                let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                let ty = u16::from_ne_bytes([rest[4], rest[5]]);
                if len < NLMSG_HDRLEN || len > rest.len() {
                    return Err(SockDiagError::Malformed("a message's length"));
                }
                let payload = &rest[NLMSG_HDRLEN..len];
                match ty {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let code = payload
                            .get(..4)
                            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                            .ok_or(SockDiagError::Malformed("an error message"))?;
                        return if code == 0 {
                            Ok(())
                        } else {
                            Err(SockDiagError::Errno(nix::errno::Errno::from_raw(-code)))
                        };
                    }
                    _ => f(payload)?,
                }
                rest = &rest[((len + 3) & !3).min(rest.len())..];
            }
        }
    }
}

/// A request: the netlink header and an `inet_diag_req_v2` for UDP of `family`, naming `id`
/// (48 bytes of `inet_diag_sockid`; zero for a dump).
fn request(ty: u16, flags: u16, family: u8, states: u32, id: &[u8; 48]) -> Vec<u8> {
    let mut b = Vec::with_capacity(NLMSG_HDRLEN + REQ_LEN);
    b.extend_from_slice(&((NLMSG_HDRLEN + REQ_LEN) as u32).to_ne_bytes());
    b.extend_from_slice(&ty.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&1u32.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes());
    b.extend_from_slice(&[family, IPPROTO_UDP, 0, 0]);
    b.extend_from_slice(&states.to_ne_bytes());
    b.extend_from_slice(id);
    b
}

/// One `inet_diag_msg` read into a socket (`None`: not a connected one of a known family).
fn parse(m: &[u8]) -> Result<Option<UdpSock>, SockDiagError> {
    if m.len() < MSG_LEN {
        return Err(SockDiagError::Malformed("a socket's message is short"));
    }
    let (family, state) = (m[0], m[1]);
    if u32::from(state) != ESTABLISHED {
        return Ok(None);
    }
    let id = &m[4..52];
    let port = |at: usize| u16::from_be_bytes([id[at], id[at + 1]]);
    let addr = |at: usize| -> Option<IpAddr> {
        let raw = &id[at..at + 16];
        match i32::from(family) {
            libc::AF_INET => Some(IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]))),
            libc::AF_INET6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(raw);
                Some(IpAddr::V6(Ipv6Addr::from(o)))
            }
            _ => None,
        }
    };
    let (Some(src), Some(dst)) = (addr(4), addr(20)) else {
        return Ok(None);
    };
    let word = |at: usize| u32::from_ne_bytes([id[at], id[at + 1], id[at + 2], id[at + 3]]);
    Ok(Some(UdpSock {
        local: SocketAddr::new(src, port(0)),
        peer: SocketAddr::new(dst, port(2)),
        cookie: u64::from(word(40)) | (u64::from(word(44)) << 32),
        ifindex: word(36),
        family,
    }))
}

/// Every connected UDP socket (IPv4 and IPv6) of the calling thread's network namespace.
pub fn connected_udp() -> Result<Vec<UdpSock>, SockDiagError> {
    let s = Socket::open()?;
    let mut out = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        s.send(&request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            1 << ESTABLISHED,
            &[0; 48],
        ))?;
        s.answers(&mut |m| {
            if let Some(u) = parse(m)? {
                out.push(u);
            }
            Ok(())
        })?;
    }
    Ok(out)
}

/// Ends `sock` (in the calling thread's network namespace): its next call fails with
/// `ECONNABORTED`. Gone already: `Errno(ENOENT)`.
pub fn destroy(sock: &UdpSock) -> Result<(), SockDiagError> {
    let mut id = [0u8; 48];
    id[0..2].copy_from_slice(&sock.local.port().to_be_bytes());
    id[2..4].copy_from_slice(&sock.peer.port().to_be_bytes());
    let put = |id: &mut [u8; 48], at: usize, a: IpAddr| match a {
        IpAddr::V4(v4) => id[at..at + 4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => id[at..at + 16].copy_from_slice(&v6.octets()),
    };
    put(&mut id, 4, sock.local.ip());
    put(&mut id, 20, sock.peer.ip());
    id[36..40].copy_from_slice(&sock.ifindex.to_ne_bytes());
    id[40..44].copy_from_slice(&(sock.cookie as u32).to_ne_bytes());
    id[44..48].copy_from_slice(&((sock.cookie >> 32) as u32).to_ne_bytes());
    let s = Socket::open()?;
    s.send(&request(
        SOCK_DESTROY,
        NLM_F_REQUEST | NLM_F_ACK,
        sock.family,
        u32::MAX,
        &id,
    ))?;
    s.answers(&mut |_| Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_message_reads_into_its_ends_and_cookie() {
        let mut m = [0u8; MSG_LEN];
        m[0] = libc::AF_INET as u8;
        m[1] = ESTABLISHED as u8;
        m[4..6].copy_from_slice(&5353u16.to_be_bytes());
        m[6..8].copy_from_slice(&53u16.to_be_bytes());
        m[8..12].copy_from_slice(&[10, 0, 0, 2]);
        m[24..28].copy_from_slice(&[10, 96, 0, 10]);
        m[44..48].copy_from_slice(&7u32.to_ne_bytes());
        m[48..52].copy_from_slice(&1u32.to_ne_bytes());
        let u = parse(&m).expect("parsed").expect("a connected socket");
        assert_eq!(u.local, "10.0.0.2:5353".parse().expect("addr"));
        assert_eq!(u.peer, "10.96.0.10:53".parse().expect("addr"));
        assert_eq!(u.cookie, (1 << 32) | 7);
        m[1] = 7;
        assert_eq!(parse(&m).expect("parsed"), None, "not connected");
        assert!(parse(&m[..40]).is_err(), "short");
        let mapped = UdpSock {
            peer: "[::ffff:10.96.0.10]:53".parse().expect("addr"),
            ..u
        };
        assert_eq!(mapped.peer_plain(), u.peer);
    }

    #[test]
    fn a_request_is_a_header_and_the_request() {
        let r = request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, 2, 1, &[9; 48]);
        assert_eq!(r.len(), NLMSG_HDRLEN + REQ_LEN);
        assert_eq!(
            u32::from_ne_bytes([r[0], r[1], r[2], r[3]]) as usize,
            r.len()
        );
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), SOCK_DESTROY);
        assert_eq!(&r[16..20], &[2, IPPROTO_UDP, 0, 0]);
        assert_eq!(&r[24..], &[9; 48]);
    }
}
