//! `cargo bench -p calix-dataplane --bench policy_packets` (a part of `cargo xtask bench
//! policy`): where a same-node connection's NetworkPolicy time goes, packet by packet. Pod A
//! opens a TCP connection to pod B on one node and both close it: SYN, SYN-ACK, ACK, A's FIN,
//! B's FIN, the last ACK, each sent through `from_pod` with BPF_PROG_TEST_RUN on CPU 0, and
//! the kernel's own run time of each (one run, ns) averaged over the connections. Variants, each
//! its own programs and maps in a network namespace of its own, interleaved per repetition: no
//! policy, and A and B isolated both ways by rules that let every TCP packet between them
//! through (the pair cache passes their established segments), with the IPv4 flow table at its
//! default size and at two smaller ones: what a connection's entry costs beyond its work is the
//! table's memory (its buckets and entries out of the CPU's caches).
//!
//! Prints a markdown section on stdout, progress on stderr. Needs root. `--reps N`,
//! `--conns N` (measured connections per variant and repetition).

// The helpers this shares with the program tests: not all of them are used here.
#![allow(dead_code)]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/harness.rs"]
mod harness;
#[path = "../tests/common/policed.rs"]
mod policed;

use std::sync::{Arc, Mutex};

use calix_common::{DEFAULT_POLICY_FLOWS, POLICY_FLOWS_V4_MAP, PROG_FROM_POD};
use calix_core::policy::cluster::Change;
use common::*;
use harness::*;
use policed::*;

const FIN_ACK: u8 = 0x11;
/// Connections run before the measured ones, per variant and repetition.
const WARM_UP: u32 = 500;
/// The packets of one connection: (name, A sends it, TCP flags).
const PACKETS: [(&str, bool, u8); 6] = [
    ("SYN (A opens)", true, SYN),
    ("SYN-ACK", false, SYN_ACK),
    ("ACK (established)", true, ACK),
    ("A's FIN", true, FIN_ACK),
    ("B's FIN", false, FIN_ACK),
    ("the last ACK", true, ACK),
];

/// A variant: its name, whether A and B are isolated, the IPv4 flow table's size.
struct Variant {
    name: String,
    policed: bool,
    flows: u32,
}

fn variants() -> Vec<Variant> {
    let mut v = vec![Variant {
        name: "no policy".into(),
        policed: false,
        flows: DEFAULT_POLICY_FLOWS,
    }];
    for (flows, note) in [
        (DEFAULT_POLICY_FLOWS, " (default)"),
        (16_384, ""),
        (1_024, ""),
    ] {
        v.push(Variant {
            name: format!("policy, flow table {flows}{note}"),
            policed: true,
            flows,
        });
    }
    v
}

/// The mean run time (ns) of each of `PACKETS` over `conns` connections of variant `v`.
fn measure(v: &Variant, conns: u32) -> [f64; 6] {
    let out = Arc::new(Mutex::new([0.0; 6]));
    let (policed, flows, o) = (v.policed, v.flows, out.clone());
    in_netns(move || {
        let mut cpus = nix::sched::CpuSet::new();
        cpus.set(0).expect("CPU 0");
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus)
            .expect("sched_setaffinity");
        let (mut h, a, b) = setup_sized(&[(POLICY_FLOWS_V4_MAP, flows)]);
        let mut p = Policed::new(&mut h, &a, &b);
        if policed {
            p.apply(Change::Policy(a_with_b()));
            p.apply(Change::Policy(policy(
                vec![],
                Some(vec![app_rule("a", vec![])]),
            )));
        }
        let mut sums = [0u64; 6];
        for i in 0..WARM_UP + conns {
            let port = 10_000 + (i % 50_000) as u16;
            for (k, &(name, from_a, flags)) in PACKETS.iter().enumerate() {
                let (from, to, l4) = if from_a {
                    (&a, &b, tcp(port, 81, flags))
                } else {
                    (&b, &a, tcp(81, port, flags))
                };
                let frame = Ip4::new(from.v4, to.v4, TCP, l4).sent_by(from);
                let run = h.run(PROG_FROM_POD, from.ifindex, &frame);
                assert_eq!(run.verdict, TC_ACT_REDIRECT, "{name}: delivered");
                if i >= WARM_UP {
                    sums[k] += u64::from(run.duration_ns);
                }
            }
        }
        let mut means = [0.0; 6];
        for (m, s) in means.iter_mut().zip(sums) {
            *m = s as f64 / f64::from(conns);
        }
        *o.lock().expect("results") = means;
    });
    let means = *out.lock().expect("results");
    means
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn arg(args: &[String], name: &str, default: u32) -> u32 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps = arg(&args, "--reps", 5).max(1);
    let conns = arg(&args, "--conns", 20_000).max(1);
    let vs = variants();
    // [variant][packet] → one mean per repetition.
    let mut runs: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); PACKETS.len()]; vs.len()];
    for rep in 1..=reps {
        for (i, v) in vs.iter().enumerate() {
            eprintln!("[packets {rep}/{reps}] {}: {conns} connections", v.name);
            for (k, m) in measure(v, conns).into_iter().enumerate() {
                runs[i][k].push(m);
            }
        }
    }
    let med: Vec<Vec<f64>> = runs
        .into_iter()
        .map(|v| v.into_iter().map(median).collect())
        .collect();
    let mut s = format!(
        "## Per packet kind (BPF_PROG_TEST_RUN)\n\nWhere a same-node connection's policy time \
         goes: pod A opens a TCP connection to pod B on one node and both close it, each packet \
         sent through `from_pod` with BPF_PROG_TEST_RUN on CPU 0 (the kernel's own run time of \
         one run, which includes its timer's reads: compare within the table). With policy, A \
         and B isolated both ways by rules that let every TCP packet between them through (the \
         pair cache passes their established segments); the IPv4 flow table at its default \
         size and two smaller ones. Means over {conns} connections per variant and repetition \
         (after {WARM_UP} unmeasured), medians of {reps} repetitions, the variants \
         interleaved; in parentheses, ns above no policy.\n\n| packet |"
    );
    for v in &vs {
        s.push_str(&format!(" {} |", v.name));
    }
    s.push_str("\n|---|");
    s.push_str(&"---|".repeat(vs.len()));
    s.push('\n');
    let cell = |i: usize, x: f64, base: f64| {
        if i == 0 {
            format!(" {x:.0} ns |")
        } else {
            format!(" {x:.0} ns ({:+.0}) |", x - base)
        }
    };
    for (k, &(name, _, _)) in PACKETS.iter().enumerate() {
        s.push_str(&format!("| {name} |"));
        for (i, m) in med.iter().enumerate() {
            s.push_str(&cell(i, m[k], med[0][k]));
        }
        s.push('\n');
    }
    s.push_str("| **the connection** |");
    let total = |m: &Vec<f64>| m.iter().sum::<f64>();
    for (i, m) in med.iter().enumerate() {
        s.push_str(&cell(i, total(m), total(&med[0])));
    }
    s.push('\n');
    println!("{s}");
}
