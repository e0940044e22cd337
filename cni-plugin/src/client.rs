//! The plugin's connection to calix-agent: bounded in time, errors mapped to CNI codes.
use std::path::Path;
use std::time::Duration;

use calix_proto::v1 as pb;
use tonic::transport::Channel;

use crate::error::{code, CniError};

/// Bounds every call, so an unreachable or wedged agent is answered with code 11 quickly.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(4);

pub struct AgentClient {
    pub ipam: pb::ipam_client::IpamClient<Channel>,
    pub endpoints: pb::endpoints_client::EndpointsClient<Channel>,
}

impl AgentClient {
    pub async fn connect(socket: &Path) -> Result<Self, CniError> {
        let channel = tokio::time::timeout(
            CALL_TIMEOUT,
            calix_proto::connect_unix(socket, CALL_TIMEOUT),
        )
        .await
        .map_err(|_| unreachable_err(socket, "timed out"))?
        .map_err(|e| unreachable_err(socket, &source_chain(&e)))?;
        Ok(Self {
            ipam: pb::ipam_client::IpamClient::new(channel.clone()),
            endpoints: pb::endpoints_client::EndpointsClient::new(channel),
        })
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn unreachable_err(socket: &Path, why: &str) -> CniError {
    CniError::new(
        code::TRY_AGAIN,
        format!(
            "calix-agent is not reachable at {}: {why}",
            socket.display()
        ),
        "check that calix-agent runs on this node (calixctl endpoints); the runtime will retry",
    )
}

/// Maps a failed agent call to a CNI error.
pub fn call_error(what: &str, s: tonic::Status) -> CniError {
    use tonic::Code;
    match s.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
            CniError::new(
                code::TRY_AGAIN,
                format!("calix-agent did not answer {what}: {}", s.message()),
                "check that calix-agent runs on this node; the runtime will retry",
            )
        }
        Code::ResourceExhausted => CniError::new(
            code::AGENT_REFUSED,
            format!("{what}: {}", s.message()),
            "the IP pools are full: add a pool or delete unused pods",
        ),
        _ => CniError::new(
            code::AGENT_REFUSED,
            format!("calix-agent refused {what}: {}", s.message()),
            "",
        ),
    }
}
