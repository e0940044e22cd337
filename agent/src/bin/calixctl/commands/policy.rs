//! `policy [<namespace>/<pod>]`.
use anyhow::{bail, Context, Result};
use calix_core::policy::report::{DroppedPacket, PolicyReport};
use calix_core::policy::trace::{parse_proto_port, TraceReport};
use calix_proto::v1 as pb;

use crate::render::policy as render;
use crate::Output;
use calix_core::policy::model::PodKey;

/// `namespace/name` split ([`PodKey::parse`]).
pub(crate) fn pod_ref(s: &str) -> Result<(String, String)> {
    let k = PodKey::parse(s).map_err(anyhow::Error::msg)?;
    Ok((k.namespace, k.name))
}

pub(crate) async fn run(
    channel: tonic::transport::Channel,
    pod: Option<String>,
    output: Output,
) -> Result<()> {
    let (namespace, name) = match &pod {
        Some(p) => pod_ref(p)?,
        None => Default::default(),
    };
    let json = pb::policy_info_client::PolicyInfoClient::new(channel)
        .show(pb::PolicyInfoRequest { namespace, name })
        .await
        .context("reading the policy calculation")?
        .into_inner()
        .json;
    let r: PolicyReport = serde_json::from_str(&json).context("agent sent a bad policy report")?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
        Output::Table => println!("{}", render::policy(&r, pod.as_deref())),
    }
    if pod.is_some() && r.enabled && r.endpoint.is_none() {
        bail!("no such pod known to the agent");
    }
    Ok(())
}

/// `monitor --drops`: the agent's drop events, one line each, until interrupted or `count`.
pub(crate) async fn monitor(
    channel: tonic::transport::Channel,
    count: Option<u64>,
    output: Output,
) -> Result<()> {
    let mut stream = pb::policy_info_client::PolicyInfoClient::new(channel)
        .monitor(pb::MonitorRequest {})
        .await
        .context("following the drop events")?
        .into_inner();
    if matches!(output, Output::Table) {
        println!("{}", render::drop_header());
    }
    let mut seen = 0u64;
    while count.is_none_or(|c| seen < c) {
        let Some(event) = stream.message().await.context("the drop events")? else {
            bail!("the agent ended the stream (stopping?)");
        };
        let d: DroppedPacket =
            serde_json::from_str(&event.json).context("agent sent a bad drop event")?;
        match output {
            Output::Json => println!("{}", serde_json::to_string(&d)?),
            Output::Table => println!("{}", render::drop_line(&d)),
        }
        seen += 1;
    }
    Ok(())
}

/// `trace <src> <dst> <proto>/<port>`: fails (non-zero) when the packet would be dropped, so
/// scripts can branch on it.
pub(crate) async fn trace(
    channel: tonic::transport::Channel,
    src: String,
    dst: String,
    proto: &str,
    output: Output,
) -> Result<()> {
    let (protocol, port) = parse_proto_port(proto).map_err(anyhow::Error::msg)?;
    let json = pb::policy_info_client::PolicyInfoClient::new(channel)
        .trace(pb::TraceRequest {
            src,
            dst,
            protocol: u32::from(protocol),
            port: u32::from(port),
        })
        .await
        .context("tracing the packet")?
        .into_inner()
        .json;
    let r: TraceReport = serde_json::from_str(&json).context("agent sent a bad trace")?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
        Output::Table => println!("{}", render::trace(&r)),
    }
    if r.dropped_at().is_some() {
        std::process::exit(1);
    }
    Ok(())
}
