//! `bgp peers`, `bgp routes`.
use anyhow::{Context, Result};
use calix_agent::bgp::status::BgpReport;
use calix_proto::v1 as pb;

use crate::render::bgp as render;
use crate::Output;

/// `bgp peers` (`routes`: `bgp routes`).
pub(crate) async fn run(
    channel: tonic::transport::Channel,
    routes: bool,
    output: Output,
) -> Result<()> {
    let json = pb::bgp_info_client::BgpInfoClient::new(channel)
        .show(pb::BgpInfoRequest {})
        .await
        .context("reading the BGP speaker")?
        .into_inner()
        .json;
    if json.is_empty() {
        match output {
            Output::Json => println!("null"),
            Output::Table => println!("BGP is off on this node (bgp.enabled = false)"),
        }
        return Ok(());
    }
    let r: BgpReport = serde_json::from_str(&json).context("agent sent a bad BGP report")?;
    match (output, routes) {
        (Output::Json, false) => println!("{}", serde_json::to_string_pretty(&r.peers)?),
        (Output::Json, true) => println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "advertised": r.advertised,
                "learned": r.learned,
                "complete": r.complete,
            }))?
        ),
        (Output::Table, false) => println!("{}", render::peers_table(&r)),
        (Output::Table, true) => println!("{}", render::routes_table(&r)),
    }
    Ok(())
}
