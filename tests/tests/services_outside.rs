//! Services reached from outside the nodes (issue 24): a client in a namespace beyond the
//! node's uplink reaches a NodePort at the node's address, which the tc programs translate per
//! packet (no socket of the client's is the node's to see). The backend sees the client's own
//! address and the replies come from the NodePort, over TCP and UDP; with
//! `externalTrafficPolicy: Local` and no endpoint on the node the client is dropped there (and
//! counted), with `Cluster` the same endpoint serves it. A backend elsewhere (a namespace
//! routed behind the node, as another node's pod is) meets the client masqueraded to the
//! node's address, and its replies still come from the NodePort. A connection from outside
//! lasts through the agent's `kill -9`, its restart and an upgrade to another build of the
//! programs, and new ones are served after each. A UDP client outside whose backend leaves the
//! Service meets the one left with its next datagram, from the same socket; a TCP client that
//! reuses its port after its connection ended meets the backends as they are then; with
//! `sessionAffinity: ClientIP` every connection of a client meets the same backend. IPv6
//! clients reach a dual-stack NodePort at the node's IPv6 address the same ways. Each new
//! connection meets the backend its slot in the Maglev table names (computed in the test from
//! the backends alone, as every node does), and a backend leaving moves none of the others'.
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, UdpSocket};
use std::process::Stdio;
use std::time::Duration;

use calix_testbed::{wait_for, KubeApi, Netns, Node, Pod};
use serde_json::{json, Value};

mod common;
use common::services::{frontend_counters, running, service_step, Bed};

const UPLINK: &str = "up0";
const NODE_ADDR: &str = "192.0.2.61";
const CLIENT_ADDR: &str = "192.0.2.62";
/// The UDP test's.
const UDP_NODE_ADDR: &str = "192.0.2.81";
const UDP_CLIENT_ADDR: &str = "192.0.2.82";
/// The second test's (each test's node has an address of its own in the shared API server).
const HELD_NODE_ADDR: &str = "192.0.2.71";
const HELD_CLIENT_ADDR: &str = "192.0.2.72";
/// The IPv6 test's: the node's address on the uplink, the client's, and the node's end of the
/// link to the backend elsewhere and the backend's.
const V6_NODE_ADDR: &str = "fd89:61::1";
const V6_CLIENT_ADDR: &str = "fd89:61::2";
const FAR6_NODE_ADDR: &str = "fd89:64::1";
const FAR6_ADDR: &str = "fd89:64::10";
/// The link to the backend elsewhere: the node's end, and the backend.
const FAR_LINK: &str = "far0";
const FAR_NODE_ADDR: &str = "10.89.4.1";
const FAR_ADDR: &str = "10.89.4.10";

/// The client, in the outside namespace: TCP to `argv[2]`, then UDP to `argv[3]`, each tried
/// until it answers or `argv[4]` seconds have passed. Prints `tcp <answer>` and
/// `udp <answer> <source of the answer>`, or `<proto> failed <error>`.
const CLIENT: &str = r#"
import socket, sys, time
host, tport, uport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.time() + float(sys.argv[4])
def tcp():
    s = socket.create_connection((host, tport), timeout=1)
    s.sendall(b"hi")
    return s.recv(64).decode()
def udp():
    u = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(1)
    u.sendto(b"yo", (host, uport))
    data, src = u.recvfrom(64)
    return "%s %s:%d" % (data.decode(), src[0], src[1])
for name, f in (("tcp", tcp), ("udp", udp)):
    while True:
        try:
            print(name, f(), flush=True)
            break
        except OSError as e:
            if time.time() > deadline:
                print(name, "failed", e, flush=True)
                break
            time.sleep(0.2)
"#;

/// Serves TCP 8080 and UDP 8053 in `ns` for as long as the test runs: each message of a
/// connection, and each datagram, answered with the address it came from.
fn serve(ns: &Netns) {
    serve_at(ns, "0.0.0.0");
}

/// As [`serve`], on `any` (`[::]`: IPv6, and IPv4 as mapped addresses).
fn serve_at(ns: &Netns, any: &str) {
    let (t, u) = (format!("{any}:8080"), format!("{any}:8053"));
    let (tcp, udp) = ns.run(move || {
        (
            TcpListener::bind(t).expect("bind tcp"),
            UdpSocket::bind(u).expect("bind udp"),
        )
    });
    std::thread::spawn(move || {
        for c in tcp.incoming() {
            let Ok(mut c) = c else { continue };
            let Ok(from) = c.peer_addr() else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0
                        || c.write_all(format!("from {}", from.ip()).as_bytes())
                            .is_err()
                    {
                        break;
                    }
                }
            });
        }
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(format!("from {}", from.ip()).as_bytes(), from);
        }
    });
}

/// A node whose uplink leads to `outside`, a namespace of the test's own where the clients
/// run at `client`/24.
struct Beyond {
    // Bound first in the tests' patterns, dropped last: the uplink goes with the node.
    outside: Netns,
    bed: Bed,
}

fn beyond(api: &KubeApi, tag: &str, cidr: &str, node_addr: &str, client: &str) -> Beyond {
    beyond_dual(api, tag, &[cidr], &[node_addr], &[client])
}

/// As [`beyond`], the node with a pool of each of `cidrs`, and of each family an address
/// (`node_addrs`, IPv4 first: in /24, IPv6 in /64) on the uplink, where the clients have
/// `clients`.
fn beyond_dual(
    api: &KubeApi,
    tag: &str,
    cidrs: &[&str],
    node_addrs: &[&str],
    clients: &[&str],
) -> Beyond {
    let outside = Netns::new(tag);
    let prefix = |a: &str| if a.contains(':') { 64 } else { 24 };
    let bed = Bed::wired(
        api,
        tag,
        cidrs,
        node_addrs,
        |n| {
            n.uplink_to(&outside, UPLINK, &format!("{}/24", node_addrs[0]));
            for a in &node_addrs[1..] {
                let a = format!("{a}/{}", prefix(a));
                n.ns.exec_ok(&["ip", "addr", "add", &a, "dev", UPLINK, "nodad"]);
            }
        },
        &format!("uplinks = [\"{UPLINK}\"]\n"),
    );
    for c in clients {
        let c = format!("{c}/{}", prefix(c));
        outside.exec_ok(&["ip", "addr", "add", &c, "dev", "eth0", "nodad"]);
    }
    Beyond { outside, bed }
}

/// Runs [`CLIENT`] in `outside` against `node_addr`'s NodePorts `tport` (TCP) and `uport`
/// (UDP), each tried for `seconds`: its lines.
fn clients(outside: &Netns, node_addr: &str, tport: u16, uport: u16, seconds: &str) -> Vec<String> {
    let out = outside
        .cmd(&[
            "python3",
            "-c",
            CLIENT,
            node_addr,
            &tport.to_string(),
            &uport.to_string(),
            seconds,
        ])
        .output()
        .expect("run the client");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// A python3 `script` in `ns` driven a line at a time: each line written to its stdin, its
/// answer read from its stdout. It ends when dropped (its stdin closed).
struct Driven {
    child: std::process::Child,
    to: Option<std::process::ChildStdin>,
    from: BufReader<std::process::ChildStdout>,
}

impl Driven {
    fn start(ns: &Netns, script: &str, args: &[&str]) -> Self {
        let mut argv = vec!["python3", "-c", script];
        argv.extend_from_slice(args);
        let mut child = ns
            .cmd(&argv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the driven client");
        let to = child.stdin.take();
        let from = BufReader::new(child.stdout.take().expect("stdout"));
        Self { child, to, from }
    }

    /// Writes `line`, returns the answer's line (empty once the script ended).
    fn say(&mut self, line: &str) -> String {
        let to = self.to.as_mut().expect("stdin");
        writeln!(to, "{line}").expect("write to the driven client");
        let mut answer = String::new();
        self.from
            .read_line(&mut answer)
            .expect("read the driven client");
        answer.trim().to_string()
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        self.to = None;
        let _ = self.child.wait();
    }
}

/// The NodePort of `svc`'s port `i`.
fn node_port(svc: &Value, i: usize) -> u16 {
    svc["spec"]["ports"][i]["nodePort"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or_else(|| panic!("no nodePort: {svc}"))
}

#[test]
fn a_client_outside_reaches_a_nodeport_with_local_and_cluster() {
    let api = KubeApi::shared();
    let Beyond {
        outside,
        bed: Bed {
            cg: _cg, node, ns, ..
        },
    } = beyond(&api, "so", "10.89.3.0/24", NODE_ADDR, CLIENT_ADDR);
    let web = running(&api, &node, &ns, "web");
    serve(&web.ns);
    let service = |policy: &str, ports| web_service(&api, &ns, policy, ports, &["IPv4"]);
    let slice = |address: &str, on: &str| web_slice(&api, &ns, "IPv4", address, on);
    let svc = service("Local", None);
    let (tport, uport) = (node_port(&svc, 0), node_port(&svc, 1));
    slice(&web.ip(), &node.ns.name);
    let client = |seconds: &str| clients(&outside, NODE_ADDR, tport, uport, seconds);
    let served = [
        format!("tcp from {CLIENT_ADDR}"),
        format!("udp from {CLIENT_ADDR} {NODE_ADDR}:{uport}"),
    ];
    // Local, the endpoint here: served, the client's address kept, the replies from the
    // NodePort.
    let got = client("30");
    assert_eq!(got, served, "Local, endpoint here\n{}", node.agent_log());
    // `calixctl trace` from the client's address: the per-packet step, to the pod here.
    let trace = node
        .agent()
        .calixctl_json(&["trace", CLIENT_ADDR, NODE_ADDR, &format!("tcp/{tport}")])
        .unwrap_or_else(|e| panic!("{e}"));
    let detail = service_step(&trace);
    assert!(
        detail.contains("per packet") && detail.contains(&format!("to one of {}:8080", web.ip())),
        "{trace}"
    );

    // Local, the endpoint on another node: dropped here, and counted.
    let before = node.dropped(UPLINK, "service_no_local_endpoint");
    slice(&web.ip(), "elsewhere");
    wait_for(
        "clients outside dropped at a node with no local endpoint",
        Duration::from_secs(30),
        || {
            let got = client("0");
            (got.first().is_some_and(|l| l.starts_with("tcp failed"))).then_some(())
        },
        || node.agent_log(),
    );
    let after = node.dropped(UPLINK, "service_no_local_endpoint");
    assert!(
        after > before,
        "the drops are counted: {before} then {after}"
    );
    // And per Service: the flows from outside sent to the backend (a TCP connection and a UDP
    // flow at least), and those refused.
    let r = node
        .agent()
        .calixctl_json(&["services", &format!("{ns}/web")])
        .unwrap_or_else(|e| panic!("{e}"));
    let counted =
        |port: u16| frontend_counters(&r, |f| f["port"] == port && f["kind"] == "NodePort");
    let (tcp_in, tcp_refused) = counted(tport);
    assert!(
        tcp_in >= 1 && tcp_refused >= 1,
        "the TCP NodePort: {tcp_in} sent, {tcp_refused} refused: {r}"
    );
    assert!(counted(uport).0 >= 1, "the UDP NodePort: {r}");

    // Cluster: the same endpoint serves clients outside wherever its node is.
    service("Cluster", Some((tport, uport)));
    let got = client("30");
    assert_eq!(got, served, "Cluster\n{}", node.agent_log());

    // Cluster, the endpoint on another node: the host stack takes the translated packet there,
    // masqueraded to this node's address (the backend's replies must come back through it),
    // and the replies leave from the NodePort.
    let _far = far_backend(&node, "sf", &[(FAR_NODE_ADDR, FAR_ADDR)]);
    slice(FAR_ADDR, "elsewhere");
    let masqueraded = [
        format!("tcp from {FAR_NODE_ADDR}"),
        format!("udp from {FAR_NODE_ADDR} {NODE_ADDR}:{uport}"),
    ];
    served_in_time(&node, "the backend elsewhere", &masqueraded, client);
}

/// IPv6 from outside, as IPv4 (the first test): a dual-stack NodePort at the node's IPv6
/// address, `Local` with the endpoint here (the client's address kept, the replies from the
/// NodePort), and `Cluster` with the endpoint behind another link (masqueraded to the node's
/// IPv6 address there by `ip6 calix-services`, the replies still from the NodePort).
#[test]
fn an_ipv6_client_outside_reaches_a_dual_stack_nodeport() {
    let api = KubeApi::shared();
    let Beyond {
        outside,
        bed: Bed {
            cg: _cg, node, ns, ..
        },
    } = beyond_dual(
        &api,
        "s6",
        &["10.89.7.0/24", "fd89:7::/120"],
        &["192.0.2.91", V6_NODE_ADDR],
        &["192.0.2.92", V6_CLIENT_ADDR],
    );
    let dual = json!({"ipam": {"type": "calix-ipam", "assign_ipv6": true}});
    let web = api
        .running_pod_with(&node, &ns, "web", json!({"app": "web"}), dual)
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    let web6 = web
        .ips()
        .into_iter()
        .find(|a| a.contains(':'))
        .unwrap_or_else(|| panic!("an IPv6 address: {:?}", web.ips()));
    serve_at(&web.ns, "[::]");
    let service = |policy: &str, ports| web_service(&api, &ns, policy, ports, &["IPv4", "IPv6"]);
    let slice = |address: &str, on: &str| web_slice(&api, &ns, "IPv6", address, on);
    let svc = service("Local", None);
    let (tport, uport) = (node_port(&svc, 0), node_port(&svc, 1));
    slice(&web6, &node.ns.name);
    let client = |seconds: &str| clients(&outside, V6_NODE_ADDR, tport, uport, seconds);
    let served = [
        format!("tcp from {V6_CLIENT_ADDR}"),
        format!("udp from {V6_CLIENT_ADDR} {V6_NODE_ADDR}:{uport}"),
    ];
    let got = client("30");
    assert_eq!(got, served, "Local, endpoint here\n{}", node.agent_log());
    let trace = node
        .agent()
        .calixctl_json(&[
            "trace",
            V6_CLIENT_ADDR,
            V6_NODE_ADDR,
            &format!("tcp/{tport}"),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    let detail = service_step(&trace);
    assert!(
        detail.contains("per packet") && detail.contains(&format!("to one of [{web6}]:8080")),
        "{trace}"
    );

    // Cluster, the endpoint behind another link: masqueraded to the node's address there.
    service("Cluster", Some((tport, uport)));
    let _far = far_backend(
        &node,
        "s6f",
        &[("10.89.8.1", "10.89.8.10"), (FAR6_NODE_ADDR, FAR6_ADDR)],
    );
    slice(FAR6_ADDR, "elsewhere");
    let masqueraded = [
        format!("tcp from {FAR6_NODE_ADDR}"),
        format!("udp from {FAR6_NODE_ADDR} {V6_NODE_ADDR}:{uport}"),
    ];
    served_in_time(&node, "the IPv6 backend elsewhere", &masqueraded, client);
}

/// NodePort Service `web` of namespace `ns`: TCP 80 to 8080 and UDP 53 to 8053 (at NodePorts
/// `ports` when given, else the API server's), `externalTrafficPolicy: policy`, of the IP
/// `families` (two: dual-stack).
fn web_service(
    api: &KubeApi,
    ns: &str,
    policy: &str,
    ports: Option<(u16, u16)>,
    families: &[&str],
) -> Value {
    let mut spec_ports = json!([
        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053}]);
    if let Some((t, u)) = ports {
        spec_ports[0]["nodePort"] = json!(t);
        spec_ports[1]["nodePort"] = json!(u);
    }
    let mut spec =
        json!({"type": "NodePort", "externalTrafficPolicy": policy, "ports": spec_ports});
    if families.len() > 1 {
        spec["ipFamilyPolicy"] = json!("RequireDualStack");
        spec["ipFamilies"] = json!(families);
    }
    api.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": ns, "name": "web"},
        "spec": spec,
    }))
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Service `web`'s EndpointSlice of `address_type` (`IPv4`, `IPv6`): `address` ready on node
/// `on`, TCP 8080 and UDP 8053.
fn web_slice(api: &KubeApi, ns: &str, address_type: &str, address: &str, on: &str) -> Value {
    let name = if address_type == "IPv6" {
        "web-6"
    } else {
        "web-1"
    };
    api.apply(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": ns, "name": name,
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                  {"name": "dns", "port": 8053, "protocol": "UDP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": true},
                       "nodeName": on}],
    }))
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A backend elsewhere: namespace `tag` behind a link of its own from `node` (as another
/// node's pod is), with an address of each family in `addresses` (the node's end, the
/// backend's; IPv4 first, in /24, IPv6 in /64), routed by the node, serving TCP 8080 and
/// UDP 8053.
fn far_backend(node: &Node, tag: &str, addresses: &[(&str, &str)]) -> Netns {
    let far = Netns::new(tag);
    for (i, (node_end, backend)) in addresses.iter().enumerate() {
        let (prefix, family) = if backend.contains(':') {
            (64, "-6")
        } else {
            (24, "-4")
        };
        if i == 0 {
            node.uplink_to(&far, FAR_LINK, &format!("{node_end}/{prefix}"));
        } else {
            let a = format!("{node_end}/{prefix}");
            node.ns
                .exec_ok(&["ip", "addr", "add", &a, "dev", FAR_LINK, "nodad"]);
        }
        let a = format!("{backend}/{prefix}");
        far.exec_ok(&["ip", "addr", "add", &a, "dev", "eth0", "nodad"]);
        far.exec_ok(&["ip", family, "route", "add", "default", "via", node_end]);
    }
    // IPv4 alone: on 0.0.0.0 (a dual-stack socket would see IPv4 clients as mapped addresses).
    serve_at(
        &far,
        if addresses.len() > 1 {
            "[::]"
        } else {
            "0.0.0.0"
        },
    );
    far
}

/// Waits until `client` (a run of [`CLIENT`] trying for the seconds it is given) prints
/// `want`; if it never does, fails with what it printed, the node's nftables and its log.
fn served_in_time(node: &Node, by: &str, want: &[String], client: impl Fn(&str) -> Vec<String>) {
    wait_for(
        &format!("clients outside served by {by}"),
        Duration::from_secs(30),
        || (client("2") == want).then_some(()),
        || {
            let tables = node.ns.exec_ok(&["nft", "list", "ruleset"]);
            format!(
                "{:?}\n{}\n{}",
                client("0"),
                String::from_utf8_lossy(&tables.stdout),
                node.agent_log()
            )
        },
    );
}

/// Holds one TCP connection to `argv[1]`:`argv[2]`: each line of stdin sent, each answer
/// printed.
const HOLD: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
for line in sys.stdin:
    s.sendall(line.strip().encode())
    print(s.recv(64).decode(), flush=True)
"#;

#[test]
fn a_connection_from_outside_lasts_through_agent_restarts_and_an_upgrade() {
    let api = KubeApi::shared();
    let Beyond {
        outside,
        bed: Bed {
            cg: _cg, node, ns, ..
        },
    } = beyond(&api, "su", "10.89.5.0/24", HELD_NODE_ADDR, HELD_CLIENT_ADDR);
    let web = running(&api, &node, &ns, "web");
    serve(&web.ns);
    let svc = api
        .apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": "web"},
            "spec": {"type": "NodePort", "externalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
                               {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    api.apply(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": ns, "name": "web-1",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                  {"name": "dns", "port": 8053, "protocol": "UDP"}],
        "endpoints": [{"addresses": [web.ip()], "conditions": {"ready": true},
                       "nodeName": node.ns.name}],
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let (tport, uport) = (node_port(&svc, 0), node_port(&svc, 1));
    let fresh = || clients(&outside, HELD_NODE_ADDR, tport, uport, "30");
    let served = [
        format!("tcp from {HELD_CLIENT_ADDR}"),
        format!("udp from {HELD_CLIENT_ADDR} {HELD_NODE_ADDR}:{uport}"),
    ];
    assert_eq!(fresh(), served, "{}", node.agent_log());
    let mut held = Driven::start(&outside, HOLD, &[HELD_NODE_ADDR, &tport.to_string()]);
    let mut say = |what: &str| held.say(what);
    let answer = format!("from {HELD_CLIENT_ADDR}");
    assert_eq!(say("first"), answer);
    // kill -9: the programs and their maps (the flow among them) stay.
    node.kill_agent();
    assert_eq!(say("agent down"), answer, "with the agent killed");
    assert_eq!(fresh(), served, "a new client with the agent killed");
    node.start_agent();
    assert_eq!(say("restarted"), answer, "after the restart");
    // An upgrade: another build of the programs (it counts what pods send under a marker
    // reason) takes over the pinned maps.
    node.stop_agent();
    let upgrade = calix_testbed::upgrade_test_object();
    node.start_agent_with(&["--bpf-object", &upgrade.display().to_string()]);
    let marked = || node.dropped(&web.host_ifname(), "reason_255");
    wait_for(
        "the upgraded programs run on web's veth",
        Duration::from_secs(30),
        || {
            let before = marked();
            let got = say("upgraded");
            (got == answer && marked() > before).then_some(())
        },
        || node.agent_log(),
    );
    assert_eq!(fresh(), served, "a new client after the upgrade");
}

/// Answers each UDP datagram on port 8053 and each TCP connection on port 8080 in `ns` with
/// `name`.
fn named(ns: &Netns, name: &'static str) {
    let (tcp, udp) = ns.run(|| {
        (
            TcpListener::bind("0.0.0.0:8080").expect("bind tcp"),
            UdpSocket::bind("0.0.0.0:8053").expect("bind udp"),
        )
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(name.as_bytes(), from);
        }
    });
    std::thread::spawn(move || {
        for mut c in tcp.incoming().flatten() {
            let _ = c.write_all(name.as_bytes());
        }
    });
}

/// A TCP connection to `argv[1]`:`argv[2]` from source port `argv[3]` (reset when closed: no
/// TIME_WAIT keeps the port): what the server said first.
const FROM_PORT: &str = r#"
import socket, struct, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
s.bind(("", int(sys.argv[3])))
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print(s.recv(64).decode())
except OSError as e:
    print("failed", e)
s.close()
"#;

/// One UDP socket to `argv[1]`:`argv[2]`: for each line of stdin a datagram, and the answer
/// printed (`timeout` when none came).
const ASK: &str = r#"
import socket, sys
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(1)
for line in sys.stdin:
    u.sendto(b"q", (sys.argv[1], int(sys.argv[2])))
    try:
        print(u.recv(64).decode(), flush=True)
    except OSError:
        print("timeout", flush=True)
"#;

#[test]
fn a_udp_client_outside_leaves_a_backend_that_goes() {
    let api = KubeApi::shared();
    let Beyond {
        outside,
        bed: Bed {
            cg: _cg, node, ns, ..
        },
    } = beyond(&api, "sd", "10.89.6.0/24", UDP_NODE_ADDR, UDP_CLIENT_ADDR);
    let one = running(&api, &node, &ns, "one");
    let two = running(&api, &node, &ns, "two");
    named(&one.ns, "one");
    named(&two.ns, "two");
    let svc = api
        .apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": "dns"},
            "spec": {"type": "NodePort",
                     "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053},
                               {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    let (port, tport) = (node_port(&svc, 0), node_port(&svc, 1));
    let slice = |pods: &[&Pod<'_>]| {
        let endpoints: Vec<Value> = pods
            .iter()
            .map(|p| {
                json!({"addresses": [p.ip()], "conditions": {"ready": true},
                            "nodeName": node.ns.name})
            })
            .collect();
        api.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": "dns-1",
                         "labels": {"kubernetes.io/service-name": "dns"}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 8053, "protocol": "UDP"},
                      {"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    slice(&[&one, &two]);
    let mut asker = Driven::start(&outside, ASK, &[UDP_NODE_ADDR, &port.to_string()]);
    let mut ask = || asker.say("q");
    let mut first = String::from("timeout");
    wait_for(
        "the UDP client served",
        Duration::from_secs(30),
        || {
            first = ask();
            (first != "timeout").then_some(())
        },
        || node.agent_log(),
    );
    // Its flow keeps it on one backend...
    for _ in 0..5 {
        assert_eq!(ask(), first, "one flow, one backend");
    }
    // ...until that backend leaves the Service (its pod still answers: only the flow could
    // keep the client there).
    let (stays, name) = if first == "one" {
        (&two, "two")
    } else {
        (&one, "one")
    };
    slice(&[stays]);
    wait_for(
        "the same socket's datagrams meet the backend left",
        Duration::from_secs(30),
        || (ask() == name).then_some(()),
        || node.agent_log(),
    );
    assert!(
        node.agent_log()
            .contains("flows from outside sent there forgotten"),
        "{}",
        node.agent_log()
    );

    // TCP: a client that reuses its port after its connection ended meets the backends as
    // they are then, not the one its old flow went to (whose pod still answers).
    slice(&[&one, &two]);
    let from = |port: u16| {
        let out = outside
            .cmd(&[
                "python3",
                "-c",
                FROM_PORT,
                UDP_NODE_ADDR,
                &tport.to_string(),
                &port.to_string(),
            ])
            .output()
            .expect("run the TCP client");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let from_port = || from(40123);
    let mut was = String::new();
    wait_for(
        "the TCP client served, both backends in the Service",
        Duration::from_secs(30),
        || {
            was = from_port();
            (was == "one" || was == "two").then_some(())
        },
        || node.agent_log(),
    );
    let (stays, name) = if was == "one" {
        (&two, "two")
    } else {
        (&one, "one")
    };
    slice(&[stays]);
    wait_for(
        "the same client port meets the backend left",
        Duration::from_secs(30),
        || (from_port() == name).then_some(()),
        || node.agent_log(),
    );

    // Maglev: each new connection meets the backend its slot in the Maglev table names, the
    // table every node with these backends builds (computed here from the backends alone);
    // and when a backend leaves, the connections of the others stay where they were.
    let three = running(&api, &node, &ns, "three");
    named(&three.ns, "three");
    let ports: Vec<u16> = (40300..40332).collect();
    let met_each = || -> Vec<String> { ports.iter().map(|p| from(*p)).collect() };
    let named_pods = [(&one, "one"), (&two, "two"), (&three, "three")];
    slice(&[&one, &two, &three]);
    let all3 = expected_by_maglev(&named_pods, UDP_CLIENT_ADDR, &ports);
    let spread: BTreeSet<&String> = all3.iter().collect();
    assert_eq!(spread.len(), 3, "32 ports meet all 3 backends: {all3:?}");
    wait_for(
        "every connection meets the backend of its Maglev slot",
        Duration::from_secs(30),
        || (met_each() == all3).then_some(()),
        || node.agent_log(),
    );
    slice(&[&one, &three]);
    let two_left = expected_by_maglev(&[named_pods[0], named_pods[2]], UDP_CLIENT_ADDR, &ports);
    wait_for(
        "with a backend gone, every connection meets its new slot's",
        Duration::from_secs(30),
        || (met_each() == two_left).then_some(()),
        || node.agent_log(),
    );
    let moved: Vec<(&String, &String)> = all3
        .iter()
        .zip(&two_left)
        .filter(|(was, now)| *was != "two" && was != now)
        .collect();
    assert!(
        moved.is_empty(),
        "connections of the backends that stayed moved: {moved:?}"
    );

    // `sessionAffinity: ClientIP`: without it a client's connections from 16 ports spread
    // over both backends; with it they all meet one.
    slice(&[&one, &two]);
    let met = || -> BTreeSet<String> { (40200..40216).map(from).collect() };
    let both: BTreeSet<String> = ["one", "two"].map(String::from).into();
    wait_for(
        "a client's connections spread over both backends",
        Duration::from_secs(30),
        || (met() == both).then_some(()),
        || node.agent_log(),
    );
    api.merge_patch(
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": ns, "name": "dns"}}),
        json!({"spec": {"sessionAffinity": "ClientIP"}}),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "every connection of the client meets one backend",
        Duration::from_secs(30),
        || (met().len() == 1).then_some(()),
        || node.agent_log(),
    );
    let one_of = met();
    assert!(
        one_of.len() == 1 && one_of.is_subset(&both),
        "affinity holds: {one_of:?}"
    );
}

/// The backend (its name) that each of `ports` of `client` meets by the Maglev table of
/// `pods` (their TCP 8080): the eBPF dataplane's own table and hash.
fn expected_by_maglev(pods: &[(&Pod<'_>, &str)], client: &str, ports: &[u16]) -> Vec<String> {
    use calix_common::{svc_client_hash, SvcBackend, SVC_MAGLEV_SLOTS, SVC_V4};
    let backs: Vec<SvcBackend> = pods
        .iter()
        .map(|(p, _)| {
            let a: std::net::Ipv4Addr = p.ip().parse().expect("a pod's IPv4 address");
            let mut addr = [0u8; 16];
            addr[..4].copy_from_slice(&a.octets());
            SvcBackend {
                addr,
                port: 8080u16.to_be(),
                family: SVC_V4,
                _pad: 0,
            }
        })
        .collect();
    let table = calix_dataplane::ebpf::services::maglev(&backs);
    let client: std::net::Ipv4Addr = client.parse().expect("the client's address");
    ports
        .iter()
        .map(|port| {
            let h = svc_client_hash(client.octets(), port.to_be());
            let i = usize::from(table.slots[(h % SVC_MAGLEV_SLOTS) as usize]);
            pods[i].1.to_string()
        })
        .collect()
}
