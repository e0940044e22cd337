//! The TCP door of `calix.v1.Routes` (watches, and the verdict calls of `calixctl trace`), the
//! only service served on TCP. Only the nodes get in:
//! a connection whose source is no address of a known node (the node records, or the
//! Kubernetes Node objects, route distribution follows: [`Known`]) is closed at once, before
//! it takes a slot or a handshake, and counted (`refused_unknown`). Like the HTTP door
//! ([`crate::metrics`]) nothing a connecting party does can cost the agent more than its
//! limits: a cap on connections (and per remote address, so one node's flood leaves the
//! others their slots), on TLS handshakes in progress and their duration, on streams per
//! connection, TCP and HTTP/2 keepalives that drop dead peers, backoff when accept fails. A
//! handshake that fails (no certificate, one of another CA, expired...) is refused, logged
//! with the reason (throttled) and counted.
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use calix_proto::v1 as pb;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;

use super::conn::{Accepted, Conn, PeerInfo};
use super::door::{DoorStats, Known, PerAddress, Slot, Throttle};
use super::server::RoutesSvc;

/// Limits of the Routes door.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once (a reflector serves every node of the cluster).
    pub max_connections: usize,
    /// Connections from one address at once.
    pub max_per_address: usize,
    /// TLS handshakes in progress at once.
    pub max_handshakes: usize,
    /// Time to complete the TLS handshake.
    pub handshake_timeout: Duration,
    /// TCP keepalive: idle time before the first probe (then every 10 s, 3 probes).
    pub tcp_keepalive: Duration,
    /// HTTP/2 pings on an idle connection, and the time to answer one.
    pub h2_keepalive: Duration,
    pub h2_keepalive_timeout: Duration,
    /// Streams (watches) per connection.
    pub max_streams: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 2048,
            max_per_address: 8,
            max_handshakes: 64,
            handshake_timeout: Duration::from_secs(5),
            tcp_keepalive: Duration::from_secs(30),
            h2_keepalive: Duration::from_secs(20),
            h2_keepalive_timeout: Duration::from_secs(10),
            max_streams: 4,
        }
    }
}

/// Serves the Routes service on `listeners` (this node's addresses: one per family) until
/// `shutdown` turns true (after which the service ends every stream); `tls` none is plain
/// text. The listeners share one set of caps.
pub async fn serve(
    listeners: Vec<TcpListener>,
    tls: Option<Arc<ServerConfig>>,
    svc: RoutesSvc,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let (stats, throttle, known) = (svc.stats.clone(), svc.throttle.clone(), svc.known.clone());
    serve_with(
        listeners, tls, svc, stats, throttle, known, limits, shutdown,
    )
    .await
}

/// [`serve`] for any implementation of `calix.v1.Routes` (the test bed's hostile peer),
/// counting in `stats`, admitting the sources `known` has.
#[allow(clippy::too_many_arguments)]
pub async fn serve_with<S: pb::routes_server::Routes>(
    listeners: Vec<TcpListener>,
    tls: Option<Arc<ServerConfig>>,
    svc: S,
    stats: Arc<DoorStats>,
    throttle: Arc<Throttle>,
    known: Arc<Known>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let (tx, rx) = mpsc::channel::<Result<Accepted, std::io::Error>>(16);
    let door = Arc::new(Door {
        tls,
        limits,
        tx,
        stats,
        throttle,
        known,
        slots: Arc::new(Semaphore::new(limits.max_connections)),
        handshakes: Arc::new(Semaphore::new(limits.max_handshakes)),
        per: Arc::new(PerAddress::default()),
    });
    let accepts: Vec<_> = listeners
        .into_iter()
        .map(|l| tokio::spawn(accept_loop(l, door.clone())))
        .collect();
    drop(door);
    let signal = async move {
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
    };
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(limits.h2_keepalive))
        .http2_keepalive_timeout(Some(limits.h2_keepalive_timeout))
        .max_concurrent_streams(Some(limits.max_streams))
        .add_service(pb::routes_server::RoutesServer::new(svc))
        .serve_with_incoming_shutdown(ReceiverStream::new(rx), signal)
        .await;
    for a in accepts {
        a.abort();
    }
    served
}

/// What every accept loop of the door shares: the caps, the counters, who is known.
struct Door {
    tls: Option<Arc<ServerConfig>>,
    limits: Limits,
    tx: mpsc::Sender<Result<Accepted, std::io::Error>>,
    stats: Arc<DoorStats>,
    throttle: Arc<Throttle>,
    known: Arc<Known>,
    slots: Arc<Semaphore>,
    handshakes: Arc<Semaphore>,
    per: Arc<PerAddress>,
}

/// First pause after a failed accept (EMFILE...); doubles up to a second.
const FIRST_ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

async fn accept_loop(listener: TcpListener, door: Arc<Door>) {
    // Until the nodes are known every source would be refused: peers that dial meanwhile
    // wait in the backlog.
    door.known.listed().await;
    let limits = door.limits;
    let mut backoff = FIRST_ACCEPT_BACKOFF;
    loop {
        let (sock, remote) = match listener.accept().await {
            Ok(s) => {
                backoff = FIRST_ACCEPT_BACKOFF;
                s
            }
            Err(e) => {
                tracing::warn!(error = %e, ?backoff, "routes: accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let source = remote.ip().to_canonical();
        // Before any slot, any handshake: only the nodes' own addresses get further. A pod
        // on some node, a scanner, anything else is closed at once (a reset: nothing lingers).
        if !door.known.has_address(source) {
            door.stats.refused_unknown.fetch_add(1, Ordering::Relaxed);
            let _ = sock.set_zero_linger();
            if door.throttle.allow() {
                tracing::warn!(%remote, "routes: refused a connection before TLS: the source is no address of a known node");
            }
            continue;
        }
        let Some((slot, handshake)) =
            admit(&door.slots, &door.handshakes, &door.per, source, &limits)
        else {
            door.stats.refused_busy.fetch_add(1, Ordering::Relaxed);
            if door.throttle.allow() {
                tracing::warn!(%remote, "routes: refused a connection: too many open");
            }
            continue;
        };
        keepalive(&sock, limits.tcp_keepalive);
        let _ = sock.set_nodelay(true);
        let door = door.clone();
        tokio::spawn(async move {
            let conn =
                handshake_with(sock, remote, door.tls.clone(), limits.handshake_timeout).await;
            drop(handshake);
            match conn {
                Ok((conn, cert)) => {
                    door.stats.accepted.fetch_add(1, Ordering::Relaxed);
                    let _ = door
                        .tx
                        .send(Ok(Accepted {
                            conn,
                            peer: PeerInfo { remote, cert },
                            _slot: slot,
                        }))
                        .await;
                }
                Err(reason) => {
                    door.stats.refused_tls.fetch_add(1, Ordering::Relaxed);
                    if door.throttle.allow() {
                        tracing::warn!(%remote, %reason, "routes: refused a connection: TLS handshake failed");
                    }
                }
            }
        });
    }
}

fn admit(
    slots: &Arc<Semaphore>,
    handshakes: &Arc<Semaphore>,
    per: &Arc<PerAddress>,
    addr: IpAddr,
    limits: &Limits,
) -> Option<(Slot, OwnedSemaphorePermit)> {
    let permit = slots.clone().try_acquire_owned().ok()?;
    let handshake = handshakes.clone().try_acquire_owned().ok()?;
    Some((per.slot(permit, addr, limits.max_per_address)?, handshake))
}

type ServerConn = Conn<tokio_rustls::server::TlsStream<TcpStream>>;

async fn handshake_with(
    sock: TcpStream,
    remote: SocketAddr,
    tls: Option<Arc<ServerConfig>>,
    timeout: Duration,
) -> Result<
    (
        ServerConn,
        Option<rustls::pki_types::CertificateDer<'static>>,
    ),
    String,
> {
    let Some(cfg) = tls else {
        return Ok((Conn::Plain(sock), None));
    };
    let accept = tokio_rustls::TlsAcceptor::from(cfg).accept(sock);
    match tokio::time::timeout(timeout, accept).await {
        Err(_) => Err(format!("no handshake within {timeout:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(s)) => {
            let cert = s
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.clone().into_owned());
            if cert.is_none() {
                // The verifier requires one; never reached.
                return Err(format!("{remote} sent no certificate"));
            }
            Ok((Conn::Tls(Box::new(s)), cert))
        }
    }
}

/// The backlog of a Routes listener: peers that dial while the agent starts wait in it.
const BACKLOG: u32 = 1024;

/// A Routes listener on `addr`, bound with `IP_FREEBIND`: an address the node does not have
/// yet (DHCP, an interface that comes up after the agent) binds now and is served from the
/// moment it appears.
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{setsockopt, sockopt};
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    // IP_FREEBIND is honoured by IPv6 sockets too (the kernel keeps one flag for both).
    setsockopt(&sock, sockopt::IpFreebind, &true).map_err(std::io::Error::from)?;
    sock.bind(addr)?;
    sock.listen(BACKLOG)
}

/// TCP keepalive on an accepted socket: a peer that vanished without a FIN (power loss, a
/// partition) is noticed.
fn keepalive(sock: &TcpStream, idle: Duration) {
    use nix::sys::socket::{setsockopt, sockopt};
    let secs = u32::try_from(idle.as_secs()).unwrap_or(u32::MAX);
    let _ = setsockopt(sock, sockopt::KeepAlive, &true);
    let _ = setsockopt(sock, sockopt::TcpKeepIdle, &secs);
    let _ = setsockopt(sock, sockopt::TcpKeepInterval, &10);
    let _ = setsockopt(sock, sockopt::TcpKeepCount, &3);
}
