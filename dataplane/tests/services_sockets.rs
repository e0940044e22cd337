//! Services at the sockets, in the kernel: the cgroup `sock_addr` programs attached to a cgroup
//! of the test's own (never the root), a client process in it and in the test's network
//! namespace (loopback only: an untranslated connection goes nowhere), the backends on
//! loopback. Run as root.
mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::Command;

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::HashMap;
use calix_common::{SvcAffKey, SvcAffValue, SVC_AFFINITY_MAP};
use calix_dataplane::ebpf::services::{
    attach_sockets, detach_sockets, Front, PinnedServiceMaps, ServiceProgrammer, Target, TCP, UDP,
};
use common::*;

/// A cgroup of this test's own on the v2 hierarchy, removed when dropped (its processes have
/// exited by then).
struct TestCgroup(PathBuf);

impl TestCgroup {
    fn new(tag: &str) -> Self {
        let root = PathBuf::from("/sys/fs/cgroup/unified");
        let root = if root.join("cgroup.procs").exists() {
            root
        } else {
            PathBuf::from("/sys/fs/cgroup")
        };
        let dir = root.join(format!("cxt-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the test cgroup");
        Self(dir)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn ip_addr(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

/// The client: joins the cgroup, then speaks to the frontends and prints what it saw.
const CLIENT: &str = r#"
import errno, socket
t = socket.create_connection(("10.96.77.1", 80), timeout=5)
t.sendall(b"hi")
print("tcp", t.recv(16).decode(), t.getpeername()[0], t.getpeername()[1])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(5)
u.sendto(b"yo", ("10.96.77.1", 53))
data, src = u.recvfrom(16)
print("udp", data.decode(), src[0], src[1])
# One unconnected socket: every datagram to a frontend of two backends goes to the same one.
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
seen = set()
for _ in range(8):
    s.sendto(b"which", ("10.96.77.1", 54))
    data, src = s.recvfrom(16)
    seen.add(data)
print("sticky", len(seen), src[0], src[1])
for port in (81, 82):
    try:
        socket.create_connection(("10.96.77.1", port), timeout=2)
        print("connected", port)
    except OSError as e:
        print("refused", port, errno.errorcode.get(e.errno, e.errno))
"#;

#[test]
fn a_client_reaches_the_backends_and_sees_the_frontend() {
    in_netns(|| {
        ip(&["link", "set", "lo", "up"]);
        let pins = PinDir::new();
        let mut bpf = load_object(&pins);
        let cg = TestCgroup::new("svc");
        let links = pins.0.join("sockets");
        attach_sockets(&mut bpf, &links, &cg.0).expect("attach to the test's cgroup");
        // A restart attaches again: the new links replace the old ones.
        attach_sockets(&mut bpf, &links, &cg.0).expect("attach again");
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let udp = UdpSocket::bind("127.0.0.1:0").expect("bind udp");
        let (tport, uport) = (
            tcp.local_addr().expect("addr").port(),
            udp.local_addr().expect("addr").port(),
        );
        // Two UDP backends of one frontend, each answering with its own name.
        let pair: Vec<UdpSocket> = (0..2)
            .map(|_| UdpSocket::bind("127.0.0.1:0").expect("bind udp"))
            .collect();
        let pair_ports: Vec<u16> = pair
            .iter()
            .map(|s| s.local_addr().expect("addr").port())
            .collect();
        for (i, s) in pair.into_iter().enumerate() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 16];
                while let Ok((_, from)) = s.recv_from(&mut buf) {
                    let _ = s.send_to(format!("b{i}").as_bytes(), from);
                }
            });
        }
        let server = std::thread::spawn(move || {
            let (mut c, _) = tcp.accept().expect("accept");
            let mut buf = [0u8; 2];
            c.read_exact(&mut buf).expect("read");
            c.write_all(&buf).expect("write");
            let mut buf = [0u8; 16];
            let (n, from) = udp.recv_from(&mut buf).expect("recv");
            udp.send_to(&buf[..n], from).expect("send");
        });
        let maps = PinnedServiceMaps::open(&mut bpf).expect("the Services maps");
        let mut p = ServiceProgrammer::restore(Box::new(maps));
        let front = |port, proto| Front {
            address: ip_addr("10.96.77.1"),
            port,
            proto,
            external: false,
        };
        let want = std::collections::BTreeMap::from([
            (
                front(80, TCP),
                Target::to(vec![(ip_addr("127.0.0.1"), tport)]),
            ),
            (
                front(53, UDP),
                Target::to(vec![(ip_addr("127.0.0.1"), uport)]),
            ),
            (front(81, TCP), Target::Refuse),
            (
                front(54, UDP),
                Target::to(
                    pair_ports
                        .iter()
                        .map(|p| (ip_addr("127.0.0.1"), *p))
                        .collect(),
                ),
            ),
        ]);
        p.set(&want).expect("program the Services");
        let (ok, stdout, stderr) = client(&cg, CLIENT, &[]);
        server.join().expect("the backends");
        assert!(ok, "{stdout}\n{stderr}");
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(
            lines,
            [
                "tcp hi 10.96.77.1 80",
                "udp yo 10.96.77.1 53",
                "sticky 1 10.96.77.1 54",
                // No backend: refused at connect, as after kube-proxy's ICMP reject.
                "refused 81 ECONNREFUSED",
                // No frontend: left alone (and with only loopback here, unreachable).
                "refused 82 ENETUNREACH",
            ],
            "{stderr}"
        );
        // Detached (Services off): the frontend is an address like any other again.
        detach_sockets(&links);
        let (_, stdout, stderr) = client(&cg, OFF, &[]);
        assert_eq!(stdout.trim(), "refused 80 ENETUNREACH", "{stderr}");
    });
}

/// Runs `script` with python3 and `args` in the cgroup `cg`: whether it succeeded, its output,
/// its errors.
fn client(cg: &TestCgroup, script: &str, args: &[&str]) -> (bool, String, String) {
    let procs = cg.0.join("cgroup.procs");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {} && exec python3 -c \"$0\" \"$@\"",
            procs.display()
        ))
        .arg(script)
        .args(args)
        .output()
        .expect("run the client");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const OFF: &str = r#"
import errno, socket
try:
    socket.create_connection(("10.96.77.1", 80), timeout=2)
    print("connected 80")
except OSError as e:
    print("refused 80", errno.errorcode.get(e.errno, e.errno))
"#;

/// Connects `n` times to 10.96.77.2:`port`: each backend's name, a line each.
const CONNECTS: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
for _ in range(n):
    c = socket.create_connection(("10.96.77.2", port), timeout=5)
    print(c.recv(16).decode())
    c.close()
"#;

/// `CLOCK_MONOTONIC` in nanoseconds: the programs' `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) into a timespec we own.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[test]
fn session_affinity_keeps_a_client_on_its_backend() {
    in_netns(|| {
        ip(&["link", "set", "lo", "up"]);
        let pins = PinDir::new();
        let mut bpf = load_object(&pins);
        let cg = TestCgroup::new("aff");
        let links = pins.0.join("sockets");
        attach_sockets(&mut bpf, &links, &cg.0).expect("attach to the test's cgroup");
        // Three TCP backends, each answering a connection with its name.
        let ports: Vec<u16> = (0..3)
            .map(|i| {
                let l = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
                let port = l.local_addr().expect("addr").port();
                std::thread::spawn(move || {
                    for mut c in l.incoming().flatten() {
                        let _ = c.write_all(format!("b{i}").as_bytes());
                    }
                });
                port
            })
            .collect();
        let maps = PinnedServiceMaps::open(&mut bpf).expect("the Services maps");
        let mut p = ServiceProgrammer::restore(Box::new(maps));
        let front = |port| Front {
            address: ip_addr("10.96.77.2"),
            port,
            proto: TCP,
            external: false,
        };
        let to = |which: &[usize], affinity_secs| Target::To {
            backends: which
                .iter()
                .map(|i| (ip_addr("127.0.0.1"), ports[*i]))
                .collect(),
            affinity_secs,
        };
        let seen = |port: u16, n: usize| -> Vec<String> {
            let (ok, out, err) = client(&cg, CONNECTS, &[&port.to_string(), &n.to_string()]);
            assert!(ok, "{out}\n{err}");
            out.lines().map(String::from).collect()
        };
        p.set(&BTreeMap::from([
            (front(80), to(&[0, 1, 2], 60)),
            (front(81), to(&[0, 1, 2], 0)),
        ]))
        .expect("program the Services");
        let first = seen(80, 12);
        let kept = first[0].clone();
        assert!(
            first.iter().all(|b| *b == kept),
            "one client, one backend: {first:?}"
        );
        assert_eq!(
            seen(80, 4),
            vec![kept.clone(); 4],
            "another process of the same client (network namespace): the same backend"
        );
        let spread: BTreeSet<String> = seen(81, 24).into_iter().collect();
        assert!(
            spread.len() > 1,
            "without affinity, any backend: {spread:?}"
        );

        // The others change; the client's backend stays (at another index), so does it.
        let k: usize = kept[1..].parse().expect("a backend's name");
        let others: Vec<usize> = (0..3).filter(|i| *i != k).collect();
        p.set(&BTreeMap::from([(front(80), to(&[others[0], k], 60))]))
            .expect("program the change");
        assert_eq!(
            seen(80, 6),
            vec![kept.clone(); 6],
            "its backend kept through a change of the others"
        );
        // Its backend goes: the client moves, to one backend again.
        p.set(&BTreeMap::from([(front(80), to(&others, 60))]))
            .expect("program the removal");
        let moved = seen(80, 8);
        assert!(
            moved.iter().all(|b| *b == moved[0]) && moved[0] != kept,
            "{moved:?} after {kept} went"
        );

        // The timeout: a client last seen longer ago than it picks again (each time aged
        // past it, the client connects once; two backends: it must land on both).
        let mut aff: HashMap<_, SvcAffKey, SvcAffValue> =
            HashMap::try_from(bpf.map_mut(SVC_AFFINITY_MAP).expect("the affinity map"))
                .expect("a hash map");
        let mut after = BTreeSet::new();
        for _ in 0..24 {
            let keys: Vec<SvcAffKey> = aff.keys().filter_map(Result::ok).collect();
            assert_eq!(keys.len(), 1, "one client, one frontend with affinity");
            for key in keys {
                let mut v = aff.get(&key, 0).expect("the client's entry");
                // (60 s, not hours: the clock counts from the boot, which may be recent.)
                v.seen_ns = monotonic_ns()
                    .checked_sub(61 * 1_000_000_000)
                    .expect("a minute since the boot");
                aff.insert(key, v, 0).expect("age the entry");
            }
            after.extend(seen(80, 1));
            if after.len() > 1 {
                break;
            }
        }
        assert_eq!(after.len(), 2, "an expired client picks again: {after:?}");
        detach_sockets(&links);
    });
}

/// Speaks to a NodePort at two node addresses and at one that is no node's.
const NODE_PORTS: &str = r#"
import errno, socket
for node in ("10.96.88.1", "10.96.88.2"):
    t = socket.create_connection((node, 30080), timeout=5)
    print("tcp", t.recv(16).decode(), t.getpeername()[0], t.getpeername()[1])
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(5)
    u.sendto(b"yo", (node, 30053))
    data, src = u.recvfrom(16)
    print("udp", data.decode(), src[0], src[1])
try:
    socket.create_connection(("10.96.88.3", 30080), timeout=2)
    print("connected 10.96.88.3")
except OSError as e:
    print("10.96.88.3", errno.errorcode.get(e.errno, e.errno))
"#;

#[test]
fn a_nodeport_answers_on_every_nodes_address() {
    in_netns(|| {
        ip(&["link", "set", "lo", "up"]);
        let pins = PinDir::new();
        let mut bpf = load_object(&pins);
        let cg = TestCgroup::new("nodeport");
        let links = pins.0.join("sockets");
        attach_sockets(&mut bpf, &links, &cg.0).expect("attach to the test's cgroup");
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let udp = UdpSocket::bind("127.0.0.1:0").expect("bind udp");
        let (tport, uport) = (
            tcp.local_addr().expect("addr").port(),
            udp.local_addr().expect("addr").port(),
        );
        std::thread::spawn(move || {
            for mut c in tcp.incoming().flatten() {
                let _ = c.write_all(b"np");
            }
        });
        std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            while let Ok((n, from)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(&buf[..n], from);
            }
        });
        let maps = PinnedServiceMaps::open(&mut bpf).expect("the Services maps");
        let mut p = ServiceProgrammer::restore(Box::new(maps));
        let any = |port, proto| Front {
            address: ip_addr("0.0.0.0"),
            port,
            proto,
            external: false,
        };
        p.set_nodes(&BTreeSet::from([
            ip_addr("10.96.88.1"),
            ip_addr("10.96.88.2"),
        ]))
        .expect("the nodes' addresses");
        p.set(&BTreeMap::from([
            (
                any(30080, TCP),
                Target::to(vec![(ip_addr("127.0.0.1"), tport)]),
            ),
            (
                any(30053, UDP),
                Target::to(vec![(ip_addr("127.0.0.1"), uport)]),
            ),
        ]))
        .expect("program the NodePorts");
        let (ok, stdout, stderr) = client(&cg, NODE_PORTS, &[]);
        assert!(ok, "{stdout}\n{stderr}");
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(
            lines,
            [
                "tcp np 10.96.88.1 30080",
                "udp yo 10.96.88.1 30053",
                "tcp np 10.96.88.2 30080",
                "udp yo 10.96.88.2 30053",
                // No node's address: left alone (only loopback here: unreachable).
                "10.96.88.3 ENETUNREACH",
            ],
            "{stderr}"
        );
        // A node that leaves: its address is an address like any other again.
        p.set_nodes(&BTreeSet::from([ip_addr("10.96.88.2")]))
            .expect("one node left");
        let (_, stdout, stderr) = client(&cg, NODE_PORTS, &[]);
        assert!(
            stdout.is_empty() && stderr.contains("Network is unreachable"),
            "{stdout}\n{stderr}"
        );
        detach_sockets(&links);
    });
}
