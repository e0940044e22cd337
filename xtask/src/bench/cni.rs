//! `cargo xtask bench cni`: CNI ADD and DEL latency, calix against Debian's reference `ptp` +
//! `host-local`, with the floors next to them, in one run (DESIGN.md §10).
//!
//! Every plugin call is exec'd the way a runtime in the node's namespace does it (fork, `setns`
//! into the node namespace, exec `<plugin>` with a clean CNI environment and the network config
//! on stdin) and timed fork-to-exit. Each variant has its own node namespace (calix: a test-bed
//! node with a release `calix-agent`, eBPF dataplane); the pod namespaces are created once,
//! before any timing, and shared: every phase leaves them empty.
//!
//! One repetition runs, in order: the floors (`/bin/true`, `/bin/true` exec'd into the node
//! namespace, `ip link del <veth>` exec'd into the node namespace over pre-created pod-like
//! veths: peer in a pod namespace, both ends up, an address and a /32 route), then calix and
//! ptp in an order that alternates between repetitions. Per variant: the load average, `pods`
//! sequential ADDs, `pods` sequential DELs, then 20 and 50 concurrent ADDs (wall time; cleaned
//! up by concurrent DELs, untimed).
//!
//! Writes docs/bench/cni.md and docs/bench/cni.svg. Everything it creates is named
//! `cxb-<pid>-…` and removed on drop, on error too.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Result};
use calix_testbed::traffic::cpu::load_average;
use calix_testbed::{Call, Dataplane, Netns, Plugin, CNI_DIR, NODE_IP};
use serde_json::json;

use super::chart::{self, Layout, Panel};
use super::harness::{cni_plugins_version, order, repetition, timed_cmd, true_floor, Bench};
use super::report::{
    fmt_ms, fmt_spread, heading, load_note, loads, median, percentile, ratio, targets, Calls,
};
use crate::util::{self, output, run as run_cmd};

const PTP_SUBNET: &str = "10.245.0.0/16";
const CONCURRENCY: [usize; 2] = [20, 50];

/// The target the plugin is built for: musl, a static executable (`cargo xtask setup` adds it).
const STATIC_TARGET: &str = crate::setup::MUSL_TARGET;

/// Builds the plugin the way it ships: a static musl executable. A CNI plugin is a process per
/// call, so its start-up is per-call cost: the dynamic glibc build spent ~0.8 ms of CPU per ADD
/// in the loader (three libraries, relocations, libgcc_s's CPUID probes, each a VM exit on a
/// virtual machine), and a static glibc build still ~0.2 ms more than musl in glibc's start-up
/// CPUID probing of the cache sizes (docs/decisions.md, "CNI concurrency"). `--target` keeps
/// the build in its own directory.
fn build_static_plugin() -> Result<PathBuf> {
    let root = util::workspace_root();
    run_cmd(Command::new(env!("CARGO")).current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "calix-cni",
        "--bin",
        "calix",
        "--target",
        STATIC_TARGET,
    ]))?;
    Ok(root
        .join("target")
        .join(STATIC_TARGET)
        .join("release")
        .join("calix"))
}

/// Fails when `veth` links are left in `node` (there must be none between phases).
fn no_veths_left(node: &Netns, label: &str, after: &str) -> Result<()> {
    let out =
        output(Command::new("ip").args(["-n", &node.name, "-o", "link", "show", "type", "veth"]))?;
    let left = out.lines().filter(|l| !l.trim().is_empty()).count();
    if left != 0 {
        bail!("{label}: {left} veth(s) left in the node after {after}");
    }
    Ok(())
}

fn pod_call(command: &'static str, rep: usize, tag: &str, i: usize, pod: &Netns) -> Call<'static> {
    let container_id = format!("cxb{rep}{tag}{i:04}0123456789abcdef");
    let args = format!(
        "K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID=00000000-0000-0000-0000-{i:012};\
         IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-{tag}-{i}"
    );
    Call::new(command, container_id, pod.path(), args)
}

/// What one variant measured over every repetition.
#[derive(Default)]
struct Samples {
    add: Calls,
    del: Calls,
    /// Per repetition: the walls of 20 and 50 concurrent ADDs.
    conc: [Vec<f64>; 2],
    load: Vec<f64>,
}

impl Samples {
    fn conc_median(&self, k: usize) -> f64 {
        median(&self.conc[k])
    }
}

/// The floors over every repetition.
#[derive(Default)]
struct Floors {
    truth: Calls,
    nsexec: Calls,
    link_del: Calls,
    load: Vec<f64>,
}

fn run_floors(f: &mut Floors, floor_node: &Netns, pods: &[Netns], n: usize) -> Result<String> {
    f.load.push(load_average());
    let t50 = f.truth.push(true_floor(n, None)?);
    let n50 = f.nsexec.push(true_floor(n, Some(floor_node))?);
    // Veths like a pod's, set up untimed: the peer in the pod's namespace, both ends up, an
    // address on the pod end and a /32 scope-link route on the host end.
    let addr = |i: usize| format!("10.246.{}.{}", (i + 1) / 256, (i + 1) % 256);
    let script: String = pods[..n]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "link add cxbf{i} type veth peer name eth0 netns {}\nlink set cxbf{i} up\n\
                 route add {}/32 dev cxbf{i} scope link\n",
                p.name,
                addr(i)
            )
        })
        .collect();
    floor_node.ip_batch(&script)?;
    for (i, p) in pods[..n].iter().enumerate() {
        p.ip_batch(&format!(
            "addr add {}/32 dev eth0\nlink set eth0 up\n",
            addr(i)
        ))?;
    }
    let mut del = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("cxbf{i}");
        del.push(timed_cmd(
            floor_node
                .command("/usr/sbin/ip")?
                .args(["link", "del", &name]),
        )?);
    }
    let d50 = f.link_del.push(del);
    Ok(format!(
        "(load {:.2}): /bin/true p50 {} ms, /bin/true in node netns p50 {} ms, ip link del p50 {} ms",
        f.load.last().copied().unwrap_or(f64::NAN),
        fmt_ms(t50),
        fmt_ms(n50),
        fmt_ms(d50),
    ))
}

fn run_variant(
    p: &Plugin,
    node: &Netns,
    tag: &str,
    s: &mut Samples,
    rep: usize,
    pods: &[Netns],
    n: usize,
) -> Result<String> {
    let load = load_average();
    s.load.push(load);
    let sequential = |command| -> Result<Vec<f64>> {
        let calls = pods[..n].iter().enumerate();
        Ok(calls
            .map(|(i, ns)| p.timed(&pod_call(command, rep, tag, i, ns)))
            .collect::<Result<_, _>>()?)
    };
    let (add, del) = (sequential("ADD")?, sequential("DEL")?);
    no_veths_left(node, &p.label, "DEL")?;
    let mut walls = [0.0; 2];
    for (k, &c) in CONCURRENCY.iter().enumerate() {
        let ctag = format!("{tag}c{c}x");
        let calls = |command| -> Vec<Call> {
            (0..c)
                .map(|i| pod_call(command, rep, &ctag, i, &pods[i]))
                .collect()
        };
        let wall = p.concurrent(&calls("ADD"));
        // Clean up even when an ADD failed (DEL is idempotent).
        let cleaned = p.concurrent(&calls("DEL"));
        walls[k] = wall?;
        cleaned?;
        s.conc[k].push(walls[k]);
    }
    no_veths_left(node, &p.label, "the concurrent DELs")?;
    let (a99, d99) = (percentile(&add, 99.0), percentile(&del, 99.0));
    let (a50, d50) = (s.add.push(add), s.del.push(del));
    Ok(format!(
        "(load {load:.2}): ADD p50 {} p99 {} ms, DEL p50 {} p99 {} ms, 20×ADD {} ms, 50×ADD {} ms",
        fmt_ms(a50),
        fmt_ms(a99),
        fmt_ms(d50),
        fmt_ms(d99),
        fmt_ms(walls[0]),
        fmt_ms(walls[1]),
    ))
}

/// Runs the bench; with `baseline` (a revision), calix built from it is a third variant.
pub fn run(pods: usize, reps: usize, baseline: Option<&str>) -> Result<()> {
    util::require_root("the CNI benchmark")?;
    if pods < 2 || reps < 1 {
        bail!("--pods must be at least 2 and --reps at least 1");
    }
    println!("[setup] prerequisites (cargo xtask setup)");
    crate::setup::run()?;
    let b = Bench::setup("the CNI benchmark", &[], &["ptp", "host-local"])?;
    println!("[setup] building the static plugin (--target {STATIC_TARGET})");
    let plugin = build_static_plugin()?;
    let base = baseline.map(super::baseline::calix).transpose()?;

    let n_ns = pods.max(CONCURRENCY[1]);
    println!("[setup] 3 node namespaces (calix, ptp, floor) and {n_ns} pod namespaces");
    let calix_node = b.node("calix", b.spec(Dataplane::Ebpf))?;
    let base_node = match &base {
        Some(base) => {
            let mut spec = b.spec(Dataplane::Ebpf);
            spec.bins = base.agent_bins.clone();
            Some(b.node("calixb", spec)?)
        }
        None => None,
    };
    let (ptp_node, floor_node) = (b.netns("ptp")?, b.netns("floor")?);
    for n in [&ptp_node, &floor_node] {
        n.ip(&format!("addr add {NODE_IP}/32 dev lo"))?;
    }
    let pod_ns = (0..n_ns)
        .map(|i| b.netns(&format!("p{i}")))
        .collect::<Result<Vec<_>>>()?;
    let calix_conf = json!({ "name": "cxb-calix", "mtu": 1500, "ipam": { "type": "calix-ipam" } });
    let calix = Plugin::new(
        "calix",
        plugin,
        Some(&calix_node.ns),
        &calix_node.conf(calix_conf.clone()),
    );
    let ptp_conf = json!({
        "cniVersion": "1.0.0", "name": "cxb-ptp", "type": "ptp", "ipMasq": false, "mtu": 1500,
        "ipam": {
            "type": "host-local",
            "subnet": PTP_SUBNET,
            "routes": [{ "dst": "0.0.0.0/0" }],
            "dataDir": b.dir.join("host-local").display().to_string(),
        },
    });
    let ptp = Plugin::new(
        "ptp + host-local",
        Path::new(CNI_DIR).join("ptp"),
        Some(&ptp_node),
        &ptp_conf,
    );

    let base_plugin = match (&base, &base_node) {
        (Some(base), Some(node)) => Some(Plugin::new(
            &format!("calix baseline {}", base.label),
            base.plugin.clone(),
            Some(&node.ns),
            &node.conf(calix_conf.clone()),
        )),
        _ => None,
    };

    // One untimed warm-up call of each (page cache, the agent's first connection).
    for p in [Some(&calix), Some(&ptp), base_plugin.as_ref()]
        .into_iter()
        .flatten()
    {
        p.timed(&pod_call("ADD", 0, "w", 0, &pod_ns[0]))?;
        p.timed(&pod_call("DEL", 0, "w", 0, &pod_ns[0]))?;
    }

    let mut floors = Floors::default();
    let mut res = [Samples::default(), Samples::default(), Samples::default()];
    let mut variants = vec![(&calix, &calix_node.ns, "c"), (&ptp, &ptp_node, "p")];
    if let (Some(p), Some(node)) = (&base_plugin, &base_node) {
        variants.push((p, &node.ns, "b"));
    }
    let indexes: Vec<usize> = (0..variants.len()).collect();
    for rep in 0..reps {
        repetition(
            rep,
            reps,
            &[()],
            |()| "floors".into(),
            |()| run_floors(&mut floors, &floor_node, &pod_ns, pods),
        )?;
        repetition(
            rep,
            reps,
            &order(&indexes, rep, variants.len() > 2),
            |v| variants[v].0.label.clone(),
            |v| {
                let (p, node, tag) = variants[v];
                run_variant(p, node, tag, &mut res[v], rep + 1, &pod_ns, pods)
            },
        )?;
    }
    let base_label = base_plugin.as_ref().map(|p| p.label.clone());
    drop((calix_node, ptp_node, floor_node, base_node, pod_ns));
    b.done();

    let [c, p, base] = res;
    let report = Report {
        pods,
        reps,
        plugins_version: cni_plugins_version(),
        calix: c,
        ptp: p,
        baseline: base_label.map(|l| (l, base)),
        floors,
        bench: b,
    };
    Bench::publish("cni", &report.markdown(), false, |p| chart(p, &report))
}

struct Report {
    pods: usize,
    reps: usize,
    plugins_version: String,
    calix: Samples,
    ptp: Samples,
    /// calix built from another revision, and what it measured.
    baseline: Option<(String, Samples)>,
    floors: Floors,
    bench: Bench,
}

/// A table row of `a`'s figures over `b`'s.
fn ratio_row(label: &str, a: &Samples, b: &Samples) -> String {
    format!(
        "| {label} | {} | {} | {} | {} | {} | {} | |\n",
        ratio(a.add.p(50.0), b.add.p(50.0)),
        ratio(a.add.p(99.0), b.add.p(99.0)),
        ratio(a.del.p(50.0), b.del.p(50.0)),
        ratio(a.del.p(99.0), b.del.p(99.0)),
        ratio(a.conc_median(0), b.conc_median(0)),
        ratio(a.conc_median(1), b.conc_median(1)),
    )
}

impl Report {
    fn row(&self, label: &str, s: &Samples) -> String {
        format!(
            "| {label} | {} | {} ms | {} | {} ms | {} | {} | {} |\n",
            s.add.p50(),
            fmt_ms(s.add.p(99.0)),
            s.del.p50(),
            fmt_ms(s.del.p(99.0)),
            fmt_spread(&s.conc[0]),
            fmt_spread(&s.conc[1]),
            loads(&s.load),
        )
    }

    fn link_del_p50(&self) -> f64 {
        self.floors.link_del.p(50.0)
    }

    fn targets(&self) -> Vec<(String, Option<bool>)> {
        let (c, p) = (&self.calix, &self.ptp);
        let floor = self.link_del_p50();
        vec![
            (
                format!(
                    "ADD p50 ≤ 0.5× ptp's: {} ms vs {} ms",
                    fmt_ms(c.add.p(50.0)),
                    fmt_ms(0.5 * p.add.p(50.0))
                ),
                Some(c.add.p(50.0) <= 0.5 * p.add.p(50.0)),
            ),
            (
                format!(
                    "ADD p99 ≤ ptp's p50: {} ms vs {} ms",
                    fmt_ms(c.add.p(99.0)),
                    fmt_ms(p.add.p(50.0))
                ),
                Some(c.add.p(99.0) <= p.add.p(50.0)),
            ),
            (
                format!(
                    "20 concurrent ADDs ≤ 0.5× ptp's wall: {} ms vs {} ms",
                    fmt_ms(c.conc_median(0)),
                    fmt_ms(0.5 * p.conc_median(0))
                ),
                Some(c.conc_median(0) <= 0.5 * p.conc_median(0)),
            ),
            (
                format!(
                    "DEL p50 ≤ 1.1× the `ip link del` floor: {} ms vs {} ms",
                    fmt_ms(c.del.p(50.0)),
                    fmt_ms(1.1 * floor)
                ),
                Some(c.del.p(50.0) <= 1.1 * floor),
            ),
        ]
    }

    fn markdown(&self) -> String {
        let (c, p) = (&self.calix, &self.ptp);
        let f = &self.floors;
        let floor = self.link_del_p50();
        let mut s = heading("CNI ADD/DEL latency: calix vs ptp + host-local", false);
        s.push_str(&format!(
            "{} (release build, the plugin static (musl) as it ships, `calix-agent` with the \
             eBPF dataplane and the embedded datastore); `ptp` + `host-local` from Debian's containernetworking-plugins \
             {} (`ipMasq: false`, a /16).\n\n",
            self.bench
                .measured(&format!("cni --pods {} --reps {}", self.pods, self.reps)),
            self.plugins_version
        ));
        s.push_str(&format!(
            "Fork-to-exit of `<plugin>` exec'd into the node's network namespace (fork, setns, exec: as a runtime in that namespace does) with the CNI environment and the \
             config on stdin; {} pods per variant and repetition (sequential ADDs, then sequential \
             DELs, each pod in its own network namespace, created before timing), {} repetitions \
             with the variants interleaved. p50/p99 over all {} calls; [min–max] of the \
             per-repetition p50s; concurrent walls as median [min–max] over repetitions; the \
             1-minute load average before each variant.\n\n",
            self.pods,
            self.reps,
            self.pods * self.reps
        ));
        s.push_str("| variant | ADD p50 | ADD p99 | DEL p50 | DEL p99 | 20×ADD wall | 50×ADD wall | load before |\n");
        s.push_str("|---|---|---|---|---|---|---|---|\n");
        s.push_str(&self.row("calix", c));
        s.push_str(&self.row("ptp + host-local", p));
        s.push_str(&ratio_row("calix / ptp", c, p));
        if let Some((label, b)) = &self.baseline {
            s.push_str(&self.row(label, b));
            s.push_str(&ratio_row("calix / its baseline", c, b));
        }
        let floor99 = f.link_del.p(99.0);
        for (label, v) in [("calix", c), ("ptp + host-local", p)] {
            s.push_str(&format!(
                "| {label} DEL / `ip link del` floor | | | {} | {} | | | |\n",
                ratio(v.del.p(50.0), floor),
                ratio(v.del.p(99.0), floor99),
            ));
        }
        if let Some((label, _)) = &self.baseline {
            s.push_str(&format!(
                "\n{label}: the plugin and agent built from that revision the same way (static \
                 musl plugin, release agent), on a node of their own, run as a third variant \
                 (the order of the three rotating between repetitions); \"calix / its \
                 baseline\" is this build over it.\n"
            ));
        }
        s.push_str("\nFloors, timed the same way (fork-to-exit), load before: ");
        s.push_str(&loads(&f.load));
        s.push_str(":\n\n| floor | p50 | p99 |\n|---|---|---|\n");
        s.push_str(&f.truth.row("fork+exec `/bin/true`"));
        s.push_str(
            &f.nsexec
                .row("fork+setns+exec `/bin/true` (the exec path of every call)"),
        );
        s.push_str(&f.link_del.row(
            "`ip link del <veth>` in the node namespace (a pod-like veth: peer in a pod \
             namespace, both ends up, addressed, routed)",
        ));
        s.push_str(&targets("Targets (issue 3):", &self.targets(), ""));
        let all_loads: Vec<f64> = [&c.load, &p.load, &f.load]
            .into_iter()
            .chain(self.baseline.as_ref().map(|(_, b)| &b.load))
            .flatten()
            .copied()
            .collect();
        if let Some(note) = load_note(&all_loads) {
            s.push_str(&note);
        }
        s.push_str("\n![CNI latency chart](cni.svg)\n");
        s
    }
}

// --- chart ---------------------------------------------------------------------------------

fn chart(path: &Path, r: &Report) -> Result<()> {
    let (c, p) = (&r.calix, &r.ptp);
    let floors = &r.floors.link_del;
    let per_call = Panel::new(
        "per call (ms)",
        "ms",
        &["ADD p50", "ADD p99", "DEL p50", "DEL p99"],
        vec![
            (
                "calix",
                chart::BLUE,
                [c.add.p(50.0), c.add.p(99.0), c.del.p(50.0), c.del.p(99.0)]
                    .map(Some)
                    .to_vec(),
            ),
            (
                "ptp + host-local",
                chart::ORANGE,
                [p.add.p(50.0), p.add.p(99.0), p.del.p(50.0), p.del.p(99.0)]
                    .map(Some)
                    .to_vec(),
            ),
            (
                "ip link del floor",
                chart::GREY,
                vec![None, None, Some(floors.p(50.0)), Some(floors.p(99.0))],
            ),
        ],
        |_, _, v| fmt_ms(v),
    )
    .reference("/bin/true in node netns p50", r.floors.nsexec.p(50.0));
    let concurrent = Panel::new(
        "concurrent ADDs, wall (ms)",
        "ms",
        &["20×ADD", "50×ADD"],
        vec![
            (
                "calix",
                chart::BLUE,
                vec![Some(c.conc_median(0)), Some(c.conc_median(1))],
            ),
            (
                "ptp + host-local",
                chart::ORANGE,
                vec![Some(p.conc_median(0)), Some(p.conc_median(1))],
            ),
        ],
        |_, _, v| fmt_ms(v),
    );
    chart::chart(
        path,
        (1000, 460),
        &format!(
            "CNI fork-to-exit latency, calix vs ptp + host-local ({} pods × {} reps, {})",
            r.pods, r.reps, r.bench.machine.date
        ),
        Layout::Columns(&[640]),
        &[per_call, concurrent],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::{around, render};

    #[test]
    fn the_report_renders() {
        let reps = 2;
        let samples = |add: f64, del: f64| Samples {
            add: Calls::fake(add, reps),
            del: Calls::fake(del, reps),
            conc: [around(20.0 * add, reps), around(50.0 * add, reps)],
            load: around(0.4, reps),
        };
        let r = Report {
            pods: 40,
            reps,
            plugins_version: "1.1.1".into(),
            calix: samples(2.5, 2.0),
            ptp: samples(9.0, 6.0),
            baseline: Some(("calix baseline main~1 (abc)".into(), samples(2.0, 2.0))),
            floors: Floors {
                truth: Calls::fake(0.6, reps),
                nsexec: Calls::fake(0.8, reps),
                link_del: Calls::fake(1.9, reps),
                load: around(0.3, reps),
            },
            bench: Bench::fake(),
        };
        let md = r.markdown();
        let svg = render("cni", &md, |p| chart(p, &r));
        assert!(md.starts_with("# CNI"));
        assert!(svg.contains("ptp + host-local") && svg.contains("ip link del floor"));
        // This build against its baseline: 2.5 ms over 2.0 ms.
        assert!(md.contains("| calix baseline main~1 (abc) |"), "{md}");
        assert!(md.contains("| calix / its baseline | 1.25× |"), "{md}");
    }
}
