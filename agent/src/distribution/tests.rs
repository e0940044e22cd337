//! The Routes server, door and follower together on loopback (no root): mutual TLS, the
//! stream's snapshot, deltas and shutdown, the door's caps.
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use calix_core::routes::peers::Target;
use calix_core::update::PeerEvent;
use calix_core::Route;
use calix_testbed::tls::Ca;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};

use super::client::{self, Dialer, PeerMessage};
use super::door::{DoorStats, Known};
use super::feed::Feed;
use super::listener::{self, Limits};
use super::server::{Feeds, RoutesSvc};
use super::tls::{LiveTls, TlsMaterial};
use crate::distribution::tls::CertSource;

fn material(ca: &Ca, name: &str) -> TlsMaterial {
    let c = ca.issue(name).expect("cert");
    let p = Path::new("(test)");
    TlsMaterial::from_pem(
        (p, ca.pem().as_bytes()),
        (p, c.cert_pem.as_bytes()),
        (p, c.key_pem.as_bytes()),
    )
    .expect("material")
}

fn route(p: &str) -> Route {
    Route {
        prefix: p.parse().expect("net"),
        node: "a".into(),
        next_hop: "192.0.2.1".parse().expect("ip"),
    }
}

struct Server {
    addr: String,
    own: Arc<Feed>,
    stats: Arc<DoorStats>,
    stop: watch::Sender<bool>,
}

/// Node "a"'s Routes server on 127.0.0.1, serving `own`; "b" may watch, from 127.0.0.1.
async fn server(ca: &Ca, limits: Limits) -> Server {
    server_knowing(ca, limits, &["127.0.0.1"]).await
}

/// [`server`], the known nodes at `addresses` (every other source is a stranger).
async fn server_knowing(ca: &Ca, limits: Limits, addresses: &[&str]) -> Server {
    server_answering(ca, limits, addresses, None).await
}

/// [`server_knowing`], answering `Verdict` calls with `verdicts`.
async fn server_answering(
    ca: &Ca,
    limits: Limits,
    addresses: &[&str],
    verdicts: Option<Arc<dyn super::server::Verdicts>>,
) -> Server {
    let sock = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = sock.local_addr().expect("addr").to_string();
    let own = Arc::new(Feed::default());
    let known = Arc::new(Known::default());
    known.set(
        ["b".to_string()].into(),
        addresses.iter().map(|a| a.parse().expect("ip")).collect(),
    );
    let stats = Arc::new(DoorStats::default());
    let (stop, stop_rx) = watch::channel(false);
    let svc = RoutesSvc {
        feeds: Arc::new(Feeds {
            own: own.clone(),
            relay: Arc::new(Feed::default()),
            reflector: false,
        }),
        known,
        stats: stats.clone(),
        shutdown: stop_rx.clone(),
        throttle: Arc::default(),
        verdicts,
    };
    let tls = material(ca, "a").server_config().expect("server");
    tokio::spawn(listener::serve(vec![sock], Some(tls), svc, limits, stop_rx));
    Server {
        addr,
        own,
        stats,
        stop,
    }
}

async fn next(rx: &mut mpsc::Receiver<PeerMessage>) -> PeerEvent {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an event within 5 s")
        .expect("follower alive")
        .event
}

#[tokio::test]
async fn a_follower_gets_the_snapshot_then_deltas_over_mutual_tls_and_sees_the_shutdown() {
    let ca = Ca::new("test-ca").expect("ca");
    let s = server(&ca, Limits::default()).await;
    let mut set = BTreeMap::new();
    set.insert(route("10.0.0.0/26").prefix, route("10.0.0.0/26"));
    s.own.publish(&set, Instant::now());
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 7, tx));
    let generation = match next(&mut rx).await {
        PeerEvent::Snapshot {
            generation, routes, ..
        } => {
            assert_eq!(routes, vec![route("10.0.0.0/26")]);
            generation
        }
        other => panic!("{other:?}"),
    };
    set.insert(route("10.0.0.64/26").prefix, route("10.0.0.64/26"));
    s.own.publish(&set, Instant::now());
    match next(&mut rx).await {
        PeerEvent::Delta {
            generation: g,
            routes,
            withdrawn,
            ..
        } => {
            assert_eq!(g, generation + 1);
            assert_eq!(routes, vec![route("10.0.0.64/26")]);
            assert!(withdrawn.is_empty());
        }
        other => panic!("{other:?}"),
    }
    let _ = s.stop.send(true);
    match next(&mut rx).await {
        PeerEvent::Down { reason, .. } => assert!(reason.contains("shutting down"), "{reason}"),
        other => panic!("{other:?}"),
    }
    follower.abort();
    assert_eq!(s.stats.counts().accepted, 1);
}

#[tokio::test]
async fn a_server_certificate_of_another_node_is_refused_by_the_follower() {
    let ca = Ca::new("test-ca").expect("ca");
    let s = server(&ca, Limits::default()).await;
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    // "c" is expected at a's address: a's certificate does not name c.
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("c".into(), target, dialer, 1, tx));
    match next(&mut rx).await {
        PeerEvent::Down { reason, .. } => {
            assert!(reason.contains("not valid for name \"c\""), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    follower.abort();
}

fn material_names(ca: &Ca, names: &[&str]) -> TlsMaterial {
    let c = ca.issue_names(names).expect("cert");
    let p = Path::new("(test)");
    TlsMaterial::from_pem(
        (p, ca.pem().as_bytes()),
        (p, c.cert_pem.as_bytes()),
        (p, c.key_pem.as_bytes()),
    )
    .expect("material")
}

/// A certificate that names two nodes (both DNS SANs valid, signed by the CA) identifies
/// neither: a client presenting one is refused whichever of its names it watches as, and a
/// server presenting one is refused by a follower that dialed one of its names.
#[tokio::test]
async fn a_certificate_naming_two_nodes_is_refused_on_both_sides() {
    let ca = Ca::new("test-ca").expect("ca");
    let s = server(&ca, Limits::default()).await;
    s.own.publish(&BTreeMap::new(), Instant::now());
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(
            material_names(&ca, &["b", "c"])
                .client_config()
                .expect("client"),
        ),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    match next(&mut rx).await {
        PeerEvent::Down { reason, .. } => assert!(reason.contains("more than one"), "{reason}"),
        other => panic!("a client certificate naming b and c watched as b: {other:?}"),
    }
    follower.abort();

    // A server whose certificate names a and c, dialed as a.
    let sock = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = sock.local_addr().expect("addr").to_string();
    let known = Arc::new(Known::default());
    known.set(
        ["b".to_string()].into(),
        ["127.0.0.1".parse().expect("ip")].into(),
    );
    let own = Arc::new(Feed::default());
    own.publish(&BTreeMap::new(), Instant::now());
    let (_stop, stop_rx) = watch::channel(false);
    let svc = RoutesSvc {
        feeds: Arc::new(Feeds {
            own,
            relay: Arc::new(Feed::default()),
            reflector: false,
        }),
        known,
        stats: Arc::new(DoorStats::default()),
        shutdown: stop_rx.clone(),
        throttle: Arc::default(),
        verdicts: None,
    };
    let tls = material_names(&ca, &["a", "c"])
        .server_config()
        .expect("server");
    tokio::spawn(listener::serve(
        vec![sock],
        Some(tls),
        svc,
        Limits::default(),
        stop_rx,
    ));
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let target = Target {
        endpoint: addr,
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    match next(&mut rx).await {
        PeerEvent::Down { reason, .. } => assert!(reason.contains("more than one"), "{reason}"),
        other => panic!("a server certificate naming a and c passed as a: {other:?}"),
    }
    follower.abort();
}

/// `name`'s certificate from `ca`, put in `live`; its serial.
fn renew(live: &LiveTls, ca: &Ca, name: &str) -> String {
    use rustls::pki_types::pem::PemObject;
    let c = ca.issue(name).expect("cert");
    let chain = rustls::pki_types::CertificateDer::pem_slice_iter(c.cert_pem.as_bytes())
        .map(|c| c.expect("pem"))
        .collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).expect("key");
    live.set_identity(chain, key).expect("identity").serial
}

/// The serial of the certificate the server at `addr` presents to a client of `live`.
async fn served_serial(addr: &str, live: &Arc<LiveTls>, node: &str) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let tls = tokio_rustls::TlsConnector::from(live.client_config().expect("client"))
        .connect(super::tls::server_name(node).expect("name"), tcp)
        .await
        .expect("handshake");
    let cert = tls.get_ref().1.peer_certificates().expect("certs")[0].clone();
    calix_pki::cert::facts(cert.as_ref()).expect("facts").serial
}

/// A renewed certificate is served from the next handshake on, while the stream that is open
/// carries on (no reconnect, the next delta on the same stream); a node still waiting for its
/// first certificate neither serves nor dials, and starts both once it is there.
#[tokio::test]
async fn a_renewed_certificate_is_used_by_new_connections_and_open_streams_go_on() {
    let ca = Ca::new("test-ca").expect("ca");
    let sock = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = sock.local_addr().expect("addr").to_string();
    let known = Arc::new(Known::default());
    known.set(
        ["b".to_string()].into(),
        ["127.0.0.1".parse().expect("ip")].into(),
    );
    let own = Arc::new(Feed::default());
    let stats = Arc::new(DoorStats::default());
    let (_stop, stop_rx) = watch::channel(false);
    let svc = RoutesSvc {
        feeds: Arc::new(Feeds {
            own: own.clone(),
            relay: Arc::new(Feed::default()),
            reflector: false,
        }),
        known,
        stats: stats.clone(),
        shutdown: stop_rx.clone(),
        throttle: Arc::default(),
        verdicts: None,
    };
    let bundle = super::tls::bundle(Path::new("(ca)"), ca.pem().as_bytes()).expect("bundle");
    let server_tls = LiveTls::pending("a", CertSource::Kubernetes);
    server_tls.set_roots(bundle.clone()).expect("roots");
    let config = server_tls.server_config().expect("server");
    tokio::spawn(listener::serve(
        vec![sock],
        Some(config),
        svc,
        Limits::default(),
        stop_rx,
    ));
    // The follower's own certificate is not there yet: it does not dial.
    let client_tls = LiveTls::pending("b", CertSource::Kubernetes);
    client_tls.set_roots(bundle).expect("roots");
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(client_tls.client_config().expect("client")),
        live: Some(client_tls.clone()),
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let mut set = BTreeMap::new();
    set.insert(route("10.0.0.0/26").prefix, route("10.0.0.0/26"));
    own.publish(&set, Instant::now());
    let (tx, mut rx) = mpsc::channel(16);
    let target = Target {
        endpoint: addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rx.try_recv().is_err(),
        "no event while it has no certificate"
    );
    assert_eq!(
        stats.counts().refused_tls + stats.counts().accepted,
        0,
        "nothing dialed"
    );
    renew(&client_tls, &ca, "b");
    // Now it dials, but the server has no certificate yet: refused at the handshake.
    assert!(matches!(next(&mut rx).await, PeerEvent::Down { .. }));
    assert!(stats.counts().refused_tls >= 1);
    let first = renew(&server_tls, &ca, "a");
    let generation = loop {
        match next(&mut rx).await {
            PeerEvent::Snapshot { generation, .. } => break generation,
            PeerEvent::Down { .. } => continue,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(served_serial(&addr, &client_tls, "a").await, first);
    let accepted = stats.counts().accepted;
    // Renewed on both sides: the open stream carries the next delta.
    let second = renew(&server_tls, &ca, "a");
    renew(&client_tls, &ca, "b");
    assert_ne!(first, second);
    set.insert(route("10.0.0.64/26").prefix, route("10.0.0.64/26"));
    own.publish(&set, Instant::now());
    match next(&mut rx).await {
        PeerEvent::Delta { generation: g, .. } => assert_eq!(g, generation + 1),
        other => panic!("the stream did not go on: {other:?}"),
    }
    assert_eq!(served_serial(&addr, &client_tls, "a").await, second);
    // One more accepted connection: served_serial's, not a reconnect of the follower.
    assert_eq!(stats.counts().accepted, accepted + 1);
    assert_eq!(server_tls.status(std::time::SystemTime::now()).issued, 2);
    follower.abort();
}

#[tokio::test]
async fn the_door_caps_connections_per_address_and_times_out_handshakes() {
    let ca = Ca::new("test-ca").expect("ca");
    let limits = Limits {
        max_per_address: 2,
        handshake_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let s = server(&ca, limits).await;
    // Two connections that never start TLS hold the address's two slots.
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(
            tokio::net::TcpStream::connect(&s.addr)
                .await
                .expect("connect"),
        );
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A third is closed at once.
    let mut third = tokio::net::TcpStream::connect(&s.addr)
        .await
        .expect("connect");
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_millis(200), third.read(&mut buf))
        .await
        .expect("closed at once")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert_eq!(s.stats.counts().refused_busy, 1);
    // The idle two are dropped when their handshake time is up, and counted.
    for mut c in idle {
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf))
            .await
            .expect("closed after the handshake timeout")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
    assert_eq!(s.stats.counts().refused_tls, 2);
    // Their slots are free again.
    s.own.publish(&BTreeMap::new(), Instant::now());
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    assert!(matches!(next(&mut rx).await, PeerEvent::Snapshot { .. }));
    follower.abort();
}

/// Whether the server closed `c` (EOF or a reset; `None`: reset before `connect` returned)
/// within `wait`.
async fn closed_within(c: &mut Option<tokio::net::TcpStream>, wait: Duration) -> bool {
    let Some(c) = c else {
        return true;
    };
    let mut buf = [0u8; 1];
    matches!(
        tokio::time::timeout(wait, c.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// `n` idle connections to `addr` from `from` (`None`: reset while connecting).
async fn idle_from(addr: &str, from: &str, n: usize) -> Vec<Option<tokio::net::TcpStream>> {
    let to: std::net::SocketAddr = addr.parse().expect("addr");
    let mut out = Vec::new();
    for _ in 0..n {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind(format!("{from}:0").parse().expect("from"))
            .expect("bind");
        out.push(match sock.connect(to).await {
            Ok(c) => Some(c),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => None,
            Err(e) => panic!("connect from {from}: {e}"),
        });
    }
    out
}

/// Issue 20: a source that is no known node's address never takes a slot of the door (it
/// is closed before TLS, at once, and counted), and a known node flooding the door holds its
/// own few slots, not the others'.
#[tokio::test]
async fn strangers_are_refused_before_tls_and_one_nodes_flood_leaves_the_others_their_slots() {
    let ca = Ca::new("test-ca").expect("ca");
    // Known nodes at 127.0.0.2 (the follower, "b") and 127.0.0.3 (a flooding node); 127.0.0.1
    // is nobody's.
    let s = server_knowing(&ca, Limits::default(), &["127.0.0.2", "127.0.0.3"]).await;
    s.own.publish(&BTreeMap::new(), Instant::now());
    let mut strangers = idle_from(&s.addr, "127.0.0.1", 64).await;
    for (i, c) in strangers.iter_mut().enumerate() {
        assert!(
            closed_within(c, Duration::from_millis(500)).await,
            "stranger connection {i} was held (waiting for a TLS handshake): {:?}",
            s.stats.counts()
        );
    }
    let counts = s.stats.counts();
    assert_eq!(counts.refused_unknown, 64, "{counts:?}");
    assert_eq!(
        (counts.refused_busy, counts.refused_tls),
        (0, 0),
        "{counts:?}"
    );
    // A known node's flood: it keeps its 8 slots (per address), the rest is closed at once.
    let _flood = idle_from(&s.addr, "127.0.0.3", 64).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        s.stats.counts().refused_busy,
        64 - 8,
        "{:?}",
        s.stats.counts()
    );
    // The other known node still gets in and streams.
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        connect_timeout: Duration::from_secs(3),
        source: calix_core::routes::advertise::NextHops {
            v4: Some("127.0.0.2".parse().expect("ip")),
            v6: None,
        },
        live: None,
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    assert!(matches!(next(&mut rx).await, PeerEvent::Snapshot { .. }));
    follower.abort();
    assert_eq!(s.stats.counts().accepted, 1);
}

/// A starting agent's feed is empty until its datastore view is listed: a watcher that
/// connects then (peers queued in the backlog during the initial sync do) must not get that
/// empty snapshot, which would withdraw every route of this node from its peers.
#[tokio::test]
async fn a_watcher_waits_for_the_first_publication_instead_of_an_empty_snapshot() {
    let ca = Ca::new("test-ca").expect("ca");
    let s = server(&ca, Limits::default()).await;
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut set = BTreeMap::new();
    set.insert(route("10.0.0.0/26").prefix, route("10.0.0.0/26"));
    s.own.publish(&set, Instant::now());
    match next(&mut rx).await {
        PeerEvent::Snapshot { routes, .. } => {
            assert_eq!(
                routes,
                vec![route("10.0.0.0/26")],
                "the first snapshot is the real one"
            )
        }
        other => panic!("{other:?}"),
    }
    follower.abort();
}

/// The follower's HTTP/2 windows ([`crate::memory::STREAM_WINDOW`]) pace a stream, they do not
/// cap it: a snapshot of 20,000 routes in messages each larger than the window arrives whole.
#[tokio::test]
async fn a_snapshot_larger_than_the_window_arrives() {
    use tonic_prost::prost::Message;
    let ca = Ca::new("test-ca").expect("ca");
    let s = server(&ca, Limits::default()).await;
    // The longest node name a route may carry: ~230 bytes a route on the wire.
    let node = "n".repeat(253);
    let set: BTreeMap<_, _> = (0..20_000u32)
        .map(|i| {
            let r = Route {
                prefix: ipnet::IpNet::from(std::net::IpAddr::from(std::net::Ipv4Addr::from(
                    0x0a00_0000 + i,
                ))),
                node: node.clone(),
                next_hop: "192.0.2.1".parse().expect("ip"),
            };
            (r.prefix, r)
        })
        .collect();
    let messages = calix_core::wire::encode_snapshot(&calix_core::update::Snapshot {
        generation: 1,
        routes: set.values().cloned().collect(),
    });
    let smallest = messages.iter().map(|m| m.encoded_len()).min().unwrap_or(0);
    let window = crate::memory::STREAM_WINDOW as usize;
    assert!(
        messages.len() > 1 && smallest > window,
        "{} messages of at least {smallest} bytes against a window of {window}",
        messages.len()
    );
    s.own.publish(&set, Instant::now());
    let (tx, mut rx) = mpsc::channel(16);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    match next(&mut rx).await {
        PeerEvent::Snapshot { routes, .. } => {
            assert_eq!(routes.len(), set.len());
            assert!(routes.iter().all(|r| set.get(&r.prefix) == Some(r)));
        }
        other => panic!("{other:?}"),
    }
    follower.abort();
}

/// The door binds this node's own addresses, and one the node does not have yet (an
/// interface that comes up later, DHCP) binds too: it is served once the address is there.
#[tokio::test]
async fn the_door_binds_an_address_the_node_does_not_have_yet() {
    for addr in ["192.0.2.77:0", "[2001:db8::77]:0"] {
        let a: std::net::SocketAddr = addr.parse().expect("addr");
        let l = listener::bind(a).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        let got = l.local_addr().expect("local addr");
        assert_eq!(got.ip(), a.ip(), "{addr}");
        assert_ne!(got.port(), 0);
    }
}

/// What an agent puts in place as its own certificate is checked first: it names this node
/// alone, its key is the certificate's, it chains to the bundle; and a new bundle that does
/// not trust it says so (the agent then renews at once).
#[test]
fn only_a_certificate_of_this_node_trusted_by_the_bundle_is_put_in_place() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let parts = |c: &calix_testbed::tls::NodeCert| {
        (
            CertificateDer::pem_slice_iter(c.cert_pem.as_bytes())
                .map(|c| c.expect("pem"))
                .collect::<Vec<_>>(),
            PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).expect("key"),
        )
    };
    let ca = Ca::new("test-ca").expect("ca");
    let other_ca = Ca::new("other-ca").expect("ca");
    let live = LiveTls::pending("a", CertSource::Kubernetes);
    live.set_roots(super::tls::bundle(Path::new("(ca)"), ca.pem().as_bytes()).expect("bundle"))
        .expect("roots");
    let refused = |c: &calix_testbed::tls::NodeCert| {
        let (chain, key) = parts(c);
        live.set_identity(chain, key)
            .expect_err("refused")
            .to_string()
    };
    assert!(refused(&ca.issue("b").expect("cert")).contains("not for node \"a\""));
    assert!(refused(&ca.issue_names(&["a", "b"]).expect("cert")).contains("more than one"));
    assert!(refused(&other_ca.issue("a").expect("cert")).contains("does not verify"));
    let (chain, _) = parts(&ca.issue("a").expect("cert"));
    let (_, other_key) = parts(&ca.issue("a").expect("cert"));
    assert!(
        live.set_identity(chain, other_key).is_err(),
        "a key that is not the certificate's"
    );
    assert!(!live.is_ready());
    assert_eq!(live.status(std::time::SystemTime::now()).issued, 0);
    let serial = renew(&live, &ca, "a");
    assert!(live.is_ready() && live.identity_trusted());
    assert_eq!(
        live.status(std::time::SystemTime::now()).serial.as_deref(),
        Some(serial.as_str())
    );
    let changes = live.bundle_changes();
    live.set_roots(
        super::tls::bundle(Path::new("(ca)"), other_ca.pem().as_bytes()).expect("bundle"),
    )
    .expect("roots");
    assert!(changes.has_changed().expect("open"));
    assert!(!live.identity_trusted(), "the new bundle does not trust it");
}

/// A peer that streams faster than this agent takes its updates cannot queue more than a few
/// of them in this agent's memory: the follower reads the next update only once the engine
/// has taken an earlier one (the rest wait in the peer, held back by HTTP/2 flow control).
#[tokio::test]
async fn a_follower_holds_few_updates_the_engine_has_not_taken() {
    let ca = Ca::new("test-ca").expect("ca");
    let s = server(&ca, Limits::default()).await;
    s.own.publish(&BTreeMap::new(), Instant::now());
    let (tx, mut rx) = mpsc::channel(64);
    let dialer = Arc::new(Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        connect_timeout: Duration::from_secs(3),
        live: None,
        source: Default::default(),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    // The engine takes the snapshot...
    assert!(matches!(next(&mut rx).await, PeerEvent::Snapshot { .. }));
    // ...then stops taking updates while the peer publishes 200 of them.
    for i in 0..200u32 {
        let r = route(&format!("10.1.{}.{}/32", i / 256, i % 256));
        s.own.publish(&[(r.prefix, r)].into(), Instant::now());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let queued = rx.len();
    assert!(
        queued <= client::IN_FLIGHT,
        "{queued} updates of one peer queued for the engine"
    );
    // Taken, they keep coming, in order.
    let mut generation = 0;
    for _ in 0..20 {
        match next(&mut rx).await {
            PeerEvent::Delta { generation: g, .. } => {
                assert!(generation == 0 || g == generation + 1);
                generation = g;
            }
            other => panic!("{other:?}"),
        }
    }
    follower.abort();
}

/// Answers every verdict call with the pod address it was asked about.
struct Echo;

#[tonic::async_trait]
impl super::server::Verdicts for Echo {
    async fn verdict(&self, req: &calix_proto::v1::VerdictRequest) -> Result<String, String> {
        match req.pod_address.as_str() {
            "" => Err("no pod address".into()),
            a => Ok(format!("{{\"asked\":\"{a}\"}}")),
        }
    }
}

/// `Verdict` (calixctl trace on another node): answered over the same mutual TLS as a watch,
/// to a node asking as itself only; a node that computes no policy says so.
#[tokio::test]
async fn a_verdict_is_answered_to_the_node_its_certificate_names() {
    let ca = Ca::new("test-ca").expect("ca");
    let s = server_answering(&ca, Limits::default(), &["127.0.0.1"], Some(Arc::new(Echo))).await;
    let dialer = Dialer {
        me: "b".into(),
        tls: Some(material(&ca, "b").client_config().expect("client")),
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    };
    let req = |node: &str, pod: &str| calix_proto::v1::VerdictRequest {
        node: node.into(),
        pod_address: pod.into(),
        ..Default::default()
    };
    let answer = super::verdict::ask(&dialer, "a", &s.addr, req("b", "10.0.0.5")).await;
    assert_eq!(answer, Ok(r#"{"asked":"10.0.0.5"}"#.to_string()));
    // Its own refusal, as the caller reads it.
    let refused = super::verdict::ask(&dialer, "a", &s.addr, req("b", "")).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains("no pod address")),
        "{refused:?}"
    );
    // Asking as another node with b's certificate: refused, counted.
    let before = s.stats.counts().refused_identity;
    let refused = super::verdict::ask(&dialer, "a", &s.addr, req("c", "10.0.0.5")).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains("PermissionDenied") || e.contains("permission")),
        "{refused:?}"
    );
    assert_eq!(s.stats.counts().refused_identity, before + 1);
    // A server with no policy: unimplemented, said.
    let plain = server(&ca, Limits::default()).await;
    let none = super::verdict::ask(&dialer, "a", &plain.addr, req("b", "10.0.0.5")).await;
    assert!(
        none.as_ref()
            .is_err_and(|e| e.contains("computes no NetworkPolicy")),
        "{none:?}"
    );
    let _ = s.stop.send(true);
    let _ = plain.stop.send(true);
}
