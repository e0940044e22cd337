//! The plugin's connection to calix-agent: bounded in time, errors mapped to CNI codes. The
//! verbs call the agent through [`Agent`], so their sequence is unit-tested against a fake.
use std::path::Path;
use std::time::Duration;

use calix_proto::v1 as pb;
use tonic::transport::Channel;
use tonic::Status;

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
        .map_err(|e| unreachable_err(socket, &calix_log::error_chain(&e)))?;
        Ok(Self {
            ipam: pb::ipam_client::IpamClient::new(channel.clone()),
            endpoints: pb::endpoints_client::EndpointsClient::new(channel),
        })
    }
}

/// What the plugin asks of calix-agent (its IPAM and its endpoint registry), one method per
/// call. [`AgentClient`] is the real one (gRPC over the agent's unix socket).
///
/// `async fn` in a public trait cannot promise `Send` futures; the plugin runs on a
/// current-thread runtime and never needs them to be.
#[allow(async_fn_in_trait)]
pub trait Agent {
    async fn allocate(&mut self, r: pb::AllocateRequest) -> Result<pb::AllocateResponse, Status>;
    async fn release(&mut self, r: pb::ReleaseRequest) -> Result<pb::ReleaseResponse, Status>;
    async fn lookup(&mut self, r: pb::LookupRequest) -> Result<pb::LookupResponse, Status>;
    async fn register(&mut self, r: pb::RegisterRequest) -> Result<pb::RegisterResponse, Status>;
    async fn unregister(
        &mut self,
        r: pb::UnregisterRequest,
    ) -> Result<pb::UnregisterResponse, Status>;
}

impl Agent for AgentClient {
    async fn allocate(&mut self, r: pb::AllocateRequest) -> Result<pb::AllocateResponse, Status> {
        self.ipam.allocate(r).await.map(tonic::Response::into_inner)
    }

    async fn release(&mut self, r: pb::ReleaseRequest) -> Result<pb::ReleaseResponse, Status> {
        self.ipam.release(r).await.map(tonic::Response::into_inner)
    }

    async fn lookup(&mut self, r: pb::LookupRequest) -> Result<pb::LookupResponse, Status> {
        self.ipam.lookup(r).await.map(tonic::Response::into_inner)
    }

    async fn register(&mut self, r: pb::RegisterRequest) -> Result<pb::RegisterResponse, Status> {
        self.endpoints
            .register(r)
            .await
            .map(tonic::Response::into_inner)
    }

    async fn unregister(
        &mut self,
        r: pb::UnregisterRequest,
    ) -> Result<pb::UnregisterResponse, Status> {
        self.endpoints
            .unregister(r)
            .await
            .map(tonic::Response::into_inner)
    }
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
pub fn call_error(what: &str, s: Status) -> CniError {
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

/// Maps a refused address allocation: [`call_error`], with what to do in `details` (the
/// message names the annotation, the pool and the rule).
pub fn allocation_error(s: Status) -> CniError {
    use tonic::Code;
    let todo = match s.code() {
        Code::InvalidArgument => {
            "fix the pod's calix.dev/ipv4pools, ipv6pools or ipAddrs annotation (or its \
             namespace's) and create the pod again: retries fail the same way"
        }
        Code::FailedPrecondition => {
            "the pools this pod's namespace may use cannot give it that: choose another address \
             or pool, or have the IPPools (namespaceSelector, nodeSelector, disabled) changed"
        }
        Code::AlreadyExists => {
            "the address is taken: choose another address, or release it (calixctl ipam show)"
        }
        _ => "",
    };
    let mut e = call_error("the address allocation", s);
    if e.details.is_empty() {
        e.details = todo.to_string();
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_allocation_says_what_was_refused_and_what_to_do() {
        let annotation = "annotation calix.dev/ipAddrs on pod shop/web: 10.1.0.9 is in pool \
                          blue (10.1.0.0/16), which does not serve namespace shop";
        for (status, todo) in [
            (tonic::Status::invalid_argument(annotation), "annotation"),
            (
                tonic::Status::failed_precondition(
                    "pod shop/web: no IPv6 pool of this node serves namespace shop: ...",
                ),
                "IPPools",
            ),
            (
                tonic::Status::already_exists("requested address 10.1.0.9 is already in use"),
                "another address",
            ),
        ] {
            let said = status.message().to_string();
            let e = allocation_error(status);
            assert_eq!(e.code, code::AGENT_REFUSED, "{e}");
            assert!(e.msg.contains(&said), "{e}");
            assert!(e.details.contains(todo), "{e}");
        }
        // Unreachable stays "try again".
        let e = allocation_error(tonic::Status::unavailable("down"));
        assert_eq!(e.code, code::TRY_AGAIN);
    }
}
