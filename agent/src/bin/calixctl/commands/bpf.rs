//! `bpf counters`, `bpf conntrack`, `bpf nat`.
use anyhow::{Context, Result};
use calix_proto::v1 as pb;
use clap::Subcommand;

use crate::render::bpf as render;
use crate::Output;

#[derive(Subcommand)]
pub(crate) enum BpfCmd {
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
pub(crate) struct FlowArgs {
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

/// `bpf counters`.
pub(crate) async fn counters(channel: tonic::transport::Channel, output: Output) -> Result<()> {
    let resp = pb::endpoints_client::EndpointsClient::new(channel)
        .drops(pb::DropsRequest {})
        .await
        .context("reading drop counters")?
        .into_inner();
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&render::drops_json(&resp))?
        ),
        Output::Table => println!("{}", render::drops_table(&resp)),
    }
    Ok(())
}

/// `bpf conntrack` / `bpf nat`.
pub(crate) async fn flows(
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
        Output::Table => println!("{}", render::flows_table(&flows, nat_view, &resp.node)),
    }
    Ok(())
}
