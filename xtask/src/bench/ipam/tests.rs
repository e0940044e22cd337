//! The IPAM report, rendered from made-up samples.
use super::*;
use crate::bench::harness::{around, render};
use crate::bench::report::Calls;

#[test]
fn the_report_renders() {
    let reps = 2;
    let samples = |rate: f64, journal: bool| Samples {
        seq: around(rate, reps),
        conc: around(1.5 * rate, reps),
        rel: around(2.0 * rate, reps),
        alloc: Calls::fake(1e3 / rate, reps),
        release: Calls::fake(500.0 / rate, reps),
        rpc: Calls::fake(0.1, reps),
        first_tenth: around(1e3 / rate, 10),
        last_tenth: around(1.2e3 / rate, 10),
        journal_per_alloc: if journal {
            around(300.0, reps)
        } else {
            Vec::new()
        },
        load: around(0.5, reps),
    };
    let r = Report {
        allocs: 1000,
        reps,
        plugins_version: "1.1.1".into(),
        etcd_version: "3.5.16".into(),
        res: [
            samples(2500.0, true),
            samples(400.0, false),
            samples(150.0, false),
            samples(300.0, false),
        ],
        floors: Floors {
            truth: Calls::fake(0.6, reps),
            fsync: Calls::fake(1.5, reps),
            load: around(0.3, reps),
        },
        bench: Bench::fake(),
    };
    let md = r.markdown();
    let svg = render("ipam", &md, |p| chart(p, &r));
    assert!(md.starts_with("# IPAM allocations per second"));
    assert!(svg.contains("calix, kubernetes") && svg.contains("host-local"));
}
