//! The NetworkPolicy program tests' cluster: pods A and B of one namespace on the harness's
//! node, their policy calculated by calix-core, compiled, and written into the pinned maps by
//! the dataplane's own programmer, as the agent does; and the frames they send.

use std::collections::BTreeMap;

use calix_common::{
    FlowKey, PolicyFlow, PolicyFlowKeyV4, HOST_VETH_MAC, POLICY_FLOWS_MAP, POLICY_FLOWS_V4_MAP,
    PROG_FROM_POD,
};
use calix_core::policy::cluster::{Change, Cluster};
use calix_core::policy::compiler::Compiler;
use calix_core::policy::model::{
    Namespaces, Peer, Pod as PodModel, PodKey, Policy, PolicyKey, PortMatch, PortRef, Protocol,
    Rule,
};
use calix_core::selector::LabelSelector;
use calix_dataplane::ebpf::policy::{PinnedPolicyMaps, PolicyProgrammer};

use super::common::*;
use super::harness::*;

pub const NS: &str = "team";

pub fn key(name: &str) -> PodKey {
    PodKey {
        namespace: NS.into(),
        name: name.into(),
    }
}

pub fn labels(app: &str) -> BTreeMap<String, String> {
    [("app".to_string(), app.to_string())].into()
}

pub fn model(name: &str, app: &str, pod: &Pod) -> PodModel {
    PodModel {
        key: key(name),
        labels: labels(app),
        ips: vec![
            std::net::Ipv4Addr::from(pod.v4).into(),
            std::net::Ipv6Addr::from(pod.v6).into(),
        ],
        ports: Vec::new(),
        host_network: false,
    }
}

pub fn tcp_port(port: u16) -> PortMatch {
    PortMatch {
        protocol: Protocol::Tcp,
        port: Some(PortRef::Number(port)),
        end_port: None,
    }
}

/// A rule for the pods of this namespace labelled `app`, on `ports` (empty: all).
pub fn app_rule(app: &str, ports: Vec<PortMatch>) -> Rule {
    Rule {
        peers: vec![Peer::Pods {
            namespaces: Namespaces::Named(NS.into()),
            pods: LabelSelector {
                match_labels: labels(app),
                match_expressions: Vec::new(),
            },
        }],
        ports,
        unreadable: None,
    }
}

/// A policy selecting `app=b` that lets `app=a` in on `ports` (empty: all) and, when
/// `egress` is `Some`, isolates egress with those rules.
pub fn policy(ports: Vec<PortMatch>, egress: Option<Vec<Rule>>) -> Policy {
    Policy {
        key: PolicyKey {
            namespace: NS.into(),
            name: "b-in".into(),
        },
        pod_selector: LabelSelector {
            match_labels: labels("b"),
            match_expressions: Vec::new(),
        },
        ingress: Some(vec![app_rule("a", ports)]),
        egress,
        unreadable_selector: None,
    }
}

/// A policy selecting `app=a` that lets `app=b` in, and A out to `app=b`, on every port.
#[allow(dead_code)] // Not every test file that includes this uses it.
pub fn a_with_b() -> Policy {
    Policy {
        key: PolicyKey {
            namespace: NS.into(),
            name: "a-both".into(),
        },
        pod_selector: LabelSelector {
            match_labels: labels("a"),
            match_expressions: Vec::new(),
        },
        ingress: Some(vec![app_rule("b", vec![])]),
        egress: Some(vec![app_rule("b", vec![])]),
        unreadable_selector: None,
    }
}

/// The cluster's policy for pods A and B, programmed the way the agent does: calculated,
/// compiled, written by the dataplane's programmer.
pub struct Policed {
    pub cluster: Cluster,
    pub compiler: Compiler,
    pub programmer: PolicyProgrammer,
    pub slots: Vec<(PodKey, u32)>,
}

impl Policed {
    pub fn new(h: &mut Harness, a: &Pod, b: &Pod) -> Self {
        let mut cluster = Cluster::new();
        cluster.apply(Change::Namespace {
            name: NS.into(),
            labels: BTreeMap::new(),
        });
        cluster.apply(Change::Pod(model("a", "a", a)));
        cluster.apply(Change::Pod(model("b", "b", b)));
        let maps = PinnedPolicyMaps::open(&mut h.bpf).expect("policy maps");
        Self {
            cluster,
            compiler: Compiler::new(),
            programmer: PolicyProgrammer::restore(Box::new(maps)),
            slots: vec![(key("a"), a.slot), (key("b"), b.slot)],
        }
    }

    pub fn apply(&mut self, change: Change) {
        self.cluster.apply(change);
        let endpoints = ["a", "b"]
            .into_iter()
            .filter_map(|n| Some((key(n), self.cluster.endpoint(&key(n))?)))
            .collect();
        let tables = self
            .compiler
            .compile(&endpoints, |s| self.cluster.members(s));
        self.programmer
            .set(tables, &self.slots)
            .expect("program the policy maps");
    }
}

/// A TCP segment with `flags` (0x02 SYN, 0x10 ACK, 0x12 SYN-ACK).
pub fn tcp(sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut t = tcp_syn(sport, dport);
    t[13] = flags;
    t
}

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const SYN_ACK: u8 = 0x12;

/// `from_pod` on `from`'s veth, for a frame from `from` to `to`: the verdict.
pub fn send(h: &Harness, from: &Pod, to: &Pod, proto: u8, l4: Vec<u8>) -> u32 {
    let frame = Ip4::new(from.v4, to.v4, proto, l4).sent_by(from);
    h.run(PROG_FROM_POD, from.ifindex, &frame).verdict
}

/// As [`send`], over IPv6.
pub fn send6(h: &Harness, from: &Pod, to: &Pod, proto: u8, l4: Vec<u8>) -> u32 {
    let frame = eth(
        HOST_VETH_MAC,
        from.mac,
        ETH_P_IPV6,
        &ip6(from.v6, to.v6, proto, &l4),
    );
    h.run(PROG_FROM_POD, from.ifindex, &frame).verdict
}

/// The flows `CALIX_POL_FLOWS_V4` and `CALIX_POL_FLOWS` remember.
pub fn remembered(h: &Harness) -> usize {
    let map = h.bpf.map(POLICY_FLOWS_V4_MAP).expect("CALIX_POL_FLOWS_V4");
    let flows4: aya::maps::HashMap<_, PolicyFlowKeyV4, PolicyFlow> =
        aya::maps::HashMap::try_from(map).expect("a hash map");
    let map = h.bpf.map(POLICY_FLOWS_MAP).expect("CALIX_POL_FLOWS");
    let flows: aya::maps::HashMap<_, FlowKey, PolicyFlow> =
        aya::maps::HashMap::try_from(map).expect("a hash map");
    flows4.keys().filter(Result::is_ok).count() + flows.keys().filter(Result::is_ok).count()
}
