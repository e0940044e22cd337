//! calixctl: the operator's CLI. Talks to the local agent over its unix socket; `ipam` can
//! also work from a kubeconfig, on the cluster's records directly (the `kubernetes` datastore).
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use calix_proto::v1 as pb;
use clap::{Parser, Subcommand, ValueEnum};

use commands::bpf::BpfCmd;
use commands::ipam::{Ipam, IpamCmd};

mod commands;
mod render;

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
pub(crate) enum Output {
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
    /// BGP with the data centre's routers.
    Bgp {
        #[command(subcommand)]
        cmd: BgpCmd,
    },
    /// Kubernetes Services: each one's frontends (address, port, protocol) and where each
    /// sends new connections, from inside and from outside; what was refused (an address
    /// not the Service's to have, no room) and what of its EndpointSlices was skipped.
    /// `SERVICE`: `<namespace>/<name>`.
    Services { service: Option<String> },
    /// NetworkPolicy: the agent's calculation, and a pod's policies and rules in force
    /// (`<namespace>/<name>`, or a name in `default`).
    Policy { pod: Option<String> },
    /// Every verdict a packet would meet on its way, in order (anti-spoofing, egress policy,
    /// route, NAT, ingress policy), naming the rule that decides: from the live maps for a
    /// pod on this node, from the agent's calculation for a pod elsewhere. SRC and DST: a
    /// pod (`<namespace>/<name>`, or a name in `default`) or an address; PROTO: `tcp/80`,
    /// `udp/53`, `sctp/9`, `icmp`, `icmpv6`, or a protocol number.
    Trace {
        src: String,
        dst: String,
        proto: String,
    },
    /// What happens now: with `--drops`, each packet NetworkPolicy denies on this node, as it
    /// happens (the endpoint, the flow, the peer, why), until interrupted. At most 1,000
    /// events a second per CPU; what the limit leaves out is counted on the next line. With
    /// `-o json`, one JSON object per line.
    Monitor {
        /// The packets NetworkPolicy denies (eBPF dataplane).
        #[arg(long, required = true)]
        drops: bool,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
    },
}

#[derive(Subcommand)]
enum BgpCmd {
    /// Each peer: state, uptime, prefixes sent, accepted and received, graceful restart,
    /// the last error, and what it got wrong (malformed UPDATEs, over its limit).
    Peers,
    /// The routes advertised to each peer and learned from each (AS path, whether the import
    /// rule took it, whether it is installed or stale).
    Routes,
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
        let store = calix_datastore::KubeStore::connect(&calix_datastore::KubeConfig {
            kubeconfig: Some(path.clone()),
            timeout: Duration::from_secs(10),
            attempts: 3,
        })
        .await
        .with_context(|| format!("kubeconfig {}", path.display()))?;
        return commands::ipam::run(Ipam::Cluster(store), cmd, cli.output).await;
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
            return commands::ipam::run(Ipam::Agent(client), &cmd, cli.output).await;
        }
        Cmd::Routes => commands::routes::routes(channel, cli.output).await?,
        Cmd::Nodes => commands::routes::nodes(channel, cli.output).await?,
        Cmd::Bgp { cmd } => {
            commands::bgp::run(channel, matches!(cmd, BgpCmd::Routes), cli.output).await?
        }
        Cmd::Bpf {
            cmd: BpfCmd::Conntrack { filter, flush },
        } => return commands::bpf::flows(channel, filter, flush, false, cli.output).await,
        Cmd::Bpf {
            cmd: BpfCmd::Nat { filter },
        } => return commands::bpf::flows(channel, filter, false, true, cli.output).await,
        Cmd::Bpf {
            cmd: BpfCmd::Counters,
        } => commands::bpf::counters(channel, cli.output).await?,
        Cmd::Endpoints => commands::endpoints::run(channel, cli.output).await?,
        Cmd::Services { service } => commands::services::run(channel, service, cli.output).await?,
        Cmd::Policy { pod } => commands::policy::run(channel, pod, cli.output).await?,
        Cmd::Trace { src, dst, proto } => {
            commands::policy::trace(channel, src, dst, &proto, cli.output).await?
        }
        Cmd::Monitor { drops: _, count } => {
            commands::policy::monitor(channel, count, cli.output).await?
        }
    }
    Ok(())
}
