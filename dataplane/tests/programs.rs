//! The eBPF programs run from userspace with BPF_PROG_TEST_RUN on crafted frames: the verdict,
//! the frame they leave and the counters they update. Needs root (CI runs it as root). Each
//! test runs on a thread of its own in a fresh network namespace with veths it creates (their
//! ifindexes are what the maps name) and pins the maps under a fresh
//! `/sys/fs/bpf/cxt-progtest-<pid>-<n>`; both go when the test ends, pass or fail.
//!
//! What test_run does with a tc program (net/bpf/test_run.c, `bpf_prog_test_run_skb`):
//! `skb->dev` is the caller's loopback unless the `__sk_buff` passed as `ctx_in` names an
//! `ifindex` > 1, which must exist in the caller's network namespace: that is how a program
//! sees a registered veth. (`convert___skb_to_skb` rejects any other non-zero context field
//! than mark, priority, ingress_ifindex, ifindex, cb, tstamp, wire_len, gso_* and hwtstamp.)
//! The redirect helpers only record their target and return TC_ACT_REDIRECT, for any ifindex:
//! the redirect itself happens in the tc hook (`skb_do_redirect`), which test_run never calls.
//! So REDIRECT means "the program chose to redirect", where to is checked through the rewritten
//! MACs and the counters, and delivery into the pod is left to the end-to-end tests. Recent
//! kernels (6.18 here) also refuse (EINVAL) frames whose IPv4 or IPv6 header is shorter than
//! its fixed size: see `Harness::drops_truncated_as`.
mod common;

use std::mem::size_of;
use std::os::fd::AsFd;
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData};
use aya::programs::{Program, SchedClassifier, Xdp};
use calix_common::{
    direct_bucket, eui64_link_local, AgentPorts, DirectEndpoint, DropReason, EndpointCounters,
    EndpointInfo, FlowKey, NatConfig, StackFlow, AGENT_PORTS_MAP, ALL_MAPS, ALL_PROGRAMS,
    EP_HAS_V4, EP_NAT_OUTGOING, HOST_V4_MAP, HOST_V6_MAP, HOST_VETH_MAC, MAX_ENDPOINTS,
    NAT_CONFIG_MAP, PEERS_V4_MAP, PEERS_V6_MAP, POOLS_V6_MAP, PROG_FROM_HOST_DEV, PROG_FROM_POD,
    PROG_TO_HOST_DEV, PROG_TO_POD, STACK_FLOWS_MAP, STACK_MARKED, TC_PROGRAMS, XDP_PROGRAMS,
};
use calix_dataplane::nat::monotonic_ns;
use calix_dataplane::stack_flows::{HostTimeouts, StackFlows};
use common::*;

#[path = "common/harness.rs"]
mod harness;
use harness::*;

// ---- Tests ----

#[test]
fn every_program_passes_the_verifier() {
    assert_root();
    let pins = PinDir::new();
    let bpf = load_object(&pins);
    for name in ALL_PROGRAMS {
        let prog = bpf.program(name).expect("a program of ALL_PROGRAMS");
        assert!(prog.fd().is_ok(), "{name} is loaded");
    }
    for name in TC_PROGRAMS {
        let prog = bpf.program(name).expect("a tc program");
        assert!(matches!(prog, Program::SchedClassifier(_)), "{name}: tc");
    }
    for name in XDP_PROGRAMS {
        let prog = bpf.program(name).expect("an XDP program");
        let _: &Xdp = prog.try_into().expect("an XDP program");
    }
    for name in ALL_MAPS {
        assert!(pins.0.join(name).exists(), "{name} pinned");
    }
}

#[test]
fn ipv4_to_a_local_pod_goes_straight_into_it() {
    in_netns(|| {
        let (h, a, b) = setup();
        let packets = [
            Ip4::new(a.v4, b.v4, TCP, tcp_syn(40000, 80)),
            Ip4::new(a.v4, b.v4, UDP, udp(40000, 53)),
            Ip4::new(a.v4, b.v4, ICMP, icmp(8, 7)),
        ];
        let mut bytes = 0;
        for ip in &packets {
            let sent = ip.sent_by(&a);
            bytes += sent.len() as u64;
            let out = h.run(PROG_FROM_POD, a.ifindex, &sent);
            assert_eq!(out.verdict, TC_ACT_REDIRECT, "protocol {}", ip.proto);
            let frame = out.frame;
            assert_eq!(frame[..6], b.mac, "destination MAC: the target pod's");
            assert_eq!(frame[6..12], HOST_VETH_MAC, "source MAC: the gateway's");
            assert_eq!(frame[14 + 8], 63, "TTL decremented");
            assert_eq!(ipv4_checksum(&frame[14..34]), 0, "header checksum right");
            assert_eq!(frame, ip.delivered_to(&b), "nothing else changed");
        }
        let n = packets.len() as u64;
        let zero = EndpointCounters::default();
        let a_counters = EndpointCounters {
            from_pod_packets: n,
            from_pod_bytes: bytes,
            ..zero
        };
        assert_eq!(h.counters(a.ifindex), a_counters);
        let b_counters = EndpointCounters {
            to_pod_packets: n,
            to_pod_bytes: bytes,
            ..zero
        };
        assert_eq!(h.counters(b.ifindex), b_counters);
        assert!(h.all_drops().is_empty());
    });
}

#[test]
fn ipv4_with_options_is_forwarded_and_keyed_on_the_ports_after_them() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        // IHL 7. Read at offset 20 instead, the "ports" would be 0x0101 and 0x0101.
        let mut ip = Ip4::new(a.v4, b.v4, TCP, tcp_syn(40000, 80));
        ip.options = vec![1, 1, 1, 1, 1, 1, 1, 0];
        let (sent, delivered) = (ip.sent_by(&a), ip.delivered_to(&b));
        h.redirects(PROG_FROM_POD, a.ifindex, &sent, &delivered);
        // Once the flow is the stack's (and A marked as having such flows, as `record`
        // does), this packet must find its key.
        let key = flow_v4(a.v4, b.v4, 40000, 80, TCP);
        h.flows
            .insert(key, StackFlow::default(), 0)
            .expect("insert a flow");
        h.stack_eps.set(a.slot, STACK_MARKED, 0).expect("mark A");
        h.passes(PROG_FROM_POD, a.ifindex, &sent);
    });
}

#[test]
fn ipv4_the_fast_path_cannot_take_goes_to_the_stack_unchanged() {
    in_netns(|| {
        let (h, a, b) = setup();
        let syn = Ip4::new(a.v4, b.v4, TCP, tcp_syn(40000, 80));
        let cases = [
            syn.clone().ttl(1),                     // would expire
            syn.clone().frag(0x2000),               // more fragments
            syn.clone().frag(0x0010),               // a fragment offset
            syn.clone().to([192, 0, 2, 1]),         // not a pod
            Ip4::new(a.v4, b.v4, ICMP, icmp(3, 0)), // an ICMP error
            Ip4::new(a.v4, b.v4, 47, vec![0; 8]),   // no ports (GRE)
        ];
        for ip in &cases {
            h.passes(PROG_FROM_POD, a.ifindex, &ip.sent_by(&a));
        }
        // A TCP packet whose IP payload is empty, padded to the Ethernet minimum with bytes
        // that look like ports: the ports must come from the payload, so no fast path.
        let mut padded = Ip4::new(a.v4, b.v4, TCP, Vec::new()).sent_by(&a);
        padded.extend_from_slice(&[0x9c, 0x40, 0x00, 0x50]);
        padded.resize(60, 0);
        h.passes(PROG_FROM_POD, a.ifindex, &padded);
        assert_eq!(
            h.counters(a.ifindex).from_pod_packets,
            cases.len() as u64 + 1
        );
        assert_eq!(h.counters(b.ifindex), EndpointCounters::default());
        assert!(h.all_drops().is_empty());
    });
}

#[test]
fn ipv4_spoofed_or_malformed_is_dropped_and_counted() {
    in_netns(|| {
        let (h, a, b) = setup();
        let spoofed = Ip4::new([10, 244, 0, 99], b.v4, TCP, tcp_syn(1, 2)).sent_by(&a);
        h.drops_as(a.ifindex, &spoofed, DropReason::SpoofedV4);

        let good = Ip4::new(a.v4, b.v4, TCP, tcp_syn(1, 2)).sent_by(&a);
        let tot = u16::try_from(good.len() - 14 + 1).expect("total length");
        let mut too_long = good.clone();
        too_long[16..18].copy_from_slice(&tot.to_be_bytes());
        let (ihl_4, version_6) = (with_byte(&good, 14, 0x44), with_byte(&good, 14, 0x65));
        for frame in [ihl_4, too_long, version_6] {
            h.drops_as(a.ifindex, &frame, DropReason::MalformedV4);
        }
        let truncated = &good[..14 + 10];
        let ran = h.drops_truncated_as(a.ifindex, truncated, DropReason::MalformedV4);

        assert_eq!(h.all_drops().len(), 2, "one counter per (ifindex, reason)");
        let sent = h.counters(a.ifindex).from_pod_packets;
        assert_eq!(sent, 4 + u64::from(ran), "drops count as sent");
        assert_eq!(h.counters(b.ifindex), EndpointCounters::default());
    });
}

#[test]
fn ipv6_from_a_pod() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let ip = |src| ip6(src, b.v6, UDP, &udp(1, 53));
        let from_a = |ip: &[u8]| eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, ip);
        let (sent, delivered) = (from_a(&ip(a.v6)), delivered_v6(&b, &ip(a.v6)));
        h.redirects(PROG_FROM_POD, a.ifindex, &sent, &delivered);
        assert_eq!(h.counters(b.ifindex).to_pod_packets, 1);

        // Neighbour discovery: link-local and unspecified sources are the stack's.
        let link_local = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10];
        let solicited = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0, 0, 11];
        for src in [link_local, [0; 16]] {
            let ns = ip6(src, solicited, ICMPV6, &icmp(135, 0));
            h.passes(PROG_FROM_POD, a.ifindex, &from_a(&ns));
        }

        h.drops_as(a.ifindex, &from_a(&ip(v6(99))), DropReason::SpoofedV6);
        let mut past_the_end = sent.clone();
        past_the_end[18..20].copy_from_slice(&100u16.to_be_bytes());
        let version_4 = with_byte(&sent, 14, 0x40);
        for frame in [past_the_end, version_4] {
            h.drops_as(a.ifindex, &frame, DropReason::MalformedV6);
        }
        h.drops_truncated_as(a.ifindex, &sent[..14 + 20], DropReason::MalformedV6);

        // A pod without an IPv6 address sends none (but for neighbour discovery).
        let mut v4_only = h.endpoints.get(&a.ifindex, 0).expect("endpoint");
        v4_only.flags = EP_HAS_V4;
        h.set_endpoint(a.ifindex, v4_only);
        h.drops_as(a.ifindex, &sent, DropReason::FamilyNotAssigned);
    });
}

#[test]
fn arp_from_a_pod() {
    in_netns(|| {
        let (h, a, b) = setup();
        let request = |spa| eth([0xff; 6], a.mac, ETH_P_ARP, &arp(a.mac, spa, b.v4));
        h.passes(PROG_FROM_POD, a.ifindex, &request(a.v4));
        h.passes(PROG_FROM_POD, a.ifindex, &request([0; 4])); // a probe
        h.drops_as(a.ifindex, &request(b.v4), DropReason::SpoofedArp);
        let truncated = &request(a.v4)[..14 + 20];
        h.drops_as(a.ifindex, truncated, DropReason::MalformedArp);
        let not_ethernet = with_byte(&request(a.v4), 15, 6); // hardware type 6 (IEEE 802)
        h.drops_as(a.ifindex, &not_ethernet, DropReason::MalformedArp);
        assert_eq!(h.all_drops().len(), 2);
    });
}

#[test]
fn a_pod_sends_nothing_but_ipv4_ipv6_and_arp() {
    in_netns(|| {
        let (h, a, b) = setup();
        let lldp_dst = [0x01, 0x80, 0xc2, 0, 0, 0x0e];
        let lldp = eth(lldp_dst, a.mac, ETH_P_LLDP, &[2, 7, 4, 0, 0, 0]);
        let own = Ip4::new(a.v4, b.v4, UDP, udp(1, 53)).bytes();
        for frame in [
            lldp,
            eth(HOST_VETH_MAC, a.mac, ETH_P_LOCAL_EXP, &own),
            eth(HOST_VETH_MAC, a.mac, 0x8137, &own), // IPX
            eth(HOST_VETH_MAC, a.mac, 0x0842, &own), // Wake-on-LAN
            eth(HOST_VETH_MAC, a.mac, 0x9100, &own), // pre-802.1ad QinQ
            eth(HOST_VETH_MAC, a.mac, 0x0040, &own), // an 802.3 length, not a type
        ] {
            h.drops_as(a.ifindex, &frame, DropReason::EtherTypeNotAllowed);
        }
        assert_eq!(h.all_drops().len(), 1, "one counter: {:?}", h.all_drops());
    });
}

#[test]
fn unknown_interfaces_are_not_judged() {
    in_netns(|| {
        let (h, a, b) = setup();
        // An interface the agent has not registered: not ours to judge (fail open).
        let unknown = veth("cxtpx");
        let spoofed = Ip4::new([10, 244, 0, 99], b.v4, TCP, tcp_syn(1, 2)).sent_by(&a);
        let arp = eth([0xff; 6], a.mac, ETH_P_ARP, &arp(a.mac, b.v4, b.v4));
        let lldp = eth(
            [1, 0x80, 0xc2, 0, 0, 0x0e],
            a.mac,
            ETH_P_LLDP,
            &[2, 7, 4, 0],
        );
        let tagged = vlan_tagged(&spoofed, ETH_P_8021Q, 5);
        for sent in [
            spoofed.clone(),
            with_byte(&spoofed, 14, 0x44),
            arp,
            lldp,
            tagged,
        ] {
            h.passes(PROG_FROM_POD, unknown, &sent);
        }
        assert!(h.all_drops().is_empty(), "no drop counted");
        let counted = h
            .all_counters()
            .into_iter()
            .any(|c| c != EndpointCounters::default());
        assert!(!counted, "nothing counted");
    });
}

/// The programs find an endpoint in its direct-mapped bucket when the bucket holds it, and in
/// the endpoint table otherwise: a bucket that holds another interface (one whose ifindex
/// shares it) is never taken for this one's, and a free bucket falls back to the table.
#[test]
fn an_endpoint_is_found_in_its_bucket_or_else_in_the_table() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let ip = Ip4::new(b.v4, a.v4, UDP, udp(1, 53));
        let spoofed = Ip4::new([10, 244, 0, 99], a.v4, UDP, udp(1, 53)).sent_by(&b);
        // B's bucket holds another interface, allowed to send from 10.244.0.99.
        let other = DirectEndpoint {
            ifindex: b.ifindex + MAX_ENDPOINTS,
            _pad: 0,
            info: EndpointInfo {
                ipv4: [10, 244, 0, 99],
                flags: EP_HAS_V4,
                slot: a.slot,
                ..EndpointInfo::default()
            },
        };
        h.direct
            .set(direct_bucket(b.ifindex), other, 0)
            .expect("bucket");
        h.redirects(
            PROG_FROM_POD,
            b.ifindex,
            &ip.sent_by(&b),
            &ip.delivered_to(&a),
        );
        h.drops_as(b.ifindex, &spoofed, DropReason::SpoofedV4);
        assert_eq!(h.counters(b.ifindex).from_pod_packets, 2, "B's own slot");
        // A free bucket: the table.
        h.direct
            .set(direct_bucket(b.ifindex), DirectEndpoint::default(), 0)
            .expect("bucket");
        h.drops_as(b.ifindex, &spoofed, DropReason::SpoofedV4);
        // The bucket alone (the table lost B): still B's addresses.
        h.register(&b);
        h.endpoints
            .remove(&b.ifindex)
            .expect("remove from the table");
        h.drops_as(b.ifindex, &spoofed, DropReason::SpoofedV4);
        h.redirects(
            PROG_FROM_POD,
            b.ifindex,
            &ip.sent_by(&b),
            &ip.delivered_to(&a),
        );
    });
}

#[test]
fn replies_of_flows_the_stack_delivered_go_back_through_it() {
    in_netns(|| {
        let (h, a, b) = setup();
        let to_a = |ethertype, ip: &[u8]| eth(a.mac, HOST_VETH_MAC, ethertype, ip);
        let from_a = |ip: &[u8]| eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, ip);
        // B reaches A through the host stack (a hostPort, a service: NATed on the way in).
        let syn = Ip4::new(b.v4, a.v4, TCP, tcp_syn(40000, 8080)).bytes();
        let syn = to_a(ETH_P_IP, &syn);
        h.passes(PROG_TO_POD, a.ifindex, &syn);
        assert_eq!(h.counters(a.ifindex).to_pod_packets, 1);
        assert_eq!(h.counters(a.ifindex).to_pod_bytes, syn.len() as u64);
        let keys: Vec<FlowKey> = h.flows.keys().map(|k| k.expect("flow key")).collect();
        assert_eq!(keys, [flow_v4(a.v4, b.v4, 8080, 40000, TCP)]);
        assert!(h.marked(&a), "A marked as having a flow through the stack");
        assert!(!h.marked(&b));

        // What the node itself sends (no input interface) is not recorded: its replies go to
        // the node, never the fast path.
        let probe = Ip4::new([10, 244, 0, 1], b.v4, TCP, tcp_syn(41000, 8080)).bytes();
        let probe = eth(b.mac, HOST_VETH_MAC, ETH_P_IP, &probe);
        let p = h.bpf.program(PROG_TO_POD).expect("to_pod");
        let run = test_run_ctx(
            p.try_into().expect("a tc classifier"),
            b.ifindex,
            &probe,
            0,
            0,
        )
        .expect("BPF_PROG_TEST_RUN of to_pod");
        assert_eq!(run.verdict, TC_ACT_OK);
        assert_eq!(
            h.flows.keys().count(),
            1,
            "the node's own packet recorded no flow"
        );
        assert!(!h.marked(&b), "B not marked by the node's own packet");

        // A's reply goes back through the stack (which undoes its NAT)...
        let reply = Ip4::new(a.v4, b.v4, TCP, tcp_syn(8080, 40000));
        h.passes(PROG_FROM_POD, a.ifindex, &reply.sent_by(&a));
        // ...while other flows between the same pods take the fast path.
        let pong = |id| Ip4::new(a.v4, b.v4, ICMP, icmp(0, id));
        let others = [
            Ip4::new(a.v4, b.v4, TCP, tcp_syn(8081, 40000)),
            Ip4::new(a.v4, b.v4, TCP, tcp_syn(8080, 40001)),
            Ip4::new(a.v4, b.v4, UDP, udp(8080, 40000)),
            pong(78),
        ];
        for ip in &others {
            let (sent, delivered) = (ip.sent_by(&a), ip.delivered_to(&b));
            h.redirects(PROG_FROM_POD, a.ifindex, &sent, &delivered);
        }

        // ICMP echo: the identifier keys both directions.
        let ping = Ip4::new(b.v4, a.v4, ICMP, icmp(8, 77)).bytes();
        h.passes(PROG_TO_POD, a.ifindex, &to_a(ETH_P_IP, &ping));
        h.passes(PROG_FROM_POD, a.ifindex, &pong(77).sent_by(&a));

        // IPv6 alike.
        let query = ip6(b.v6, a.v6, UDP, &udp(5000, 53));
        h.passes(PROG_TO_POD, a.ifindex, &to_a(ETH_P_IPV6, &query));
        let answer = |sport| ip6(a.v6, b.v6, UDP, &udp(sport, 5000));
        h.passes(PROG_FROM_POD, a.ifindex, &from_a(&answer(53)));
        let (sent, delivered) = (from_a(&answer(54)), delivered_v6(&b, &answer(54)));
        h.redirects(PROG_FROM_POD, a.ifindex, &sent, &delivered);
    });
}

#[test]
fn from_host_dev_delivers_to_local_pods_only() {
    in_netns(|| {
        let (h, a, _b) = setup();
        let uplink = veth("cxtpu");
        let (uplink_mac, router_mac) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 0xfe]);
        let from_router = |ethertype, ip: &[u8]| eth(uplink_mac, router_mac, ethertype, ip);
        let ip = Ip4::new([10, 244, 1, 5], a.v4, TCP, tcp_syn(40000, 80));
        let sent = from_router(ETH_P_IP, &ip.bytes());
        h.redirects(PROG_FROM_HOST_DEV, uplink, &sent, &ip.delivered_to(&a));
        assert_eq!(h.counters(a.ifindex).to_pod_packets, 1);
        let ip6 = ip6(v6(99), a.v6, UDP, &udp(1, 53));
        let (sent6, delivered6) = (from_router(ETH_P_IPV6, &ip6), delivered_v6(&a, &ip6));
        h.redirects(PROG_FROM_HOST_DEV, uplink, &sent6, &delivered6);

        // Anything else is the stack's, malformed packets included: no drops on the uplink.
        let elsewhere = from_router(ETH_P_IP, &ip.clone().to([10, 244, 0, 99]).bytes());
        h.passes(PROG_FROM_HOST_DEV, uplink, &elsewhere);
        h.passes(PROG_FROM_HOST_DEV, uplink, &with_byte(&sent, 14, 0x44));
        assert!(h.all_drops().is_empty());
        // to_host_dev passes everything (so far).
        h.passes(PROG_TO_HOST_DEV, uplink, &sent);
    });
}

/// VXLAN over IPv6: UDP to the tunnel port (`NatConfig::tunnel_port`) at one of the node's own
/// addresses (`CALIX_HOST_V6`) is the kernel's VXLAN socket's, and `from_host_dev` passes it to
/// the stack before any pod or Service lookup. Shown with an address the agent never lists as
/// the node's (pod A's), so that the same packet is otherwise delivered: another port, TCP, a
/// header too short for UDP, or the address no longer listed, and it is a pod's again.
#[test]
fn vxlan_over_ipv6_to_the_nodes_address_is_left_to_the_stack() {
    in_netns(|| {
        const PORT: u16 = 4789;
        let (mut h, a, _b) = setup();
        let uplink = veth("cxtpu");
        let mut cfg: Array<MapData, NatConfig> = map(&mut h.bpf, NAT_CONFIG_MAP);
        let mut host6: HashMap<MapData, [u8; 16], u32> = map(&mut h.bpf, HOST_V6_MAP);
        let (uplink_mac, router_mac) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 0xfe]);
        let from_router = |ip: &[u8]| eth(uplink_mac, router_mac, ETH_P_IPV6, ip);
        let to_a = |next, seg: &[u8]| ip6(v6(99), a.v6, next, seg);
        let delivered = |ip: &[u8]| {
            h.redirects(
                PROG_FROM_HOST_DEV,
                uplink,
                &from_router(ip),
                &delivered_v6(&a, ip),
            )
        };
        let vxlan = to_a(UDP, &udp(40000, PORT));
        // Neither the port set nor the address listed; then the port only.
        delivered(&vxlan);
        let tunnel = NatConfig {
            tunnel_port: PORT.to_be(),
            ..NatConfig::default()
        };
        cfg.set(0, tunnel, 0).expect("NAT config");
        delivered(&vxlan);
        host6.insert(a.v6, 1, 0).expect("host address");
        h.passes(PROG_FROM_HOST_DEV, uplink, &from_router(&vxlan));
        delivered(&to_a(UDP, &udp(40000, PORT + 1)));
        delivered(&to_a(TCP, &tcp_syn(40000, PORT)));
        // A payload too short for a UDP header is not read as one.
        delivered(&to_a(UDP, &udp(40000, PORT)[..4]));
        host6.remove(&a.v6).expect("host address gone");
        delivered(&vxlan);
        assert!(h.all_drops().is_empty());
    });
}

#[test]
fn replies_of_flows_the_stack_routed_out_come_back_through_it() {
    in_netns(|| {
        let (h, a, _b) = setup();
        let uplink = veth("cxtpu");
        let (uplink_mac, router_mac) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 0xfe]);
        let out = |ip: &Ip4| eth(router_mac, uplink_mac, ETH_P_IP, &ip.bytes());
        let back = |ip: &Ip4| eth(uplink_mac, router_mac, ETH_P_IP, &ip.bytes());
        // Pod a's flow routed out by the host stack (e.g. to a service backend it DNATed to
        // another node): to_host_dev records it, and the reply goes back through the stack.
        let routed = Ip4::new(a.v4, [10, 244, 1, 5], TCP, tcp_syn(40000, 80));
        h.passes(PROG_TO_HOST_DEV, uplink, &out(&routed));
        let reply = Ip4::new([10, 244, 1, 5], a.v4, TCP, tcp_syn(80, 40000));
        h.passes(PROG_FROM_HOST_DEV, uplink, &back(&reply));
        // A packet from_pod sent through the FIB carries the fast-path mark: not recorded, so
        // its reply is delivered straight into the pod.
        let fast = Ip4::new(a.v4, [10, 244, 1, 6], TCP, tcp_syn(40001, 80));
        let run = h.run_marked(
            PROG_TO_HOST_DEV,
            uplink,
            &out(&fast),
            calix_common::FAST_PATH_MARK,
        );
        assert_eq!(run.verdict, TC_ACT_OK);
        let reply = Ip4::new([10, 244, 1, 6], a.v4, TCP, tcp_syn(80, 40001));
        h.redirects(
            PROG_FROM_HOST_DEV,
            uplink,
            &back(&reply),
            &reply.delivered_to(&a),
        );
        // Traffic from an address that is not a local pod is not recorded either.
        let foreign = Ip4::new([10, 244, 1, 7], [10, 244, 1, 5], TCP, tcp_syn(40002, 80));
        h.passes(PROG_TO_HOST_DEV, uplink, &out(&foreign));
    });
}

#[test]
fn pool_traffic_for_other_nodes_leaves_through_the_fib() {
    in_netns(|| {
        let (mut h, a, _b) = setup();
        veth("cxtpu");
        ip(&["link", "set", "cxtpu", "address", "02:00:00:00:00:01", "up"]);
        ip(&["link", "set", "cxtpup", "up"]);
        ip(&["addr", "add", "192.168.77.1/24", "dev", "cxtpu"]);
        let gw_mac = "02:00:00:00:00:fe";
        ip(&[
            "neigh",
            "add",
            "192.168.77.2",
            "lladdr",
            gw_mac,
            "dev",
            "cxtpu",
        ]);
        ip(&["route", "add", "10.244.1.0/24", "via", "192.168.77.2"]);
        ip(&["route", "add", "10.244.2.0/24", "via", "192.168.77.3"]); // no neighbour entry
        ip(&["route", "add", "198.51.100.0/24", "via", "192.168.77.2"]);
        // bpf_fib_lookup wants forwarding on; /proc/sys/net is this thread's namespace's.
        std::fs::write("/proc/sys/net/ipv4/conf/all/forwarding", "1").expect("forwarding");
        let pool = Key::new(16, [10, 244, 0, 0]);
        h.pools_v4.insert(&pool, 1, 0).expect("insert a pool");

        // Next hop known: MACs from the FIB (the gateway's, the uplink's), TTL one less.
        let ip = Ip4::new(a.v4, [10, 244, 1, 5], TCP, tcp_syn(40000, 80));
        let routed = ip.clone().ttl(63).bytes();
        let routed = eth([2, 0, 0, 0, 0, 0xfe], [2, 0, 0, 0, 0, 1], ETH_P_IP, &routed);
        h.redirects(PROG_FROM_POD, a.ifindex, &ip.sent_by(&a), &routed);
        // Next hop unresolved: bpf_redirect_neigh resolves it (and sets the MACs) later.
        let ip = ip.to([10, 244, 2, 5]);
        let routed = ip.clone().ttl(63).sent_by(&a);
        h.redirects(PROG_FROM_POD, a.ifindex, &ip.sent_by(&a), &routed);
        // A pool address without a route, and a routed address outside the pools: the stack's.
        for dst in [[10, 244, 9, 9], [198, 51, 100, 1]] {
            h.passes(PROG_FROM_POD, a.ifindex, &ip.clone().to(dst).sent_by(&a));
        }
    });
}

/// `__sk_buff` up to `gso_size` (`u32` words; 64-bit fields count as two): `gso_segs` and
/// `gso_size` make the test skb a GSO packet, as TCP from a pod usually is (one frame of many
/// MSS-sized segments, cut at the egress device or by its hardware).
type SkBuffGso = [u32; 45];
const SKB_GSO_SEGS: usize = 41;
const SKB_GSO_SIZE: usize = 44;

/// Runs `prog` on `frame` as a GSO packet of `segs` segments of `size` bytes, on `ifindex`.
fn test_run_gso(h: &Harness, prog: &str, ifindex: u32, frame: &[u8], segs: u32, size: u32) -> Run {
    let p: &SchedClassifier = h
        .bpf
        .program(prog)
        .expect("a program of ALL_PROGRAMS")
        .try_into()
        .expect("a tc classifier");
    let mut ctx: SkBuffGso = [0; 45];
    ctx[SKB_IFINDEX] = ifindex;
    ctx[SKB_INGRESS_IFINDEX] = FORWARDED_FROM;
    ctx[SKB_GSO_SEGS] = segs;
    ctx[SKB_GSO_SIZE] = size;
    const _: () = assert!(size_of::<SkBuffGso>() == 180);
    let fd = p.fd().expect("program fd");
    common::test_run(fd.as_fd(), frame, &ctx).expect("BPF_PROG_TEST_RUN")
}

/// The uplink `cxtpu` (up, MAC 02:..:01, 192.168.77.1/24 and fd77::1/64) with the next hop
/// 192.168.77.2 / fd77::2 known at 02:..:fe, forwarding on, and the pools in the maps.
fn uplink_with_a_neighbour(h: &mut Harness) -> u32 {
    let uplink = veth("cxtpu");
    ip(&["link", "set", "cxtpu", "address", "02:00:00:00:00:01", "up"]);
    ip(&["link", "set", "cxtpup", "up"]);
    ip(&["addr", "add", "192.168.77.1/24", "dev", "cxtpu"]);
    ip(&["addr", "add", "fd77::1/64", "dev", "cxtpu", "nodad"]);
    for (gw, mac) in [
        ("192.168.77.2", "02:00:00:00:00:fe"),
        ("fd77::2", "02:00:00:00:00:fe"),
    ] {
        ip(&["neigh", "add", gw, "lladdr", mac, "dev", "cxtpu"]);
    }
    // bpf_fib_lookup wants forwarding on; /proc/sys/net is this thread's namespace's.
    std::fs::write("/proc/sys/net/ipv4/conf/all/forwarding", "1").expect("forwarding");
    std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").expect("forwarding");
    h.pools_v4
        .insert(&Key::new(16, [10, 244, 0, 0]), 1, 0)
        .expect("insert a pool");
    let mut pools_v6: LpmTrie<MapData, [u8; 16], u32> = map(&mut h.bpf, POOLS_V6_MAP);
    pools_v6
        .insert(&Key::new(32, v6(0)), 1, 0)
        .expect("insert a pool");
    uplink
}

#[test]
fn a_gso_packet_to_another_node_leaves_through_the_fib_whole() {
    in_netns(|| {
        let (mut h, a, _b) = setup();
        uplink_with_a_neighbour(&mut h);
        ip(&["route", "add", "10.244.1.0/24", "via", "192.168.77.2"]);
        ip(&["-6", "route", "add", "fd00:244:0:1::/64", "via", "fd77::2"]);
        // TCP from a pod to another node: 4 segments of 700 bytes in one frame, bigger than
        // the uplink's MTU as a whole. It leaves as it is (the uplink or its hardware cuts
        // it), never through the host stack.
        let mut payload = tcp_syn(40000, 80);
        payload.resize(20 + 2800, 0x5a);
        let ip4 = Ip4::new(a.v4, [10, 244, 1, 5], TCP, payload.clone());
        let routed = eth(
            [2, 0, 0, 0, 0, 0xfe],
            [2, 0, 0, 0, 0, 1],
            ETH_P_IP,
            &ip4.clone().ttl(63).bytes(),
        );
        let run = test_run_gso(&h, PROG_FROM_POD, a.ifindex, &ip4.sent_by(&a), 4, 700);
        assert_eq!(run.verdict, TC_ACT_REDIRECT, "IPv4: to the host stack");
        assert_eq!(run.frame, routed);
        let mut dst6 = v6(5);
        dst6[7] = 1;
        let p6 = ip6(a.v6, dst6, TCP, &payload);
        let mut routed6 = eth([2, 0, 0, 0, 0, 0xfe], [2, 0, 0, 0, 0, 1], ETH_P_IPV6, &p6);
        routed6[14 + 7] = 63;
        let sent6 = eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, &p6);
        let run = test_run_gso(&h, PROG_FROM_POD, a.ifindex, &sent6, 4, 700);
        assert_eq!(run.verdict, TC_ACT_REDIRECT, "IPv6: to the host stack");
        assert_eq!(run.frame, routed6);
        // One frame bigger than the MTU that is not GSO: the stack's (it answers "too big").
        let big = test_run_gso(&h, PROG_FROM_POD, a.ifindex, &ip4.sent_by(&a), 0, 0);
        assert_eq!(big.verdict, TC_ACT_OK);
    });
}

#[test]
fn pool_traffic_through_calix_vxlan_devices_is_redirected_to_them() {
    use calix_kernel::host::{HostKernel, NetlinkHost};
    use calix_kernel::node_route::NodeRoute;
    use calix_kernel::vxlan::{vtep_mac, FdbEntry, VxlanSpec, DEVICE_V4, DEVICE_V6};
    in_netns(|| {
        let (mut h, a, b) = setup();
        let uplink = uplink_with_a_neighbour(&mut h);
        // What the route reconciler programs for a peer on another subnet, with calix's own
        // kernel code.
        let mut k = NetlinkHost::new().expect("netlink");
        let mut tunnel = |name, local: &str, peer: &str, block: &str, mtu| {
            let (local, peer): (std::net::IpAddr, std::net::IpAddr) =
                (local.parse().expect("ip"), peer.parse().expect("ip"));
            let spec = VxlanSpec {
                name,
                vni: 4096,
                port: 4789,
                local,
                underlay: uplink,
                mtu,
            };
            let dev = k.create_vxlan(&spec).expect("create the device");
            k.add_fdb(dev, &FdbEntry::of_peer(peer)).expect("fdb");
            k.set_neighbour(dev, peer, vtep_mac(peer))
                .expect("neighbour");
            k.add_node_route(
                &NodeRoute {
                    dst: block.parse().expect("block"),
                    gateway: peer,
                    oif: dev,
                    onlink: true,
                },
                false,
            )
            .expect("route");
            (dev, spec.mac(), vtep_mac(peer))
        };
        let (dev4, mac4, peer4) = tunnel(
            DEVICE_V4,
            "192.168.77.1",
            "172.31.2.3",
            "10.244.2.0/26",
            1450,
        );
        let (dev6, mac6, peer6) =
            tunnel(DEVICE_V6, "fd77::1", "fd31:2::3", "fd00:244:0:2::/64", 1430);

        // Into the device, addressed to the peer's VTEP: the device encapsulates.
        let ip4 = Ip4::new(a.v4, [10, 244, 2, 5], TCP, tcp_syn(40000, 80));
        let routed = eth(peer4, mac4, ETH_P_IP, &ip4.clone().ttl(63).bytes());
        h.redirects(PROG_FROM_POD, a.ifindex, &ip4.sent_by(&a), &routed);
        let mut dst6 = v6(5);
        dst6[7] = 2;
        let p6 = ip6(a.v6, dst6, UDP, &udp(5000, 53));
        let mut routed6 = eth(peer6, mac6, ETH_P_IPV6, &p6);
        routed6[14 + 7] = 63;
        h.redirects(
            PROG_FROM_POD,
            a.ifindex,
            &eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, &p6),
            &routed6,
        );
        // A frame the device's MTU cannot carry (a pod with a bigger MTU than the tunnel's):
        // the host stack's, which answers "fragmentation needed".
        let mut payload = tcp_syn(40000, 80);
        payload.resize(1460, 0);
        let big = Ip4::new(a.v4, [10, 244, 2, 5], TCP, payload);
        h.passes(PROG_FROM_POD, a.ifindex, &big.sent_by(&a));

        // Decapsulated traffic for a local pod, on the device's ingress: straight into it.
        let from_peer = Ip4::new([10, 244, 2, 5], b.v4, TCP, tcp_syn(80, 40000));
        let arrived = eth(mac4, peer4, ETH_P_IP, &from_peer.bytes());
        h.redirects(
            PROG_FROM_HOST_DEV,
            dev4,
            &arrived,
            &from_peer.delivered_to(&b),
        );
        let back6 = ip6(dst6, b.v6, UDP, &udp(53, 5000));
        h.redirects(
            PROG_FROM_HOST_DEV,
            dev6,
            &eth(mac6, peer6, ETH_P_IPV6, &back6),
            &delivered_v6(&b, &back6),
        );
    });
}

// ---- A VLAN tag in the skb's metadata ----

/// `__sk_buff.vlan_present`'s index in [`SkBuffHead`] (`vlan_tci`, `vlan_proto` follow).
const SKB_VLAN_PRESENT: usize = 5;

/// `bpf(2)` commands and constants (include/uapi/linux/bpf.h).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_MAP_TYPE_PROG_ARRAY: u32 = 3;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PSEUDO_MAP_FD: u8 = 1;
const BPF_FUNC_TAIL_CALL: i32 = 12;
const BPF_FUNC_SKB_VLAN_PUSH: i32 = 18;
/// What the tagging program returns if its tail call into `from_pod` did not happen.
const TAIL_CALL_FAILED: u32 = 0x7a11;

/// Runs `bpf(cmd, attr)`; the new descriptor (or 0) on success.
fn bpf_cmd<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is the `union bpf_attr` member `cmd` reads, zero-padded to its full size
    // by the caller's type, and every pointer in it is valid until the call returns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

fn owned_fd(fd: libc::c_long) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let raw = i32::try_from(fd).expect("a descriptor");
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) }
}

/// One eBPF instruction (`struct bpf_insn`) as its 8 bytes, little-endian.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from(dst | (src << 4)) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

/// A classifier that tags the packet in the skb's metadata and tail-calls `from_pod`.
///
/// The kernel hands tc ingress a VLAN-tagged frame with its (outer) tag already moved into
/// the skb's metadata (`__netif_receive_skb_core` runs `skb_vlan_untag` before tc; seen on a
/// veth here: a tagged frame a pod writes arrives with `vlan_present` set and the inner
/// EtherType in the header). BPF_PROG_TEST_RUN cannot build such an skb: it never untags,
/// and `convert___skb_to_skb` refuses a context with any `vlan_*` field set (EINVAL, asserted
/// below). So the test runs this eleven-instruction program instead, which puts the tag into
/// the metadata with `bpf_skb_vlan_push` (on an untagged skb that only sets
/// `vlan_proto`/`vlan_tci`) and continues in `from_pod` through a tail call: `from_pod` then
/// sees exactly what the kernel gives it.
struct TagThenFromPod {
    prog: std::os::fd::OwnedFd,
    _array: std::os::fd::OwnedFd,
}

impl TagThenFromPod {
    fn load(from_pod: std::os::fd::BorrowedFd<'_>, tpid: u16, tci: u16) -> Self {
        use std::os::fd::AsRawFd;
        // `union bpf_attr` for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries.
        let mut create = [0u32; 32];
        create[..4].copy_from_slice(&[BPF_MAP_TYPE_PROG_ARRAY, 4, 4, 1]);
        let array = owned_fd(bpf_cmd(BPF_MAP_CREATE, &mut create).expect("a program array"));
        let (key, value) = (0u32, u32::try_from(from_pod.as_raw_fd()).expect("fd"));
        // BPF_MAP_UPDATE_ELEM: map_fd (u32, padded), key, value, flags.
        let mut update = [
            u64::try_from(array.as_raw_fd()).expect("fd"),
            &key as *const u32 as u64,
            &value as *const u32 as u64,
            0,
        ];
        bpf_cmd(BPF_MAP_UPDATE_ELEM, &mut update).expect("from_pod into the program array");
        let map_fd = array.as_raw_fd();
        let insns = [
            insn(0xbf, 6, 1, 0, 0),                       // r6 = r1 (the skb)
            insn(0xb7, 2, 0, 0, i32::from(tpid.to_be())), // r2 = htons(tpid)
            insn(0xb7, 3, 0, 0, i32::from(tci)),          // r3 = tci
            insn(0x85, 0, 0, 0, BPF_FUNC_SKB_VLAN_PUSH),  // bpf_skb_vlan_push(r1, r2, r3)
            insn(0xbf, 1, 6, 0, 0),                       // r1 = r6
            insn(0x18, 2, BPF_PSEUDO_MAP_FD, 0, map_fd),  // r2 = the program array
            insn(0, 0, 0, 0, 0),                          //   (upper half of the imm64)
            insn(0xb7, 3, 0, 0, 0),                       // r3 = 0 (from_pod's slot)
            insn(0x85, 0, 0, 0, BPF_FUNC_TAIL_CALL),      // bpf_tail_call(r1, r2, r3)
            insn(0xb7, 0, 0, 0, TAIL_CALL_FAILED as i32), // r0 = TAIL_CALL_FAILED
            insn(0x95, 0, 0, 0, 0),                       // exit
        ];
        let license = c"GPL";
        let mut log = vec![0u8; 64 * 1024];
        // BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level, log_size, log_buf,
        // then zeros (kern_version, prog_flags, prog_name...).
        #[repr(C)]
        struct ProgLoad {
            prog_type: u32,
            insn_cnt: u32,
            insns: u64,
            license: u64,
            log_level: u32,
            log_size: u32,
            log_buf: u64,
            rest: [u64; 16],
        }
        let mut load = ProgLoad {
            prog_type: BPF_PROG_TYPE_SCHED_CLS,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 1,
            log_size: log.len() as u32,
            log_buf: log.as_mut_ptr() as u64,
            rest: [0; 16],
        };
        let prog = bpf_cmd(BPF_PROG_LOAD, &mut load).unwrap_or_else(|e| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            panic!(
                "load the tagging program: {e}\n{}",
                String::from_utf8_lossy(&log[..end])
            )
        });
        Self {
            prog: owned_fd(prog),
            _array: array,
        }
    }

    /// Runs the program on `frame` as seen on interface `ifindex`.
    fn run(&self, ifindex: u32, frame: &[u8]) -> Run {
        let mut ctx: SkBuffHead = [0; 11];
        ctx[SKB_IFINDEX] = ifindex;
        ctx[SKB_INGRESS_IFINDEX] = FORWARDED_FROM;
        common::test_run(self.prog.as_fd(), frame, &ctx).expect("BPF_PROG_TEST_RUN")
    }
}

#[test]
fn vlan_tagged_frames_are_dropped_whether_the_tag_is_in_the_header_or_the_metadata() {
    in_netns(|| {
        let (h, a, b) = setup();
        let own = Ip4::new(a.v4, b.v4, UDP, udp(1, 53)).sent_by(&a);
        let own6 = eth(
            HOST_VETH_MAC,
            a.mac,
            ETH_P_IPV6,
            &ip6(a.v6, b.v6, UDP, &udp(1, 53)),
        );
        let arp_own = eth([0xff; 6], a.mac, ETH_P_ARP, &arp(a.mac, a.v4, b.v4));
        // The tag in the header: what BPF_PROG_TEST_RUN builds, and on a real veth the inner
        // tag of a double-tagged frame (the outer one is in the metadata then).
        for inner in [&own, &own6, &arp_own] {
            for (tpid, tci) in [(ETH_P_8021Q, 5), (ETH_P_8021AD, 5), (ETH_P_8021Q, 0)] {
                let tagged = vlan_tagged(inner, tpid, tci);
                h.drops_as(a.ifindex, &tagged, DropReason::VlanTagged);
            }
            let qinq = vlan_tagged(&vlan_tagged(inner, ETH_P_8021Q, 0), ETH_P_8021AD, 0);
            h.drops_as(a.ifindex, &qinq, DropReason::VlanTagged);
        }
        // The tag in the metadata: what tc ingress on a real veth sees.
        let prog: &SchedClassifier = h
            .bpf
            .program(PROG_FROM_POD)
            .expect("from_pod")
            .try_into()
            .expect("a tc classifier");
        let from_pod = prog.fd().expect("from_pod's fd");
        let mut ctx: SkBuffHead = [0; 11];
        ctx[SKB_IFINDEX] = a.ifindex;
        ctx[SKB_VLAN_PRESENT] = 1;
        let refused = common::test_run(from_pod.as_fd(), &own, &ctx).err();
        assert_eq!(
            refused.and_then(|e| e.raw_os_error()),
            Some(libc::EINVAL),
            "test_run took a context with vlan_present set: test that way instead"
        );
        let before = h.dropped(a.ifindex, DropReason::VlanTagged);
        for (tpid, tci) in [(ETH_P_8021Q, 5), (ETH_P_8021AD, 5), (ETH_P_8021Q, 0)] {
            let tagging = TagThenFromPod::load(from_pod.as_fd(), tpid, tci);
            for frame in [&own, &own6, &arp_own] {
                let run = tagging.run(a.ifindex, frame);
                assert_eq!(run.verdict, TC_ACT_SHOT, "tag {tpid:#x}/{tci}: verdict");
            }
        }
        let after = h.dropped(a.ifindex, DropReason::VlanTagged);
        assert_eq!(
            after.packets,
            before.packets + 9,
            "each counted as vlan_tagged"
        );
        // The same frames untagged are the pod's to send.
        h.redirects(
            PROG_FROM_POD,
            a.ifindex,
            &own,
            &Ip4::new(a.v4, b.v4, UDP, udp(1, 53)).delivered_to(&b),
        );
        h.passes(PROG_FROM_POD, a.ifindex, &arp_own);
        assert_eq!(h.all_drops().len(), 1, "{:?}", h.all_drops());
    });
}

// ---- IPv6 neighbour discovery ----

/// The host veth's link-local address: every pod's IPv6 gateway.
fn gateway_v6() -> [u8; 16] {
    eui64_link_local(HOST_VETH_MAC)
}

/// The solicited-node multicast address of `a` (ff02::1:ffXX:XXXX).
fn solicited(a: [u8; 16]) -> [u8; 16] {
    let mut m = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0, 0, 0];
    m[13..].copy_from_slice(&a[13..]);
    m
}

/// `inner` (protocol `next`) behind `n` destination-options headers.
fn behind_dstopts(n: usize, next: u8, inner: &[u8]) -> (u8, Vec<u8>) {
    let (mut next, mut payload) = (next, inner.to_vec());
    for _ in 0..n {
        payload = ext_header(next, &payload);
        next = IPV6_DSTOPTS;
    }
    (next, payload)
}

#[test]
fn link_local_and_unspecified_sources_may_only_do_neighbour_discovery() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let from_a = |ip: &[u8]| eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, ip);
        let (ll, any, gw) = (eui64_link_local(a.mac), [0u8; 16], gateway_v6());
        let all_routers = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        let mld2 = ext_header(ICMPV6, &mld2_report());
        // What a pod's kernel sends from them: router solicitations, neighbour solicitations
        // (duplicate address detection from ::), advertisements of its own addresses (from
        // the address advertised), MLD reports (behind a hop-by-hop header, from :: while
        // it has no link-local address yet).
        let kernel_sends = [
            ip6(ll, all_routers, ICMPV6, &icmp(ND_ROUTER_SOLICIT, 0)),
            ip6(any, all_routers, ICMPV6, &icmp(ND_ROUTER_SOLICIT, 0)),
            ip6(ll, solicited(gw), ICMPV6, &nd(ND_NEIGHBOR_SOLICIT, gw)),
            ip6(any, solicited(ll), ICMPV6, &nd(ND_NEIGHBOR_SOLICIT, ll)),
            ip6(ll, gw, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, ll)),
            ip6(ll, gw, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, a.v6)),
            ip6(ll, ALL_MLD2_ROUTERS, IPV6_HOPOPTS, &mld2),
            ip6(any, ALL_MLD2_ROUTERS, IPV6_HOPOPTS, &mld2),
            ip6(
                ll,
                ALL_NODES,
                IPV6_HOPOPTS,
                &ext_header(ICMPV6, &icmp(MLD_REPORT, 0)),
            ),
            ip6(
                ll,
                all_routers,
                IPV6_HOPOPTS,
                &ext_header(ICMPV6, &icmp(MLD_DONE, 0)),
            ),
        ];
        for ip in &kernel_sends {
            h.passes(PROG_FROM_POD, a.ifindex, &from_a(ip));
        }
        // Anything else from such a source: no link-local traffic but neighbour discovery.
        let (deep_next, deep) = behind_dstopts(9, ICMPV6, &nd(ND_NEIGHBOR_SOLICIT, gw));
        let not_nd = [
            ip6(ll, b.v6, UDP, &udp(1, 53)),
            ip6(ll, gw, TCP, &tcp_syn(40000, 22)),
            ip6(ll, gw, ICMPV6, &icmp(128, 1)), // echo request
            ip6(ll, ALL_NODES, ICMPV6, &icmp(134, 0)), // router advertisement
            ip6(ll, ALL_NODES, ICMPV6, &icmp(137, 0)), // redirect
            ip6(
                ll,
                ALL_NODES,
                IPV6_HOPOPTS,
                &ext_header(ICMPV6, &icmp(130, 0)),
            ), // MLD query
            ip6(any, b.v6, UDP, &udp(1, 53)),
            ip6(any, gw, ICMPV6, &icmp(128, 1)),
            // Neighbour discovery is never fragmented (RFC 6980).
            ip6(
                ll,
                gw,
                IPV6_FRAGMENT,
                &fragment_header(ICMPV6, 0, true, &nd(ND_NEIGHBOR_SOLICIT, gw)),
            ),
            ip6(ll, gw, ICMPV6, &[]),      // no ICMPv6 header
            ip6(ll, gw, deep_next, &deep), // more extension headers than the program follows
        ];
        for ip in &not_nd {
            h.drops_as(a.ifindex, &from_a(ip), DropReason::LinkLocalNotNd);
        }
        // An advertisement must name the address it comes from, or the pod's own.
        let foreign = [
            ip6(ll, ALL_NODES, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, b.v6)),
            ip6(
                ll,
                ALL_NODES,
                ICMPV6,
                &nd(ND_NEIGHBOR_ADVERT, eui64_link_local(b.mac)),
            ),
            ip6(ll, ALL_NODES, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, gw)),
            ip6(any, ALL_NODES, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, ll)),
            ip6(
                ll,
                ALL_NODES,
                IPV6_DSTOPTS,
                &ext_header(ICMPV6, &nd(ND_NEIGHBOR_ADVERT, b.v6)),
            ),
            ip6(ll, ALL_NODES, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, ll)[..8]), // target cut off
        ];
        for ip in &foreign {
            h.drops_as(a.ifindex, &from_a(ip), DropReason::SpoofedNdTarget);
        }
        // The gateway's link-local address is the host's, never a pod's.
        for ip in [
            ip6(gw, ALL_NODES, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, gw)),
            ip6(gw, solicited(ll), ICMPV6, &nd(ND_NEIGHBOR_SOLICIT, ll)),
        ] {
            h.drops_as(a.ifindex, &from_a(&ip), DropReason::SpoofedV6);
        }
        // A pod without an IPv6 address still resolves and advertises its link-local one,
        // and nothing else.
        let mut v4_only = h.endpoints.get(&a.ifindex, 0).expect("endpoint");
        v4_only.flags = EP_HAS_V4;
        h.set_endpoint(a.ifindex, v4_only);
        h.passes(PROG_FROM_POD, a.ifindex, &from_a(&kernel_sends[4]));
        h.passes(PROG_FROM_POD, a.ifindex, &from_a(&kernel_sends[6]));
        h.drops_as(
            a.ifindex,
            &from_a(&kernel_sends[5]),
            DropReason::SpoofedNdTarget,
        );
        let reasons: Vec<u32> = h.all_drops().iter().map(|(k, _)| k.reason).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
    });
}

#[test]
fn an_advertisement_from_the_pods_address_must_advertise_it() {
    in_netns(|| {
        let (h, a, b) = setup();
        let from_a = |ip: &[u8]| eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, ip);
        let gw = gateway_v6();
        h.passes(
            PROG_FROM_POD,
            a.ifindex,
            &from_a(&ip6(
                a.v6,
                solicited(b.v6),
                ICMPV6,
                &nd(ND_NEIGHBOR_SOLICIT, b.v6),
            )),
        );
        h.passes(
            PROG_FROM_POD,
            a.ifindex,
            &from_a(&ip6(a.v6, gw, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, a.v6))),
        );
        let na_b = nd(ND_NEIGHBOR_ADVERT, b.v6);
        let (two_next, two) = behind_dstopts(2, ICMPV6, &na_b);
        for ip in [
            ip6(a.v6, gw, ICMPV6, &na_b),
            ip6(
                a.v6,
                gw,
                ICMPV6,
                &nd(ND_NEIGHBOR_ADVERT, eui64_link_local(a.mac)),
            ),
            ip6(a.v6, gw, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, gw)),
            ip6(a.v6, gw, IPV6_HOPOPTS, &ext_header(ICMPV6, &na_b)),
            ip6(a.v6, gw, two_next, &two),
            ip6(
                a.v6,
                gw,
                IPV6_FRAGMENT,
                &fragment_header(ICMPV6, 0, true, &na_b),
            ),
            ip6(a.v6, gw, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, a.v6)[..8]), // target cut off
        ] {
            h.drops_as(a.ifindex, &from_a(&ip), DropReason::SpoofedNdTarget);
        }
        // A later fragment carries no ICMPv6 header: the first one decided.
        let later = fragment_header(ICMPV6, 1, false, &na_b);
        h.passes(
            PROG_FROM_POD,
            a.ifindex,
            &from_a(&ip6(a.v6, gw, IPV6_FRAGMENT, &later)),
        );
        // A chain longer than the program follows hides what it carries: malformed.
        let (deep_next, deep) = behind_dstopts(9, ICMPV6, &na_b);
        h.drops_as(
            a.ifindex,
            &from_a(&ip6(a.v6, gw, deep_next, &deep)),
            DropReason::MalformedV6,
        );
        // Traffic behind a few extension headers is the stack's, as before.
        let (next, udp_behind) = behind_dstopts(2, UDP, &udp(1, 53));
        h.passes(
            PROG_FROM_POD,
            a.ifindex,
            &from_a(&ip6(a.v6, b.v6, next, &udp_behind)),
        );
    });
}

/// The stack-flow table is full: a flow the stack delivers that cannot be recorded must not
/// let its replies (or any other packet of that pod the flow check covers) take the fast
/// path, which would skip the stack's reverse NAT. Nothing already recorded is evicted.
#[test]
fn a_full_stack_flow_table_fails_safe_to_the_stack() {
    in_netns(|| {
        let (h, a, b) = setup_sized(&[(STACK_FLOWS_MAP, 4)]);
        let to_a = |ip: &Ip4| eth(a.mac, HOST_VETH_MAC, ETH_P_IP, &ip.bytes());
        // B reaches A through the host stack on 8 flows: twice what the table holds.
        for i in 0..8u16 {
            let syn = Ip4::new(b.v4, a.v4, TCP, tcp_syn(40000 + i, 8080));
            h.passes(PROG_TO_POD, a.ifindex, &to_a(&syn));
        }
        assert_eq!(h.flows.keys().count(), 4, "the table is full");
        // Every reply goes back through the stack, recorded or not.
        for i in 0..8u16 {
            let reply = Ip4::new(a.v4, b.v4, TCP, tcp_syn(8080, 40000 + i));
            h.passes(PROG_FROM_POD, a.ifindex, &reply.sent_by(&a));
        }
        // So does any other flow of A the fast path would take: A's flows are unknown now.
        let other = Ip4::new(a.v4, b.v4, UDP, udp(5000, 53));
        h.passes(PROG_FROM_POD, a.ifindex, &other.sent_by(&a));
        // B is not affected.
        let ping = Ip4::new(b.v4, a.v4, ICMP, icmp(8, 9));
        h.redirects(
            PROG_FROM_POD,
            b.ifindex,
            &ping.sent_by(&b),
            &ping.delivered_to(&a),
        );

        // The agent's upkeep: while the host may still know a flow the table missed, A
        // stays on the stack path...
        let mut upkeep = StackFlows::open(&h.pins.0).expect("open the stack-flow maps");
        let host = HostTimeouts {
            tcp_established: Duration::from_secs(60),
            ..HostTimeouts::default()
        };
        let now = monotonic_ns();
        let pass = upkeep.clean(&host, now);
        assert_eq!(
            (pass.removed, pass.overflowing.clone()),
            (0, vec![a.ifindex])
        );
        h.passes(PROG_FROM_POD, a.ifindex, &other.sent_by(&a));
        // ...and once the host has forgotten every such flow, the entries go, the mark is
        // cleared (the programs keep any newer one) and A's other flows are fast again.
        let quiet = HostTimeouts {
            tcp_established: Duration::ZERO,
            tcp_closing: Duration::ZERO,
            udp: Duration::ZERO,
            icmp: Duration::ZERO,
            other: Duration::ZERO,
        };
        let later = now + 10_000_000_000;
        let pass = upkeep.clean(&quiet, later);
        assert_eq!((pass.removed, pass.cleared), (4, 1));
        assert!(pass.overflowing.is_empty());
        let (sent, delivered) = (other.sent_by(&a), other.delivered_to(&b));
        h.redirects(PROG_FROM_POD, a.ifindex, &sent, &delivered);
        // A flow the stack delivers now is recorded again, and its reply is the stack's.
        let syn = Ip4::new(b.v4, a.v4, TCP, tcp_syn(41000, 8080));
        h.passes(PROG_TO_POD, a.ifindex, &to_a(&syn));
        let reply = Ip4::new(a.v4, b.v4, TCP, tcp_syn(8080, 41000));
        h.passes(PROG_FROM_POD, a.ifindex, &reply.sent_by(&a));
    });
}

/// Issue 20: TCP from a pod to a calix agent's port (Routes, metrics) on a node's address —
/// this node's own (`CALIX_HOST_V4/V6`) or another node's (`CALIX_PEERS_V4/V6`) — is dropped
/// and counted as `agent_port`, SYN or not, whether it would go to the stack or be SNATed
/// out (natOutgoing: the other node would see its peer's address), IPv6 behind extension
/// headers too. The same ports elsewhere, the nodes' other ports, UDP to those ports, later
/// fragments (their first carries the header) and pods' own traffic on those ports pass;
/// so does everything once no port is guarded (the operator let pods in).
#[test]
fn a_pod_does_not_reach_the_agents_ports_on_any_node() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let (own4, peer4, elsewhere4) = ([172, 31, 1, 1], [172, 31, 2, 3], [192, 0, 2, 1]);
        let (own6, peer6) = ([0xfd, 0x31, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], {
            let mut p = [0u8; 16];
            p[..4].copy_from_slice(&[0xfd, 0x31, 0, 2]);
            p[15] = 3;
            p
        });
        let mut host4: HashMap<MapData, [u8; 4], u32> = map(&mut h.bpf, HOST_V4_MAP);
        let mut host6: HashMap<MapData, [u8; 16], u32> = map(&mut h.bpf, HOST_V6_MAP);
        let mut peers4: HashMap<MapData, [u8; 4], u32> = map(&mut h.bpf, PEERS_V4_MAP);
        let mut peers6: HashMap<MapData, [u8; 16], u32> = map(&mut h.bpf, PEERS_V6_MAP);
        let mut ports: Array<MapData, AgentPorts> = map(&mut h.bpf, AGENT_PORTS_MAP);
        host4.insert(own4, 1, 0).expect("host v4");
        host6.insert(own6, 1, 0).expect("host v6");
        peers4.insert(peer4, 1, 0).expect("peer v4");
        peers6.insert(peer6, 1, 0).expect("peer v6");
        let mut guarded = AgentPorts::default();
        guarded.tcp[0] = 5474u16.to_be();
        guarded.tcp[3] = 9091u16.to_be();
        ports.set(0, guarded, 0).expect("ports");
        let ack = |sport: u16, dport: u16| {
            let mut t = tcp_syn(sport, dport);
            t[13] = 0x10;
            t
        };
        let from_a = |ip: &[u8]| eth(HOST_VETH_MAC, a.mac, ETH_P_IPV6, ip);

        for dst in [own4, peer4] {
            for port in [5474, 9091] {
                let syn = Ip4::new(a.v4, dst, TCP, tcp_syn(40000, port));
                h.drops_as(a.ifindex, &syn.sent_by(&a), DropReason::AgentPort);
                let ack = Ip4::new(a.v4, dst, TCP, ack(40000, port));
                h.drops_as(a.ifindex, &ack.sent_by(&a), DropReason::AgentPort);
                // A first fragment carries the header: checked like a whole packet.
                let first = Ip4::new(a.v4, dst, TCP, tcp_syn(40000, port)).frag(0x2000);
                h.drops_as(a.ifindex, &first.sent_by(&a), DropReason::AgentPort);
            }
        }
        for dst in [own6, peer6] {
            for port in [5474, 9091] {
                let syn = ip6(a.v6, dst, TCP, &tcp_syn(40000, port));
                h.drops_as(a.ifindex, &from_a(&syn), DropReason::AgentPort);
                let (next, behind) = behind_dstopts(2, TCP, &tcp_syn(40000, port));
                let hidden = ip6(a.v6, dst, next, &behind);
                h.drops_as(a.ifindex, &from_a(&hidden), DropReason::AgentPort);
            }
        }
        // natOutgoing: dropped before it is translated.
        let mut nat = h.endpoints.get(&a.ifindex, 0).expect("endpoint");
        nat.flags |= EP_NAT_OUTGOING;
        h.set_endpoint(a.ifindex, nat);
        let syn = Ip4::new(a.v4, peer4, TCP, tcp_syn(40000, 5474));
        h.drops_as(a.ifindex, &syn.sent_by(&a), DropReason::AgentPort);
        nat.flags &= !EP_NAT_OUTGOING;
        h.set_endpoint(a.ifindex, nat);
        let drops = h.dropped(a.ifindex, DropReason::AgentPort).packets;
        assert_eq!(drops, 2 * 2 * 3 + 2 * 2 * 2 + 1);

        // What passes: the nodes' other ports, UDP, those ports elsewhere, a later fragment,
        // the node itself sending from those ports to a pod's... and pod to pod.
        let passing = [
            Ip4::new(a.v4, own4, TCP, tcp_syn(40000, 22)),
            Ip4::new(a.v4, peer4, TCP, tcp_syn(5474, 8080)),
            Ip4::new(a.v4, own4, UDP, udp(40000, 5474)),
            Ip4::new(a.v4, elsewhere4, TCP, tcp_syn(40000, 5474)),
            Ip4::new(a.v4, own4, TCP, tcp_syn(40000, 5474)).frag(0x0003),
        ];
        for ip in &passing {
            h.passes(PROG_FROM_POD, a.ifindex, &ip.sent_by(&a));
        }
        h.passes(
            PROG_FROM_POD,
            a.ifindex,
            &from_a(&ip6(a.v6, own6, TCP, &tcp_syn(40000, 443))),
        );
        h.passes(
            PROG_FROM_POD,
            a.ifindex,
            &from_a(&ip6(a.v6, own6, UDP, &udp(40000, 9091))),
        );
        let to_b = Ip4::new(a.v4, b.v4, TCP, tcp_syn(40000, 5474));
        h.redirects(
            PROG_FROM_POD,
            a.ifindex,
            &to_b.sent_by(&a),
            &to_b.delivered_to(&b),
        );
        // No port guarded (pods allowed in): nothing of it is dropped.
        ports.set(0, AgentPorts::default(), 0).expect("ports");
        let syn = Ip4::new(a.v4, own4, TCP, tcp_syn(40000, 5474));
        h.passes(PROG_FROM_POD, a.ifindex, &syn.sent_by(&a));
        assert_eq!(h.dropped(a.ifindex, DropReason::AgentPort).packets, drops);
    });
}
