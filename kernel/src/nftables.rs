//! nftables' ruleset generation: a number the kernel moves at every committed nftables
//! transaction of a network namespace (any table, any tool) and at nothing else — a listing
//! does not move it. While it stands still, no table of the namespace changed: a caller that
//! checks its tables for drift need not list them (`nft list` is a process; the generation is
//! one netlink request, `NFT_MSG_GETGEN`, as `nft` itself asks it).
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// linux/netfilter/nfnetlink.h: the nftables subsystem.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// linux/netfilter/nf_tables.h: `NFT_MSG_NEWGEN` (the answer), `NFT_MSG_GETGEN` (the question).
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
/// linux/netfilter/nf_tables.h: `NFTA_GEN_ID` (u32, network byte order).
const NFTA_GEN_ID: u16 = 1;
/// linux/netlink.h.
const NLMSG_ERROR: u16 = 2;
const NLMSG_HDRLEN: usize = 16;
/// struct nfgenmsg: family, version, resource id.
const NFGENMSG_LEN: usize = 4;
/// How long the kernel may take to answer (it answers at once; this only bounds a surprise).
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

/// The nftables ruleset generation of the calling thread's network namespace.
pub fn generation() -> std::io::Result<u32> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: ANSWER_WITHIN.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: SO_RCVTIMEO reads a timeval of the size given, valid for the call.
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set < 0 {
        return Err(std::io::Error::last_os_error());
    }
    const SEQ: u32 = 1;
    let request = request(SEQ);
    // SAFETY: `request` is valid for its length; the kernel is the destination (no address:
    // a netlink socket's default peer is the kernel).
    let sent = unsafe { libc::send(fd.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = [0u8; 512];
    // SAFETY: `buf` is writable for its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    parse_answer(&buf[..n as usize], SEQ)
}

/// `NFT_MSG_GETGEN`: a netlink header and an nfgenmsg (AF_UNSPEC, version 0).
fn request(seq: u32) -> [u8; NLMSG_HDRLEN + NFGENMSG_LEN] {
    const LEN: usize = NLMSG_HDRLEN + NFGENMSG_LEN;
    let mut m = [0u8; LEN];
    m[0..4].copy_from_slice(&(LEN as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETGEN).to_ne_bytes());
    m[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    // Port 0 (the kernel assigns ours), family AF_UNSPEC, version NFNETLINK_V0, resource 0.
    m
}

/// The generation in the kernel's answer to request `seq`.
fn parse_answer(msg: &[u8], seq: u32) -> std::io::Result<u32> {
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    let u16_at = |i: usize| msg.get(i..i + 2).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    let u32_at = |i: usize| {
        msg.get(i..i + 4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    };
    let (Some(len), Some(kind), Some(got_seq)) = (u32_at(0), u16_at(4), u32_at(8)) else {
        return Err(bad("short netlink answer"));
    };
    let len = (len as usize).min(msg.len());
    if got_seq != seq {
        return Err(bad("netlink answer to another request"));
    }
    if kind == NLMSG_ERROR {
        // struct nlmsgerr: a negative errno, then the request's header.
        let errno = u32_at(NLMSG_HDRLEN).map_or(0, |e| -(e as i32));
        return Err(std::io::Error::from_raw_os_error(errno));
    }
    if kind != NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWGEN {
        return Err(bad("netlink answer of another kind than NFT_MSG_NEWGEN"));
    }
    // Attributes: length (header included), type; padded to 4 bytes.
    let mut at = NLMSG_HDRLEN + NFGENMSG_LEN;
    while at + 4 <= len {
        let (Some(alen), Some(atype)) = (u16_at(at), u16_at(at + 2)) else {
            break;
        };
        let alen = usize::from(alen);
        if alen < 4 || at + alen > len {
            break;
        }
        if atype & 0x3fff == NFTA_GEN_ID && alen == 8 {
            let v = &msg[at + 4..at + 8];
            return Ok(u32::from_be_bytes([v[0], v[1], v[2], v[3]]));
        }
        at += (alen + 3) & !3;
    }
    Err(bad("NFT_MSG_NEWGEN without NFTA_GEN_ID"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as the kernel sends it: header, nfgenmsg, `attrs` (type, payload).
    fn answer(kind: u16, seq: u32, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDRLEN];
        m.extend([0, 0, 0, 0]);
        for (t, v) in attrs {
            m.extend(((4 + v.len()) as u16).to_ne_bytes());
            m.extend(t.to_ne_bytes());
            m.extend(*v);
            while !m.len().is_multiple_of(4) {
                m.push(0);
            }
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&kind.to_ne_bytes());
        m[8..12].copy_from_slice(&seq.to_ne_bytes());
        m
    }

    const NEWGEN: u16 = NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWGEN;

    #[test]
    fn the_request_is_a_getgen_of_the_nftables_subsystem() {
        let r = request(7);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().expect("4")), 20);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 0x0a10);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), 1, "NLM_F_REQUEST");
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().expect("4")), 7);
        assert_eq!(&r[16..], &[0, 0, 0, 0]);
    }

    #[test]
    fn the_generation_is_read_among_the_other_attributes() {
        // NFTA_GEN_PROC_PID (2) and NFTA_GEN_PROC_NAME (3) around it, as the kernel sends.
        let m = answer(
            NEWGEN,
            1,
            &[
                (2, &1234u32.to_be_bytes()),
                (NFTA_GEN_ID, &0x0102_0304u32.to_be_bytes()),
                (3, b"nft\0"),
            ],
        );
        assert_eq!(parse_answer(&m, 1).expect("generation"), 0x0102_0304);
    }

    #[test]
    fn errors_and_strange_answers_are_errors() {
        let mut err = answer(NLMSG_ERROR, 1, &[]);
        err.truncate(NLMSG_HDRLEN);
        err.extend((-libc::EPERM).to_ne_bytes());
        err.extend([0u8; NLMSG_HDRLEN]);
        let e = parse_answer(&err, 1).expect_err("an error");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        let ok = answer(NEWGEN, 1, &[(NFTA_GEN_ID, &5u32.to_be_bytes())]);
        assert!(parse_answer(&ok, 2).is_err(), "another request's answer");
        assert!(parse_answer(&ok[..10], 1).is_err(), "short");
        assert!(
            parse_answer(&answer(NEWGEN, 1, &[(3, b"nft\0")]), 1).is_err(),
            "no generation"
        );
        let other = answer(
            NFNL_SUBSYS_NFTABLES << 8 | 1,
            1,
            &[(1, &5u32.to_be_bytes())],
        );
        assert!(parse_answer(&other, 1).is_err(), "another message");
    }
}
