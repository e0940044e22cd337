//! `calix.v1.ServicesInfo`: the Services calculation's report for calixctl.
use std::sync::Arc;

use calix_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::services::ServicesService;

/// The Services calculation's report for calixctl (`None`: `[services]` is off).
pub struct ServicesInfoSvc {
    pub services: Option<Arc<ServicesService>>,
}

#[tonic::async_trait]
impl pb::services_info_server::ServicesInfo for ServicesInfoSvc {
    async fn show(
        &self,
        req: Request<pb::ServicesInfoRequest>,
    ) -> Result<Response<pb::ServicesInfoResponse>, Status> {
        let Some(services) = &self.services else {
            return Ok(Response::new(pb::ServicesInfoResponse {
                json: String::new(),
            }));
        };
        let only = req.into_inner().service;
        let report = services.report((!only.is_empty()).then_some(only.as_str()));
        serde_json::to_string(&report)
            .map(|json| Response::new(pb::ServicesInfoResponse { json }))
            .map_err(|e| Status::internal(format!("cannot encode the report: {e}")))
    }
}
