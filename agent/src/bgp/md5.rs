//! TCP MD5 signatures (RFC 2385) on a socket: `TCP_MD5SIG` with the peer's address and the
//! key, as BIRD's and FRR's `password` set it. Set on a socket before it connects (or on a
//! listener, for each peer it may accept): the kernel then signs every segment to that peer
//! and drops unsigned or wrongly signed ones from it.
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The longest key the kernel takes (`TCP_MD5SIG_MAXKEYLEN`).
pub const MAX_KEY_LEN: usize = 80;

/// `struct tcp_md5sig` (linux/tcp.h).
#[repr(C)]
struct TcpMd5Sig {
    addr: libc::sockaddr_storage,
    flags: u8,
    prefixlen: u8,
    keylen: u16,
    ifindex: libc::c_int,
    key: [u8; MAX_KEY_LEN],
}

/// Signs the socket's segments to and from `peer` with `key` (empty: removes the key).
pub fn set_password(fd: BorrowedFd<'_>, peer: IpAddr, key: &[u8]) -> io::Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a TCP MD5 password of {} bytes: at most {MAX_KEY_LEN}",
                key.len()
            ),
        ));
    }
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut sig: TcpMd5Sig = unsafe { std::mem::zeroed() };
    match peer {
        IpAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe { &mut *(&mut sig.addr as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.octets());
        }
        IpAddr::V6(a) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&mut sig.addr as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = a.octets();
        }
    }
    sig.keylen = key.len() as u16;
    sig.key[..key.len()].copy_from_slice(key);
    // SAFETY: setsockopt with a pointer to a live struct and its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_MD5SIG,
            &sig as *const _ as *const libc::c_void,
            std::mem::size_of::<TcpMd5Sig>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
