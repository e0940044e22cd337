//! The layout of the shared types: their sizes, the published layouts, the reasons' values.
use super::*;
use core::mem::size_of;

/// The key and value size of every map of this build, from the shared types: what
/// [`LAYOUTS`] must say for [`LAYOUT_VERSION`].
fn sizes_of_this_build() -> [(&'static str, usize, usize); 48] {
    let lpm = |addr: usize| 4 + addr;
    [
        (
            STACK_FLOWS_MAP,
            size_of::<FlowKey>(),
            size_of::<StackFlow>(),
        ),
        (STACK_EPS_MAP, size_of::<u32>(), size_of::<u32>()),
        (STACK_OVERFLOW_MAP, size_of::<u32>(), size_of::<u32>()),
        (STACK_CLEARED_MAP, size_of::<u32>(), size_of::<u32>()),
        (
            COUNTERS_MAP,
            size_of::<u32>(),
            size_of::<EndpointCounters>(),
        ),
        (ENDPOINTS_MAP, size_of::<u32>(), size_of::<EndpointInfo>()),
        (
            ENDPOINTS_DIRECT_MAP,
            size_of::<u32>(),
            size_of::<DirectEndpoint>(),
        ),
        (LOCAL_V4_MAP, 4, size_of::<LocalEndpoint>()),
        (LOCAL_V6_MAP, 16, size_of::<LocalEndpoint>()),
        (DROPS_MAP, size_of::<DropKey>(), size_of::<DropCount>()),
        (POOLS_V4_MAP, lpm(4), size_of::<u32>()),
        (POOLS_V6_MAP, lpm(16), size_of::<u32>()),
        (DENY_V4_MAP, lpm(4), size_of::<u32>()),
        (DENY_V6_MAP, lpm(16), size_of::<u32>()),
        (FAILSAFE_MAP, size_of::<FailsafePort>(), size_of::<u32>()),
        (HOST_V4_MAP, 4, size_of::<u32>()),
        (HOST_V6_MAP, 16, size_of::<u32>()),
        (CT_MAP, size_of::<CtKey>(), size_of::<CtEntry>()),
        (CT_OWNED_MAP, size_of::<u32>(), size_of::<u32>()),
        (CT_FREED_MAP, size_of::<u32>(), size_of::<u32>()),
        (NAT_CONFIG_MAP, size_of::<u32>(), size_of::<NatConfig>()),
        (NO_SNAT_V4_MAP, lpm(4), size_of::<u32>()),
        (AGENT_PORTS_MAP, size_of::<u32>(), size_of::<AgentPorts>()),
        (PEERS_V4_MAP, 4, size_of::<u32>()),
        (PEERS_V6_MAP, 16, size_of::<u32>()),
        (POLICY_IDS_V4_MAP, lpm(4), size_of::<u32>()),
        (POLICY_IDS_V6_MAP, lpm(16), size_of::<u32>()),
        (POLICY_MAP, lpm(size_of::<PolicyKey>()), size_of::<u32>()),
        (POLICY_STATE_MAP, size_of::<u32>(), size_of::<PolicyState>()),
        (
            POLICY_FLOWS_MAP,
            size_of::<FlowKey>(),
            size_of::<PolicyFlow>(),
        ),
        (
            POLICY_FLOWS_V4_MAP,
            size_of::<PolicyFlowKeyV4>(),
            size_of::<PolicyFlow>(),
        ),
        (POLICY_PAIRS_MAP, size_of::<u32>(), size_of::<PolicyPair>()),
        (POLICY_SYNS_MAP, size_of::<u32>(), size_of::<PolicySyn>()),
        (
            POLICY_OPENERS_MAP,
            size_of::<u32>(),
            size_of::<PolicyOpeners>(),
        ),
        (
            POLICY_SCRATCH_MAP,
            size_of::<u32>(),
            size_of::<PolicyScratch>(),
        ),
        (POLICY_HITS_MAP, size_of::<PolicyHitKey>(), size_of::<u64>()),
        (POLICY_EVENTS_MAP, 0, 0),
        (
            POLICY_EVENT_BUDGET_MAP,
            size_of::<u32>(),
            size_of::<EventBudget>(),
        ),
        (
            SVC_FRONTENDS_MAP,
            size_of::<SvcKey>(),
            size_of::<SvcValue>(),
        ),
        (
            SVC_BACKENDS_MAP,
            size_of::<SvcBackendKey>(),
            size_of::<SvcBackend>(),
        ),
        (
            SVC_REV_MAP,
            size_of::<SvcRevKey>(),
            size_of::<SvcRevValue>(),
        ),
        (
            SVC_FWD_MAP,
            size_of::<SvcFwdKey>(),
            size_of::<SvcBackendKey>(),
        ),
        (
            SVC_AFFINITY_MAP,
            size_of::<SvcAffKey>(),
            size_of::<SvcAffValue>(),
        ),
        (SVC_NODES_MAP, size_of::<SvcNodeKey>(), size_of::<u32>()),
        (
            SVC_COUNTERS_MAP,
            size_of::<SvcKey>(),
            size_of::<SvcCounters>(),
        ),
        (SVC_FLOWS_MAP, size_of::<SvcFlowKey>(), size_of::<SvcFlow>()),
        (SVC_SCRATCH_MAP, size_of::<u32>(), size_of::<SvcScratch>()),
        (SVC_MAGLEV_MAP, size_of::<u32>(), size_of::<SvcMaglev>()),
    ]
}

/// A shared type that changes size without a new [`LAYOUT_VERSION`] (and a new row in
/// [`LAYOUTS`]) fails here: pinned maps of the old size would be reused as they are.
#[test]
fn the_layout_version_names_these_sizes() {
    let current = layout(LAYOUT_VERSION).expect("a row for LAYOUT_VERSION in LAYOUTS");
    let sizes = sizes_of_this_build();
    assert_eq!(current.maps.len(), sizes.len(), "every map has a row");
    for (name, key, value) in sizes {
        let row = current
            .map(name)
            .unwrap_or_else(|| panic!("{name} missing from layout {LAYOUT_VERSION}"));
        assert_eq!(
            (row.key_size as usize, row.value_size as usize),
            (key, value),
            "{name}: the types changed size; bump LAYOUT_VERSION and add a row to LAYOUTS"
        );
    }
    for name in ALL_MAPS {
        assert!(current.map(name).is_some(), "{name} in ALL_MAPS has no row");
    }
}

#[test]
fn layouts_are_append_only() {
    let versions: [u32; 4] = LAYOUTS.map(|l| l.version);
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    assert_eq!(
        versions.last(),
        Some(&LAYOUT_VERSION),
        "the newest is this build's"
    );
    for l in LAYOUTS {
        for (i, a) in l.maps.iter().enumerate() {
            assert!(
                l.maps[i + 1..].iter().all(|b| b.name != a.name),
                "layout {}: {} twice",
                l.version,
                a.name
            );
        }
    }
    // Layout 1 as it was published (the agent migrates from it).
    let v1 = layout(1).expect("layout 1");
    assert_eq!(v1.map(CT_MAP).map(|m| m.value_size), Some(40));
    assert_eq!(
        v1.map(STACK_FLOWS_MAP).map(|m| m.map_type),
        Some(BPF_MAP_TYPE_LRU_HASH)
    );
}

#[test]
fn layouts_have_no_padding() {
    assert_eq!(size_of::<EndpointCounters>(), 32);
    assert_eq!(size_of::<EndpointInfo>(), 32);
    assert_eq!(size_of::<DirectEndpoint>(), 40);
    assert_eq!(size_of::<LocalEndpoint>(), 16);
    assert_eq!(size_of::<DropKey>(), 8);
    assert_eq!(size_of::<DropCount>(), 16);
    assert_eq!(size_of::<FlowKey>(), 40);
    assert_eq!(size_of::<PolicyFlowKeyV4>(), 16);
    assert_eq!(size_of::<PolicyPair>(), 32);
    assert_eq!(size_of::<PolicySyn>(), 28);
    assert_eq!(size_of::<PolicyDropEvent>(), 64);
    assert_eq!(size_of::<SvcKey>(), 20);
    assert_eq!(size_of::<SvcValue>(), 16);
    assert_eq!(size_of::<SvcBackendKey>(), 8);
    assert_eq!(size_of::<SvcBackend>(), 20);
    assert_eq!(size_of::<SvcRevKey>(), 32);
    assert_eq!(size_of::<SvcRevValue>(), 20);
    assert_eq!(size_of::<SvcFwdKey>(), 32);
    assert_eq!(size_of::<EventBudget>(), 88);
    assert_eq!(size_of::<FailsafePort>(), 4);
    assert_eq!(size_of::<CtKey>(), 16);
    assert_eq!(size_of::<CtEntry>(), 64);
    assert_eq!(size_of::<NatConfig>(), 88);
    assert_eq!(size_of::<StackFlow>(), 16);
    assert_eq!(size_of::<AgentPorts>(), 16);
}

#[test]
fn the_gateway_link_local_is_the_eui64_of_the_host_veth_mac() {
    let want = [
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0xec, 0xee, 0xee, 0xff, 0xfe, 0xee, 0xee, 0xee,
    ];
    assert_eq!(HOST_VETH_LINK_LOCAL, want); // fe80::ecee:eeff:feee:eeee
}

#[test]
fn conntrack_keys_go_both_ways() {
    let out = CtKey {
        src: [10, 244, 0, 5],
        dst: [198, 51, 100, 7],
        sport: 40000u16.to_be(),
        dport: 443u16.to_be(),
        proto: IPPROTO_TCP,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    };
    let nat = ([192, 0, 2, 1], 20000u16.to_be());
    let r = out.reply(nat.0, nat.1);
    assert_eq!(
        (r.src, r.dst, r.sport, r.dport),
        (out.dst, nat.0, out.dport, nat.1)
    );
    assert_eq!(r.original(out.src, out.sport), out);
    // ICMP echo: the identifier is both "ports".
    let ping = CtKey { proto: 1, ..out };
    let r = ping.reply(nat.0, nat.1);
    assert_eq!((r.sport, r.dport), (nat.1, nat.1));
    assert_eq!(r.original(ping.src, ping.sport).dport, ping.sport);
}

#[test]
fn accumulate_adds_every_field() {
    let mut a = EndpointCounters {
        from_pod_packets: 1,
        from_pod_bytes: 2,
        to_pod_packets: 3,
        to_pod_bytes: 4,
    };
    a.accumulate(&a.clone());
    assert_eq!(
        a,
        EndpointCounters {
            from_pod_packets: 2,
            from_pod_bytes: 4,
            to_pod_packets: 6,
            to_pod_bytes: 8
        }
    );
}

#[test]
fn reasons_round_trip_and_have_distinct_names() {
    for r in DropReason::ALL {
        assert_eq!(DropReason::from_u32(r as u32), Some(r));
        assert_eq!(
            DropReason::ALL
                .iter()
                .filter(|o| o.name() == r.name())
                .count(),
            1
        );
    }
    assert_eq!(DropReason::from_u32(0), None);
    // Values are stable: they are keys in the pinned counters map.
    let values: [u32; 22] = DropReason::ALL.map(|r| r as u32);
    assert_eq!(
        values,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    );
}

#[test]
fn programs_are_the_tc_ones_then_the_xdp_ones_then_the_socket_ones() {
    let mut all = [""; 13];
    all[..4].copy_from_slice(&TC_PROGRAMS);
    all[4..5].copy_from_slice(&XDP_PROGRAMS);
    all[5..].copy_from_slice(&SVC_PROGRAMS);
    assert_eq!(all, ALL_PROGRAMS);
}

/// The scratch space's keys lie as their maps' keys: a prefix length, then the data.
#[test]
fn the_policy_scratch_keys_are_contiguous() {
    use core::mem::offset_of;
    assert_eq!(
        offset_of!(PolicyScratch, rule),
        offset_of!(PolicyScratch, rule_len) + 4
    );
    assert_eq!(
        offset_of!(PolicyScratch, addr),
        offset_of!(PolicyScratch, addr_len) + 4
    );
    assert_eq!(size_of::<PolicyKey>(), 12);
    assert_eq!(offset_of!(PolicyScratch, value) % 8, 0);
}

#[test]
fn a_pending_mark_carries_its_slot_and_no_other_mark_reads_as_one() {
    for slot in [0, 1, 4242, MAX_ENDPOINTS - 1] {
        let mark = policy_pending_mark(slot);
        assert_eq!(policy_pending_slot(mark), Some(slot));
        // kube-proxy ORs its masquerade bit in, and XORs it out again.
        assert_eq!(policy_pending_slot(mark | 0x4000), Some(slot));
        assert_eq!(mark & 0xc000, 0, "clear of kube-proxy's bits");
    }
    for other in [0, FAST_PATH_MARK, 0x4000, 0x8000, 0xc000_0000, 0x4000_0000] {
        assert_eq!(policy_pending_slot(other), None, "{other:#x}");
    }
}

/// The hash flows from outside pick their backend by is the one every build had (nodes of
/// two versions must agree): FNV-1a 32 of the address and the port's bytes, finalized.
#[test]
fn the_client_hash_is_fixed() {
    assert_eq!(svc_client_hash([192, 0, 2, 1], 0), 0xb56d_cdca);
    assert_eq!(
        svc_client_hash([192, 0, 2, 1], 1234u16.to_be()),
        svc_client_hash([192, 0, 2, 1], 1234u16.to_be())
    );
    let mut v6 = [0u8; 16];
    v6[..4].copy_from_slice(&[192, 0, 2, 1]);
    assert_ne!(svc_client_hash6(&v6, 0), svc_client_hash([192, 0, 2, 1], 0));
}

/// An IPv4 flow's 16-byte key stands for the same flow; an IPv6 flow has none.
#[test]
fn an_ipv4_flow_key_round_trips() {
    let mut flow = FlowKey {
        pod_port: 8080u16.to_be(),
        peer_port: 40000u16.to_be(),
        proto: IPPROTO_TCP,
        family: 4,
        ..FlowKey::default()
    };
    flow.pod[..4].copy_from_slice(&[10, 0, 0, 1]);
    flow.peer[..4].copy_from_slice(&[10, 0, 1, 2]);
    let key = PolicyFlowKeyV4::of(&flow).expect("an IPv4 flow");
    assert_eq!(
        (key.pod, key.peer, key.proto),
        ([10, 0, 0, 1], [10, 0, 1, 2], IPPROTO_TCP)
    );
    assert_eq!(key.flow(), flow);
    let v6 = FlowKey { family: 6, ..flow };
    assert_eq!(PolicyFlowKeyV4::of(&v6), None);
}
