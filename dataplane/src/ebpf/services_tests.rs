//! The Services maps' writer without a kernel: a fake behind its narrow interface.
use super::*;
use calix_common::SVC_V4;
use std::sync::{Arc, Mutex};

type Held2 = (
    BTreeMap<SvcKey, SvcValue>,
    BTreeMap<(u32, u32), SvcBackend>,
    std::collections::BTreeSet<SvcNodeKey>,
    BTreeMap<u32, SvcMaglev>,
);

/// The maps as plain maps, shared with the test.
#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Held2>>);

impl ServiceMaps for Fake {
    fn set_front(&mut self, k: &SvcKey, v: &SvcValue) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").0.insert(*k, *v);
        Ok(())
    }
    fn remove_front(&mut self, k: &SvcKey) {
        self.0.lock().expect("lock").0.remove(k);
    }
    fn set_back(&mut self, k: &SvcBackendKey, v: &SvcBackend) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").1.insert((k.id, k.index), *v);
        Ok(())
    }
    fn remove_back(&mut self, k: &SvcBackendKey) {
        self.0.lock().expect("lock").1.remove(&(k.id, k.index));
    }
    fn read_back(&self) -> Held {
        let g = self.0.lock().expect("lock");
        (
            g.0.iter().map(|(k, v)| (*k, *v)).collect(),
            g.1.iter()
                .map(|((id, index), b)| {
                    (
                        SvcBackendKey {
                            id: *id,
                            index: *index,
                        },
                        *b,
                    )
                })
                .collect(),
        )
    }
    fn set_table(&mut self, id: u32, t: &SvcMaglev) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").3.insert(id, *t);
        Ok(())
    }
    fn remove_table(&mut self, id: u32) {
        self.0.lock().expect("lock").3.remove(&id);
    }
    fn read_tables(&self) -> Vec<u32> {
        self.0.lock().expect("lock").3.keys().copied().collect()
    }
    fn translated(&self, _: u64, _: &SvcBackend) -> Option<SvcRevValue> {
        None
    }
    fn set_node(&mut self, k: &SvcNodeKey) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").2.insert(*k);
        Ok(())
    }
    fn remove_node(&mut self, k: &SvcNodeKey) {
        self.0.lock().expect("lock").2.remove(k);
    }
    fn end_flows(&mut self, _: &Left) -> usize {
        0
    }
    fn read_nodes(&self) -> Vec<SvcNodeKey> {
        self.0.lock().expect("lock").2.iter().copied().collect()
    }
}

#[test]
fn node_addresses_follow_and_a_restart_reads_them_back() {
    let fake = Fake::default();
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    let set = |a: &[&str]| {
        a.iter()
            .map(|s| ip(s))
            .collect::<std::collections::BTreeSet<_>>()
    };
    p.set_nodes(&set(&["192.0.2.1", "192.0.2.2", "fd00::1"]))
        .expect("set");
    let held = |f: &Fake| f.0.lock().expect("lock").2.clone();
    assert_eq!(
        held(&fake),
        set(&["192.0.2.1", "192.0.2.2", "fd00::1"])
            .iter()
            .map(node_key)
            .collect()
    );
    let mut again = ServiceProgrammer::restore(Box::new(fake.clone()));
    again.set_nodes(&set(&["192.0.2.2"])).expect("set");
    assert_eq!(held(&fake), [node_key(&ip("192.0.2.2"))].into());
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn web() -> Front {
    Front {
        address: ip("10.96.0.10"),
        port: 80,
        proto: TCP,
        external: false,
    }
}

/// `web`'s NodePort at a node's address, for clients outside.
fn node_port_outside() -> Front {
    Front {
        address: ip("192.0.2.1"),
        port: 30080,
        external: true,
        ..web()
    }
}

/// A frontend for clients outside is its own entry, with its own backends and flags.
#[test]
fn an_external_frontend_gets_its_backends_and_a_drop() {
    let fake = Fake::default();
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    let outside = node_port_outside();
    let mut want = BTreeMap::from([
        (web(), Target::to(vec![(ip("10.244.1.5"), 8080)])),
        (outside, Target::to(vec![(ip("10.244.1.6"), 8080)])),
    ]);
    p.set(&want).expect("set");
    {
        let g = fake.0.lock().expect("lock");
        let v = g.0[&key(&outside)];
        assert_eq!((v.count, v.flags), (1, 0), "its backend, of its family");
        assert_eq!(g.1[&(v.id, 0)].addr[..4], [10, 244, 1, 6]);
        assert_ne!(
            key(&outside),
            key(&Front {
                external: false,
                ..outside
            })
        );
    }
    want.insert(outside, Target::Drop);
    p.set(&want).expect("set");
    let v = fake.0.lock().expect("lock").0[&key(&outside)];
    assert_eq!((v.count, v.flags), (0, SVC_REJECT | SVC_DROP));
}

#[test]
fn a_change_goes_under_a_new_id_and_the_old_one_goes_after() {
    let fake = Fake::default();
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    let mut want = BTreeMap::from([(
        web(),
        Target::to(vec![(ip("10.244.1.5"), 8080), (ip("fd00::5"), 8080)]),
    )]);
    p.set(&want).expect("set");
    {
        let g = fake.0.lock().expect("lock");
        let v = g.0[&key(&web())];
        assert_eq!((v.count, v.flags), (1, 0), "the other family left out");
        assert_eq!(g.1.len(), 1);
        assert_eq!(g.1[&(v.id, 0)].port, 8080u16.to_be());
    }
    // The same again: nothing written.
    let before = fake.0.lock().expect("lock").0[&key(&web())];
    p.set(&want).expect("set");
    assert_eq!(fake.0.lock().expect("lock").0[&key(&web())], before);
    // Two backends: a new id, the old one's entries gone.
    want.insert(
        web(),
        Target::to(vec![(ip("10.244.1.5"), 8080), (ip("10.244.1.6"), 8080)]),
    );
    p.set(&want).expect("set");
    {
        let g = fake.0.lock().expect("lock");
        let v = g.0[&key(&web())];
        assert_ne!(v.id, before.id);
        assert_eq!(v.count, 2);
        assert_eq!(g.1.len(), 2, "only the new id's");
    }
    // No endpoint: refused; then gone: nothing left.
    want.insert(web(), Target::Refuse);
    p.set(&want).expect("set");
    let v = fake.0.lock().expect("lock").0[&key(&web())];
    assert_eq!((v.count, v.flags), (0, SVC_REJECT));
    assert!(fake.0.lock().expect("lock").1.is_empty());
    p.set(&BTreeMap::new()).expect("set");
    assert!(fake.0.lock().expect("lock").0.is_empty());
    assert_eq!(p.counts(), (0, 0));
}

#[test]
fn udp_backends_that_leave_a_frontend_are_said() {
    let mut p = ServiceProgrammer::restore(Box::new(Fake::default()));
    let dns = Front {
        port: 53,
        proto: UDP,
        ..web()
    };
    let two = Target::to(vec![(ip("10.244.1.5"), 53), (ip("10.244.1.6"), 53)]);
    let mut want = BTreeMap::from([(web(), two.clone()), (dns, two)]);
    assert_eq!(p.set(&want).expect("set"), [], "nothing left yet");
    let one = Target::to(vec![(ip("10.244.1.6"), 53)]);
    want.insert(web(), one.clone());
    want.insert(dns, one);
    let left = p.set(&want).expect("set");
    let (gone, _) = octets(&ip("10.244.1.5"));
    assert_eq!(
        left,
        [Left {
            front: key(&dns),
            backend: (gone, 53u16.to_be())
        }],
        "UDP only: a TCP connection ends by itself"
    );
    want.remove(&dns);
    let left = p.set(&want).expect("set");
    assert_eq!(left.len(), 1, "the frontend gone: its backends left it");
}

#[test]
fn a_restart_keeps_what_the_pins_hold_and_drops_the_incomplete() {
    let fake = Fake::default();
    let want = BTreeMap::from([(web(), Target::to(vec![(ip("10.244.1.5"), 8080)]))]);
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    p.set(&want).expect("set");
    let held = fake.0.lock().expect("lock").0[&key(&web())];
    // A stray backend of no frontend (an agent stopped between two writes).
    fake.0.lock().expect("lock").1.insert(
        (held.id + 7, 0),
        SvcBackend {
            family: SVC_V4,
            ..SvcBackend::default()
        },
    );
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    assert_eq!(
        fake.0.lock().expect("lock").1.len(),
        1,
        "the stray one gone"
    );
    p.set(&want).expect("set");
    assert_eq!(
        fake.0.lock().expect("lock").0[&key(&web())],
        held,
        "unchanged: not written again"
    );
    // The next id is above every id the pins held.
    let other = Front { port: 81, ..web() };
    let mut more = want.clone();
    more.insert(other, Target::to(vec![(ip("10.244.1.9"), 9)]));
    p.set(&more).expect("set");
    let v = fake.0.lock().expect("lock").0[&key(&other)];
    assert!(v.id > held.id + 7, "{} vs {}", v.id, held.id);
}

#[test]
fn the_flows_of_a_udp_backend_that_left_an_external_frontend_end() {
    let v4 = |a: [u8; 4]| {
        let mut o = [0u8; 16];
        o[..4].copy_from_slice(&a);
        o
    };
    let front = key(&Front {
        address: ip("192.0.2.1"),
        port: 30053,
        proto: UDP,
        external: true,
    });
    let (gone, stays) = (
        (v4([10, 244, 1, 5]), 53u16.to_be()),
        (v4([10, 244, 1, 6]), 53u16.to_be()),
    );
    let client = (v4([198, 51, 100, 7]), 40000u16.to_be());
    let flow = |dir: u8, a: ([u8; 16], u16), b: ([u8; 16], u16), to: ([u8; 16], u16)| {
        (
            SvcFlowKey {
                a: a.0,
                b: b.0,
                a_port: a.1,
                b_port: b.1,
                proto: UDP,
                family: calix_common::SVC_V4,
                dir,
                _pad: 0,
            },
            SvcFlow {
                addr: to.0,
                port: to.1,
                ..SvcFlow::default()
            },
        )
    };
    let at = (front.addr, front.port);
    let other_client = (v4([198, 51, 100, 8]), 40000u16.to_be());
    let held = [
        flow(SVC_FLOW_IN, client, at, gone),
        flow(SVC_FLOW_OUT, gone, client, at),
        flow(SVC_FLOW_IN, other_client, at, stays),
        flow(SVC_FLOW_OUT, stays, other_client, at),
        // The same backend for another frontend (another port).
        flow(SVC_FLOW_OUT, gone, client, (front.addr, 30054u16.to_be())),
    ];
    let left = Left {
        front,
        backend: gone,
    };
    assert_eq!(ended_flows(&left, &held), [held[0].0, held[1].0]);
}

/// An external frontend's flows pick by its Maglev table, written under its backends' id
/// before its entry points there and removed with them; a frontend for clients inside has
/// none; a restart keeps a complete one and writes again one an older build left without.
#[test]
fn an_external_frontend_has_a_maglev_table_under_its_backends_id() {
    let fake = Fake::default();
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    let outside = node_port_outside();
    let three = vec![
        (ip("10.244.1.5"), 8080),
        (ip("10.244.1.6"), 8080),
        (ip("10.244.2.7"), 8080),
    ];
    let mut want = BTreeMap::from([
        (web(), Target::to(three.clone())),
        (outside, Target::to(three.clone())),
    ]);
    p.set(&want).expect("set");
    let table_of = |f: &Fake| {
        let g = f.0.lock().expect("lock");
        let v = g.0[&key(&outside)];
        assert_eq!(
            g.3.len(),
            1,
            "the external frontend's only: {:?}",
            g.3.keys()
        );
        (v.id, g.3[&v.id])
    };
    let (id, t) = table_of(&fake);
    let mut shares = [0usize; 3];
    for s in &t.slots[..SVC_MAGLEV_SLOTS as usize] {
        shares[usize::from(*s)] += 1;
    }
    assert!(shares.iter().all(|n| (340..=341).contains(n)), "{shares:?}");
    // The same backends in another order: the same backend in every slot (every node that
    // has them builds this table).
    let backs =
        |v: &[(IpAddr, u16)]| -> Vec<SvcBackend> { entries(&Target::to(v.to_vec()), SVC_V4).0 };
    let mut reversed = three.clone();
    reversed.reverse();
    let (a, b) = (backs(&three), backs(&reversed));
    let (ta, tb) = (maglev(&a), maglev(&b));
    assert!(ta
        .slots
        .iter()
        .zip(&tb.slots)
        .take(SVC_MAGLEV_SLOTS as usize)
        .all(|(x, y)| a[usize::from(*x)] == b[usize::from(*y)]));
    // One backend fewer: a new id and table, the old id's gone; the slots of the backends that
    // stay mostly stay.
    want.insert(outside, Target::to(three[..2].to_vec()));
    p.set(&want).expect("set");
    let (id2, t2) = table_of(&fake);
    assert_ne!(id2, id);
    let kept = t
        .slots
        .iter()
        .zip(&t2.slots)
        .take(SVC_MAGLEV_SLOTS as usize)
        .filter(|(x, _)| **x != 2)
        .filter(|(x, y)| x == y)
        .count();
    assert!(
        kept >= shares[0] + shares[1] - 20,
        "{kept} of {}",
        shares[0] + shares[1]
    );
    // A restart keeps it as it is.
    let again = ServiceProgrammer::restore(Box::new(fake.clone()));
    assert_eq!(again.counts().0, 2);
    assert_eq!(table_of(&fake).0, id2);
    // An older build's: no table. Written again under a new id at the next set.
    fake.0.lock().expect("lock").3.clear();
    let mut again = ServiceProgrammer::restore(Box::new(fake.clone()));
    again.set(&want).expect("set");
    let (id3, _) = table_of(&fake);
    assert_ne!(id3, id2);
    // A table of no frontend goes at a restart; Drop and gone leave none.
    fake.0
        .lock()
        .expect("lock")
        .3
        .insert(9999, SvcMaglev::default());
    let mut again = ServiceProgrammer::restore(Box::new(fake.clone()));
    assert_eq!(table_of(&fake).0, id3);
    want.insert(outside, Target::Drop);
    again.set(&want).expect("set");
    assert!(fake.0.lock().expect("lock").3.is_empty());
}

/// What changed alone: the frontends named written (as a whole set would), those gone removed
/// with their backends, every other frontend left as it was; a UDP frontend gone says its
/// backends left.
#[test]
fn an_update_changes_what_it_names_and_leaves_the_rest() {
    let fake = Fake::default();
    let mut p = ServiceProgrammer::restore(Box::new(fake.clone()));
    let dns = Front {
        port: 53,
        proto: UDP,
        ..web()
    };
    let other = Front {
        address: ip("10.96.0.11"),
        ..web()
    };
    let to = |a: &str, port: u16| Target::to(vec![(ip(a), port)]);
    let whole = BTreeMap::from([
        (web(), to("10.244.1.5", 8080)),
        (dns, to("10.244.1.7", 53)),
        (other, to("10.244.1.8", 8080)),
    ]);
    p.set(&whole).expect("set");
    let other_before = fake.0.lock().expect("lock").0[&key(&other)];
    let changed = BTreeMap::from([(web(), to("10.244.1.6", 8080))]);
    let left = p
        .update(&changed, &std::collections::BTreeSet::from([dns]))
        .expect("update");
    let (gone, _) = octets(&ip("10.244.1.7"));
    assert_eq!(
        left,
        [Left {
            front: key(&dns),
            backend: (gone, 53u16.to_be())
        }]
    );
    let g = fake.0.lock().expect("lock");
    assert!(!g.0.contains_key(&key(&dns)), "gone");
    assert_eq!(g.0[&key(&other)], other_before, "not named: as it was");
    let v = g.0[&key(&web())];
    assert_eq!(g.1[&(v.id, 0)].addr[..4], [10, 244, 1, 6]);
    assert_eq!(g.1.len(), 2, "web's new backend and other's; dns's gone");
    drop(g);
    assert_eq!(p.counts(), (2, 2));
    // A frontend the maps do not hold, said gone: nothing happens.
    let left = p
        .update(&BTreeMap::new(), &std::collections::BTreeSet::from([dns]))
        .expect("update");
    assert!(left.is_empty());
    assert_eq!(p.counts(), (2, 2));
}
