//! `calix.v1.Routes/Verdict`, the asking side: `calixctl trace` on one node asks the node a
//! traced pod lives on for that pod's policy verdict from its live maps. The node is found in
//! route distribution's view (the block holding the address, and who allocated it there), and
//! dialed as a follower dials its peer (TLS naming that node, from this node's address).
use std::net::IpAddr;
use std::time::Duration;

use calix_core::routes::view::View;
use calix_proto::v1 as pb;

use super::client::{self, Dialer, PeerChannel};

/// How long the whole call may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The node holding `ip` (the node that allocated it, else its block's) and where it serves
/// the Routes service; `None`: no block holds it, or its node announces no endpoint.
pub fn locate(view: &View, ip: IpAddr) -> Option<(String, String)> {
    let (_, block) = view.block_of(ip)?;
    let node = block
        .allocations
        .get(&ip)
        .filter(|n| !n.is_empty())
        .unwrap_or(&block.affinity);
    if node.is_empty() {
        return None;
    }
    let endpoint = &view.node(node)?.record.routes_endpoint;
    (!endpoint.is_empty()).then(|| (node.clone(), endpoint.clone()))
}

/// Asks `node` at `endpoint` for the verdict `req` describes; the step as JSON.
pub async fn ask(
    dialer: &Dialer,
    node: &str,
    endpoint: &str,
    req: pb::VerdictRequest,
) -> Result<String, String> {
    let call = async {
        let channel = client::connect(node, endpoint, dialer)
            .await
            .map_err(|e| format!("cannot connect: {}", calix_log::error_chain(&e)))?;
        unary(channel, req)
            .await
            .map(|r| r.into_inner().json)
            .map_err(|s| format!("{}: {}", s.code(), s.message()))
    };
    tokio::time::timeout(TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {TIMEOUT:?}"))?
}

async fn unary(
    channel: PeerChannel,
    req: pb::VerdictRequest,
) -> Result<tonic::Response<pb::VerdictResponse>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(calix_log::error_chain(&e)))?;
    let mut req = tonic::Request::new(req);
    req.extensions_mut()
        .insert(tonic::GrpcMethod::new("calix.v1.Routes", "Verdict"));
    grpc.unary(
        req,
        http::uri::PathAndQuery::from_static("/calix.v1.Routes/Verdict"),
        tonic_prost::ProstCodec::default(),
    )
    .await
}
