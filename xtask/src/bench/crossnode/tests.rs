//! The cross-node report, rendered from made-up samples.
use super::path::{PathRun, Prog};
use super::*;
use crate::bench::harness::render;

#[test]
fn the_report_renders() {
    let reps = 3;
    let res = [1.5, 1.0, 1.1, 0.8, 0.9, 0.85, 1.0, 0.75].map(|k| Samples::fake(k, reps));
    let paths = variants(true)
        .iter()
        .map(|v| PathRun {
            conns: 50_000.0,
            fwd: if v.ebpf() { [0.0, 0.0] } else { [10.0, 10.0] },
            progs: if v.ebpf() {
                vec![Prog {
                    node: 0,
                    name: "from_pod".into(),
                    at: vec!["cali1234/tcx_ingress".into()],
                    runs: 250_000,
                    ns: 25_000_000,
                }]
            } else {
                Vec::new()
            },
            rr_bpf_ns: if v.ebpf() { 900.0 } else { f64::NAN },
            profile: vec![(12.5, "tcp_v4_rcv".into()), (3.0, "bpf_prog_run".into())],
        })
        .collect();
    let r = Report {
        reps,
        secs: 3,
        quick: true,
        cpu: 1,
        tw_delay: false,
        iperf_version: "iperf 3.18".into(),
        res,
        paths,
        baseline: Some("main~1 (abc)".into()),
        bench: Bench::fake(),
    };
    let md = r.markdown();
    let svg = render("crossnode", &md, |p| chart(p, &r));
    assert!(md.starts_with("# Cross-node pod to pod"));
    assert!(md.contains("## Where the time goes"));
    assert!(svg.contains("plain VXLAN (flannel-like)"));
    assert!(md.contains("| calix eBPF, VXLAN, baseline |"), "{md}");
    assert!(
        md.contains("calix eBPF, VXLAN / calix eBPF, VXLAN, baseline"),
        "{md}"
    );
}
