//! The uplink's XDP prefilter (`xdp_host_dev`) run from userspace with BPF_PROG_TEST_RUN on
//! crafted frames, its maps written by the agent's own code (`XdpFilter::set_policy`): deny
//! list by source, failsafe ports, malformed headers, non-IP. Needs root, like `programs.rs`
//! (whose environment it shares: a network namespace and a pin directory per test).
//!
//! What test_run does with an XDP program (net/bpf/test_run.c, `bpf_prog_test_run_xdp`): the
//! context is a `struct xdp_md` whose `data` must be 0 (no metadata) and `data_end` the frame's
//! size; `ingress_ifindex` may name an interface of the caller's network namespace (the drop
//! counters are keyed on it; `egress_ifindex` must stay 0). Unlike tc programs on Linux 6.18,
//! whose test_run builds an skb and refuses an IPv4/IPv6 header shorter than its fixed size,
//! XDP test_run only refuses frames shorter than an Ethernet header (`bpf_test_init`: EINVAL
//! below ETH_HLEN): truncated IP headers reach the program, and are checked here. Verdicts are
//! only returned, never acted on.
mod common;

use std::os::fd::AsFd;

use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{HashMap, Map, MapData, PerCpuHashMap};
use aya::programs::Xdp;
use aya::Ebpf;
use calix_common::{
    DropCount, DropKey, DropReason, FailsafePort, DENY_V4_MAP, DROPS_MAP, FAILSAFE_MAP,
    PROG_XDP_HOST_DEV,
};
use calix_dataplane::host_addrs::HostAddrs;
use calix_dataplane::xdp::{parse_deny, Failsafe, XdpFilter, XdpPolicy};
use common::*;

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;

/// `struct xdp_md`: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
type XdpMd = [u32; 6];

const UPLINK_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const ROUTER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xfe];

/// 192.0.2.0/24 and 2001:db8:bad::/48 are denied; tcp:22, udp:53 and tcp:9091 are failsafe.
const DENY: [&str; 2] = ["192.0.2.0/24", "2001:db8:bad::/48"];
const FAILSAFE: [&str; 3] = ["tcp:22", "udp:53", "tcp:9091"];
const DENIED_V4: [u8; 4] = [192, 0, 2, 7];
const ALLOWED_V4: [u8; 4] = [198, 51, 100, 1];
const NODE_V4: [u8; 4] = [10, 99, 0, 1];

fn policy(deny: &[&str], failsafe: &[&str]) -> XdpPolicy {
    XdpPolicy {
        deny: deny
            .iter()
            .map(|d| parse_deny(d).expect("a CIDR"))
            .collect(),
        failsafe: failsafe
            .iter()
            .map(|f| f.parse::<Failsafe>().expect("a port"))
            .collect(),
    }
}

fn node_addresses(a: &[std::net::IpAddr]) -> std::collections::BTreeSet<std::net::IpAddr> {
    a.iter().copied().collect()
}

fn v6(prefix: [u16; 3], last: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    for (i, w) in prefix.iter().enumerate() {
        a[2 * i..2 * i + 2].copy_from_slice(&w.to_be_bytes());
    }
    a[15] = last;
    a
}

fn denied_v6() -> [u8; 16] {
    v6([0x2001, 0xdb8, 0xbad], 1)
}

fn allowed_v6() -> [u8; 16] {
    v6([0x2001, 0xdb8, 0x600d], 1)
}

fn node_v6() -> [u8; 16] {
    v6([0xfd00, 0, 0], 1)
}

/// A frame from the router to the node's uplink.
fn from_router(ethertype: u16, payload: &[u8]) -> Vec<u8> {
    eth(UPLINK_MAC, ROUTER_MAC, ethertype, payload)
}

fn v4_frame(src: [u8; 4], proto: u8, l4: Vec<u8>) -> Vec<u8> {
    from_router(ETH_P_IP, &Ip4::new(src, NODE_V4, proto, l4).bytes())
}

fn v6_frame(src: [u8; 16], next: u8, l4: &[u8]) -> Vec<u8> {
    from_router(ETH_P_IPV6, &ip6(src, node_v6(), next, l4))
}

/// The object loaded, the prefilter's policy and the node's addresses written by the agent's
/// code, an uplink veth.
struct Harness {
    bpf: Ebpf,
    filter: XdpFilter,
    host: HostAddrs,
    drops: PerCpuHashMap<MapData, DropKey, DropCount>,
    uplink: u32,
    pins: PinDir,
}

fn setup() -> Harness {
    let pins = PinDir::new();
    let mut bpf = load_object(&pins);
    let mut filter = XdpFilter::open(&mut bpf).expect("the prefilter's maps");
    filter
        .set_policy(&policy(&DENY, &FAILSAFE))
        .expect("write the policy");
    let mut host = HostAddrs::open(&mut bpf).expect("the node-address maps");
    host.set(&node_addresses(&[NODE_V4.into(), node_v6().into()]))
        .expect("write the node's addresses");
    Harness {
        drops: map(&mut bpf, DROPS_MAP),
        bpf,
        filter,
        host,
        uplink: veth("cxtxu"),
        pins,
    }
}

impl Harness {
    fn try_run(&self, frame: &[u8]) -> std::io::Result<Run> {
        let prog: &Xdp = self
            .bpf
            .program(PROG_XDP_HOST_DEV)
            .expect("the XDP program")
            .try_into()
            .expect("an XDP program");
        let size = u32::try_from(frame.len()).expect("frame size");
        let ctx: XdpMd = [0, size, 0, self.uplink, 0, 0];
        let fd = prog.fd().expect("program fd");
        test_run(fd.as_fd(), frame, &ctx)
    }

    #[track_caller]
    fn verdict(&self, frame: &[u8]) -> u32 {
        let run = self
            .try_run(frame)
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of xdp_host_dev: {e}"));
        assert_eq!(run.frame, frame, "the frame is never changed");
        run.verdict
    }

    #[track_caller]
    fn passes(&self, frame: &[u8]) {
        assert_eq!(self.verdict(frame), XDP_PASS, "verdict: pass");
    }

    /// Asserts that `frame` is dropped and counted once, with its size, under `reason` on the
    /// uplink.
    #[track_caller]
    fn drops_as(&self, frame: &[u8], reason: DropReason) {
        let before = dropped(&self.drops, self.uplink, reason);
        assert_eq!(self.verdict(frame), XDP_DROP, "{reason:?}: verdict");
        let after = dropped(&self.drops, self.uplink, reason);
        assert_eq!(after.packets, before.packets + 1, "{reason:?}: packets");
        assert_eq!(
            after.bytes,
            before.bytes + frame.len() as u64,
            "{reason:?}: bytes"
        );
    }

    /// The reasons counted so far (every key is on the uplink).
    fn reasons(&self) -> Vec<u32> {
        let drops = all_drops(&self.drops);
        assert!(drops.iter().all(|(k, _)| k.ifindex == self.uplink));
        let mut r: Vec<u32> = drops.iter().map(|(k, _)| k.reason).collect();
        r.sort();
        r
    }
}

#[test]
fn a_denied_source_is_dropped_and_counted_unless_to_a_failsafe_port() {
    in_netns(|| {
        let h = setup();
        let ping = v4_frame(DENIED_V4, ICMP, icmp(8, 7));
        h.drops_as(&ping, DropReason::XdpDenied);
        h.drops_as(&ping, DropReason::XdpDenied);
        // Failsafe: ssh, DNS, the agent's metrics, by protocol and port.
        h.passes(&v4_frame(DENIED_V4, TCP, tcp_syn(40000, 22)));
        h.passes(&v4_frame(DENIED_V4, UDP, udp(40000, 53)));
        h.passes(&v4_frame(DENIED_V4, TCP, tcp_syn(40000, 9091)));
        // The same ports with the other protocol, a port next to them, a source port of 22.
        for frame in [
            v4_frame(DENIED_V4, UDP, udp(40000, 22)),
            v4_frame(DENIED_V4, TCP, tcp_syn(40000, 53)),
            v4_frame(DENIED_V4, TCP, tcp_syn(40000, 23)),
            v4_frame(DENIED_V4, TCP, tcp_syn(22, 80)),
        ] {
            h.drops_as(&frame, DropReason::XdpDenied);
        }
        // Sources outside the deny list pass, whatever they send.
        h.passes(&v4_frame(ALLOWED_V4, ICMP, icmp(8, 7)));
        h.passes(&v4_frame(ALLOWED_V4, TCP, tcp_syn(40000, 80)));
        h.passes(&v4_frame([192, 0, 3, 7], UDP, udp(1, 2)));
        assert_eq!(h.reasons(), [DropReason::XdpDenied as u32]);
    });
}

#[test]
fn failsafe_ports_are_found_behind_options_vlans_and_not_in_later_fragments() {
    in_netns(|| {
        let h = setup();
        // IHL 6: the ports come after the options.
        let mut ssh = Ip4::new(DENIED_V4, NODE_V4, TCP, tcp_syn(40000, 22));
        ssh.options = vec![1, 1, 1, 0];
        h.passes(&from_router(ETH_P_IP, &ssh.bytes()));
        // One 802.1Q tag (VLAN 100) in front of the IP header.
        let tagged = |ip: &[u8]| {
            let mut inner = vec![0, 100];
            inner.extend(ETH_P_IP.to_be_bytes());
            inner.extend(ip);
            from_router(ETH_P_8021Q, &inner)
        };
        let ssh = Ip4::new(DENIED_V4, NODE_V4, TCP, tcp_syn(40000, 22));
        h.passes(&tagged(&ssh.bytes()));
        let ping = Ip4::new(DENIED_V4, NODE_V4, ICMP, icmp(8, 1));
        h.drops_as(&tagged(&ping.bytes()), DropReason::XdpDenied);
        h.passes(&tagged(
            &Ip4::new(ALLOWED_V4, NODE_V4, ICMP, icmp(8, 1)).bytes(),
        ));
        // A first fragment carries the ports; a later one does not (its "ports" are data).
        h.passes(&from_router(ETH_P_IP, &ssh.clone().frag(0x2000).bytes()));
        let later = ssh.frag(0x0003).bytes();
        h.drops_as(&from_router(ETH_P_IP, &later), DropReason::XdpDenied);
    });
}

#[test]
fn ipv6_denied_sources_and_failsafe_ports() {
    in_netns(|| {
        let h = setup();
        h.drops_as(
            &v6_frame(denied_v6(), ICMPV6, &icmp(128, 1)),
            DropReason::XdpDenied,
        );
        h.drops_as(
            &v6_frame(denied_v6(), TCP, &tcp_syn(40000, 80)),
            DropReason::XdpDenied,
        );
        h.passes(&v6_frame(denied_v6(), TCP, &tcp_syn(40000, 22)));
        // Neighbour discovery passes (as ARP does), so the failsafe ports stay reachable;
        // other ICMPv6 does not.
        for ty in 133..=137 {
            h.passes(&v6_frame(denied_v6(), ICMPV6, &icmp(ty, 0)));
        }
        for ty in [1, 2, 129, 132, 138] {
            h.drops_as(
                &v6_frame(denied_v6(), ICMPV6, &icmp(ty, 0)),
                DropReason::XdpDenied,
            );
        }
        h.passes(&v6_frame(denied_v6(), UDP, &udp(40000, 53)));
        h.passes(&v6_frame(allowed_v6(), ICMPV6, &icmp(128, 1)));
        // Neighbour discovery from a link-local address is not in the deny list.
        let link_local = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        h.passes(&v6_frame(link_local, ICMPV6, &icmp(135, 0)));
        // IPv4 and IPv6 lists are separate: 192.0.2.7 mapped into IPv6 is not denied.
        let mut mapped = [0u8; 16];
        mapped[10..12].copy_from_slice(&[0xff, 0xff]);
        mapped[12..].copy_from_slice(&DENIED_V4);
        h.passes(&v6_frame(mapped, ICMPV6, &icmp(128, 1)));
        assert_eq!(h.reasons(), [DropReason::XdpDenied as u32]);
    });
}

#[test]
fn malformed_ipv4_and_ipv6_are_dropped_and_counted_whatever_the_source() {
    in_netns(|| {
        let h = setup();
        let good = v4_frame(ALLOWED_V4, TCP, tcp_syn(40000, 22));
        h.passes(&good);
        let mut past_the_end = good.clone();
        let tot = u16::try_from(good.len() - 14 + 1).expect("total length");
        past_the_end[16..18].copy_from_slice(&tot.to_be_bytes());
        let mut shorter_than_header = good.clone();
        shorter_than_header[16..18].copy_from_slice(&19u16.to_be_bytes());
        for frame in [
            with_byte(&good, 14, 0x44), // IHL 4
            with_byte(&good, 14, 0x65), // version 6
            past_the_end,
            shorter_than_header,
            good[..14 + 10].to_vec(), // the header cut short
            good[..14].to_vec(),      // no header at all
        ] {
            // Failsafe ports do not save a malformed packet: its "ports" mean nothing.
            h.drops_as(&frame, DropReason::XdpMalformedV4);
        }
        // Ethernet padding after the packet is fine.
        let mut padded = v4_frame(ALLOWED_V4, ICMP, icmp(8, 1));
        padded.extend([0; 18]);
        h.passes(&padded);

        let good6 = v6_frame(allowed_v6(), UDP, &udp(1, 53));
        h.passes(&good6);
        let mut past_the_end = good6.clone();
        past_the_end[18..20].copy_from_slice(&100u16.to_be_bytes());
        for frame in [
            with_byte(&good6, 14, 0x40), // version 4
            past_the_end,
            good6[..14 + 20].to_vec(), // the header cut short
        ] {
            h.drops_as(&frame, DropReason::XdpMalformedV6);
        }
        let want = [DropReason::XdpMalformedV4, DropReason::XdpMalformedV6];
        assert_eq!(h.reasons(), want.map(|r| r as u32));
        // Shorter than an Ethernet header: test_run refuses to build the frame at all.
        let err = h.try_run(&good[..13]).err().map(|e| e.raw_os_error());
        assert_eq!(err, Some(Some(libc::EINVAL)), "a 13-byte frame");
    });
}

#[test]
fn jumbo_frames_spanning_buffers_are_judged_by_their_whole_length() {
    in_netns(|| {
        let h = setup();
        // 9000 bytes: test_run puts what does not fit a page (with head- and tailroom) into
        // fragments, as a multi-buffer driver would; the program is frags-aware.
        let jumbo = |src| v4_frame(src, UDP, udp_payload(9000 - 14 - 20 - 8));
        let allowed = jumbo(ALLOWED_V4);
        assert_eq!(allowed.len(), 9000);
        h.passes(&allowed);
        h.drops_as(&jumbo(DENIED_V4), DropReason::XdpDenied);
        let mut past_the_end = allowed.clone();
        past_the_end[16..18].copy_from_slice(&8990u16.to_be_bytes());
        h.drops_as(&past_the_end, DropReason::XdpMalformedV4);
        let big6 = v6_frame(denied_v6(), UDP, &udp_payload(8000));
        h.drops_as(&big6, DropReason::XdpDenied);
        h.passes(&v6_frame(allowed_v6(), UDP, &udp_payload(8000)));
    });
}

/// A UDP header (ports 40000 → 5000, length set) and `n` bytes of payload.
fn udp_payload(n: usize) -> Vec<u8> {
    let len = u16::try_from(8 + n).expect("UDP length");
    let mut d = [
        &40000u16.to_be_bytes()[..],
        &5000u16.to_be_bytes(),
        &len.to_be_bytes(),
        &[0, 0],
    ]
    .concat();
    d.resize(8 + n, 0xab);
    d
}

#[test]
fn non_ip_passes_untouched() {
    in_netns(|| {
        let h = setup();
        let arp_request = arp(ROUTER_MAC, DENIED_V4, NODE_V4);
        h.passes(&eth([0xff; 6], ROUTER_MAC, ETH_P_ARP, &arp_request));
        let lldp_dst = [0x01, 0x80, 0xc2, 0, 0, 0x0e];
        h.passes(&eth(lldp_dst, ROUTER_MAC, ETH_P_LLDP, &[2, 7, 4, 0, 0, 0]));
        // Just an Ethernet header, and a VLAN tag cut short.
        h.passes(&eth(UPLINK_MAC, ROUTER_MAC, ETH_P_ARP, &[]));
        h.passes(&eth(UPLINK_MAC, ROUTER_MAC, ETH_P_8021Q, &[0, 100]));
        assert!(all_drops(&h.drops).is_empty());
    });
}

#[test]
fn a_new_policy_takes_effect_at_once_and_a_new_agent_finds_the_old_one() {
    in_netns(|| {
        let mut h = setup();
        let ping = v4_frame(DENIED_V4, ICMP, icmp(8, 7));
        let ping6 = v6_frame(denied_v6(), ICMPV6, &icmp(128, 1));
        let ssh = v4_frame(DENIED_V4, TCP, tcp_syn(40000, 22));
        h.drops_as(&ping, DropReason::XdpDenied);
        // A reload (SIGHUP) without the IPv4 entry and without ssh as failsafe.
        h.filter
            .set_policy(&policy(&[DENY[1], "198.51.100.0/24"], &["udp:53"]))
            .expect("reload");
        h.passes(&ping);
        h.drops_as(&ping6, DropReason::XdpDenied);
        h.drops_as(
            &v4_frame(ALLOWED_V4, ICMP, icmp(8, 7)),
            DropReason::XdpDenied,
        );
        h.passes(&v4_frame(ALLOWED_V4, UDP, udp(1, 53)));
        h.filter
            .set_policy(&policy(&DENY, &["udp:53"]))
            .expect("reload");
        h.drops_as(&ssh, DropReason::XdpDenied);

        // A restarted agent loads the object again on the same pins: what it does not
        // configure goes, what it does is there.
        let mut bpf = load_object(&h.pins);
        let mut filter = XdpFilter::open(&mut bpf).expect("the maps again");
        filter
            .set_policy(&policy(&["203.0.113.0/24"], &FAILSAFE))
            .expect("policy of the new agent");
        let pinned = |name: &str| {
            MapData::from_pin(h.pins.0.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        let deny = LpmTrie::<_, [u8; 4], u32>::try_from(Map::LpmTrie(pinned(DENY_V4_MAP)))
            .expect("the IPv4 deny list");
        let keys: Vec<(u32, [u8; 4])> = deny
            .keys()
            .map(|k| k.expect("key"))
            .map(|k| (k.prefix_len(), k.data()))
            .collect();
        assert_eq!(keys, [(24, [203, 0, 113, 0])]);
        let failsafe =
            HashMap::<_, FailsafePort, u32>::try_from(Map::HashMap(pinned(FAILSAFE_MAP)))
                .expect("the failsafe ports");
        let mut ports: Vec<(u8, u16)> = failsafe
            .keys()
            .map(|k| k.expect("key"))
            .map(|k| (k.proto, u16::from_be(k.port)))
            .collect();
        ports.sort();
        assert_eq!(ports, [(TCP, 22), (TCP, 9091), (UDP, 53)]);
        // The running program sees the same maps.
        h.passes(&ping);
        h.passes(&ssh);
        h.drops_as(
            &v4_frame([203, 0, 113, 9], ICMP, icmp(8, 7)),
            DropReason::XdpDenied,
        );
    });
}

/// A pod's address on this node: the node forwards to it, it is not the node's own.
const POD_V4: [u8; 4] = [10, 244, 0, 10];

fn pod_v6() -> [u8; 16] {
    v6([0xfd00, 0x244, 0], 10)
}

#[test]
fn failsafe_ports_apply_only_to_the_nodes_own_addresses() {
    in_netns(|| {
        let mut h = setup();
        let to4 = |dst, proto, l4: Vec<u8>| {
            from_router(ETH_P_IP, &Ip4::new(DENIED_V4, dst, proto, l4).bytes())
        };
        let to6 =
            |dst, proto, l4: &[u8]| from_router(ETH_P_IPV6, &ip6(denied_v6(), dst, proto, l4));
        h.passes(&to4(NODE_V4, TCP, tcp_syn(40000, 22)));
        h.passes(&to6(node_v6(), TCP, &tcp_syn(40000, 22)));
        // Through the node to a pod (or anywhere else it forwards to): no failsafe.
        for frame in [
            to4(POD_V4, TCP, tcp_syn(40000, 22)),
            to4(POD_V4, UDP, udp(40000, 53)),
            to4([10, 99, 0, 2], TCP, tcp_syn(40000, 9091)),
            to6(pod_v6(), TCP, &tcp_syn(40000, 22)),
            to6(pod_v6(), UDP, &udp(40000, 53)),
        ] {
            h.drops_as(&frame, DropReason::XdpDenied);
        }
        // Neighbour discovery still passes wherever it goes (it is never forwarded).
        h.passes(&to6(pod_v6(), ICMPV6, &nd(ND_NEIGHBOR_SOLICIT, pod_v6())));
        // The node's addresses change (the agent's watcher writes them): at once, the old
        // one is just another destination and the new one the node's.
        let new_v4 = [10, 99, 0, 7];
        let new_v6 = v6([0xfd00, 0, 1], 1);
        h.host
            .set(&node_addresses(&[new_v4.into(), new_v6.into()]))
            .expect("new addresses");
        assert_eq!(
            h.host.get(),
            node_addresses(&[new_v4.into(), new_v6.into()])
        );
        h.drops_as(
            &to4(NODE_V4, TCP, tcp_syn(40000, 22)),
            DropReason::XdpDenied,
        );
        h.drops_as(
            &to6(node_v6(), TCP, &tcp_syn(40000, 22)),
            DropReason::XdpDenied,
        );
        h.passes(&to4(new_v4, TCP, tcp_syn(40000, 22)));
        h.passes(&to6(new_v6, TCP, &tcp_syn(40000, 22)));
    });
}

#[test]
fn ipv6_failsafe_ports_are_found_behind_extension_headers() {
    in_netns(|| {
        let h = setup();
        let ssh = tcp_syn(40000, 22);
        let frame = |next, payload: &[u8]| v6_frame(denied_v6(), next, payload);
        h.passes(&frame(IPV6_DSTOPTS, &ext_header(TCP, &ssh)));
        let two = ext_header(IPV6_DSTOPTS, &ext_header(TCP, &ssh));
        h.passes(&frame(IPV6_HOPOPTS, &two));
        // A first fragment carries the ports; a later one does not.
        h.passes(&frame(IPV6_FRAGMENT, &fragment_header(TCP, 0, true, &ssh)));
        let later = fragment_header(TCP, 3, false, &ssh);
        h.drops_as(&frame(IPV6_FRAGMENT, &later), DropReason::XdpDenied);
        // Not a failsafe port, or more headers than the program follows: dropped.
        let http = ext_header(TCP, &tcp_syn(40000, 80));
        h.drops_as(&frame(IPV6_DSTOPTS, &http), DropReason::XdpDenied);
        let mut deep = ssh.clone();
        let mut next = TCP;
        for _ in 0..9 {
            deep = ext_header(next, &deep);
            next = IPV6_DSTOPTS;
        }
        h.drops_as(&frame(next, &deep), DropReason::XdpDenied);
    });
}
