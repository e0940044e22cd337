//! `routes`, `nodes`.
use calix_core::routes::report::RoutesReport;

use super::{age, table};

fn routes_off(r: &RoutesReport) -> Option<String> {
    (!r.enabled).then(|| {
        format!(
            "route distribution is off on node {} (routes.enabled = false)",
            r.node
        )
    })
}

pub(crate) fn routes_table(r: &RoutesReport) -> String {
    if let Some(off) = routes_off(r) {
        return off;
    }
    let mut rows: Vec<Vec<String>> = r
        .advertised
        .iter()
        .map(|a| {
            vec![
                a.prefix.clone(),
                a.node.clone(),
                a.next_hop.clone(),
                "-".into(),
                "(this node)".into(),
                age(a.age_secs),
                "advertised".into(),
            ]
        })
        .collect();
    rows.extend(r.learned.iter().map(|l| {
        vec![
            l.prefix.clone(),
            l.node.clone(),
            l.next_hop.clone(),
            l.via.clone(),
            l.source.clone(),
            age(l.age_secs),
            match &l.cause {
                Some(c) => format!("{}: {c}", l.state),
                None => l.state.clone(),
            },
        ]
    }));
    let mut out = table(
        &[
            "PREFIX", "NODE", "NEXT HOP", "VIA", "SOURCE", "AGE", "STATE",
        ],
        &rows,
    );
    out.push_str(&format!(
        "\n{} advertised, {} learned; {} route(s) handed to the reconciler ({}){}",
        r.advertised.len(),
        r.learned.len(),
        r.desired.len(),
        if r.desired_complete {
            "complete"
        } else {
            "incomplete: re-learning, stale routes kept"
        },
        r.desired_age_secs
            .map(|s| format!(" {} ago", age(s)))
            .unwrap_or_default()
    ));
    if r.learned_omitted > 0 {
        out.push_str(&format!(
            "\n{} more learned route(s) not accepted, not listed",
            r.learned_omitted
        ));
    }
    if !r.refusals.is_empty() {
        let causes: Vec<String> = r.refusals.iter().map(|(c, n)| format!("{c} {n}")).collect();
        out.push_str(&format!("\nrefused: {}", causes.join(", ")));
    }
    if !r.guard_refusals.is_empty() {
        let causes: Vec<String> = r
            .guard_refusals
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        out.push_str(&format!(
            "\nkept out of the kernel by the route guard: {}",
            causes.join(", ")
        ));
    }
    if !r.ignored_blocks.is_empty() {
        let rules: Vec<String> = r
            .ignored_blocks
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        out.push_str(&format!(
            "\nblocks ignored (calixctl ipam check): {}",
            rules.join(", ")
        ));
    }
    out
}

pub(crate) fn nodes_table(r: &RoutesReport) -> String {
    if let Some(off) = routes_off(r) {
        return off;
    }
    let rows: Vec<Vec<String>> = r
        .peers
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                p.endpoint.clone(),
                if p.reflector { "reflector" } else { "node" }.into(),
                p.state.clone(),
                p.last_update_secs
                    .map(|s| format!("{} ago", age(s)))
                    .unwrap_or("-".into()),
                p.generation.to_string(),
                p.grace_left_secs.map(age).unwrap_or("-".into()),
                format!("{}/{}", p.accepted, p.routes),
                p.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "PEER",
            "ENDPOINT",
            "ROLE",
            "STATE",
            "LAST UPDATE",
            "GENERATION",
            "GRACE LEFT",
            "ROUTES",
            "LAST ERROR",
        ],
        &rows,
    );
    let d = &r.door;
    out.push_str(&format!(
        "\nnode {} ({}{}, {}) at {}: {} peer(s) followed, {} watcher(s); {}; refused connections: {} unknown source, {} busy, {} TLS, {} identity",
        r.node,
        r.topology,
        if r.reflector { ", reflector" } else { "" },
        if r.tls { "mutual TLS" } else { "PLAIN TEXT" },
        r.endpoint,
        r.peers.len(),
        r.watchers,
        if r.complete {
            "every peer answered"
        } else {
            "waiting for peers (stale routes kept)"
        },
        d.refused_unknown,
        d.refused_busy,
        d.refused_tls,
        d.refused_identity
    ));
    if let Some(c) = &r.certificate {
        out.push_str(&format!(
            "\ncertificate ({}): {}{}; {} issued, {} failed attempt(s){}",
            c.source,
            match (&c.serial, c.expires_in_secs) {
                (Some(serial), Some(left)) if left >= 0 =>
                    format!("serial {serial}, expires in {}", age(left as f64)),
                (Some(serial), _) => format!("serial {serial}, EXPIRED"),
                _ => "none yet".to_string(),
            },
            if c.bundle {
                ""
            } else {
                ", no trust bundle yet"
            },
            c.issued,
            c.failures,
            c.last_error
                .as_ref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        ));
    }
    if r.unknown_withdrawals > 0 || !r.dropped.is_empty() {
        let dropped: Vec<String> = r.dropped.iter().map(|(c, n)| format!("{c} {n}")).collect();
        out.push_str(&format!(
            "\nwithdrawals of prefixes not held (ignored): {}; streams dropped for breaking the protocol: {}",
            r.unknown_withdrawals,
            if dropped.is_empty() {
                "none".to_string()
            } else {
                dropped.join(", ")
            }
        ));
    }
    out
}

pub(crate) fn nodes_json(r: &RoutesReport) -> serde_json::Value {
    serde_json::json!({
        "node": r.node,
        "enabled": r.enabled,
        "topology": r.topology,
        "reflector": r.reflector,
        "endpoint": r.endpoint,
        "tls": r.tls,
        "certificate": r.certificate,
        "complete": r.complete,
        "watchers": r.watchers,
        "door": r.door,
        "unknown_withdrawals": r.unknown_withdrawals,
        "dropped": r.dropped,
        "peers": r.peers,
    })
}
