//! What `calixctl routes` and `calixctl nodes` show (one report, JSON over the unix socket),
//! and route distribution's lines of `/metrics`.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Instant;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::engine::{Engine, Verdict};
use super::peers::Topology;
use super::validate::Refusal;
use crate::ipam::pool::VxlanMode;
use crate::reconcile::remote::RemoteRoute;
use crate::update::WireError;
use crate::Route;

/// A set of routes this agent serves to its watchers (the agent's feed), as the report reads
/// it.
pub trait Served {
    /// Each route with when it took its current value.
    fn with_ages(&self) -> Vec<(Route, Instant)>;
    /// How many routes it holds.
    fn routes(&self) -> usize;
    /// Watchers subscribed now.
    fn watchers(&self) -> usize;
}

/// What `calixctl nodes` and `/metrics` show of this node's certificate.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CertStatus {
    /// `files` or `kubernetes`.
    pub source: String,
    /// Its serial (hex); `None` while there is none.
    pub serial: Option<String>,
    /// Its end of validity, seconds since the epoch.
    pub not_after: Option<i64>,
    /// Seconds it is still valid (negative: expired).
    pub expires_in_secs: Option<i64>,
    /// The trust bundle is known.
    pub bundle: bool,
    /// Certificates put in place since the agent started (the first included).
    pub issued: u64,
    /// Attempts to get one that failed.
    pub failures: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// What the Routes door saw (its counters, read at one time).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoorCounts {
    /// Connections that passed the handshake.
    pub accepted: u64,
    /// Closed at once, before TLS: the source is no address of a known node.
    #[serde(default)]
    pub refused_unknown: u64,
    /// Closed at once: too many connections (in total, from one address, or handshaking).
    pub refused_busy: u64,
    /// TLS handshakes that failed or timed out (missing, untrusted or bad certificates).
    pub refused_tls: u64,
    /// Watches refused: the certificate does not name the node asked for, or no such node.
    pub refused_identity: u64,
}

/// Route distribution on this node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutesReport {
    pub node: String,
    /// `routes.enabled`: off, the rest is empty.
    pub enabled: bool,
    pub topology: String,
    pub reflector: bool,
    /// Where peers reach this agent (its node record's `routes_endpoint`).
    pub endpoint: String,
    /// Mutual TLS between nodes (false: `routes.plaintext`).
    pub tls: bool,
    /// This node's certificate (with TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<CertStatus>,
    /// The datastore's blocks and nodes are listed.
    pub synced: bool,
    /// Every peer answered (or its grace ran out) since this agent started.
    pub complete: bool,
    /// This node's routes, as served.
    pub advertised: Vec<Advertised>,
    /// Routes a reflector relays (its own included).
    pub relayed: usize,
    /// Every route the peers announced, with what this agent made of it.
    pub learned: Vec<Learned>,
    /// What the reconciler was handed last (the desired routes to other nodes' pods).
    pub desired: Vec<Desired>,
    /// Whether that set was complete (stale routes may be removed).
    pub desired_complete: bool,
    /// Seconds since it was handed over; `None` before the first time.
    pub desired_age_secs: Option<f64>,
    pub peers: Vec<Peer>,
    /// Watch streams this agent serves now.
    pub watchers: usize,
    /// Routes refused, by cause.
    pub refusals: BTreeMap<String, u64>,
    /// Withdrawals of prefixes their peer did not hold: ignored.
    #[serde(default)]
    pub unknown_withdrawals: u64,
    /// Peers' streams dropped because they broke the protocol or a bound, by cause.
    #[serde(default)]
    pub dropped: BTreeMap<String, u64>,
    /// Learned routes not listed in `learned`: every accepted route is, and the first
    /// [`LISTED_UNUSED`] of each peer's others (a peer can announce many that are refused;
    /// the report, and the time it takes, stay small).
    #[serde(default)]
    pub learned_omitted: usize,
    /// Accepted routes the route guard kept out of the kernel so far, by cause.
    #[serde(default)]
    pub guard_refusals: BTreeMap<String, u64>,
    /// Stored blocks the view ignores (they break the rule for blocks), by rule.
    #[serde(default)]
    pub ignored_blocks: BTreeMap<String, u64>,
    /// The TCP door's counters.
    pub door: DoorCounts,
}

/// Routes of one peer listed in the report that are not accepted (refused, pending).
pub const LISTED_UNUSED: usize = 100;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advertised {
    pub prefix: String,
    pub node: String,
    pub next_hop: String,
    pub age_secs: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Learned {
    pub prefix: String,
    /// The node the prefix lives on.
    pub node: String,
    pub next_hop: String,
    /// `direct` or `vxlan`: how this node reaches it, as configured (the pool's `vxlan`).
    pub via: String,
    /// The peer that announced it.
    pub source: String,
    pub age_secs: f64,
    /// `accepted`, `pending` (refused for less than the settle time), `refused`, `guarded`
    /// (accepted, but kept out of the kernel by the route guard: `cause` says why), or `own`
    /// (this node's own route relayed back).
    pub state: String,
    /// Why it is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Desired {
    pub prefix: String,
    pub node: String,
    pub next_hop: String,
    /// The pool's `vxlan` mode.
    pub vxlan: String,
    /// `direct` or `vxlan`.
    pub via: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Peer {
    pub name: String,
    pub endpoint: String,
    pub reflector: bool,
    /// `connecting`, `up`, `grace` or `down` (its grace ran out).
    pub state: String,
    pub last_update_secs: Option<f64>,
    /// The generation of its last update.
    pub generation: u64,
    /// Time left before its routes are withdrawn, while in grace.
    pub grace_left_secs: Option<f64>,
    /// Routes it announces, and how many of them are accepted.
    pub routes: usize,
    pub accepted: usize,
    /// Snapshots received (1 + reconnects).
    pub snapshots: u64,
    /// Entries it sent that did not parse.
    #[serde(default)]
    pub malformed: u64,
    /// Withdrawals of prefixes it did not hold (ignored).
    #[serde(default)]
    pub unknown_withdrawals: u64,
    /// Its streams dropped because it broke the protocol or a bound, by cause.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dropped: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How traffic to `next_hop` goes: VXLAN always or never as the pool says, or across
/// subnets only (`crossSubnet`: direct when the next hop is in one of `subnets`).
pub fn via(mode: VxlanMode, next_hop: IpAddr, subnets: &[IpNet]) -> &'static str {
    match mode {
        VxlanMode::Always => "vxlan",
        VxlanMode::Never => "direct",
        VxlanMode::CrossSubnet if subnets.iter().any(|s| s.contains(&next_hop)) => "direct",
        VxlanMode::CrossSubnet => "vxlan",
    }
}

pub fn mode_name(m: VxlanMode) -> &'static str {
    match m {
        VxlanMode::Never => "never",
        VxlanMode::CrossSubnet => "crossSubnet",
        VxlanMode::Always => "always",
    }
}

/// What the report is built from besides the engine.
pub struct Context<'a> {
    pub endpoint: &'a str,
    /// This node's certificate; `None`: plain text.
    pub tls: Option<CertStatus>,
    pub own: &'a dyn Served,
    pub relay: &'a dyn Served,
    /// The last set handed to the reconciler: routes, complete, when.
    pub handed: Option<(std::sync::Arc<Vec<RemoteRoute>>, bool, Instant)>,
    pub subnets: &'a [IpNet],
    pub door: DoorCounts,
}

pub fn build(e: &Engine, cx: &Context<'_>, now: Instant) -> RoutesReport {
    let s = e.settings();
    let secs = |t: Instant| now.saturating_duration_since(t).as_secs_f64();
    let advertised = cx
        .own
        .with_ages()
        .into_iter()
        .map(|(r, since)| Advertised {
            prefix: r.prefix.to_string(),
            node: r.node,
            next_hop: r.next_hop.to_string(),
            age_secs: secs(since),
        })
        .collect();
    let mut learned = Vec::new();
    let mut learned_omitted = 0;
    let mut peers = Vec::new();
    for (name, session) in e.sessions() {
        // Every accepted (and own) route is listed, and the first LISTED_UNUSED of the
        // others; the walk stops once nothing more would be listed but accepted routes still
        // to come, so a peer's refused routes cost the report nothing beyond those.
        let accepted = e.accepted(name);
        let (mut listed_accepted, mut listed_unused, mut listed) = (0, 0, 0);
        for (p, r) in &session.routes {
            if listed_unused >= LISTED_UNUSED && listed_accepted == accepted {
                break;
            }
            let (state, cause) = match e.verdict(name, p) {
                Some(Verdict::Accepted) => {
                    listed_accepted += 1;
                    match e.guarded().get(p) {
                        Some((_, g)) => ("guarded", Some(g.name().to_string())),
                        None => ("accepted", None),
                    }
                }
                Some(Verdict::Own) => ("own", None),
                Some(Verdict::Pending { cause, .. }) => ("pending", Some(cause.name().to_string())),
                Some(Verdict::Refused(cause)) => ("refused", Some(cause.name().to_string())),
                None => ("pending", None),
            };
            if state == "pending" || state == "refused" {
                if listed_unused == LISTED_UNUSED {
                    continue;
                }
                listed_unused += 1;
            }
            listed += 1;
            learned.push(Learned {
                prefix: p.to_string(),
                node: r.node.clone(),
                next_hop: r.next_hop.to_string(),
                via: via(e.vxlan_for(p), r.next_hop, cx.subnets).into(),
                source: name.clone(),
                age_secs: session.since.get(p).map(|t| secs(*t)).unwrap_or(0.0),
                state: state.into(),
                cause,
            });
        }
        learned_omitted += session.routes.len() - listed;
        peers.push(Peer {
            name: name.clone(),
            endpoint: session.endpoint.clone(),
            reflector: e.view().node(name).is_some_and(|n| n.record.reflector),
            state: session.state.name().into(),
            last_update_secs: session.last_update.map(secs),
            generation: session.generation,
            grace_left_secs: session.grace_left(now).map(|d| d.as_secs_f64()),
            routes: session.routes.len(),
            accepted,
            snapshots: session.snapshots,
            malformed: session.malformed,
            unknown_withdrawals: session.unknown_withdrawals,
            dropped: names(&session.dropped),
            error: session.last_error.clone(),
        });
    }
    let (desired, desired_complete, desired_age_secs) = match &cx.handed {
        Some((routes, complete, at)) => (
            routes
                .iter()
                .map(|r| Desired {
                    prefix: r.prefix.to_string(),
                    node: r.node.clone(),
                    next_hop: r.next_hop.to_string(),
                    vxlan: mode_name(r.vxlan).into(),
                    via: via(r.vxlan, r.next_hop, cx.subnets).into(),
                })
                .collect(),
            *complete,
            Some(secs(*at)),
        ),
        None => (Vec::new(), false, None),
    };
    RoutesReport {
        node: s.me.clone(),
        enabled: true,
        topology: match s.topology {
            Topology::Mesh => "mesh",
            Topology::Reflectors => "reflectors",
        }
        .into(),
        reflector: s.reflector,
        endpoint: cx.endpoint.into(),
        tls: cx.tls.is_some(),
        certificate: cx.tls.clone(),
        synced: e.synced(),
        complete: e.complete(),
        advertised,
        relayed: if s.reflector { cx.relay.routes() } else { 0 },
        learned,
        desired,
        desired_complete,
        desired_age_secs,
        peers,
        watchers: cx.own.watchers() + cx.relay.watchers(),
        refusals: e
            .refusals()
            .iter()
            .map(|(c, n)| (c.name().to_string(), *n))
            .collect(),
        unknown_withdrawals: e.unknown_withdrawals(),
        dropped: names(e.dropped()),
        learned_omitted,
        guard_refusals: guard_refusals(e),
        ignored_blocks: ignored_blocks(e),
        door: cx.door.clone(),
    }
}

fn names(m: &BTreeMap<&'static str, u64>) -> BTreeMap<String, u64> {
    m.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn guard_refusals(e: &Engine) -> BTreeMap<String, u64> {
    e.guard_counts()
        .iter()
        .map(|(c, n)| (c.name().to_string(), *n))
        .collect()
}

fn ignored_blocks(e: &Engine) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for i in e.view().ignored() {
        *out.entry(i.rule.name().to_string()).or_default() += 1;
    }
    out
}

/// What `/metrics` shows, counted without building the report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    /// Peers by stream state.
    pub peers: BTreeMap<&'static str, usize>,
    /// Learned routes accepted.
    pub learned: usize,
    pub desired: usize,
    pub advertised: usize,
    pub complete: bool,
    pub refusals: BTreeMap<String, u64>,
    pub unknown_withdrawals: u64,
    pub dropped: BTreeMap<String, u64>,
    pub guard_refusals: BTreeMap<String, u64>,
    /// Accepted routes the guard keeps out now.
    pub guarded: usize,
    pub watchers: usize,
    pub door: DoorCounts,
    pub certificate: Option<CertStatus>,
}

pub fn counts(e: &Engine, cx: &Context<'_>) -> Counts {
    let mut peers = BTreeMap::new();
    let mut learned = 0;
    for (name, s) in e.sessions() {
        *peers.entry(s.state.name()).or_default() += 1;
        learned += e.accepted(name);
    }
    Counts {
        peers,
        learned,
        desired: cx.handed.as_ref().map_or(0, |h| h.0.len()),
        advertised: cx.own.routes(),
        complete: e.complete(),
        refusals: e
            .refusals()
            .iter()
            .map(|(c, n)| (c.name().to_string(), *n))
            .collect(),
        unknown_withdrawals: e.unknown_withdrawals(),
        dropped: names(e.dropped()),
        guard_refusals: guard_refusals(e),
        guarded: e.guarded().len(),
        watchers: cx.own.watchers() + cx.relay.watchers(),
        door: cx.door.clone(),
        certificate: cx.tls.clone(),
    }
}

/// Route distribution's lines of `/metrics`.
pub fn metrics(r: &Counts) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP calix_route_peers Followed peers by stream state (connecting, up, grace, down).\n# TYPE calix_route_peers gauge"
    );
    for state in ["connecting", "up", "grace", "down"] {
        let n = r.peers.get(state).copied().unwrap_or(0);
        let _ = writeln!(out, "calix_route_peers{{state=\"{state}\"}} {n}");
    }
    let accepted = r.learned;
    let _ = writeln!(
        out,
        "# HELP calix_routes_learned Routes learned from peers and accepted.\n# TYPE calix_routes_learned gauge\ncalix_routes_learned {accepted}"
    );
    let _ = writeln!(
        out,
        "# HELP calix_routes_desired Routes to other nodes' pods handed to the reconciler.\n# TYPE calix_routes_desired gauge\ncalix_routes_desired {}",
        r.desired
    );
    let _ = writeln!(
        out,
        "# HELP calix_routes_advertised Routes this node advertises (its blocks, borrowed addresses).\n# TYPE calix_routes_advertised gauge\ncalix_routes_advertised {}",
        r.advertised
    );
    let _ = writeln!(
        out,
        "# HELP calix_routes_complete 1 once every peer answered (or its grace ran out) since the agent started.\n# TYPE calix_routes_complete gauge\ncalix_routes_complete {}",
        u8::from(r.complete)
    );
    let _ = writeln!(
        out,
        "# HELP calix_route_refusals_total Routes from peers refused, by cause.\n# TYPE calix_route_refusals_total counter"
    );
    for cause in Refusal::ALL {
        let n = r.refusals.get(cause.name()).copied().unwrap_or(0);
        let _ = writeln!(out, "calix_route_refusals_total{{cause=\"{cause}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP calix_route_withdrawals_ignored_total Withdrawals of prefixes their peer did not hold (never announced, or gone already): ignored.\n# TYPE calix_route_withdrawals_ignored_total counter\ncalix_route_withdrawals_ignored_total {}",
        r.unknown_withdrawals
    );
    let _ = writeln!(
        out,
        "# HELP calix_route_streams_dropped_total Peers' streams dropped because the peer broke the protocol or a bound, by cause.\n# TYPE calix_route_streams_dropped_total counter"
    );
    for cause in WireError::NAMES {
        let n = r.dropped.get(cause).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "calix_route_streams_dropped_total{{cause=\"{cause}\"}} {n}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP calix_route_guard_refusals_total Accepted routes the route guard kept out of the kernel, by cause (outside every pool, shorter than the pool's blocks, covering a node's or an uplink's address).\n# TYPE calix_route_guard_refusals_total counter"
    );
    for cause in crate::reconcile::remote::Guarded::ALL {
        let n = r.guard_refusals.get(cause.name()).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "calix_route_guard_refusals_total{{cause=\"{cause}\"}} {n}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP calix_routes_guarded Accepted routes the route guard keeps out of the kernel now.\n# TYPE calix_routes_guarded gauge\ncalix_routes_guarded {}",
        r.guarded
    );
    let _ = writeln!(
        out,
        "# HELP calix_route_watchers Watch streams this agent serves.\n# TYPE calix_route_watchers gauge\ncalix_route_watchers {}",
        r.watchers
    );
    let d = &r.door;
    let _ = writeln!(
        out,
        "# HELP calix_route_connections_refused_total Connections to the Routes port refused, by cause (unknown: the source is no known node's address, before TLS; busy: caps; tls: handshake; identity: certificate or node).\n# TYPE calix_route_connections_refused_total counter\ncalix_route_connections_refused_total{{cause=\"unknown\"}} {}\ncalix_route_connections_refused_total{{cause=\"busy\"}} {}\ncalix_route_connections_refused_total{{cause=\"tls\"}} {}\ncalix_route_connections_refused_total{{cause=\"identity\"}} {}",
        d.refused_unknown, d.refused_busy, d.refused_tls, d.refused_identity
    );
    if let Some(c) = &r.certificate {
        let _ = writeln!(
            out,
            "# HELP calix_routes_certificate_expiry_timestamp_seconds When this node's route-distribution certificate expires (0: none yet).\n# TYPE calix_routes_certificate_expiry_timestamp_seconds gauge\ncalix_routes_certificate_expiry_timestamp_seconds {}",
            c.not_after.unwrap_or(0)
        );
        let _ = writeln!(
            out,
            "# HELP calix_routes_certificates_issued_total Certificates put in place for route distribution since the agent started.\n# TYPE calix_routes_certificates_issued_total counter\ncalix_routes_certificates_issued_total {}",
            c.issued
        );
        let _ = writeln!(
            out,
            "# HELP calix_routes_certificate_failures_total Attempts to get this node's certificate that failed.\n# TYPE calix_routes_certificate_failures_total counter\ncalix_routes_certificate_failures_total {}",
            c.failures
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn via_follows_the_pools_mode_and_the_subnets() {
        let subnets: Vec<IpNet> = vec!["172.31.1.0/24".parse().expect("net")];
        let near: IpAddr = "172.31.1.2".parse().expect("ip");
        let far: IpAddr = "172.31.2.3".parse().expect("ip");
        assert_eq!(via(VxlanMode::CrossSubnet, near, &subnets), "direct");
        assert_eq!(via(VxlanMode::CrossSubnet, far, &subnets), "vxlan");
        assert_eq!(via(VxlanMode::Always, near, &subnets), "vxlan");
        assert_eq!(via(VxlanMode::Never, far, &subnets), "direct");
    }

    /// A peer that announces many routes no datastore backs does not make the report (and
    /// calixctl's message) as large: a few of them are listed, the rest counted.
    #[test]
    fn routes_not_accepted_are_listed_up_to_a_cap_per_peer() {
        use crate::routes::advertise::NextHops;
        use crate::routes::engine::{Settings, SETTLE};
        use crate::routes::peers::Topology;
        use crate::routes::view::tests::node_kv;
        use crate::routes::view::Part;
        use crate::update::{PeerEvent, Unused};
        let t0 = Instant::now();
        let mut e = Engine::new(Settings {
            me: "a".into(),
            topology: Topology::Mesh,
            reflector: false,
            grace: std::time::Duration::from_secs(120),
            settle: SETTLE,
            next_hops: NextHops {
                v4: Some("172.31.1.1".parse().expect("ip")),
                v6: None,
            },
            pools: vec![],
            blocks: crate::routes::view::tests::pools(),
        });
        e.view_listed(
            Part::Nodes,
            vec![
                node_kv("a", &["172.31.1.1"], false),
                node_kv("b", &["172.31.1.2"], false),
            ],
        );
        e.view_listed(Part::Blocks, vec![]);
        e.flush(t0);
        let routes = (0..LISTED_UNUSED as u32 + 50)
            .map(|i| crate::Route {
                prefix: ipnet::IpNet::from(IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i))),
                node: "b".into(),
                next_hop: "172.31.1.2".parse().expect("ip"),
            })
            .collect();
        e.peer_event(
            "b",
            PeerEvent::Snapshot {
                generation: 1,
                routes,
                unused: Unused::default(),
            },
            t0,
        );
        e.flush(t0);
        /// Nothing served.
        struct NoRoutes;
        impl Served for NoRoutes {
            fn with_ages(&self) -> Vec<(Route, Instant)> {
                Vec::new()
            }
            fn routes(&self) -> usize {
                0
            }
            fn watchers(&self) -> usize {
                0
            }
        }
        let feed = NoRoutes;
        let cx = Context {
            endpoint: "172.31.1.1:5474",
            tls: None,
            own: &feed,
            relay: &feed,
            handed: None,
            subnets: &[],
            door: DoorCounts::default(),
        };
        let r = build(&e, &cx, t0);
        assert_eq!(r.learned.len(), LISTED_UNUSED);
        assert_eq!(r.learned_omitted, 50);
        assert_eq!(r.peers[0].routes, LISTED_UNUSED + 50);
    }

    #[test]
    fn metrics_name_every_state_and_cause() {
        let mut r = Counts::default();
        r.refusals.insert("not_its_own".into(), 3);
        r.peers.insert("up", 2);
        r.unknown_withdrawals = 7;
        r.dropped.insert("update_bytes".into(), 2);
        let m = metrics(&r);
        assert!(m.contains("calix_route_withdrawals_ignored_total 7"));
        assert!(m.contains("calix_route_streams_dropped_total{cause=\"update_bytes\"} 2"));
        assert!(m.contains("calix_route_streams_dropped_total{cause=\"too_many_routes\"} 0"));
        assert!(m.contains("calix_route_peers{state=\"up\"} 2"));
        assert!(m.contains("calix_route_refusals_total{cause=\"not_its_own\"} 3"));
        assert!(m.contains("calix_route_refusals_total{cause=\"block_not_affine\"} 0"));
        assert!(m.contains("calix_route_peers{state=\"grace\"} 0"));
        assert!(
            !m.contains("calix_routes_certificate"),
            "plain text: no certificate lines"
        );
        r.certificate = Some(CertStatus {
            not_after: Some(1_700_000_000),
            issued: 3,
            failures: 2,
            ..CertStatus::default()
        });
        let m = metrics(&r);
        assert!(m.contains("calix_routes_certificate_expiry_timestamp_seconds 1700000000"));
        assert!(m.contains("calix_routes_certificates_issued_total 3"));
        assert!(m.contains("calix_routes_certificate_failures_total 2"));
        assert!(m.contains("calix_route_guard_refusals_total{cause=\"too_short\"} 0"));
        assert!(m.contains("calix_routes_guarded 0"));
    }
}
