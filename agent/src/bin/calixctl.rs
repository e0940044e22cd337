//! calixctl: the operator's CLI. Talks to the local agent over its unix socket; `ipam` can
//! also work from a kubeconfig, on the cluster's records directly (the `kubernetes` datastore).
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_proto::v1 as pb;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "calixctl",
    version,
    about = "Inspect and operate calix on this node"
)]
struct Cli {
    /// The agent's gRPC socket [env: CALIX_SOCKET; default: /var/run/calix/agent.sock].
    #[arg(long, global = true, env = "CALIX_SOCKET")]
    socket: Option<PathBuf>,
    /// `ipam show/check/release` on the cluster's calix.dev objects through this kubeconfig
    /// instead of the agent (the `kubernetes` datastore). Also `$KUBECONFIG` when no socket is
    /// given.
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Output format.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// List this node's endpoints with their addresses, interfaces and counters.
    Endpoints,
    /// IP address management across every node of the datastore.
    Ipam {
        #[command(subcommand)]
        cmd: IpamCmd,
    },
    /// The eBPF dataplane of this node.
    Bpf {
        #[command(subcommand)]
        cmd: BpfCmd,
    },
    /// Routes between nodes: this node's advertised routes and the routes learned from peers
    /// (node, next hop, via, source, age, state), and what the reconciler was handed.
    Routes,
    /// The peers this node follows for routes: stream state, last update, generation, grace
    /// timer.
    Nodes,
}

#[derive(Subcommand)]
enum BpfCmd {
    /// Drop counters by interface and reason (every drop the programs make is counted).
    Counters,
    /// SNAT connection tracking: the translated flows, their state and timeouts.
    Conntrack {
        #[command(flatten)]
        filter: FlowArgs,
        /// Remove the matching flows (every flow without a filter).
        #[arg(long)]
        flush: bool,
    },
    /// SNAT mappings: each pod address and port and the node address and port it leaves with.
    Nat {
        #[command(flatten)]
        filter: FlowArgs,
    },
}

/// Filters of `bpf conntrack` / `bpf nat`.
#[derive(clap::Args)]
struct FlowArgs {
    /// An IPv4 address of the pod, destination or NAT side.
    #[arg(long)]
    ip: Option<std::net::Ipv4Addr>,
    /// tcp, udp or icmp.
    #[arg(long)]
    proto: Option<String>,
    /// A port of any side.
    #[arg(long)]
    port: Option<u16>,
}

/// `bpf conntrack` / `bpf nat`.
async fn flows(
    channel: tonic::transport::Channel,
    filter: FlowArgs,
    flush: bool,
    nat_view: bool,
    output: Output,
) -> Result<()> {
    let resp = pb::endpoints_client::EndpointsClient::new(channel)
        .conntrack(pb::ConntrackRequest {
            ip: filter.ip.map(|i| i.to_string()).unwrap_or_default(),
            proto: filter.proto.unwrap_or_default(),
            port: filter.port.map(u32::from).unwrap_or_default(),
            flush,
        })
        .await
        .context("reading the conntrack table")?
        .into_inner();
    if flush {
        match output {
            Output::Json => println!(
                "{}",
                serde_json::to_string_pretty(
                    &serde_json::json!({"node": resp.node, "flushed": resp.flushed})
                )?
            ),
            Output::Table => println!("{} flow(s) flushed on node {}", resp.flushed, resp.node),
        }
        return Ok(());
    }
    let flows: Vec<serde_json::Value> =
        serde_json::from_str(&resp.json).context("agent sent bad flows")?;
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"node": resp.node, "flows": flows}))?
        ),
        Output::Table => println!("{}", flows_table(&flows, nat_view, &resp.node)),
    }
    Ok(())
}

fn flows_table(flows: &[serde_json::Value], nat_view: bool, node: &str) -> String {
    let s = |f: &serde_json::Value, k: &str| match &f[k] {
        serde_json::Value::String(v) => v.clone(),
        other => other.to_string(),
    };
    let rows: Vec<Vec<String>> = flows
        .iter()
        .map(|f| {
            let pod = format!("{}:{}", s(f, "pod"), s(f, "pod_port"));
            let nat = format!("{}:{}", s(f, "nat"), s(f, "nat_port"));
            let dst = format!("{}:{}", s(f, "dst"), s(f, "dst_port"));
            if nat_view {
                vec![s(f, "proto"), pod, nat, dst]
            } else {
                vec![
                    s(f, "proto"),
                    pod,
                    dst,
                    nat,
                    s(f, "state"),
                    format!("{}s", s(f, "idle_secs")),
                    format!("{}s", s(f, "expires_in_secs")),
                ]
            }
        })
        .collect();
    let header: &[&str] = if nat_view {
        &["PROTO", "POD", "NAT", "DESTINATION"]
    } else {
        &[
            "PROTO",
            "POD",
            "DESTINATION",
            "NAT",
            "STATE",
            "IDLE",
            "EXPIRES",
        ]
    };
    let mut out = table(header, &rows);
    out.push_str(&format!("\n{} flow(s) on node {node}", flows.len()));
    out
}

fn drops_table(resp: &pb::DropsResponse) -> String {
    let rows: Vec<Vec<String>> = resp
        .drops
        .iter()
        .map(|d| {
            vec![
                if d.ifname.is_empty() {
                    format!("(ifindex {})", d.ifindex)
                } else {
                    d.ifname.clone()
                },
                d.reason.clone(),
                d.packets.to_string(),
                human_bytes(d.bytes),
            ]
        })
        .collect();
    let total: u64 = resp.drops.iter().map(|d| d.packets).sum();
    let t = table(&["INTERFACE", "REASON", "PACKETS", "BYTES"], &rows);
    format!("{t}\n{total} packet(s) dropped on node {}", resp.node)
}

#[derive(Subcommand)]
enum IpamCmd {
    /// Pools, blocks (with their node) and per-node use.
    Show,
    /// Look for leaks, duplicates and orphans; exits 1 if any is found. `-o json` gives a
    /// report `ipam release --from-report` takes.
    Check,
    /// Release addresses: one (`--ip`) or every leak of a `check -o json` report. A report's
    /// entries are released only if each address is still that very allocation.
    Release {
        #[arg(
            long,
            conflicts_with = "from_report",
            required_unless_present = "from_report"
        )]
        ip: Option<std::net::IpAddr>,
        #[arg(long)]
        from_report: Option<PathBuf>,
    },
}

use calix_agent::ipam::service::{CheckReport, IpamReport};
use calix_core::routes::report::RoutesReport;

/// Seconds as "4s", "3m20s", "2h5m", "3d4h".
fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{}s", s / 60, s % 60),
        3600..=86399 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

fn routes_off(r: &RoutesReport) -> Option<String> {
    (!r.enabled).then(|| {
        format!(
            "route distribution is off on node {} (routes.enabled = false)",
            r.node
        )
    })
}

fn routes_table(r: &RoutesReport) -> String {
    if let Some(off) = routes_off(r) {
        return off;
    }
    let mut rows: Vec<Vec<String>> = r
        .advertised
        .iter()
        .map(|a| {
            vec![
                a.prefix.clone(),
                a.node.clone(),
                a.next_hop.clone(),
                "-".into(),
                "(this node)".into(),
                age(a.age_secs),
                "advertised".into(),
            ]
        })
        .collect();
    rows.extend(r.learned.iter().map(|l| {
        vec![
            l.prefix.clone(),
            l.node.clone(),
            l.next_hop.clone(),
            l.via.clone(),
            l.source.clone(),
            age(l.age_secs),
            match &l.cause {
                Some(c) => format!("{}: {c}", l.state),
                None => l.state.clone(),
            },
        ]
    }));
    let mut out = table(
        &[
            "PREFIX", "NODE", "NEXT HOP", "VIA", "SOURCE", "AGE", "STATE",
        ],
        &rows,
    );
    out.push_str(&format!(
        "\n{} advertised, {} learned; {} route(s) handed to the reconciler ({}){}",
        r.advertised.len(),
        r.learned.len(),
        r.desired.len(),
        if r.desired_complete {
            "complete"
        } else {
            "incomplete: re-learning, stale routes kept"
        },
        r.desired_age_secs
            .map(|s| format!(" {} ago", age(s)))
            .unwrap_or_default()
    ));
    if r.learned_omitted > 0 {
        out.push_str(&format!(
            "\n{} more learned route(s) not accepted, not listed",
            r.learned_omitted
        ));
    }
    if !r.refusals.is_empty() {
        let causes: Vec<String> = r.refusals.iter().map(|(c, n)| format!("{c} {n}")).collect();
        out.push_str(&format!("\nrefused: {}", causes.join(", ")));
    }
    if !r.guard_refusals.is_empty() {
        let causes: Vec<String> = r
            .guard_refusals
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        out.push_str(&format!(
            "\nkept out of the kernel by the route guard: {}",
            causes.join(", ")
        ));
    }
    if !r.ignored_blocks.is_empty() {
        let rules: Vec<String> = r
            .ignored_blocks
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        out.push_str(&format!(
            "\nblocks ignored (calixctl ipam check): {}",
            rules.join(", ")
        ));
    }
    out
}

fn nodes_table(r: &RoutesReport) -> String {
    if let Some(off) = routes_off(r) {
        return off;
    }
    let rows: Vec<Vec<String>> = r
        .peers
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                p.endpoint.clone(),
                if p.reflector { "reflector" } else { "node" }.into(),
                p.state.clone(),
                p.last_update_secs
                    .map(|s| format!("{} ago", age(s)))
                    .unwrap_or("-".into()),
                p.generation.to_string(),
                p.grace_left_secs.map(age).unwrap_or("-".into()),
                format!("{}/{}", p.accepted, p.routes),
                p.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "PEER",
            "ENDPOINT",
            "ROLE",
            "STATE",
            "LAST UPDATE",
            "GENERATION",
            "GRACE LEFT",
            "ROUTES",
            "LAST ERROR",
        ],
        &rows,
    );
    let d = &r.door;
    out.push_str(&format!(
        "\nnode {} ({}{}, {}) at {}: {} peer(s) followed, {} watcher(s); {}; refused connections: {} unknown source, {} busy, {} TLS, {} identity",
        r.node,
        r.topology,
        if r.reflector { ", reflector" } else { "" },
        if r.tls { "mutual TLS" } else { "PLAIN TEXT" },
        r.endpoint,
        r.peers.len(),
        r.watchers,
        if r.complete {
            "every peer answered"
        } else {
            "waiting for peers (stale routes kept)"
        },
        d.refused_unknown,
        d.refused_busy,
        d.refused_tls,
        d.refused_identity
    ));
    if let Some(c) = &r.certificate {
        out.push_str(&format!(
            "\ncertificate ({}): {}{}; {} issued, {} failed attempt(s){}",
            c.source,
            match (&c.serial, c.expires_in_secs) {
                (Some(serial), Some(left)) if left >= 0 =>
                    format!("serial {serial}, expires in {}", age(left as f64)),
                (Some(serial), _) => format!("serial {serial}, EXPIRED"),
                _ => "none yet".to_string(),
            },
            if c.bundle {
                ""
            } else {
                ", no trust bundle yet"
            },
            c.issued,
            c.failures,
            c.last_error
                .as_ref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        ));
    }
    if r.unknown_withdrawals > 0 || !r.dropped.is_empty() {
        let dropped: Vec<String> = r.dropped.iter().map(|(c, n)| format!("{c} {n}")).collect();
        out.push_str(&format!(
            "\nwithdrawals of prefixes not held (ignored): {}; streams dropped for breaking the protocol: {}",
            r.unknown_withdrawals,
            if dropped.is_empty() {
                "none".to_string()
            } else {
                dropped.join(", ")
            }
        ));
    }
    out
}

fn nodes_json(r: &RoutesReport) -> serde_json::Value {
    serde_json::json!({
        "node": r.node,
        "enabled": r.enabled,
        "topology": r.topology,
        "reflector": r.reflector,
        "endpoint": r.endpoint,
        "tls": r.tls,
        "certificate": r.certificate,
        "complete": r.complete,
        "watchers": r.watchers,
        "door": r.door,
        "unknown_withdrawals": r.unknown_withdrawals,
        "dropped": r.dropped,
        "peers": r.peers,
    })
}

async fn route_report(channel: tonic::transport::Channel) -> Result<RoutesReport> {
    let json = pb::route_info_client::RouteInfoClient::new(channel)
        .show(pb::RouteInfoRequest {})
        .await
        .context("reading route distribution")?
        .into_inner()
        .json;
    serde_json::from_str(&json).context("agent sent a bad routes report")
}

fn ipam_show_table(r: &IpamReport) -> String {
    let pools: Vec<Vec<String>> = r
        .pools
        .iter()
        .map(|p| {
            vec![
                p.cidr.clone(),
                format!("/{}", p.block_size),
                if p.disabled { "disabled" } else { "enabled" }.into(),
                p.blocks.to_string(),
                p.used.to_string(),
                p.size.to_string(),
            ]
        })
        .collect();
    let blocks: Vec<Vec<String>> = r
        .blocks
        .iter()
        .map(|b| {
            vec![
                b.cidr.clone(),
                b.affinity.clone(),
                format!("{}/{}", b.used, b.size),
                b.borrowed.to_string(),
            ]
        })
        .collect();
    let nodes: Vec<Vec<String>> = r
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.node.clone(),
                n.addresses.join(","),
                n.blocks.to_string(),
                n.used.to_string(),
                n.endpoints.to_string(),
            ]
        })
        .collect();
    format!(
        "{}\n\n{}\n\n{}\n\nnode {} can allocate {} more IPv4 and {} more IPv6 address(es) from its blocks and unclaimed ones",
        table(&["POOL", "BLOCK SIZE", "STATE", "BLOCKS", "IN USE", "SIZE"], &pools),
        table(&["BLOCK", "NODE", "IN USE", "BORROWED"], &blocks),
        table(&["NODE", "ADDRESSES", "BLOCKS", "IN USE", "ENDPOINTS"], &nodes),
        r.node,
        r.free_v4,
        r.free_v6
    )
}

fn ipam_check_table(r: &CheckReport) -> String {
    let rows: Vec<Vec<String>> = r
        .findings
        .iter()
        .map(|f| {
            vec![
                if f.rule.is_empty() {
                    f.kind.clone()
                } else {
                    format!("{} ({})", f.kind, f.rule)
                },
                f.address.map(|a| a.to_string()).unwrap_or_default(),
                f.node.clone(),
                f.block.clone(),
                if f.handle.is_empty() {
                    String::new()
                } else {
                    format!("{}/{}", f.handle, f.ifname)
                },
                f.detail.clone(),
            ]
        })
        .collect();
    let summary = format!(
        "{} allocation(s) in {} block(s), {} handle(s), {} endpoint(s): {} problem(s)",
        r.allocations,
        r.blocks,
        r.handles,
        r.endpoints,
        r.findings.len()
    );
    if rows.is_empty() {
        summary
    } else {
        format!(
            "{}\n{summary}",
            table(
                &["KIND", "ADDRESS", "NODE", "BLOCK", "HANDLE", "DETAIL"],
                &rows
            )
        )
    }
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn pod_name(e: &pb::Endpoint) -> String {
    match (e.pod_namespace.as_str(), e.pod_name.as_str()) {
        ("", "") => e.container_id.chars().take(12).collect(),
        ("", p) => p.to_string(),
        (ns, p) => format!("{ns}/{p}"),
    }
}

/// Renders rows as an aligned table with a header.
/// A table with aligned columns. Cells come from the agent and often from pods (names,
/// namespaces): their control characters are escaped, so no cell can move the cursor, clear
/// the screen or forge a row on the operator's terminal.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|c| calix_log::escape_control(c).into_owned())
                .collect()
        })
        .collect();
    let rows = &rows;
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(header.iter().map(|h| h.to_string()).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

fn endpoints_json(resp: &pb::ListResponse) -> serde_json::Value {
    let eps: Vec<serde_json::Value> = resp
        .endpoints
        .iter()
        .map(|s| {
            let e = s.endpoint.clone().unwrap_or_default();
            serde_json::json!({
                "pod": pod_name(&e),
                "podNamespace": e.pod_namespace,
                "podName": e.pod_name,
                "podUID": s.pod.as_ref().map_or(e.pod_uid.clone(), |p| p.uid.clone()),
                "podLabels": s.pod.as_ref().map(|p| p.labels.iter().collect::<std::collections::BTreeMap<_, _>>()),
                "podPhase": s.pod.as_ref().map(|p| p.phase.clone()),
                "podDeleting": s.pod.as_ref().map(|p| p.deleting),
                "containerID": e.container_id,
                "ifname": e.ifname,
                "hostInterface": e.host_ifname,
                "hostIfindex": s.host_ifindex,
                "addresses": e.addresses,
                "bpfAttached": s.bpf_attached,
                "state": s.state,
                "counters": s.counters.as_ref().map(|c| serde_json::json!({
                    "fromPodPackets": c.from_pod_packets,
                    "fromPodBytes": c.from_pod_bytes,
                    "toPodPackets": c.to_pod_packets,
                    "toPodBytes": c.to_pod_bytes,
                })),
            })
        })
        .collect();
    serde_json::json!({ "node": resp.node, "endpoints": eps })
}

fn endpoints_table(resp: &pb::ListResponse) -> String {
    let rows: Vec<Vec<String>> = resp
        .endpoints
        .iter()
        .map(|s| {
            let e = s.endpoint.clone().unwrap_or_default();
            let (tx, rx) = match &s.counters {
                Some(c) => (
                    format!(
                        "{} pkts / {}",
                        c.from_pod_packets,
                        human_bytes(c.from_pod_bytes)
                    ),
                    format!(
                        "{} pkts / {}",
                        c.to_pod_packets,
                        human_bytes(c.to_pod_bytes)
                    ),
                ),
                None => ("-".into(), "-".into()),
            };
            vec![
                pod_name(&e),
                e.addresses.join(","),
                e.host_ifname,
                if s.bpf_attached { "ebpf" } else { "kernel" }.into(),
                if s.state.is_empty() { "-" } else { &s.state }.into(),
                tx,
                rx,
            ]
        })
        .collect();
    let mut out = table(
        &[
            "POD",
            "ADDRESSES",
            "HOST IFACE",
            "DATAPLANE",
            "STATE",
            "FROM POD",
            "TO POD",
        ],
        &rows,
    );
    let not_ok = resp
        .endpoints
        .iter()
        .filter(|s| !s.state.is_empty() && s.state != "ok")
        .count();
    out.push_str(&format!(
        "\n{} endpoint(s) on node {}",
        resp.endpoints.len(),
        resp.node
    ));
    if not_ok > 0 {
        out.push_str(&format!(
            ", {not_ok} not in their desired state (STATE says why)"
        ));
    }
    out
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let kubeconfig = cli.kubeconfig.clone().or_else(|| {
        cli.socket
            .is_none()
            .then(|| std::env::var_os("KUBECONFIG"))
            .flatten()
            .and_then(|v| std::env::split_paths(&v).next())
    });
    if let (Cmd::Ipam { cmd }, Some(path)) = (&cli.cmd, &kubeconfig) {
        let store =
            calix_agent::datastore::KubeStore::connect(&calix_agent::datastore::KubeConfig {
                kubeconfig: Some(path.clone()),
                timeout: Duration::from_secs(10),
                attempts: 3,
            })
            .await
            .with_context(|| format!("kubeconfig {}", path.display()))?;
        return ipam(Ipam::Cluster(store), cmd, cli.output).await;
    }
    let socket = cli
        .socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(calix_proto::DEFAULT_AGENT_SOCKET));
    let channel = calix_proto::connect_unix(&socket, Duration::from_secs(5))
        .await
        .with_context(|| {
            format!(
                "cannot reach calix-agent at {} (is it running? see --socket)",
                socket.display()
            )
        })?;
    match cli.cmd {
        Cmd::Ipam { cmd } => {
            let client = pb::ipam_client::IpamClient::new(channel);
            return ipam(Ipam::Agent(client), &cmd, cli.output).await;
        }
        Cmd::Routes => {
            let r = route_report(channel).await?;
            match cli.output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
                Output::Table => println!("{}", routes_table(&r)),
            }
        }
        Cmd::Nodes => {
            let r = route_report(channel).await?;
            match cli.output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&nodes_json(&r))?),
                Output::Table => println!("{}", nodes_table(&r)),
            }
        }
        Cmd::Bpf {
            cmd: BpfCmd::Conntrack { filter, flush },
        } => return flows(channel, filter, flush, false, cli.output).await,
        Cmd::Bpf {
            cmd: BpfCmd::Nat { filter },
        } => return flows(channel, filter, false, true, cli.output).await,
        Cmd::Bpf {
            cmd: BpfCmd::Counters,
        } => {
            let resp = pb::endpoints_client::EndpointsClient::new(channel)
                .drops(pb::DropsRequest {})
                .await
                .context("reading drop counters")?
                .into_inner();
            match cli.output {
                Output::Json => {
                    let v: Vec<serde_json::Value> = resp
                        .drops
                        .iter()
                        .map(|d| {
                            serde_json::json!({
                                "ifindex": d.ifindex,
                                "interface": d.ifname,
                                "reason": d.reason,
                                "packets": d.packets,
                                "bytes": d.bytes,
                            })
                        })
                        .collect();
                    println!(
                        "{}",
                        serde_json::to_string_pretty(
                            &serde_json::json!({"node": resp.node, "drops": v})
                        )?
                    );
                }
                Output::Table => println!("{}", drops_table(&resp)),
            }
        }
        Cmd::Endpoints => {
            let resp = pb::endpoints_client::EndpointsClient::new(channel)
                .list(pb::ListRequest {})
                .await
                .context("listing endpoints")?
                .into_inner();
            match cli.output {
                Output::Json => {
                    println!("{}", serde_json::to_string_pretty(&endpoints_json(&resp))?)
                }
                Output::Table => println!("{}", endpoints_table(&resp)),
            }
        }
    }
    Ok(())
}

/// Where `ipam` works: through the agent, or on the cluster's records.
enum Ipam {
    Agent(pb::ipam_client::IpamClient<tonic::transport::Channel>),
    Cluster(calix_agent::datastore::KubeStore),
}

impl Ipam {
    async fn show(&mut self) -> Result<IpamReport> {
        match self {
            Ipam::Agent(client) => {
                let json = client
                    .show(pb::ShowRequest {})
                    .await
                    .context("ipam show")?
                    .into_inner()
                    .json;
                serde_json::from_str(&json).context("agent sent a bad report")
            }
            Ipam::Cluster(store) => calix_agent::ipam::admin::show(store)
                .await
                .context("ipam show on the cluster"),
        }
    }

    async fn check(&mut self) -> Result<CheckReport> {
        match self {
            Ipam::Agent(client) => {
                let json = client
                    .check(pb::CheckRequest {})
                    .await
                    .context("ipam check")?
                    .into_inner()
                    .json;
                serde_json::from_str(&json).context("agent sent a bad report")
            }
            Ipam::Cluster(store) => calix_agent::ipam::admin::check(store)
                .await
                .context("ipam check on the cluster"),
        }
    }

    async fn release(&mut self, addr: std::net::IpAddr, seq: u64, reason: String) -> Result<bool> {
        match self {
            Ipam::Agent(client) => Ok(client
                .release_address(pb::ReleaseAddressRequest {
                    address: addr.to_string(),
                    seq,
                    reason,
                })
                .await
                .with_context(|| format!("releasing {addr}"))?
                .into_inner()
                .released),
            Ipam::Cluster(store) => {
                calix_agent::ipam::admin::release(store, addr, (seq > 0).then_some(seq), &reason)
                    .await
                    .with_context(|| format!("releasing {addr} on the cluster"))
            }
        }
    }
}

async fn ipam(mut backend: Ipam, cmd: &IpamCmd, output: Output) -> Result<()> {
    match cmd {
        IpamCmd::Show => {
            let r = backend.show().await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
                Output::Table => println!("{}", ipam_show_table(&r)),
            }
        }
        IpamCmd::Check => {
            let r = backend.check().await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
                Output::Table => println!("{}", ipam_check_table(&r)),
            }
            if !r.findings.is_empty() {
                std::process::exit(1);
            }
        }
        IpamCmd::Release { ip, from_report } => {
            let targets: Vec<(std::net::IpAddr, u64, String)> = match (ip, from_report) {
                (Some(ip), _) => vec![(*ip, 0, "released by calixctl ipam release --ip".into())],
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    let r: CheckReport = serde_json::from_str(&text).with_context(|| {
                        format!(
                            "{} is not a `calixctl ipam check -o json` report",
                            path.display()
                        )
                    })?;
                    r.findings
                        .iter()
                        .filter(|f| f.kind == "leak")
                        .filter_map(|f| {
                            Some((
                                f.address?,
                                f.seq?,
                                format!("released from report {}: {}", path.display(), f.detail),
                            ))
                        })
                        .collect()
                }
                (None, None) => anyhow::bail!("give --ip or --from-report"),
            };
            let mut rows = Vec::new();
            for (addr, seq, reason) in targets {
                let released = backend.release(addr, seq, reason).await?;
                rows.push((addr, released));
            }
            match output {
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "released": rows.iter().filter(|r| r.1).map(|r| r.0.to_string()).collect::<Vec<_>>(),
                        "unchanged": rows.iter().filter(|r| !r.1).map(|r| r.0.to_string()).collect::<Vec<_>>(),
                    }))?
                ),
                Output::Table => {
                    let t: Vec<Vec<String>> = rows
                        .iter()
                        .map(|(a, r)| {
                            vec![
                                a.to_string(),
                                if *r {
                                    "released"
                                } else {
                                    "unchanged (not allocated, or reallocated since the report)"
                                }
                                .into(),
                            ]
                        })
                        .collect();
                    println!("{}", table(&["ADDRESS", "RESULT"], &t));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &["A", "BB"],
            &[vec!["xxx".into(), "y".into()], vec!["z".into(), "".into()]],
        );
        assert_eq!(t, "A    BB\nxxx  y\nz");
        let t = table(&["POD"], &[vec!["evil\u{1b}[2J\nforged".into()]]);
        assert_eq!(t, "POD\nevil\\u{1b}[2J\\nforged");
    }

    #[test]
    fn ages_are_human() {
        assert_eq!(age(4.2), "4s");
        assert_eq!(age(200.0), "3m20s");
        assert_eq!(age(7500.0), "2h5m");
        assert_eq!(age(-1.0), "0s");
    }

    #[test]
    fn routes_off_says_so() {
        let r = RoutesReport {
            node: "n1".into(),
            ..Default::default()
        };
        assert!(routes_table(&r).contains("route distribution is off on node n1"));
        assert!(nodes_table(&r).contains("routes.enabled = false"));
    }

    #[test]
    fn an_ignored_block_shows_its_block_and_rule() {
        let r = CheckReport {
            blocks: 1,
            findings: vec![calix_agent::ipam::service::Finding {
                kind: "ignored-block".into(),
                rule: "block_size".into(),
                address: None,
                seq: None,
                handle: String::new(),
                ifname: String::new(),
                node: "rogue".into(),
                block: "10.244.7.9/32".into(),
                detail: "10.244.7.9/32 is a /32; pool 10.244.0.0/16 makes /26".into(),
            }],
            ..Default::default()
        };
        let t = ipam_check_table(&r);
        let row = t.lines().nth(1).expect("a row");
        for want in [
            "ignored-block (block_size)",
            "rogue",
            "10.244.7.9/32",
            "makes /26",
        ] {
            assert!(row.contains(want), "{want:?} not in {t}");
        }
        assert!(t.lines().next().is_some_and(|h| h.contains("BLOCK")), "{t}");
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(2048), "2.0 KiB");
    }
}
