//! The agent's doors (issue 11): its HTTP port (/metrics, /healthz, /readyz) holds up against
//! idle and slow clients; one agent per node, a second one changes nothing; a stopping agent
//! never removes a socket it does not own; the plugin refuses the node's own namespace and an
//! agent socket that is not served by root; logs escape control characters. Run as root.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use calix_proto::v1 as pb;
use calix_testbed::{cni_call, run, unique, Dataplane, EtcdNs, Node, Pod};
use serde_json::{json, Value};

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
