//! `bgp peers`, `bgp routes`.
use std::time::Duration;

use calix_agent::bgp::status::{human, BgpReport};

use super::table;

pub(crate) fn peers_table(r: &BgpReport) -> String {
    let rows: Vec<Vec<String>> = r
        .peers
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                p.address.clone(),
                p.asn.to_string(),
                p.state.clone(),
                p.uptime_secs
                    .map_or("-".into(), |s| human(Duration::from_secs(s))),
                p.sent.to_string(),
                format!("{}/{}", p.accepted, p.received),
                p.graceful_restart.clone(),
                if p.last_error.is_empty() {
                    "-".into()
                } else {
                    p.last_error.clone()
                },
            ]
        })
        .collect();
    let mut out = table(
        &[
            "PEER",
            "ADDRESS",
            "AS",
            "STATE",
            "UPTIME",
            "SENT",
            "ACCEPTED/RECEIVED",
            "GR",
            "LAST ERROR",
        ],
        &rows,
    );
    out.push_str(&format!(
        "\nAS {}, router ID {}; {} peer(s), {} established",
        r.asn,
        r.router_id,
        r.peers.len(),
        r.peers.iter().filter(|p| p.state == "Established").count()
    ));
    out.push_str(&if r.listening.is_empty() {
        "\nnot listening: it connects to its peers".to_string()
    } else {
        format!("\nlistening on {}", r.listening.join(", "))
    });
    if r.refused_connections > 0 {
        out.push_str(&format!(
            "; {} connection(s) from no configured peer closed",
            r.refused_connections
        ));
    }
    let troubled: Vec<String> = r
        .peers
        .iter()
        .filter(|p| p.malformed_updates + p.refused_over_limit + p.limit_resets + p.open_refused > 0)
        .map(|p| {
            format!(
                "{}: {} malformed UPDATE(s), {} route(s) over the limit, {} limit reset(s), {} OPEN(s) refused",
                p.name, p.malformed_updates, p.refused_over_limit, p.limit_resets, p.open_refused
            )
        })
        .collect();
    for t in troubled {
        out.push('\n');
        out.push_str(&t);
    }
    out
}

pub(crate) fn routes_table(r: &BgpReport) -> String {
    let mut rows: Vec<Vec<String>> = r
        .advertised
        .iter()
        .map(|a| {
            vec![
                a.prefix.clone(),
                a.next_hop.clone(),
                a.peer.clone(),
                "-".into(),
                "advertised".into(),
            ]
        })
        .collect();
    rows.extend(r.learned.iter().map(|l| {
        let state = match (l.accepted, l.installed, l.stale) {
            (false, _, _) => "refused (import rule)",
            (true, true, true) => "installed, stale",
            (true, true, false) => "installed",
            (true, false, _) => "learned (another peer's is installed)",
        };
        vec![
            l.prefix.clone(),
            l.next_hop.clone(),
            l.peer.clone(),
            l.as_path
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" "),
            state.into(),
        ]
    }));
    let mut out = table(&["PREFIX", "NEXT HOP", "PEER", "AS PATH", "STATE"], &rows);
    out.push_str(&format!(
        "\n{} advertised, {} learned; the installed set is {}",
        r.advertised.len(),
        r.learned.len(),
        if r.complete {
            "complete"
        } else {
            "not complete yet (waiting for the peers' End-of-RIB: nothing is removed)"
        }
    ));
    out
}
