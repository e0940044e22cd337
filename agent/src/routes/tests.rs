//! The Routes server, door and follower together on loopback (no root): mutual TLS, the
//! stream's snapshot, deltas and shutdown, the door's caps.
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use calix_testbed::tls::Ca;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};

use super::client::{self, Dialer, PeerMessage};
use super::engine::PeerEvent;
use super::feed::Feed;
use super::listener::{self, DoorStats, Limits};
use super::peers::Target;
use super::server::{Feeds, Known, RoutesSvc};
use super::tls::TlsMaterial;
use super::Route;

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

/// Node "a"'s Routes server on 127.0.0.1, serving `own`; "b" may watch.
async fn server(ca: &Ca, limits: Limits) -> Server {
    let sock = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = sock.local_addr().expect("addr").to_string();
    let own = Arc::new(Feed::default());
    let known = Arc::new(Known::default());
    known.set(["b".to_string()].into());
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
    };
    let tls = material(ca, "a").server_config().expect("server");
    tokio::spawn(listener::serve(sock, Some(tls), svc, limits, stop_rx));
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
        connect_timeout: Duration::from_secs(3),
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
        connect_timeout: Duration::from_secs(3),
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
        connect_timeout: Duration::from_secs(3),
    });
    let target = Target {
        endpoint: s.addr.clone(),
        relayed: false,
    };
    let follower = tokio::spawn(client::follow("a".into(), target, dialer, 1, tx));
    assert!(matches!(next(&mut rx).await, PeerEvent::Snapshot { .. }));
    follower.abort();
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
        connect_timeout: Duration::from_secs(3),
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
    let messages = super::wire::encode_snapshot(&super::feed::Snapshot {
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
        connect_timeout: Duration::from_secs(3),
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
