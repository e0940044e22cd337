//! The dataplane report, rendered from made-up samples.
use super::*;
use crate::bench::harness::{around, render};

#[test]
fn the_report_renders() {
    let reps = 3;
    let res = [1.2, 1.0, 0.9, 1.3, 1.25, 1.15, 1.1].map(|k| Samples::fake(k, reps));
    let mut cost: [Cost; SLOTS] = Default::default();
    for (v, ns) in [
        (Variant::Ebpf, 90.0),
        (Variant::EbpfClsBpf, 95.0),
        (Variant::Floor, 40.0),
        (Variant::Baseline, 100.0),
    ] {
        cost[v as usize] = Cost {
            from_pod_ns: around(ns, reps),
            from_pod_runs: around(1e6, reps),
            to_pod_runs: around(0.0, reps),
        };
    }
    let mut attach: [Attach; SLOTS] = Default::default();
    for (v, ns) in [(Variant::Ebpf, 300.0), (Variant::EbpfClsBpf, 340.0)] {
        attach[v as usize] = Attach {
            ns_per_packet: around(ns, reps),
            mpps: around(1e3 / ns, reps),
        };
    }
    let r = Report {
        reps,
        secs: 3,
        quick: false,
        cpu: 1,
        tw_delay: true,
        plugins_version: "1.1.1".into(),
        iperf_version: "iperf 3.18".into(),
        res,
        cost,
        attach,
        baseline: Some("main~1 (abc)".into()),
        bench: Bench::fake(),
    };
    let md = r.markdown();
    let svg = render("dataplane", &md, |p| chart(p, &r));
    assert!(md.starts_with("# Same-node pod-to-pod dataplane"));
    assert!(md.contains("| calix eBPF, cls_bpf |"));
    // This build against its baseline: 90 ns over 100 ns per packet; its traffic 1.2 over 1.1.
    assert!(md.contains("| calix eBPF, baseline |"), "{md}");
    assert!(md.contains("`from_pod` over the baseline's: 0.90×"), "{md}");
    assert!(md.contains("| calix eBPF / calix eBPF, baseline |"), "{md}");
    assert!(svg.contains("calix eBPF") && svg.contains("TCP_RR round trip"));
}
