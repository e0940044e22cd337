//! The IPAM bench's report: the markdown and the chart.
use std::path::Path;

use anyhow::Result;

use super::samples::{fmt_rate, rate_spread, Floors, Samples};
use super::{
    Variant, BLOCK_SIZE, CALIX, CALIX_POOL, FSYNC_LINE, HOST_LOCAL_SUBNET, IN_FLIGHT, VARIANTS,
};
use crate::bench::chart::{self, Layout, Panel};
use crate::bench::harness::{Bench, Compared};
use crate::bench::report::{fmt_ms, heading, load_note, loads, median, percentile, ratio};

pub(super) struct Report {
    pub(super) allocs: usize,
    pub(super) reps: usize,
    pub(super) plugins_version: String,
    pub(super) etcd_version: String,
    pub(super) res: [Samples; 4],
    pub(super) floors: Floors,
    pub(super) bench: Bench,
}

impl Report {
    fn get(&self, v: Variant) -> &Samples {
        &self.res[v as usize]
    }

    /// `<variant> <f(samples)>` for every variant, comma-separated.
    fn per_variant(&self, f: impl Fn(&Samples) -> String) -> String {
        VARIANTS
            .iter()
            .map(|&v| format!("{} {}", v.label(), f(self.get(v))))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn row(&self, v: Variant) -> String {
        let s = self.get(v);
        format!(
            "| {} | {} | {} | {} | {} | {} ms | {} | {} ms | {} |\n",
            v.label(),
            rate_spread(&s.seq),
            rate_spread(&s.conc),
            rate_spread(&s.rel),
            s.alloc.p50(),
            fmt_ms(s.alloc.p(99.0)),
            s.release.p50(),
            fmt_ms(s.release.p(99.0)),
            loads(&s.load),
        )
    }

    fn ratio_row(&self, v: Variant) -> String {
        let (c, h) = (self.get(v), self.get(Variant::HostLocal));
        let med = median;
        let pct = |s: &Samples, p: f64, rel: bool| match rel {
            true => s.release.p(p),
            false => s.alloc.p(p),
        };
        format!(
            "| {} / host-local | {} | {} | {} | {} | {} | {} | {} | |\n",
            v.label(),
            ratio(med(&c.seq), med(&h.seq)),
            ratio(med(&c.conc), med(&h.conc)),
            ratio(med(&c.rel), med(&h.rel)),
            ratio(pct(c, 50.0, false), pct(h, 50.0, false)),
            ratio(pct(c, 99.0, false), pct(h, 99.0, false)),
            ratio(pct(c, 50.0, true), pct(h, 50.0, true)),
            ratio(pct(c, 99.0, true), pct(h, 99.0, true)),
        )
    }

    pub(super) fn markdown(&self) -> String {
        let f = &self.floors;
        let n = self.allocs;
        let mut s = heading(
            "IPAM allocations per second: calix (embedded, etcd, kubernetes) vs host-local",
            false,
        );
        s.push_str(&format!(
            "{} (release build, `calix-agent --dataplane kernel`, pool \
             {CALIX_POOL} in /{BLOCK_SIZE} blocks); the etcd backend against etcd {} (one member on \
             127.0.0.1, data on the same disk); the kubernetes backend against kube-apiserver \
             v1.36.2 (upstream, watch cache on) on its own etcd {}, both on 127.0.0.1 of a \
             namespace of their own (its IPAM objects kept across repetitions); `host-local` from Debian's \
             containernetworking-plugins {} (a {HOST_LOCAL_SUBNET} range). Every datastore is \
             in /tmp, on the root ext4 disk.\n\n",
            self.bench
                .measured(&format!("ipam --allocs {n} --reps {}", self.reps)),
            self.etcd_version,
            self.etcd_version,
            self.plugins_version,
        ));
        s.push_str(&format!(
            "**calix** is driven through its gRPC API (`calix.v1.Ipam/Allocate`, IPv4 only, a \
             unique handle per call; `Release`) on the agent's unix socket, from the bench \
             process over one HTTP/2 connection, each call timed client-side. **host-local is a \
             process per allocation**: fork, exec `/usr/lib/cni/host-local` with \
             `CNI_COMMAND=ADD` (a unique container ID) and the network config on stdin, wait for \
             its exit — the reference the issue asks for, so its numbers include process \
             creation and the Go runtime's start, which calix's numbers here do not (calix's own \
             CNI plugin is a process per ADD too: see [cni.md](cni.md)).\n\n\
             Per variant and repetition, from a fresh state (a new agent with its own directory \
             and datastore, a new etcd key prefix, a new host-local `dataDir`) after one untimed \
             warm-up allocation: {n} sequential allocations, the same {n} released sequentially, \
             {n} fresh allocations with {IN_FLIGHT} in flight ({IN_FLIGHT} tasks on the one \
             connection; {IN_FLIGHT} host-local processes at a time), released untimed; then \
             nothing may be left allocated. The sequential phase claims a block every 64 \
             allocations; the in-flight phase reuses those (empty, affine) blocks. The agent's \
             housekeeping runs hourly, so never during a measurement. {} repetitions with the \
             variants interleaved (order reversed every other repetition). Rates are \
             allocations (releases) per second of wall time, median [min–max] over repetitions; \
             latencies are per call, p50/p99 over all {} sequential calls with the [min–max] of \
             the per-repetition p50s; the 1-minute load average before each variant.\n\n",
            self.reps,
            n * self.reps,
        ));
        s.push_str(&format!(
            "| variant | sequential alloc/s | {IN_FLIGHT} in flight alloc/s | release/s | \
             alloc p50 | alloc p99 | release p50 | release p99 | load before |\n"
        ));
        s.push_str("|---|---|---|---|---|---|---|---|---|\n");
        for v in VARIANTS {
            s.push_str(&self.row(v));
        }
        for v in CALIX {
            s.push_str(&self.ratio_row(v));
        }
        s.push_str(
            "\nRatios are calix / host-local: above 1× is faster for rates, below 1× is faster \
             for latencies.\n",
        );
        s.push_str(&format!(
            "\n- {IN_FLIGHT} in flight against sequential (median rates): {}.\n",
            self.per_variant(|x| ratio(median(&x.conc), median(&x.seq)))
        ));
        s.push_str(&format!(
            "- 1 / the {IN_FLIGHT}-in-flight rate (what an allocation costs once the RPC work \
             overlaps; calix: about the time it holds the agent's lock): {}.\n",
            self.per_variant(|x| format!("{} ms", fmt_ms(1e3 / median(&x.conc))))
        ));
        s.push_str(&format!(
            "- Sequential allocation p50, first tenth → last tenth of each repetition (the \
             addresses held grow from 0 to {n}): {}.\n",
            self.per_variant(|x| format!(
                "{} → {} ms",
                fmt_ms(percentile(&x.first_tenth, 50.0)),
                fmt_ms(percentile(&x.last_tenth, 50.0))
            ))
        ));
        let journal = &self.get(Variant::Embedded).journal_per_alloc;
        if !journal.is_empty() {
            s.push_str(&format!(
                "- The embedded journal grew by {:.0} bytes per sequential allocation (one \
                 transaction: the block record and the handle record, fdatasync'd).\n",
                median(journal)
            ));
        }
        s.push_str("\nFloors, per call (the first two before the variants, load ");
        s.push_str(&loads(&f.load));
        s.push_str("; the gRPC ones in each calix run, before its allocations):\n\n");
        s.push_str("| floor | p50 | p99 |\n|---|---|---|\n");
        s.push_str(&f.truth.row(
            "fork+exec `/bin/true`, timed fork-to-exit (what every host-local call pays first)",
        ));
        s.push_str(&f.fsync.row(&format!(
            "append {FSYNC_LINE} B + `fdatasync` in /tmp (the least a durable allocation pays)"
        )));
        for v in CALIX {
            s.push_str(&self.get(v).rpc.row(&format!(
                "`calix.v1.Ipam/Status` round trip, {} agent (no datastore access: the gRPC \
                 floor of every call)",
                v.label().trim_start_matches("calix, ")
            )));
        }
        s.push_str(
            "\nWhat each allocation does. calix: one gRPC call; the agent takes its IPAM lock, \
             reads the handle key, picks an address in its in-memory block view, commits the \
             block alone with a compare-and-swap on its revision, then writes the handle record \
             (which follows the block); embedded: journal appends + one `fdatasync` (releases \
             append without fsync); etcd: a range and txn round trips to etcd, which fsyncs its \
             Raft WAL for every write (releases too); kubernetes: a GET of the handle object, a \
             PUT of the block object carrying its resourceVersion and the handle object's \
             create or replace, each an HTTPS request the API server turns into an etcd \
             transaction. Allocations are serialized on the agent's lock, so calls in flight \
             overlap only their RPC work. host-local: a process; `flock` on the `dataDir`, then \
             it reads every address file it holds (looking for the container ID's earlier \
             allocation: the cost grows with the addresses held), creates one file for the new \
             address and rewrites `last_reserved_ip`, no fsync.\n",
        );
        let all_loads: Vec<f64> = self
            .res
            .iter()
            .flat_map(|r| r.load.iter())
            .chain(&f.load)
            .copied()
            .collect();
        if let Some(note) = load_note(&all_loads) {
            s.push_str(&note);
        }
        s.push_str("\n![IPAM allocations per second](ipam.svg)\n");
        s
    }
}

pub(super) fn chart(path: &Path, r: &Report) -> Result<()> {
    let rates = |s: &Samples| vec![Some(median(&s.seq)), Some(median(&s.conc))];
    let series = VARIANTS
        .iter()
        .map(|&v| (v.label(), v.color(), rates(r.get(v))))
        .collect();
    let host_local = rates(r.get(Variant::HostLocal));
    let label = move |si: usize, gi: usize, v: f64| {
        if VARIANTS[si] == Variant::HostLocal {
            fmt_rate(v)
        } else {
            let reference = host_local[gi].unwrap_or(f64::NAN);
            format!("{} ({})", fmt_rate(v), ratio(v, reference))
        }
    };
    let in_flight = format!("{IN_FLIGHT} in flight");
    chart::chart(
        path,
        (900, 460),
        &format!(
            "IPAM allocations/s, calix vs host-local ({} allocations × {} reps, {})",
            r.allocs, r.reps, r.bench.machine.date
        ),
        Layout::Grid(1, 1),
        &[Panel::new(
            "allocations per second (median); calix labels: ratio to host-local",
            "allocations/s",
            &["sequential", &in_flight],
            series,
            label,
        )],
    )
}
