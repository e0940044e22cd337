//! `ipam show`, `ipam check`, `ipam release`.
use calix_agent::ipam::service::{CheckReport, IpamReport};

use super::table;

pub(crate) fn ipam_show_table(r: &IpamReport) -> String {
    let pools: Vec<Vec<String>> = r
        .pools
        .iter()
        .map(|p| {
            vec![
                p.cidr.clone(),
                format!("/{}", p.block_size),
                if p.disabled { "disabled" } else { "enabled" }.into(),
                p.blocks.to_string(),
                p.used.to_string(),
                p.size.to_string(),
            ]
        })
        .collect();
    let blocks: Vec<Vec<String>> = r
        .blocks
        .iter()
        .map(|b| {
            vec![
                b.cidr.clone(),
                b.affinity.clone(),
                format!("{}/{}", b.used, b.size),
                b.borrowed.to_string(),
            ]
        })
        .collect();
    let nodes: Vec<Vec<String>> = r
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.node.clone(),
                n.addresses.join(","),
                n.blocks.to_string(),
                n.used.to_string(),
                n.endpoints.to_string(),
            ]
        })
        .collect();
    format!(
        "{}\n\n{}\n\n{}\n\nnode {} can allocate {} more IPv4 and {} more IPv6 address(es) from its blocks and unclaimed ones",
        table(&["POOL", "BLOCK SIZE", "STATE", "BLOCKS", "IN USE", "SIZE"], &pools),
        table(&["BLOCK", "NODE", "IN USE", "BORROWED"], &blocks),
        table(&["NODE", "ADDRESSES", "BLOCKS", "IN USE", "ENDPOINTS"], &nodes),
        r.node,
        r.free_v4,
        r.free_v6
    )
}

pub(crate) fn ipam_check_table(r: &CheckReport) -> String {
    let rows: Vec<Vec<String>> = r
        .findings
        .iter()
        .map(|f| {
            vec![
                if f.rule.is_empty() {
                    f.kind.clone()
                } else {
                    format!("{} ({})", f.kind, f.rule)
                },
                f.address.map(|a| a.to_string()).unwrap_or_default(),
                f.node.clone(),
                f.block.clone(),
                if f.handle.is_empty() {
                    String::new()
                } else {
                    format!("{}/{}", f.handle, f.ifname)
                },
                f.detail.clone(),
            ]
        })
        .collect();
    let summary = format!(
        "{} allocation(s) in {} block(s), {} handle(s), {} endpoint(s): {} problem(s)",
        r.allocations,
        r.blocks,
        r.handles,
        r.endpoints,
        r.findings.len()
    );
    if rows.is_empty() {
        summary
    } else {
        format!(
            "{}\n{summary}",
            table(
                &["KIND", "ADDRESS", "NODE", "BLOCK", "HANDLE", "DETAIL"],
                &rows
            )
        )
    }
}
