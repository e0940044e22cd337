//! The peer task's pure parts (the import rule, collisions), and a whole task against a
//! scripted peer on the loopback (route refresh).
use calix_bgp::open::{Capabilities, Open};
use calix_bgp::peer::LimitAction;
use calix_bgp::Message;

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

#[test]
fn the_import_rule_and_more() {
    let rule = ImportRule {
        within: vec![net("10.244.0.0/16"), net("fd44::/48")],
        own: vec![net("10.244.1.0/26")],
    };
    let own = [ip("172.31.1.1")];
    let ok = |p: &str, nh: &str, path: &[u32]| {
        accepts(&rule, 64512, &own, &net(p), &ip(nh), path.iter().copied())
    };
    assert!(ok("10.244.2.0/26", "172.31.1.254", &[65000, 64513]));
    assert!(ok("fd44::/122", "fd31:1::fe", &[65000]));
    assert!(!ok("10.244.1.0/26", "172.31.1.254", &[65000]), "own block");
    assert!(
        !ok("10.245.0.0/26", "172.31.1.254", &[65000]),
        "outside the pools"
    );
    assert!(!ok("0.0.0.0/0", "172.31.1.254", &[65000]), "default route");
    assert!(
        !ok("10.244.2.0/26", "fd31:1::fe", &[65000]),
        "another family's next hop"
    );
    assert!(
        !ok("10.244.2.0/26", "172.31.1.1", &[65000]),
        "via this node"
    );
    assert!(
        !ok("10.244.2.0/26", "0.0.0.0", &[65000]),
        "unspecified next hop"
    );
    assert!(
        !ok("10.244.2.0/26", "172.31.1.254", &[65000, 64512]),
        "an AS loop"
    );
}

#[test]
fn a_collision_keeps_the_higher_identifiers_connection() {
    let (low, high) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
    assert!(incoming_wins(false, true, low, Some(high)));
    assert!(!incoming_wins(false, true, high, Some(low)));
    assert!(
        !incoming_wins(false, true, low, Some(low)),
        "equal: ours stays"
    );
    assert!(
        !incoming_wins(true, true, low, Some(high)),
        "Established stays"
    );
    assert!(
        !incoming_wins(false, false, low, Some(high)),
        "the peer's first stays"
    );
    assert!(!incoming_wins(false, true, low, None), "no OPEN: no claim");
}

#[test]
fn families_follow_the_next_hops() {
    assert_eq!(families(&[ip("172.31.1.1")]), [Family::IPV4_UNICAST]);
    assert_eq!(
        families(&[ip("172.31.1.1"), ip("fd31:1::1")]),
        [Family::IPV4_UNICAST, Family::IPV6_UNICAST]
    );
    assert!(families(&[]).is_empty());
}

/// The scripted peer's side of one connection: messages read with a deadline each.
struct Scripted(Connection);

impl Scripted {
    async fn message(&mut self) -> Message {
        let read = tokio::time::timeout(Duration::from_secs(5), self.0.read(true))
            .await
            .expect("the task says something within 5 s")
            .expect("read from the task");
        match read {
            Read::Message(m) => m.expect("the task's message decodes"),
            Read::Eof => panic!("the task closed the connection"),
        }
    }

    async fn send(&mut self, m: Message) {
        self.0
            .write(&m.encode(true))
            .await
            .expect("write to the task");
    }

    /// The routes announced (with their communities) up to the next End-of-RIB, and its
    /// family; KEEPALIVEs are skipped, anything else fails.
    async fn until_end_of_rib(&mut self) -> (Vec<(IpNet, IpAddr, Vec<u32>)>, Family) {
        let mut announced = Vec::new();
        loop {
            match self.message().await {
                Message::Keepalive => {}
                Message::Update(u) => {
                    if let Some(f) = u.end_of_rib {
                        return (announced, f);
                    }
                    assert!(u.withdrawn.is_empty(), "nothing is withdrawn: {u:?}");
                    let c = &u.attributes.communities;
                    announced.extend(u.announced.iter().map(|(n, h)| (*n, *h, c.clone())));
                }
                m => panic!("an UPDATE or a KEEPALIVE, not {m:?}"),
            }
        }
    }
}

/// RFC 2918: after the first exchange, a ROUTE-REFRESH for a family brings that family's
/// routes again (with the peer's communities), and its End-of-RIB, and nothing of the other
/// family; the session stays up.
#[tokio::test]
async fn a_route_refresh_sends_the_familys_routes_and_end_of_rib_again() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen on the loopback");
    let port = listener.local_addr().expect("its address").port();
    let community = (65000 << 16) | 100;
    let (v4, v6) = (net("10.244.1.0/26"), net("fd44::/122"));
    let (hop4, hop6) = (ip("127.0.0.1"), ip("fd31:1::1"));
    let wanted: Wanted = [(v4, hop4), (v6, hop6)].into();
    let (_wanted, wanted_rx) = watch::channel(Some(Arc::new(wanted)));
    let (_import, import_rx) = watch::channel(Arc::new(ImportRule {
        within: vec![net("10.244.0.0/16")],
        own: vec![v4],
    }));
    let (stop, stop_rx) = watch::channel(None);
    let ctx = Ctx {
        asn: 64512,
        router_id: Ipv4Addr::new(10, 0, 0, 1),
        own: vec![hop4, hop6],
        restart_time: 120,
        wanted: wanted_rx,
        import: import_rx,
        stop: stop_rx,
        notices: Arc::new(crate::notice::Notifier::default()),
    };
    let spec = PeerSettings {
        name: "scripted".into(),
        address: ip("127.0.0.1"),
        port,
        asn: 65000,
        password: None,
        hold_time: 90,
        graceful_restart: true,
        max_prefixes: 100,
        limit_action: LimitAction::Refuse,
        communities: vec![community],
    };
    let state: Shared = Arc::new(Mutex::new(PeerState::new(&spec)));
    let (events, _events_rx) = mpsc::channel(16);
    let (_incoming, incoming_rx) = mpsc::channel(1);
    let task = tokio::spawn(run(0, spec, ctx, state.clone(), events, incoming_rx));

    let (stream, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
        .await
        .expect("the task connects within 5 s")
        .expect("accept");
    let mut peer = Scripted(Connection::new(stream));
    assert!(matches!(peer.message().await, Message::Open(_)));
    peer.send(Message::Open(Open {
        asn: 65000,
        hold_time: 90,
        router_id: Ipv4Addr::new(10, 0, 0, 2),
        capabilities: Capabilities {
            families: vec![Family::IPV4_UNICAST, Family::IPV6_UNICAST],
            route_refresh: true,
            enhanced_route_refresh: false,
            four_octet_as: Some(65000),
            graceful_restart: None,
            other: Vec::new(),
        },
    }))
    .await;
    peer.send(Message::Keepalive).await;

    // The first exchange: both families' routes, then an End-of-RIB for each.
    let (first4, eor) = peer.until_end_of_rib().await;
    assert_eq!(eor, Family::IPV4_UNICAST);
    let (first6, eor) = peer.until_end_of_rib().await;
    assert_eq!(eor, Family::IPV6_UNICAST);
    let mut first = [first4, first6].concat();
    first.sort();
    assert_eq!(
        first,
        [(v4, hop4, vec![community]), (v6, hop6, vec![community])]
    );

    // Each family asked for again: its routes again, then its End-of-RIB.
    for (family, route, hop) in [
        (Family::IPV4_UNICAST, v4, hop4),
        (Family::IPV6_UNICAST, v6, hop6),
    ] {
        peer.send(Message::RouteRefresh { family, subtype: 0 })
            .await;
        let (again, eor) = peer.until_end_of_rib().await;
        assert_eq!(eor, family, "the End-of-RIB of the family asked for");
        assert_eq!(
            again,
            [(route, hop, vec![community])],
            "{family}: its routes again, only its own"
        );
    }
    {
        let st = lock(&state);
        assert_eq!(st.report.state, "Established");
        assert_eq!(st.report.sent, 2);
        assert_eq!(st.report.down_total, 0);
        assert_eq!(st.families, [Family::IPV4_UNICAST, Family::IPV6_UNICAST]);
    }

    // The agent stops for good: Cease, administrative shutdown.
    stop.send(Some(Stop::ForGood)).expect("the task listens");
    loop {
        match peer.message().await {
            Message::Keepalive => {}
            Message::Notification(n) => {
                assert_eq!((n.code, n.subcode), (6, 2), "{n:?}");
                break;
            }
            m => panic!("a NOTIFICATION, not {m:?}"),
        }
    }
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the task ends within 5 s")
        .expect("the task did not panic");
}
