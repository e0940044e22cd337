use super::*;

fn route(i: u32) -> Route {
    Route {
        prefix: IpNet::new(
            IpAddr::from([10, (i >> 16) as u8, (i >> 8) as u8, i as u8]),
            32,
        )
        .expect("net"),
        node: "b".into(),
        next_hop: "192.0.2.2".parse().expect("ip"),
    }
}

#[test]
fn a_large_snapshot_spans_messages_and_comes_back_whole() {
    let snap = Snapshot {
        generation: 7,
        routes: (0..5000).map(route).collect(),
    };
    let msgs = encode_snapshot(&snap);
    assert_eq!(msgs.len(), 3);
    assert!(msgs[0].more && msgs[1].more && !msgs[2].more);
    let mut a = Assembler::default();
    assert_eq!(a.push(msgs[0].clone()), Ok(None));
    assert_eq!(a.push(msgs[1].clone()), Ok(None));
    match a.push(msgs[2].clone()) {
        Ok(Some(PeerEvent::Snapshot {
            generation: 7,
            routes,
            unused,
        })) => {
            assert_eq!(routes, snap.routes);
            assert_eq!(unused, Unused::default());
        }
        other => panic!("{other:?}"),
    }
    // An empty snapshot is one message.
    let empty = encode_snapshot(&Snapshot {
        generation: 1,
        routes: vec![],
    });
    assert_eq!(empty.len(), 1);
    assert!(!empty[0].more);
}

#[test]
fn deltas_must_follow_the_snapshot_generation_by_generation() {
    let mut a = Assembler::default();
    let d = |g: u64| {
        encode_delta(&Delta {
            generation: g,
            routes: vec![route(1)],
            withdrawn: vec![route(2).prefix],
        })
    };
    assert_eq!(a.push(d(3)[0].clone()), Err(WireError::NoSnapshot));
    let mut a = Assembler::default();
    let snap = encode_snapshot(&Snapshot {
        generation: 3,
        routes: vec![route(2)],
    });
    assert!(a.push(snap[0].clone()).expect("snapshot").is_some());
    match a.push(d(4)[0].clone()) {
        Ok(Some(PeerEvent::Delta {
            generation: 4,
            routes,
            withdrawn,
            ..
        })) => {
            assert_eq!(routes, vec![route(1)]);
            assert_eq!(withdrawn, vec![route(2).prefix]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        a.push(d(6)[0].clone()),
        Err(WireError::Generation { had: 4, got: 6 })
    );
}

#[test]
fn bad_streams_and_bad_routes() {
    let mut a = Assembler::default();
    let mut m = encode_snapshot(&Snapshot {
        generation: 1,
        routes: vec![route(1)],
    })
    .remove(0);
    m.kind = 0;
    assert_eq!(a.push(m.clone()), Err(WireError::Kind(0)));
    m.kind = 77;
    assert_eq!(a.push(m), Err(WireError::Kind(77)));
    // A continued update that changes generation.
    let mut msgs = encode_snapshot(&Snapshot {
        generation: 1,
        routes: (0..3000).map(route).collect(),
    });
    msgs[1].generation = 2;
    let mut a = Assembler::default();
    a.push(msgs[0].clone()).expect("first part");
    assert_eq!(a.push(msgs[1].clone()), Err(WireError::BrokenUpdate));
    // Malformed routes are set aside.
    let mut a = Assembler::default();
    let bad = pb::RouteUpdate {
        kind: pb::route_update::Kind::Snapshot as i32,
        generation: 1,
        routes: vec![
            to_proto(&route(1)),
            pb::Route {
                prefix: "10.0.0.1/24".into(), // host bits
                node: "b".into(),
                next_hop: "192.0.2.2".into(),
            },
            pb::Route {
                prefix: "10.0.0.0/24".into(),
                node: "b".into(),
                next_hop: "gateway".into(),
            },
            pb::Route {
                prefix: "10.0.0.0/24".into(),
                node: String::new(),
                next_hop: "192.0.2.2".into(),
            },
        ],
        withdrawn: vec![],
        more: false,
    };
    match a.push(bad) {
        Ok(Some(PeerEvent::Snapshot { routes, unused, .. })) => {
            assert_eq!(routes.len(), 1);
            assert_eq!(unused.malformed, 3);
            assert_eq!(
                unused.examples,
                [
                    "10.0.0.1/24 b via 192.0.2.2",
                    "10.0.0.0/24 b via gateway",
                    "10.0.0.0/24  via 192.0.2.2"
                ]
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_peer_cannot_make_this_agent_hold_unbounded_routes() {
    let mut a = Assembler::default();
    let mut m = pb::RouteUpdate {
        kind: pb::route_update::Kind::Snapshot as i32,
        generation: 1,
        routes: (0..CHUNK as u32).map(|i| to_proto(&route(i))).collect(),
        withdrawn: vec![],
        more: true,
    };
    let mut n = 0;
    let err = loop {
        match a.push(m.clone()) {
            Ok(_) => n += 1,
            Err(e) => break e,
        }
        // New routes each time (the same ones again would not be more).
        m.routes = (0..CHUNK as u32)
            .map(|i| to_proto(&route((n + 1) * CHUNK as u32 + i)))
            .collect();
    };
    assert_eq!(err, WireError::TooMany { limit: MAX_ROUTES });
    assert_eq!(n as usize, MAX_ROUTES / CHUNK);
}
