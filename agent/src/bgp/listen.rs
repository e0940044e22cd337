//! The speaker's door: it listens on the BGP port of this node's addresses, so a router that
//! connects to its peers (or only waits for them, `passive`) reaches the node too. Only the
//! configured peers get in: each peer's password is keyed on the listening sockets (the kernel
//! drops unsigned or wrongly signed segments of that address), and a connection from any other
//! address is closed at once, counted and logged. A taken connection's first message (the
//! peer's OPEN) is read here, at most one at a time per peer, and handed to the peer's task,
//! which settles a collision with its own connection by the BGP identifiers (RFC 4271 §6.8).
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use calix_bgp::{DecodeError, Message};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::conn::{Connection, Read};
use super::md5;

/// How long an accepted connection has to send its OPEN.
const OPEN_WAIT: Duration = Duration::from_secs(10);
/// How long a failed bind waits before the next try.
const BIND_RETRY: Duration = Duration::from_secs(10);

/// A connection a peer opened, with its first message.
pub struct Incoming {
    pub conn: Connection,
    pub first: Result<Message, DecodeError>,
    pub from: SocketAddr,
}

impl Incoming {
    /// The BGP identifier its OPEN names, if its first message is an OPEN.
    pub fn router_id(&self) -> Option<std::net::Ipv4Addr> {
        match &self.first {
            Ok(Message::Open(o)) => Some(o.router_id),
            _ => None,
        }
    }
}

struct Door {
    peer: usize,
    tx: mpsc::Sender<Incoming>,
    password: Option<Vec<u8>>,
    /// An OPEN is being read from a connection of this peer.
    reading: Arc<AtomicBool>,
}

#[derive(Default)]
struct Inner {
    doors: HashMap<IpAddr, Door>,
    sockets: Vec<(SocketAddr, Arc<TcpListener>)>,
}

/// Who may come in: the configured peers by address, and the listening sockets.
#[derive(Default)]
pub struct Doors {
    inner: Mutex<Inner>,
    /// Connections closed at once: from no configured peer's address, or while one of the
    /// same peer was still sending its OPEN.
    refused: AtomicU64,
}

impl Doors {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets peer `peer` at `address` in: its connections go to `tx`, keyed with `password`.
    pub fn admit(
        &self,
        peer: usize,
        address: IpAddr,
        password: Option<Vec<u8>>,
        tx: mpsc::Sender<Incoming>,
    ) {
        let mut inner = self.lock();
        if let Some(key) = &password {
            for (at, l) in &inner.sockets {
                key_socket(l, *at, address, key);
            }
        }
        inner.doors.insert(
            address,
            Door {
                peer,
                tx,
                password,
                reading: Arc::default(),
            },
        );
    }

    /// Peer `peer` at `address` is gone (unless another took the address since).
    pub fn forget(&self, peer: usize, address: IpAddr) {
        let mut inner = self.lock();
        if inner.doors.get(&address).is_some_and(|d| d.peer == peer) {
            let door = inner.doors.remove(&address);
            if door.and_then(|d| d.password).is_some() {
                for (at, l) in &inner.sockets {
                    key_socket(l, *at, address, &[]);
                }
            }
        }
    }

    /// The addresses listened on, IPv4 first and each family in order (the sockets are
    /// bound concurrently, so their own order varies from one start to the next).
    pub fn listening(&self) -> Vec<String> {
        let mut at: Vec<SocketAddr> = self.lock().sockets.iter().map(|(a, _)| *a).collect();
        at.sort();
        at.iter().map(SocketAddr::to_string).collect()
    }

    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn add_socket(&self, at: SocketAddr, l: Arc<TcpListener>) {
        let mut inner = self.lock();
        for (address, d) in &inner.doors {
            if let Some(key) = &d.password {
                key_socket(&l, at, *address, key);
            }
        }
        inner.sockets.push((at, l));
    }

    fn remove_socket(&self, at: SocketAddr) {
        self.lock().sockets.retain(|(a, _)| *a != at);
    }

    fn door(&self, from: IpAddr) -> Option<(mpsc::Sender<Incoming>, Arc<AtomicBool>)> {
        self.lock()
            .doors
            .get(&from)
            .map(|d| (d.tx.clone(), d.reading.clone()))
    }
}

fn key_socket(l: &TcpListener, at: SocketAddr, peer: IpAddr, key: &[u8]) {
    if at.is_ipv4() != peer.is_ipv4() {
        return;
    }
    if let Err(e) = md5::set_password(l.as_fd(), peer, key) {
        tracing::error!(listener = %at, %peer, error = %e,
            "bgp: cannot key the listening socket for the peer's password");
    }
}

/// The listening sockets' tasks; they end (and their sockets close) when dropped.
pub struct Listeners {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Listeners {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Listens on `port` of each of `addresses` (port 0: nowhere).
pub fn listen(addresses: &[IpAddr], port: u16, doors: &Arc<Doors>) -> Listeners {
    let tasks = if port == 0 {
        Vec::new()
    } else {
        addresses
            .iter()
            .map(|a| tokio::spawn(listen_on(SocketAddr::new(*a, port), doors.clone())))
            .collect()
    };
    Listeners { tasks }
}

fn bind(at: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match at {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(at)?;
    socket.listen(64)
}

/// Removes its socket from the doors when the task ends (or is aborted).
struct Registered {
    at: SocketAddr,
    doors: Arc<Doors>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.doors.remove_socket(self.at);
    }
}

async fn listen_on(at: SocketAddr, doors: Arc<Doors>) {
    // The first retry is soon: sockets of settings just replaced may still be closing.
    let mut wait = Duration::from_secs(1);
    let listener = loop {
        match bind(at) {
            Ok(l) => break Arc::new(l),
            Err(e) => {
                tracing::warn!(address = %at, error = %e, retry_secs = wait.as_secs(),
                    "bgp: cannot listen: peers must wait for this node to connect");
                tokio::time::sleep(wait).await;
                wait = BIND_RETRY;
            }
        }
    };
    doors.add_socket(at, listener.clone());
    let _registered = Registered {
        at,
        doors: doors.clone(),
    };
    tracing::info!(address = %at, "bgp: listening");
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(address = %at, error = %e, "bgp: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let ip = canonical(from.ip());
        let Some((tx, reading)) = doors.door(ip) else {
            doors.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, "bgp: a connection from an address that is no configured peer: closed");
            continue;
        };
        if reading.swap(true, Ordering::AcqRel) {
            doors.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, "bgp: the peer's previous connection has not sent its OPEN yet: this one is closed");
            continue;
        }
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let mut conn = Connection::new(stream);
            let first = tokio::time::timeout(OPEN_WAIT, conn.read(false)).await;
            reading.store(false, Ordering::Release);
            match first {
                Ok(Ok(Read::Message(first))) => {
                    let _ = tx.send(Incoming { conn, first, from }).await;
                }
                Ok(Ok(Read::Eof)) => {
                    tracing::debug!(%from, "bgp: an incoming connection closed before its OPEN")
                }
                Ok(Err(e)) => {
                    tracing::debug!(%from, error = %e, "bgp: an incoming connection failed before its OPEN")
                }
                Err(_) => {
                    tracing::warn!(%from, secs = OPEN_WAIT.as_secs(), "bgp: an incoming connection sent no OPEN: closed")
                }
            }
        });
    }
}

/// An IPv4 peer reaching an IPv6 socket shows as `::ffff:a.b.c.d`.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_addresses_read_as_ipv4() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert_eq!(canonical(ip("::ffff:172.31.1.254")), ip("172.31.1.254"));
        assert_eq!(canonical(ip("fd31:1::fe")), ip("fd31:1::fe"));
        assert_eq!(canonical(ip("172.31.1.254")), ip("172.31.1.254"));
    }

    #[tokio::test]
    async fn a_door_is_forgotten_only_by_its_peer() {
        let doors = Doors::default();
        let ip: IpAddr = "172.31.1.254".parse().expect("ip");
        let (tx, _rx) = mpsc::channel(1);
        doors.admit(1, ip, None, tx.clone());
        doors.admit(2, ip, None, tx);
        doors.forget(1, ip);
        assert!(doors.door(ip).is_some(), "peer 2 holds the address");
        doors.forget(2, ip);
        assert!(doors.door(ip).is_none());
    }

    #[tokio::test]
    async fn listeners_are_listed_ipv4_first_whatever_order_they_came_in() {
        let doors = Doors::default();
        for at in ["[::1]:0", "127.0.0.1:0"] {
            let l = TcpListener::bind(at).await.expect("bind on loopback");
            let at = l.local_addr().expect("address");
            doors.add_socket(at, Arc::new(l));
        }
        let listed = doors.listening();
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert!(listed[0].starts_with("127.0.0.1:"), "{listed:?}");
        assert!(listed[1].starts_with("[::1]:"), "{listed:?}");
    }
}
