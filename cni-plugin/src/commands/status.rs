//! STATUS (CNI 1.1): whether ADDs can be served. The agent unreachable is code 51 (no new pods;
//! and without the agent, existing pods' dataplane and routes are not maintained); no free
//! address in any pool of a wanted family is code 50 (no new pods).
use calix_proto::v1 as pb;

use super::Invocation;
use crate::client::AgentClient;
use crate::error::{code, CniError};

pub async fn run(inv: &Invocation<'_>) -> Result<(), CniError> {
    let conf = inv.conf;
    let mut agent = AgentClient::connect(&conf.agent_socket())
        .await
        .map_err(|e| CniError::new(code::PLUGIN_NOT_AVAILABLE_LIMITED, e.msg, e.details))?;
    let st = agent
        .ipam
        .status(pb::StatusRequest {})
        .await
        .map_err(|s| {
            CniError::new(
                code::PLUGIN_NOT_AVAILABLE_LIMITED,
                format!("calix-agent did not answer STATUS: {}", s.message()),
                "check calix-agent on this node",
            )
        })?
        .into_inner();
    if !conf.agent_ipam() {
        return Ok(());
    }
    let (v4, v6) = conf.ipam.families()?;
    let short: Vec<&str> = [(v4, st.free_v4, "IPv4"), (v6, st.free_v6, "IPv6")]
        .into_iter()
        .filter(|(want, free, _)| *want && *free == 0)
        .map(|(_, _, f)| f)
        .collect();
    if !short.is_empty() {
        return Err(CniError::new(
            code::PLUGIN_NOT_AVAILABLE,
            format!(
                "no free {} address on node {} (pools: {})",
                short.join("/"),
                st.node,
                st.pools.join(", ")
            ),
            "add a pool or free addresses (calixctl endpoints)",
        ));
    }
    Ok(())
}
