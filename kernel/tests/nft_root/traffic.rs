//! Traffic through the tables the module writes: a pod namespace behind a node namespace
//! (`calit0`, a `cali*` interface) with a server namespace on the node's uplink.

use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use calix_kernel::nft::{self, Family};

use super::{fixtures, TestNs};

struct Topology {
    pod: TestNs,
    node: TestNs,
    server: TestNs,
}

/// pod eth0 10.244.0.2 -- calit0 10.244.0.1 [node, forwarding] up0 172.31.0.1 -- eth0
/// 172.31.0.2 server, which has no route back to the pods: only a masqueraded packet gets
/// an answer, and its source says what the node did.
fn topology() -> Topology {
    let (pod, node, server) = (TestNs::new(), TestNs::new(), TestNs::new());
    let sh = |ns: &TestNs, cmds: &[&str]| {
        for c in cmds {
            let args: Vec<&str> = c.split_whitespace().collect();
            ns.exec_ok(&args);
        }
    };
    node.exec_ok(&[
        "ip", "link", "add", "calit0", "type", "veth", "peer", "name", "eth0", "netns", &pod.name,
    ]);
    node.exec_ok(&[
        "ip",
        "link",
        "add",
        "up0",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &server.name,
    ]);
    sh(
        &node,
        &[
            "ip link set lo up",
            "ip addr add 10.244.0.1/24 dev calit0",
            "ip link set calit0 up",
            "ip addr add 172.31.0.1/24 dev up0",
            "ip link set up0 up",
            "sysctl -qw net.ipv4.ip_forward=1",
        ],
    );
    sh(
        &pod,
        &[
            "ip link set lo up",
            "ip addr add 10.244.0.2/24 dev eth0",
            "ip link set eth0 up",
            "ip route add default via 10.244.0.1",
        ],
    );
    sh(
        &server,
        &[
            "ip link set lo up",
            "ip addr add 172.31.0.2/24 dev eth0",
            "ip link set eth0 up",
        ],
    );
    Topology { pod, node, server }
}

/// The source the server sees of a datagram the pod sends it.
fn source_seen(t: &Topology) -> SocketAddr {
    let server = t
        .server
        .run(|| UdpSocket::bind("0.0.0.0:7777"))
        .expect("bind in the server");
    server
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let client = t
        .pod
        .run(|| UdpSocket::bind("0.0.0.0:0"))
        .expect("bind in the pod");
    client
        .send_to(b"hello", "172.31.0.2:7777")
        .expect("send from the pod");
    let mut buf = [0u8; 16];
    let (_, from) = server.recv_from(&mut buf).expect("the datagram arrives");
    from
}

#[test]
fn the_masquerade_table_translates_to_the_node_and_its_ports() {
    let t = topology();
    // Without the table, the pod's own address.
    assert_eq!(source_seen(&t).ip().to_string(), "10.244.0.2");
    let mut table = fixtures::masquerade();
    // The first rule's range: a narrow one to see it used.
    let chain = &mut table.chains[0];
    chain.rules[0] = nft::Rule::builder(Family::Ip)
        .ipv4_in(
            nft::Addr::Source,
            &["10.244.0.0/16".parse().expect("net")],
            false,
        )
        .ipv4_in(
            nft::Addr::Destination,
            &["10.244.0.0/16".parse().expect("net")],
            true,
        )
        .l4proto_in(&[6, 17, 1], false)
        .masquerade(Some((40000, 40009)));
    t.node.apply(&table).expect("apply the masquerade");
    let seen = source_seen(&t);
    assert_eq!(seen.ip().to_string(), "172.31.0.1", "masqueraded");
    assert!((40000..=40009).contains(&seen.port()), "{seen}");
    t.node
        .run(|| nft::delete(Family::Ip, "calix"))
        .expect("delete");
    // (Each datagram comes from a new port: a new connection, which the table no longer
    // translates.)
    assert_eq!(source_seen(&t).ip().to_string(), "10.244.0.2");
}

fn connects(t: &Topology, port: u16) -> bool {
    let to: SocketAddr = format!("172.31.0.1:{port}").parse().expect("addr");
    t.pod
        .run(move || TcpStream::connect_timeout(&to, Duration::from_millis(700)))
        .is_ok()
}

#[test]
fn the_doors_table_drops_pods_tcp_to_the_closed_ports() {
    let t = topology();
    let _listeners: Vec<TcpListener> = [5474u16, 9091, 9092]
        .iter()
        .map(|p| {
            let p = *p;
            t.node
                .run(move || TcpListener::bind(("0.0.0.0", p)))
                .expect("listen in the node")
        })
        .collect();
    assert!(connects(&t, 9091) && connects(&t, 9092));
    t.node.apply(&fixtures::doors()).expect("apply the doors");
    assert!(!connects(&t, 9091), "9091 is closed to pods");
    assert!(!connects(&t, 5474), "5474 is closed to pods");
    assert!(connects(&t, 9092), "9092 is not");
    let counted = t
        .node
        .exec_ok(&["nft", "list", "chain", "inet", "calix_doors", "input"]);
    assert!(!counted.contains("counter packets 0 "), "{counted}");
    // The node itself is not a pod: it still reaches the port.
    let to: SocketAddr = "172.31.0.1:9091".parse().expect("addr");
    assert!(t
        .node
        .run(move || TcpStream::connect_timeout(&to, Duration::from_millis(700)))
        .is_ok());
}
