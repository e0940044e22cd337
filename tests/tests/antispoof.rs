//! Anti-spoofing without holes (issue 11, item 2): a pod may send untagged IPv4 and IPv6 from
//! its own addresses, ARP for its own IPv4 address and IPv6 neighbour discovery, nothing else.
//! Pod a writes hostile frames onto its eth0 with a raw socket (`Netns::send_frames`, the
//! frames from `calix_testbed::packets`); pod b's tcpdump shows what reached it, the agent's drop
//! counters what was dropped and why. Kernel mode (no BPF) is checked for spoofed sources:
//! rp_filter and the agent's nftables table. Run as root.
use std::time::{Duration, Instant};

use calix_common::{eui64_link_local, HOST_VETH_MAC};
use calix_testbed::packets::*;
use calix_testbed::{bin, run, Capture, Dataplane, Node, Pod};
use serde_json::Value;

const DUAL: &str = "[[pools]]\ncidr = \"10.244.0.0/16\"\n[[pools]]\ncidr = \"fd00:10::/64\"\n";
/// The nftables table (family inet) the agent keeps in kernel mode.
const GUARD_TABLE: &str = "calix_antispoof";
/// UDP port the test frames go to (discard: nobody listens, tcpdump sees them anyway).
const PORT: u16 = 9;

/// Two dual-stack pods on one node, with what pod a's frames need.
struct Pair<'a> {
    node: &'a Node,
    a: Pod<'a>,
    b: Pod<'a>,
    a_mac: [u8; 6],
    a_v4: [u8; 4],
    a_v6: [u8; 16],
    b_v4: [u8; 4],
    b_v6: [u8; 16],
}

fn pair(node: &Node) -> Pair<'_> {
    let dual = serde_json::json!({"ipam": {"type": "calix-ipam", "assign_ipv6": "true"}});
    let a = Pod::add_with(node, "a", dual.clone());
    let b = Pod::add_with(node, "b", dual);
    let addr = |pod: &Pod, v6: bool| {
        pod.ips()
            .into_iter()
            .find(|ip| ip.contains(':') == v6)
            .unwrap_or_else(|| {
                panic!(
                    "no {} address: {:?}",
                    if v6 { "v6" } else { "v4" },
                    pod.ips()
                )
            })
    };
    let v4 = |s: String| s.parse::<std::net::Ipv4Addr>().expect("v4").octets();
    let v6 = |s: String| s.parse::<std::net::Ipv6Addr>().expect("v6").octets();
    let out = a.ns.exec_ok(&["ip", "-j", "link", "show", "eth0"]);
    let link: Value = serde_json::from_slice(&out.stdout).expect("ip -j link");
    let mac = link[0]["address"].as_str().expect("eth0's MAC");
    let bytes: Vec<u8> = mac
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).expect("MAC byte"))
        .collect();
    Pair {
        node,
        a_mac: bytes.try_into().expect("6 bytes"),
        a_v4: v4(addr(&a, false)),
        a_v6: v6(addr(&a, true)),
        b_v4: v4(addr(&b, false)),
        b_v6: v6(addr(&b, true)),
        a,
        b,
    }
}

/// A marker carried in a test frame's payload, so a capture shows whether it arrived.
fn marker(name: &str) -> Vec<u8> {
    format!("cxt-{name}-cxt").into_bytes()
}

impl Pair<'_> {
    /// UDP from `src` to pod b's IPv4 address, in a frame to the gateway.
    fn udp4(&self, src: [u8; 4], name: &str) -> Vec<u8> {
        let ip = Ip4::new(src, self.b_v4, UDP, udp_with(40000, PORT, &marker(name)));
        eth(HOST_VETH_MAC, self.a_mac, ETH_P_IP, &ip.bytes())
    }

    /// UDP from `src` to pod b's IPv6 address.
    fn udp6(&self, src: [u8; 16], name: &str) -> Vec<u8> {
        let ip = ip6(src, self.b_v6, UDP, &udp_with(40000, PORT, &marker(name)));
        eth(HOST_VETH_MAC, self.a_mac, ETH_P_IPV6, &ip)
    }

    /// An ICMPv6 message from `src` to all nodes, hop limit 255 as neighbour discovery has.
    fn icmp6(&self, src: [u8; 16], icmp: &[u8]) -> Vec<u8> {
        let mut ip = ip6(src, ALL_NODES, ICMPV6, icmp);
        ip[7] = 255;
        eth([0x33, 0x33, 0, 0, 0, 1], self.a_mac, ETH_P_IPV6, &ip)
    }

    /// Every kind of frame pod a must not get through: (marker or "", frame, the reason it is
    /// counted under).
    fn hostile(&self) -> Vec<(&'static str, Vec<u8>, &'static str)> {
        let ll = eui64_link_local(self.a_mac);
        let gateway = eui64_link_local(HOST_VETH_MAC);
        let spoofed_v6 = {
            let mut a = self.a_v6;
            a[15] ^= 0x55;
            a
        };
        let qinq = vlan_tagged(
            &vlan_tagged(&self.udp4([10, 244, 250, 250], "vlan-qinq"), ETH_P_8021Q, 0),
            ETH_P_8021AD,
            0,
        );
        let arp_b = arp(self.a_mac, self.b_v4, [169, 254, 1, 1]);
        vec![
            (
                "spoofed-v4",
                self.udp4([10, 244, 250, 250], "spoofed-v4"),
                "spoofed_source_v4",
            ),
            (
                "spoofed-v6",
                self.udp6(spoofed_v6, "spoofed-v6"),
                "spoofed_source_v6",
            ),
            (
                "",
                eth([0xff; 6], self.a_mac, ETH_P_ARP, &arp_b),
                "spoofed_arp_sender",
            ),
            (
                "",
                self.icmp6(ll, &nd(ND_NEIGHBOR_ADVERT, self.b_v6)),
                "spoofed_nd_target",
            ),
            (
                "",
                self.icmp6(self.a_v6, &nd(ND_NEIGHBOR_ADVERT, self.b_v6)),
                "spoofed_nd_target",
            ),
            (
                "vlan-8021q",
                vlan_tagged(&self.udp4(self.a_v4, "vlan-8021q"), ETH_P_8021Q, 5),
                "vlan_tagged",
            ),
            (
                "vlan-8021ad",
                vlan_tagged(&self.udp4(self.a_v4, "vlan-8021ad"), ETH_P_8021AD, 5),
                "vlan_tagged",
            ),
            // Priority tags (VLAN 0) twice: the host stack strips both and routes the inner
            // packet, which no tc program then sees again.
            ("vlan-qinq", qinq, "vlan_tagged"),
            (
                "ethertype",
                eth(
                    HOST_VETH_MAC,
                    self.a_mac,
                    ETH_P_LOCAL_EXP,
                    &marker("ethertype"),
                ),
                "ethertype_not_allowed",
            ),
            (
                "link-local",
                self.udp6(ll, "link-local"),
                "link_local_not_nd",
            ),
            (
                "unspecified",
                self.udp6([0; 16], "unspecified"),
                "link_local_not_nd",
            ),
            (
                "gateway-ll",
                self.udp6(gateway, "gateway-ll"),
                "spoofed_source_v6",
            ),
        ]
    }

    /// Sends `frames` from pod a, then the legitimate `legit` ones, and returns b's capture
    /// once every legitimate frame reached b (so the hostile ones, sent first, had their
    /// chance).
    fn send_and_capture(&self, frames: &[Vec<u8>], legit: &[(&str, Vec<u8>)]) -> String {
        let capture: Capture = self.b.ns.capture("eth0");
        self.a.ns.send_frames("eth0", frames);
        let legit_frames: Vec<Vec<u8>> = legit.iter().map(|(_, f)| f.clone()).collect();
        self.a.ns.send_frames("eth0", &legit_frames);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = capture.text();
            let arrived = legit
                .iter()
                .all(|(name, _)| text.contains(&format!("cxt-{name}-cxt")));
            if arrived {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "pod a's own packets never reached b:\n{text}\nagent log:\n{}",
                self.node.agent_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn legit(&self) -> Vec<(&'static str, Vec<u8>)> {
        vec![
            ("legit-v4", self.udp4(self.a_v4, "legit-v4")),
            ("legit-v6", self.udp6(self.a_v6, "legit-v6")),
        ]
    }

    /// Both families still work between the pods.
    fn pings(&self) {
        let b4 = std::net::Ipv4Addr::from(self.b_v4).to_string();
        let b6 = std::net::Ipv6Addr::from(self.b_v6).to_string();
        assert!(self.a.ns.ping(&b4, 2), "IPv4 ping a -> b");
        assert!(self.a.ns.ping(&b6, 2), "IPv6 ping a -> b");
    }
}

/// `calixctl bpf counters -o json`: packets dropped on `iface`, by reason.
fn drops_on(node: &Node, iface: &str) -> std::collections::BTreeMap<String, u64> {
    let out = node.calixctl(&["bpf", "counters", "-o", "json"]);
    assert!(
        out.status.success(),
        "calixctl bpf counters: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpf counters json");
    let mut by_reason = std::collections::BTreeMap::new();
    for d in v["drops"].as_array().into_iter().flatten() {
        if d["interface"] == iface {
            let reason = d["reason"].as_str().unwrap_or_default().to_string();
            *by_reason.entry(reason).or_default() += d["packets"].as_u64().unwrap_or(0);
        }
    }
    by_reason
}

#[test]
fn ebpf_mode_drops_and_counts_everything_a_pod_may_not_send() {
    let node = Node::start_with_config(Dataplane::Ebpf, Some(DUAL));
    let p = pair(&node);
    p.pings();
    let host_a = p.a.host_ifname();
    let before = drops_on(&node, &host_a);
    assert!(
        before.is_empty(),
        "drops before the test frames: {before:?}"
    );

    let hostile = p.hostile();
    let frames: Vec<Vec<u8>> = hostile.iter().map(|(_, f, _)| f.clone()).collect();
    let seen = p.send_and_capture(&frames, &p.legit());
    for (name, _, reason) in &hostile {
        if !name.is_empty() {
            assert!(
                !seen.contains(&format!("cxt-{name}-cxt")),
                "{name} ({reason}) reached pod b:\n{seen}"
            );
        }
    }
    // Each counted once under its reason; nothing the pods' kernels sent by themselves
    // (router solicitations, MLD reports, neighbour discovery) was counted.
    let mut want = std::collections::BTreeMap::new();
    for (_, _, reason) in &hostile {
        *want.entry(reason.to_string()).or_insert(0u64) += 1;
    }
    p.pings();
    assert_eq!(drops_on(&node, &host_a), want, "drops on pod a's veth");
    assert!(
        drops_on(&node, &p.b.host_ifname()).is_empty(),
        "drops on b's veth"
    );
    // Named in /metrics too.
    let out = node.ns.exec_ok(&[
        "bash",
        "-c",
        "exec 3<>/dev/tcp/127.0.0.1/9091 && printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3",
    ]);
    let metrics = String::from_utf8_lossy(&out.stdout);
    for reason in want.keys() {
        let line = format!("calix_drops_total{{interface=\"{host_a}\",reason=\"{reason}\"}}");
        assert!(metrics.contains(&line), "{line} missing from /metrics");
    }
}

/// `nft list table inet calix_antispoof` in the node, if the table exists.
fn guard_table(node: &Node) -> Option<String> {
    let out = node.ns.exec(&["nft", "list", "table", "inet", GUARD_TABLE]);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The packets the table's drop rules counted.
fn guard_drops(table: &str) -> u64 {
    table
        .lines()
        .filter(|l| l.contains(" drop"))
        .filter_map(|l| l.split("counter packets ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[test]
fn kernel_mode_drops_spoofed_sources_with_rp_filter_and_nftables() {
    let node = Node::start_with_config(Dataplane::Kernel, Some(DUAL));
    let p = pair(&node);
    p.pings();
    let host_a = p.a.host_ifname();
    let rp = node
        .ns
        .exec_ok(&["sysctl", "-n", &format!("net.ipv4.conf.{host_a}.rp_filter")]);
    assert_eq!(
        String::from_utf8_lossy(&rp.stdout).trim(),
        "1",
        "strict rp_filter on {host_a}"
    );
    let table = guard_table(&node).unwrap_or_else(|| {
        panic!(
            "no nftables table inet {GUARD_TABLE}:\n{}",
            node.agent_log()
        )
    });
    assert!(
        table.contains("comment \"calix: "),
        "the table carries calix's mark:\n{table}"
    );

    let mut spoofed_v6 = p.a_v6;
    spoofed_v6[15] ^= 0x55;
    let spoofed = [
        ("k-spoofed-v4", p.udp4([10, 244, 250, 250], "k-spoofed-v4")),
        ("k-spoofed-v6", p.udp6(spoofed_v6, "k-spoofed-v6")),
        ("k-spoofed-b", p.udp4(p.b_v4, "k-spoofed-b")),
    ];
    let frames: Vec<Vec<u8>> = spoofed.iter().map(|(_, f)| f.clone()).collect();
    let seen = p.send_and_capture(&frames, &p.legit());
    for (name, _) in &spoofed {
        assert!(
            !seen.contains(&format!("cxt-{name}-cxt")),
            "{name} reached b:\n{seen}"
        );
    }
    let counted = guard_drops(&guard_table(&node).expect("the table"));
    assert!(
        counted >= 3,
        "nft counted {counted} drops:\n{:?}",
        guard_table(&node)
    );
    // Neighbour discovery (link-local and unspecified sources) and the pods' own addresses
    // still work.
    p.pings();

    // With `all.rp_filter = 2` (loose, systemd's default) the interface's strict setting is
    // overruled (the kernel takes the maximum): the nftables table still drops.
    node.ns
        .exec_ok(&["sysctl", "-w", "net.ipv4.conf.all.rp_filter=2"]);
    let again = [("k-loose-v4", p.udp4([10, 244, 250, 251], "k-loose-v4"))];
    let frames: Vec<Vec<u8>> = again.iter().map(|(_, f)| f.clone()).collect();
    let seen = p.send_and_capture(&frames, &p.legit());
    assert!(
        !seen.contains("cxt-k-loose-v4-cxt"),
        "loose rp_filter let it through:\n{seen}"
    );
    assert!(guard_drops(&guard_table(&node).expect("the table")) > counted);
    p.pings();

    // --uninstall removes the table.
    node.stop_agent();
    let cfg = node.dir.join("agent.toml").display().to_string();
    let pin_root = node.pin_root().display().to_string();
    let agent = bin("calix-agent").display().to_string();
    let argv = [
        agent.as_str(),
        "--node-name",
        &node.ns.name,
        "--config",
        &cfg,
        "--bpf-pin-root",
        &pin_root,
        "--uninstall",
    ];
    let out = run(&mut node.ns.cmd_setns(&argv));
    assert!(
        out.status.success(),
        "--uninstall: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        guard_table(&node),
        None,
        "the table is left after --uninstall"
    );
}
