//! Types shared by the calix eBPF programs (kernel side, `no_std`) and the agent (user side).
//!
//! Every map key and value is `#[repr(C)]` with no implicit padding, so both sides agree on the
//! layout byte for byte; `tests` below pin each size.
#![no_std]

/// Per-CPU hash map: host-side ifindex of a `cali*` veth → [`EndpointCounters`].
/// The agent inserts the entry when an endpoint is registered and removes it when the endpoint
/// goes away; the programs only update entries that exist.
pub const COUNTERS_MAP: &str = "CALIX_COUNTERS";
/// Maximum number of endpoints the counters map can hold on one node.
pub const MAX_ENDPOINTS: u32 = 16_384;

/// tc ingress on each host-side `cali*` veth: traffic the pod sends.
pub const PROG_FROM_POD: &str = "from_pod";
/// tc egress on each host-side `cali*` veth: traffic delivered to the pod.
pub const PROG_TO_POD: &str = "to_pod";

/// Packet and byte counters of one endpoint, seen from the host side of its veth.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    /// Packets the pod sent (tc ingress on the host veth).
    pub from_pod_packets: u64,
    pub from_pod_bytes: u64,
    /// Packets delivered to the pod (tc egress on the host veth).
    pub to_pod_packets: u64,
    pub to_pod_bytes: u64,
}

impl EndpointCounters {
    /// Adds `other` into `self` (used to sum the per-CPU values).
    pub fn accumulate(&mut self, other: &EndpointCounters) {
        self.from_pod_packets = self.from_pod_packets.wrapping_add(other.from_pod_packets);
        self.from_pod_bytes = self.from_pod_bytes.wrapping_add(other.from_pod_bytes);
        self.to_pod_packets = self.to_pod_packets.wrapping_add(other.to_pod_packets);
        self.to_pod_bytes = self.to_pod_bytes.wrapping_add(other.to_pod_bytes);
    }
}

#[cfg(feature = "user")]
// SAFETY: plain old data, `#[repr(C)]`, no padding, every bit pattern valid.
unsafe impl aya::Pod for EndpointCounters {}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(size_of::<EndpointCounters>(), 32);
    }

    #[test]
    fn accumulate_adds_every_field() {
        let mut a = EndpointCounters {
            from_pod_packets: 1,
            from_pod_bytes: 2,
            to_pod_packets: 3,
            to_pod_bytes: 4,
        };
        a.accumulate(&a.clone());
        assert_eq!(
            a,
            EndpointCounters {
                from_pod_packets: 2,
                from_pod_bytes: 4,
                to_pod_packets: 6,
                to_pod_bytes: 8
            }
        );
    }
}
