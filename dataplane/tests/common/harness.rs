//! The tc program tests' harness (`programs.rs`, `policy_programs.rs`): BPF_PROG_TEST_RUN of a
//! tc program on a veth's ifindex, the loaded object with its maps, and two registered pods.
#![allow(dead_code)] // Each test file uses its own part of it.

use std::mem::size_of;
use std::os::fd::AsFd;

use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{Array, HashMap, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues};
use aya::programs::SchedClassifier;
use aya::Ebpf;
use calix_common::{
    direct_bucket, DirectEndpoint, DropCount, DropKey, DropReason, EndpointCounters, EndpointInfo,
    FlowKey, LocalEndpoint, StackFlow, COUNTERS_MAP, DROPS_MAP, ENDPOINTS_DIRECT_MAP,
    ENDPOINTS_MAP, EP_HAS_V4, EP_HAS_V6, HOST_VETH_MAC, LOCAL_V4_MAP, LOCAL_V6_MAP, POOLS_V4_MAP,
    PROG_FROM_POD, STACK_EPS_MAP, STACK_FLOWS_MAP, STACK_MARKED,
};

use super::common::{self, *};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

// ---- BPF_PROG_TEST_RUN of a tc program ----

/// `struct __sk_buff` up to `ifindex` (the kernel zero-fills a shorter context): `u32` fields
/// len, pkt_type, mark, queue_mapping, protocol, vlan_present, vlan_tci, vlan_proto, priority,
/// ingress_ifindex, ifindex.
pub type SkBuffHead = [u32; 11];
pub const SKB_IFINDEX: usize = 10;

/// `__sk_buff.mark`'s index in [`SkBuffHead`].
pub const SKB_MARK: usize = 2;
/// `__sk_buff.ingress_ifindex`'s index in [`SkBuffHead`]: 0 for a packet the node itself
/// sent, the input interface for a received or forwarded one.
pub const SKB_INGRESS_IFINDEX: usize = 9;
/// The input interface the tests give received and forwarded packets (loopback: any
/// interface other than 0 means "not sent by the node itself").
pub const FORWARDED_FROM: u32 = 1;

/// Runs `prog` once on `frame`, as seen on interface `ifindex`, a packet received or
/// forwarded from elsewhere.
pub fn test_run(prog: &SchedClassifier, ifindex: u32, frame: &[u8]) -> std::io::Result<Run> {
    test_run_ctx(prog, ifindex, frame, 0, FORWARDED_FROM)
}

/// As [`test_run`], with `skb->mark` set to `mark` and `skb->skb_iif` to `ingress`.
pub fn test_run_ctx(
    prog: &SchedClassifier,
    ifindex: u32,
    frame: &[u8],
    mark: u32,
    ingress: u32,
) -> std::io::Result<Run> {
    let mut ctx: SkBuffHead = [0; 11];
    ctx[SKB_IFINDEX] = ifindex;
    ctx[SKB_MARK] = mark;
    ctx[SKB_INGRESS_IFINDEX] = ingress;
    const _: () = assert!(size_of::<SkBuffHead>() == 44);
    let fd = prog.fd().expect("program fd");
    common::test_run(fd.as_fd(), frame, &ctx)
}

// ---- Harness: the loaded object, its maps, two registered pods ----

/// A pod as the agent registers it: its host-side veth, its slot, addresses and MAC.
#[derive(Clone, Copy)]
pub struct Pod {
    pub ifindex: u32,
    pub slot: u32,
    pub v4: [u8; 4],
    pub v6: [u8; 16],
    pub mac: [u8; 6],
}

pub struct Harness {
    pub bpf: Ebpf,
    pub pins: PinDir,
    pub endpoints: HashMap<MapData, u32, EndpointInfo>,
    pub direct: Array<MapData, DirectEndpoint>,
    pub local_v4: HashMap<MapData, [u8; 4], LocalEndpoint>,
    pub local_v6: HashMap<MapData, [u8; 16], LocalEndpoint>,
    pub counters: PerCpuArray<MapData, EndpointCounters>,
    pub drops: PerCpuHashMap<MapData, DropKey, DropCount>,
    pub flows: HashMap<MapData, FlowKey, StackFlow>,
    pub stack_eps: Array<MapData, u32>,
    pub pools_v4: LpmTrie<MapData, [u8; 4], u32>,
}

/// Loads everything and registers pods A (veth `cxtpa`) and B (`cxtpb`) in the current network
/// namespace.
pub fn setup() -> (Harness, Pod, Pod) {
    setup_sized(&[])
}

/// As [`setup`], with the maps named in `sizes` given those `max_entries`.
pub fn setup_sized(sizes: &[(&str, u32)]) -> (Harness, Pod, Pod) {
    let pins = PinDir::new();
    let mut bpf = load_object_sized(&pins, sizes);
    let mut h = Harness {
        endpoints: map(&mut bpf, ENDPOINTS_MAP),
        direct: map(&mut bpf, ENDPOINTS_DIRECT_MAP),
        local_v4: map(&mut bpf, LOCAL_V4_MAP),
        local_v6: map(&mut bpf, LOCAL_V6_MAP),
        counters: map(&mut bpf, COUNTERS_MAP),
        drops: map(&mut bpf, DROPS_MAP),
        flows: map(&mut bpf, STACK_FLOWS_MAP),
        stack_eps: map(&mut bpf, STACK_EPS_MAP),
        pools_v4: map(&mut bpf, POOLS_V4_MAP),
        bpf,
        pins,
    };
    // Slots other than 0 and 1: a program that mixed up slot and ifindex would miss them.
    let pod = |name, last: u8| Pod {
        ifindex: veth(name),
        slot: u32::from(last) * 7,
        v4: [10, 244, 0, last],
        v6: v6(last),
        mac: [0x02, 0, 0, 0, 0, last],
    };
    let (a, b) = (pod("cxtpa", 10), pod("cxtpb", 11));
    h.register(&a);
    h.register(&b);
    (h, a, b)
}

impl Harness {
    /// Registers `pod` as the agent does: a zeroed slot, addresses, local delivery.
    pub fn register(&mut self, pod: &Pod) {
        let cpus = aya::util::nr_cpus().expect("number of CPUs");
        let zero = vec![EndpointCounters::default(); cpus];
        let zero = PerCpuValues::try_from(zero).expect("per-CPU zeros");
        self.counters.set(pod.slot, zero, 0).expect("counters");
        self.stack_eps.set(pod.slot, 0, 0).expect("mark");
        let flags = EP_HAS_V4 | EP_HAS_V6;
        let info = EndpointInfo {
            ipv4: pod.v4,
            flags,
            ipv6: pod.v6,
            slot: pod.slot,
            _pad: 0,
        };
        self.set_endpoint(pod.ifindex, info);
        let local = LocalEndpoint {
            ifindex: pod.ifindex,
            slot: pod.slot,
            mac: pod.mac,
            _pad: [0; 2],
        };
        self.local_v4.insert(pod.v4, local, 0).expect("local v4");
        self.local_v6.insert(pod.v6, local, 0).expect("local v6");
    }

    pub fn try_run(&self, prog: &str, ifindex: u32, frame: &[u8]) -> std::io::Result<Run> {
        let prog = self.bpf.program(prog).expect("a program of ALL_PROGRAMS");
        test_run(prog.try_into().expect("a tc classifier"), ifindex, frame)
    }

    #[track_caller]
    pub fn run_marked(&self, prog: &str, ifindex: u32, frame: &[u8], mark: u32) -> Run {
        let p = self.bpf.program(prog).expect("a program of ALL_PROGRAMS");
        test_run_ctx(
            p.try_into().expect("a tc classifier"),
            ifindex,
            frame,
            mark,
            FORWARDED_FROM,
        )
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {prog}: {e}"))
    }

    #[track_caller]
    pub fn run(&self, prog: &str, ifindex: u32, frame: &[u8]) -> Run {
        let run = self.try_run(prog, ifindex, frame);
        run.unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {prog}: {e}"))
    }

    /// Asserts that `prog` lets `frame` continue (TC_ACT_OK), untouched.
    #[track_caller]
    pub fn passes(&self, prog: &str, ifindex: u32, frame: &[u8]) {
        let run = self.run(prog, ifindex, frame);
        assert_eq!(run.verdict, TC_ACT_OK, "{prog}: verdict");
        assert_eq!(run.frame, frame, "{prog}: frame untouched");
    }

    /// Asserts that `prog` redirects `frame`, leaving it as `expected`.
    #[track_caller]
    pub fn redirects(&self, prog: &str, ifindex: u32, frame: &[u8], expected: &[u8]) {
        let run = self.run(prog, ifindex, frame);
        assert_eq!(run.verdict, TC_ACT_REDIRECT, "{prog}: verdict");
        assert_eq!(run.frame, expected, "{prog}: frame");
    }

    /// Asserts that `from_pod` drops `frame` and counts it under (`ifindex`, `reason`).
    #[track_caller]
    pub fn drops_as(&self, ifindex: u32, frame: &[u8], reason: DropReason) {
        self.check_drop(ifindex, frame, reason, false);
    }

    /// As `drops_as`, for a frame cut inside its IPv4 or IPv6 header; `false` where the kernel
    /// refuses to build such an skb for test_run (EINVAL; Linux 6.18 does): the programs'
    /// checks for a short header cannot be reached from here then.
    #[track_caller]
    pub fn drops_truncated_as(&self, ifindex: u32, frame: &[u8], reason: DropReason) -> bool {
        self.check_drop(ifindex, frame, reason, true)
    }

    #[track_caller]
    pub fn check_drop(
        &self,
        ifindex: u32,
        frame: &[u8],
        reason: DropReason,
        truncated: bool,
    ) -> bool {
        let before = self.dropped(ifindex, reason);
        let run = match self.try_run(PROG_FROM_POD, ifindex, frame) {
            Ok(run) => run,
            Err(e) if truncated && e.raw_os_error() == Some(libc::EINVAL) => return false,
            Err(e) => panic!("BPF_PROG_TEST_RUN of from_pod: {e}"),
        };
        assert_eq!(run.verdict, TC_ACT_SHOT, "{reason:?}: verdict");
        let len = frame.len() as u64;
        let after = self.dropped(ifindex, reason);
        assert_eq!(
            after.packets,
            before.packets + 1,
            "{reason:?}: packets counted"
        );
        assert_eq!(after.bytes, before.bytes + len, "{reason:?}: bytes counted");
        true
    }

    /// Rewrites the endpoint on `ifindex` as the agent does: the table and its bucket.
    pub fn set_endpoint(&mut self, ifindex: u32, info: EndpointInfo) {
        self.endpoints.insert(ifindex, info, 0).expect("endpoint");
        let d = DirectEndpoint {
            ifindex,
            _pad: 0,
            info,
        };
        self.direct
            .set(direct_bucket(ifindex), d, 0)
            .expect("bucket");
    }

    /// The counters of the endpoint on `ifindex` (at the slot its entry names), summed over
    /// the CPUs; the endpoint must be registered.
    pub fn counters(&self, ifindex: u32) -> EndpointCounters {
        let slot = self
            .endpoints
            .get(&ifindex, 0)
            .unwrap_or_else(|e| panic!("no endpoint entry for ifindex {ifindex}: {e}"))
            .slot;
        let mut sum = EndpointCounters::default();
        let per_cpu = self.counters.get(&slot, 0).expect("read counters");
        per_cpu.iter().for_each(|c| sum.accumulate(c));
        sum
    }

    /// Whether `pod` is marked as having flows through the stack.
    pub fn marked(&self, pod: &Pod) -> bool {
        self.stack_eps.get(&pod.slot, 0).expect("read the mark") == STACK_MARKED
    }

    /// Every counter of every slot, summed over the CPUs.
    pub fn all_counters(&self) -> Vec<EndpointCounters> {
        self.counters
            .iter()
            .map(|v| {
                let mut sum = EndpointCounters::default();
                v.expect("read counters")
                    .iter()
                    .for_each(|c| sum.accumulate(c));
                sum
            })
            .collect()
    }

    /// Every drop counter, summed over the CPUs.
    pub fn all_drops(&self) -> Vec<(DropKey, DropCount)> {
        all_drops(&self.drops)
    }

    pub fn dropped(&self, ifindex: u32, reason: DropReason) -> DropCount {
        dropped(&self.drops, ifindex, reason)
    }
}

// ---- Packets of pods ----

/// A packet of the test bed's as a pod's frames.
pub trait PodFrames {
    /// The frame `pod` sends this packet in (to its gateway, the host veth).
    fn sent_by(&self, pod: &Pod) -> Vec<u8>;
    /// The frame the fast path hands `pod`: MACs rewritten, TTL one less.
    fn delivered_to(&self, pod: &Pod) -> Vec<u8>;
}

impl PodFrames for Ip4 {
    fn sent_by(&self, pod: &Pod) -> Vec<u8> {
        eth(HOST_VETH_MAC, pod.mac, ETH_P_IP, &self.bytes())
    }

    fn delivered_to(&self, pod: &Pod) -> Vec<u8> {
        let ip = self.clone().ttl(self.ttl - 1);
        eth(pod.mac, HOST_VETH_MAC, ETH_P_IP, &ip.bytes())
    }
}

/// The frame the fast path hands `pod` for IPv6 packet `ip`: MACs rewritten, hop limit 63.
pub fn delivered_v6(pod: &Pod, ip: &[u8]) -> Vec<u8> {
    let mut f = eth(pod.mac, HOST_VETH_MAC, ETH_P_IPV6, ip);
    f[14 + 7] = 63;
    f
}

/// A flow key as the programs build it (ports in network byte order).
pub fn flow_v4(pod: [u8; 4], peer: [u8; 4], pod_port: u16, peer_port: u16, proto: u8) -> FlowKey {
    let (pod_port, peer_port, family) = (pod_port.to_be(), peer_port.to_be(), 4);
    let mut k = FlowKey {
        pod_port,
        peer_port,
        proto,
        family,
        ..FlowKey::default()
    };
    k.pod[..4].copy_from_slice(&pod);
    k.peer[..4].copy_from_slice(&peer);
    k
}
