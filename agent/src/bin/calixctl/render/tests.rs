use calix_agent::ipam::service::{CheckReport, Finding};
use calix_core::routes::report::RoutesReport;
use calix_proto::v1 as pb;

use super::bpf::{drops_json, drops_table, flows_table};
use super::endpoints::{endpoints_json, endpoints_table};
use super::ipam::ipam_check_table;
use super::routes::{nodes_table, routes_table};
use super::{age, human_bytes, table};

#[test]
fn table_aligns_columns() {
    let t = table(
        &["A", "BB"],
        &[vec!["xxx".into(), "y".into()], vec!["z".into(), "".into()]],
    );
    assert_eq!(t, "A    BB\nxxx  y\nz");
    let t = table(&["POD"], &[vec!["evil\u{1b}[2J\nforged".into()]]);
    assert_eq!(t, "POD\nevil\\u{1b}[2J\\nforged");
}

#[test]
fn ages_are_human() {
    assert_eq!(age(4.2), "4s");
    assert_eq!(age(200.0), "3m20s");
    assert_eq!(age(7500.0), "2h5m");
    assert_eq!(age(-1.0), "0s");
}

#[test]
fn routes_off_says_so() {
    let r = RoutesReport {
        node: "n1".into(),
        ..Default::default()
    };
    assert!(routes_table(&r).contains("route distribution is off on node n1"));
    assert!(nodes_table(&r).contains("routes.enabled = false"));
}

#[test]
fn an_ignored_block_shows_its_block_and_rule() {
    let r = CheckReport {
        blocks: 1,
        findings: vec![Finding {
            kind: "ignored-block".into(),
            rule: "block_size".into(),
            address: None,
            seq: None,
            handle: String::new(),
            ifname: String::new(),
            node: "rogue".into(),
            block: "10.244.7.9/32".into(),
            detail: "10.244.7.9/32 is a /32; pool 10.244.0.0/16 makes /26".into(),
        }],
        ..Default::default()
    };
    let t = ipam_check_table(&r);
    let row = t.lines().nth(1).expect("a row");
    for want in [
        "ignored-block (block_size)",
        "rogue",
        "10.244.7.9/32",
        "makes /26",
    ] {
        assert!(row.contains(want), "{want:?} not in {t}");
    }
    assert!(t.lines().next().is_some_and(|h| h.contains("BLOCK")), "{t}");
}

#[test]
fn bytes_are_human() {
    assert_eq!(human_bytes(12), "12 B");
    assert_eq!(human_bytes(2048), "2.0 KiB");
}

fn flow() -> serde_json::Value {
    serde_json::json!({
        "proto": "tcp", "pod": "10.244.0.5", "pod_port": 40000,
        "nat": "192.168.1.10", "nat_port": 61000, "dst": "1.1.1.1", "dst_port": 443,
        "state": "established", "idle_secs": 3, "expires_in_secs": 7437,
    })
}

#[test]
fn conntrack_and_nat_views_order_their_columns() {
    let t = flows_table(&[flow()], false, "n1");
    let mut lines = t.lines();
    let header: Vec<&str> = lines.next().expect("a header").split_whitespace().collect();
    assert_eq!(
        header,
        [
            "PROTO",
            "POD",
            "DESTINATION",
            "NAT",
            "STATE",
            "IDLE",
            "EXPIRES"
        ]
    );
    let row: Vec<&str> = lines.next().expect("a row").split_whitespace().collect();
    assert_eq!(
        row,
        [
            "tcp",
            "10.244.0.5:40000",
            "1.1.1.1:443",
            "192.168.1.10:61000",
            "established",
            "3s",
            "7437s"
        ]
    );
    assert_eq!(lines.next(), Some("1 flow(s) on node n1"));

    let t = flows_table(&[flow()], true, "n1");
    let row: Vec<&str> = t
        .lines()
        .nth(1)
        .expect("a row")
        .split_whitespace()
        .collect();
    assert_eq!(
        row,
        [
            "tcp",
            "10.244.0.5:40000",
            "192.168.1.10:61000",
            "1.1.1.1:443"
        ]
    );
}

#[test]
fn drops_name_the_interface_or_its_index_and_sum_the_packets() {
    let resp = pb::DropsResponse {
        node: "n1".into(),
        drops: vec![
            pb::DropCounter {
                ifindex: 7,
                ifname: "cali1".into(),
                reason: "policy".into(),
                packets: 3,
                bytes: 3072,
            },
            pb::DropCounter {
                ifindex: 9,
                ifname: String::new(),
                reason: "no-route".into(),
                packets: 2,
                bytes: 100,
            },
        ],
    };
    let t = drops_table(&resp);
    assert_eq!(
        t,
        "INTERFACE    REASON    PACKETS  BYTES\n\
         cali1        policy    3        3.0 KiB\n\
         (ifindex 9)  no-route  2        100 B\n\
         5 packet(s) dropped on node n1"
    );
    let j = drops_json(&resp);
    assert_eq!(j["node"], "n1");
    assert_eq!(j["drops"][1]["interface"], "");
    assert_eq!(j["drops"][1]["ifindex"], 9);
    assert_eq!(j["drops"][0]["bytes"], 3072);
}

#[test]
fn endpoints_show_their_pod_and_say_which_are_not_ok() {
    let status = |ns: &str, pod: &str, container: &str, state: &str| pb::EndpointStatus {
        endpoint: Some(pb::Endpoint {
            container_id: container.into(),
            pod_namespace: ns.into(),
            pod_name: pod.into(),
            host_ifname: "cali1".into(),
            addresses: vec!["10.244.0.5/32".into()],
            ..Default::default()
        }),
        bpf_attached: true,
        state: state.into(),
        counters: Some(pb::Counters {
            from_pod_packets: 1,
            from_pod_bytes: 2048,
            ..Default::default()
        }),
        ..Default::default()
    };
    let resp = pb::ListResponse {
        node: "n1".into(),
        endpoints: vec![
            status("default", "web", "c1", "ok"),
            status("", "", "0123456789abcdef", "unreachable"),
            status("", "", "c3", ""),
        ],
    };
    let t = endpoints_table(&resp);
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 5, "{t}");
    assert!(lines[1].starts_with("default/web "), "{t}");
    assert!(lines[1].contains("1 pkts / 2.0 KiB"), "{t}");
    assert!(lines[2].starts_with("0123456789ab "), "{t}");
    assert!(lines[3].contains(" - "), "{t}");
    assert_eq!(
        lines[4],
        "3 endpoint(s) on node n1, 1 not in their desired state (STATE says why)"
    );
    let j = endpoints_json(&resp);
    assert_eq!(j["endpoints"][0]["pod"], "default/web");
    assert_eq!(j["endpoints"][1]["pod"], "0123456789ab");
    assert_eq!(j["endpoints"][0]["counters"]["fromPodBytes"], 2048);
    assert!(j["endpoints"][0]["podLabels"].is_null());
}

#[test]
fn a_pods_policy_reads_direction_by_direction() {
    use calix_core::policy::report::{EndpointReport, PolicyReport, RuleReport};
    let mut r = PolicyReport {
        node: "n1".into(),
        enabled: true,
        ready: true,
        pods: 3,
        policies: 1,
        ..PolicyReport::default()
    };
    assert!(super::policy::policy(&r, None)
        .starts_with("node n1: in sync (0 namespaces, 3 pods, 1 policies"));
    assert!(super::policy::policy(&r, Some("a/x")).ends_with("pod a/x: not known to the agent"));
    r.dataplane = Some("3 prefixes, 9 entries".into());
    assert!(super::policy::policy(&r, None).ends_with("\ndataplane: 3 prefixes, 9 entries"));
    r.endpoint = Some(EndpointReport {
        pod: "a/web".into(),
        local: true,
        policies: vec!["a/web".into(), "a/deny-egress".into()],
        ingress: Some(vec![RuleReport {
            policy: "a/web".into(),
            rule: 0,
            peer: "pods role=client in a".into(),
            ports: "TCP/80".into(),
            members: Some(2),
            hits: Some(17),
        }]),
        egress: Some(vec![]),
        problems: vec!["a/web ingress rule 1: unknown protocol \"ICMP\"".into()],
        denied_ingress: Some(4),
        denied_egress: Some(9),
        ..EndpointReport::default()
    });
    let text = super::policy::policy(&r, Some("a/web"));
    assert!(text.contains("policies: a/web, a/deny-egress"), "{text}");
    assert!(
        text.contains("ingress: isolated (4 packets denied), allowed:"),
        "{text}"
    );
    assert!(text.contains("pods role=client in a  2"), "{text}");
    assert!(text.contains("TCP/80  17"), "{text}");
    assert!(
        text.contains("egress: isolated, nothing allowed (9 packets denied)"),
        "{text}"
    );
    assert!(
        text.contains("not enforceable, allows nothing: a/web ingress rule 1"),
        "{text}"
    );
    r.enabled = false;
    assert!(super::policy::policy(&r, None).contains("needs the kubernetes datastore"));
}

#[test]
fn a_pod_is_named_as_kubectl_names_it() {
    use crate::commands::policy::pod_ref;
    assert_eq!(
        pod_ref("shop/web").expect("ok"),
        ("shop".into(), "web".into())
    );
    assert_eq!(
        pod_ref("web").expect("ok"),
        ("default".into(), "web".into())
    );
    assert!(pod_ref("a/b/c").is_err());
    assert!(pod_ref("/x").is_err());
    assert!(pod_ref("x/").is_err());
}

#[test]
fn a_dropped_packet_reads_on_one_line() {
    use calix_core::policy::report::DroppedPacket;
    let d = DroppedPacket {
        time: "2026-12-03T15:00:00.123Z".into(),
        pod: Some("shop/web".into()),
        interface: Some("cali0123456789a".into()),
        direction: "ingress".into(),
        protocol: "TCP".into(),
        pod_address: "fd00::5".into(),
        pod_port: Some(80),
        peer_address: "10.0.1.9".into(),
        peer_port: Some(43210),
        peer_pod: Some("shop/evil\n".into()),
        why: "no rule allows it".into(),
        suppressed: 3,
    };
    let line = super::policy::drop_line(&d);
    assert!(line.starts_with("2026-12-03T15:00:00.123Z "), "{line}");
    assert!(line.contains(" shop/web "), "{line}");
    assert!(line.contains(" [fd00::5]:80 "), "{line}");
    assert!(line.contains(" 10.0.1.9:43210 (shop/evil\\n) "), "{line}");
    assert!(
        line.ends_with("no rule allows it (+3 left out before it)"),
        "{line}"
    );
    assert!(
        !line.contains('\n'),
        "a pod's name cannot break the line: {line}"
    );
    assert!(super::policy::drop_header().starts_with("TIME "));
}

#[test]
fn a_trace_reads_step_by_step_and_ends_with_its_verdict() {
    use calix_core::policy::trace::{Outcome, TraceReport, TraceStep};
    let step = |stage: &str, outcome, detail: &str| TraceStep {
        stage: stage.into(),
        node: "n1".into(),
        outcome,
        detail: detail.into(),
        source: "live maps".into(),
    };
    let r = TraceReport {
        node: "n1".into(),
        packet: "TCP 10.0.0.5 (a/client) → 10.0.0.6:80 (a/web)".into(),
        steps: vec![
            step("egress policy", Outcome::Pass, "a/client is not isolated"),
            step("route", Outcome::Note, "delivered on n1 to cali1"),
            step("ingress policy", Outcome::Drop, "no rule allows it"),
        ],
    };
    let text = super::policy::trace(&r);
    assert!(text.starts_with("TCP 10.0.0.5 (a/client)"), "{text}");
    assert!(text.contains("3  ingress policy  n1    DROP"), "{text}");
    assert!(
        text.ends_with("=> dropped by ingress policy on n1: no rule allows it"),
        "{text}"
    );
}

#[test]
fn services_table_shows_frontends_refusals_and_room() {
    use calix_agent::services::{ServiceRow, ServicesReport};
    use calix_core::services::admit::{Frontend, Kind, Refusal};
    use calix_core::services::choose::Choice;
    use calix_core::services::model::Protocol;
    use calix_core::services::state::Limits;
    use calix_core::services::Programmed;
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    let r = ServicesReport {
        node: "n1".into(),
        ready: true,
        programmed: false,
        program_error: None,
        services: 2,
        slices: 1,
        used_frontends: 2,
        used_backends: 2,
        limits: Limits {
            frontends: 10,
            backends: 20,
        },
        changes: 3,
        list: vec![
            ServiceRow {
                service: "shop/big".into(),
                frontends: Vec::new(),
                refused: Vec::new(),
                problems: Vec::new(),
                unreadable: Vec::new(),
                no_room: Some((1, 30)),
                counters: Vec::new(),
            },
            ServiceRow {
                service: "shop/web".into(),
                frontends: vec![
                    Programmed {
                        frontend: Frontend {
                            kind: Kind::ClusterIp,
                            address: Some(ip("fd00:96::a")),
                            protocol: Protocol::Tcp,
                            port: 80,
                            port_name: "http".into(),
                        },
                        internal: Choice::To(vec![(ip("10.244.1.5"), 8080)]),
                        external: None,
                        terminating_fallback: false,
                        affinity_secs: None,
                        local_at: None,
                    },
                    Programmed {
                        frontend: Frontend {
                            kind: Kind::NodePort,
                            address: None,
                            protocol: Protocol::Udp,
                            port: 30053,
                            port_name: "dns".into(),
                        },
                        internal: Choice::Reject,
                        external: Some(Choice::Drop),
                        terminating_fallback: false,
                        affinity_secs: None,
                        local_at: None,
                    },
                ],
                refused: vec![Refusal {
                    kind: Kind::External,
                    address: ip("192.0.2.9"),
                    why: "outside services.external_cidrs".into(),
                }],
                problems: Vec::new(),
                unreadable: Vec::new(),
                no_room: None,
                counters: vec![
                    calix_agent::services::FrontCounts {
                        connections: 12,
                        refused: 0,
                    },
                    calix_agent::services::FrontCounts {
                        connections: 0,
                        refused: 3,
                    },
                ],
            },
        ],
    };
    let t = super::services::services_table(&r);
    assert!(t.contains("CONNECTIONS"), "{t}");
    assert!(t.contains("  12\n"), "{t}");
    assert!(t.contains("0 (3 refused)"), "{t}");
    assert!(
        t.contains("no room (1 frontend(s), 30 backend entries needed)"),
        "{t}"
    );
    assert!(t.contains("[fd00:96::a]:80/TCP"), "{t}");
    assert!(t.contains("10.244.1.5:8080"), "{t}");
    assert!(t.contains("<node>:30053/UDP"), "{t}");
    assert!(
        t.contains("reject (no endpoint)") && t.contains("drop (no local endpoint)"),
        "{t}"
    );
    assert!(
        t.contains("shop/web: External 192.0.2.9 refused: outside services.external_cidrs"),
        "{t}"
    );
    assert!(
        t.contains("room used: 2/10 frontends, 2/20 backend entries"),
        "{t}"
    );
    assert!(t.contains("calculated only"), "{t}");
}
