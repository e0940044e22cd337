//! `policy`.
use calix_core::policy::report::{DroppedPacket, PolicyReport, RuleReport};
use calix_core::policy::trace::{Outcome, TraceReport};

use super::table;

/// The calculation's summary, then the pod's policy when one was asked for.
pub(crate) fn policy(r: &PolicyReport, asked: Option<&str>) -> String {
    if !r.enabled {
        return format!(
            "NetworkPolicy is not followed on node {} (it needs the kubernetes datastore)",
            r.node
        );
    }
    let mut out = format!(
        "node {}: {} ({} namespaces, {} pods, {} policies, {} address sets; {} endpoints here; {} changes)",
        r.node,
        if r.ready { "in sync" } else { "listing" },
        r.namespaces,
        r.pods,
        r.policies,
        r.sets,
        r.local_endpoints,
        r.changes
    );
    if let Some(d) = &r.dataplane {
        out.push_str(&format!("\ndataplane: {d}"));
    }
    let Some(asked) = asked else {
        return out;
    };
    let Some(e) = &r.endpoint else {
        out.push_str(&format!("\npod {asked}: not known to the agent"));
        return out;
    };
    out.push_str(&format!(
        "\n\npod {}{}",
        e.pod,
        if e.local {
            ""
        } else {
            " (on another node: its policy is programmed there)"
        }
    ));
    if e.host_network {
        out.push_str("\non the host's network: NetworkPolicy does not apply");
        return out;
    }
    out.push_str(&format!(
        "\npolicies: {}",
        if e.policies.is_empty() {
            "none".to_string()
        } else {
            e.policies.join(", ")
        }
    ));
    for (direction, rules, denied) in [
        ("ingress", &e.ingress, e.denied_ingress),
        ("egress", &e.egress, e.denied_egress),
    ] {
        let denied = match denied {
            Some(n) if rules.is_some() => format!(" ({n} packets denied)"),
            _ => String::new(),
        };
        match rules {
            None => out.push_str(&format!("\n{direction}: not isolated, everything allowed")),
            Some(rules) if rules.is_empty() => {
                out.push_str(&format!("\n{direction}: isolated, nothing allowed{denied}"))
            }
            Some(rules) => {
                out.push_str(&format!("\n{direction}: isolated{denied}, allowed:\n"));
                out.push_str(&rules_table(rules));
            }
        }
    }
    for p in &e.problems {
        out.push_str(&format!("\nnot enforceable, allows nothing: {p}"));
    }
    out
}

fn rules_table(rules: &[RuleReport]) -> String {
    let rows: Vec<Vec<String>> = rules
        .iter()
        .map(|x| {
            vec![
                x.policy.clone(),
                x.rule.to_string(),
                x.peer.clone(),
                x.members.map_or("-".to_string(), |m| m.to_string()),
                x.ports.clone(),
                x.hits.map_or("-".to_string(), |h| h.to_string()),
            ]
        })
        .collect();
    table(
        &["POLICY", "RULE", "PEER", "ADDRESSES", "PORTS", "HITS"],
        &rows,
    )
}

/// The columns of [`drop_line`] (a stream: fixed widths, not a table sized to its rows).
pub(crate) fn drop_header() -> String {
    format!(
        "{:<24} {:<32} {:<7} {:<6} {:<46} {:<46} WHY",
        "TIME", "POD", "DIR", "PROTO", "POD ADDRESS", "PEER"
    )
}

/// One denied packet, on one line.
pub(crate) fn drop_line(d: &DroppedPacket) -> String {
    let at = |a: &str, p: Option<u16>| match (p, a.contains(':')) {
        (Some(p), true) => format!("[{a}]:{p}"),
        (Some(p), false) => format!("{a}:{p}"),
        (None, _) => a.to_string(),
    };
    let peer = match &d.peer_pod {
        Some(p) => format!("{} ({p})", at(&d.peer_address, d.peer_port)),
        None => at(&d.peer_address, d.peer_port),
    };
    let pod = d
        .pod
        .clone()
        .or_else(|| d.interface.clone())
        .unwrap_or_else(|| "?".to_string());
    let mut why = d.why.clone();
    if d.suppressed > 0 && !d.pod_address.is_empty() {
        why.push_str(&format!(" (+{} left out before it)", d.suppressed));
    }
    let line = format!(
        "{:<24} {:<32} {:<7} {:<6} {:<46} {:<46} {}",
        d.time,
        pod,
        d.direction,
        d.protocol,
        at(&d.pod_address, d.pod_port),
        peer,
        why
    );
    calix_log::escape_control(line.trim_end()).into_owned()
}

/// A trace: the packet, each step as a row, then where it ends.
pub(crate) fn trace(r: &TraceReport) -> String {
    let rows: Vec<Vec<String>> = r
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            vec![
                (i + 1).to_string(),
                s.stage.clone(),
                s.node.clone(),
                match s.outcome {
                    Outcome::Pass => "pass",
                    Outcome::Drop => "DROP",
                    Outcome::Defer => "later",
                    Outcome::Note => "-",
                }
                .to_string(),
                s.detail.clone(),
                s.source.clone(),
            ]
        })
        .collect();
    format!(
        "{}\n{}\n=> {}",
        calix_log::escape_control(&r.packet),
        table(&["#", "STAGE", "NODE", "VERDICT", "DETAIL", "FROM"], &rows),
        calix_log::escape_control(&r.conclusion())
    )
}
