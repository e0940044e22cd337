use super::*;
use calix_common::CT_DIR_OUT;

const S: u64 = 1_000_000_000;

fn cfg() -> NatConfig {
    NatConfig {
        tcp_established_ns: 100 * S,
        tcp_syn_ns: 20 * S,
        tcp_closing_ns: 5 * S,
        udp_ns: 30 * S,
        icmp_ns: 10 * S,
        uplinks: [0; MAX_NAT_UPLINKS],
        port_min: 20000,
        port_max: 20100,
        enabled: 1,
        ct_budget: 0,
        tunnel_port: 0,
        _pad: 0,
    }
}

/// Both entries of a TCP flow pod 10.0.0.1:5000 → 192.0.2.9:80 via 192.0.2.1:20001.
fn tcp_flow(out_flags: u16, reply_flags: u16, out_t: u64, reply_t: u64) -> Vec<(CtKey, CtEntry)> {
    let (pod, dst, nat) = ([10, 0, 0, 1], [192, 0, 2, 9], [192, 0, 2, 1]);
    let (pp, dp, np) = (5000u16.to_be(), 80u16.to_be(), 20001u16.to_be());
    let okey = CtKey {
        src: pod,
        dst,
        sport: pp,
        dport: dp,
        proto: IPPROTO_TCP,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    };
    let rkey = CtKey {
        src: dst,
        dst: nat,
        sport: dp,
        dport: np,
        proto: IPPROTO_TCP,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    vec![
        (
            okey,
            CtEntry {
                last_seen_ns: out_t,
                addr: nat,
                port: np,
                flags: out_flags,
                ..CtEntry::default()
            },
        ),
        (
            rkey,
            CtEntry {
                last_seen_ns: reply_t,
                addr: pod,
                port: pp,
                flags: reply_flags,
                ..CtEntry::default()
            },
        ),
    ]
}

#[test]
fn tcp_timeouts_follow_the_flags() {
    let c = cfg();
    let est = CT_F_SEEN | CT_F_ACK;
    // Established (a reply, then the pod's ACK), idle 50 s: kept (100 s); SYN only, or
    // a reply the pod never acknowledged, idle 50 s: gone (20 s).
    assert!(expired(tcp_flow(est, CT_F_SEEN, 50 * S, 60 * S), &c, 110 * S, None).is_empty());
    for (out, reply) in [(CT_F_SEEN, 0), (CT_F_SEEN, CT_F_SEEN)] {
        let flow = tcp_flow(out, reply, 50 * S, 50 * S);
        assert_eq!(expired(flow, &c, 100 * S, None).len(), 2);
    }
    // FIN one way only: still established timing; both ways: closing (5 s).
    let fin = est | CT_F_FIN;
    let flow = tcp_flow(fin, CT_F_SEEN, 50 * S, 50 * S);
    assert!(expired(flow, &c, 60 * S, None).is_empty());
    let flow = tcp_flow(fin, CT_F_SEEN | CT_F_FIN, 50 * S, 50 * S);
    assert_eq!(expired(flow, &c, 60 * S, None).len(), 2);
    // RST either way closes.
    let rst = CT_F_SEEN | CT_F_RST;
    let flow = tcp_flow(est, rst, 50 * S, 50 * S);
    assert_eq!(expired(flow, &c, 56 * S, None).len(), 2);
    // The later of the two directions counts.
    let flow = tcp_flow(est, CT_F_SEEN, 0, 90 * S);
    assert!(expired(flow, &c, 150 * S, None).is_empty());
}

/// Under pressure, unanswered flows (and orphans) go after the pressure timeout; answered
/// ones keep their usual timeouts.
#[test]
fn under_pressure_unanswered_flows_expire_early() {
    let c = cfg();
    let est = CT_F_SEEN | CT_F_ACK;
    let p = Some(2 * S);
    let now = 53 * S;
    assert!(expired(tcp_flow(est, CT_F_SEEN, 50 * S, 50 * S), &c, now, p).is_empty());
    for (out, reply) in [(CT_F_SEEN, 0), (CT_F_SEEN, CT_F_SEEN)] {
        let flow = tcp_flow(out, reply, 50 * S, 50 * S);
        assert!(expired(flow.clone(), &c, now, None).is_empty());
        assert_eq!(expired(flow, &c, now, p).len(), 2);
    }
    let orphan = vec![tcp_flow(est, CT_F_SEEN, 50 * S, 50 * S)[0]];
    assert!(expired(orphan.clone(), &c, now, None).is_empty());
    assert_eq!(expired(orphan, &c, now, p).len(), 1);
}

#[test]
fn orphans_expire_and_views_read_back() {
    let c = cfg();
    let flow = tcp_flow(CT_F_SEEN | CT_F_ACK, CT_F_SEEN, 10 * S, 12 * S);
    let only_out = vec![flow[0]];
    assert!(expired(only_out.clone(), &c, 20 * S, None).is_empty());
    assert_eq!(expired(only_out, &c, 40 * S, None), vec![flow[0].0]);
    let (flows, orphans) = pair(flow);
    assert!(orphans.is_empty());
    let v = flows[0].view(&c, 15 * S);
    assert_eq!(
        (
            v.pod.as_str(),
            v.pod_port,
            v.dst.as_str(),
            v.dst_port,
            v.nat.as_str(),
            v.nat_port
        ),
        ("10.0.0.1", 5000, "192.0.2.9", 80, "192.0.2.1", 20001)
    );
    assert_eq!(
        (v.state.as_str(), v.idle_secs, v.expires_in_secs),
        ("established", 3, 97)
    );
    // Which side closed is in the state: a flow held half-closed is read at a glance.
    let states: Vec<String> = [
        (CT_F_FIN, 0),
        (0, CT_F_FIN),
        (CT_F_FIN, CT_F_FIN),
        (CT_F_FIN, CT_F_RST),
    ]
    .iter()
    .map(|&(o, r)| {
        let (flows, _) = pair(tcp_flow(
            CT_F_SEEN | CT_F_ACK | o,
            CT_F_SEEN | r,
            10 * S,
            12 * S,
        ));
        flows[0].view(&c, 15 * S).state
    })
    .collect();
    assert_eq!(states, ["fin_pod", "fin_peer", "fin_both", "reset"]);
    let f = FlowFilter {
        port: Some(20001),
        ..Default::default()
    };
    assert!(f.matches(&v, IPPROTO_TCP));
    let f = FlowFilter {
        proto: Some(IPPROTO_UDP),
        ..Default::default()
    };
    assert!(!f.matches(&v, IPPROTO_TCP));
}

#[test]
fn program_config_is_off_without_pools_or_uplinks() {
    let mut s = NatSettings {
        nat_pools: vec!["10.0.0.0/16".parse().expect("cidr")],
        no_snat: vec![],
        service: vec![],
        service_v6: vec![],
        conntrack_entries: 1024,
        ct_budget: 100,
        pressure_unanswered: Duration::from_secs(1),
        timeouts: Timeouts {
            tcp_established: Duration::from_secs(1),
            tcp_syn: Duration::from_secs(1),
            tcp_closing: Duration::from_secs(1),
            udp: Duration::from_secs(1),
            icmp: Duration::from_secs(1),
        },
        port_min: 1,
        port_max: 2,
        tunnel_port: 4789,
        cleaner_interval: Duration::from_secs(1),
    };
    assert_eq!(s.program_config(&[7]).enabled, 1);
    // The tunnel port, as in the packet; none when it is a NAT port.
    assert_eq!(s.program_config(&[7]).tunnel_port, 4789u16.to_be());
    let mut inside = s.clone();
    inside.tunnel_port = 2;
    assert_eq!(inside.program_config(&[7]).tunnel_port, 0);
    assert_eq!(s.program_config(&[7]).uplinks[0], 7);
    assert_eq!(s.program_config(&[]).enabled, 0);
    s.nat_pools.clear();
    assert_eq!(s.program_config(&[7]).enabled, 0);
    assert!(!s.translates(Ipv4Addr::new(10, 0, 0, 1)));
}
