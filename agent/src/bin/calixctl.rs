//! calixctl: the operator's CLI. Talks to the local agent over its unix socket.
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
    /// The agent's gRPC socket.
    #[arg(long, global = true, env = "CALIX_SOCKET", default_value = calix_proto::DEFAULT_AGENT_SOCKET)]
    socket: PathBuf,
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
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
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
                "containerID": e.container_id,
                "ifname": e.ifname,
                "hostInterface": e.host_ifname,
                "hostIfindex": s.host_ifindex,
                "addresses": e.addresses,
                "bpfAttached": s.bpf_attached,
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
            "FROM POD",
            "TO POD",
        ],
        &rows,
    );
    out.push_str(&format!(
        "\n{} endpoint(s) on node {}",
        resp.endpoints.len(),
        resp.node
    ));
    out
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let channel = calix_proto::connect_unix(&cli.socket, Duration::from_secs(5))
        .await
        .with_context(|| {
            format!(
                "cannot reach calix-agent at {} (is it running? see --socket)",
                cli.socket.display()
            )
        })?;
    match cli.cmd {
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
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(2048), "2.0 KiB");
    }
}
