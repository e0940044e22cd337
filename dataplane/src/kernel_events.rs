//! Kernel mode's drop events: the packets an endpoint's policy chain drops are logged to
//! [`kernel_policy::LOG_GROUP`] (within a rate per chain, see `kernel_policy`), read here as
//! the eBPF dataplane's events are (`calixctl monitor --drops`).
use std::os::fd::{AsRawFd, RawFd};

use calix_common::{FlowKey, PolicyDropEvent, DENIED_NO_RULE, POL_DIR_EGRESS, POL_DIR_INGRESS};
use calix_kernel::nft::{LogListener, Logged};

use crate::kernel_policy::{self, LOG_GROUP, LOG_SNAPLEN};
use crate::DataplaneError;

const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

/// The listener of the policy chains' log group, in the agent's network namespace.
#[derive(Debug)]
pub struct KernelDrops {
    listener: LogListener,
}

impl KernelDrops {
    /// Binds the log group (another listener of it in this namespace: `EBUSY`).
    pub fn open() -> Result<Self, DataplaneError> {
        LogListener::bind(LOG_GROUP, LOG_SNAPLEN)
            .map(|listener| Self { listener })
            .map_err(|source| DataplaneError::Nflog {
                group: LOG_GROUP,
                source,
            })
    }

    /// The drops logged since the last call, each with its endpoint's host veth (never
    /// waits). The events' time is left 0: the caller stamps them.
    pub fn drain(&mut self) -> Result<Vec<(String, PolicyDropEvent)>, DataplaneError> {
        let logged = self
            .listener
            .drain()
            .map_err(|source| DataplaneError::Nflog {
                group: LOG_GROUP,
                source,
            })?;
        Ok(logged.iter().filter_map(event).collect())
    }

    /// How often the kernel could not queue a drop for this listener.
    pub fn lost(&self) -> u64 {
        self.listener.lost()
    }
}

impl AsRawFd for KernelDrops {
    fn as_raw_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }
}

/// A logged packet as a drop event of its endpoint; `None`: not one of the policy table's, or
/// not IP.
fn event(l: &Logged) -> Option<(String, PolicyDropEvent)> {
    let drop = kernel_policy::logged_drop(&l.prefix)?;
    let flow = flow_of(l.family, &l.payload, drop.pod_is_src)?;
    let e = PolicyDropEvent {
        flow,
        dir: if drop.ingress {
            POL_DIR_INGRESS
        } else {
            POL_DIR_EGRESS
        },
        why: DENIED_NO_RULE,
        ..PolicyDropEvent::default()
    };
    Some((drop.ifname, e))
}

/// The flow of an IP packet (from its network header), seen from the pod (`pod_is_src`: the
/// pod sent it): ports (network order) for TCP, UDP and SCTP, the identifier of an ICMP echo
/// (as the eBPF dataplane keys it); none for fragments and IPv6 behind extension headers.
pub fn flow_of(family: u8, p: &[u8], pod_is_src: bool) -> Option<FlowKey> {
    let mut k = FlowKey::default();
    let (src, dst, l4) = match family {
        NFPROTO_IPV4 if p.len() >= 20 && p[0] >> 4 == 4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            k.family = 4;
            k.proto = p[9];
            let fragment = u16::from_be_bytes([p[6], p[7]]) & 0x3fff != 0;
            let l4 = (!fragment && ihl >= 20).then(|| p.get(ihl..)).flatten();
            (&p[12..16], &p[16..20], l4)
        }
        NFPROTO_IPV6 if p.len() >= 40 && p[0] >> 4 == 6 => {
            k.family = 6;
            k.proto = p[6];
            (&p[8..24], &p[24..40], p.get(40..))
        }
        _ => return None,
    };
    let (pod, peer) = if pod_is_src { (src, dst) } else { (dst, src) };
    k.pod[..pod.len()].copy_from_slice(pod);
    k.peer[..peer.len()].copy_from_slice(peer);
    let ports = match (k.proto, l4) {
        (6 | 17 | 132, Some(l4)) if l4.len() >= 4 => Some((
            u16::from_ne_bytes([l4[0], l4[1]]),
            u16::from_ne_bytes([l4[2], l4[3]]),
        )),
        (1 | 58, Some(l4)) if l4.len() >= 6 => {
            let id = u16::from_ne_bytes([l4[4], l4[5]]);
            Some((id, id))
        }
        _ => None,
    };
    if let Some((sport, dport)) = ports {
        (k.pod_port, k.peer_port) = if pod_is_src {
            (sport, dport)
        } else {
            (dport, sport)
        };
    }
    Some(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(proto: u8, frag: [u8; 2], l4: &[u8]) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 0, 0, 0, frag[0], frag[1], 64, proto, 0, 0];
        p.extend_from_slice(&[10, 0, 0, 5, 10, 0, 1, 9]);
        p.extend_from_slice(l4);
        p
    }

    #[test]
    fn a_logged_packet_reads_as_its_flow_seen_from_the_pod() {
        // TCP 10.0.0.5:43210 -> 10.0.1.9:80, sent by the pod.
        let tcp = v4(6, [0x40, 0], &[0xa8, 0xca, 0, 80, 0, 0, 0, 0]);
        let k = flow_of(NFPROTO_IPV4, &tcp, true).expect("a flow");
        assert_eq!((k.family, k.proto), (4, 6));
        assert_eq!(&k.pod[..4], &[10, 0, 0, 5]);
        assert_eq!(&k.peer[..4], &[10, 0, 1, 9]);
        assert_eq!(
            (u16::from_be(k.pod_port), u16::from_be(k.peer_port)),
            (43210, 80)
        );
        // The same packet sent to the pod: the ends swap.
        let k = flow_of(NFPROTO_IPV4, &tcp, false).expect("a flow");
        assert_eq!(&k.pod[..4], &[10, 0, 1, 9]);
        assert_eq!(u16::from_be(k.pod_port), 80);
        // A later fragment: addresses, no ports.
        let frag = v4(17, [0x00, 0x10], &[0, 53, 0, 53]);
        let k = flow_of(NFPROTO_IPV4, &frag, true).expect("a flow");
        assert_eq!((k.proto, k.pod_port, k.peer_port), (17, 0, 0));
        // IPv6 UDP.
        let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        v6.extend_from_slice(&[0xfd; 16]);
        v6.extend_from_slice(&[0xfe; 16]);
        v6.extend_from_slice(&[0x30, 0x39, 0, 53, 0, 8, 0, 0]);
        let k = flow_of(NFPROTO_IPV6, &v6, false).expect("a flow");
        assert_eq!((k.family, k.proto), (6, 17));
        assert_eq!(k.pod, [0xfe; 16]);
        assert_eq!(
            (u16::from_be(k.pod_port), u16::from_be(k.peer_port)),
            (53, 12345)
        );
        // Not IP, or cut short: nothing.
        assert!(flow_of(NFPROTO_IPV4, &tcp[..19], true).is_none());
        assert!(flow_of(NFPROTO_IPV6, &tcp, true).is_none());
        assert!(flow_of(7, &tcp, true).is_none());
        // Short transport headers: no ports, no panic.
        let short = v4(6, [0, 0], &[1]);
        let k = flow_of(NFPROTO_IPV4, &short, true).expect("a flow");
        assert_eq!((k.pod_port, k.peer_port), (0, 0));
    }

    #[test]
    fn only_the_policy_tables_prefixes_are_events() {
        let tcp = v4(6, [0, 0], &[0, 1, 0, 2]);
        let logged = |prefix: &str| Logged {
            family: NFPROTO_IPV4,
            prefix: prefix.into(),
            payload: tcp.clone(),
        };
        let (ifname, e) = event(&logged("calix-policy cali7_eg_r")).expect("an event");
        assert_eq!(ifname, "cali7");
        assert_eq!(e.dir, POL_DIR_EGRESS);
        assert_eq!(&e.flow.pod[..4], &[10, 0, 1, 9], "sent to the pod");
        assert!(event(&logged("someone else's")).is_none());
    }
}
