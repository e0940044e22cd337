//! What the speaker reports: each peer's session (`calixctl bgp peers`), the routes advertised
//! and learned (`calixctl bgp routes`), and the metrics. The report is JSON on the local API;
//! calixctl renders it.
use std::fmt::Write;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One peer, as the speaker saw it last.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerReport {
    pub name: String,
    pub address: String,
    pub asn: u32,
    /// Idle, Connect, OpenSent, OpenConfirm or Established.
    pub state: String,
    /// Seconds in Established (none when not).
    pub uptime_secs: Option<u64>,
    /// Prefixes announced to the peer on this session.
    pub sent: usize,
    /// Prefixes the peer announced, and how many of them the import rule took.
    pub received: usize,
    pub accepted: usize,
    /// Routes kept from a connection that dropped (graceful restart, this node as helper).
    pub stale: usize,
    /// Graceful restart: "off", "offered", "helping" (the peer restarts: its routes are
    /// stale), or "waiting" (this node restarted: its peers' End-of-RIB is awaited).
    pub graceful_restart: String,
    /// Why the last session ended or the last connection failed.
    pub last_error: String,
    /// Sessions that reached Established, and that went down since the agent started.
    pub established_total: u64,
    pub down_total: u64,
    /// UPDATEs with a malformed attribute (RFC 7606: withdrawn or discarded, session kept).
    pub malformed_updates: u64,
    /// Routes refused over the prefix limit, and sessions reset for it.
    pub refused_over_limit: u64,
    pub limit_resets: u64,
    /// OPENs refused (wrong AS, bad hold time...).
    pub open_refused: u64,
}

/// A route advertised or learned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteLine {
    pub prefix: String,
    pub next_hop: String,
    /// The peer it was learned from (learned routes), or sent to (advertised).
    pub peer: String,
    /// The AS path (learned routes).
    pub as_path: Vec<u32>,
    /// Learned: the import rule took it; false: refused (own prefix, outside the pools...).
    pub accepted: bool,
    /// Learned: kept from a dropped connection (graceful restart).
    pub stale: bool,
    /// Learned: this is the route installed for the prefix.
    pub installed: bool,
}

/// `calixctl bgp` reads this.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BgpReport {
    pub asn: u32,
    pub router_id: String,
    pub peers: Vec<PeerReport>,
    pub advertised: Vec<RouteLine>,
    pub learned: Vec<RouteLine>,
    /// Whether the installed set is whole: every peer sent its End-of-RIB since the agent
    /// started, or the restart time ran out. Until then no kernel route is removed.
    pub complete: bool,
    /// The addresses and port it listens on for its peers' connections.
    #[serde(default)]
    pub listening: Vec<String>,
    /// Connections closed at once: from no configured peer, or while the same peer's
    /// previous one had not sent its OPEN.
    #[serde(default)]
    pub refused_connections: u64,
}

/// Seconds since `t`, when set.
pub fn since(t: Option<Instant>, now: Instant) -> Option<u64> {
    t.map(|t| now.saturating_duration_since(t).as_secs())
}

/// The Prometheus lines of a report.
pub fn metrics(r: &BgpReport) -> String {
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(&PeerReport) -> u64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for p in &r.peers {
            let _ = writeln!(out, "{name}{{peer=\"{}\"}} {}", p.name, value(p));
        }
    };
    family(
        "calix_bgp_session_established",
        "gauge",
        "1 when the session with the peer is Established.",
        &|p| u64::from(p.state == "Established"),
    );
    family(
        "calix_bgp_prefixes_sent",
        "gauge",
        "Prefixes announced to the peer.",
        &|p| p.sent as u64,
    );
    family(
        "calix_bgp_prefixes_received",
        "gauge",
        "Prefixes the peer announced.",
        &|p| p.received as u64,
    );
    family(
        "calix_bgp_prefixes_accepted",
        "gauge",
        "Prefixes of the peer the import rule took.",
        &|p| p.accepted as u64,
    );
    family(
        "calix_bgp_sessions_down_total",
        "counter",
        "Sessions with the peer that went down.",
        &|p| p.down_total,
    );
    family(
        "calix_bgp_malformed_updates_total",
        "counter",
        "UPDATEs with a malformed attribute (RFC 7606).",
        &|p| p.malformed_updates,
    );
    family(
        "calix_bgp_refused_over_limit_total",
        "counter",
        "Routes refused over the peer's prefix limit.",
        &|p| p.refused_over_limit,
    );
    family(
        "calix_bgp_limit_resets_total",
        "counter",
        "Sessions reset for the prefix limit.",
        &|p| p.limit_resets,
    );
    family(
        "calix_bgp_open_refused_total",
        "counter",
        "OPEN messages refused (wrong AS, bad hold time...).",
        &|p| p.open_refused,
    );
    let _ = writeln!(
        out,
        "# HELP calix_bgp_refused_connections_total Connections to the BGP port closed at once (no configured peer's address).\n\
         # TYPE calix_bgp_refused_connections_total counter\ncalix_bgp_refused_connections_total {}",
        r.refused_connections
    );
    out
}

/// A duration for a table: "3h12m", "4m05s", "12s".
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_name_each_peer() {
        let r = BgpReport {
            peers: vec![
                PeerReport {
                    name: "tor-a".into(),
                    state: "Established".into(),
                    sent: 3,
                    malformed_updates: 2,
                    ..PeerReport::default()
                },
                PeerReport {
                    name: "tor-b".into(),
                    state: "Connect".into(),
                    ..PeerReport::default()
                },
            ],
            ..BgpReport::default()
        };
        let m = metrics(&r);
        assert!(
            m.contains("calix_bgp_session_established{peer=\"tor-a\"} 1\n"),
            "{m}"
        );
        assert!(
            m.contains("calix_bgp_session_established{peer=\"tor-b\"} 0\n"),
            "{m}"
        );
        assert!(
            m.contains("calix_bgp_prefixes_sent{peer=\"tor-a\"} 3\n"),
            "{m}"
        );
        assert!(
            m.contains("calix_bgp_malformed_updates_total{peer=\"tor-a\"} 2\n"),
            "{m}"
        );
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(human(Duration::from_secs(12)), "12s");
        assert_eq!(human(Duration::from_secs(245)), "4m05s");
        assert_eq!(human(Duration::from_secs(3 * 3600 + 720)), "3h12m");
    }
}
