//! `routes`, `nodes`.
use anyhow::{Context, Result};
use calix_core::routes::report::RoutesReport;
use calix_proto::v1 as pb;

use crate::render::routes as render;
use crate::Output;

/// `routes`.
pub(crate) async fn routes(channel: tonic::transport::Channel, output: Output) -> Result<()> {
    let r = route_report(channel).await?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
        Output::Table => println!("{}", render::routes_table(&r)),
    }
    Ok(())
}

/// `nodes`.
pub(crate) async fn nodes(channel: tonic::transport::Channel, output: Output) -> Result<()> {
    let r = route_report(channel).await?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&render::nodes_json(&r))?),
        Output::Table => println!("{}", render::nodes_table(&r)),
    }
    Ok(())
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
