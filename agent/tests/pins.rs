//! Pinned maps that do not match the object: the agent's dataplane still loads, carries the
//! conntrack and stack-flow entries into maps of this build's layout, and recreates what it
//! cannot convert. Needs root (bpffs, BPF maps and programs).
mod common;

use aya::maps::{HashMap, Map, MapData, MapInfo};
use calix_agent::config::AgentConfig;
use calix_agent::dataplane::ebpf::{EbpfConfig, EbpfDataplane};
use calix_agent::dataplane::pins::{CtEntryV1, MapSpec};
use calix_agent::dataplane::Dataplane;
use calix_common::{
    layout, CtEntry, CtKey, FlowKey, StackFlow, BPF_MAP_TYPE_HASH, COUNTERS_MAP, CT_DIR_OUT,
    CT_DIR_REPLY, CT_F_ACK, CT_F_SEEN, CT_MAP, IPPROTO_TCP, LAYOUT_VERSION, NAT_CONFIG_MAP,
    STACK_FLOWS_MAP,
};
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
    let mut agent = AgentConfig::default();
    agent.nat.conntrack_entries = ct_entries;
    EbpfConfig {
        pin_root: pins.0.clone(),
        node: node.into(),
        uplinks: Vec::new(),
        object: None,
        xdp: None,
        nat: Some(agent.nat_settings().expect("default [nat]")),
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

/// An upgrade across a layout change: the maps of layout 1's directory (`v1/`) are carried
/// into this layout's (`v2/`); the old directory goes once the agent has reconciled.
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
