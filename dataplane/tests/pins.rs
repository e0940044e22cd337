//! Pinned maps that do not match the object: the agent's dataplane still loads, carries the
//! conntrack and stack-flow entries into maps of this build's layout, and recreates what it
//! cannot convert. Needs root (bpffs, BPF maps and programs).
mod common;

use std::net::Ipv4Addr;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, MapInfo};
use calix_common::{
    layout, CtEntry, CtKey, EndpointInfo, FlowKey, PolicyFlow, PolicyFlowKeyV4, PolicyKey,
    StackFlow, BPF_MAP_TYPE_HASH, COUNTERS_MAP, CT_DIR_OUT, CT_DIR_REPLY, CT_F_ACK, CT_F_SEEN,
    CT_MAP, ENDPOINTS_MAP, IPPROTO_TCP, LAYOUT_VERSION, NAT_CONFIG_MAP, PF_TO_POD,
    POLICY_FLOWS_MAP, POLICY_FLOWS_V4_MAP, POLICY_KEY_BITS, POLICY_MAP, POL_DIR_INGRESS,
    STACK_CLEARED_MAP, STACK_EPS_MAP, STACK_FLOWS_MAP, STACK_MARKED, STACK_OVERFLOW_MAP,
};
use calix_dataplane::ebpf::{EbpfConfig, EbpfDataplane};
use calix_dataplane::nat::NatSettings;
use calix_dataplane::pins::{CtEntryV1, MapSpec};
use calix_dataplane::{Dataplane, EndpointSpec};
use common::*;

/// Both entries of a translated TCP flow, as layout 1 wrote them: pod 10.244.0.10:40000 →
/// 198.51.100.7:443 via 192.0.2.1:20007, answered.
fn v1_flow() -> [(CtKey, CtEntryV1); 2] {
    let out = CtKey {
        src: [10, 244, 0, 10],
        dst: [198, 51, 100, 7],
        sport: 40000u16.to_be(),
        dport: 443u16.to_be(),
        proto: IPPROTO_TCP,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    };
    let reply = CtKey {
        src: out.dst,
        dst: [192, 0, 2, 1],
        sport: out.dport,
        dport: 20007u16.to_be(),
        proto: IPPROTO_TCP,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    let entry = |addr, port| CtEntryV1 {
        last_seen_ns: 5,
        addr,
        port,
        flags: CT_F_SEEN,
        route_ifindex: 9,
        ..CtEntryV1::default()
    };
    [
        (out, entry(reply.dst, reply.dport)),
        (reply, entry(out.src, out.sport)),
    ]
}

fn hash<K: aya::Pod, V: aya::Pod>(data: MapData) -> HashMap<MapData, K, V> {
    HashMap::try_from(Map::HashMap(data)).expect("a hash map of these types")
}

/// This build's map `name` as the object defines it.
fn spec(name: &str) -> MapSpec {
    let l = layout(LAYOUT_VERSION).expect("this layout");
    MapSpec::from_layout(l.map(name).expect("a map of this layout"))
}

fn config(pins: &PinDir, node: &str, ct_entries: u32) -> EbpfConfig {
    let mut nat = NatSettings::example();
    nat.conntrack_entries = ct_entries;
    EbpfConfig {
        pin_root: pins.0.clone(),
        node: node.into(),
        uplinks: Vec::new(),
        object: None,
        xdp: None,
        nat: Some(nat),
        tc_attach: Default::default(),
        doors: Default::default(),
        policy: Default::default(),
        services_cgroup: None,
    }
}

/// The incident: `CtEntry` grew (16 → 40 → 56 bytes) while the pins stayed where they were.
/// Maps in this layout's own directory with another value size, type, size or flags: the
/// agent starts, carries the flows over (converted) and recreates the rest.
#[test]
fn mismatched_pins_are_migrated_or_recreated() {
    in_netns(|| {
        let pins = PinDir::new();
        let cfg = config(&pins, "n1", 1024);
        let dir = cfg.pin_dir();
        std::fs::create_dir_all(&dir).expect("layout dir");
        // The conntrack table with layout 1's 40-byte entries (and the default size, where
        // the config now says 1024).
        let v1 = layout(1).expect("layout 1");
        let old_ct = MapSpec::from_layout(v1.map(CT_MAP).expect("CT"));
        let mut ct =
            hash::<CtKey, CtEntryV1>(old_ct.create_pinned(&dir.join(CT_MAP)).expect("old CT"));
        for (k, v) in v1_flow() {
            ct.insert(k, v, 0).expect("a v1 entry");
        }
        // The stack flows as an LRU of 8-byte values.
        let old_flows = MapSpec::from_layout(v1.map(STACK_FLOWS_MAP).expect("flows"));
        let mut flows = HashMap::<MapData, FlowKey, u64>::try_from(Map::LruHashMap(
            old_flows
                .create_pinned(&dir.join(STACK_FLOWS_MAP))
                .expect("old flows"),
        ))
        .expect("an LRU hash");
        let flow = FlowKey {
            proto: IPPROTO_TCP,
            family: 4,
            pod_port: 8080u16.to_be(),
            ..FlowKey::default()
        };
        flows.insert(flow, 0, 0).expect("a v1 flow");
        // Counters with a wrong size, the NAT config with the old value size: recreated.
        let mut counters = spec(COUNTERS_MAP);
        counters.max_entries = 10;
        counters
            .create_pinned(&dir.join(COUNTERS_MAP))
            .expect("small counters");
        let mut nat_cfg = spec(NAT_CONFIG_MAP);
        nat_cfg.value_size = 80;
        nat_cfg
            .create_pinned(&dir.join(NAT_CONFIG_MAP))
            .expect("old NAT config");
        drop((ct, flows));

        let mut dp = match EbpfDataplane::load(cfg) {
            Ok(dp) => dp,
            Err(e) => panic!("the dataplane does not load on mismatched pins: {e:?}"),
        };
        let info = |name: &str| {
            MapSpec::of(
                name,
                &MapInfo::from_pin(dir.join(name)).expect("pinned map info"),
            )
        };
        let mut want_ct = spec(CT_MAP);
        want_ct.max_entries = 1024;
        for (name, want) in [
            (CT_MAP, want_ct),
            (STACK_FLOWS_MAP, spec(STACK_FLOWS_MAP)),
            (COUNTERS_MAP, spec(COUNTERS_MAP)),
            (NAT_CONFIG_MAP, spec(NAT_CONFIG_MAP)),
        ] {
            assert_eq!(
                info(name).differences(&want),
                Vec::<String>::new(),
                "{name}"
            );
        }
        let ct = hash::<CtKey, CtEntry>(MapData::from_pin(dir.join(CT_MAP)).expect("CT pin"));
        let [(okey, o), (rkey, r)] = v1_flow();
        let o2 = ct
            .get(&okey, 0)
            .expect("the flow's original entry carried over");
        let r2 = ct
            .get(&rkey, 0)
            .expect("the flow's reply entry carried over");
        assert_eq!((o2.addr, o2.port, o2.route_ifindex), (o.addr, o.port, 9));
        assert_eq!(o2.flags, CT_F_SEEN | CT_F_ACK, "answered: established");
        assert_eq!((r2.addr, r2.port, r2.flags), (r.addr, r.port, CT_F_SEEN));
        let flows = hash::<FlowKey, StackFlow>(
            MapData::from_pin(dir.join(STACK_FLOWS_MAP)).expect("flows pin"),
        );
        assert!(flows.get(&flow, 0).is_ok(), "the stack flow carried over");
        assert_eq!(info(STACK_FLOWS_MAP).map_type, BPF_MAP_TYPE_HASH);
        // A second start finds everything matching: nothing moves.
        dp.release();
        drop(dp);
        let cfg = config(&pins, "n1", 1024);
        let again = EbpfDataplane::load(cfg).expect("a start on matching pins");
        drop(again);
        let ct = hash::<CtKey, CtEntry>(MapData::from_pin(dir.join(CT_MAP)).expect("CT pin"));
        assert_eq!(ct.keys().count(), 2);
    });
}

/// `[policy] entries` and `flows` changed: at the next start the policy maps have the new
/// sizes and still hold what the old ones did, so the endpoints go on being policed as they
/// were until the agent has recomputed their policy (no window open, none closed). A map
/// smaller than its entries takes what fits: the dataplane still loads.
#[test]
fn resized_policy_maps_keep_their_entries() {
    in_netns(|| {
        let pins = PinDir::new();
        let cfg = config(&pins, "n4", 1024);
        let dir = cfg.pin_dir();
        let mut dp = EbpfDataplane::load(cfg).expect("the dataplane loads");
        dp.release();
        drop(dp);
        let trie = |dir: &std::path::Path| {
            LpmTrie::<MapData, PolicyKey, u32>::try_from(Map::LpmTrie(
                MapData::from_pin(dir.join(POLICY_MAP)).expect("policy pin"),
            ))
            .expect("an LPM trie")
        };
        let entries: Vec<(Key<PolicyKey>, u32)> = (0..3u32)
            .map(|slot| {
                let k =
                    PolicyKey::new(slot, POL_DIR_INGRESS, 7, IPPROTO_TCP, 8080u16.to_be_bytes());
                (Key::new(POLICY_KEY_BITS, k), slot + 1)
            })
            .collect();
        let mut t = trie(&dir);
        for (k, v) in &entries {
            t.insert(k, v, 0).expect("a policy entry");
        }
        let (flow, flow4) = (v6_flow(), v4_flow());
        let remembered = PolicyFlow {
            last_seen_ns: 5,
            generation: 3,
            flags: PF_TO_POD,
        };
        let mut flows = lru::<FlowKey>(&dir, POLICY_FLOWS_MAP);
        flows.insert(flow, remembered, 0).expect("a flow");
        let mut flows4 = lru::<PolicyFlowKeyV4>(&dir, POLICY_FLOWS_V4_MAP);
        flows4.insert(flow4, remembered, 0).expect("an IPv4 flow");
        drop((t, flows, flows4));

        let mut cfg = config(&pins, "n4", 1024);
        cfg.policy.entries = 64;
        cfg.policy.flows = 128;
        let mut dp = EbpfDataplane::load(cfg).expect("the dataplane loads with new policy sizes");
        let size = |name: &str| {
            MapInfo::from_pin(dir.join(name))
                .expect("pinned map info")
                .max_entries()
        };
        assert_eq!(
            (
                size(POLICY_MAP),
                size(POLICY_FLOWS_MAP),
                size(POLICY_FLOWS_V4_MAP)
            ),
            (64, 128, 128)
        );
        let t = trie(&dir);
        for (k, v) in &entries {
            assert_eq!(t.get(k, 0).ok(), Some(*v), "an allow entry carried over");
        }
        let flows = lru::<FlowKey>(&dir, POLICY_FLOWS_MAP);
        assert_eq!(
            flows.get(&flow, 0).ok(),
            Some(remembered),
            "the flow carried over"
        );
        let flows4 = lru::<PolicyFlowKeyV4>(&dir, POLICY_FLOWS_V4_MAP);
        assert_eq!(
            flows4.get(&flow4, 0).ok(),
            Some(remembered),
            "the IPv4 flow carried over"
        );
        dp.release();
        drop((dp, t, flows, flows4));

        // Smaller than what it holds: what fits is kept.
        let mut cfg = config(&pins, "n4", 1024);
        cfg.policy.entries = 2;
        let dp = EbpfDataplane::load(cfg).expect("the dataplane loads into a smaller policy map");
        assert_eq!(size(POLICY_MAP), 2);
        assert_eq!(trie(&dir).keys().filter(Result::is_ok).count(), 2);
        drop(dp);
    });
}

/// The policy flow table `name` pinned in `dir`.
fn lru<K: aya::Pod>(dir: &std::path::Path, name: &str) -> HashMap<MapData, K, PolicyFlow> {
    HashMap::try_from(Map::LruHashMap(
        MapData::from_pin(dir.join(name)).expect("a flow table's pin"),
    ))
    .expect("an LRU hash")
}

/// A remembered TCP flow of pod 10.244.0.10:8080 with 10.244.1.7:40000.
fn v4_flow() -> PolicyFlowKeyV4 {
    PolicyFlowKeyV4 {
        pod: [10, 244, 0, 10],
        peer: [10, 244, 1, 7],
        pod_port: 8080u16.to_be(),
        peer_port: 40000u16.to_be(),
        proto: IPPROTO_TCP,
        _pad: [0; 3],
    }
}

/// A remembered TCP flow of pod fd00::a:8080 with fd00::1:7:40000.
fn v6_flow() -> FlowKey {
    let mut f = FlowKey {
        proto: IPPROTO_TCP,
        family: 6,
        pod_port: 8080u16.to_be(),
        peer_port: 40000u16.to_be(),
        ..FlowKey::default()
    };
    f.pod = "fd00::a"
        .parse::<std::net::Ipv6Addr>()
        .expect("v6")
        .octets();
    f.peer = "fd00::1:7"
        .parse::<std::net::Ipv6Addr>()
        .expect("v6")
        .octets();
    f
}

/// An upgrade from the first builds of this layout, which kept IPv4 policy flows in
/// `CALIX_POL_FLOWS` with the IPv6 ones: the new `CALIX_POL_FLOWS_V4` starts with them (an
/// established flow's replies keep passing), including one the old programs add until they
/// are replaced, and they leave the IPv6 table at the reconcile.
#[test]
fn the_first_builds_ipv4_policy_flows_move_into_their_own_table() {
    in_netns(|| {
        let pins = PinDir::new();
        let dir = config(&pins, "n5", 1024).pin_dir();
        let mut dp = EbpfDataplane::load(config(&pins, "n5", 1024)).expect("the dataplane loads");
        dp.release();
        drop(dp);
        // The first builds had no IPv4 table.
        std::fs::remove_file(dir.join(POLICY_FLOWS_V4_MAP)).expect("unpin the IPv4 table");
        let remembered = PolicyFlow {
            last_seen_ns: 5,
            generation: 3,
            flags: PF_TO_POD,
        };
        let late = PolicyFlowKeyV4 {
            peer_port: 40001u16.to_be(),
            ..v4_flow()
        };
        let mut both = lru::<FlowKey>(&dir, POLICY_FLOWS_MAP);
        for f in [v4_flow().flow(), v6_flow()] {
            both.insert(f, remembered, 0).expect("a flow");
        }

        let mut dp = EbpfDataplane::load(config(&pins, "n5", 1024)).expect("the dataplane loads");
        let flows4 = lru::<PolicyFlowKeyV4>(&dir, POLICY_FLOWS_V4_MAP);
        assert_eq!(
            flows4.get(&v4_flow(), 0).ok(),
            Some(remembered),
            "the IPv4 flow is in its own table"
        );
        // The old programs (still attached until the reconcile) remember another one.
        both.insert(late.flow(), remembered, 0)
            .expect("a late flow");
        dp.reconcile(&[]).expect("reconcile");
        assert_eq!(
            flows4.get(&late, 0).ok(),
            Some(remembered),
            "the flow the old programs added meanwhile followed"
        );
        let left: Vec<FlowKey> = both.keys().filter_map(Result::ok).collect();
        assert_eq!(
            left,
            vec![v6_flow()],
            "the IPv6 table keeps the IPv6 flow only"
        );
        drop(dp);
    });
}

/// An upgrade across a layout change: the maps of layout 1's directory (`v1/`) are carried
/// into this layout's; the old directory goes once the agent has reconciled.
#[test]
fn an_older_layouts_flows_are_carried_into_this_one() {
    in_netns(|| {
        let pins = PinDir::new();
        let cfg = config(&pins, "n2", 4096);
        let v1_dir = cfg.node_dir().join("v1");
        std::fs::create_dir_all(&v1_dir).expect("v1 dir");
        let v1 = layout(1).expect("layout 1");
        for m in v1.maps {
            MapSpec::from_layout(m)
                .create_pinned(&v1_dir.join(m.name))
                .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        }
        let mut ct = hash::<CtKey, CtEntryV1>(MapData::from_pin(v1_dir.join(CT_MAP)).expect("pin"));
        for (k, v) in v1_flow() {
            ct.insert(k, v, 0).expect("a v1 entry");
        }
        let dir = cfg.pin_dir();
        let mut dp = EbpfDataplane::load(cfg).expect("the dataplane loads over layout 1");
        let ct = hash::<CtKey, CtEntry>(MapData::from_pin(dir.join(CT_MAP)).expect("CT pin"));
        let [(okey, _), (rkey, _)] = v1_flow();
        assert!(
            ct.get(&okey, 0).is_ok() && ct.get(&rkey, 0).is_ok(),
            "carried"
        );
        assert!(
            v1_dir.exists(),
            "the old programs may still use layout 1's maps"
        );
        dp.reconcile(&[]).expect("reconcile");
        assert!(!v1_dir.exists(), "layout 1's pins go after the reconcile");
    });
}

/// An upgrade from layout 2, whose stack-flow marks are keyed by ifindex, into this layout's
/// arrays keyed by slot: each endpoint inherits its mark when the agent gives it its slot (a
/// plain mark; an overflow mark, unless the old agent had cleared it; a mark for a stack flow
/// naming its address), and a mark the old programs add until they are replaced is written
/// at the reconcile. Without this, the replies of flows the host stack NATed before the
/// upgrade would take the fast path and skip the stack's reverse NAT.
#[test]
fn layout_2s_marks_follow_their_endpoints_into_their_slots() {
    in_netns(|| {
        let pins = PinDir::new();
        let cfg = config(&pins, "n3", 4096);
        let v2_dir = cfg.node_dir().join("v2");
        std::fs::create_dir_all(&v2_dir).expect("v2 dir");
        let v2 = layout(2).expect("layout 2");
        for m in v2.maps {
            MapSpec::from_layout(m)
                .create_pinned(&v2_dir.join(m.name))
                .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        }
        let names = ["cxtma", "cxtmb", "cxtmc", "cxtmd", "cxtme"];
        let idx: Vec<u32> = names.iter().map(|n| veth(n)).collect();
        let old = |name| hash::<u32, u32>(MapData::from_pin(v2_dir.join(name)).expect("pin"));
        let (mut marks, mut cleared) = (old(STACK_EPS_MAP), old(STACK_CLEARED_MAP));
        marks.insert(idx[0], 0, 0).expect("a plain mark");
        marks.insert(idx[1], 17, 0).expect("an overflow mark");
        marks.insert(idx[2], 20, 0).expect("an overflow mark");
        cleared
            .insert(idx[2], 20, 0)
            .expect("cleared by the old agent");
        // A flow the stack delivered to the pod behind cxtme (10.244.0.14).
        let mut flows = hash::<FlowKey, StackFlow>(
            MapData::from_pin(v2_dir.join(STACK_FLOWS_MAP)).expect("flows pin"),
        );
        let mut pod = [0u8; 16];
        pod[..4].copy_from_slice(&[10, 244, 0, 14]);
        let flow = FlowKey {
            pod,
            proto: IPPROTO_TCP,
            family: 4,
            ..FlowKey::default()
        };
        flows
            .insert(flow, StackFlow::default(), 0)
            .expect("a v2 flow");

        let dir = cfg.pin_dir();
        let mut dp = EbpfDataplane::load(cfg).expect("the dataplane loads over layout 2");
        for (i, (name, ifindex)) in names.iter().zip(&idx).enumerate() {
            let last = 10 + i as u8;
            let spec = EndpointSpec {
                key: format!("c{i}/eth0"),
                host_ifname: name.to_string(),
                host_ifindex: Some(*ifindex),
                ipv4: Some(Ipv4Addr::new(10, 244, 0, last)),
                ipv6: None,
                mac: Some([2, 0, 0, 0, 0, last]),
                pod: None,
            };
            dp.attach(&spec).expect("attach");
        }
        let endpoints =
            hash::<u32, EndpointInfo>(MapData::from_pin(dir.join(ENDPOINTS_MAP)).expect("pin"));
        let array = |name| {
            Array::<MapData, u32>::try_from(Map::Array(
                MapData::from_pin(dir.join(name)).expect("pin"),
            ))
            .expect("an array")
        };
        let (eps, ovf) = (array(STACK_EPS_MAP), array(STACK_OVERFLOW_MAP));
        let state = |ifindex: u32| {
            let slot = endpoints.get(&ifindex, 0).expect("registered").slot;
            (
                eps.get(&slot, 0).expect("mark"),
                ovf.get(&slot, 0).expect("overflow"),
            )
        };
        let m = STACK_MARKED;
        let got: Vec<(u32, u32)> = idx.iter().map(|i| state(*i)).collect();
        assert_eq!(got, [(m, 0), (m, 17), (m, 0), (0, 0), (m, 0)]);
        // The old programs mark cxtmd before they are replaced.
        marks.insert(idx[3], 30, 0).expect("a late overflow mark");
        let known: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        dp.reconcile(&known).expect("reconcile");
        assert_eq!(state(idx[3]), (m, 30));
        assert!(!v2_dir.exists(), "layout 2's pins go after the reconcile");
    });
}
