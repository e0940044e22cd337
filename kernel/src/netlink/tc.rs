//! The BPF classifier filters on a link's clsact hooks, read.
use futures::TryStreamExt;
use rtnetlink::Handle;

use super::{errno, NetlinkError};

/// A BPF classifier (tc) filter on an interface's clsact hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpfFilter {
    /// Ingress (`true`) or egress.
    pub ingress: bool,
    pub priority: u16,
    /// The filter's handle (`tcm_handle`).
    pub handle: u32,
    /// The program it runs (`TCA_BPF_ID`).
    pub prog_id: u32,
    /// `TCA_BPF_NAME`.
    pub name: String,
}

/// The BPF filters on interface `ifindex`'s clsact ingress and egress hooks (none without the
/// qdisc).
pub async fn bpf_filters(handle: &Handle, ifindex: u32) -> Result<Vec<BpfFilter>, NetlinkError> {
    use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
    let mut out = Vec::new();
    for ingress in [true, false] {
        let index =
            i32::try_from(ifindex).map_err(|_| NetlinkError::IndexNotFound { index: ifindex })?;
        let mut request = handle.traffic_filter(index).get();
        request = if ingress {
            request.ingress()
        } else {
            request.egress()
        };
        let messages: Vec<_> = match request.execute().try_collect().await {
            Ok(m) => m,
            // No such device, or no clsact qdisc: no filters.
            Err(e) if matches!(errno(&e), Some(libc::ENODEV | libc::EINVAL | libc::ENOENT)) => {
                Vec::new()
            }
            Err(source) => {
                return Err(NetlinkError::Netlink {
                    op: "list tc filters",
                    target: format!("interface {ifindex}"),
                    source,
                })
            }
        };
        for m in messages {
            let mut prog_id = None;
            let mut name = String::new();
            for a in &m.attributes {
                if let TcAttribute::Options(opts) = a {
                    for o in opts {
                        match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => prog_id = Some(*id),
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = n.clone(),
                            _ => {}
                        }
                    }
                }
            }
            if let Some(prog_id) = prog_id {
                out.push(BpfFilter {
                    ingress,
                    // tcm_info: the priority in the upper 16 bits.
                    priority: (m.header.info >> 16) as u16,
                    handle: u32::from(m.header.handle),
                    prog_id,
                    name,
                });
            }
        }
    }
    Ok(out)
}
