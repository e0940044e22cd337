//! calix's BGP speaker against a real router: BIRD 2 in a network namespace, peering with the
//! speaker (calix-bgp's session over the agent's connection code) in another, over IPv4 and
//! over IPv6, each session signed with a TCP MD5 password. Each side learns the other's
//! routes (BIRD's `show route`, the speaker's peer table); a withdrawal reaches BIRD; a wrong
//! password never establishes. Needs root and `bird` (cargo xtask setup installs bird2).
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use calix_agent::bgp::conn::{self, Connection};
use calix_bgp::peer::{LimitAction, PeerRib};
use calix_bgp::session::{LocalConfig, LocalRestart, Negotiated, Output, Session, State};
use calix_bgp::update::AsSegment;
use calix_bgp::{Family, PathAttributes, UpdateBuilder};
use calix_testbed::{require_root, unique, wait_for, Guarded, Netns};
use ipnet::IpNet;

const PASSWORD: &str = "calix-md5-test";
const ROUTER_AS: u32 = 65000;
const NODE_AS: u32 = 65001;

/// BIRD's configuration: two eBGP sessions to the node (IPv4, IPv6), each exporting one
/// static route of its family and importing everything.
fn bird_conf() -> String {
    format!(
        r#"router id 10.250.0.1;
protocol device {{}}
protocol static st4 {{ ipv4; route 198.18.1.0/24 blackhole; }}
protocol static st6 {{ ipv6; route fd60::/64 blackhole; }}
protocol bgp calix4 {{
  local 10.250.0.1 as {ROUTER_AS};
  neighbor 10.250.0.2 as {NODE_AS};
  password "{PASSWORD}";
  passive on;
  hold time 9;
  ipv4 {{ import all; export where proto = "st4"; }};
}}
protocol bgp calix6 {{
  local fd50::1 as {ROUTER_AS};
  neighbor fd50::2 as {NODE_AS};
  password "{PASSWORD}";
  passive on;
  hold time 9;
  ipv6 {{ import all; export where proto = "st6"; }};
}}
"#
    )
}

struct Bird {
    _daemon: Guarded,
    dir: PathBuf,
    router: Netns,
}

impl Bird {
    fn start(router: Netns) -> Self {
        let dir = std::env::temp_dir().join(unique("bird"));
        std::fs::create_dir_all(&dir).expect("bird's directory");
        std::fs::write(dir.join("bird.conf"), bird_conf()).expect("bird.conf");
        let conf = dir.join("bird.conf");
        let sock = dir.join("bird.ctl");
        let mut cmd = router
            .daemon("bird", None)
            .expect("bird in the router's namespace");
        cmd.args(["-f", "-c"]).arg(&conf).arg("-s").arg(&sock);
        let child = cmd
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("bird runs (cargo xtask setup installs bird2)");
        let bird = Self {
            _daemon: Guarded(child),
            dir,
            router,
        };
        wait_for(
            "bird's control socket",
            Duration::from_secs(10),
            || sock.exists().then_some(()),
            String::new,
        );
        bird
    }

    fn birdc(&self, cmd: &str) -> String {
        let out = std::process::Command::new("birdc")
            .arg("-s")
            .arg(self.dir.join("bird.ctl"))
            .args(cmd.split(' '))
            .output()
            .expect("birdc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.router;
    }
}

fn config(family: Family, router_id: [u8; 4]) -> LocalConfig {
    LocalConfig {
        asn: NODE_AS,
        router_id: router_id.into(),
        peer_asn: ROUTER_AS,
        hold_time: 9,
        families: vec![family],
        graceful_restart: Some(LocalRestart {
            restart_time: 120,
            restarting: false,
            forwarding_preserved: true,
        }),
    }
}

/// One session to BIRD, driven until `done` holds of the peer's routes (or the time runs out);
/// on the way up it announces `ours` via `next_hop` and its End-of-RIB, then withdraws
/// `withdraw_after` once BIRD's routes are in. Returns the negotiated parameters, the peer's
/// routes, and the session's state at the end.
/// The test's word to the speaker: withdraw now; the end.
type Signal = tokio::sync::oneshot::Receiver<()>;

async fn peer_with_bird(
    local: IpAddr,
    peer: IpAddr,
    family: Family,
    password: &str,
    ours: Vec<IpNet>,
    withdraw: Vec<IpNet>,
    (withdraw_now, done): (Signal, Signal),
) -> Result<(Negotiated, PeerRib), String> {
    let stream = conn::connect(
        Some(local),
        SocketAddr::new(peer, conn::PORT),
        Some(password.as_bytes()),
        Duration::from_secs(3),
    )
    .await
    .map_err(|e| format!("connect: {e}"))?;
    let mut c = Connection::new(stream);
    let (mut session, out) =
        Session::start(config(family, [10, 250, 0, 2]), std::time::Instant::now());
    let (rest, failed) = c.send(out).await;
    assert!(rest.is_empty());
    if let Some(e) = failed {
        return Err(format!("send OPEN: {e}"));
    }
    let mut rib = PeerRib::new(1_000, LimitAction::Refuse);
    let mut negotiated = None;
    let mut eor = false;
    let mut phases = Some((withdraw_now, done));
    loop {
        for o in c.step(&mut session).await {
            match o {
                Output::Established(n) => {
                    let builder = UpdateBuilder {
                        four_octet_as: n.four_octet_as,
                        attributes: PathAttributes {
                            as_path: vec![AsSegment {
                                set: false,
                                asns: vec![NODE_AS],
                            }],
                            ..PathAttributes::default()
                        },
                    };
                    let mut msgs = builder.announce(family, local, None, &ours);
                    msgs.push(UpdateBuilder::end_of_rib(family));
                    for m in msgs {
                        c.write(&m).await.map_err(|e| e.to_string())?;
                    }
                    negotiated = Some(n);
                }
                Output::Update(u) => {
                    let applied = rib.apply(&u, |_, _, _| true);
                    eor |= applied.end_of_rib == Some(family);
                }
                Output::Closed { reason, .. } => return Err(reason),
                _ => {}
            }
        }
        if eor && negotiated.is_some() {
            if let Some((now_rx, done_rx)) = phases.take() {
                // Both sides' routes are in: wait for the test to see them, withdraw, and
                // wait until the test saw that.
                let mut now_rx = now_rx;
                loop {
                    tokio::select! {
                        _ = &mut now_rx => break,
                        outs = c.step(&mut session) => {
                            if let Some(Output::Closed { reason, .. }) = outs.into_iter().find(|o| matches!(o, Output::Closed { .. })) {
                                return Err(reason);
                            }
                        }
                    }
                }
                let builder = UpdateBuilder {
                    four_octet_as: true,
                    attributes: PathAttributes::default(),
                };
                for m in builder.withdraw(family, &withdraw) {
                    c.write(&m).await.map_err(|e| e.to_string())?;
                }
                let mut rx = done_rx;
                loop {
                    tokio::select! {
                        _ = &mut rx => break,
                        outs = c.step(&mut session) => {
                            if let Some(Output::Closed { reason, .. }) = outs.into_iter().find(|o| matches!(o, Output::Closed { .. })) {
                                return Err(reason);
                            }
                        }
                    }
                }
                assert_eq!(session.state(), State::Established);
                let n = negotiated.take().expect("negotiated");
                let _ = c.send(session.shutdown()).await;
                return Ok((n, rib));
            }
        }
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("a prefix")
}

#[test]
fn calix_peers_with_bird_over_ipv4_and_ipv6_with_md5() {
    require_root();
    let router = Netns::new("bgpr");
    let node = Netns::new("bgpn");
    router
        .ip(&format!(
            "link add cxbgr0 type veth peer name cxbgn0 netns {}",
            node.name
        ))
        .expect("veth");
    router
        .ip_batch("addr add 10.250.0.1/24 dev cxbgr0\naddr add fd50::1/64 dev cxbgr0 nodad\nlink set cxbgr0 up")
        .expect("router addresses");
    node.ip_batch("addr add 10.250.0.2/24 dev cxbgn0\naddr add fd50::2/64 dev cxbgn0 nodad\nlink set cxbgn0 up")
        .expect("node addresses");
    let bird = Bird::start(router);

    let v4 = vec![net("10.244.0.0/26"), net("10.244.0.64/26")];
    let v6 = vec![net("fd44::/122"), net("fd44::40/122")];
    let (tx4, rx4) = tokio::sync::oneshot::channel();
    let (tx6, rx6) = tokio::sync::oneshot::channel();
    let (wtx4, wrx4) = tokio::sync::oneshot::channel();
    let (wtx6, wrx6) = tokio::sync::oneshot::channel();
    let (v4c, v6c) = (v4.clone(), v6.clone());
    let speaker = node
        .spawn(None, move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let s4 = peer_with_bird(
                    "10.250.0.2".parse().expect("ip"),
                    "10.250.0.1".parse().expect("ip"),
                    Family::IPV4_UNICAST,
                    PASSWORD,
                    v4c.clone(),
                    v4c[1..].to_vec(),
                    (wrx4, rx4),
                );
                let s6 = peer_with_bird(
                    "fd50::2".parse().expect("ip"),
                    "fd50::1".parse().expect("ip"),
                    Family::IPV6_UNICAST,
                    PASSWORD,
                    v6c.clone(),
                    v6c[1..].to_vec(),
                    (wrx6, rx6),
                );
                tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(s4, s6) }).await
            })
        })
        .expect("the speaker's thread");

    // BIRD holds the node's routes, learned over BGP from AS 65001.
    let show = |proto: &str| bird.birdc(&format!("show route protocol {proto}"));
    wait_for(
        "BIRD learns both IPv4 routes",
        Duration::from_secs(30),
        || {
            let s = show("calix4");
            (s.contains("10.244.0.0/26") && s.contains("10.244.0.64/26")).then_some(())
        },
        || {
            format!(
                "{}\n{}",
                bird.birdc("show protocols all calix4"),
                show("calix4")
            )
        },
    );
    wait_for(
        "BIRD learns both IPv6 routes",
        Duration::from_secs(30),
        || {
            let s = show("calix6");
            (s.contains("fd44::/122") && s.contains("fd44::40/122")).then_some(())
        },
        || {
            format!(
                "{}\n{}",
                bird.birdc("show protocols all calix6"),
                show("calix6")
            )
        },
    );
    let all = bird.birdc("show route all protocol calix4");
    assert!(all.contains(&format!("BGP.as_path: {NODE_AS}")), "{all}");
    assert!(all.contains("BGP.next_hop: 10.250.0.2"), "{all}");
    // The withdrawal of the second prefix of each family reaches BIRD.
    let _ = wtx4.send(());
    let _ = wtx6.send(());
    wait_for(
        "BIRD drops the withdrawn routes",
        Duration::from_secs(30),
        || {
            let (s4, s6) = (show("calix4"), show("calix6"));
            (s4.contains("10.244.0.0/26")
                && !s4.contains("10.244.0.64/26")
                && s6.contains("fd44::/122")
                && !s6.contains("fd44::40/122"))
            .then_some(())
        },
        || format!("{}\n{}", show("calix4"), show("calix6")),
    );
    let _ = tx4.send(());
    let _ = tx6.send(());
    let (r4, r6) = speaker
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
        .expect("both sessions ended within 60 s");
    let (n4, rib4) = r4.expect("the IPv4 session");
    let (n6, rib6) = r6.expect("the IPv6 session");
    assert_eq!(n4.hold_time, 9);
    assert!(n4.four_octet_as && n4.peer_route_refresh, "{n4:?}");
    assert_eq!(n4.peer_router_id, std::net::Ipv4Addr::new(10, 250, 0, 1));
    let learned4: Vec<_> = rib4
        .routes()
        .iter()
        .map(|(n, r)| (*n, r.next_hop, r.as_path.clone()))
        .collect();
    assert_eq!(
        learned4,
        vec![(
            net("198.18.1.0/24"),
            "10.250.0.1".parse::<IpAddr>().expect("ip"),
            vec![ROUTER_AS]
        )]
    );
    assert_eq!(n6.families, vec![Family::IPV6_UNICAST]);
    let learned6: Vec<IpNet> = rib6.routes().keys().copied().collect();
    assert_eq!(learned6, vec![net("fd60::/64")]);

    // A wrong password never establishes: the router's kernel drops segments signed with
    // another key, so the connection does not even open (it times out, it is not refused).
    let wrong = node
        .spawn(None, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                conn::connect(
                    Some("10.250.0.2".parse().expect("ip")),
                    "10.250.0.1:179".parse().expect("addr"),
                    Some(b"not-the-password"),
                    Duration::from_secs(3),
                )
                .await
                .map(|_| ())
                .map_err(|e| e.kind())
            })
        })
        .expect("thread")
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(
        wrong,
        Err(std::io::ErrorKind::TimedOut),
        "a connection opened (or was refused) with the wrong password"
    );
    let state = bird.birdc("show protocols calix4");
    assert!(
        !state.contains("Established"),
        "BIRD still shows a session: {state}"
    );
}
