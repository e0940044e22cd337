//! NetworkPolicy in the tc programs, run with BPF_PROG_TEST_RUN (see `programs.rs` for what
//! test_run does): the policy calculated by calix-core, compiled into tables, written into the
//! pinned maps by the dataplane's own programmer, and the verdicts the programs give on
//! crafted frames: ingress and egress, replies, a change that revokes a flow, protocols and
//! fragments, the stack's path and the node's own traffic, IPv6. Needs root.
mod common;

#[path = "common/harness.rs"]
mod harness;

#[path = "common/policed.rs"]
mod policed;

use calix_common::{
    DropReason, HOST_VETH_MAC, PROG_FROM_HOST_DEV, PROG_FROM_POD, PROG_TO_HOST_DEV, PROG_TO_POD,
};
use calix_core::policy::cluster::Change;
use calix_core::policy::model::{Namespaces, Peer, Policy, PolicyKey, Rule};
use calix_core::selector::LabelSelector;
use common::*;
use harness::*;
use policed::*;

#[test]
fn an_isolated_pod_takes_only_what_its_rules_allow_and_the_replies() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        // Nothing isolates B yet: everything passes.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        // B lets A in on TCP 80 only, and sends nothing it is not answering.
        p.apply(Change::Policy(policy(vec![tcp_port(80)], Some(vec![]))));
        let before = h.dropped(b.ifindex, DropReason::PolicyIngress);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_SHOT);
        assert_eq!(send(&h, &a, &b, UDP, udp(40000, 80)), TC_ACT_SHOT);
        assert_eq!(send(&h, &a, &b, ICMP, icmp(8, 7)), TC_ACT_SHOT);
        let after = h.dropped(b.ifindex, DropReason::PolicyIngress);
        assert_eq!(after.packets, before.packets + 3, "counted on B's veth");
        // Port 80: in, and B's answers out although its egress allows nothing.
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, SYN)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(80, 40000, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_REDIRECT);
        // B opening anything of its own: refused at its egress.
        let before = h.dropped(b.ifindex, DropReason::PolicyEgress);
        assert_eq!(send(&h, &b, &a, TCP, tcp(40001, 80, SYN)), TC_ACT_SHOT);
        // A reply-looking segment of a connection A could not have opened: refused too (one
        // A could have opened passes: an established connection older than the policy).
        assert_eq!(send(&h, &b, &a, TCP, tcp(81, 40002, SYN_ACK)), TC_ACT_SHOT);
        let after = h.dropped(b.ifindex, DropReason::PolicyEgress);
        assert_eq!(after.packets, before.packets + 2);
        // A SYN is always a new connection: B cannot pass a SYN off as part of the flow.
        assert_eq!(send(&h, &b, &a, TCP, tcp(80, 40000, SYN)), TC_ACT_SHOT);
    });
}

#[test]
fn a_change_that_revokes_a_flow_refuses_its_next_packet() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![tcp_port(80)], None)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, SYN)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_REDIRECT);
        // A change that keeps port 80 keeps the flow.
        p.apply(Change::Policy(policy(
            vec![tcp_port(80), tcp_port(81)],
            None,
        )));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_REDIRECT);
        // One that takes it away refuses the established flow from its next packet, both
        // ways, and lets the new port in.
        p.apply(Change::Policy(policy(vec![tcp_port(81)], None)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_SHOT);
        // And every packet after it, both ways: B's egress is open, yet the mid-connection
        // rule (a segment of no remembered flow passes when either direction allows it) does
        // not let the revoked flow in again.
        for _ in 0..3 {
            assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_SHOT);
            assert_eq!(send(&h, &b, &a, TCP, tcp(80, 40000, ACK)), TC_ACT_SHOT);
        }
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
        // A's label change takes it out of the set: its flows to B go too.
        p.apply(Change::Pod(model("a", "other", &a)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_SHOT);
        // The label back: the flow is let through again.
        p.apply(Change::Pod(model("a", "a", &a)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, ACK)), TC_ACT_REDIRECT);
        // The policy gone: B is open again.
        p.apply(Change::PolicyGone(PolicyKey {
            namespace: NS.into(),
            name: "b-in".into(),
        }));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 99, SYN)), TC_ACT_REDIRECT);
    });
}

/// A connection that ends (both FINs and the last ACK, or a RST) takes its remembered flow
/// with it, on the pod's path and on the node's: a busy node's table holds live connections,
/// not closed ones that every new connection would have to evict. What comes after is judged
/// as any segment of no remembered flow.
#[test]
fn a_closed_connection_leaves_no_remembered_flow() {
    const FIN_ACK: u8 = 0x11;
    const RST: u8 = 0x04;
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![tcp_port(80)], Some(vec![]))));
        let (ab, ba) = (
            |h: &Harness, port: u16, flags| send(h, &a, &b, TCP, tcp(port, 80, flags)),
            |h: &Harness, port: u16, flags| send(h, &b, &a, TCP, tcp(80, port, flags)),
        );
        for port in [40000, 40001] {
            assert_eq!(ab(&h, port, SYN), TC_ACT_REDIRECT);
            assert_eq!(ba(&h, port, SYN_ACK), TC_ACT_REDIRECT);
            assert_eq!(ab(&h, port, ACK), TC_ACT_REDIRECT);
        }
        assert_eq!(remembered(&h), 2, "B's two connections");
        // A closes 40000 first, then B; the flow stays until A's last ACK.
        assert_eq!(ab(&h, 40000, FIN_ACK), TC_ACT_REDIRECT);
        assert_eq!(ba(&h, 40000, ACK), TC_ACT_REDIRECT);
        assert_eq!(ba(&h, 40000, FIN_ACK), TC_ACT_REDIRECT);
        assert_eq!(
            remembered(&h),
            2,
            "half closed both ways, the last ACK not seen yet"
        );
        assert_eq!(ab(&h, 40000, ACK), TC_ACT_REDIRECT);
        assert_eq!(remembered(&h), 1, "40000 closed");
        // B resets 40001.
        assert_eq!(ba(&h, 40001, RST), TC_ACT_REDIRECT);
        assert_eq!(remembered(&h), 0, "40001 reset");
        // A RST of no remembered flow is judged, never remembered.
        assert_eq!(ab(&h, 40002, RST), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(81, 40003, RST)),
            TC_ACT_SHOT,
            "nothing A could have opened, and B's egress allows nothing"
        );
        assert_eq!(remembered(&h), 0);
        // A revoked flow is kept as such, FIN or not: its segments stay refused.
        assert_eq!(ab(&h, 40004, SYN), TC_ACT_REDIRECT);
        p.apply(Change::Policy(policy(vec![tcp_port(81)], Some(vec![]))));
        assert_eq!(ab(&h, 40004, FIN_ACK), TC_ACT_SHOT);
        assert_eq!(ba(&h, 40004, FIN_ACK), TC_ACT_SHOT);
        assert_eq!(ab(&h, 40004, ACK), TC_ACT_SHOT);
        assert_eq!(remembered(&h), 1, "the revoked flow");
        // The node's own connection (a kubelet probe to port 8080): remembered when it opens,
        // forgotten when it closes, whichever end's packets run which program.
        let node = [10, 0, 0, 1];
        let from_node = |h: &Harness, flags| {
            let frame = Ip4::new(node, b.v4, TCP, tcp(41000, 8080, flags)).sent_by(&b);
            let prog = h.bpf.program(PROG_TO_POD).expect("to_pod");
            test_run_ctx(prog.try_into().expect("tc"), b.ifindex, &frame, 0, 0)
                .expect("test_run")
                .verdict
        };
        let to_node = |h: &Harness, flags| {
            let frame = Ip4::new(b.v4, node, TCP, tcp(8080, 41000, flags)).sent_by(&b);
            h.run(PROG_FROM_POD, b.ifindex, &frame).verdict
        };
        assert_eq!(from_node(&h, SYN), TC_ACT_OK);
        assert_eq!(to_node(&h, SYN_ACK), TC_ACT_OK);
        assert_eq!(remembered(&h), 2, "the probe's flow");
        assert_eq!(from_node(&h, FIN_ACK), TC_ACT_OK);
        assert_eq!(to_node(&h, FIN_ACK), TC_ACT_OK);
        assert_eq!(from_node(&h, ACK), TC_ACT_OK);
        assert_eq!(remembered(&h), 1, "the probe's flow closed");
    });
}

/// `[policy] keep_established`: a flow a change would refuse goes on (both ways), a new
/// connection meets the new rules, and turning the option off refuses the kept flow from its
/// next packet.
#[test]
fn keeping_established_flows_lets_a_revoked_flow_go_on_and_refuses_new_ones() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.programmer
            .set_keep_established(true)
            .expect("keep established");
        p.apply(Change::Policy(policy(vec![tcp_port(80)], None)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, SYN)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &b, &a, TCP, tcp(80, 40000, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        p.apply(Change::Policy(policy(vec![tcp_port(81)], None)));
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_REDIRECT);
        assert_eq!(send(&h, &b, &a, TCP, tcp(80, 40000, ACK)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &a, &b, TCP, tcp(40001, 80, SYN)),
            TC_ACT_SHOT,
            "a new connection meets the new rules"
        );
        assert_eq!(
            send(&h, &a, &b, TCP, tcp(40000, 80, SYN)),
            TC_ACT_SHOT,
            "a SYN is a new connection, even on a kept flow"
        );
        // The option off: the kept flow is checked again, and refused.
        p.programmer
            .set_keep_established(false)
            .expect("keep established off");
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 80, ACK)), TC_ACT_SHOT);
        assert_eq!(send(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_REDIRECT);
    });
}

#[test]
fn fragments_and_portless_protocols_pass_only_a_rule_for_every_port() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![tcp_port(80)], None)));
        let first = Ip4::new(a.v4, b.v4, TCP, tcp(40000, 80, SYN)).frag(0x2000);
        let later = Ip4::new(a.v4, b.v4, TCP, vec![0; 16]).frag(0x0003);
        for ip in [first.clone(), later.clone()] {
            let frame = ip.sent_by(&a);
            let run = h.run(PROG_FROM_POD, a.ifindex, &frame);
            // Fragments go to the host stack (TC_ACT_OK) and meet B's policy at its veth.
            assert_eq!(run.verdict, TC_ACT_OK);
            let delivered = ip.sent_by(&b);
            assert_eq!(
                h.run(PROG_TO_POD, b.ifindex, &delivered).verdict,
                TC_ACT_SHOT
            );
        }
        // A rule with no ports covers every protocol, fragments included.
        p.apply(Change::Policy(policy(vec![], None)));
        for ip in [first, later] {
            assert_eq!(
                h.run(PROG_TO_POD, b.ifindex, &ip.sent_by(&b)).verdict,
                TC_ACT_OK
            );
        }
        assert_eq!(send(&h, &a, &b, ICMP, icmp(8, 7)), TC_ACT_REDIRECT);
        assert_eq!(
            send(&h, &a, &b, 47, vec![0; 8]),
            TC_ACT_OK,
            "GRE: to the stack"
        );
    });
}

#[test]
fn the_stack_path_and_other_nodes_meet_the_same_policy_and_the_node_always_passes() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![tcp_port(80)], Some(vec![]))));
        // Delivered by the host stack (a NodePort after kube-proxy's DNAT, a hostPort): B's
        // veth judges it against the pod's real address and port.
        let to_b =
            |src: [u8; 4], port: u16| Ip4::new(src, b.v4, TCP, tcp(40000, port, SYN)).sent_by(&b);
        assert_eq!(
            h.run(PROG_TO_POD, b.ifindex, &to_b(a.v4, 80)).verdict,
            TC_ACT_OK
        );
        assert_eq!(
            h.run(PROG_TO_POD, b.ifindex, &to_b(a.v4, 81)).verdict,
            TC_ACT_SHOT
        );
        assert_eq!(
            h.run(PROG_TO_POD, b.ifindex, &to_b([192, 0, 2, 9], 80))
                .verdict,
            TC_ACT_SHOT,
            "an address in no set"
        );
        // From another node, through the uplink: the same.
        let uplink = veth("cxtpu");
        let from_wire = Ip4::new([10, 244, 1, 5], b.v4, TCP, tcp(40000, 80, SYN));
        let frame = eth(
            [0xee; 6],
            [2, 0, 0, 0, 0, 0x55],
            ETH_P_IP,
            &from_wire.bytes(),
        );
        assert_eq!(
            h.run(PROG_FROM_HOST_DEV, uplink, &frame).verdict,
            TC_ACT_SHOT
        );
        // The node's own traffic (a kubelet probe): always in, and the pod's answer goes out
        // although its egress allows nothing.
        let probe = to_b([10, 0, 0, 1], 8080);
        let prog = h.bpf.program(PROG_TO_POD).expect("to_pod");
        let run =
            test_run_ctx(prog.try_into().expect("tc"), b.ifindex, &probe, 0, 0).expect("test_run");
        assert_eq!(run.verdict, TC_ACT_OK);
        let answer = Ip4::new(b.v4, [10, 0, 0, 1], TCP, tcp(8080, 40000, SYN_ACK)).sent_by(&b);
        assert_eq!(h.run(PROG_FROM_POD, b.ifindex, &answer).verdict, TC_ACT_OK);
    });
}

#[test]
fn ipv6_is_policed_and_neighbour_discovery_never_is() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.apply(Change::Policy(policy(vec![tcp_port(80)], Some(vec![]))));
        let v6 = |from: &Pod, to: &Pod, next: u8, l4: &[u8]| {
            eth(
                HOST_VETH_MAC,
                from.mac,
                ETH_P_IPV6,
                &ip6(from.v6, to.v6, next, l4),
            )
        };
        let run = |from: &Pod, frame: &[u8]| h.run(PROG_FROM_POD, from.ifindex, frame).verdict;
        assert_eq!(send6(&h, &a, &b, TCP, tcp(40000, 81, SYN)), TC_ACT_SHOT);
        assert_eq!(send6(&h, &a, &b, TCP, tcp(40000, 80, SYN)), TC_ACT_REDIRECT);
        assert_eq!(
            send6(&h, &b, &a, TCP, tcp(80, 40000, SYN_ACK)),
            TC_ACT_REDIRECT
        );
        assert_eq!(send6(&h, &b, &a, TCP, tcp(40001, 80, SYN)), TC_ACT_SHOT);
        // An extension header hides the ports: only a rule for every port would let it by.
        let hidden = ext_header(TCP, &tcp(40000, 80, SYN));
        assert_eq!(
            run(&a, &v6(&a, &b, IPV6_DSTOPTS, &hidden)),
            TC_ACT_OK,
            "to the stack"
        );
        let delivered = v6(&a, &b, IPV6_DSTOPTS, &hidden);
        assert_eq!(
            h.run(PROG_TO_POD, b.ifindex, &delivered).verdict,
            TC_ACT_SHOT
        );
        // B's neighbour advertisement of its own address passes its egress isolation.
        let na = v6(&b, &a, ICMPV6, &nd(ND_NEIGHBOR_ADVERT, b.v6));
        assert_ne!(run(&b, &na), TC_ACT_SHOT);
    });
}

/// A pod's egress to a Service address waits for the host stack's DNAT: `from_pod` hands the
/// packet to the stack marked with the pod's slot (whatever the rules say of the Service
/// address), and the hook after the stack judges it against the backend it now goes to:
/// `to_pod` of a backend on this node, `to_host_dev` of an uplink (mark cleared). The replies
/// come back from the Service address; nothing else does.
#[test]
fn service_traffic_is_judged_after_the_dnat_against_its_backend() {
    in_netns(|| {
        let (mut h, a, b) = setup();
        let mut p = Policed::new(&mut h, &a, &b);
        p.programmer
            .set_services(&["10.96.0.0/16".parse().expect("cidr")], &p.slots)
            .expect("service ranges");
        // B lets A in on 80; A may go out only to B on 80, and takes nothing in.
        p.apply(Change::Policy(policy(vec![tcp_port(80)], None)));
        let to_b = Rule {
            peers: vec![Peer::Pods {
                namespaces: Namespaces::Named(NS.into()),
                pods: LabelSelector {
                    match_labels: labels("b"),
                    match_expressions: Vec::new(),
                },
            }],
            ports: vec![tcp_port(80)],
            unreadable: None,
        };
        p.apply(Change::Policy(Policy {
            key: PolicyKey {
                namespace: NS.into(),
                name: "a-out".into(),
            },
            pod_selector: LabelSelector {
                match_labels: labels("a"),
                match_expressions: Vec::new(),
            },
            ingress: Some(vec![]),
            egress: Some(vec![to_b]),
            unreadable_selector: None,
        }));
        let service = [10, 96, 0, 10];
        let pending = calix_common::policy_pending_mark(a.slot);
        // To the Service address: to the stack, marked (no rule names the address).
        let to_service = Ip4::new(a.v4, service, TCP, tcp(40000, 80, SYN)).sent_by(&a);
        let run = h.run(PROG_FROM_POD, a.ifindex, &to_service);
        assert_eq!(run.verdict, TC_ACT_OK);
        assert_eq!(run.ctx[SKB_MARK], pending, "marked with A's slot");
        // Straight to B's address (no DNAT): judged at once, and not marked.
        let direct = Ip4::new(a.v4, b.v4, TCP, tcp(40001, 81, SYN)).sent_by(&a);
        assert_eq!(
            h.run(PROG_FROM_POD, a.ifindex, &direct).verdict,
            TC_ACT_SHOT
        );
        // After the DNAT, on B's veth: A's egress, then B's ingress.
        let after =
            |port: u16, dst: [u8; 4]| Ip4::new(a.v4, dst, TCP, tcp(40000, port, SYN)).sent_by(&b);
        let run_to = |name: &str, ifindex: u32, frame: &[u8]| {
            let p = h.bpf.program(name).expect("program");
            test_run_ctx(
                p.try_into().expect("tc"),
                ifindex,
                frame,
                pending,
                a.ifindex,
            )
            .expect("test_run")
        };
        let allowed = run_to(PROG_TO_POD, b.ifindex, &after(80, b.v4));
        assert_eq!(allowed.verdict, TC_ACT_OK, "the backend B on 80: allowed");
        assert_eq!(allowed.ctx[SKB_MARK], 0, "the mark is cleared");
        let before = h.dropped(a.ifindex, DropReason::PolicyEgress).packets;
        assert_eq!(
            run_to(PROG_TO_POD, b.ifindex, &after(81, b.v4)).verdict,
            TC_ACT_SHOT,
            "a backend port A's egress does not allow"
        );
        assert_eq!(
            h.dropped(a.ifindex, DropReason::PolicyEgress).packets,
            before + 1,
            "counted on A's veth"
        );
        // Out of the node (a backend elsewhere, or nothing translated it): the uplink judges.
        let uplink = veth("cxtps");
        let out = run_to(PROG_TO_HOST_DEV, uplink, &after(80, b.v4));
        assert_eq!(out.verdict, TC_ACT_OK);
        assert_eq!(out.ctx[SKB_MARK], 0, "cleared before the uplink's own hook");
        assert_eq!(
            run_to(PROG_TO_HOST_DEV, uplink, &after(80, [192, 0, 2, 9])).verdict,
            TC_ACT_SHOT,
            "a backend in no set"
        );
        assert_eq!(
            run_to(PROG_TO_HOST_DEV, uplink, &after(80, service)).verdict,
            TC_ACT_SHOT,
            "still the Service address: nothing translated it"
        );
        // Unmarked traffic on the uplink is not A's to judge.
        assert_eq!(
            h.run(PROG_TO_HOST_DEV, uplink, &after(80, [192, 0, 2, 9]))
                .verdict,
            TC_ACT_OK
        );
        // The reply, from the Service address once the stack undid the DNAT: in, although A
        // takes nothing in; from another Service address, or a new connection: not.
        let reply = |src: [u8; 4], sport: u16, flags: u8| {
            Ip4::new(src, a.v4, TCP, tcp(sport, 40000, flags)).sent_by(&a)
        };
        assert_eq!(
            h.run(PROG_TO_POD, a.ifindex, &reply(service, 80, SYN_ACK))
                .verdict,
            TC_ACT_OK
        );
        assert_eq!(
            h.run(PROG_TO_POD, a.ifindex, &reply([10, 96, 0, 11], 80, SYN_ACK))
                .verdict,
            TC_ACT_SHOT
        );
        assert_eq!(
            h.run(PROG_TO_POD, a.ifindex, &reply(service, 80, SYN))
                .verdict,
            TC_ACT_SHOT
        );
        // A's next packets to the Service address: marked again, every one.
        let ack = Ip4::new(a.v4, service, TCP, tcp(40000, 80, ACK)).sent_by(&a);
        let run = h.run(PROG_FROM_POD, a.ifindex, &ack);
        assert_eq!((run.verdict, run.ctx[SKB_MARK]), (TC_ACT_OK, pending));
    });
}
