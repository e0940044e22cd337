//! `endpoints`.
use anyhow::{Context, Result};
use calix_proto::v1 as pb;

use crate::render::endpoints as render;
use crate::Output;

pub(crate) async fn run(channel: tonic::transport::Channel, output: Output) -> Result<()> {
    let resp = pb::endpoints_client::EndpointsClient::new(channel)
        .list(pb::ListRequest {})
        .await
        .context("listing endpoints")?
        .into_inner();
    match output {
        Output::Json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&render::endpoints_json(&resp))?
            )
        }
        Output::Table => println!("{}", render::endpoints_table(&resp)),
    }
    Ok(())
}
