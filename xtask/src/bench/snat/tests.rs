//! The snat bench's frames, rules, config, and its report rendered from made-up samples.
use calix_testbed::packets::ETH_P_IP;
use serde_json::Value;

use super::drops::{flood_frame, nft_counter};
use super::*;

#[test]
fn the_report_renders() {
    use crate::bench::harness::{around, render};
    let reps = 2;
    let drops = |ns: f64| DropSamples {
        sent_rate: around(2e6, reps),
        drop_rate: around(1e9 / ns, reps),
        share: around(99.0, reps),
        softirq_ns: around(ns / 2.0, reps),
        total_ns: around(ns, reps),
        ksoftirqd: around(30.0, reps),
        load: around(1.2, reps),
        others_busy: around(4.0, reps),
    };
    for calix_snat in [true, false] {
        let mut unavailable = vec![None; VARIANTS.len()];
        if !calix_snat {
            unavailable[Variant::CalixSnat as usize] = Some("no SNAT on this kernel".into());
        }
        let r = Report {
            reps,
            secs: 3,
            quick: false,
            iperf_version: "iperf 3.18".into(),
            nft_version: "nftables v1.1.1".into(),
            iptables_version: "iptables v1.8.11 (nf_tables)".into(),
            unavailable,
            snat_config: None,
            snat_args: calix_snat.then(|| "--dataplane ebpf".into()),
            snat_agent_config: agent_config(true, true, None, None),
            res: [1.0, 1.1, 0.8, 0.85, 0.95].map(|k| Samples::fake(k, reps)),
            dres: [40.0, 90.0, 120.0, 200.0, 30.0].map(drops),
            xdp_prog_ns: [Some(25.0), Some(30.0), None, None, None],
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let name = if calix_snat {
            "snat"
        } else {
            "snat-unavailable"
        };
        let svg = render(name, &md, |p| chart(p, &r));
        assert!(md.starts_with("# "));
        assert!(svg.contains("CPU ns per dropped packet"));
    }
}

#[test]
fn the_flood_frame_is_a_valid_udp_packet() {
    let f = flood_frame([2; 6], [4; 6], ETH_P_IP);
    assert_eq!(f.len(), 60);
    assert_eq!(&f[12..14], &[0x08, 0x00]);
    // A header with its checksum sums to 0xffff: the checksum of it is 0.
    assert_eq!(calix_testbed::packets::ipv4_checksum(&f[14..34]), 0);
    assert_eq!(&f[26..30], &FLOOD_SRC.octets());
    assert_eq!(u16::from_be_bytes([f[36], f[37]]), FLOOD_PORT);
}

#[test]
fn nft_counters_are_summed_from_json() {
    let v: Value = serde_json::from_str(
        r#"{"nftables":[{"metainfo":{}},{"table":{"family":"netdev"}},
        {"rule":{"expr":[{"match":{}},{"counter":{"packets":5,"bytes":300}},{"drop":null}]}}]}"#,
    )
    .unwrap_or_default();
    assert_eq!(nft_counter(&v), 5.0);
}

#[test]
fn agent_config_has_keys_before_tables() {
    let c = agent_config(true, true, None, Some("[nat]\nfoo = 1"));
    let first_table = c.find("\n[").unwrap_or(0);
    assert!(c.find("uplinks").is_some_and(|i| i < first_table));
    assert!(c.contains("natOutgoing = true"));
    assert!(c.trim_end().ends_with("foo = 1"));
}
