//! The `NETLINK_NETFILTER` socket: opened in the calling thread's network namespace (the
//! one it acts on for its whole life), blocking, with a receive timeout so a kernel that
//! never answers is an error, not a hang.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::wire::{self, Malformed, Msg, NLMSG_DONE, NLMSG_ERROR};
use super::{NetlinkError, NftError};

const NETLINK_NETFILTER: libc::c_int = 12;
const SOL_NETLINK: libc::c_int = 270;
/// Errors carry the failing message's header only, not all of it.
const NETLINK_CAP_ACK: libc::c_int = 10;
/// How long an answer may take: the kernel answers before `send` returns, so this only
/// bounds a broken kernel or a full receive queue.
const TIMEOUT: Duration = Duration::from_secs(5);
/// One receive: a dump's messages come in batches of at most 32 KiB (netlink's cap).
const RECV_BUF: usize = 64 * 1024;

/// A netfilter netlink socket. Create it inside the namespace it should act on.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl Socket {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> Result<Socket, NftError> {
        let open = |source| NftError::Socket { source };
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(open(io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; all zeroes but the family is "let the kernel pick
        // the port id, no multicast groups".
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `addr` is a valid sockaddr_nl of the length given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(open(io::Error::last_os_error()));
        }
        let s = Socket {
            fd,
            // Distinct from other sockets' numbers, for whoever reads a trace.
            seq: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs() as u32),
            buf: vec![0; RECV_BUF],
        };
        s.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
            .map_err(open)?;
        // `time_t` by inference (naming it is deprecated on musl, whose width changes).
        let tv = libc::timeval {
            tv_sec: TIMEOUT.as_secs().try_into().unwrap_or(1),
            tv_usec: 0,
        };
        // SAFETY: SO_RCVTIMEO takes a timeval of this size.
        let rc = unsafe {
            libc::setsockopt(
                s.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(open(io::Error::last_os_error()));
        }
        Ok(s)
    }

    /// The descriptor (for waiting on it).
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }

    fn setsockopt(&self, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> io::Result<()> {
        // SAFETY: an int option, passed by pointer with its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Makes room for a batch of `bytes` and the acks of `messages`: as root beyond the
    /// system's limits (`SO_*BUFFORCE`), else as far as they allow.
    pub(crate) fn reserve(&self, bytes: usize, messages: usize) {
        let want_snd = (bytes + 64 * 1024).min(i32::MAX as usize) as libc::c_int;
        let want_rcv = (messages * 1024 + 256 * 1024).min(i32::MAX as usize) as libc::c_int;
        for (force, plain, v) in [
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, want_snd),
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, want_rcv),
        ] {
            if self.setsockopt(libc::SOL_SOCKET, force, v).is_err() {
                // Best effort: a batch that still does not fit fails with EMSGSIZE.
                let _ = self.setsockopt(libc::SOL_SOCKET, plain, v);
            }
        }
    }

    /// `n` consecutive sequence numbers; returns the first.
    pub(crate) fn seqs(&mut self, n: u32) -> u32 {
        let first = self.seq;
        self.seq = self.seq.wrapping_add(n);
        first
    }

    /// Sends `bytes` (one or more messages) to the kernel in one datagram.
    pub(crate) fn send(&self, bytes: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_nl is plain data; all zeroes but the family addresses the kernel.
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        loop {
            // SAFETY: `bytes` and `to` are valid for the lengths given.
            let n = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    0,
                    (&to as *const libc::sockaddr_nl).cast(),
                    std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
                )
            };
            if n >= 0 {
                return if n as usize == bytes.len() {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "a short netlink send",
                    ))
                };
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Receives one datagram (one or more messages) and hands its messages to `f`.
    /// `wait: false`: `Ok(false)` at once when nothing is queued.
    pub(crate) fn recv(
        &mut self,
        wait: bool,
        f: &mut dyn FnMut(Msg<'_>) -> Result<(), NetlinkError>,
    ) -> Result<bool, NetlinkError> {
        let flags = libc::MSG_TRUNC | if wait { 0 } else { libc::MSG_DONTWAIT };
        let n = loop {
            // SAFETY: `buf` is valid for writes of its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    flags,
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock if !wait => return Ok(false),
                io::ErrorKind::WouldBlock => return Err(NetlinkError::Timeout(TIMEOUT)),
                _ => {
                    return Err(NetlinkError::Io {
                        op: "receive",
                        source: e,
                    })
                }
            }
        };
        if n > self.buf.len() {
            return Err(Malformed("a netlink datagram larger than the receive buffer").into());
        }
        for m in wire::messages(&self.buf[..n])? {
            f(m)?;
        }
        Ok(true)
    }

    /// Sends one dump request and hands every reply message to `f`, until the dump is done.
    /// An error reply is the kernel's errno.
    pub(crate) fn dump(
        &mut self,
        request: &[u8],
        seq: u32,
        f: &mut dyn FnMut(Msg<'_>) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError> {
        self.send(request)
            .map_err(|source| NetlinkError::Io { op: "send", source })?;
        let mut done = false;
        while !done {
            self.recv(true, &mut |m| {
                if m.seq != seq {
                    return Ok(());
                }
                match m.ty {
                    NLMSG_DONE => done = true,
                    NLMSG_ERROR => {
                        let (code, _) = m.error()?;
                        done = true;
                        if code != 0 {
                            return Err(NetlinkError::Errno(nix::errno::Errno::from_raw(-code)));
                        }
                    }
                    _ => f(m)?,
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}
