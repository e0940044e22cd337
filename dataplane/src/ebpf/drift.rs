//! How an endpoint's or uplink's attachments differ from what the agent attached: a tcx link
//! or a cls_bpf filter runs calix's program in each direction.
use aya::programs::tc::TcAttachType;
use calix_kernel::host::HostKernel;

use super::EbpfDataplane;
use crate::tcx::{self, Attachment, TC_HANDLE, TC_PRIORITY};
use crate::{DataplaneError, Drift};

/// How calix's ingress and egress filters among `filters` differ from running the programs
/// `(ingress, egress)`.
fn filter_drift(filters: &[calix_kernel::netlink::BpfFilter], ids: (u32, u32)) -> Vec<Drift> {
    let mut drift = Vec::new();
    for (ingress, want) in [(true, ids.0), (false, ids.1)] {
        let ours = filters
            .iter()
            .find(|f| f.ingress == ingress && f.priority == TC_PRIORITY && f.handle == TC_HANDLE);
        match ours {
            Some(f) if f.prog_id == want => {}
            other => drift.push(Drift::Filter {
                ingress,
                found: other.map(|f| f.prog_id),
            }),
        }
    }
    drift
}

impl EbpfDataplane {
    /// How calix's attachments on `ifname` (link `index`) differ from running the programs
    /// `ids` (ingress, egress): a tcx link or a cls_bpf filter runs each (a hook moving to tcx
    /// has the filter until the move); a filter only, with `tc_attach = "tc"`.
    pub(super) fn attachment_drift(
        &self,
        ifname: &str,
        index: u32,
        ids: (u32, u32),
        kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        let filters = kernel
            .bpf_filters(index)
            .map_err(|source| DataplaneError::Kernel {
                what: format!("the tc filters of {ifname}"),
                source: Box::new(source),
            })?;
        let mut drift = filter_drift(&filters, ids);
        if self.attacher.how() == Attachment::Tcx && !drift.is_empty() {
            let on_link = |at: TcAttachType, want: u32| {
                tcx::programs(ifname, at)
                    .map(|progs| progs.contains(&want))
                    .map_err(|e| DataplaneError::Program {
                        name: "tcx",
                        op: "query",
                        source: Box::new(e),
                    })
            };
            let (ingress, egress) = (
                on_link(TcAttachType::Ingress, ids.0)?,
                on_link(TcAttachType::Egress, ids.1)?,
            );
            drift.retain(|d| match d {
                Drift::Filter { ingress: true, .. } => !ingress,
                Drift::Filter { ingress: false, .. } => !egress,
                _ => true,
            });
        }
        Ok(drift)
    }
}
