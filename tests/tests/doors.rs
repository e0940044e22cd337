//! The agent's doors (issue 11): its HTTP port (/metrics, /healthz, /readyz) holds up against
//! idle and slow clients; one agent per node, a second one changes nothing; a stopping agent
//! never removes a socket it does not own; the plugin refuses the node's own namespace and an
//! agent socket that is not served by root; logs escape control characters. Issue 20: only
//! nodes reach the Routes door (bound to the node's addresses, strangers refused before TLS,
//! pods' packets to the agent's ports dropped on their own node). Run as root.
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use calix_proto::v1 as pb;
use calix_testbed::tls::Ca;
use calix_testbed::{cni_call, run, unique, Cluster, Dataplane, EtcdNs, Node, Pod};
use common::flood::Flood;
use serde_json::{json, Value};

mod common;

/// Opens `n` connections to the HTTP door from inside the node and sends nothing; returns
/// them and how many the agent had closed after `after` (EOF or a reset).
fn idle_connections(node: &Node, n: usize, after: Duration) -> (Vec<TcpStream>, usize) {
    node.ns.run(move || {
        let socks: Vec<TcpStream> = (0..n)
            .map(|_| TcpStream::connect("127.0.0.1:9091").expect("connect"))
            .collect();
        std::thread::sleep(after);
        let closed = socks
            .iter()
            .filter(|s| is_closed(s, Duration::from_millis(10)))
            .count();
        (socks, closed)
    })
}

/// Whether the peer closed `s` (EOF or reset) within `wait`.
fn is_closed(s: &TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).expect("timeout");
    let mut b = [0u8; 1];
    match (&*s).read(&mut b) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

#[test]
fn the_http_door_caps_connections_and_drops_idle_ones() {
    let node = Node::start(Dataplane::Ebpf);
    let (ok, _) = node.http_get("/metrics").expect("GET /metrics");
    assert_eq!(ok, 200);
    // 40 clients that never send a request: the agent serves at most 16 at once and closes
    // the rest at once; the gRPC socket is unaffected.
    let (held, closed_at_once) = idle_connections(&node, 40, Duration::from_millis(300));
    assert!(
        closed_at_once >= 40 - 16,
        "only {closed_at_once} of 40 idle connections were refused"
    );
    assert!(node.calixctl(&["endpoints"]).status.success());
    // The idle ones it kept are closed when the read timeout (5 s) runs out...
    let started = Instant::now();
    let still_open = node.ns.run(move || {
        held.iter()
            .filter(|s| !is_closed(s, Duration::from_secs(8)))
            .count()
    });
    assert_eq!(still_open, 0);
    assert!(started.elapsed() < Duration::from_secs(8));
    // ...and the port serves again, counting what it refused.
    let (code, body) = node
        .http_get("/metrics")
        .expect("GET /metrics after the flood");
    assert_eq!(code, 200);
    let refused: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix("calix_http_refused_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(refused >= 24, "calix_http_refused_total {refused}\n{body}");
    // A client that trickles a request never finishes it: closed at the read timeout.
    let t0 = Instant::now();
    let trickled = node.ns.run(|| {
        let mut s = TcpStream::connect("127.0.0.1:9091").expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(9)))
            .expect("timeout");
        for _ in 0..12 {
            if s.write_all(b"G").is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let mut b = [0u8; 64];
        matches!(s.read(&mut b), Ok(0) | Err(_))
    });
    assert!(trickled, "a trickling client was not cut off");
    assert!(t0.elapsed() < Duration::from_secs(12));
}

#[test]
fn healthz_and_readyz_answer_only_after_the_initial_sync() {
    let etcd = EtcdNs::start();
    let probe = Node::create(Dataplane::Kernel, None);
    let url = etcd.wire(&probe.ns);
    let node = probe.with_config(&format!(
        "[datastore]\ntype = \"etcd\"\nendpoints = [\"{url}\"]\nprefix = \"/calix-test/\"\nattempts = 40\n\n[[pools]]\ncidr = \"10.61.0.0/20\"\n"
    ));
    // etcd is down: the agent cannot finish its initial sync.
    etcd.kill();
    node.spawn_agent(&[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = None;
    while Instant::now() < deadline && seen.is_none() {
        seen = node.http_get("/readyz");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(seen.map(|(c, _)| c), Some(503), "{}", node.agent_log());
    assert_eq!(node.http_get("/healthz").map(|(c, _)| c), Some(503));
    assert_eq!(node.http_get("/metrics").map(|(c, _)| c), Some(503));
    assert!(!node.calixctl(&["endpoints"]).status.success());
    // etcd comes back: the sync completes and every door opens.
    etcd.spawn();
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.http_get("/readyz").map(|(c, _)| c) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "never ready:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(node.http_get("/healthz").map(|(c, _)| c), Some(200));
    assert!(
        node.calixctl(&["endpoints"]).status.success(),
        "ready, so the socket answers"
    );
}

/// (device, inode) of the file at `path`.
fn file_id(path: &std::path::Path) -> (u64, u64) {
    let m = std::fs::symlink_metadata(path).expect("stat");
    (m.dev(), m.ino())
}

#[test]
fn a_second_agent_refuses_to_start_and_changes_nothing() {
    let node = Node::start(Dataplane::Ebpf);
    let pod = Pod::add(&node, "a");
    let host_if = pod.host_ifname();
    let prog = node
        .filter_prog(&host_if, "ingress")
        .expect("from_pod attached");
    let socket = file_id(&node.socket);
    let args = node.agent_args(&[]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let second = run(&mut node.ns.cmd_setns(&argv));
    assert!(!second.status.success(), "a second agent started");
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("already runs"), "{err}");
    assert!(
        err.contains(&format!("pid {}", node.agent_pid().expect("pid"))),
        "{err}"
    );
    // The first agent's socket, programs and traffic are untouched.
    assert_eq!(file_id(&node.socket), socket, "the socket was replaced");
    assert_eq!(
        node.filter_prog(&host_if, "ingress"),
        Some(prog),
        "programs replaced"
    );
    assert!(node.calixctl(&["endpoints"]).status.success());
    let peer = Pod::add(&node, "b");
    assert!(peer.ns.ping(&pod.ip(), 2));
}

#[test]
fn a_stopping_agent_leaves_a_socket_it_does_not_own() {
    let node = Node::start(Dataplane::Kernel);
    // Someone else's socket at the agent's path now.
    std::fs::remove_file(&node.socket).expect("remove");
    let theirs = std::os::unix::net::UnixListener::bind(&node.socket).expect("bind");
    let id = file_id(&node.socket);
    node.stop_agent();
    assert!(
        node.socket.exists(),
        "the stopping agent removed someone else's socket"
    );
    assert_eq!(file_id(&node.socket), id);
    assert!(
        node.agent_log().contains("not removing the socket"),
        "{}",
        node.agent_log()
    );
    drop(theirs);
}

#[test]
fn add_refuses_the_nodes_own_namespace() {
    let node = Node::start(Dataplane::under_test());
    let own = node.ns.path();
    let out = cni_call(
        &node.ns,
        "ADD",
        &format!("{}0123456789ab", node.ns.name),
        &own,
        "eth0",
        "K8S_POD_NAMESPACE=default;K8S_POD_NAME=hostns",
        &node.conf(Value::Null).to_string(),
    );
    assert!(!out.success, "ADD into the node's own namespace succeeded");
    assert_eq!(out.code(), Some(4), "{}", out.stdout);
    assert!(
        out.stdout.contains("node's own network namespace"),
        "{}",
        out.stdout
    );
    assert!(node.cali_links().is_empty(), "{:?}", node.cali_links());
    assert_eq!(node.allocated(), 0);
}

#[test]
fn the_plugin_refuses_an_agent_socket_not_served_by_root() {
    let node = Node::start(Dataplane::Kernel);
    let dir = std::env::temp_dir().join(unique("fake"));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let sock = dir.join("agent.sock");
    // An impostor listening as nobody.
    let script = format!(
        "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.bind({:?})\ns.listen(8)\nprint('up',flush=True)\ntime.sleep(30)",
        sock.display().to_string()
    );
    let mut impostor = node
        .ns
        .cmd(&[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            &script,
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("impostor");
    let mut up = [0u8; 2];
    impostor
        .stdout
        .as_mut()
        .expect("stdout")
        .read_exact(&mut up)
        .expect("impostor up");
    let pod = Pod::try_add(
        &node,
        "victim",
        json!({"agent_socket": sock.display().to_string()}),
    );
    let _ = impostor.kill();
    let _ = impostor.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!pod.result.success, "ADD talked to an impostor");
    assert!(
        pod.result.stdout.contains("not by root"),
        "{}",
        pod.result.stdout
    );
    assert!(node.cali_links().is_empty(), "{:?}", node.cali_links());
}

#[test]
fn logs_escape_control_characters() {
    let node = Node::start(Dataplane::Kernel);
    // The plugin: a namespace path with a forged log line in it.
    let log = node.dir.join("plugin.log");
    let conf = node.conf(json!({"log_level": "info", "log_file_path": log.display().to_string()}));
    let out = cni_call(
        &node.ns,
        "ADD",
        &format!("{}0123456789ab", node.ns.name),
        "/nonexistent\nERROR forged=1\u{1b}[2J",
        "eth0",
        "",
        &conf.to_string(),
    );
    assert!(!out.success);
    let text = std::fs::read_to_string(&log).expect("plugin log");
    assert!(
        !text.lines().any(|l| l.starts_with("ERROR forged")),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "{text:?}");
    assert!(
        text.contains("/nonexistent\\nERROR forged=1\\u{1b}[2J"),
        "{text}"
    );
    // The agent: a handle with a forged line, through its gRPC API.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let ch = calix_proto::connect_unix(&node.socket, Duration::from_secs(5))
            .await
            .expect("connect");
        let mut ipam = pb::ipam_client::IpamClient::new(ch);
        ipam.allocate(pb::AllocateRequest {
            handle: "evil\nINFO forged=1".into(),
            ifname: "eth0".into(),
            ipv4: true,
            ..Default::default()
        })
        .await
        .expect("allocate");
    });
    let agent_log = node.agent_log();
    assert!(
        !agent_log.lines().any(|l| l.starts_with("INFO forged")),
        "{agent_log}"
    );
    assert!(agent_log.contains("evil\\nINFO forged=1"), "{agent_log}");
}

// ---- Only nodes reach the Routes door (issue 20, item 3) ----

/// `calixctl nodes -o json` of cluster node `i`.
fn nodes_report(c: &Cluster, i: usize) -> Value {
    c.nodes[i]
        .agent()
        .calixctl_json(&["nodes"])
        .unwrap_or_else(|e| panic!("calixctl nodes on node {i}: {e}"))
}

/// (name, state, snapshots) of each peer node `i` follows.
fn peer_states(c: &Cluster, i: usize) -> Vec<(String, String, u64)> {
    nodes_report(c, i)["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or_default().to_string(),
                p["state"].as_str().unwrap_or_default().to_string(),
                p["snapshots"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// Polls `done` every 100 ms for up to `secs`; panics naming `what` (and showing `show()`).
fn within_showing(
    secs: u64,
    what: &str,
    mut done: impl FnMut() -> bool,
    show: impl Fn() -> String,
) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "not within {secs} s: {what}\n{}",
            show()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The local addresses of the TCP sockets listening on `port` in process `pid`'s namespace.
fn listening_on(pid: u32, port: u16) -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")).unwrap_or_default();
        for l in table.lines().skip(1) {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let Some((addr, p)) = cols.get(1).and_then(|a| a.split_once(':')) else {
                continue;
            };
            if cols.get(3) != Some(&"0A") || u16::from_str_radix(p, 16).ok() != Some(port) {
                continue;
            }
            // /proc/net/tcp{,6}: the address as 32-bit words in host byte order.
            let words: Vec<u32> = (0..addr.len() / 8)
                .filter_map(|i| u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16).ok())
                .collect();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            let ip = match (v6, bytes.len()) {
                (false, 4) => IpAddr::from(<[u8; 4]>::try_from(bytes).expect("4 bytes")),
                (true, 16) => IpAddr::from(<[u8; 16]>::try_from(bytes).expect("16 bytes")),
                _ => continue,
            };
            out.insert(ip);
        }
    }
    out
}

/// Whether `ns` completes a TCP handshake with `to` within 2 s.
fn connects(ns: &calix_testbed::Netns, to: SocketAddr) -> bool {
    ns.run(move || TcpStream::connect_timeout(&to, Duration::from_secs(2)).is_ok())
}

/// The packets counted by the rules of nftables table `inet <table>` in `node`'s namespace.
fn nft_counted(node: &Node, table: &str) -> u64 {
    let out = node.ns.exec(&["nft", "-j", "list", "table", "inet", table]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["rule"]["expr"].as_array())
        .flatten()
        .filter_map(|e| e["counter"]["packets"].as_u64())
        .sum()
}

/// Issue 20, item 3: the Routes door (5474) of node 0 is flooded with 64 idle connections
/// each from a pod on node 0, from a pod on node 1 (natOutgoing: SNATed to node 1's address,
/// a known node) and from 8 addresses no node has, in a namespace of the test's own; pods
/// also try the metrics port. The door listens on node 0's own addresses only; the pods'
/// connections never complete (dropped on their own node: `from_pod` in eBPF mode, nftables
/// in kernel mode), the strangers' are closed at once before TLS and counted; every real peer
/// stays up throughout (no stream lost, no grace period), and when node 0's agent restarts
/// its peers are back within seconds, through the flood. The node itself (the kubelet's
/// probes) still reaches the metrics port.
#[test]
fn only_nodes_reach_the_routes_door() {
    let ca = Ca::new("calix-test-ca").expect("CA");
    let dataplane = Dataplane::under_test();
    let c = Cluster::create(dataplane, &[1, 1, 2], |i, c| {
        "metrics_addr = \"0.0.0.0:9091\"\n".to_string()
            + &c.base_config(i)
            + "[[pools]]\ncidr = \"10.244.0.0/16\"\nnatOutgoing = true\n"
            + &c.routes_config(i, &ca, "grace_secs = 10")
                .expect("routes config")
    });
    c.start();
    let settled = |i: usize| {
        let s = peer_states(&c, i);
        s.len() == 2 && s.iter().all(|(_, state, _)| state == "up")
    };
    for i in 0..3 {
        within_showing(
            20,
            &format!("node {i} streams from both peers"),
            || settled(i),
            || format!("{:?}", peer_states(&c, i)),
        );
    }
    let pod0 = Pod::add(&c.nodes[0], "p");
    let pod1 = Pod::add(&c.nodes[1], "q");
    let node0: IpAddr = c.address(0).parse().expect("address");
    let routes_door = SocketAddr::new(node0, 5474);
    let metrics_door = SocketAddr::new(node0, 9091);
    // The pods reach node 0 at all (ping), and the node reaches its own metrics port.
    assert!(pod0.ns.ping(&c.address(0), 1) && pod1.ns.ping(&c.address(0), 1));
    assert!(
        connects(&c.nodes[0].ns, metrics_door),
        "the node's own metrics port"
    );

    // The door listens on node 0's addresses, one per family, nothing else.
    let pid = c.nodes[0].agent_pid().expect("agent pid");
    let want: BTreeSet<IpAddr> = [c.address(0), c.address6(0)]
        .iter()
        .map(|a| a.parse().expect("address"))
        .collect();
    assert_eq!(
        listening_on(pid, 5474),
        want,
        "what the Routes port listens on"
    );

    // A stranger: 8 addresses no node has, on node 0's subnet.
    let stranger = calix_testbed::Netns::create(unique("s")).expect("namespace");
    let port = format!("s{}", std::process::id() % 100_000);
    calix_testbed::veth(&stranger, "eth0", c.underlay(), &port).expect("veth");
    c.underlay()
        .ip(&format!("link set {port} master bra up"))
        .expect("bridge port");
    let strangers: Vec<IpAddr> = (200..208)
        .map(|k| format!("172.31.1.{k}").parse().expect("ip"))
        .collect();
    for a in &strangers {
        stranger
            .ip(&format!("addr add {a}/24 dev eth0"))
            .expect("address");
    }
    stranger.ip("link set eth0 up").expect("up");
    within_showing(
        10,
        "the stranger reaches node 0",
        || stranger.ping(&c.address(0), 1),
        String::new,
    );

    // The floods, held for the rest of the test.
    let per_source = |addrs: &[IpAddr]| -> Vec<Option<IpAddr>> {
        addrs.iter().flat_map(|a| [Some(*a); 8]).collect()
    };
    let from_stranger = Flood::start(&stranger, per_source(&strangers), routes_door);
    let from_pod0 = Flood::start(&pod0.ns, vec![None; 64], routes_door);
    let from_pod1 = Flood::start(&pod1.ns, vec![None; 64], routes_door);
    let metrics_pod0 = Flood::start(&pod0.ns, vec![None; 4], metrics_door);
    let metrics_pod1 = Flood::start(&pod1.ns, vec![None; 4], metrics_door);
    let show = || {
        format!(
            "stranger {:?}, pod on node 0 {:?}, pod on node 1 {:?}, metrics from pods {:?} {:?} \
             [connected, closed at once, held, timed out, failed]\nnode 0's door: {}",
            from_stranger.get(),
            from_pod0.get(),
            from_pod1.get(),
            metrics_pod0.get(),
            metrics_pod1.get(),
            nodes_report(&c, 0)["door"]
        )
    };

    // 12 s of flood (more than two handshake timeouts): every stream stays up, none starts
    // over, the routes stay.
    let before: Vec<_> = (0..3).map(|i| peer_states(&c, i)).collect();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(12) {
        for (i, was) in before.iter().enumerate() {
            assert_eq!(
                &peer_states(&c, i),
                was,
                "node {i}'s peers during the flood\n{}",
                show()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let [connected, ..] = from_pod0.get();
    assert_eq!(
        connected,
        0,
        "a pod reached its own node's Routes port\n{}",
        show()
    );
    let [connected, ..] = from_pod1.get();
    assert_eq!(
        connected,
        0,
        "a pod reached another node's Routes port\n{}",
        show()
    );
    assert_eq!(
        metrics_pod0.get()[0] + metrics_pod1.get()[0],
        0,
        "pods reached the metrics port\n{}",
        show()
    );
    assert!(
        from_pod0.get()[3] >= 64 && from_pod1.get()[3] >= 64,
        "the pods tried\n{}",
        show()
    );
    // The flood still runs: each of the 64 sources may have one connection between its
    // handshake and its close when the counters are read. Refused at once, each source
    // reconnects every ~0.2 s: many rounds each, none held.
    let sources = strangers.len() as u64 * 8;
    let [connected, closed_at_once, held, ..] = from_stranger.get();
    assert!(connected >= 10 * sources, "{}", show());
    assert!(
        connected.saturating_sub(closed_at_once) <= sources && held == 0,
        "the strangers' connections\n{}",
        show()
    );
    let door = nodes_report(&c, 0)["door"].clone();
    assert!(door["refused_unknown"].as_u64() >= Some(64), "{door}");
    assert_eq!(
        (door["refused_busy"].as_u64(), door["refused_tls"].as_u64()),
        (Some(0), Some(0)),
        "{door}"
    );
    let (_, metrics) = c.nodes[0]
        .http_get("/metrics")
        .expect("/metrics from the node itself");
    assert!(
        metrics.contains("calix_route_connections_refused_total{cause=\"unknown\"}"),
        "{metrics}"
    );
    // Where the pods' packets were dropped: on their own node.
    match dataplane {
        Dataplane::Ebpf => {
            for (node, pod) in [(&c.nodes[0], &pod0), (&c.nodes[1], &pod1)] {
                let n = node.dropped(&pod.host_ifname(), "agent_port");
                assert!(
                    n >= 64,
                    "{} agent_port drops on {}\n{}",
                    n,
                    pod.host_ifname(),
                    show()
                );
            }
        }
        Dataplane::Kernel => {
            for i in [0, 1] {
                let n = nft_counted(&c.nodes[i], "calix_doors");
                assert!(
                    n >= 64,
                    "node {i}'s calix_doors table counted {n}\n{}",
                    show()
                );
            }
        }
    }

    // Node 0's agent restarts in the flood: its peers are back within seconds.
    let snapshots_of_0 = |i: usize| {
        peer_states(&c, i)
            .into_iter()
            .find(|(name, _, _)| name == c.name(0))
            .map_or(0, |(_, _, n)| n)
    };
    let seen = [snapshots_of_0(1), snapshots_of_0(2)];
    c.nodes[0].kill_agent();
    c.nodes[0].start_agent();
    let restarted = Instant::now();
    for i in 0..3 {
        within_showing(
            15,
            &format!("node {i} streams from both peers after node 0's restart"),
            || settled(i),
            || format!("{:?}\n{}", peer_states(&c, i), show()),
        );
    }
    eprintln!(
        "peers back {:?} after node 0's agent restarted, in the flood\n{}",
        restarted.elapsed(),
        show()
    );
    for (k, i) in [1, 2].into_iter().enumerate() {
        within_showing(
            15,
            &format!("node {i} streams from the restarted node 0 (a new snapshot)"),
            || snapshots_of_0(i) > seen[k],
            || format!("{:?}\n{}", peer_states(&c, i), show()),
        );
    }
    let (code, _) = c.nodes[0].http_get("/metrics").expect("/metrics");
    assert_eq!(code, 200);
    assert!(
        connects(&c.nodes[0].ns, metrics_door),
        "the node's own metrics port"
    );
    assert_eq!(from_pod0.get()[0] + from_pod1.get()[0], 0, "{}", show());
}

/// Issue 20: the metrics port listening on every address (as the chart has it) is closed to
/// pods on the node's addresses unless `[doors] pods_reach_metrics` (Prometheus in a pod);
/// the node itself (the kubelet's probes) always reaches it.
#[test]
fn pods_reach_the_metrics_port_only_when_the_operator_allows_it() {
    let dataplane = Dataplane::under_test();
    for allowed in [false, true] {
        let config = format!(
            "metrics_addr = \"0.0.0.0:9091\"\n[doors]\npods_reach_metrics = {allowed}\n\
             [[pools]]\ncidr = \"10.244.0.0/16\"\n"
        );
        let node = Node::start_with_config(dataplane, Some(&config));
        let pod = Pod::add(&node, "p");
        let door: SocketAddr = format!("{}:9091", node.node_ip).parse().expect("addr");
        assert!(pod.ns.ping(&node.node_ip, 1), "the pod reaches the node");
        assert!(
            connects(&node.ns, door),
            "the node reaches its own metrics port"
        );
        assert_eq!(
            connects(&pod.ns, door),
            allowed,
            "a pod on the metrics port, pods_reach_metrics = {allowed}"
        );
        let (code, _) = node.http_get("/healthz").expect("/healthz from the node");
        assert_eq!(code, 200);
    }
}
