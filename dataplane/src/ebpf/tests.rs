//! The endpoint bookkeeping ([`Endpoints`]) on in-memory maps: what attach writes, what detach
//! removes, what verify finds drifted and attach repairs, what the sweep after the initial sync
//! removes.
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};

use calix_common::{
    direct_bucket, DirectEndpoint, EndpointInfo, LocalEndpoint, EP_HAS_V4, EP_HAS_V6,
    MAX_ENDPOINTS, STACK_MARKED,
};

use super::endpoints::{Endpoints, Inherited};
use super::maps::{EndpointMaps, SlotArrays, Table};
use crate::{DataplaneError, Drift, EndpointSpec};

/// An in-memory map, shared with the test that reads it. An array (`array`) reads as its
/// default where nothing was written.
struct Mem<K, V> {
    entries: Arc<Mutex<BTreeMap<K, V>>>,
    array: bool,
}

impl<K: Ord + Copy + Send, V: Copy + Default + Send> Table<K, V> for Mem<K, V> {
    fn get(&self, k: &K) -> Result<Option<V>, DataplaneError> {
        let e = self.entries.lock().expect("lock");
        Ok(match e.get(k) {
            Some(v) => Some(*v),
            None if self.array => Some(V::default()),
            None => None,
        })
    }
    fn set(&mut self, k: K, v: V) -> Result<(), DataplaneError> {
        self.entries.lock().expect("lock").insert(k, v);
        Ok(())
    }
    fn remove(&mut self, k: &K) {
        self.entries.lock().expect("lock").remove(k);
    }
    fn keys(&self) -> Vec<K> {
        self.entries.lock().expect("lock").keys().copied().collect()
    }
    fn entries(&self) -> Vec<(K, V)> {
        let e = self.entries.lock().expect("lock");
        e.iter().map(|(k, v)| (*k, *v)).collect()
    }
}

type Shared<K, V> = Arc<Mutex<BTreeMap<K, V>>>;
/// Per slot: how often its counters were zeroed, and its three marks.
type SlotState = Shared<u32, (u32, [u32; 3])>;

/// The slot arrays: per slot, (counters zeroed how often, the three marks).
#[derive(Default)]
struct MemSlots(SlotState);

impl SlotArrays for MemSlots {
    fn reset(&mut self, slot: u32, marked: u32, overflow: u32) -> Result<(), DataplaneError> {
        let mut s = self.0.lock().expect("lock");
        let e = s.entry(slot).or_default();
        e.0 += 1;
        e.1 = [marked, overflow, 0];
        Ok(())
    }
    fn mark(&mut self, slot: u32) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").entry(slot).or_default().1[0] = STACK_MARKED;
        Ok(())
    }
    fn set_overflow(&mut self, slot: u32, overflow: u32) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").entry(slot).or_default().1[1] = overflow;
        Ok(())
    }
}

/// The maps as a test sees them.
#[derive(Default)]
struct Maps {
    endpoints: Shared<u32, EndpointInfo>,
    direct: Shared<u32, DirectEndpoint>,
    local_v4: Shared<[u8; 4], LocalEndpoint>,
    local_v6: Shared<[u8; 16], LocalEndpoint>,
    owned: Shared<u32, u32>,
    slots: SlotState,
}

fn mem<K, V>(m: &Shared<K, V>, array: bool) -> Box<Mem<K, V>> {
    Box::new(Mem {
        entries: m.clone(),
        array,
    })
}

impl Maps {
    fn endpoints(&self, inherited: Option<Inherited>) -> Endpoints {
        let maps = EndpointMaps {
            endpoints: mem(&self.endpoints, false),
            direct: mem(&self.direct, true),
            local_v4: mem(&self.local_v4, false),
            local_v6: mem(&self.local_v6, false),
            per_endpoint: vec![mem(&self.owned, false)],
            slots: Box::new(MemSlots(self.slots.clone())),
        };
        Endpoints::restore(maps, inherited, None)
    }
    fn endpoint(&self, idx: u32) -> Option<EndpointInfo> {
        self.endpoints.lock().expect("lock").get(&idx).copied()
    }
    fn bucket(&self, idx: u32) -> DirectEndpoint {
        let d = self.direct.lock().expect("lock");
        d.get(&direct_bucket(idx)).copied().unwrap_or_default()
    }
    fn local_v4(&self, a: Ipv4Addr) -> Option<LocalEndpoint> {
        self.local_v4
            .lock()
            .expect("lock")
            .get(&a.octets())
            .copied()
    }
    fn local_v6(&self, a: Ipv6Addr) -> Option<LocalEndpoint> {
        self.local_v6
            .lock()
            .expect("lock")
            .get(&a.octets())
            .copied()
    }
}

const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

fn spec(key: &str, ifname: &str, v4: [u8; 4]) -> EndpointSpec {
    EndpointSpec {
        key: key.into(),
        host_ifname: ifname.into(),
        host_ifindex: None,
        ipv4: Some(Ipv4Addr::from(v4)),
        ipv6: Some(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(v4[3]))),
        mac: Some(MAC),
        pod: None,
    }
}

fn attach(e: &mut Endpoints, ep: &EndpointSpec, idx: u32) {
    e.attach(ep, idx, || Ok(())).expect("attach");
}

#[test]
fn attach_writes_the_endpoint_its_bucket_and_its_local_entries() {
    let m = Maps::default();
    let mut e = m.endpoints(None);
    let ep = spec("c1/eth0", "cali1", [10, 0, 0, 5]);
    attach(&mut e, &ep, 7);

    let info = m.endpoint(7).expect("the endpoint entry");
    assert_eq!(info.ipv4, [10, 0, 0, 5]);
    assert_eq!(info.ipv6, ep.ipv6.expect("v6").octets());
    assert_eq!(info.flags, EP_HAS_V4 | EP_HAS_V6);
    assert_eq!(
        m.bucket(7),
        DirectEndpoint {
            ifindex: 7,
            _pad: 0,
            info
        }
    );
    let local = m.local_v4(Ipv4Addr::new(10, 0, 0, 5)).expect("v4 local");
    assert_eq!((local.ifindex, local.slot, local.mac), (7, info.slot, MAC));
    assert_eq!(m.local_v6(ep.ipv6.expect("v6")), Some(local));
    // A new slot: its counters zeroed, its marks cleared, before anything pointed at it.
    assert_eq!(
        m.slots.lock().expect("lock").get(&info.slot),
        Some(&(1, [0, 0, 0]))
    );
    assert!(e.drift(&ep, 7).is_empty(), "{:?}", e.drift(&ep, 7));
}

#[test]
fn detach_removes_what_attach_wrote() {
    let m = Maps::default();
    let mut e = m.endpoints(None);
    let ep = spec("c1/eth0", "cali1", [10, 0, 0, 5]);
    attach(&mut e, &ep, 7);
    m.owned.lock().expect("lock").insert(7, 3);

    let p = e.detach("c1/eth0").expect("its programs go too");
    assert_eq!((p.ifname.as_str(), p.ifindex), ("cali1", 7));
    assert_eq!(m.endpoint(7), None);
    assert_eq!(m.bucket(7), DirectEndpoint::default());
    assert_eq!(m.local_v4(Ipv4Addr::new(10, 0, 0, 5)), None);
    assert_eq!(m.local_v6(ep.ipv6.expect("v6")), None);
    assert!(m.owned.lock().expect("lock").is_empty(), "budget count");
    // Twice is fine, and an unknown key too.
    assert!(e.detach("c1/eth0").is_none());
}

#[test]
fn a_failed_program_attach_leaves_no_entry() {
    let m = Maps::default();
    let mut e = m.endpoints(None);
    let ep = spec("c1/eth0", "cali1", [10, 0, 0, 5]);
    let err = e.attach(&ep, 7, || Err(DataplaneError::Driver("no programs".into())));
    assert!(err.is_err());
    assert_eq!(m.endpoint(7), None);
    assert_eq!(m.bucket(7), DirectEndpoint::default());
    assert_eq!(m.local_v4(Ipv4Addr::new(10, 0, 0, 5)), None);
    assert!(e.detach("c1/eth0").is_none(), "not recorded as programmed");
}

#[test]
fn verify_finds_a_wrong_entry_and_attach_repairs_it() {
    let m = Maps::default();
    let mut e = m.endpoints(None);
    let ep = spec("c1/eth0", "cali1", [10, 0, 0, 5]);
    attach(&mut e, &ep, 7);

    // Someone rewrote the endpoint entry and pointed the v4 address elsewhere.
    m.endpoints
        .lock()
        .expect("lock")
        .get_mut(&7)
        .expect("entry")
        .flags = 0;
    m.local_v4
        .lock()
        .expect("lock")
        .get_mut(&[10, 0, 0, 5])
        .expect("local")
        .ifindex = 9;
    assert_eq!(
        e.drift(&ep, 7),
        vec![
            Drift::EndpointEntry,
            Drift::LocalEntry(Ipv4Addr::new(10, 0, 0, 5).into())
        ]
    );
    attach(&mut e, &ep, 7);
    assert!(e.drift(&ep, 7).is_empty(), "{:?}", e.drift(&ep, 7));
    assert_eq!(m.endpoint(7).expect("entry").flags, EP_HAS_V4 | EP_HAS_V6);

    // A missing bucket is drift too.
    m.direct.lock().expect("lock").clear();
    assert_eq!(e.drift(&ep, 7), vec![Drift::EndpointEntry]);
}

#[test]
fn a_shared_bucket_goes_to_the_other_endpoint_when_its_holder_leaves() {
    let m = Maps::default();
    let mut e = m.endpoints(None);
    let (a, b) = (7, 7 + MAX_ENDPOINTS);
    attach(&mut e, &spec("a/eth0", "cali1", [10, 0, 0, 1]), a);
    attach(&mut e, &spec("b/eth0", "cali2", [10, 0, 0, 2]), b);
    // The first keeps the bucket; the second is in the table only, which is no drift.
    assert_eq!(m.bucket(a).ifindex, a);
    assert!(e
        .drift(&spec("b/eth0", "cali2", [10, 0, 0, 2]), b)
        .is_empty());

    e.detach("a/eth0").expect("gone");
    let d = m.bucket(b);
    assert_eq!(d.ifindex, b);
    assert_eq!(Some(d.info), m.endpoint(b));
}

#[test]
fn a_recreated_pod_on_the_same_name_replaces_the_old_entries() {
    let m = Maps::default();
    let mut e = m.endpoints(None);
    attach(&mut e, &spec("old/eth0", "cali1", [10, 0, 0, 1]), 7);
    // A new sandbox, a new link with the same name.
    attach(&mut e, &spec("new/eth0", "cali1", [10, 0, 0, 2]), 8);
    assert_eq!(m.endpoint(7), None);
    assert_eq!(m.local_v4(Ipv4Addr::new(10, 0, 0, 1)), None);
    assert_eq!(m.endpoint(8).expect("new").ipv4, [10, 0, 0, 2]);
    // The old key is forgotten: its DEL does nothing to the new one.
    assert!(e.detach("old/eth0").is_none());
    assert!(m.endpoint(8).is_some());
}

#[test]
fn the_sweep_removes_what_no_programmed_endpoint_owns() {
    let m = Maps::default();
    // Left by an earlier agent: an endpoint (slot 3) whose pod was deleted while it was away.
    let stale = EndpointInfo {
        slot: 3,
        ..EndpointInfo::default()
    };
    m.endpoints.lock().expect("lock").insert(40, stale);
    m.direct.lock().expect("lock").insert(
        direct_bucket(40),
        DirectEndpoint {
            ifindex: 40,
            _pad: 0,
            info: stale,
        },
    );
    let gone = LocalEndpoint {
        ifindex: 40,
        slot: 3,
        mac: MAC,
        _pad: [0; 2],
    };
    m.local_v4
        .lock()
        .expect("lock")
        .insert([10, 0, 0, 40], gone);
    m.owned.lock().expect("lock").insert(40, 1);
    let mut e = m.endpoints(None);
    let ep = spec("c1/eth0", "cali1", [10, 0, 0, 5]);
    attach(&mut e, &ep, 7);

    // endpoint entry, bucket, slot, budget count, local entry.
    assert_eq!(e.sweep(), 5);
    assert_eq!(m.endpoint(40), None);
    assert_eq!(m.bucket(40), DirectEndpoint::default());
    assert_eq!(m.local_v4(Ipv4Addr::new(10, 0, 0, 40)), None);
    assert!(!m.owned.lock().expect("lock").contains_key(&40));
    // What is programmed stays.
    assert!(m.endpoint(7).is_some());
    assert!(e.drift(&ep, 7).is_empty());
    assert_eq!(e.sweep(), 0);
}

#[test]
fn an_endpoint_keeps_its_slot_across_a_restart() {
    let m = Maps::default();
    let ep = spec("c1/eth0", "cali1", [10, 0, 0, 5]);
    let slot = {
        let mut e = m.endpoints(None);
        attach(&mut e, &ep, 7);
        e.release();
        m.endpoint(7).expect("entry").slot
    };
    // The next agent: the slot from the pinned entry, its counters not zeroed again.
    let mut e = m.endpoints(None);
    attach(&mut e, &ep, 7);
    assert_eq!(m.endpoint(7).expect("entry").slot, slot);
    assert_eq!(
        m.slots.lock().expect("lock").get(&slot).map(|s| s.0),
        Some(1)
    );
}

#[test]
fn an_endpoint_named_by_a_stack_flow_inherits_a_mark_until_the_initial_sync_ends() {
    let m = Maps::default();
    let mut v4 = [0u8; 16];
    v4[..4].copy_from_slice(&[10, 0, 0, 5]);
    let inherited = Inherited {
        marks: crate::pins::OldMarks::new(&[], &[]),
        flow_addrs: [v4].into_iter().collect(),
    };
    let mut e = m.endpoints(Some(inherited));
    attach(&mut e, &spec("c1/eth0", "cali1", [10, 0, 0, 5]), 7);
    let slot = m.endpoint(7).expect("entry").slot;
    assert_eq!(
        m.slots.lock().expect("lock").get(&slot).map(|s| s.1),
        Some([STACK_MARKED, 0, 0])
    );
    e.end_initial_sync();
    attach(&mut e, &spec("c2/eth0", "cali2", [10, 0, 0, 5]), 8);
    let slot = m.endpoint(8).expect("entry").slot;
    assert_eq!(
        m.slots.lock().expect("lock").get(&slot).map(|s| s.1),
        Some([0, 0, 0])
    );
}
