//! What calix has on a node, seen from outside as an operator would look: the conflist in the
//! node's CNI config dir, the pins under the bpffs, the routes of calix's protocol (202), the
//! VXLAN devices, the nftables tables, BPF programs on any device and `cali*` links.
use std::path::PathBuf;

use calix_testbed::Netns;
use serde_json::Value;

/// Where one node keeps calix's files (the chart's host paths, per node).
pub struct NodePaths {
    pub conflist: PathBuf,
    pub pins: PathBuf,
}

/// Every piece of calix on the node, each as a line an operator can act on; empty: none.
pub fn calix_on(ns: &Netns, paths: &NodePaths) -> Vec<String> {
    let mut found = Vec::new();
    if paths.conflist.exists() {
        found.push(format!("the conflist {}", paths.conflist.display()));
    }
    if paths.pins.exists() {
        found.push(format!("the pins {}", paths.pins.display()));
    }
    for family in ["-4", "-6"] {
        for r in json(ns, &["ip", "-j", family, "route", "show", "proto", "202"]) {
            found.push(format!("route {} (proto 202)", r["dst"]));
        }
    }
    for l in json(ns, &["ip", "-j", "link", "show"]) {
        let name = l["ifname"].as_str().unwrap_or_default();
        if name.contains("calix") || name.starts_with("cali") {
            found.push(format!("link {name}"));
        }
    }
    let tables = json(ns, &["nft", "-j", "list", "tables"]);
    for t in tables
        .iter()
        .filter_map(|t| t["table"]["name"].as_str())
        .filter(|n| n.contains("calix"))
    {
        found.push(format!("nftables table {t}"));
    }
    // Every device's tc (cls_bpf and tcx) and XDP programs (tcx from the kernel: Debian's
    // bpftool does not list tcx links).
    match calix_testbed::bpf::attached(ns) {
        Ok(progs) => found.extend(
            progs
                .iter()
                .map(|p| format!("{} program {} on {}", p.hook, p.name, p.dev)),
        ),
        Err(e) => found.push(format!("cannot list the BPF programs: {e}")),
    }
    found
}

/// `argv`'s JSON output in `ns` as an array (none when it fails or prints nothing).
fn json(ns: &Netns, argv: &[&str]) -> Vec<Value> {
    let out = ns.exec(argv);
    serde_json::from_slice::<Value>(&out.stdout)
        .ok()
        .and_then(|v| match v {
            Value::Array(a) => Some(a),
            Value::Object(o) => o.get("nftables").and_then(|n| n.as_array()).cloned(),
            _ => None,
        })
        .unwrap_or_default()
}
