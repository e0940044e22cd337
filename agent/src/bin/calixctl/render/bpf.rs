//! `bpf conntrack`, `bpf nat`, `bpf counters`.
use calix_proto::v1 as pb;

use super::{human_bytes, table};

pub(crate) fn flows_table(flows: &[serde_json::Value], nat_view: bool, node: &str) -> String {
    let s = |f: &serde_json::Value, k: &str| match &f[k] {
        serde_json::Value::String(v) => v.clone(),
        other => other.to_string(),
    };
    let rows: Vec<Vec<String>> = flows
        .iter()
        .map(|f| {
            let pod = format!("{}:{}", s(f, "pod"), s(f, "pod_port"));
            let nat = format!("{}:{}", s(f, "nat"), s(f, "nat_port"));
            let dst = format!("{}:{}", s(f, "dst"), s(f, "dst_port"));
            if nat_view {
                vec![s(f, "proto"), pod, nat, dst]
            } else {
                vec![
                    s(f, "proto"),
                    pod,
                    dst,
                    nat,
                    s(f, "state"),
                    format!("{}s", s(f, "idle_secs")),
                    format!("{}s", s(f, "expires_in_secs")),
                ]
            }
        })
        .collect();
    let header: &[&str] = if nat_view {
        &["PROTO", "POD", "NAT", "DESTINATION"]
    } else {
        &[
            "PROTO",
            "POD",
            "DESTINATION",
            "NAT",
            "STATE",
            "IDLE",
            "EXPIRES",
        ]
    };
    let mut out = table(header, &rows);
    out.push_str(&format!("\n{} flow(s) on node {node}", flows.len()));
    out
}

pub(crate) fn drops_table(resp: &pb::DropsResponse) -> String {
    let rows: Vec<Vec<String>> = resp
        .drops
        .iter()
        .map(|d| {
            vec![
                if d.ifname.is_empty() {
                    format!("(ifindex {})", d.ifindex)
                } else {
                    d.ifname.clone()
                },
                d.reason.clone(),
                d.packets.to_string(),
                human_bytes(d.bytes),
            ]
        })
        .collect();
    let total: u64 = resp.drops.iter().map(|d| d.packets).sum();
    let t = table(&["INTERFACE", "REASON", "PACKETS", "BYTES"], &rows);
    format!("{t}\n{total} packet(s) dropped on node {}", resp.node)
}

/// `bpf counters -o json`.
pub(crate) fn drops_json(resp: &pb::DropsResponse) -> serde_json::Value {
    let v: Vec<serde_json::Value> = resp
        .drops
        .iter()
        .map(|d| {
            serde_json::json!({
                "ifindex": d.ifindex,
                "interface": d.ifname,
                "reason": d.reason,
                "packets": d.packets,
                "bytes": d.bytes,
            })
        })
        .collect();
    serde_json::json!({"node": resp.node, "drops": v})
}
