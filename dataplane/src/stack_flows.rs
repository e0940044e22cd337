//! Upkeep of the stack-flow table (`CALIX_STACK_FLOWS`; the programs fill it, see
//! `ebpf/programs/src/flows.rs`). The table is a plain hash, so nothing leaves it unless the
//! agent removes it: an entry goes once the host's conntrack would have forgotten its flow
//! (the host's own timeouts, read at every pass), and an endpoint's overflow mark (a flow of
//! it found the table full) is cleared once every flow it could have missed would have been
//! forgotten too. Until then that endpoint's traffic goes through the host stack: the safe
//! side, since only the stack can undo its own NAT.
use std::path::Path;
use std::time::Duration;

use aya::maps::{Array, HashMap, MapData};
use calix_common::{
    EndpointInfo, FlowKey, StackFlow, ENDPOINTS_MAP, IPPROTO_TCP, IPPROTO_UDP, SF_CLOSING,
    STACK_CLEARED_MAP, STACK_FLOWS_MAP, STACK_OVERFLOW_MAP,
};

use super::bpf::{open_array, open_hash};
use super::DataplaneError;

/// Where the host's conntrack timeouts are (per network namespace).
pub const NETFILTER_SYSCTLS: &str = "/proc/sys/net/netfilter";

/// Slack on top of the host's timeouts: the programs refresh an entry's time at most once a
/// second, so its recorded last use may be up to that much early.
const MARGIN: Duration = Duration::from_secs(2);

/// How long the host's conntrack keeps an idle flow, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTimeouts {
    pub tcp_established: Duration,
    /// TCP after a FIN or RST (the longest of TIME_WAIT, FIN_WAIT, CLOSE_WAIT).
    pub tcp_closing: Duration,
    pub udp: Duration,
    pub icmp: Duration,
    pub other: Duration,
}

impl Default for HostTimeouts {
    /// The kernel's defaults (used where nf_conntrack is not loaded: it may be later).
    fn default() -> Self {
        let s = Duration::from_secs;
        Self {
            tcp_established: s(432_000),
            tcp_closing: s(120),
            udp: s(120),
            icmp: s(30),
            other: s(600),
        }
    }
}

impl HostTimeouts {
    /// Reads `nf_conntrack_*_timeout*` from `dir` ([`NETFILTER_SYSCTLS`]); the default for
    /// any that cannot be read.
    pub fn read(dir: &Path) -> Self {
        let d = Self::default();
        let get = |name: &str, default: Duration| {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(default, Duration::from_secs)
        };
        let closing = [
            "nf_conntrack_tcp_timeout_time_wait",
            "nf_conntrack_tcp_timeout_fin_wait",
            "nf_conntrack_tcp_timeout_close_wait",
        ]
        .iter()
        .map(|n| get(n, d.tcp_closing))
        .max()
        .unwrap_or(d.tcp_closing);
        Self {
            tcp_established: get("nf_conntrack_tcp_timeout_established", d.tcp_established),
            tcp_closing: closing,
            udp: get("nf_conntrack_udp_timeout_stream", d.udp),
            icmp: get("nf_conntrack_icmp_timeout", d.icmp),
            other: get("nf_conntrack_generic_timeout", d.other),
        }
    }

    /// How long a flow of `proto` (closing: a FIN or RST seen) may stay idle.
    pub fn for_flow(&self, proto: u8, closing: bool) -> Duration {
        let t = match proto {
            IPPROTO_TCP if closing => self.tcp_closing,
            IPPROTO_TCP => self.tcp_established,
            IPPROTO_UDP => self.udp,
            1 | 58 => self.icmp,
            _ => self.other,
        };
        t + MARGIN
    }

    /// The longest any flow may stay idle: how long an overflow mark must stand.
    pub fn longest(&self) -> Duration {
        [
            self.tcp_established,
            self.tcp_closing,
            self.udp,
            self.icmp,
            self.other,
        ]
        .into_iter()
        .max()
        .unwrap_or_default()
            + MARGIN
    }
}

/// Which entries of `flows` the host has forgotten at `now_ns`.
pub fn forgotten(
    flows: impl IntoIterator<Item = (FlowKey, StackFlow)>,
    t: &HostTimeouts,
    now_ns: u64,
) -> Vec<FlowKey> {
    flows
        .into_iter()
        .filter(|(k, f)| {
            let idle = Duration::from_nanos(now_ns.saturating_sub(f.last_seen_ns));
            idle > t.for_flow(k.proto, f.flags & SF_CLOSING != 0)
        })
        .map(|(k, _)| k)
        .collect()
}

/// Whether the overflow mark `mark` (`calix_common::stack_overflow_mark`) may be cleared at
/// `now_ns`: every flow it stands for would be forgotten by the host by now.
pub fn mark_expired(mark: u32, t: &HostTimeouts, now_ns: u64) -> bool {
    let marked_at = Duration::from_secs(u64::from(mark.saturating_sub(1)));
    Duration::from_nanos(now_ns).saturating_sub(marked_at) > t.longest()
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StackPass {
    pub removed: usize,
    /// Overflow marks cleared.
    pub cleared: usize,
    /// Endpoints (host veth ifindex) whose overflow mark stands: their traffic takes the
    /// host stack.
    pub overflowing: Vec<u32>,
}

/// The pinned stack-flow maps (and the endpoints, for their slots), opened by path.
pub struct StackFlows {
    flows: HashMap<MapData, FlowKey, StackFlow>,
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    overflow: Array<MapData, u32>,
    cleared: Array<MapData, u32>,
}

impl StackFlows {
    /// Opens the maps pinned in `pin_dir` (the layout directory).
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        Ok(Self {
            flows: open_hash(pin_dir, STACK_FLOWS_MAP)?,
            endpoints: open_hash(pin_dir, ENDPOINTS_MAP)?,
            overflow: open_array(pin_dir, STACK_OVERFLOW_MAP)?,
            cleared: open_array(pin_dir, STACK_CLEARED_MAP)?,
        })
    }

    /// Removes the entries the host has forgotten and clears the overflow marks that have
    /// stood long enough (by writing them to `CALIX_STACK_CLEARED`: the programs' newer
    /// marks are never overwritten).
    pub fn clean(&mut self, t: &HostTimeouts, now_ns: u64) -> StackPass {
        let entries: Vec<(FlowKey, StackFlow)> = self.flows.iter().filter_map(Result::ok).collect();
        let mut pass = StackPass::default();
        for k in forgotten(entries, t, now_ns) {
            // Refreshed meanwhile? Then it stays.
            let still = self
                .flows
                .get(&k, 0)
                .is_ok_and(|f| forgotten([(k, f)], t, now_ns).len() == 1);
            if still && self.flows.remove(&k).is_ok() {
                pass.removed += 1;
            }
        }
        // The endpoints' slots: only slots in use can hold a mark that matters.
        let mut slots: Vec<(u32, u32)> = self
            .endpoints
            .iter()
            .filter_map(Result::ok)
            .map(|(ifindex, info)| (ifindex, info.slot))
            .collect();
        slots.sort_unstable();
        for (ifindex, slot) in slots {
            let mark = self.overflow.get(&slot, 0).unwrap_or(0);
            if mark == 0 || self.cleared.get(&slot, 0).ok() == Some(mark) {
                continue;
            }
            if mark_expired(mark, t, now_ns) {
                if self.cleared.set(slot, mark, 0).is_ok() {
                    pass.cleared += 1;
                }
            } else {
                pass.overflowing.push(ifindex);
            }
        }
        pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn key(proto: u8, port: u16) -> FlowKey {
        FlowKey {
            proto,
            pod_port: port,
            family: 4,
            ..FlowKey::default()
        }
    }

    fn flow(last: u64, flags: u32) -> StackFlow {
        StackFlow {
            last_seen_ns: last,
            flags,
            _pad: 0,
        }
    }

    #[test]
    fn entries_go_when_the_host_has_forgotten_them() {
        let t = HostTimeouts {
            tcp_established: Duration::from_secs(1000),
            tcp_closing: Duration::from_secs(100),
            udp: Duration::from_secs(30),
            icmp: Duration::from_secs(10),
            other: Duration::from_secs(600),
        };
        let now = 2000 * S;
        let gone = forgotten(
            [
                (key(IPPROTO_TCP, 1), flow(now - 500 * S, 0)),
                (key(IPPROTO_TCP, 2), flow(now - 500 * S, SF_CLOSING)),
                (key(IPPROTO_UDP, 3), flow(now - 31 * S, 0)),
                (key(IPPROTO_UDP, 4), flow(now - 33 * S, 0)),
                (key(1, 5), flow(now - 13 * S, 0)),
            ],
            &t,
            now,
        );
        let ports: Vec<u16> = gone.iter().map(|k| k.pod_port).collect();
        assert_eq!(ports, [2, 4, 5], "a 2 s margin over the host's timeouts");
        // An overflow mark stands for the longest timeout, plus the margin.
        let mark = calix_common::stack_overflow_mark(100 * S);
        assert!(!mark_expired(mark, &t, 1101 * S));
        assert!(mark_expired(mark, &t, 1103 * S));
    }

    #[test]
    fn timeouts_are_read_from_the_host_or_default() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("nf_conntrack_tcp_timeout_established"),
            "86400\n",
        )
        .expect("write");
        std::fs::write(dir.path().join("nf_conntrack_tcp_timeout_time_wait"), "240").expect("w");
        std::fs::write(dir.path().join("nf_conntrack_udp_timeout_stream"), "junk").expect("w");
        let t = HostTimeouts::read(dir.path());
        assert_eq!(t.tcp_established, Duration::from_secs(86_400));
        assert_eq!(t.tcp_closing, Duration::from_secs(240));
        assert_eq!(
            t.udp,
            HostTimeouts::default().udp,
            "unreadable: the default"
        );
        assert_eq!(t.longest(), Duration::from_secs(86_402));
    }
}
