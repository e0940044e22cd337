//! `calix.v1.BgpInfo`: the BGP speaker's report for calixctl.
use std::sync::Arc;

use calix_proto::v1 as pb;
use tonic::{Request, Response, Status};

/// The BGP speaker's report for calixctl (`None`: `bgp.enabled = false`).
pub struct BgpInfoSvc {
    pub bgp: Option<Arc<crate::bgp::speaker::BgpHandle>>,
}

#[tonic::async_trait]
impl pb::bgp_info_server::BgpInfo for BgpInfoSvc {
    async fn show(
        &self,
        _req: Request<pb::BgpInfoRequest>,
    ) -> Result<Response<pb::BgpInfoResponse>, Status> {
        let Some(bgp) = &self.bgp else {
            return Ok(Response::new(pb::BgpInfoResponse {
                json: String::new(),
            }));
        };
        let report = bgp
            .report()
            .await
            .ok_or_else(|| Status::unavailable("the BGP speaker is not running"))?;
        serde_json::to_string(&report)
            .map(|json| Response::new(pb::BgpInfoResponse { json }))
            .map_err(|e| Status::internal(format!("cannot encode the report: {e}")))
    }
}
