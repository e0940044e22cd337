//! GC (CNI 1.1): releases every calix allocation and endpoint of this network whose
//! (containerID, ifname) is not in `cni.dev/valid-attachments` (or the older
//! `cni.dev/attachments`), deletes the stale endpoints' veths, and passes GC on to a
//! delegated IPAM plugin.
use calix_proto::v1 as pb;

use super::{wiring, Invocation};
use crate::client::{call_error, AgentClient};
use crate::error::{code, CniError};
use crate::ipam;
use crate::kernel::NodeKernel;
use calix_kernel::{netns, pod};

pub async fn run(inv: &Invocation<'_>) -> Result<(), CniError> {
    let conf = inv.conf;
    let valid = conf.gc_attachments().ok_or_else(|| {
        CniError::new(
            code::INVALID_CONFIG,
            "GC needs cni.dev/valid-attachments",
            "the runtime must list the attachments that are still in use",
        )
    })?;
    let mut agent = AgentClient::connect(&conf.agent_socket()).await?;
    let resp = agent
        .ipam
        .gc(pb::GcRequest {
            network: conf.name.clone(),
            valid: valid
                .iter()
                .map(|a| pb::Attachment {
                    container_id: a.container_id.clone(),
                    ifname: a.ifname.clone(),
                })
                .collect(),
        })
        .await
        .map_err(|s| call_error("garbage collection", s))?
        .into_inner();
    let host = netns::netlink_here()
        .await
        .map_err(|e| wiring("cannot open netlink in the host namespace".into(), &e))?;
    let mut kernel = NodeKernel::new(host, None);
    for st in &resp.stale {
        let owner = pod::owner_alias(&st.container_id, &st.ifname);
        match super::delete_owned_link(&mut kernel, &st.host_ifname, &owner).await {
            Ok(true) => tracing::info!(name = %st.host_ifname, "GC: deleted stale veth"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(name = %st.host_ifname, error = %e, "GC: cannot delete stale veth")
            }
        }
    }
    for a in &resp.released {
        tracing::info!(address = %a, "GC: released");
    }
    if !conf.agent_ipam() {
        // Reference IPAM plugins before CNI 1.1 do not know GC: not our failure.
        if let Err(e) = ipam::exec_plugin(inv.env, &conf.ipam.ipam_type, "GC", inv.raw) {
            tracing::warn!(error = %e, "delegated IPAM GC failed");
        }
    }
    Ok(())
}
