//! `services`.
use anyhow::{Context, Result};
use calix_agent::services::ServicesReport;
use calix_proto::v1 as pb;

use crate::render::services as render;
use crate::Output;

/// `services [namespace/name]`.
pub(crate) async fn run(
    channel: tonic::transport::Channel,
    service: Option<String>,
    output: Output,
) -> Result<()> {
    let json = pb::services_info_client::ServicesInfoClient::new(channel)
        .show(pb::ServicesInfoRequest {
            service: service.unwrap_or_default(),
        })
        .await
        .context("reading the Services calculation")?
        .into_inner()
        .json;
    if json.is_empty() {
        match output {
            Output::Json => println!("null"),
            Output::Table => {
                println!("Services are off on this node ([services] enabled = false)")
            }
        }
        return Ok(());
    }
    let r: ServicesReport =
        serde_json::from_str(&json).context("agent sent a bad Services report")?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
        Output::Table => println!("{}", render::services_table(&r)),
    }
    Ok(())
}
