//! Kubernetes Services translated at the sockets (issue 24), end to end: a real kube-apiserver
//! (Services, EndpointSlices), an agent with the eBPF dataplane and only the chart's ClusterRole,
//! real pods wired by the CNI plugin, the socket programs attached to a cgroup of the test's own
//! (never the root) that the client process joins. The client speaks to the Service's cluster
//! IP and meets the backend pod; with no endpoint it is refused; the agent's `kill -9`, its
//! restart, its stop and an upgrade to another build of the programs leave the translation in
//! force. With `sessionAffinity: ClientIP`, a client stays on
//! one backend of two. A UDP client's connected socket to a backend that leaves the Service is
//! ended, and its next socket meets a backend that is there. An established TCP connection
//! stays on its backend when the endpoints change; the next one meets the new ones.
use std::io::{Read, Write};
use std::net::{TcpListener, UdpSocket};
use std::time::Duration;

use calix_testbed::{wait_for, KubeApi, Pod};
use serde_json::{json, Value};

mod common;
use common::services::{cluster_ip, frontend_counters, running, service_step, Bed, TestCgroup};

/// Runs `script` with python3 in `pod`'s network namespace and in the cgroup `cg`.
fn client(pod: &Pod<'_>, cg: &TestCgroup, script: &str) -> (bool, String, String) {
    let join = format!(
        "echo $$ > {} && exec python3 -c \"$0\"",
        cg.0.join("cgroup.procs").display()
    );
    let out = pod
        .ns
        .cmd_setns(&["sh", "-c", &join, script])
        .output()
        .expect("run the client");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The client's script against `ip`: TCP to port 80 and UDP to port 53, then port 81 (a
/// Service with no endpoint).
fn script(ip: &str) -> String {
    format!(
        r#"
import errno, socket
t = socket.create_connection(("{ip}", 80), timeout=5)
t.sendall(b"hi")
print("tcp", t.recv(64).decode(), t.getpeername()[0] == "{ip}")
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(5)
u.sendto(b"yo", ("{ip}", 53))
data, src = u.recvfrom(64)
print("udp", data.decode(), src[0] == "{ip}" and src[1] == 53)
try:
    socket.create_connection(("{ip}", 81), timeout=2)
    print("connected 81")
except OSError as e:
    print("refused 81", errno.errorcode.get(e.errno, e.errno))
"#
    )
}

/// Serves `rounds` TCP connections and UDP datagrams in `web`'s namespace: each answered with
/// the address it came from.
fn backends(web: &Pod<'_>, rounds: usize) -> std::thread::JoinHandle<()> {
    let (tcp, udp) = web.ns.run(|| {
        (
            TcpListener::bind("0.0.0.0:8080").expect("bind tcp"),
            UdpSocket::bind("0.0.0.0:8053").expect("bind udp"),
        )
    });
    std::thread::spawn(move || {
        for _ in 0..rounds {
            let (mut c, from) = tcp.accept().expect("accept");
            let mut buf = [0u8; 2];
            c.read_exact(&mut buf).expect("read");
            c.write_all(format!("from {}", from.ip()).as_bytes())
                .expect("write");
            let mut buf = [0u8; 64];
            let (_, from) = udp.recv_from(&mut buf).expect("recv");
            udp.send_to(format!("from {}", from.ip()).as_bytes(), from)
                .expect("send");
        }
    })
}

#[test]
fn a_pod_reaches_a_service_through_the_socket_programs() {
    let api = KubeApi::shared();
    let Bed {
        cg,
        node,
        tag: _,
        ns,
    } = Bed::new(&api, "sx", "10.89.0.0/24", "192.0.2.42");
    let pod = |name: &str| running(&api, &node, &ns, name);
    let web = pod("web");
    let cl = pod("client");
    let service = |name: &str, ports: Value| {
        api.apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": name},
            "spec": {"ports": ports},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let svc = service(
        "web",
        json!([{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
               {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053}]),
    );
    let ip = cluster_ip(&svc);
    // A second Service on the same address is impossible; the one with no endpoint is its
    // own port of web's address instead: a port 81 whose slice names no endpoint.
    api.apply(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": ns, "name": "web-1",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                  {"name": "dns", "port": 8053, "protocol": "UDP"}],
        "endpoints": [{"addresses": [web.ip()], "conditions": {"ready": true}}],
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let with_81_ports = || {
        json!([{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
               {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053},
               {"name": "none", "port": 81, "protocol": "TCP", "targetPort": 9}])
    };
    service("web", with_81_ports());
    let show = || {
        format!(
            "{:?}\n{}",
            node.agent()
                .calixctl_json(&["services", &format!("{ns}/web")]),
            node.agent_log()
        )
    };
    wait_for(
        "the agent programs web's three frontends",
        Duration::from_secs(30),
        || {
            let r = node
                .agent()
                .calixctl_json(&["services", &format!("{ns}/web")])
                .ok()?;
            (r["programmed"] == true
                && r["list"][0]["frontends"].as_array().map(Vec::len) == Some(3))
            .then_some(())
        },
        show,
    );
    let expect = |stdout: &str, stderr: &str| {
        let lines: Vec<&str> = stdout.lines().collect();
        let from = format!("from {}", cl.ip());
        assert_eq!(
            lines,
            [
                format!("tcp {from} True").as_str(),
                format!("udp {from} True").as_str(),
                "refused 81 ECONNREFUSED",
            ],
            "{stderr}\n{}",
            node.agent_log()
        );
    };
    let server = backends(&web, 2);
    let (ok, stdout, stderr) = client(&cl, &cg, &script(&ip));
    assert!(ok, "{stdout}\n{stderr}\n{}", node.agent_log());
    expect(&stdout, &stderr);
    // `calixctl trace` names the Service and where its connections go.
    let trace = node
        .agent()
        .calixctl_json(&["trace", &format!("{ns}/client"), &ip, "tcp/80"])
        .unwrap_or_else(|e| panic!("{e}"));
    let detail = service_step(&trace);
    assert!(
        detail.contains(&format!("{ns}/web"))
            && detail.contains(&format!("to one of {}:8080", web.ip())),
        "{trace}"
    );
    // The socket programs counted it: a connection each on 80/TCP and 53/UDP, a refusal on
    // 81 (the client made one of each), in `calixctl services` and on /metrics.
    let r = node
        .agent()
        .calixctl_json(&["services", &format!("{ns}/web")])
        .unwrap_or_else(|e| panic!("{e}"));
    let counted = |port: u64| frontend_counters(&r, |f| f["port"] == port);
    assert_eq!(counted(80), (1, 0), "{r}");
    assert_eq!(counted(53), (1, 0), "{r}");
    assert_eq!(counted(81), (0, 1), "{r}");
    let (_, metrics) = node.http_get("/metrics").expect("/metrics");
    for line in [
        format!("calix_service_connections_total{{service=\"{ns}/web\"}} 2"),
        format!("calix_service_refused_total{{service=\"{ns}/web\"}} 1"),
        "calix_service_connections_total{service=\"other\"} 0".to_string(),
    ] {
        assert!(
            metrics.contains(&line),
            "{line} not in /metrics:\n{metrics}"
        );
    }
    // kill -9 and a new agent: the pinned links and maps translate all along.
    node.kill_agent();
    let (ok, stdout, stderr) = client(&cl, &cg, &script(&ip));
    assert!(ok, "with the agent down: {stdout}\n{stderr}");
    expect(&stdout, &stderr);
    server.join().expect("the backends");
    node.start_agent();
    wait_for(
        "the restarted agent programs web again",
        Duration::from_secs(30),
        || {
            let r = node
                .agent()
                .calixctl_json(&["services", &format!("{ns}/web")])
                .ok()?;
            (r["programmed"] == true).then_some(())
        },
        show,
    );
    // An upgrade to another build of the programs under the same pins: translated as before,
    // from the moment the old agent stops to the new one's first programming.
    let server = backends(&web, 2);
    node.stop_agent();
    let (ok, stdout, stderr) = client(&cl, &cg, &script(&ip));
    assert!(ok, "with the agent stopped: {stdout}\n{stderr}");
    expect(&stdout, &stderr);
    let upgrade = calix_testbed::upgrade_test_object();
    node.start_agent_with(&["--bpf-object", &upgrade.display().to_string()]);
    let (ok, stdout, stderr) = client(&cl, &cg, &script(&ip));
    assert!(ok, "after the upgrade: {stdout}\n{stderr}");
    expect(&stdout, &stderr);
    server.join().expect("the backends");
    // An EndpointSlice labelled headless (kube-proxy ignores it, the upstream suite checks
    // that): as good as gone, web's port 80 refuses; unlabelled again, served again.
    let web_slice = |labels: Value| {
        api.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": "web-1", "labels": labels},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                      {"name": "dns", "port": 8053, "protocol": "UDP"}],
            "endpoints": [{"addresses": [web.ip()], "conditions": {"ready": true}}],
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let port_80 = |want: &'static str| {
        wait_for(
            &format!("web's port 80 {want}"),
            Duration::from_secs(30),
            || {
                let r = node
                    .agent()
                    .calixctl_json(&["services", &format!("{ns}/web")])
                    .ok()?;
                let f = r["list"][0]["frontends"]
                    .as_array()?
                    .iter()
                    .find(|f| f["frontend"]["port"] == 80)?
                    .clone();
                let refused = f["internal"] == "Reject";
                ((want == "refused") == refused && r["programmed"] == true).then_some(())
            },
            show,
        )
    };
    web_slice(json!({"kubernetes.io/service-name": "web",
                     "service.kubernetes.io/headless": ""}));
    port_80("refused");
    web_slice(json!({"kubernetes.io/service-name": "web"}));
    port_80("served");
    // Labelled as another proxy's (kube-proxy's rule, which the upstream suite checks):
    // left alone, as if gone.
    api.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": ns, "name": "web",
                     "labels": {"service.kubernetes.io/service-proxy-name": "another"}},
        "spec": {"ports": with_81_ports()},
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    // web no longer programmed (and the rest programmed).
    let web_unprogrammed = |what: &str| {
        wait_for(
            what,
            Duration::from_secs(30),
            || {
                let r = node.agent().calixctl_json(&["services"]).ok()?;
                let gone = r["list"]
                    .as_array()?
                    .iter()
                    .all(|s| s["service"] != format!("{ns}/web"));
                (gone && r["programmed"] == true).then_some(())
            },
            show,
        )
    };
    web_unprogrammed("web, another proxy's now, left alone");
    // The Service gone: its address is nothing any more (the pod's connection goes out to
    // its default route and finds no one: refused or unreachable, never the backend).
    api.delete_now("v1", "Service", &ns, "web")
        .unwrap_or_else(|e| panic!("{e}"));
    web_unprogrammed("web's frontends removed");
    let (_, stdout, _) = client(
        &cl,
        &cg,
        &format!(
            r#"
import socket
try:
    socket.create_connection(("{ip}", 80), timeout=2)
    print("connected")
except OSError as e:
    print("not connected")
"#
        ),
    );
    assert_eq!(stdout.trim(), "not connected");
}

/// Answers each TCP connection on port 8080 in `pod`'s namespace with `name`.
fn named_backend(pod: &Pod<'_>, name: &'static str) {
    let tcp = pod
        .ns
        .run(|| TcpListener::bind("0.0.0.0:8080").expect("bind tcp"));
    std::thread::spawn(move || {
        for mut c in tcp.incoming().flatten() {
            let _ = c.write_all(name.as_bytes());
        }
    });
}

#[test]
fn a_client_keeps_its_backend_with_session_affinity() {
    let api = KubeApi::shared();
    let Bed {
        cg,
        node,
        tag: _,
        ns,
    } = Bed::new(&api, "sa", "10.89.1.0/24", "192.0.2.44");
    let pod = |name: &str| running(&api, &node, &ns, name);
    let (a, b, cl) = (pod("web-a"), pod("web-b"), pod("client"));
    named_backend(&a, "web-a");
    named_backend(&b, "web-b");
    let service = |name: &str, affinity: &str| {
        api.apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": name},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
                     "sessionAffinity": affinity},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let mut ips = Vec::new();
    for (name, affinity) in [("sticky", "ClientIP"), ("any", "None")] {
        let svc = service(name, affinity);
        ips.push(cluster_ip(&svc));
        api.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": format!("{name}-1"),
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a.ip()], "conditions": {"ready": true}},
                          {"addresses": [b.ip()], "conditions": {"ready": true}}],
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    }
    wait_for(
        "the agent programs both Services",
        Duration::from_secs(30),
        || {
            let r = node.agent().calixctl_json(&["services"]).ok()?;
            let ours = r["list"]
                .as_array()?
                .iter()
                .filter(|s| s["service"].as_str().is_some_and(|n| n.starts_with(&ns)))
                .count();
            (r["programmed"] == true && ours == 2).then_some(())
        },
        || format!("{:?}", node.agent().calixctl_json(&["services"])),
    );
    let connects = |ip: &str| -> Vec<String> {
        let script = format!(
            r#"
import socket
for _ in range(16):
    c = socket.create_connection(("{ip}", 80), timeout=5)
    print(c.recv(16).decode())
    c.close()
"#
        );
        let (ok, out, err) = client(&cl, &cg, &script);
        assert!(ok, "{out}\n{err}\n{}", node.agent_log());
        out.lines().map(String::from).collect()
    };
    let sticky = connects(&ips[0]);
    assert!(
        sticky.len() == 16 && sticky.iter().all(|n| *n == sticky[0]),
        "ClientIP: every connection to one backend: {sticky:?}"
    );
    let any: std::collections::BTreeSet<String> = connects(&ips[1]).into_iter().collect();
    assert_eq!(any.len(), 2, "None: both backends answer: {any:?}");
}

/// Answers each UDP datagram on port 8053 in `pod`'s namespace with `name`.
fn named_udp_backend(pod: &Pod<'_>, name: &'static str) {
    let udp = pod
        .ns
        .run(|| UdpSocket::bind("0.0.0.0:8053").expect("bind udp"));
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(name.as_bytes(), from);
        }
    });
}

#[test]
fn a_udp_client_leaves_a_backend_that_goes() {
    use std::io::BufRead;
    let api = KubeApi::shared();
    let Bed {
        cg,
        node,
        tag: _,
        ns,
    } = Bed::new(&api, "su", "10.89.2.0/24", "192.0.2.45");
    let pod = |name: &str| running(&api, &node, &ns, name);
    let (a, b, cl) = (pod("dns-a"), pod("dns-b"), pod("client"));
    named_udp_backend(&a, "dns-a");
    named_udp_backend(&b, "dns-b");
    let ip = cluster_ip(
        &api.apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": "dns"},
            "spec": {"ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053}]},
        }))
        .unwrap_or_else(|e| panic!("{e}")),
    );
    let slice = |endpoints: Vec<String>| {
        let endpoints: Vec<Value> = endpoints
            .into_iter()
            .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
            .collect();
        api.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": "dns-1",
                         "labels": {"kubernetes.io/service-name": "dns"}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 8053, "protocol": "UDP"}],
            "endpoints": endpoints,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    };
    slice(vec![a.ip(), b.ip()]);
    let backends = |n: usize| {
        move |r: Value| {
            let f = &r["list"][0]["frontends"][0];
            (r["programmed"] == true && f["internal"]["To"].as_array().map(Vec::len) == Some(n))
                .then_some(())
        }
    };
    let show = || {
        format!(
            "{:?}\n{}",
            node.agent()
                .calixctl_json(&["services", &format!("{ns}/dns")]),
            node.agent_log()
        )
    };
    let programmed = |n: usize, what: &str| {
        let check = backends(n);
        wait_for(
            what,
            Duration::from_secs(30),
            || {
                check(
                    node.agent()
                        .calixctl_json(&["services", &format!("{ns}/dns")])
                        .ok()?,
                )
            },
            show,
        );
    };
    programmed(2, "the agent programs dns with its two backends");
    // A resolver's connected socket: its first answer, then asking again every 100 ms until
    // the socket is ended (the backend it was sent to keeps answering meanwhile: only its
    // removal from the Service ends it), then a new socket.
    let script = format!(
        r#"
import errno, socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1)
s.connect(("{ip}", 53))
s.send(b"q")
print(s.recv(16).decode(), flush=True)
end = time.time() + 20
while time.time() < end:
    time.sleep(0.1)
    try:
        s.send(b"q")
        s.recv(16)
    except socket.timeout:
        continue
    except OSError as e:
        print("ended", errno.errorcode.get(e.errno, e.errno), flush=True)
        break
else:
    print("never ended", flush=True)
t = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
t.settimeout(5)
t.connect(("{ip}", 53))
t.send(b"q")
print(t.recv(16).decode(), flush=True)
"#
    );
    let join = format!(
        "echo $$ > {} && exec python3 -c \"$0\"",
        cg.0.join("cgroup.procs").display()
    );
    let mut child = cl
        .ns
        .cmd_setns(&["sh", "-c", &join, &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the client");
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("no first answer\n{}", node.agent_log()));
    // The backend that answered leaves the Service (it keeps running and answering).
    let (keep, stays) = match first.as_str() {
        "dns-a" => (b.ip(), "dns-b"),
        "dns-b" => (a.ip(), "dns-a"),
        other => panic!("an answer from neither backend: {other:?}"),
    };
    slice(vec![keep]);
    programmed(1, "the agent programs dns with one backend left");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let out = child.wait_with_output().expect("the client");
    // Ended: its pending error (ECONNABORTED), or a send on the socket, disconnected now.
    let ended = rest.first().map(String::as_str);
    assert!(
        matches!(ended, Some("ended ECONNABORTED" | "ended EDESTADDRREQ")),
        "{rest:?}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.agent_log()
    );
    assert_eq!(
        rest[1..],
        [stays],
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.agent_log()
    );
}

/// Answers each line on each TCP connection to port 8080 in `pod`'s namespace with `name`.
fn line_backend(pod: &Pod<'_>, name: &'static str) {
    let tcp = pod
        .ns
        .run(|| TcpListener::bind("0.0.0.0:8080").expect("bind tcp"));
    std::thread::spawn(move || {
        for c in tcp.incoming().flatten() {
            std::thread::spawn(move || {
                let mut w = match c.try_clone() {
                    Ok(w) => w,
                    Err(_) => return,
                };
                let r = std::io::BufReader::new(c);
                for line in std::io::BufRead::lines(r) {
                    if line.is_err() || w.write_all(format!("{name}\n").as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

#[test]
fn an_established_connection_stays_on_its_backend_when_the_endpoints_change() {
    let api = KubeApi::shared();
    let Bed {
        cg,
        node,
        tag: u,
        ns,
    } = Bed::new(&api, "sf", "10.89.3.0/24", "192.0.2.46");
    let pod = |name: &str| running(&api, &node, &ns, name);
    let (a, b, cl) = (pod("web-a"), pod("web-b"), pod("client"));
    line_backend(&a, "web-a");
    line_backend(&b, "web-b");
    let ip = cluster_ip(&api.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": ns, "name": "flow"},
        "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
    })).unwrap_or_else(|e| panic!("{e}")));
    let endpoints = |backend: &str| {
        api.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": "flow-1",
                         "labels": {"kubernetes.io/service-name": "flow"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [backend], "conditions": {"ready": true}}],
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let programmed = |backend: String| {
        wait_for(
            &format!("flow programmed to {backend} only"),
            Duration::from_secs(30),
            || {
                let r = node
                    .agent()
                    .calixctl_json(&["services", &format!("{ns}/flow")])
                    .ok()?;
                let to = r["list"][0]["frontends"][0]["internal"]["To"].as_array()?;
                (r["programmed"] == true && to.len() == 1 && to[0][0] == backend.as_str())
                    .then_some(())
            },
            || {
                format!(
                    "{:?}",
                    node.agent()
                        .calixctl_json(&["services", &format!("{ns}/flow")])
                )
            },
        )
    };
    endpoints(&a.ip());
    programmed(a.ip());
    // The client connects, speaks, waits for the go file (the endpoints changed meanwhile:
    // web-a replaced by web-b), speaks again on the same connection, then connects anew.
    let go = std::env::temp_dir().join(format!("{u}-go"));
    let script = format!(
        r#"
import os, socket, time
c = socket.create_connection(("{ip}", 80), timeout=5)
f = c.makefile("rw")
f.write("1\n"); f.flush(); print("before", f.readline().strip(), flush=True)
deadline = time.time() + 60
while not os.path.exists("{go}") and time.time() < deadline:
    time.sleep(0.05)
f.write("2\n"); f.flush(); print("same connection", f.readline().strip())
n = socket.create_connection(("{ip}", 80), timeout=5)
n.sendall(b"3\n"); print("new connection", n.recv(16).decode().strip())
"#,
        go = go.display()
    );
    let join = format!(
        "echo $$ > {} && exec python3 -c \"$0\"",
        cg.0.join("cgroup.procs").display()
    );
    let mut client = cl
        .ns
        .cmd_setns(&["sh", "-c", &join, &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the client");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
        client.stdout.take().expect("the client's stdout"),
    ));
    // Connected and answered: now the endpoints change under it.
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    endpoints(&b.ip());
    programmed(b.ip());
    std::fs::write(&go, b"go").expect("the go file");
    let mut got = vec![first];
    got.extend(lines.map_while(Result::ok));
    let out = client.wait_with_output().expect("the client");
    let _ = std::fs::remove_file(&go);
    assert!(
        out.status.success(),
        "{got:?}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.agent_log()
    );
    assert_eq!(
        got,
        [
            "before web-a",
            "same connection web-a",
            "new connection web-b"
        ],
        "an established connection does not move; a new one meets the new endpoints"
    );
}
