//! `services`.
use std::net::IpAddr;

use calix_agent::services::ServicesReport;
use calix_core::services::admit::{Frontend, Kind};
use calix_core::services::choose::Choice;

use super::table;

fn kind(k: Kind) -> &'static str {
    match k {
        Kind::ClusterIp => "ClusterIP",
        Kind::NodePort => "NodePort",
        Kind::External => "External",
        Kind::LoadBalancer => "LoadBalancer",
    }
}

fn address(a: &IpAddr, port: u16) -> String {
    match a {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

fn frontend(f: &Frontend) -> String {
    let at = match &f.address {
        Some(a) => address(a, f.port),
        None => format!("<node>:{}", f.port),
    };
    format!("{at}/{}", f.protocol)
}

fn choice(c: &Choice) -> String {
    match c {
        Choice::To(v) => v
            .iter()
            .map(|(a, p)| address(a, *p))
            .collect::<Vec<_>>()
            .join(", "),
        Choice::Reject => "reject (no endpoint)".into(),
        Choice::Drop => "drop (no local endpoint)".into(),
    }
}

/// One row a frontend; a Service with none (refused for room, or all refused) one row that
/// says why; then what was refused or skipped, and the totals.
pub(crate) fn services_table(r: &ServicesReport) -> String {
    let mut rows: Vec<Vec<String>> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    for s in &r.list {
        if let Some((f, b)) = s.no_room {
            rows.push(vec![
                s.service.clone(),
                "-".into(),
                "-".into(),
                format!("not programmed: no room ({f} frontend(s), {b} backend entries needed)"),
                "-".into(),
                "-".into(),
            ]);
        }
        for (i, p) in s.frontends.iter().enumerate() {
            let counted = match s.counters.get(i) {
                None => "-".to_string(),
                Some(c) if c.refused == 0 => c.connections.to_string(),
                Some(c) => format!("{} ({} refused)", c.connections, c.refused),
            };
            let mut backends = choice(&p.internal);
            if p.terminating_fallback {
                backends.push_str(" (terminating)");
            }
            rows.push(vec![
                s.service.clone(),
                kind(p.frontend.kind).into(),
                frontend(&p.frontend),
                backends,
                p.external.as_ref().map_or("-".into(), choice),
                counted,
            ]);
        }
        for f in &s.refused {
            notes.push(format!(
                "{}: {} {} refused: {}",
                s.service,
                kind(f.kind),
                f.address,
                f.why
            ));
        }
        for p in &s.problems {
            notes.push(format!(
                "{}: slice {} skipped: {}",
                s.service, p.slice, p.what
            ));
        }
        for u in &s.unreadable {
            notes.push(format!("{}: {u}", s.service));
        }
    }
    let mut out = table(
        &[
            "SERVICE",
            "KIND",
            "FRONTEND",
            "BACKENDS",
            "FROM OUTSIDE",
            "CONNECTIONS",
        ],
        &rows,
    );
    for n in notes {
        out.push('\n');
        out.push_str(&n);
    }
    out.push_str(&format!(
        "\n{} Service(s), {} EndpointSlice(s); room used: {}/{} frontends, {}/{} backend entries{}\n{}",
        r.services,
        r.slices,
        r.used_frontends,
        r.limits.frontends,
        r.used_backends,
        r.limits.backends,
        if r.ready { "" } else { " (first listings not in yet)" },
        match (&r.program_error, r.programmed) {
            (Some(e), _) => format!("not programmed: {e} (retried every second)"),
            (None, true) => "translated at the sockets by the eBPF dataplane".to_string(),
            (None, false) => {
                "calculated only: [services] translate is off (kube-proxy translates)".to_string()
            }
        }
    ));
    out
}
