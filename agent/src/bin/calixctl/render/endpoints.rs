//! `endpoints`.
use calix_proto::v1 as pb;

use super::{human_bytes, table};

fn pod_name(e: &pb::Endpoint) -> String {
    match (e.pod_namespace.as_str(), e.pod_name.as_str()) {
        ("", "") => e.container_id.chars().take(12).collect(),
        ("", p) => p.to_string(),
        (ns, p) => format!("{ns}/{p}"),
    }
}

pub(crate) fn endpoints_json(resp: &pb::ListResponse) -> serde_json::Value {
    let eps: Vec<serde_json::Value> = resp
        .endpoints
        .iter()
        .map(|s| {
            let e = s.endpoint.clone().unwrap_or_default();
            serde_json::json!({
                "pod": pod_name(&e),
                "podNamespace": e.pod_namespace,
                "podName": e.pod_name,
                "podUID": s.pod.as_ref().map_or(e.pod_uid.clone(), |p| p.uid.clone()),
                "podLabels": s.pod.as_ref().map(|p| p.labels.iter().collect::<std::collections::BTreeMap<_, _>>()),
                "podPhase": s.pod.as_ref().map(|p| p.phase.clone()),
                "podDeleting": s.pod.as_ref().map(|p| p.deleting),
                "containerID": e.container_id,
                "ifname": e.ifname,
                "hostInterface": e.host_ifname,
                "hostIfindex": s.host_ifindex,
                "addresses": e.addresses,
                "bpfAttached": s.bpf_attached,
                "state": s.state,
                "counters": s.counters.as_ref().map(|c| serde_json::json!({
                    "fromPodPackets": c.from_pod_packets,
                    "fromPodBytes": c.from_pod_bytes,
                    "toPodPackets": c.to_pod_packets,
                    "toPodBytes": c.to_pod_bytes,
                })),
            })
        })
        .collect();
    serde_json::json!({ "node": resp.node, "endpoints": eps })
}

pub(crate) fn endpoints_table(resp: &pb::ListResponse) -> String {
    let rows: Vec<Vec<String>> = resp
        .endpoints
        .iter()
        .map(|s| {
            let e = s.endpoint.clone().unwrap_or_default();
            let (tx, rx) = match &s.counters {
                Some(c) => (
                    format!(
                        "{} pkts / {}",
                        c.from_pod_packets,
                        human_bytes(c.from_pod_bytes)
                    ),
                    format!(
                        "{} pkts / {}",
                        c.to_pod_packets,
                        human_bytes(c.to_pod_bytes)
                    ),
                ),
                None => ("-".into(), "-".into()),
            };
            vec![
                pod_name(&e),
                e.addresses.join(","),
                e.host_ifname,
                if s.bpf_attached { "ebpf" } else { "kernel" }.into(),
                if s.state.is_empty() { "-" } else { &s.state }.into(),
                tx,
                rx,
            ]
        })
        .collect();
    let mut out = table(
        &[
            "POD",
            "ADDRESSES",
            "HOST IFACE",
            "DATAPLANE",
            "STATE",
            "FROM POD",
            "TO POD",
        ],
        &rows,
    );
    let not_ok = resp
        .endpoints
        .iter()
        .filter(|s| !s.state.is_empty() && s.state != "ok")
        .count();
    out.push_str(&format!(
        "\n{} endpoint(s) on node {}",
        resp.endpoints.len(),
        resp.node
    ));
    if not_ok > 0 {
        out.push_str(&format!(
            ", {not_ok} not in their desired state (STATE says why)"
        ));
    }
    out
}
