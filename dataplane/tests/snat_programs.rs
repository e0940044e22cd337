//! SNAT in the programs, with BPF_PROG_TEST_RUN (see programs.rs for what test_run does with
//! tc programs): `from_pod` translates a natOutgoing pod's TCP, UDP and ICMP echo to the
//! uplink's address and a NAT port and redirects it out through the FIB; `from_host_dev`
//! translates replies and ICMP errors back and redirects them into the pod. Every output
//! frame is compared byte for byte with one built independently (checksums computed from
//! scratch here), and the conntrack map's entries are checked. Needs root.
mod common;

use std::mem::size_of;
use std::os::fd::AsFd;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, PerCpuHashMap};
use aya::programs::SchedClassifier;
use aya::Ebpf;
use std::time::Duration;

use calix_common::{
    CtEntry, CtKey, DropCount, DropKey, DropReason, EndpointInfo, LocalEndpoint, NatConfig,
    CT_DIR_OUT, CT_DIR_REPLY, CT_FREED_MAP, CT_F_FIN, CT_F_RST, CT_F_SEEN, CT_F_SEQ, CT_MAP,
    CT_OWNED_MAP, DROPS_MAP, ENDPOINTS_MAP, EP_HAS_V4, EP_NAT_OUTGOING, HOST_V4_MAP, HOST_VETH_MAC,
    LOCAL_V4_MAP, MAX_NAT_UPLINKS, NAT_CONFIG_MAP, NO_SNAT_V4_MAP, PROG_FROM_HOST_DEV,
    PROG_FROM_POD,
};
use calix_dataplane::nat::{Conntrack, FlowFilter};
use common::*;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const POD: [u8; 4] = [10, 244, 0, 10];
const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 10];
const NODE: [u8; 4] = [192, 0, 2, 1];
const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const GW: [u8; 4] = [192, 0, 2, 9];
const GW_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xfe];
const SERVER: [u8; 4] = [198, 51, 100, 7];
const PORT_MIN: u16 = 20000;

// ---- Checksums and packets, computed from scratch ----

/// The TCP/UDP checksum of `seg` (its checksum field zero) with the IPv4 pseudo header.
fn l4_checksum(src: [u8; 4], dst: [u8; 4], proto: u8, seg: &[u8]) -> u16 {
    let len = u16::try_from(seg.len()).expect("segment length");
    let pseudo = [&src[..], &dst, &[0, proto], &len.to_be_bytes(), seg].concat();
    ipv4_checksum(&pseudo)
}

/// `seg` (TCP or UDP) with its checksum filled in for `src` → `dst`; UDP 0 becomes 0xffff.
fn with_l4_csum(src: [u8; 4], dst: [u8; 4], proto: u8, seg: &[u8]) -> Vec<u8> {
    let at = if proto == TCP { 16 } else { 6 };
    let mut s = seg.to_vec();
    s[at..at + 2].copy_from_slice(&[0, 0]);
    let mut c = l4_checksum(src, dst, proto, &s);
    if proto == UDP && c == 0 {
        c = 0xffff;
    }
    s[at..at + 2].copy_from_slice(&c.to_be_bytes());
    s
}

/// An ICMP message with its checksum filled in.
fn with_icmp_csum(msg: &[u8]) -> Vec<u8> {
    let mut m = msg.to_vec();
    m[2..4].copy_from_slice(&[0, 0]);
    let c = ipv4_checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

/// A TCP segment `sport` → `dport` with `flags` and `payload`, checksum zero.
fn tcp_seg(sport: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let h = [0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0];
    [&sport.to_be_bytes()[..], &dport.to_be_bytes(), &h, payload].concat()
}

/// An ICMP echo (request 8, reply 0) with `id`, checksum filled in.
fn echo(ty: u8, id: u16) -> Vec<u8> {
    with_icmp_csum(&[&[ty, 0, 0, 0][..], &id.to_be_bytes(), &[0, 1], b"abcd"].concat())
}

/// A transport message for `proto` between (`src`, `sport`) and (`dst`, `dport`) with
/// checksums right; ICMP: an echo request (`sport` is the identifier).
fn l4(proto: u8, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
    match proto {
        TCP => with_l4_csum(src, dst, TCP, &tcp_seg(sport, dport, 0x02, b"")),
        UDP => with_l4_csum(src, dst, UDP, &udp_with(sport, dport, b"ping")),
        _ => echo(8, sport),
    }
}

/// The reply to [`l4`]'s message.
fn l4_reply(proto: u8, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
    match proto {
        TCP => with_l4_csum(src, dst, TCP, &tcp_seg(sport, dport, 0x12, b"")),
        UDP => with_l4_csum(src, dst, UDP, &udp_with(sport, dport, b"pong")),
        _ => echo(0, dport),
    }
}

// ---- Harness ----

struct Snat {
    bpf: Ebpf,
    cfg: NatConfig,
    cfg_map: Array<MapData, NatConfig>,
    ct: HashMap<MapData, CtKey, CtEntry>,
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    local: HashMap<MapData, [u8; 4], LocalEndpoint>,
    drops: PerCpuHashMap<MapData, DropKey, DropCount>,
    pod_if: u32,
    uplink_if: u32,
    pins: PinDir,
}

/// In the current (test) namespace: pod veth `cxtpa` registered as a natOutgoing endpoint,
/// uplink `cxtpu` (192.0.2.1/24, gateway 192.0.2.9 with a known MAC, 198.51.100.0/24 via
/// it), SNAT to ports `PORT_MIN..=port_max`, a conntrack table of `ct_entries`.
fn setup(port_max: u16, ct_entries: u32) -> Snat {
    setup_budget(port_max, ct_entries, 0)
}

/// As [`setup`], with a budget of `budget` conntrack flows per endpoint (0: none).
fn setup_budget(port_max: u16, ct_entries: u32, budget: u32) -> Snat {
    let pins = PinDir::new();
    let mut bpf = load_object_sized(&pins, &[(CT_MAP, ct_entries)]);
    let pod_if = veth("cxtpa");
    let uplink_if = veth("cxtpu");
    ip(&["link", "set", "cxtpu", "address", "02:00:00:00:00:01", "up"]);
    ip(&["link", "set", "cxtpup", "up"]);
    ip(&["addr", "add", "192.0.2.1/24", "dev", "cxtpu"]);
    ip(&[
        "neigh",
        "add",
        "192.0.2.9",
        "lladdr",
        "02:00:00:00:00:fe",
        "dev",
        "cxtpu",
    ]);
    ip(&["route", "add", "198.51.100.0/24", "via", "192.0.2.9"]);
    // bpf_fib_lookup wants forwarding on; /proc/sys/net is this thread's namespace's.
    std::fs::write("/proc/sys/net/ipv4/conf/all/forwarding", "1").expect("forwarding");

    let mut endpoints: HashMap<MapData, u32, EndpointInfo> = map(&mut bpf, ENDPOINTS_MAP);
    let info = EndpointInfo {
        ipv4: POD,
        flags: EP_HAS_V4 | EP_NAT_OUTGOING,
        ipv6: [0; 16],
        slot: 3,
        _pad: 0,
    };
    endpoints.insert(pod_if, info, 0).expect("endpoint");
    let mut local: HashMap<MapData, [u8; 4], LocalEndpoint> = map(&mut bpf, LOCAL_V4_MAP);
    let le = LocalEndpoint {
        ifindex: pod_if,
        slot: 3,
        mac: POD_MAC,
        _pad: [0; 2],
    };
    local.insert(POD, le, 0).expect("local");
    let mut no_snat: LpmTrie<MapData, [u8; 4], u32> = map(&mut bpf, NO_SNAT_V4_MAP);
    no_snat
        .insert(&Key::new(16, [10, 244, 0, 0]), 1, 0)
        .expect("no-SNAT pool");
    let mut cfg: Array<MapData, NatConfig> = map(&mut bpf, NAT_CONFIG_MAP);
    let mut uplinks = [0; MAX_NAT_UPLINKS];
    uplinks[0] = uplink_if;
    let s = 1_000_000_000;
    let nat_cfg = NatConfig {
        tcp_established_ns: 3600 * s,
        tcp_syn_ns: 60 * s,
        tcp_closing_ns: 10 * s,
        udp_ns: 60 * s,
        icmp_ns: 30 * s,
        uplinks,
        port_min: PORT_MIN,
        port_max,
        enabled: 1,
        ct_budget: budget,
        tunnel_port: 0,
        _pad: 0,
    };
    cfg.set(0, nat_cfg, 0).expect("NAT config");
    Snat {
        cfg: nat_cfg,
        cfg_map: cfg,
        ct: map(&mut bpf, CT_MAP),
        endpoints,
        local,
        drops: map(&mut bpf, DROPS_MAP),
        bpf,
        pod_if,
        uplink_if,
        pins,
    }
}

impl Snat {
    fn run(&self, prog: &str, ifindex: u32, frame: &[u8]) -> Run {
        // `__sk_buff` up to ifindex (see programs.rs).
        let mut ctx = [0u32; 11];
        ctx[10] = ifindex;
        const _: () = assert!(size_of::<[u32; 11]>() == 44);
        let p: &SchedClassifier = self
            .bpf
            .program(prog)
            .expect("a program")
            .try_into()
            .expect("tc");
        let fd = p.fd().expect("program fd");
        test_run(fd.as_fd(), frame, &ctx).unwrap_or_else(|e| panic!("test_run {prog}: {e}"))
    }

    /// The pod sends `ip`: the frame `from_pod` leaves (asserting a redirect).
    fn snat(&self, ip: &Ip4) -> Vec<u8> {
        let out = self.run(
            PROG_FROM_POD,
            self.pod_if,
            &eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes()),
        );
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "from_pod redirects out");
        out.frame
    }

    /// `ip` arrives on the uplink: the frame `from_host_dev` leaves (asserting a redirect).
    fn reverse(&self, ip: &Ip4) -> Vec<u8> {
        let out = self.run(
            PROG_FROM_HOST_DEV,
            self.uplink_if,
            &eth(UPLINK_MAC, GW_MAC, ETH_P_IP, &ip.bytes()),
        );
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "from_host_dev redirects in");
        out.frame
    }

    fn entry(&self, k: &CtKey) -> Option<CtEntry> {
        self.ct.get(k, 0).ok()
    }

    fn ct_len(&self) -> usize {
        self.ct.keys().filter_map(Result::ok).count()
    }

    fn dropped(&self, reason: DropReason) -> u64 {
        dropped(&self.drops, self.pod_if, reason).packets
    }
}

/// A second natOutgoing pod, 10.244.0.11 behind veth `cxtpb`: its ifindex.
fn add_pod_b(h: &mut Snat) -> u32 {
    let b_if = veth("cxtpb");
    let info = EndpointInfo {
        ipv4: POD_B,
        flags: EP_HAS_V4 | EP_NAT_OUTGOING,
        ipv6: [0; 16],
        slot: 4,
        _pad: 0,
    };
    h.endpoints.insert(b_if, info, 0).expect("endpoint b");
    let le = LocalEndpoint {
        ifindex: b_if,
        slot: 4,
        mac: POD_MAC,
        _pad: [0; 2],
    };
    h.local.insert(POD_B, le, 0).expect("local b");
    b_if
}

const POD_B: [u8; 4] = [10, 244, 0, 11];

fn out_key(proto: u8, sport: u16, dport: u16) -> CtKey {
    CtKey {
        src: POD,
        dst: SERVER,
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        dir: CT_DIR_OUT,
        _pad: [0; 2],
    }
}

fn reply_key(proto: u8, dport: u16, nat_port: u16) -> CtKey {
    CtKey {
        src: SERVER,
        dst: NODE,
        sport: dport.to_be(),
        dport: nat_port.to_be(),
        proto,
        dir: CT_DIR_REPLY,
        _pad: [0; 2],
    }
}

/// One flow out and its reply back, for `proto`: exact frames both ways, conntrack entries.
fn round_trip(h: &Snat, proto: u8, sport: u16, dport: u16) -> u16 {
    let sent = Ip4::new(POD, SERVER, proto, l4(proto, POD, SERVER, sport, dport));
    let dport_key = if proto == ICMP { sport } else { dport };
    let fresh = h.entry(&out_key(proto, sport, dport_key)).is_none();
    let frame = h.snat(&sent);
    // The NAT port the allocator chose, from the flow's original entry.
    let out = h
        .entry(&out_key(proto, sport, dport_key))
        .expect("the flow's original entry");
    assert_eq!(out.addr, NODE, "NAT address: the uplink route's source");
    assert_eq!(
        out.flags & !CT_F_SEQ,
        CT_F_SEEN,
        "TCP also tracks the sequence"
    );
    let nat = u16::from_be(out.port);
    assert!((PORT_MIN..=PORT_MIN + 9).contains(&nat), "NAT port {nat}");
    let (rsport, rdport) = if proto == ICMP {
        (nat, nat)
    } else {
        (dport, nat)
    };
    let rkey = reply_key(proto, rsport, rdport);
    let r = h.entry(&rkey).expect("the flow's reply entry");
    let unanswered = if fresh { 0 } else { CT_F_SEEN };
    assert_eq!(
        (r.addr, u16::from_be(r.port), r.flags & CT_F_SEEN),
        (POD, sport, unanswered)
    );
    // Out: source = node:nat, TTL 63, checksums right, MACs from the FIB.
    let want = Ip4::new(NODE, SERVER, proto, l4(proto, NODE, SERVER, nat, dport)).ttl(63);
    assert_eq!(
        frame,
        eth(GW_MAC, UPLINK_MAC, ETH_P_IP, &want.bytes()),
        "proto {proto}: translated frame"
    );
    // Back: the reply to node:nat goes to pod:sport.
    let reply = Ip4::new(
        SERVER,
        NODE,
        proto,
        l4_reply(proto, SERVER, NODE, dport, nat),
    );
    let frame = h.reverse(&reply);
    let want = Ip4::new(
        SERVER,
        POD,
        proto,
        l4_reply(proto, SERVER, POD, dport, sport),
    )
    .ttl(63);
    assert_eq!(
        frame,
        eth(POD_MAC, HOST_VETH_MAC, ETH_P_IP, &want.bytes()),
        "proto {proto}: reply translated back"
    );
    let r = h.entry(&rkey).expect("the reply entry");
    assert_eq!(r.flags & CT_F_SEEN, CT_F_SEEN, "the flow is answered");
    nat
}

// ---- Tests ----

#[test]
fn tcp_udp_and_icmp_echo_are_translated_both_ways() {
    in_netns(|| {
        let h = setup(PORT_MIN + 9, 1024);
        round_trip(&h, TCP, 40000, 80);
        round_trip(&h, UDP, 40000, 53);
        round_trip(&h, ICMP, 0x4242, 0);
        assert_eq!(h.ct_len(), 6, "two entries per flow");
        // A second packet of the same flow reuses the entries.
        round_trip(&h, UDP, 40000, 53);
        assert_eq!(h.ct_len(), 6);
        assert!(all_drops(&h.drops).is_empty());
    });
}

#[test]
fn udp_zero_checksum_stays_zero() {
    in_netns(|| {
        let h = setup(PORT_MIN + 9, 1024);
        let sent = Ip4::new(POD, SERVER, UDP, udp_with(40001, 53, b"ping"));
        let frame = h.snat(&sent);
        let nat = u16::from_be(
            h.entry(&out_key(UDP, 40001, 53))
                .expect("original entry")
                .port,
        );
        let want = Ip4::new(NODE, SERVER, UDP, udp_with(nat, 53, b"ping")).ttl(63);
        assert_eq!(frame, eth(GW_MAC, UPLINK_MAC, ETH_P_IP, &want.bytes()));
        assert_eq!(frame[14 + 20 + 6..14 + 20 + 8], [0, 0], "no checksum");
        let reply = Ip4::new(SERVER, NODE, UDP, udp_with(53, nat, b"pong"));
        let want = Ip4::new(SERVER, POD, UDP, udp_with(53, 40001, b"pong")).ttl(63);
        assert_eq!(
            h.reverse(&reply),
            eth(POD_MAC, HOST_VETH_MAC, ETH_P_IP, &want.bytes())
        );
    });
}

/// UDP to the VXLAN port (`NatConfig::tunnel_port`) at one of the node's own addresses
/// (`CALIX_HOST_V4`) is the kernel's VXLAN socket's: `from_host_dev` passes it to the stack
/// untouched, before any NAT or Service lookup. Shown with the one thing the agent never lets
/// happen (a tunnel port among the NAT ports: `NatSettings::program_config` leaves it 0):
/// a reply to that NAT port is then no longer translated. Everything else is as before.
#[test]
fn udp_to_the_tunnel_port_at_the_nodes_address_is_left_to_the_stack() {
    in_netns(|| {
        let mut h = setup(PORT_MIN + 9, 1024);
        let nat = round_trip(&h, UDP, 40002, 53);
        let other = round_trip(&h, UDP, 40003, 53);
        assert_ne!(nat, other);
        let reply = |port: u16| Ip4::new(SERVER, NODE, UDP, l4_reply(UDP, SERVER, NODE, 53, port));
        let tunnel = NatConfig {
            tunnel_port: nat.to_be(),
            ..h.cfg
        };
        h.cfg_map.set(0, tunnel, 0).expect("NAT config");
        // Not (yet) known as one of the node's addresses: translated as before.
        round_trip(&h, UDP, 40002, 53);
        let mut host: HashMap<MapData, [u8; 4], u32> = map(&mut h.bpf, HOST_V4_MAP);
        host.insert(NODE, 1, 0).expect("host address");
        let frame = eth(UPLINK_MAC, GW_MAC, ETH_P_IP, &reply(nat).bytes());
        let out = h.run(PROG_FROM_HOST_DEV, h.uplink_if, &frame);
        assert_eq!(
            (out.verdict, &out.frame),
            (TC_ACT_OK, &frame),
            "the tunnel's port at the node's address: to the stack, unchanged"
        );
        // To a pod, the same port goes straight in.
        let to_pod = Ip4::new(SERVER, POD, UDP, l4_reply(UDP, SERVER, POD, 53, nat));
        let out = h.run(
            PROG_FROM_HOST_DEV,
            h.uplink_if,
            &eth(UPLINK_MAC, GW_MAC, ETH_P_IP, &to_pod.bytes()),
        );
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "to a pod: delivered");
        // Another port, or TCP: translated.
        round_trip(&h, UDP, 40003, 53);
        round_trip(&h, TCP, 40002, 80);
        // No tunnel port: translated again.
        h.cfg_map.set(0, h.cfg, 0).expect("NAT config");
        round_trip(&h, UDP, 40002, 53);
        assert!(all_drops(&h.drops).is_empty());
    });
}

/// An ICMP error from `GW` about the translated `quoted` packet (node → server).
fn icmp_error(ty: u8, code: u8, mtu: u16, quoted: &[u8]) -> Ip4 {
    let msg = [&[ty, code, 0, 0, 0, 0][..], &mtu.to_be_bytes(), quoted].concat();
    Ip4::new(GW, NODE, ICMP, with_icmp_csum(&msg))
}

#[test]
fn icmp_errors_about_translated_flows_go_back_to_the_pod() {
    in_netns(|| {
        let h = setup(PORT_MIN + 9, 1024);
        for (proto, sport, dport) in [(UDP, 40002, 53), (TCP, 40003, 443), (ICMP, 0x77, 0)] {
            let sent = Ip4::new(POD, SERVER, proto, l4(proto, POD, SERVER, sport, dport));
            let translated = h.snat(&sent);
            let nat_key = if proto == ICMP { sport } else { dport };
            let nat = u16::from_be(
                h.entry(&out_key(proto, sport, nat_key))
                    .expect("entry")
                    .port,
            );
            // The router quotes the whole translated packet (as it left: TTL 63).
            let quoted = &translated[14..];
            let (ty, code, mtu) = if proto == TCP {
                (3, 4, 1400)
            } else {
                (3, 3, 0)
            };
            let err = icmp_error(ty, code, mtu, quoted);
            let frame = h.reverse(&err);
            // What the pod must see: the error about its own packet, every checksum right.
            let inner = Ip4::new(POD, SERVER, proto, l4(proto, POD, SERVER, sport, dport))
                .ttl(63)
                .bytes();
            let msg = [&[ty, code, 0, 0, 0, 0][..], &mtu.to_be_bytes(), &inner].concat();
            let want = Ip4::new(GW, POD, ICMP, with_icmp_csum(&msg)).ttl(63);
            assert_eq!(
                frame,
                eth(POD_MAC, HOST_VETH_MAC, ETH_P_IP, &want.bytes()),
                "proto {proto}: ICMP error translated (NAT port {nat})"
            );
        }
        // An error about a flow nobody translated is not ours: it goes to the stack.
        let stray = Ip4::new(NODE, SERVER, UDP, l4(UDP, NODE, SERVER, 20005, 9)).bytes();
        let err = icmp_error(3, 3, 0, &stray);
        let frame = eth(UPLINK_MAC, GW_MAC, ETH_P_IP, &err.bytes());
        let out = h.run(PROG_FROM_HOST_DEV, h.uplink_if, &frame);
        assert_eq!((out.verdict, out.frame), (TC_ACT_OK, frame));
    });
}

#[test]
fn two_pods_same_source_port_same_destination_get_two_nat_ports() {
    in_netns(|| {
        let mut h = setup(PORT_MIN + 9, 1024);
        let (pod_b, b_if) = (POD_B, add_pod_b(&mut h));
        let a = round_trip(&h, UDP, 5353, 53);
        let sent = Ip4::new(pod_b, SERVER, UDP, l4(UDP, pod_b, SERVER, 5353, 53));
        let out = h.run(
            PROG_FROM_POD,
            b_if,
            &eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &sent.bytes()),
        );
        assert_eq!(out.verdict, TC_ACT_REDIRECT);
        let b = u16::from_be_bytes([out.frame[14 + 20], out.frame[14 + 21]]);
        assert_ne!(a, b, "the second pod's flow got another NAT port");
        let rb = h.entry(&reply_key(UDP, 53, b)).expect("b's reply entry");
        assert_eq!((rb.addr, u16::from_be(rb.port)), (pod_b, 5353));
        let ra = h.entry(&reply_key(UDP, 53, a)).expect("a's reply entry");
        assert_eq!((ra.addr, u16::from_be(ra.port)), (POD, 5353));
        h.ct.remove(&reply_key(UDP, 53, b)).expect("tidy");
    });
}

#[test]
fn a_full_table_and_exhausted_ports_are_counted_drops() {
    in_netns(|| {
        // Room for two flows.
        let h = setup(PORT_MIN + 9, 4);
        for sport in [41000, 41001] {
            round_trip(&h, UDP, sport, 53);
        }
        let third = Ip4::new(POD, SERVER, UDP, l4(UDP, POD, SERVER, 41002, 53));
        let sent = eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &third.bytes());
        let out = h.run(PROG_FROM_POD, h.pod_if, &sent);
        assert_eq!(
            out.verdict, TC_ACT_SHOT,
            "a full table refuses the new flow"
        );
        assert_eq!(h.dropped(DropReason::ConntrackFull), 1);
        assert_eq!(h.ct_len(), 4, "nothing half-written");
        // Established flows keep working.
        round_trip(&h, UDP, 41000, 53);
    });
    in_netns(|| {
        // Two NAT ports, a big table: the third flow to the same destination finds no port.
        let h = setup(PORT_MIN + 1, 1024);
        let ports: Vec<u16> = [42000, 42001]
            .into_iter()
            .map(|s| round_trip(&h, UDP, s, 53))
            .collect();
        assert_ne!(ports[0], ports[1]);
        let third = Ip4::new(POD, SERVER, UDP, l4(UDP, POD, SERVER, 42002, 53));
        let sent = eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &third.bytes());
        assert_eq!(h.run(PROG_FROM_POD, h.pod_if, &sent).verdict, TC_ACT_SHOT);
        assert_eq!(h.dropped(DropReason::NatPortsExhausted), 1);
        // Another destination port is another tuple: the same NAT ports are free for it.
        round_trip(&h, UDP, 42002, 54);
    });
}

#[test]
fn tcp_fin_and_rst_close_flows_and_free_their_ports() {
    in_netns(|| {
        // One NAT port: a second connection to the same server needs the first one's.
        let h = setup(PORT_MIN, 1024);
        let nat = round_trip(&h, TCP, 43000, 80);
        let send = |sport: u16, flags: u8| {
            let seg = with_l4_csum(POD, SERVER, TCP, &tcp_seg(sport, 80, flags, b""));
            let ip = Ip4::new(POD, SERVER, TCP, seg);
            h.run(
                PROG_FROM_POD,
                h.pod_if,
                &eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes()),
            )
        };
        assert_eq!(send(43001, 0x02).verdict, TC_ACT_SHOT, "port taken");
        assert_eq!(h.dropped(DropReason::NatPortsExhausted), 1);
        // FIN from the pod, FIN from the server: closed.
        assert_eq!(send(43000, 0x11).verdict, TC_ACT_REDIRECT);
        let fin = with_l4_csum(SERVER, NODE, TCP, &tcp_seg(80, nat, 0x11, b""));
        h.reverse(&Ip4::new(SERVER, NODE, TCP, fin));
        let o = h.entry(&out_key(TCP, 43000, 80)).expect("original entry");
        let r = h.entry(&reply_key(TCP, 80, nat)).expect("reply entry");
        let closing = CT_F_SEEN | CT_F_FIN | CT_F_RST;
        assert_eq!(
            (o.flags & closing, r.flags & closing),
            (CT_F_SEEN | CT_F_FIN, CT_F_SEEN | CT_F_FIN)
        );
        // Now the new connection takes the port over; the old flow's entries are gone.
        assert_eq!(send(43001, 0x02).verdict, TC_ACT_REDIRECT);
        assert!(h.entry(&out_key(TCP, 43000, 80)).is_none());
        let r = h.entry(&reply_key(TCP, 80, nat)).expect("reply entry");
        assert_eq!(u16::from_be(r.port), 43001);
        // RST from the server closes too (refusing the SYN, sequence 1: it acknowledges 2).
        let refuse = tcp_at(80, nat, 0, 2, RST | ACK, 0, &[], b"");
        let rst = with_l4_csum(SERVER, NODE, TCP, &refuse);
        h.reverse(&Ip4::new(SERVER, NODE, TCP, rst));
        let r = h.entry(&reply_key(TCP, 80, nat)).expect("reply entry");
        assert_eq!(r.flags & CT_F_RST, CT_F_RST);
        assert_eq!(send(43002, 0x02).verdict, TC_ACT_REDIRECT, "port reused");
    });
}

#[test]
fn what_snat_leaves_alone() {
    in_netns(|| {
        let h = setup(PORT_MIN + 9, 1024);
        let passes = |ip: Ip4| {
            let sent = eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes());
            let out = h.run(PROG_FROM_POD, h.pod_if, &sent);
            assert_eq!(
                (out.verdict, &out.frame),
                (TC_ACT_OK, &sent),
                "to the stack"
            );
        };
        // A pool destination (no route here either way), another protocol, a fragment, a
        // TTL about to expire, a destination not routed out of the uplink.
        passes(Ip4::new(
            POD,
            [10, 244, 9, 9],
            UDP,
            l4(UDP, POD, [10, 244, 9, 9], 1, 2),
        ));
        passes(Ip4::new(POD, SERVER, 47, vec![0; 8]));
        // A SYN-ACK answers a connection from outside (routed to the pod itself): never a
        // new SNAT flow.
        let synack = with_l4_csum(POD, SERVER, TCP, &tcp_seg(8443, 50000, 0x12, b""));
        passes(Ip4::new(POD, SERVER, TCP, synack));
        passes(Ip4::new(POD, SERVER, UDP, l4(UDP, POD, SERVER, 1, 2)).frag(0x2000));
        passes(Ip4::new(POD, SERVER, UDP, l4(UDP, POD, SERVER, 1, 2)).ttl(1));
        passes(Ip4::new(
            POD,
            [203, 0, 113, 1],
            UDP,
            l4(UDP, POD, [203, 0, 113, 1], 1, 2),
        ));
        assert_eq!(h.ct_len(), 0, "no entries");
        // Replies on the uplink that match no flow: the stack's, untouched.
        let stray = Ip4::new(SERVER, NODE, UDP, l4(UDP, SERVER, NODE, 53, PORT_MIN));
        let frame = eth(UPLINK_MAC, GW_MAC, ETH_P_IP, &stray.bytes());
        let out = h.run(PROG_FROM_HOST_DEV, h.uplink_if, &frame);
        assert_eq!((out.verdict, out.frame), (TC_ACT_OK, frame));
    });
}

/// A TCP segment with every field chosen (checksum zero): `opts` a multiple of 4 bytes.
#[allow(clippy::too_many_arguments)]
fn tcp_at(
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
    win: u16,
    opts: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    assert!(opts.len().is_multiple_of(4) && opts.len() <= 40);
    let doff = ((20 + opts.len()) / 4) as u8;
    [
        &sport.to_be_bytes()[..],
        &dport.to_be_bytes(),
        &seq.to_be_bytes(),
        &ack.to_be_bytes(),
        &[doff << 4, flags],
        &win.to_be_bytes(),
        &[0, 0, 0, 0],
        opts,
        payload,
    ]
    .concat()
}

/// SYN options as Linux sends them: MSS 1460, SACK permitted, timestamps, window scale 7.
const SYN_OPTS: [u8; 20] = [
    2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7,
];

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;

impl Snat {
    /// The pod sends a TCP segment on (`sport` → SERVER:443): from_pod's verdict.
    fn pod_tcp(&self, sport: u16, seq: u32, ack: u32, flags: u8, win: u16, opts: &[u8]) -> u32 {
        let seg = tcp_at(sport, 443, seq, ack, flags, win, opts, b"");
        let ip = Ip4::new(POD, SERVER, TCP, with_l4_csum(POD, SERVER, TCP, &seg));
        let frame = eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes());
        self.run(PROG_FROM_POD, self.pod_if, &frame).verdict
    }

    /// The server sends a TCP segment to NODE:`nat`: from_host_dev's verdict.
    #[allow(clippy::too_many_arguments)]
    fn server_tcp(
        &self,
        nat: u16,
        seq: u32,
        ack: u32,
        flags: u8,
        win: u16,
        opts: &[u8],
        payload: &[u8],
    ) -> u32 {
        let seg = tcp_at(443, nat, seq, ack, flags, win, opts, payload);
        let ip = Ip4::new(SERVER, NODE, TCP, with_l4_csum(SERVER, NODE, TCP, &seg));
        let frame = eth(UPLINK_MAC, GW_MAC, ETH_P_IP, &ip.bytes());
        self.run(PROG_FROM_HOST_DEV, self.uplink_if, &frame).verdict
    }

    fn nat_port_of(&self, sport: u16) -> u16 {
        let o = self
            .entry(&out_key(TCP, sport, 443))
            .expect("original entry");
        u16::from_be(o.port)
    }

    fn reply_flags(&self, nat: u16) -> u16 {
        self.entry(&reply_key(TCP, 443, nat))
            .expect("reply entry")
            .flags
    }

    fn uplink_dropped(&self, reason: DropReason) -> u64 {
        dropped(&self.drops, self.uplink_if, reason).packets
    }
}

/// A RST closes a translated flow only when its sequence number is in the window (as
/// netfilter's conntrack and RFC 5961 judge it): a blind attacker outside who knows (or
/// guesses) the NAT tuple cannot tear the flow down and free its port. Out-of-window RSTs are
/// dropped and counted (`ct_rst_out_of_window`), either way.
#[test]
fn a_rst_closes_a_flow_only_in_window() {
    in_netns(|| {
        let h = setup(PORT_MIN + 9, 1024);
        // Handshake: pod ISN 1000, server ISN 500000, both with window scale 7.
        assert_eq!(
            h.pod_tcp(44000, 1000, 0, SYN, 64240, &SYN_OPTS),
            TC_ACT_REDIRECT
        );
        let nat = h.nat_port_of(44000);
        let synack = h.server_tcp(nat, 500_000, 1001, SYN | ACK, 65160, &SYN_OPTS, b"");
        assert_eq!(synack, TC_ACT_REDIRECT);
        // The pod's window: 502 << 7 = 64256 bytes.
        assert_eq!(
            h.pod_tcp(44000, 1001, 500_001, ACK, 502, &[]),
            TC_ACT_REDIRECT
        );
        let data = [0x61u8; 1000];
        let sent = h.server_tcp(nat, 500_001, 1001, ACK | PSH, 509, &[], &data);
        assert_eq!(sent, TC_ACT_REDIRECT);
        // The server's next sequence number is now 501001.
        let blind = [
            501_001u32.wrapping_add(0x4000_0000),
            501_001 + 64_256 + 1,
            501_001 - 64_256 - 1,
            0,
        ];
        for seq in blind {
            assert_eq!(
                h.server_tcp(nat, seq, 0, RST, 0, &[], b""),
                TC_ACT_SHOT,
                "RST with sequence {seq}: out of window"
            );
        }
        assert_eq!(h.uplink_dropped(DropReason::ConntrackRstInvalid), 4);
        assert_eq!(h.reply_flags(nat) & CT_F_RST, 0, "the flow is not closed");
        // The pod's own RST out of window is refused alike.
        assert_eq!(h.pod_tcp(44000, 90_000, 0, RST, 0, &[]), TC_ACT_SHOT);
        assert_eq!(h.dropped(DropReason::ConntrackRstInvalid), 1);
        // In the window (the receiver would accept it): the flow closes.
        let rst = h.server_tcp(nat, 501_001 + 100, 0, RST, 0, &[], b"");
        assert_eq!(rst, TC_ACT_REDIRECT);
        assert_eq!(h.reply_flags(nat) & CT_F_RST, CT_F_RST);

        // A connection refused: before the server has sent anything, only a RST that
        // acknowledges the pod's SYN is one (RFC 793, SYN-SENT).
        assert_eq!(
            h.pod_tcp(44001, 7000, 0, SYN, 64240, &SYN_OPTS),
            TC_ACT_REDIRECT
        );
        let nat1 = h.nat_port_of(44001);
        for (ack, flags) in [(7000, RST | ACK), (7002, RST | ACK), (0, RST)] {
            assert_eq!(
                h.server_tcp(nat1, 0, ack, flags, 0, &[], b""),
                TC_ACT_SHOT,
                "RST (flags {flags:#x}, ack {ack}) does not acknowledge the SYN"
            );
        }
        assert_eq!(h.reply_flags(nat1) & CT_F_RST, 0);
        assert_eq!(
            h.server_tcp(nat1, 0, 7001, RST | ACK, 0, &[], b""),
            TC_ACT_REDIRECT
        );
        assert_eq!(h.reply_flags(nat1) & CT_F_RST, CT_F_RST);

        // A RST answering the other side's latest segment carries that segment's
        // acknowledgement number (RFC 793): the pod's socket in SYN-SENT refusing the ACK a
        // server still holding an old connection on this tuple sends. It passes, so the old
        // connection goes and the pod's next SYN gets through.
        assert_eq!(
            h.pod_tcp(44002, 9000, 0, SYN, 64240, &SYN_OPTS),
            TC_ACT_REDIRECT
        );
        let nat2 = h.nat_port_of(44002);
        let stale = h.server_tcp(nat2, 777_000, 123_456, ACK, 500, &[], b"");
        assert_eq!(stale, TC_ACT_REDIRECT);
        assert_eq!(h.pod_tcp(44002, 123_456, 0, RST, 0, &[]), TC_ACT_REDIRECT);
        let o = h.entry(&out_key(TCP, 44002, 443)).expect("original entry");
        assert_eq!(o.flags & CT_F_RST, CT_F_RST);
        assert_eq!(
            h.dropped(DropReason::ConntrackRstInvalid),
            1,
            "no more drops"
        );
    });
}

impl Snat {
    /// `pod` (behind `ifindex`) sends a UDP datagram `sport` → SERVER:53: the verdict.
    fn udp_from(&self, pod: [u8; 4], ifindex: u32, sport: u16) -> u32 {
        let ip = Ip4::new(pod, SERVER, UDP, l4(UDP, pod, SERVER, sport, 53));
        let frame = eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes());
        self.run(PROG_FROM_POD, ifindex, &frame).verdict
    }

    fn conntrack(&self) -> Conntrack {
        Conntrack::open(&self.pins.0).expect("open the pinned conntrack table")
    }
}

/// One endpoint holds at most its budget of flows: the next new flow is dropped and counted
/// (`conntrack_budget`), another endpoint is not affected, established flows go on, and a
/// flow the agent removes (its cleaner, `calixctl bpf conntrack --flush`) or the programs
/// reclaim gives the endpoint room again.
#[test]
fn an_endpoint_holds_at_most_its_budget_of_flows() {
    in_netns(|| {
        let mut h = setup_budget(PORT_MIN + 99, 1024, 3);
        let b_if = add_pod_b(&mut h);
        for sport in 1000..1003 {
            assert_eq!(h.udp_from(POD, h.pod_if, sport), TC_ACT_REDIRECT);
        }
        assert_eq!(h.udp_from(POD, h.pod_if, 1003), TC_ACT_SHOT, "over budget");
        assert_eq!(h.dropped(DropReason::ConntrackBudget), 1);
        assert_eq!(
            h.udp_from(POD, h.pod_if, 1000),
            TC_ACT_REDIRECT,
            "established"
        );
        assert_eq!(
            h.udp_from(POD_B, b_if, 1003),
            TC_ACT_REDIRECT,
            "another pod"
        );
        assert_eq!(h.ct_len(), 8);
        // The agent removes one of the pod's flows: room for one more.
        let flush = FlowFilter {
            port: Some(1001),
            ..FlowFilter::default()
        };
        assert_eq!(h.conntrack().flush(&h.cfg, &flush), 1);
        assert_eq!(h.udp_from(POD, h.pod_if, 1003), TC_ACT_REDIRECT);
        assert_eq!(h.udp_from(POD, h.pod_if, 1004), TC_ACT_SHOT);
        assert_eq!(h.dropped(DropReason::ConntrackBudget), 2);
    });
}

/// When the table is three quarters full the cleaner removes unanswered flows (a SYN flood,
/// a UDP spray) after `pressure_unanswered_secs` instead of their usual timeouts, so answered
/// flows keep their room and other pods can open new ones; the sprayer's budget is settled.
#[test]
fn under_pressure_unanswered_flows_go_first() {
    in_netns(|| {
        let mut h = setup(PORT_MIN + 99, 16);
        let b_if = add_pod_b(&mut h);
        // Pod B: a TCP connection, handshake completed.
        let syn = with_l4_csum(
            POD_B,
            SERVER,
            TCP,
            &tcp_at(5000, 443, 1, 0, SYN, 1000, &[], b""),
        );
        let frame = |ip: Ip4| eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes());
        let run = h.run(
            PROG_FROM_POD,
            b_if,
            &frame(Ip4::new(POD_B, SERVER, TCP, syn)),
        );
        assert_eq!(run.verdict, TC_ACT_REDIRECT);
        let nat = u16::from_be_bytes([run.frame[14 + 20], run.frame[14 + 21]]);
        assert_eq!(
            h.server_tcp(nat, 9, 2, SYN | ACK, 1000, &[], b""),
            TC_ACT_REDIRECT
        );
        let ack = with_l4_csum(
            POD_B,
            SERVER,
            TCP,
            &tcp_at(5000, 443, 2, 10, ACK, 1000, &[], b""),
        );
        let run = h.run(
            PROG_FROM_POD,
            b_if,
            &frame(Ip4::new(POD_B, SERVER, TCP, ack)),
        );
        assert_eq!(run.verdict, TC_ACT_REDIRECT);
        // The pod sprays 5 UDP flows nobody answers: 12 of 16 entries.
        for sport in 2000..2005 {
            assert_eq!(h.udp_from(POD, h.pod_if, sport), TC_ACT_REDIRECT);
        }
        // Without pressure nothing has expired yet.
        let mut ct = h.conntrack();
        let calm = ct.clean(&h.cfg, Duration::ZERO);
        assert_eq!((calm.entries, calm.pressure), (12, true));
        assert_eq!(calm.removed, 10, "the 5 unanswered flows went");
        assert_eq!(h.ct_len(), 2, "the answered connection stays");
        // Its room is back: pod B opens another flow, and the sprayer's budget is settled.
        assert_eq!(h.udp_from(POD_B, b_if, 5001), TC_ACT_REDIRECT);
        let below = ct.clean(&h.cfg, Duration::ZERO);
        assert_eq!(
            (below.entries, below.pressure, below.removed),
            (4, false, 0)
        );
        let owned: HashMap<MapData, u32, u32> = map(&mut h.bpf, CT_OWNED_MAP);
        let freed: HashMap<MapData, u32, u32> = map(&mut h.bpf, CT_FREED_MAP);
        assert_eq!(owned.get(&h.pod_if, 0).ok(), Some(5));
        assert_eq!(freed.get(&h.pod_if, 0).ok(), Some(5));
        assert_eq!(owned.get(&b_if, 0).ok(), Some(2));
        assert!(freed.get(&b_if, 0).is_err());
    });
}

/// A flow's packets run on two CPUs at once (a delayed ACK and the FIN; the server's ACK of
/// the pod's FIN and its own FIN): neither may lose the other's flag bit. A FIN lost that way
/// kept a closed flow, and its NAT port, for the established timeout (6 h by default). Here
/// CPU 0 sends the pod's SYN again and again (each one rewrites the entry's window scale
/// state) while CPU 1, round after round, clears the entry's FIN bit, sends the pod's FIN and
/// looks: the bit must be there, every round. With plain read-modify-writes of the flags,
/// 9 to 40 of some 90,000 rounds in a second lost it.
#[test]
fn a_fin_is_never_lost_to_a_packet_of_the_flow_on_another_cpu() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    in_netns(|| {
        let cpus = aya::util::nr_cpus().expect("number of CPUs");
        assert!(
            cpus >= 2,
            "two CPUs needed to race two packets, {cpus} here"
        );
        let mut h = setup(PORT_MIN + 9, 1024);
        let sport = 43100;
        assert_eq!(
            h.pod_tcp(sport, 1, 0, SYN, 1000, &SYN_OPTS),
            TC_ACT_REDIRECT
        );
        let nat = h.nat_port_of(sport);
        assert_eq!(
            h.server_tcp(nat, 9, 2, SYN | ACK, 1000, &SYN_OPTS, b""),
            TC_ACT_REDIRECT
        );
        assert_eq!(h.pod_tcp(sport, 2, 10, ACK, 1000, &[]), TC_ACT_REDIRECT);
        let frame = |seq: u32, ack: u32, flags: u8, opts: &[u8]| {
            let seg = tcp_at(sport, 443, seq, ack, flags, 1000, opts, b"");
            let ip = Ip4::new(POD, SERVER, TCP, with_l4_csum(POD, SERVER, TCP, &seg));
            eth(HOST_VETH_MAC, POD_MAC, ETH_P_IP, &ip.bytes())
        };
        let (syn, fin) = (frame(1, 0, SYN, &SYN_OPTS), frame(2, 10, FIN | ACK, &[]));
        let prog: &SchedClassifier = h
            .bpf
            .program(PROG_FROM_POD)
            .expect("from_pod")
            .try_into()
            .expect("tc");
        let fd = prog
            .fd()
            .expect("fd")
            .as_fd()
            .try_clone_to_owned()
            .expect("dup");
        let mut ctx = [0u32; 11];
        ctx[10] = h.pod_if;
        let key = out_key(TCP, sport, 443);
        let pin = |cpu: usize| {
            let mut set = nix::sched::CpuSet::new();
            set.set(cpu)
                .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set))
                .map_err(|e| format!("pinning to CPU {cpu}: {e}"))
        };
        let send = |frame: &[u8]| match test_run(fd.as_fd(), frame, &ctx) {
            Ok(r) if r.verdict == TC_ACT_REDIRECT => Ok(()),
            Ok(r) => Err(format!("verdict {}", r.verdict)),
            Err(e) => Err(format!("test_run: {e}")),
        };
        // Nothing in the scope panics before `stop` is set: the SYN sender would spin on.
        let stop = AtomicBool::new(false);
        let (syns, rounds, lost, fins) = std::thread::scope(|s| {
            let syns = s.spawn(|| {
                pin(0)?;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    send(&syn)?;
                    n += 1;
                }
                Ok::<u64, String>(n)
            });
            let mut fins = pin(1);
            let (mut rounds, mut lost) = (0u64, 0u64);
            let deadline = Instant::now() + Duration::from_secs(1);
            while fins.is_ok() && Instant::now() < deadline {
                let mut o = h.entry(&key).unwrap_or_default();
                o.flags &= !CT_F_FIN;
                fins =
                    h.ct.insert(key, o, 0)
                        .map_err(|e| format!("clearing FIN: {e}"))
                        .and_then(|()| send(&fin));
                let o = h.entry(&key).unwrap_or_default();
                lost += u64::from(o.flags & CT_F_FIN == 0);
                rounds += 1;
            }
            stop.store(true, Ordering::Relaxed);
            let syns = syns
                .join()
                .unwrap_or_else(|_| Err("the SYN sender panicked".into()));
            (syns, rounds, lost, fins)
        });
        let syns = syns.expect("CPU 0's SYNs");
        fins.expect("CPU 1's FINs");
        assert!(syns > 1000 && rounds > 1000, "{syns} SYNs, {rounds} rounds");
        assert_eq!(
            lost, 0,
            "the FIN bit lost in {lost} of {rounds} rounds ({syns} SYNs)"
        );
    });
}
