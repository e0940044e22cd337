//! `calixctl monitor --drops`: the packets NetworkPolicy denies, as they happen. One task
//! consumes the dataplane's drop events — the eBPF programs' ring (rate-limited by the
//! programs, per CPU), or the packets kernel mode's policy chains log to `nfnetlink_log`
//! (rate-limited per chain) — names each endpoint and peer, and hands the events to every
//! watcher (a broadcast: a slow watcher loses events, and is told how many). With no watcher
//! the events are read and dropped, so nothing holds up the dataplane.
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use calix_common::{
    PolicyDropEvent, DENIED_NO_RULE, DENIED_REVOKED, DENIED_UNREADABLE, POL_DIR_INGRESS,
};
use calix_core::policy::report::DroppedPacket;
use calix_dataplane::ebpf::PolicyEvents;
use calix_dataplane::kernel_events::KernelDrops;
use calix_dataplane::PolicyDrops;
use tokio::io::unix::AsyncFd;
use tokio::sync::broadcast;

use super::PolicyService;
use crate::pod_network::Node;

/// Events kept for a watcher that has not read them yet.
const BACKLOG: usize = 1024;

/// Where watchers subscribe.
#[derive(Clone)]
pub struct DropMonitor {
    tx: broadcast::Sender<Arc<DroppedPacket>>,
}

impl DropMonitor {
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<DroppedPacket>> {
        self.tx.subscribe()
    }
}

/// Starts consuming `events`; the endpoints are named from `node`'s, the peers from
/// `policy`'s view of the cluster.
pub fn spawn(
    events: PolicyDrops,
    node: Arc<Node>,
    policy: Option<Arc<PolicyService>>,
) -> std::io::Result<DropMonitor> {
    let (tx, _) = broadcast::channel(BACKLOG);
    let monitor = DropMonitor { tx: tx.clone() };
    match events {
        PolicyDrops::Ebpf(events) => {
            // SAFETY: the ring's map fd is owned by `events`, open and the same for as long
            // as the `AsyncFd` owns it.
            let fd =
                unsafe { AsyncFd::register_with_interest(events, tokio::io::Interest::READABLE) }
                    .map_err(std::io::Error::from)?;
            tokio::spawn(run_ebpf(fd, node, policy, tx));
        }
        PolicyDrops::Kernel(drops) => {
            // SAFETY: the socket is owned by `drops`, open and the same for as long as the
            // `AsyncFd` owns it.
            let fd =
                unsafe { AsyncFd::register_with_interest(drops, tokio::io::Interest::READABLE) }
                    .map_err(std::io::Error::from)?;
            tokio::spawn(run_kernel(fd, node, policy, tx));
        }
    }
    Ok(monitor)
}

/// Kernel mode: the logged drops, named by their endpoint's host veth; what the kernel could
/// not queue is counted into the next event.
async fn run_kernel(
    mut fd: AsyncFd<KernelDrops>,
    node: Arc<Node>,
    policy: Option<Arc<PolicyService>>,
    tx: broadcast::Sender<Arc<DroppedPacket>>,
) {
    let mut names: HashMap<String, Option<String>> = HashMap::new();
    let mut lost_before = 0;
    loop {
        let mut guard = match fd.readable_mut().await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "policy drop events: cannot wait on the log group; stopped");
                return;
            }
        };
        let batch = guard.get_inner_mut().drain();
        let lost = guard.get_inner().lost();
        guard.clear_ready();
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "policy drop events: reading the log group failed");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if tx.receiver_count() == 0 || batch.is_empty() {
            continue;
        }
        if batch.iter().any(|(i, _)| !names.contains_key(i)) {
            names = node
                .endpoints
                .attached_pods()
                .await
                .into_iter()
                .map(|(_, ifname, pod)| (ifname, pod))
                .collect();
        }
        let clock = Clock::now();
        for (ifname, mut e) in batch {
            e.ktime_ns = clock.mono_ns;
            e.suppressed = u32::try_from(lost - lost_before).unwrap_or(u32::MAX);
            lost_before = lost;
            let pod = names.get(&ifname).cloned().flatten();
            publish(&tx, &policy, describe(&e, &clock), Some(ifname), pod);
        }
    }
}

/// Names the event's endpoint and peer, and hands it to the watchers.
fn publish(
    tx: &broadcast::Sender<Arc<DroppedPacket>>,
    policy: &Option<Arc<PolicyService>>,
    mut d: DroppedPacket,
    interface: Option<String>,
    pod: Option<String>,
) {
    d.interface = interface;
    d.pod = pod;
    d.peer_pod = policy
        .as_ref()
        .and_then(|p| p.pod_with_address(d.peer_address.parse().ok()?));
    let _ = tx.send(Arc::new(d));
}

async fn run_ebpf(
    mut fd: AsyncFd<PolicyEvents>,
    node: Arc<Node>,
    policy: Option<Arc<PolicyService>>,
    tx: broadcast::Sender<Arc<DroppedPacket>>,
) {
    let mut names: HashMap<u32, (String, Option<String>)> = HashMap::new();
    loop {
        let mut guard = match fd.readable_mut().await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "policy drop events: cannot wait on the ring; stopped");
                return;
            }
        };
        let mut batch = Vec::new();
        while let Some(e) = guard.get_inner_mut().next_event() {
            batch.push(e);
        }
        guard.clear_ready();
        if tx.receiver_count() == 0 || batch.is_empty() {
            continue;
        }
        if batch.iter().any(|e| !names.contains_key(&e.slot)) {
            names = node.endpoints.slot_names().await;
        }
        let clock = Clock::now();
        for e in &batch {
            let (interface, pod) = names
                .get(&e.slot)
                .cloned()
                .map_or((None, None), |(i, p)| (Some(i), p));
            publish(&tx, &policy, describe(e, &clock), interface, pod);
        }
    }
}

/// The monotonic (coarse) clock the programs stamp events with, against the wall clock.
struct Clock {
    mono_ns: u64,
    wall: SystemTime,
}

impl Clock {
    fn now() -> Self {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec to write.
        let ok = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) } == 0;
        let mono_ns = if ok {
            (t.tv_sec as u64)
                .saturating_mul(1_000_000_000)
                .saturating_add(t.tv_nsec as u64)
        } else {
            0
        };
        Self {
            mono_ns,
            wall: SystemTime::now(),
        }
    }

    fn wall_of(&self, ktime_ns: u64) -> SystemTime {
        self.wall - Duration::from_nanos(self.mono_ns.saturating_sub(ktime_ns))
    }
}

/// The event as calixctl shows it (the endpoint and peer not named yet).
fn describe(e: &PolicyDropEvent, clock: &Clock) -> DroppedPacket {
    let f = &e.flow;
    let addr = |a: &[u8; 16]| -> IpAddr {
        if f.family == 4 {
            IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
        } else {
            IpAddr::V6(Ipv6Addr::from(*a))
        }
    };
    let ported = matches!(f.proto, 6 | 17 | 132);
    let port = |p: u16| ported.then(|| u16::from_be(p));
    DroppedPacket {
        time: k8s_openapi::jiff::Timestamp::try_from(clock.wall_of(e.ktime_ns))
            .map(|t| format!("{t:.3}"))
            .unwrap_or_default(),
        pod: None,
        interface: None,
        direction: if e.dir == POL_DIR_INGRESS {
            "ingress"
        } else {
            "egress"
        }
        .to_string(),
        protocol: match (f.proto, f.family) {
            (6, _) => "TCP".into(),
            (17, _) => "UDP".into(),
            (132, _) => "SCTP".into(),
            (1, 4) => "ICMP".into(),
            (58, 6) => "ICMPv6".into(),
            (p, _) => p.to_string(),
        },
        pod_address: addr(&f.pod).to_string(),
        pod_port: port(f.pod_port),
        peer_address: addr(&f.peer).to_string(),
        peer_port: port(f.peer_port),
        peer_pod: None,
        why: match e.why {
            DENIED_NO_RULE => "no rule allows it",
            DENIED_REVOKED => "revoked by a policy change",
            DENIED_UNREADABLE => "headers cannot be read",
            _ => "denied",
        }
        .to_string(),
        suppressed: e.suppressed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_common::{FlowKey, POL_DIR_EGRESS};

    #[test]
    fn an_event_reads_as_the_flow_seen_from_the_pod() {
        let mut flow = FlowKey {
            proto: 6,
            family: 4,
            pod_port: 43210u16.to_be(),
            peer_port: 80u16.to_be(),
            ..FlowKey::default()
        };
        flow.pod[..4].copy_from_slice(&[10, 0, 0, 5]);
        flow.peer[..4].copy_from_slice(&[10, 0, 1, 9]);
        let clock = Clock {
            mono_ns: 10_000_000_000,
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000),
        };
        let e = PolicyDropEvent {
            ktime_ns: 9_500_000_000,
            flow,
            slot: 3,
            identity: 0,
            suppressed: 2,
            dir: POL_DIR_EGRESS,
            why: DENIED_NO_RULE,
            _pad: [0; 2],
        };
        let d = describe(&e, &clock);
        assert_eq!(d.time, "1970-01-01T00:16:39.500Z");
        assert_eq!(d.direction, "egress");
        assert_eq!(d.protocol, "TCP");
        assert_eq!(
            (d.pod_address.as_str(), d.pod_port),
            ("10.0.0.5", Some(43210))
        );
        assert_eq!(
            (d.peer_address.as_str(), d.peer_port),
            ("10.0.1.9", Some(80))
        );
        assert_eq!(d.why, "no rule allows it");
        assert_eq!(d.suppressed, 2);
        // ICMP: no ports (the echo identifier is the flow's key, not a port).
        let mut icmp = e;
        icmp.flow.proto = 1;
        icmp.dir = POL_DIR_INGRESS;
        icmp.why = DENIED_REVOKED;
        let d = describe(&icmp, &clock);
        assert_eq!(
            (d.protocol.as_str(), d.pod_port, d.peer_port),
            ("ICMP", None, None)
        );
        assert_eq!(d.direction, "ingress");
        assert_eq!(d.why, "revoked by a policy change");
    }
}
