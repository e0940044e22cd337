//! Pod → outside: each variant's node, pod, uplink and internet namespace, its NAT rules, and the
//! probe that checks what the outside sees.
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use calix_testbed::traffic::{Tools, Traffic};
use calix_testbed::{uplink, AgentSpec, Dataplane, Guarded, Netns, Node, Plugin};
use serde_json::Value;

use super::{Variant, DENY_CIDR, INET, NODE_UP, PEER_IF, POOL, PROBE_PORT, UPLINK, UP_PREFIX};
use crate::bench::harness::{Bench, Compared};

/// The agent's config file beyond what the test bed passes as flags (node name, socket,
/// datastore path, dataplane, log level, pin root): the uplink, the pool, the XDP deny list,
/// then `extra` (`--snat-config`) after every table.
pub(super) fn agent_config(
    uplinks: bool,
    nat_outgoing: bool,
    xdp: Option<&str>,
    extra: Option<&str>,
) -> String {
    let mut s = String::new();
    if uplinks {
        s.push_str(&format!("uplinks = [{UPLINK:?}]\n\n"));
    }
    s.push_str(&format!("[[pools]]\ncidr = {POOL:?}\n"));
    if nat_outgoing {
        s.push_str("natOutgoing = true\n");
    }
    if let Some(mode) = xdp {
        s.push_str(&format!(
            "\n[xdp]\nenabled = true\nmode = {mode:?}\ndeny_cidrs = [{DENY_CIDR:?}]\n"
        ));
    }
    if let Some(extra) = extra {
        s.push_str(&format!("\n{}\n", extra.trim_end()));
    }
    s
}

/// A node and its uplink to a new internet namespace. The agent runs `config` once started
/// (the caller wires the rest first); without one it never starts (the nft and floor filters).
pub(super) fn uplinked(
    b: &Bench,
    tag: &str,
    dataplane: Dataplane,
    config: Option<String>,
) -> Result<(Node, Netns)> {
    let inet = b.netns(&format!("{tag}-i"))?;
    let node = Node::new(
        b.name(tag),
        AgentSpec {
            config,
            ..b.spec(dataplane)
        },
    )?;
    uplink(&node.ns, &inet, UPLINK, &format!("{NODE_UP}/{UP_PREFIX}"))?;
    inet.ip(&format!("addr add {INET}/{UP_PREFIX} dev {PEER_IF}"))?;
    Ok((node, inet))
}

/// Loads ruleset `rules` into namespace `ns` (`nft -f`).
pub(super) fn nft(b: &Bench, ns: &Netns, rules: &str) -> Result<()> {
    let path = b.dir.join(format!("{}.nft", ns.name));
    std::fs::write(&path, rules)?;
    calix_testbed::checked(ns.command("nft")?.arg("-f").arg(&path))?;
    Ok(())
}

/// One outgoing-traffic variant's wiring, removed when dropped (servers first).
pub(super) struct Topology {
    _servers: Vec<Guarded>,
    pub(super) traffic: Traffic,
    pub(super) pod_ip: Ipv4Addr,
    pub(super) node: Node,
    _namespaces: [Netns; 2],
}

/// Builds variant `v`: node + agent + uplink + internet + pod + NAT rules + servers.
pub(super) fn topology(
    b: &Bench,
    tools: &Tools,
    v: Variant,
    extra: Option<&str>,
) -> Result<Topology> {
    let extra = extra.filter(|_| v == Variant::CalixSnat);
    let config = agent_config(v.ebpf(), v == Variant::CalixSnat, None, extra);
    let dataplane = if v.ebpf() {
        Dataplane::Ebpf
    } else {
        Dataplane::Kernel
    };
    let (node, inet) = uplinked(b, v.tag(), dataplane, Some(config))?;
    let pod = b.netns(&format!("{}-p", v.tag()))?;
    let ns = &node.ns;
    ns.sysctl("net.ipv4.ip_forward=1")?;
    ns.ip(&format!("route add default via {INET}"))?;
    if !v.nat() {
        inet.ip(&format!("route add {POOL} via {NODE_UP}"))?;
    }
    node.agent().start(&[])?;
    let conf = node.conf(serde_json::json!({ "name": "k8s", "ipam": { "type": "calix-ipam" } }));
    let plugin = Plugin::new(v.label(), b.bins.join("calix"), Some(ns), &conf);
    let pod_ip = plugin.add_pod(&pod, &format!("{}-0", v.tag()))?;
    let masquerade = format!("ip saddr {POOL} ip daddr != {POOL} masquerade");
    match v {
        Variant::Iptables => {
            let rule =
                format!("-w -t nat -A POSTROUTING -s {POOL} ! -d {POOL} -o {UPLINK} -j MASQUERADE");
            calix_testbed::checked(ns.command("iptables")?.args(rule.split(' ')))?;
        }
        Variant::Nftables => nft(
            b,
            ns,
            &format!(
                "table ip cxbnat {{\n  chain post {{\n    type nat hook postrouting priority \
                 srcnat; policy accept;\n    oifname {UPLINK:?} {masquerade}\n  }}\n}}\n"
            ),
        )?,
        _ => {}
    }
    let traffic = Traffic::new(&pod, &inet, INET);
    Ok(Topology {
        _servers: tools.start(&traffic, &b.dir)?,
        traffic,
        pod_ip,
        node,
        _namespaces: [pod, inet],
    })
}

/// One TCP connection from the pod to the internet: the source the internet saw.
pub(super) fn probe(t: &Traffic) -> Result<SocketAddrV4> {
    let listener = t
        .server
        .spawn(None, || TcpListener::bind((INET, PROBE_PORT)))?
        .join()
        .map_err(|_| anyhow!("the probe listener's thread panicked"))?
        .context("probe listener")?;
    listener.set_nonblocking(true)?;
    let client = t.client.spawn(None, || {
        let to = SocketAddr::from((INET, PROBE_PORT));
        TcpStream::connect_timeout(&to, Duration::from_secs(2))
    })?;
    let deadline = Instant::now() + Duration::from_secs(3);
    let seen = loop {
        match listener.accept() {
            Ok((_, peer)) => break Some(peer),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("probe accept"),
        }
    };
    client
        .join()
        .map_err(|_| anyhow!("the probe client's thread panicked"))?
        .with_context(|| format!("connecting to {INET}:{PROBE_PORT}"))?;
    match seen {
        Some(SocketAddr::V4(a)) => Ok(a),
        Some(a) => bail!("the internet saw an IPv6 source {a}"),
        None => bail!("the connection reached no listener"),
    }
}

/// Builds `v` and checks with a probe that the internet sees the source it should; the
/// calix SNAT variant must be translated by the programs.
pub(super) fn checked_topology(
    b: &Bench,
    tools: &Tools,
    v: Variant,
    extra: Option<&str>,
) -> Result<Topology> {
    let t = topology(b, tools, v, extra).with_context(|| format!("setting up {}", v.label()))?;
    let want = if v.nat() { NODE_UP } else { t.pod_ip };
    match probe(&t.traffic).map(|a| (*a.ip(), a.port())) {
        // Translated by the programs, not by a kernel rule (the agent's own nftables masquerade
        // of what the programs leave to the stack included): their conntrack holds the probe's
        // flow, leaving with the port the internet saw.
        Ok((seen, port)) if seen == want && v == Variant::CalixSnat => {
            let flows =
                t.node
                    .agent()
                    .calixctl_json(&["bpf", "nat", "--ip", &t.pod_ip.to_string()])?;
            let num = |f: &Value, k: &str| f[k].as_u64().or_else(|| f[k].as_str()?.parse().ok());
            let by_programs = flows["flows"].as_array().into_iter().flatten().any(|f| {
                num(f, "dst_port") == Some(PROBE_PORT.into())
                    && num(f, "nat_port") == Some(port.into())
            });
            if !by_programs {
                bail!("the internet saw {seen}:{port}, a translation the programs did not make (their flows: {flows})");
            }
            Ok(t)
        }
        Ok((seen, _)) if seen == want => Ok(t),
        Ok((seen, _)) => Err(anyhow!(
            "the internet saw the pod's connection from {seen}, not {want}{}",
            if seen == t.pod_ip {
                " (not translated)"
            } else {
                ""
            }
        )),
        Err(e) if v.nat() => Err(anyhow!(
            "not translated: the pod's connection to the internet failed ({e:#}; the internet \
             has no route back to {POOL}, so only a translated connection is answered)"
        )),
        Err(e) => Err(e.context(format!(
            "a connection from the pod ({}) to the internet ({INET}) failed",
            t.pod_ip
        ))),
    }
}

/// Why calix SNAT could not be measured, in one line: the agent's last log line when it did
/// not come up, else the error chain.
pub(super) fn unavailable_reason(e: &anyhow::Error) -> String {
    let not_ready = e.chain().find_map(|c| match c.downcast_ref() {
        Some(calix_testbed::Error::NotReady { what, log, .. }) => Some((what, log)),
        _ => None,
    });
    let one_line = match not_ready {
        Some((what, log)) => {
            let last = log.lines().rev().map(str::trim).find(|l| !l.is_empty());
            format!("{what} exited: {}", last.unwrap_or("(empty log)"))
        }
        None => format!("{e:#}")
            .lines()
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" "),
    };
    let mut s: String = one_line.chars().take(400).collect();
    if s.len() < one_line.len() {
        s.push('…');
    }
    s
}
