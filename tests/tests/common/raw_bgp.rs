//! A test peer speaking raw BGP over one TCP connection, read and written by hand: it
//! accepts the agent's connection or dials the node's BGP port (optionally with a TCP MD5
//! password), and sends and reads whole messages.
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use calix_bgp::open::{Capabilities, Open};
use calix_bgp::wire::frame_len;
use calix_bgp::{Family, Message};

/// One connection of a raw peer, read and written by hand.
pub struct Raw {
    pub s: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    pub fn accept(l: &TcpListener) -> Self {
        l.set_nonblocking(false).expect("blocking");
        let (s, _) = l.accept().expect("the agent connects");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Self { s, buf: Vec::new() }
    }

    /// A connection from `from` (an address of `ns`) to the node's BGP port at `to`.
    pub fn dial(ns: &calix_testbed::Netns, from: &str, to: &str) -> Self {
        Self::try_dial(ns, from, to, None)
            .unwrap_or_else(|e| panic!("connect from {from} to {to}: {e}"))
    }

    /// The same, signed with `password` (TCP MD5) when given; an error when it does not
    /// open within 3 s.
    pub fn try_dial(
        ns: &calix_testbed::Netns,
        from: &str,
        to: &str,
        password: Option<&'static [u8]>,
    ) -> std::io::Result<Self> {
        let from: SocketAddr = format!("{from}:0").parse().expect("from");
        let to: SocketAddr = format!("{to}:179").parse().expect("to");
        let s = ns.run(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let s = rt.block_on(async {
                let sock = tokio::net::TcpSocket::new_v4()?;
                if let Some(key) = password {
                    use std::os::fd::AsFd;
                    calix_agent::bgp::md5::set_password(sock.as_fd(), to.ip(), key)?;
                }
                sock.bind(from)?;
                tokio::time::timeout(Duration::from_secs(3), sock.connect(to))
                    .await
                    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
            })?;
            let s = s.into_std()?;
            s.set_nonblocking(false)?;
            Ok::<_, std::io::Error>(s)
        })?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Self { s, buf: Vec::new() })
    }

    pub fn read(&mut self) -> Option<Vec<u8>> {
        loop {
            if let Ok(Some(n)) = frame_len(&self.buf) {
                if self.buf.len() >= n {
                    return Some(self.buf.drain(..n).collect());
                }
            }
            let mut chunk = [0u8; 4096];
            match self.s.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    pub fn message(&mut self) -> Option<Message> {
        self.read()
            .map(|m| Message::decode(&m, true).expect("the agent's message decodes"))
    }

    /// The next message that is not a KEEPALIVE or an UPDATE.
    pub fn next_notification(&mut self) -> Option<calix_bgp::Notification> {
        loop {
            match self.message()? {
                Message::Notification(n) => return Some(n),
                _ => continue,
            }
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("write to the agent");
    }

    /// OPEN both ways (ours says `asn`), then KEEPALIVE both ways unless the agent refuses.
    pub fn open(&mut self, asn: u32) {
        let theirs = self.message().expect("the agent's OPEN");
        assert!(matches!(theirs, Message::Open(_)), "{theirs:?}");
        self.send_open(asn, Ipv4Addr::new(172, 31, 1, 250));
        self.send(&Message::Keepalive.encode(true));
    }

    /// Our OPEN, saying `asn` and `router_id`.
    pub fn send_open(&mut self, asn: u32, router_id: Ipv4Addr) {
        let open = Open {
            asn,
            hold_time: 90,
            router_id,
            capabilities: Capabilities {
                families: vec![Family::IPV4_UNICAST],
                route_refresh: true,
                enhanced_route_refresh: false,
                four_octet_as: Some(asn),
                graceful_restart: None,
                other: Vec::new(),
            },
        };
        self.send(&Message::Open(open).encode(true));
    }
}
