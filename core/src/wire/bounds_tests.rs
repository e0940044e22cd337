//! What one peer can make this agent hold (issue 20, item 4).
use super::*;

fn route(i: u32) -> Route {
    Route {
        prefix: IpNet::new(
            IpAddr::from(0x0a00_0000u32.wrapping_add(i).to_be_bytes()),
            32,
        )
        .expect("net"),
        node: "b".into(),
        next_hop: "192.0.2.2".parse().expect("ip"),
    }
}

fn msg(kind: pb::route_update::Kind, generation: u64, more: bool) -> pb::RouteUpdate {
    pb::RouteUpdate {
        kind: kind as i32,
        generation,
        routes: vec![],
        withdrawn: vec![],
        more,
    }
}

/// An assembler that took a snapshot of `n` routes (route(0)..route(n)) at generation 1.
fn holding(n: u32) -> Assembler {
    let mut a = Assembler::default();
    let snap = Snapshot {
        generation: 1,
        routes: (0..n).map(route).collect(),
    };
    let mut last = None;
    for m in encode_snapshot(&snap) {
        last = a.push(m).expect("snapshot part");
    }
    assert!(matches!(last, Some(PeerEvent::Snapshot { .. })));
    a
}

#[test]
fn a_withdrawal_of_a_prefix_never_announced_does_not_lower_held() {
    let mut a = holding(MAX_ROUTES as u32);
    // Withdrawals of prefixes the peer never announced...
    let unknown: Vec<IpNet> = (0..CHUNK as u32)
        .map(|i| route(MAX_ROUTES as u32 + 1_000_000 + i).prefix)
        .collect();
    for m in encode_delta(&Delta {
        generation: 2,
        routes: vec![],
        withdrawn: unknown,
    }) {
        a.push(m).expect("unknown withdrawals are not an error");
    }
    // ...leave no room for new routes: the peer still holds MAX_ROUTES.
    let new: Vec<Route> = (0..CHUNK as u32)
        .map(|i| route(MAX_ROUTES as u32 + i))
        .collect();
    let msgs = encode_delta(&Delta {
        generation: 3,
        routes: new,
        withdrawn: vec![],
    });
    let got: Vec<_> = msgs.into_iter().map(|m| a.push(m)).collect();
    assert!(
        got.contains(&Err(WireError::TooMany { limit: MAX_ROUTES })),
        "a peer holding {MAX_ROUTES} routes added {CHUNK} more after withdrawing prefixes it never announced"
    );
    assert_eq!(a.held(), MAX_ROUTES);
}

#[test]
fn a_re_announced_prefix_does_not_raise_held() {
    let mut a = holding(MAX_ROUTES as u32);
    for g in 2..5u64 {
        let mut r = route(7);
        r.next_hop = IpAddr::from([192, 0, 2, g as u8]);
        let m = encode_delta(&Delta {
            generation: g,
            routes: vec![r],
            withdrawn: vec![],
        });
        assert!(
            matches!(a.push(m[0].clone()), Ok(Some(PeerEvent::Delta { .. }))),
            "re-announcing a held prefix (generation {g}) counted as a new route"
        );
    }
    assert_eq!(a.held(), MAX_ROUTES);
}

#[test]
fn malformed_entries_are_counted_not_kept() {
    let mut a = holding(1);
    let bad = pb::Route {
        prefix: "10.0.0.1/24".into(),
        node: "b".into(),
        next_hop: "192.0.2.2".into(),
    };
    let mut m = msg(pb::route_update::Kind::Delta, 2, true);
    m.routes = vec![bad; CHUNK];
    for _ in 0..99 {
        assert_eq!(a.push(m.clone()), Ok(None));
    }
    m.more = false;
    match a.push(m) {
        Ok(Some(PeerEvent::Delta { unused, .. })) => {
            assert_eq!(unused.malformed, 100 * CHUNK as u64);
            assert_eq!(unused.examples.len(), crate::update::MALFORMED_EXAMPLES);
        }
        other => panic!("{other:?}"),
    }
    // An example is cut short, whatever the entry's size.
    let mut a = holding(1);
    let mut m = msg(pb::route_update::Kind::Delta, 2, false);
    m.routes = vec![pb::Route {
        prefix: "p".repeat(1 << 20),
        node: "é".repeat(1 << 19),
        next_hop: String::new(),
    }];
    m.withdrawn = vec!["w".repeat(1 << 20)];
    match a.push(m) {
        Ok(Some(PeerEvent::Delta { unused, .. })) => {
            assert_eq!(unused.malformed, 2);
            assert!(
                unused
                    .examples
                    .iter()
                    .all(|e| e.chars().count() < 4 * EXAMPLE_CHARS),
                "{:?}",
                unused.examples
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_update_is_bounded_in_bytes_across_its_messages() {
    let mut a = holding(1);
    // A message of 1 MiB (under the per-message limit), again and again, never finished.
    let mut m = msg(pb::route_update::Kind::Delta, 2, true);
    m.withdrawn = vec!["x".repeat(1 << 20)];
    let n = (0..100).take_while(|_| a.push(m.clone()).is_ok()).count();
    assert!(n < 100, "{n} MiB of one update taken without an error");
    assert_eq!(
        n,
        MAX_UPDATE_BYTES / (1 << 20) - 1,
        "the last MiB holds the headers"
    );
    assert_eq!(
        a.push(m),
        Err(WireError::UpdateBytes {
            limit: MAX_UPDATE_BYTES
        })
    );
}

#[test]
fn an_update_is_bounded_in_messages() {
    let mut a = holding(1);
    let m = msg(pb::route_update::Kind::Delta, 2, true);
    let n = (0..100_000)
        .take_while(|_| a.push(m.clone()).is_ok())
        .count();
    assert!(n < 100_000, "{n} empty messages of one update taken");
    assert_eq!(n, MAX_PARTS);
    assert_eq!(a.push(m), Err(WireError::UpdateParts { limit: MAX_PARTS }));
}

#[test]
fn withdrawals_of_prefixes_not_held_are_ignored() {
    let mut a = holding(2);
    let m = encode_delta(&Delta {
        generation: 2,
        routes: vec![],
        withdrawn: vec![route(1).prefix, route(99).prefix, route(1).prefix],
    });
    match a.push(m[0].clone()) {
        Ok(Some(PeerEvent::Delta {
            withdrawn, unused, ..
        })) => {
            assert_eq!(withdrawn, vec![route(1).prefix], "only what the peer holds");
            assert_eq!(
                unused.unknown_withdrawals, 2,
                "never announced, and already withdrawn"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.held(), 1);
    // A snapshot holds nothing before it: its withdrawals are all unknown.
    let mut m = msg(pb::route_update::Kind::Snapshot, 9, false);
    m.withdrawn = vec![route(0).prefix.to_string()];
    match a.push(m) {
        Ok(Some(PeerEvent::Snapshot { routes, unused, .. })) => {
            assert!(routes.is_empty());
            assert_eq!(unused.unknown_withdrawals, 1);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.held(), 0);
}

/// What the peer holds is counted exactly, bytes too, whatever the order of announcements
/// and withdrawals within an update; an announcement wins over a withdrawal of the same
/// prefix in one delta (as the session applies it).
#[test]
fn held_routes_and_bytes_are_exact() {
    let limits = Limits {
        routes: 3,
        held_bytes: 1 << 20,
        ..Limits::default()
    };
    let mut a = Assembler::with_limits(limits);
    let size = |r: &Route| to_proto(r).encoded_len();
    let snap = encode_snapshot(&Snapshot {
        generation: 1,
        routes: vec![route(0), route(1), route(2)],
    });
    a.push(snap[0].clone()).expect("snapshot");
    assert_eq!(a.held(), 3);
    assert_eq!(a.held_bytes(), 3 * size(&route(0)));
    // One message withdraws 0 and re-announces it, withdraws 1 and announces 3.
    let mut m = msg(pb::route_update::Kind::Delta, 2, false);
    m.withdrawn = [0, 1].map(|i| route(i).prefix.to_string()).to_vec();
    let mut longer = route(0);
    longer.node = "a-longer-name".into();
    m.routes = vec![to_proto(&longer), to_proto(&route(3))];
    match a.push(m) {
        Ok(Some(PeerEvent::Delta {
            routes, withdrawn, ..
        })) => {
            assert_eq!(routes, vec![longer.clone(), route(3)]);
            assert_eq!(withdrawn, vec![route(1).prefix]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.held(), 3);
    assert_eq!(a.held_bytes(), size(&longer) + 2 * size(&route(0)));
    // A fourth route breaks the limit, even announced twice within one update.
    let m = encode_delta(&Delta {
        generation: 3,
        routes: vec![route(4), route(4)],
        withdrawn: vec![],
    });
    assert_eq!(a.push(m[0].clone()), Err(WireError::TooMany { limit: 3 }));
    // Bytes: a peer holding few routes of long names breaks the bytes limit.
    let mut a = Assembler::with_limits(Limits {
        held_bytes: 1000,
        ..Limits::default()
    });
    let mut big = route(0);
    big.node = "n".repeat(253);
    let m = encode_snapshot(&Snapshot {
        generation: 1,
        routes: (0..4)
            .map(|i| Route {
                prefix: route(i).prefix,
                ..big.clone()
            })
            .collect(),
    });
    assert_eq!(
        a.push(m[0].clone()),
        Err(WireError::HeldBytes { limit: 1000 })
    );
}
