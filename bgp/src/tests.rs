//! The codec against hand-built messages: round trips, RFC 7606's dispositions, the framing's
//! errors, and mutated messages that must decode or fail without panicking.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::notification::{self, header, open as open_sub, update as update_sub};
use crate::update::{AsSegment, Disposition, ATTR_AGGREGATOR, ATTR_ORIGIN};
use crate::wire::{frame_len, MAX_LEN};
use crate::*;

fn net(s: &str) -> IpNet {
    s.parse().expect("a prefix")
}

fn open() -> Open {
    Open {
        asn: 4_200_000_001,
        hold_time: 90,
        router_id: Ipv4Addr::new(10, 0, 0, 1),
        capabilities: Capabilities {
            families: vec![Family::IPV4_UNICAST, Family::IPV6_UNICAST],
            route_refresh: true,
            enhanced_route_refresh: false,
            four_octet_as: Some(4_200_000_001),
            graceful_restart: Some(GracefulRestart {
                restarting: true,
                notification: false,
                restart_time: 120,
                families: vec![(Family::IPV4_UNICAST, true), (Family::IPV6_UNICAST, false)],
            }),
            other: Vec::new(),
        },
    }
}

fn decode(msg: &[u8]) -> Result<Message, DecodeError> {
    Message::decode(msg, true)
}

fn update_of(msg: &[u8]) -> Update {
    match decode(msg) {
        Ok(Message::Update(u)) => u,
        other => panic!("not an UPDATE: {other:?}"),
    }
}

/// An UPDATE from its parts: withdrawn routes' bytes, attributes' bytes, NLRI bytes.
fn raw_update(withdrawn: &[u8], attrs: &[u8], nlri: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&(withdrawn.len() as u16).to_be_bytes());
    body.extend_from_slice(withdrawn);
    body.extend_from_slice(&(attrs.len() as u16).to_be_bytes());
    body.extend_from_slice(attrs);
    body.extend_from_slice(nlri);
    let mut m = vec![0xff; 16];
    m.extend_from_slice(&((19 + body.len()) as u16).to_be_bytes());
    m.push(2);
    m.extend_from_slice(&body);
    m
}

/// ORIGIN IGP, AS_PATH [65001] (4-octet), NEXT_HOP 192.0.2.1: a valid attribute set.
fn good_attrs() -> Vec<u8> {
    let mut a = vec![0x40, 1, 1, 0];
    a.extend_from_slice(&[0x40, 2, 6, 2, 1, 0, 0, 0xfd, 0xe9]);
    a.extend_from_slice(&[0x40, 3, 4, 192, 0, 2, 1]);
    a
}

/// 10.1.0.0/26 and 10.1.0.64/26 as NLRI.
const TWO: &[u8] = &[26, 10, 1, 0, 0, 26, 10, 1, 0, 64];

#[test]
fn an_open_goes_and_comes_back_with_its_capabilities() {
    let o = open();
    let bytes = Message::Open(o.clone()).encode(true);
    assert_eq!(
        &bytes[20..22],
        &23456u16.to_be_bytes(),
        "AS_TRANS in the 2-octet field"
    );
    assert_eq!(decode(&bytes), Ok(Message::Open(o)));
}

#[test]
fn an_open_that_cannot_be_taken_says_why() {
    let good = Message::Open(open()).encode(true);
    let sub = |m: &[u8]| match decode(m) {
        Err(e) => (e.notification.code, e.notification.subcode),
        Ok(m) => panic!("decoded {m:?}"),
    };
    let mut v3 = good.clone();
    v3[19] = 3;
    assert_eq!(
        sub(&v3),
        (notification::OPEN_ERROR, open_sub::UNSUPPORTED_VERSION)
    );
    let mut hold = good.clone();
    hold[22..24].copy_from_slice(&2u16.to_be_bytes());
    assert_eq!(
        sub(&hold),
        (notification::OPEN_ERROR, open_sub::UNACCEPTABLE_HOLD_TIME)
    );
    let mut id = good.clone();
    id[24..28].copy_from_slice(&[0; 4]);
    assert_eq!(
        sub(&id),
        (notification::OPEN_ERROR, open_sub::BAD_IDENTIFIER)
    );
    let mut param = good.clone();
    param[29] = 1; // the parameter's type: authentication (deprecated)
    assert_eq!(
        sub(&param),
        (notification::OPEN_ERROR, open_sub::UNSUPPORTED_PARAMETER)
    );
    let mut len = good.clone();
    len[28] += 1; // optional parameters' length past the message
    assert_eq!(sub(&len).0, notification::OPEN_ERROR);
    // A 2-octet field that disagrees with the 4-octet capability.
    let mut asn = good;
    asn[20..22].copy_from_slice(&65001u16.to_be_bytes());
    assert_eq!(sub(&asn), (notification::OPEN_ERROR, open_sub::BAD_PEER_AS));
}

#[test]
fn headers_that_are_not_headers_end_the_session() {
    let ka = Message::Keepalive.encode(true);
    assert_eq!(ka.len(), 19);
    assert_eq!(frame_len(&ka[..18]), Ok(None));
    assert_eq!(frame_len(&ka), Ok(Some(19)));
    assert_eq!(decode(&ka), Ok(Message::Keepalive));
    let code = |m: &[u8]| frame_len(m).map(|_| ()).map_err(|e| e.notification.subcode);
    let mut marker = ka.clone();
    marker[3] = 0;
    assert_eq!(code(&marker), Err(header::NOT_SYNCHRONIZED));
    let mut long_ka = ka.clone();
    long_ka[17] = 20;
    assert_eq!(code(&long_ka), Err(header::BAD_LENGTH));
    let mut huge = ka.clone();
    huge[16..18].copy_from_slice(&4097u16.to_be_bytes());
    huge[18] = 2;
    assert_eq!(code(&huge), Err(header::BAD_LENGTH));
    let mut kind = ka;
    kind[18] = 9;
    assert_eq!(code(&kind), Err(header::BAD_TYPE));
}

#[test]
fn notification_route_refresh_and_keepalive_round_trip() {
    for m in [
        Message::Notification(Notification::with_data(6, 2, b"going away")),
        Message::RouteRefresh {
            family: Family::IPV6_UNICAST,
            subtype: 0,
        },
        Message::Keepalive,
    ] {
        assert_eq!(decode(&m.encode(true)), Ok(m));
    }
}

#[test]
fn ten_thousand_routes_fit_in_full_messages_and_read_back() {
    let builder = UpdateBuilder {
        four_octet_as: true,
        attributes: PathAttributes {
            as_path: vec![AsSegment {
                set: false,
                asns: vec![64512],
            }],
            communities: vec![0xfde8_0001],
            ..PathAttributes::default()
        },
    };
    let v4: Vec<IpNet> = (0..10_000u32)
        .map(|i| {
            IpNet::new(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (i << 6))), 26).expect("prefix")
        })
        .collect();
    let nh4 = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));
    let msgs = builder.announce(Family::IPV4_UNICAST, nh4, None, &v4);
    assert!(
        msgs.len() < 20,
        "{} messages: full ones expected",
        msgs.len()
    );
    let mut back = Vec::new();
    for m in &msgs {
        assert!(m.len() <= MAX_LEN);
        let u = update_of(m);
        assert!(u.issues.is_empty(), "{:?}", u.issues);
        assert_eq!(u.attributes.communities, vec![0xfde8_0001]);
        back.extend(u.announced);
    }
    assert_eq!(back, v4.iter().map(|n| (*n, nh4)).collect::<Vec<_>>());
    let w: Vec<IpNet> = builder
        .withdraw(Family::IPV4_UNICAST, &v4)
        .iter()
        .flat_map(|m| update_of(m).withdrawn)
        .collect();
    assert_eq!(w, v4);

    let v6: Vec<IpNet> = (0..3_000u128)
        .map(|i| {
            IpNet::new(
                IpAddr::V6(Ipv6Addr::from((0xfd00u128 << 112) | (i << 6))),
                122,
            )
            .expect("prefix")
        })
        .collect();
    let nh6 = IpAddr::V6("fd00::7".parse().expect("address"));
    let ll: Ipv6Addr = "fe80::7".parse().expect("address");
    let msgs = builder.announce(Family::IPV6_UNICAST, nh6, Some(ll), &v6);
    let mut back = Vec::new();
    for m in &msgs {
        assert!(m.len() <= MAX_LEN);
        let u = update_of(m);
        assert_eq!(u.link_local_next_hop, Some(ll));
        back.extend(u.announced);
    }
    assert_eq!(back, v6.iter().map(|n| (*n, nh6)).collect::<Vec<_>>());
    let w: Vec<IpNet> = builder
        .withdraw(Family::IPV6_UNICAST, &v6)
        .iter()
        .flat_map(|m| update_of(m).withdrawn)
        .collect();
    assert_eq!(w, v6);
}

#[test]
fn end_of_rib_markers_are_recognised() {
    for f in [Family::IPV4_UNICAST, Family::IPV6_UNICAST] {
        let u = update_of(&UpdateBuilder::end_of_rib(f));
        assert_eq!(u.end_of_rib, Some(f));
        assert!(u.withdrawn.is_empty() && u.announced.is_empty());
    }
    let u = update_of(&raw_update(&[], &good_attrs(), TWO));
    assert_eq!(u.end_of_rib, None);
}

#[test]
fn a_malformed_attribute_withdraws_the_routes_and_keeps_the_session() {
    let two = [net("10.1.0.0/26"), net("10.1.0.64/26")];
    // A well-formed one: announced.
    let u = update_of(&raw_update(&[], &good_attrs(), TWO));
    assert_eq!(u.announced.len(), 2);
    assert_eq!(u.attributes.first_asn(), Some(65001));

    let withdrawn = |attrs: &[u8], what: &str| {
        let u = update_of(&raw_update(&[], attrs, TWO));
        assert!(
            u.announced.is_empty(),
            "{what}: announced {:?}",
            u.announced
        );
        assert_eq!(u.withdrawn, two, "{what}");
        assert!(
            u.issues
                .iter()
                .any(|i| i.disposition == Disposition::TreatAsWithdraw),
            "{what}: {:?}",
            u.issues
        );
    };
    let mut bad_origin = good_attrs();
    bad_origin[3] = 7;
    withdrawn(&bad_origin, "ORIGIN 7");
    let mut bad_path = good_attrs();
    bad_path[8] = 3; // segment type 3
    withdrawn(&bad_path, "AS_PATH segment type 3");
    withdrawn(&good_attrs()[..9 + 4], "NEXT_HOP missing");
    let mut comm = good_attrs();
    comm.extend_from_slice(&[0xc0, 8, 3, 1, 2, 3]);
    withdrawn(&comm, "COMMUNITIES of 3 bytes");
    let mut flags = good_attrs();
    flags[0] = 0xc0; // ORIGIN flagged optional
    withdrawn(&flags, "ORIGIN flagged optional");
    let mut unknown_wk = good_attrs();
    unknown_wk.extend_from_slice(&[0x40, 99, 1, 0]);
    withdrawn(&unknown_wk, "an unrecognized well-known attribute");
    // The attributes' framing breaks (a length past the end) with the body's NLRI found.
    let mut overrun = good_attrs();
    overrun.extend_from_slice(&[0xc0, 8, 40, 1, 2, 3, 4]);
    withdrawn(&overrun, "a length past the attributes");

    // Discarded: the routes stand.
    let mut agg = good_attrs();
    agg.extend_from_slice(&[0xc0, ATTR_AGGREGATOR, 3, 1, 2, 3]);
    let u = update_of(&raw_update(&[], &agg, TWO));
    assert_eq!(u.announced.len(), 2);
    assert_eq!(u.issues.len(), 1);
    assert_eq!(u.issues[0].disposition, Disposition::Discard);
    let mut twice = good_attrs();
    twice.extend_from_slice(&[0x40, ATTR_ORIGIN, 1, 2]);
    let u = update_of(&raw_update(&[], &twice, TWO));
    assert_eq!(u.announced.len(), 2, "a second ORIGIN is discarded");
    assert_eq!(u.attributes.origin, Origin::Igp);
    // An unknown optional attribute: ignored, no issue.
    let mut opt = good_attrs();
    opt.extend_from_slice(&[0xc0, 200, 2, 9, 9]);
    let u = update_of(&raw_update(&[], &opt, TWO));
    assert_eq!((u.announced.len(), u.issues.len()), (2, 0));
}

#[test]
fn what_leaves_an_update_unreadable_resets_the_session() {
    let sub = |m: &[u8]| match decode(m) {
        Err(e) => (e.notification.code, e.notification.subcode),
        Ok(m) => panic!("decoded {m:?}"),
    };
    // A prefix of 33 bits.
    assert_eq!(
        sub(&raw_update(&[], &good_attrs(), &[33, 10, 1, 0, 0, 0])),
        (
            notification::UPDATE_ERROR,
            update_sub::INVALID_NETWORK_FIELD
        )
    );
    // Withdrawn routes' length past the message.
    let mut m = raw_update(&[], &good_attrs(), TWO);
    m[20] = 200;
    assert_eq!(
        sub(&m),
        (
            notification::UPDATE_ERROR,
            update_sub::MALFORMED_ATTRIBUTE_LIST
        )
    );
    // MP_REACH_NLRI twice.
    let mp = [0x80, 14, 10, 0, 2, 1, 4, 192, 0, 2, 1, 0, 0];
    let mut attrs = good_attrs();
    attrs.extend_from_slice(&mp);
    attrs.extend_from_slice(&mp);
    assert_eq!(
        sub(&raw_update(&[], &attrs, &[])).0,
        notification::UPDATE_ERROR
    );
    // A framing break with no NLRI found: what it hid cannot be known.
    let mut overrun = good_attrs();
    overrun.extend_from_slice(&[0x80, 14, 200, 0, 2]);
    assert_eq!(
        sub(&raw_update(&[], &overrun, &[])),
        (
            notification::UPDATE_ERROR,
            update_sub::MALFORMED_ATTRIBUTE_LIST
        )
    );
}

#[test]
fn a_two_octet_session_reads_the_real_path_from_as4_path() {
    // The neighbour's AS is 4200000001: AS_PATH [AS_TRANS, 65001] in 2 octets.
    let mut a = vec![0x40, 1, 1, 0];
    a.extend_from_slice(&[0x40, 2, 6, 2, 2, 0x5b, 0xa0, 0xfd, 0xe9]);
    a.extend_from_slice(&[0x40, 3, 4, 192, 0, 2, 1]);
    // AS4_PATH: the whole path in 4 octets.
    a.extend_from_slice(&[0xc0, 17, 10, 2, 2]);
    a.extend_from_slice(&4_200_000_001u32.to_be_bytes());
    a.extend_from_slice(&65001u32.to_be_bytes());
    let m = raw_update(&[], &a, TWO);
    let Ok(Message::Update(u)) = Message::decode(&m, false) else {
        panic!("not an UPDATE");
    };
    let path: Vec<u32> = u.attributes.asns().collect();
    assert_eq!(path, vec![4_200_000_001, 65001]);
}

/// Valid messages of every kind, mutated byte by byte and cut short: each decodes or fails
/// with a NOTIFICATION, never panics, and what decodes encodes again.
#[test]
fn mutated_messages_decode_or_fail_without_panicking() {
    let builder = UpdateBuilder {
        four_octet_as: true,
        attributes: PathAttributes::default(),
    };
    let mut seeds = vec![
        Message::Open(open()).encode(true),
        Message::Keepalive.encode(true),
        Message::Notification(Notification::new(6, 4)).encode(true),
        raw_update(&[], &good_attrs(), TWO),
        UpdateBuilder::end_of_rib(Family::IPV6_UNICAST),
    ];
    seeds.extend(builder.announce(
        Family::IPV6_UNICAST,
        IpAddr::V6(Ipv6Addr::LOCALHOST),
        None,
        &[net("fd00::/122"), net("fd00::40/122")],
    ));
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for seed in &seeds {
        for _ in 0..4_000 {
            let mut m = seed.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() as usize) % m.len();
                m[i] = next() as u8;
            }
            if next() % 4 == 0 {
                let cut = (next() as usize) % m.len();
                m.truncate(cut.max(19));
                let len = m.len() as u16;
                m[16..18].copy_from_slice(&len.to_be_bytes());
            }
            for four in [true, false] {
                if let Ok(msg) = Message::decode(&m, four) {
                    let again = msg.encode(four);
                    assert!(again.len() <= MAX_LEN);
                    assert!(frame_len(&again).is_ok());
                }
            }
        }
    }
}
