//! SNAT for `natOutgoing` pools (issue 6): pods on a node whose uplink is a veth to an
//! "internet" namespace. The internet knows only the node's uplink subnet (TEST-NET-1,
//! 192.0.2.0/24) — no route to the pods — and serves from 198.51.100.10 (TEST-NET-2), which the
//! node routes via the internet's uplink address. So every answer a pod gets proves that the
//! flow left with the node's address and came back translated. Servers there report the peer
//! address they saw. Run as root.
use std::process::Stdio;
use std::time::{Duration, Instant};

use calix_testbed::{Dataplane, Guarded, Netns, Node, Pod};
use serde_json::Value;

const UPLINK: &str = "uplink0";
const NODE_ADDR: &str = "192.0.2.1";
const GATEWAY: &str = "192.0.2.9";
const SERVER: &str = "198.51.100.10";
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 8081;
/// A UDP port nothing listens on (the internet answers port unreachable).
const CLOSED_PORT: u16 = 8099;
const PORT_MIN: u16 = 20000;
const PORT_MAX: u16 = 20999;

fn config() -> String {
    format!(
        "uplinks = [\"{UPLINK}\"]\n\
         [[pools]]\ncidr = \"10.244.0.0/16\"\nnatOutgoing = true\n\
         [nat]\nport_min = {PORT_MIN}\nport_max = {PORT_MAX}\n\
         tcp_closing_secs = 2\ntcp_syn_secs = 5\nudp_secs = 3\nicmp_secs = 3\n\
         cleaner_interval_secs = 1\n"
    )
}

/// The servers: TCP answers the peer address (`ip:port`), then echoes what it gets until the
/// client closes (a line `later <n>` is answered `later` after n seconds); UDP (bound to the given address, so replies come from it) answers the peer
/// address. Arguments: TCP port, UDP port, address.
const SERVERS: &str = r#"
import socket, sys, threading, time
def serve(c, a):
    try:
        c.sendall(('%s:%d\n' % a).encode()); c.settimeout(30)
        while True:
            d = c.recv(64)
            if not d:
                break
            if d.startswith(b'later '):
                time.sleep(int(d.split()[1])); c.sendall(b'later\n')
            else:
                c.sendall(d)
    except Exception:
        pass
    c.close()
def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('0.0.0.0', port)); s.listen(1024)
    while True:
        c, a = s.accept()
        threading.Thread(target=serve, args=(c, a), daemon=True).start()
def udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[3], port))
    while True:
        d, a = s.recvfrom(64)
        s.sendto(('%s:%d\n' % a).encode(), a)
threading.Thread(target=tcp, args=(int(sys.argv[1]),), daemon=True).start()
threading.Thread(target=udp, args=(int(sys.argv[2]),), daemon=True).start()
threading.Event().wait()
"#;

/// The client: `tcp|udp <host> <port> <source port or 0>` prints what the server saw;
/// `refused <host> <port>` prints `refused` when a UDP send gets port unreachable back;
/// `many <host> <port> <n>` makes n TCP connections and prints how many got an answer;
/// `hold <host> <port>` connects, prints what the server saw, then sends each line of stdin
/// and prints the echo; `spray <host> <first port> <n>` sends one UDP datagram to each of n
/// ports (n new flows, none answered) and prints n.
const CLIENT: &str = r#"
import socket, sys
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def bound(kind, sport):
    s = socket.socket(socket.AF_INET, kind); s.settimeout(5)
    if sport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', sport))
    return s
if mode == 'tcp':
    s = bound(socket.SOCK_STREAM, int(sys.argv[4])); s.connect((host, port))
    print(s.recv(64).decode().strip()); s.close()
elif mode == 'udp':
    s = bound(socket.SOCK_DGRAM, int(sys.argv[4])); s.connect((host, port)); s.send(b'x')
    print(s.recv(64).decode().strip())
elif mode == 'refused':
    s = bound(socket.SOCK_DGRAM, 0); s.connect((host, port)); s.send(b'x')
    try:
        s.recv(64); print('answered')
    except ConnectionRefusedError:
        print('refused')
elif mode == 'many':
    ok = 0
    for i in range(int(sys.argv[4])):
        try:
            s = socket.create_connection((host, port), timeout=5)
            if s.recv(64):
                ok += 1
            s.close()
        except OSError as e:
            print('connection %d: %s' % (i, e), file=sys.stderr)
    print(ok)
elif mode == 'hold':
    s = socket.create_connection((host, port), timeout=10)
    print(s.recv(64).decode().strip(), flush=True)
    for line in sys.stdin:
        s.sendall(line.encode()); print(s.recv(64).decode().strip(), flush=True)
elif mode == 'spray':
    s = bound(socket.SOCK_DGRAM, 0)
    for p in range(port, port + int(sys.argv[4])):
        s.sendto(b'x', (host, p))
    print(sys.argv[4])
"#;

/// A node (agent running, SNAT configured) wired to the internet through its uplink, with
/// the servers running there.
struct Wired {
    // Fields drop in order: the servers, the node (agent, pins, namespace), the internet.
    _servers: Guarded,
    node: Node,
    internet: Netns,
}

fn wire() -> Wired {
    wire_with(Dataplane::Ebpf, "")
}

/// As [`wire`], with `nat` (lines of `[nat]`) added to the config.
fn wire_with(dataplane: Dataplane, nat: &str) -> Wired {
    let node = Node::create(dataplane, Some(&format!("{}{nat}", config())));
    let internet = Netns::new("i");
    node.uplink_to(&internet, UPLINK, &format!("{NODE_ADDR}/24"));
    let n = |argv: &[&str]| node.ns.exec_ok(argv);
    n(&[
        "ip",
        "route",
        "add",
        "198.51.100.0/24",
        "via",
        GATEWAY,
        "dev",
        UPLINK,
    ]);
    let i = |argv: &[&str]| internet.exec_ok(argv);
    i(&["ip", "addr", "add", &format!("{GATEWAY}/24"), "dev", "eth0"]);
    i(&["ip", "addr", "add", &format!("{SERVER}/32"), "dev", "eth0"]);
    let servers = internet
        .cmd(&[
            "python3",
            "-c",
            SERVERS,
            &TCP_PORT.to_string(),
            &UDP_PORT.to_string(),
            SERVER,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 servers");
    node.start_agent();
    Wired {
        _servers: Guarded(servers),
        node,
        internet,
    }
}

impl Wired {
    /// Runs the client in `pod`; its stdout, trimmed. Panics (with the agent's log) when it
    /// fails.
    fn client(&self, pod: &Pod, args: &[&str]) -> String {
        let mut argv = vec!["python3", "-c", CLIENT];
        argv.extend_from_slice(args);
        let out = pod.ns.exec(&argv);
        assert!(
            out.status.success(),
            "client {args:?} failed: {}\n{}\nagent log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.diagnostics(),
            self.node.agent_log()
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// What a failed client leaves to look at: the flows, the drop counters, the links.
    fn diagnostics(&self) -> String {
        let text = |o: std::process::Output| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        format!(
            "conntrack:\n{}\ndrops:\n{}\nnode links:\n{}\ninternet links:\n{}",
            text(self.node.calixctl(&["bpf", "conntrack"])),
            text(self.node.calixctl(&["bpf", "counters"])),
            text(self.node.ns.exec(&["ip", "-s", "link"])),
            text(self.internet.exec(&["ip", "-s", "link"])),
        )
    }

    /// `calixctl bpf conntrack -o json` with `args`: the flows.
    fn conntrack(&self, args: &[&str]) -> Vec<Value> {
        let mut argv = vec!["bpf", "conntrack", "-o", "json"];
        argv.extend_from_slice(args);
        let out = self.node.calixctl(&argv);
        assert!(
            out.status.success(),
            "calixctl bpf conntrack: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("conntrack JSON");
        v["flows"].as_array().cloned().expect("a flows array")
    }

    /// Waits until the internet has answered ARP for the node, so nothing depends on the
    /// first packet of a test resolving it.
    fn warm_up(&self) {
        assert!(
            self.internet.ping(NODE_ADDR, 1),
            "the internet reaches the node"
        );
    }
}

/// "192.0.2.1:20345" → the port, asserting the address is the node's and the port NAT's.
#[track_caller]
fn nat_port(seen: &str) -> u16 {
    let (addr, port) = seen.rsplit_once(':').expect("ip:port");
    assert_eq!(
        addr, NODE_ADDR,
        "the internet sees the node's address: {seen}"
    );
    let port: u16 = port.parse().expect("a port");
    assert!(
        (PORT_MIN..=PORT_MAX).contains(&port),
        "NAT port {port} in range"
    );
    port
}

#[test]
fn tcp_udp_and_ping_leave_with_the_node_address() {
    let w = wire();
    w.warm_up();
    let pod = Pod::add(&w.node, "snat");
    let tcp = w.client(&pod, &["tcp", SERVER, &TCP_PORT.to_string(), "0"]);
    nat_port(&tcp);
    let udp = w.client(&pod, &["udp", SERVER, &UDP_PORT.to_string(), "0"]);
    nat_port(&udp);
    assert!(
        pod.ns.ping(SERVER, 3),
        "ping through SNAT\n{}",
        w.node.agent_log()
    );
    // The flows, as calixctl shows them: the pod's tuple and the NAT one.
    let flows = w.conntrack(&["--ip", &pod.ip()]);
    let protos: std::collections::BTreeSet<&str> =
        flows.iter().filter_map(|f| f["proto"].as_str()).collect();
    assert_eq!(
        protos,
        ["icmp", "tcp", "udp"].into_iter().collect(),
        "{flows:?}"
    );
    for f in &flows {
        assert_eq!(f["pod"], pod.ip().as_str());
        assert_eq!(f["dst"], SERVER);
        assert_eq!(f["nat"], NODE_ADDR);
    }
    let udp_flow = w.conntrack(&["--proto", "udp", "--ip", &pod.ip()]);
    assert_eq!(udp_flow.len(), 1, "{udp_flow:?}");
    assert_eq!(
        udp_flow[0]["nat_port"].as_u64(),
        Some(u64::from(nat_port(&udp)))
    );
    // Destinations in the pool are not translated (nothing to do with the internet): a
    // second pod is reached with the first pod's own address.
    let other = Pod::add(&w.node, "peer");
    assert!(pod.ns.ping(&other.ip(), 1), "pod to pod");
    assert!(
        w.conntrack(&["--ip", &other.ip()]).is_empty(),
        "pool traffic has no NAT flow"
    );
}

#[test]
fn two_pods_with_the_same_source_port_get_different_nat_ports() {
    let w = wire();
    w.warm_up();
    let a = Pod::add(&w.node, "a");
    let b = Pod::add(&w.node, "b");
    for (proto, port) in [("tcp", TCP_PORT), ("udp", UDP_PORT)] {
        let seen_a = w.client(&a, &[proto, SERVER, &port.to_string(), "40000"]);
        let seen_b = w.client(&b, &[proto, SERVER, &port.to_string(), "40000"]);
        assert_ne!(
            nat_port(&seen_a),
            nat_port(&seen_b),
            "{proto}: one NAT port each"
        );
    }
    // Both UDP flows are still tracked, each with its own pod.
    let flows = w.conntrack(&["--proto", "udp", "--port", "40000"]);
    let pods: std::collections::BTreeSet<&str> =
        flows.iter().filter_map(|f| f["pod"].as_str()).collect();
    let want: std::collections::BTreeSet<String> = [a.ip(), b.ip()].into_iter().collect();
    assert_eq!(pods, want.iter().map(String::as_str).collect(), "{flows:?}");
}

#[test]
fn icmp_port_unreachable_comes_back_to_the_pod() {
    let w = wire();
    w.warm_up();
    let pod = Pod::add(&w.node, "icmperr");
    let out = w.client(&pod, &["refused", SERVER, &CLOSED_PORT.to_string()]);
    assert_eq!(
        out, "refused",
        "the pod got the translated port unreachable"
    );
}

#[test]
fn ten_thousand_short_connections_succeed_and_their_entries_expire() {
    let w = wire();
    w.warm_up();
    let pod = Pod::add(&w.node, "many");
    let t0 = Instant::now();
    let ok = w.client(&pod, &["many", SERVER, &TCP_PORT.to_string(), "10000"]);
    assert_eq!(
        ok,
        "10000",
        "every connection answered ({:?})\n{}",
        t0.elapsed(),
        w.node.drops()
    );
    // Ports are reused while the server may still hold the old connection: the resets that
    // sort that out are legitimate and must pass the window check.
    for iface in [pod.host_ifname().as_str(), UPLINK] {
        assert_eq!(
            w.node.dropped(iface, "ct_rst_out_of_window"),
            0,
            "{}",
            w.node.drops()
        );
    }
    // 10,000 flows through 1,000 NAT ports: closed flows gave their ports up. Then the
    // cleaner removes what is left once tcp_closing_secs (2 s) have passed.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = w.conntrack(&["--ip", &pod.ip()]);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} flows still tracked, e.g. {}",
            left.len(),
            left[0]
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // The table works on after the cleaner emptied it.
    nat_port(&w.client(&pod, &["tcp", SERVER, &TCP_PORT.to_string(), "0"]));
}

/// Kernel mode has no BPF: the agent masquerades natOutgoing pools with an nftables table
/// instead, reapplied on SIGHUP and removed when no pool translates any more.
#[test]
fn kernel_mode_masquerades_with_nftables() {
    let w = wire_with(Dataplane::Kernel, "");
    w.warm_up();
    let pod = Pod::add(&w.node, "kmasq");
    let seen = w.client(&pod, &["tcp", SERVER, &TCP_PORT.to_string(), "0"]);
    let (addr, _) = seen.rsplit_once(':').expect("ip:port");
    assert_eq!(addr, NODE_ADDR, "the internet saw the node's address");
    assert!(pod.ns.ping(SERVER, 1), "ping through the masquerade");
    let table = || w.node.ns.exec(&["nft", "list", "table", "ip", "calix"]);
    let listed = String::from_utf8_lossy(&table().stdout).into_owned();
    assert!(
        listed.contains("ip saddr 10.244.0.0/16") && listed.contains("masquerade"),
        "the masquerade rule:\n{listed}"
    );

    // SIGHUP with natOutgoing off: the table goes, and the internet (which has no route to
    // the pods) no longer answers.
    let off = config().replace("natOutgoing = true", "natOutgoing = false");
    std::fs::write(w.node.dir.join("agent.toml"), off).expect("rewrite the config");
    let pid = w.node.agent_pid().expect("agent pid");
    // SAFETY: kill(2) on the agent this test started.
    unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while table().status.success() {
        assert!(
            Instant::now() < deadline,
            "table ip calix still there after SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!pod.ns.ping(SERVER, 1), "no masquerade, no answer");
}

/// A TCP connection a pod holds open through the `hold` client: lines written to it come
/// back echoed by the server.
struct Held {
    child: Guarded,
    out: std::io::BufReader<std::process::ChildStdout>,
    /// What the server saw as the connection's source (`ip:port`).
    seen: String,
}

impl Held {
    fn open(pod: &Pod, host: &str, port: u16) -> Held {
        let mut argv = vec!["python3", "-c", CLIENT, "hold", host];
        let port = port.to_string();
        argv.push(&port);
        let mut child = pod
            .ns
            .cmd(&argv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 hold client");
        let out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut h = Held {
            child: Guarded(child),
            out,
            seen: String::new(),
        };
        h.seen = h.line();
        h
    }

    /// Sends `text` over the connection.
    fn send(&mut self, text: &str) {
        use std::io::Write;
        let stdin = self.child.0.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{text}").expect("write to the hold client");
        stdin.flush().expect("flush");
    }

    /// The next line the client printed (empty: it ended).
    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut l = String::new();
        self.out
            .read_line(&mut l)
            .expect("read from the hold client");
        l.trim().to_string()
    }

    /// Sends `text` over the connection and returns what came back.
    fn echo(&mut self, text: &str) -> String {
        self.send(text);
        self.line()
    }
}

/// One pod sprays new flows at a table of 32 flows: the per-endpoint budget (by default a
/// quarter of the table) stops it long before the table is full, so another pod's
/// established connection and its new connections keep working.
#[test]
fn a_pod_spraying_new_flows_cannot_fill_the_table_for_the_others() {
    let w = wire_with(Dataplane::Ebpf, "conntrack_entries = 64\n");
    w.warm_up();
    let victim = Pod::add(&w.node, "victim");
    let sprayer = Pod::add(&w.node, "sprayer");
    let mut held = Held::open(&victim, SERVER, TCP_PORT);
    nat_port(&held.seen);
    let sprayed = w.client(&sprayer, &["spray", SERVER, "30000", "200"]);
    assert_eq!(sprayed, "200");
    assert_eq!(held.echo("still there"), "still there", "established flow");
    let seen = w.client(&victim, &["tcp", SERVER, &TCP_PORT.to_string(), "0"]);
    nat_port(&seen);
    let udp = w.client(&victim, &["udp", SERVER, &UDP_PORT.to_string(), "0"]);
    nat_port(&udp);
    assert!(
        w.node.dropped(&sprayer.host_ifname(), "conntrack_budget") >= 150,
        "the spray is stopped by its budget: {}",
        w.node.drops()
    );
    assert_eq!(
        w.node.dropped(&victim.host_ifname(), "conntrack_full"),
        0,
        "{}",
        w.node.drops()
    );
}

/// A Service address, DNATed by the host stack (an nft rule stands in for kube-proxy):
/// without `service_cidrs` the programs SNAT a natOutgoing pod's connection to it straight
/// out of the uplink, VIP and all, and it fails; with it (a SIGHUP reloads it) the flows go
/// through the stack, whose DNAT takes them to a backend pod on this node (the backend sees
/// the client pod's own address) or to a backend outside (masqueraded by the host to the
/// node's address).
#[test]
fn service_addresses_are_left_to_the_host_stack_nat() {
    let w = wire();
    w.warm_up();
    let client = Pod::add(&w.node, "client");
    let backend = Pod::add(&w.node, "backend");
    let _backend_server = Guarded(
        backend
            .ns
            .cmd(&[
                "python3",
                "-c",
                SERVERS,
                &TCP_PORT.to_string(),
                &UDP_PORT.to_string(),
                &backend.ip(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 servers in the backend pod"),
    );
    let rules = format!(
        "table ip cxtsvc {{\n\
         \tchain pre {{\n\
         \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
         \t\tip daddr 10.96.0.10 tcp dport 80 dnat to {}:{TCP_PORT}\n\
         \t\tip daddr 10.96.0.11 tcp dport 80 dnat to {SERVER}:{TCP_PORT}\n\
         \t}}\n\
         }}\n",
        backend.ip()
    );
    // A node has a default route (the Service range is not routed specially).
    w.node.ns.exec_ok(&[
        "ip", "route", "add", "default", "via", GATEWAY, "dev", UPLINK,
    ]);
    let path = w.node.dir.join("services.nft");
    std::fs::write(&path, rules).expect("write the nft rules");
    w.node
        .ns
        .exec_ok(&["nft", "-f", &path.display().to_string()]);
    // The backend pod's server is up.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = client.ns.exec(&[
            "python3",
            "-c",
            CLIENT,
            "tcp",
            &backend.ip(),
            &TCP_PORT.to_string(),
            "0",
        ]);
        if out.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the backend pod's server never answered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Without service_cidrs: translated by the programs, sent out with the VIP, no answer.
    let out = client
        .ns
        .exec(&["python3", "-c", CLIENT, "tcp", "10.96.0.10", "80", "0"]);
    assert!(!out.status.success(), "the Service needs service_cidrs");
    let wrong = w.conntrack(&["--ip", "10.96.0.10"]);
    assert_eq!(wrong.len(), 1, "the programs translated it: {wrong:?}");
    // SIGHUP with service_cidrs.
    let with = format!("{}service_cidrs = [\"10.96.0.0/12\"]\n", config());
    std::fs::write(w.node.dir.join("agent.toml"), with).expect("rewrite the config");
    let pid = w.node.agent_pid().expect("agent pid");
    // SAFETY: kill(2) on the agent this test started.
    unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !w.node.agent_log().contains("service_cidrs reloaded") {
        assert!(
            Instant::now() < deadline,
            "no reload:\n{}",
            w.node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // To the backend pod: DNATed, not SNATed (pod to pod), and the reply un-DNATed.
    let seen = w.client(&client, &["tcp", "10.96.0.10", "80", "0"]);
    let (addr, _) = seen.rsplit_once(':').expect("ip:port");
    assert_eq!(addr, client.ip(), "the backend sees the client pod");
    let mut held = Held::open(&client, "10.96.0.10", 80);
    assert_eq!(held.echo("through the service"), "through the service");
    // To a backend outside: DNATed, then masqueraded by the host to the node's address.
    let seen = w.client(&client, &["tcp", "10.96.0.11", "80", "0"]);
    let (addr, _) = seen.rsplit_once(':').expect("ip:port");
    assert_eq!(addr, NODE_ADDR, "the outside backend sees the node");
    // None of it went through the programs' NAT (the flow from before the reload aside,
    // until it expires).
    let flows = w.conntrack(&["--ip", &client.ip()]);
    assert!(
        flows.iter().all(|f| f["pod_port"] == wrong[0]["pod_port"]),
        "{flows:?}"
    );
}

/// Puts the node's pins back as layout 1 left them: its maps (from `calix_common::LAYOUTS`)
/// in `v1/`, the conntrack entries converted to layout 1's 40-byte entries, the stack flows
/// kept; this layout's directory gone. The programs attached now keep running on their
/// (unpinned) maps, as a previous release's would on its own.
fn back_to_layout_1(node: &Node) -> usize {
    use aya::maps::{HashMap, Map, MapData};
    use calix_common::{layout, CtEntry, CtKey, FlowKey, StackFlow, CT_MAP, STACK_FLOWS_MAP};
    use calix_dataplane::pins::{CtEntryV1, MapSpec};

    let node_dir = node.pin_root().join(&node.ns.name);
    let now_dir = node_dir.join(format!("v{}", calix_common::LAYOUT_VERSION));
    let open = |p: std::path::PathBuf| MapData::from_pin(&p).expect("a pinned map");
    let ct: HashMap<MapData, CtKey, CtEntry> =
        HashMap::try_from(Map::HashMap(open(now_dir.join(CT_MAP)))).expect("CT");
    let flows: HashMap<MapData, FlowKey, StackFlow> =
        HashMap::try_from(Map::HashMap(open(now_dir.join(STACK_FLOWS_MAP)))).expect("flows");
    let v1_dir = node_dir.join("v1");
    std::fs::create_dir_all(&v1_dir).expect("v1 dir");
    let v1 = layout(1).expect("layout 1");
    for m in v1.maps {
        MapSpec::from_layout(m)
            .create_pinned(&v1_dir.join(m.name))
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
    }
    let mut old_ct: HashMap<MapData, CtKey, CtEntryV1> =
        HashMap::try_from(Map::HashMap(open(v1_dir.join(CT_MAP)))).expect("v1 CT");
    let mut n = 0;
    for (k, e) in ct.iter().filter_map(Result::ok) {
        let old = CtEntryV1 {
            last_seen_ns: e.last_seen_ns,
            addr: e.addr,
            port: e.port,
            flags: e.flags & 7, // layout 1 had SEEN, FIN and RST only
            route_ns: e.route_ns,
            route_ifindex: e.route_ifindex,
            route_macs: e.route_macs,
        };
        old_ct.insert(k, old, 0).expect("a v1 entry");
        n += 1;
    }
    let mut old_flows: HashMap<MapData, FlowKey, u64> =
        HashMap::try_from(Map::LruHashMap(open(v1_dir.join(STACK_FLOWS_MAP)))).expect("v1 flows");
    for k in flows.keys().filter_map(Result::ok) {
        old_flows.insert(k, 0, 0).expect("a v1 flow");
    }
    std::fs::remove_dir_all(&now_dir).expect("remove this layout's pins");
    n
}

/// An upgrade across a map layout change keeps translated flows: with the node's pins as
/// layout 1 left them, the agent starts, says what it carried over, and a TCP connection
/// through SNAT goes on — the first packet after the upgrade comes from the server, so it
/// needs the flow's reply entry in the new table.
#[test]
fn translated_flows_survive_an_upgrade_from_layout_1() {
    let w = wire();
    w.warm_up();
    let pod = Pod::add(&w.node, "upgrade");
    let mut held = Held::open(&pod, SERVER, TCP_PORT);
    let nat = nat_port(&held.seen);
    assert_eq!(held.echo("before"), "before");
    w.node.stop_agent();
    let entries = back_to_layout_1(&w.node);
    assert_eq!(entries, 2, "the connection's two conntrack entries");
    // The server answers this in 4 s, after the upgrade.
    held.send("later 4");
    w.node.start_agent();
    assert_eq!(
        held.line(),
        "later",
        "the server's data reached the pod after the upgrade\n{}",
        w.diagnostics()
    );
    assert_eq!(held.echo("after"), "after");
    let flows = w.conntrack(&["--ip", &pod.ip(), "--proto", "tcp"]);
    assert_eq!(flows.len(), 1, "{flows:?}");
    assert_eq!(
        flows[0]["nat_port"].as_u64(),
        Some(u64::from(nat)),
        "the same NAT port"
    );
    let log = w.node.agent_log();
    let carried = log
        .lines()
        .find(|l| l.contains("entries carried into the new map") && l.contains("map=CALIX_CT "))
        .unwrap_or_else(|| panic!("the agent says what it carried:\n{log}"));
    assert!(
        carried.contains("inserted=2") && carried.contains("/v1/CALIX_CT"),
        "{carried}"
    );
    let old = w.node.pin_root().join(&w.node.ns.name).join("v1");
    assert!(
        !old.exists(),
        "layout 1's pins are gone after the reconcile"
    );
}
