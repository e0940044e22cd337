//! `nfnetlink_log`: the packets a `log group` rule ([`super::Expr::Log`]) sends, read by a
//! listener bound to that group in the namespace it was created in. The kernel queues each
//! packet's first bytes (the snap length the rule or the listener sets) and sends them at once
//! (a queue threshold of one); a listener that reads too slowly loses packets (`ENOBUFS`),
//! counted, never blocking the kernel.
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use super::socket::Socket;
use super::wire::{self, malformed, Malformed, Msg, Writer, NLMSG_ERROR, NLM_F_ACK, NLM_F_REQUEST};
use super::NetlinkError;

/// `NFNL_SUBSYS_ULOG`.
const SUBSYS_ULOG: u16 = 4;
/// `NFULNL_MSG_PACKET`, `NFULNL_MSG_CONFIG`.
const MSG_PACKET: u16 = SUBSYS_ULOG << 8;
const MSG_CONFIG: u16 = (SUBSYS_ULOG << 8) | 1;
/// `NFULA_CFG_CMD`, `_MODE`, `_QTHRESH`; `NFULNL_CFG_CMD_BIND`; `NFULNL_COPY_PACKET`.
const CFG_CMD: u16 = 1;
const CFG_MODE: u16 = 2;
const CFG_QTHRESH: u16 = 5;
const CMD_BIND: u8 = 1;
const COPY_PACKET: u8 = 2;
/// `NFULA_PAYLOAD`, `NFULA_PREFIX`.
const ATTR_PAYLOAD: u16 = 9;
const ATTR_PREFIX: u16 = 10;

/// One logged packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    /// `NFPROTO_IPV4` (2) or `NFPROTO_IPV6` (10), as the hook saw it.
    pub family: u8,
    /// The rule's prefix.
    pub prefix: String,
    /// The packet from its network header, cut at the snap length.
    pub payload: Vec<u8>,
}

/// A listener of one `nfnetlink_log` group.
#[derive(Debug)]
pub struct LogListener {
    socket: Socket,
    /// Packets the kernel could not queue for this listener (it read too slowly).
    lost: u64,
}

impl LogListener {
    /// Binds `group` in the calling thread's network namespace, copying up to `snaplen`
    /// bytes of each packet. `EBUSY`: another listener has the group.
    pub fn bind(group: u16, snaplen: u32) -> Result<Self, NetlinkError> {
        let mut socket = Socket::open().map_err(|e| match e {
            super::NftError::Socket { source } => NetlinkError::Io { op: "open", source },
            _ => NetlinkError::Io {
                op: "open",
                source: io::Error::other(e.to_string()),
            },
        })?;
        // Room for a burst of packets (as root beyond the system's limits).
        socket.reserve(0, 1024);
        let seq = socket.seqs(1);
        let mut w = Writer::new();
        w.begin(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq, 0, group);
        w.put(CFG_CMD, &[CMD_BIND]);
        let mut mode = snaplen.to_be_bytes().to_vec();
        mode.extend_from_slice(&[COPY_PACKET, 0]);
        w.put(CFG_MODE, &mode);
        w.put_be32(CFG_QTHRESH, 1);
        w.end();
        socket
            .send(&w.into_bytes())
            .map_err(|source| NetlinkError::Io { op: "send", source })?;
        let mut answer = None;
        while answer.is_none() {
            socket.recv(true, &mut |m: Msg<'_>| {
                if m.ty == NLMSG_ERROR {
                    let (code, of) = m.error()?;
                    if of == seq {
                        answer = Some(code);
                    }
                }
                Ok(())
            })?;
        }
        match answer {
            Some(0) | None => Ok(Self { socket, lost: 0 }),
            Some(code) => Err(NetlinkError::Errno(nix::errno::Errno::from_raw(-code))),
        }
    }

    /// Every packet queued now (never waits).
    pub fn drain(&mut self) -> Result<Vec<Logged>, NetlinkError> {
        let mut out = Vec::new();
        loop {
            let mut bad = None;
            let got = self.socket.recv(false, &mut |m: Msg<'_>| {
                if m.ty == MSG_PACKET {
                    match parse(m.payload) {
                        Ok(p) => out.push(p),
                        Err(e) => bad = Some(e),
                    }
                }
                Ok(())
            });
            match got {
                Ok(true) => {}
                Ok(false) => return Ok(out),
                Err(NetlinkError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::ENOBUFS) =>
                {
                    self.lost += 1;
                }
                Err(e) => return Err(e),
            }
            if let Some(e) = bad {
                return Err(e.into());
            }
        }
    }

    /// How many times the kernel dropped packets for this listener (its queue was full).
    pub fn lost(&self) -> u64 {
        self.lost
    }
}

impl AsRawFd for LogListener {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.raw_fd()
    }
}

/// A `NFULNL_MSG_PACKET` message's payload (after the netlink header).
fn parse(payload: &[u8]) -> Result<Logged, Malformed> {
    let (family, attrs) = wire::nf(payload)?;
    let mut logged = Logged {
        family,
        prefix: String::new(),
        payload: Vec::new(),
    };
    for a in attrs {
        match a? {
            (ATTR_PREFIX, v) => logged.prefix = wire::string(v)?,
            (ATTR_PAYLOAD, v) => logged.payload = v.to_vec(),
            _ => {}
        }
    }
    if logged.payload.is_empty() {
        return Err(malformed("a logged packet without its payload"));
    }
    Ok(logged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logged_packet_reads_back_its_family_prefix_and_payload() {
        let mut w = Writer::new();
        w.begin(MSG_PACKET, 0, 0, 10, 7);
        w.put(1, &[0x86, 0xdd, 3, 0]);
        w.put_str(ATTR_PREFIX, "calix cali1 eg");
        w.put(ATTR_PAYLOAD, &[0x60, 0, 0, 0, 0]);
        w.end();
        let bytes = w.into_bytes();
        let msgs = wire::messages(&bytes).expect("one message");
        let p = parse(msgs[0].payload).expect("parses");
        assert_eq!(p.family, 10);
        assert_eq!(p.prefix, "calix cali1 eg");
        assert_eq!(p.payload, vec![0x60, 0, 0, 0, 0]);
        // No payload: refused, not an empty packet.
        let mut w = Writer::new();
        w.begin(MSG_PACKET, 0, 0, 2, 7);
        w.put_str(ATTR_PREFIX, "x");
        w.end();
        let bytes = w.into_bytes();
        let msgs = wire::messages(&bytes).expect("one message");
        assert!(parse(msgs[0].payload).is_err());
        // A truncated message.
        assert!(parse(&[2, 0]).is_err());
    }
}
