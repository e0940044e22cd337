//! Two sessions talking to each other through memory, with a clock the test moves; and a
//! peer's routes across connections (limits, graceful restart).
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use ipnet::IpNet;

use crate::notification::{self, cease, open as open_sub};
use crate::peer::{Change, LimitAction, PeerRib};
use crate::session::{LocalConfig, LocalRestart, Negotiated, Output, Session, State};
use crate::update::PathAttributes;
use crate::wire::frame_len;
use crate::{Family, Message, Update, UpdateBuilder};

fn config(asn: u32, peer_asn: u32, id: u8, hold: u16) -> LocalConfig {
    LocalConfig {
        asn,
        router_id: Ipv4Addr::new(10, 0, 0, id),
        peer_asn,
        hold_time: hold,
        families: vec![Family::IPV4_UNICAST, Family::IPV6_UNICAST],
        graceful_restart: Some(LocalRestart {
            restart_time: 120,
            restarting: false,
            forwarding_preserved: true,
        }),
    }
}

/// Splits outputs into the bytes to send and the rest.
fn split(out: Vec<Output>) -> (Vec<Vec<u8>>, Vec<Output>) {
    let mut sent = Vec::new();
    let mut rest = Vec::new();
    for o in out {
        match o {
            Output::Send(b) => sent.push(b),
            o => rest.push(o),
        }
    }
    (sent, rest)
}

/// Delivers `msgs` to `s`: what it answers, what else it says.
fn deliver(s: &mut Session, now: Instant, msgs: Vec<Vec<u8>>) -> (Vec<Vec<u8>>, Vec<Output>) {
    let mut sent = Vec::new();
    let mut rest = Vec::new();
    for m in msgs {
        assert_eq!(frame_len(&m).expect("a frame"), Some(m.len()));
        let decoded = Message::decode(&m, s.four_octet_as());
        let (a, b) = split(s.on_message(now, decoded));
        sent.extend(a);
        rest.extend(b);
    }
    (sent, rest)
}

/// A and B open to each other until nothing is left to say; what each said besides bytes.
fn converse(
    a: &mut Session,
    b: &mut Session,
    now: Instant,
    mut to_b: Vec<Vec<u8>>,
    mut to_a: Vec<Vec<u8>>,
) -> (Vec<Output>, Vec<Output>) {
    let (mut said_a, mut said_b) = (Vec::new(), Vec::new());
    while !to_a.is_empty() || !to_b.is_empty() {
        let (sent, said) = deliver(b, now, std::mem::take(&mut to_b));
        to_a.extend(sent);
        said_b.extend(said);
        let (sent, said) = deliver(a, now, std::mem::take(&mut to_a));
        to_b.extend(sent);
        said_a.extend(said);
    }
    (said_a, said_b)
}

fn established(said: &[Output]) -> Option<&Negotiated> {
    said.iter().find_map(|o| match o {
        Output::Established(n) => Some(n),
        _ => None,
    })
}

#[test]
fn two_speakers_agree_on_the_smaller_hold_time_and_their_common_families() {
    let now = Instant::now();
    let mut cb = config(65002, 65001, 2, 30);
    cb.families = vec![Family::IPV4_UNICAST];
    let (mut a, out_a) = Session::start(config(65001, 65002, 1, 90), now);
    let (mut b, out_b) = Session::start(cb, now);
    let (said_a, said_b) = converse(&mut a, &mut b, now, split(out_a).0, split(out_b).0);
    let n = established(&said_a).expect("A established");
    assert_eq!(n.hold_time, 30);
    assert_eq!(n.families, vec![Family::IPV4_UNICAST]);
    assert!(n.four_octet_as);
    assert_eq!(n.peer_router_id, Ipv4Addr::new(10, 0, 0, 2));
    assert!(n.peer_restart.is_some());
    assert!(established(&said_b).is_some());
    assert_eq!(
        (a.state(), b.state()),
        (State::Established, State::Established)
    );
}

#[test]
fn an_unexpected_as_number_is_refused_with_bad_peer_as() {
    let now = Instant::now();
    let (mut a, out_a) = Session::start(config(65001, 65009, 1, 90), now);
    let (mut b, out_b) = Session::start(config(65002, 65001, 2, 90), now);
    let (said_a, said_b) = converse(&mut a, &mut b, now, split(out_a).0, split(out_b).0);
    let sent = said_a.iter().find_map(|o| match o {
        Output::Closed { sent, .. } => sent.clone(),
        _ => None,
    });
    let sent = sent.expect("A closed with a NOTIFICATION");
    assert_eq!(
        (sent.code, sent.subcode),
        (notification::OPEN_ERROR, open_sub::BAD_PEER_AS)
    );
    assert_eq!(a.state(), State::Closed);
    let received = said_b.iter().find_map(|o| match o {
        Output::Closed { received, .. } => received.clone(),
        _ => None,
    });
    assert_eq!(received, Some(sent), "B read why");
}

#[test]
fn keepalives_go_at_a_third_of_the_hold_time_and_silence_ends_the_session() {
    let t0 = Instant::now();
    let (mut a, out_a) = Session::start(config(65001, 65002, 1, 9), t0);
    let (mut b, out_b) = Session::start(config(65002, 65001, 2, 9), t0);
    converse(&mut a, &mut b, t0, split(out_a).0, split(out_b).0);
    assert!(a.tick(t0 + Duration::from_secs(2)).is_empty());
    let (sent, _) = split(a.tick(t0 + Duration::from_secs(3)));
    assert_eq!(sent, vec![Message::Keepalive.encode(true)]);
    // B hears nothing for the hold time: it ends the session.
    let (sent, said) = split(b.tick(t0 + Duration::from_secs(9)));
    let n = Message::decode(&sent[0], true).expect("a NOTIFICATION");
    assert!(
        matches!(n, Message::Notification(ref n) if n.code == notification::HOLD_TIMER_EXPIRED)
    );
    assert!(matches!(said[..], [Output::Closed { .. }]));
    // A message in time moves the deadline.
    let (_, _) = deliver(
        &mut a,
        t0 + Duration::from_secs(8),
        vec![Message::Keepalive.encode(true)],
    );
    assert!(a
        .tick(t0 + Duration::from_secs(10))
        .iter()
        .all(|o| !matches!(o, Output::Closed { .. })));
}

#[test]
fn an_update_before_the_session_is_up_is_a_state_machine_error() {
    let now = Instant::now();
    let (mut a, _) = Session::start(config(65001, 65002, 1, 90), now);
    let eor = UpdateBuilder::end_of_rib(Family::IPV4_UNICAST);
    let (sent, said) = deliver(&mut a, now, vec![eor]);
    let Ok(Message::Notification(n)) = Message::decode(&sent[0], true) else {
        panic!("no NOTIFICATION");
    };
    assert_eq!((n.code, n.subcode), (notification::FSM_ERROR, 1));
    assert!(matches!(said[..], [Output::Closed { .. }]));
}

fn announce(prefixes: &[&str], nh: [u8; 4]) -> Update {
    let builder = UpdateBuilder {
        four_octet_as: true,
        attributes: PathAttributes::default(),
    };
    let nets: Vec<IpNet> = prefixes
        .iter()
        .map(|p| p.parse().expect("prefix"))
        .collect();
    let msgs = builder.announce(Family::IPV4_UNICAST, IpAddr::V4(nh.into()), None, &nets);
    match Message::decode(&msgs[0], true) {
        Ok(Message::Update(u)) => u,
        other => panic!("{other:?}"),
    }
}

fn all(_: &IpNet, _: &IpAddr, _: &PathAttributes) -> bool {
    true
}

fn negotiated(restart: Option<(u16, bool)>) -> Negotiated {
    Negotiated {
        hold_time: 90,
        four_octet_as: true,
        families: vec![Family::IPV4_UNICAST],
        peer_router_id: Ipv4Addr::new(10, 0, 0, 2),
        peer_restart: restart.map(|(time, fwd)| crate::GracefulRestart {
            restarting: false,
            notification: false,
            restart_time: time,
            families: vec![(Family::IPV4_UNICAST, fwd)],
        }),
        peer_route_refresh: true,
    }
}

#[test]
fn the_import_rule_and_the_prefix_limit_decide_what_is_installed() {
    let mut rib = PeerRib::new(3, LimitAction::Refuse);
    let only_10 = |n: &IpNet, _: &IpAddr, _: &PathAttributes| n.to_string().starts_with("10.");
    let a = rib.apply(
        &announce(&["10.0.0.0/26", "192.168.0.0/24"], [1, 1, 1, 1]),
        only_10,
    );
    assert_eq!(
        a.changes,
        vec![Change::Add(
            "10.0.0.0/26".parse().expect("p"),
            IpAddr::V4([1, 1, 1, 1].into())
        )]
    );
    assert_eq!(rib.counts(), (2, 1));
    let a = rib.apply(
        &announce(&["10.0.0.64/26", "10.0.0.128/26"], [1, 1, 1, 1]),
        only_10,
    );
    assert_eq!(
        (a.changes.len(), a.refused),
        (1, 1),
        "the fourth prefix is over the limit"
    );
    assert_eq!(rib.refused_over_limit, 1);
    // The same prefix again with the same next hop changes nothing; a new next hop does.
    assert!(rib
        .apply(&announce(&["10.0.0.0/26"], [1, 1, 1, 1]), only_10)
        .changes
        .is_empty());
    assert_eq!(
        rib.apply(&announce(&["10.0.0.0/26"], [2, 2, 2, 2]), only_10)
            .changes
            .len(),
        1
    );

    let mut reset = PeerRib::new(1, LimitAction::Reset);
    let a = reset.apply(
        &announce(&["10.0.0.0/26", "10.0.0.64/26"], [1, 1, 1, 1]),
        all,
    );
    let n = a.reset.expect("the limit resets the session");
    assert_eq!(
        (n.code, n.subcode),
        (notification::CEASE, cease::MAX_PREFIXES)
    );
    assert_eq!(&n.data[..], &[0, 1, 1, 0, 0, 0, 1]);
}

#[test]
fn graceful_restart_keeps_routes_stale_until_end_of_rib_or_the_restart_time() {
    let t0 = Instant::now();
    let mut rib = PeerRib::new(100, LimitAction::Refuse);
    rib.apply(
        &announce(&["10.0.0.0/26", "10.0.0.64/26"], [1, 1, 1, 1]),
        all,
    );
    // The connection drops; the peer announced graceful restart: nothing is removed.
    let n = negotiated(Some((60, true)));
    assert!(rib.session_down(t0, Some(&n), true).is_empty());
    assert_eq!(rib.stale_count(), 2);
    assert_eq!(rib.stale_deadline(), Some(t0 + Duration::from_secs(60)));
    // Back up with forwarding kept: still there; one announced again, then End-of-RIB.
    assert!(rib.session_up(&n).is_empty());
    assert!(rib
        .apply(&announce(&["10.0.0.0/26"], [1, 1, 1, 1]), all)
        .changes
        .is_empty());
    let eor = match Message::decode(&UpdateBuilder::end_of_rib(Family::IPV4_UNICAST), true) {
        Ok(Message::Update(u)) => u,
        other => panic!("{other:?}"),
    };
    let a = rib.apply(&eor, all);
    assert_eq!(
        a.changes,
        vec![Change::Remove("10.0.0.64/26".parse().expect("p"))]
    );
    assert_eq!(rib.stale_count(), 0);

    // Down again, and it never comes back: the restart time removes everything.
    rib.session_down(t0, Some(&n), true);
    assert!(rib.expire(t0 + Duration::from_secs(59)).is_empty());
    assert_eq!(rib.expire(t0 + Duration::from_secs(60)).len(), 1);
    // Without graceful restart (or after a NOTIFICATION), the routes go at once.
    rib.apply(&announce(&["10.0.0.0/26"], [1, 1, 1, 1]), all);
    assert_eq!(rib.session_down(t0, Some(&negotiated(None)), true).len(), 1);
    rib.apply(&announce(&["10.0.0.0/26"], [1, 1, 1, 1]), all);
    assert_eq!(rib.session_down(t0, Some(&n), false).len(), 1);
    // Back up without the F bit: the stale routes go when the session is up.
    rib.apply(&announce(&["10.0.0.0/26"], [1, 1, 1, 1]), all);
    rib.session_down(t0, Some(&n), true);
    assert_eq!(rib.session_up(&negotiated(Some((60, false)))).len(), 1);
}

#[test]
fn a_changed_set_of_routes_sends_only_the_difference() {
    use crate::advertise::Advertised;
    use std::collections::BTreeMap;
    let builder = UpdateBuilder {
        four_octet_as: true,
        attributes: PathAttributes::default(),
    };
    let hop: IpAddr = "192.0.2.1".parse().expect("ip");
    let hop6: IpAddr = "fd00::1".parse().expect("ip");
    let set = |nets: &[&str]| -> BTreeMap<IpNet, IpAddr> {
        nets.iter()
            .map(|n| {
                let n: IpNet = n.parse().expect("prefix");
                (n, if matches!(n, IpNet::V4(_)) { hop } else { hop6 })
            })
            .collect()
    };
    let read = |msgs: Vec<Vec<u8>>| -> (Vec<IpNet>, Vec<IpNet>) {
        let (mut a, mut w) = (Vec::new(), Vec::new());
        for m in msgs {
            let Ok(Message::Update(u)) = Message::decode(&m, true) else {
                panic!("not an UPDATE");
            };
            a.extend(u.announced.into_iter().map(|(n, _)| n));
            w.extend(u.withdrawn);
        }
        (a, w)
    };
    let v4 = [Family::IPV4_UNICAST];
    let mut adv = Advertised::default();
    let first = adv.update_to(
        &set(&["10.0.0.0/26", "10.0.0.64/26", "fd00::/122"]),
        &v4,
        &builder,
    );
    assert_eq!(
        read(first).0.len(),
        2,
        "the IPv6 route is not this session's family"
    );
    assert!(adv
        .update_to(&set(&["10.0.0.0/26", "10.0.0.64/26"]), &v4, &builder)
        .is_empty());
    let (a, w) = read(adv.update_to(&set(&["10.0.0.0/26", "10.0.1.5/32"]), &v4, &builder));
    assert_eq!(a, vec!["10.0.1.5/32".parse::<IpNet>().expect("p")]);
    assert_eq!(w, vec!["10.0.0.64/26".parse::<IpNet>().expect("p")]);
    assert_eq!(adv.routes().len(), 2);
}

#[test]
fn the_import_rule_takes_the_pools_routes_and_never_this_nodes_own() {
    use crate::import::ImportRule;
    let p = |s: &str| -> IpNet { s.parse().expect("prefix") };
    let rule = ImportRule {
        within: vec![p("10.244.0.0/16"), p("fd44::/48")],
        own: vec![p("10.244.3.0/26"), p("10.244.9.7/32")],
    };
    assert!(rule.accepts(&p("10.244.1.0/26")));
    assert!(rule.accepts(&p("10.244.2.9/32")));
    assert!(rule.accepts(&p("fd44::40/122")));
    assert!(!rule.accepts(&p("10.244.0.0/15")), "wider than the pool");
    assert!(!rule.accepts(&p("0.0.0.0/0")));
    assert!(!rule.accepts(&p("192.168.0.0/24")));
    assert!(!rule.accepts(&p("10.244.3.0/26")), "this node's block");
    assert!(
        !rule.accepts(&p("10.244.3.5/32")),
        "inside this node's block"
    );
    assert!(
        !rule.accepts(&p("10.244.9.0/24")),
        "covering this node's pod"
    );
}
