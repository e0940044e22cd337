//! The upstream conformance suites against the e2e cluster (`--conformance netpol|services`):
//! Kubernetes' own network e2e tests (`e2e-network.test`, v1.36.2, from ../shared/k8s) run
//! from the API server's namespace against calix as installed, before its uninstall.
//!
//! The tests' pods run `agnhost` from `registry.k8s.io/e2e-test-images/agnhost:2.63.0` and
//! probe each other through the API's exec (`/agnhost connect`, or `/bin/sh -c` with `nc`,
//! `curl`); nothing can be pulled here, so that image is built from ../shared/k8s's static
//! `agnhost`, busybox and this machine's `nc` and `curl` (`calix_testbed::image::agnhost_oci_tar`)
//! and imported into each node's containerd under exactly that name. The suite's JUnit report becomes the rows of
//! `docs/conformance/<suite>.md` ([`markdown`]): each spec, its result and its time.
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::image::agnhost_oci_tar;
use calix_testbed::k8s::k8s_binary;

use crate::cluster::E2eCluster;
use crate::progress::Progress;
use crate::Mode;

/// The image the suites' pods run (`imagePullPolicy: IfNotPresent`).
const AGNHOST_IMAGE: &str = "registry.k8s.io/e2e-test-images/agnhost:2.63.0";

/// A suite `--conformance` can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// `[sig-network] Netpol`: NetworkPolicy (test/e2e/network/netpol).
    Netpol,
    /// `[sig-network] Services`: Services (test/e2e/network/service.go), which calix
    /// translates in eBPF mode (kube-proxy in kernel mode).
    Services,
    /// The specs of `services` CI runs ([`SERVICES_CI`]): each kind of frontend and policy
    /// calix translates, in a few minutes; the whole suite by `--conformance services`.
    ServicesCi,
}

/// `services-ci`'s specs (their names after `[sig-network] Services `, each the start of
/// one): ClusterIP over TCP and UDP, several ports, NodePort, external IPs, no endpoint,
/// hairpin, the client's address kept, both `Local` policies, session affinity and a slice
/// labelled headless.
const SERVICES_CI: [&str; 12] = [
    "should serve a basic endpoint from pods",
    "should serve multiport endpoints from pods",
    "should serve endpoints on same port and different protocols ",
    "should be able to create a functioning NodePort service",
    "should be possible to connect to a service via ExternalIP when the external IP is not assigned to a node",
    "should be rejected when no endpoints exist",
    "should allow pods to hairpin back to themselves through services",
    "should preserve source pod IP for traffic thru service cluster IP",
    "should respect internalTrafficPolicy=Local Pod to Pod",
    "should support externalTrafficPolicy=Local for type=NodePort",
    "should have session affinity work for service with type clusterIP",
    "should implement service.kubernetes.io/headless",
];

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Netpol => "netpol",
            Suite::Services => "services",
            Suite::ServicesCi => "services-ci",
        }
    }

    /// The start of each of the suite's spec names (after ginkgo's `[It] `).
    fn prefix(self) -> &'static str {
        match self {
            Suite::Netpol => "[sig-network] Netpol ",
            Suite::Services | Suite::ServicesCi => "[sig-network] Services ",
        }
    }

    /// The `--ginkgo.focus` (the names of [`SERVICES_CI`] hold no regex character).
    fn focus(self) -> String {
        match self {
            Suite::Netpol => r"\[sig-network\] Netpol".into(),
            Suite::Services => r"\[sig-network\] Services ".into(),
            Suite::ServicesCi => format!(r"\[sig-network\] Services ({})", SERVICES_CI.join("|")),
        }
    }

    /// Whether the focus selects spec `name` (the report leaves the others out).
    fn selects(self, name: &str) -> bool {
        let Some(at) = name.find(self.prefix()) else {
            return false;
        };
        let rest = &name[at + self.prefix().len()..];
        match self {
            Suite::Netpol | Suite::Services => true,
            Suite::ServicesCi => SERVICES_CI.iter().any(|s| rest.starts_with(s)),
        }
    }

    /// The specs left out (each a `--ginkgo.skip` alternative) and why: they cannot run on
    /// this machine, whatever the network.
    fn skipped(self) -> &'static [(&'static str, &'static str)] {
        const NO_SCTP: &str = "this kernel has no SCTP (`CONFIG_IP_SCTP` is not set)";
        match self {
            // The specs about SCTP rules that probe over TCP run.
            Suite::Netpol => &[(r"\[Feature:SCTPConnectivity\]", NO_SCTP)],
            Suite::Services | Suite::ServicesCi => &[
                (r"SCTP", NO_SCTP),
                (
                    r"\[Disruptive\]",
                    "they restart the API server or kube-proxy over SSH to the nodes, which \
                     the suite's provider (`skeleton`) does not have",
                ),
            ],
        }
    }

    /// Whether the skip leaves spec `name` out (each alternative of [`Suite::skipped`] is a
    /// literal but for its escaped brackets).
    fn left_out(self, name: &str) -> bool {
        self.skipped()
            .iter()
            .any(|(re, _)| name.contains(&re.replace("\\[", "[").replace("\\]", "]")))
    }

    /// `case` as the report shows it: a spec skipped without saying why and not left out by
    /// the skip never ran (the run was interrupted before it).
    fn classify(self, mut case: Case) -> Case {
        if case.status == "skipped" && case.why.is_none() && !self.left_out(&case.name) {
            case.status = "not run".into();
        }
        case
    }

    /// The `--ginkgo.skip`: every alternative of [`Suite::skipped`].
    fn skip(self) -> String {
        self.skipped()
            .iter()
            .map(|(re, _)| *re)
            .collect::<Vec<_>>()
            .join("|")
    }

    fn title(self) -> &'static str {
        match self {
            Suite::Netpol => "the upstream NetworkPolicy suite (`[sig-network] Netpol`)",
            Suite::Services => "the upstream Services suite (`[sig-network] Services`)",
            Suite::ServicesCi => {
                "CI's subset of the upstream Services suite (`[sig-network] Services`)"
            }
        }
    }
}

/// One spec's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub name: String,
    pub status: String,
    pub secs: f64,
    /// Why it was skipped (ginkgo's `<skipped message>`, past its `skipped - `), when the
    /// spec said (e.g. a provider it needs): shown in the report.
    pub why: Option<String>,
}

/// One mode's run of a suite.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub mode: Mode,
    pub suite: Suite,
    /// The specs the focus selected and ran (or the skip left out: `status` "skipped").
    pub cases: Vec<Case>,
    pub took: Duration,
}

impl Outcome {
    pub fn failed(&self) -> Vec<&Case> {
        self.cases.iter().filter(|c| c.status == "failed").collect()
    }

    fn count(&self, status: &str) -> usize {
        self.cases.iter().filter(|c| c.status == status).count()
    }
}

/// Builds the agnhost image and imports it into every node's containerd.
pub fn import_agnhost(c: &E2eCluster) -> Result<()> {
    let bin = k8s_binary("agnhost").context("the agnhost binary (../shared/k8s)")?;
    let data = std::fs::read(&bin).with_context(|| format!("read {}", bin.display()))?;
    let tar = agnhost_oci_tar(AGNHOST_IMAGE, &data)?;
    let path = c.dir.join("agnhost.oci.tar");
    std::fs::write(&path, tar).with_context(|| format!("write {}", path.display()))?;
    for (i, kube) in c.kubes.iter().enumerate() {
        kube.import(&path)
            .with_context(|| format!("import {AGNHOST_IMAGE} into node {i}"))?;
    }
    Ok(())
}

/// Runs `suite` against the cluster as it is (calix installed in `mode`), from the API
/// server's namespace, and reads its JUnit report.
pub fn run(c: &E2eCluster, mode: Mode, suite: Suite, p: &Progress) -> Result<Outcome> {
    let dir = c
        .dir
        .join(format!("conformance-{}-{}", suite.name(), mode.value()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let bin = k8s_binary("e2e-network.test").context("e2e-network.test (../shared/k8s)")?;
    let kubeconfig = c.api.kubeconfig_advertised()?;
    let ns = c
        .api
        .ns
        .as_ref()
        .context("the API server runs in a namespace of its own")?;
    let (focus, skip) = (suite.focus(), suite.skip());
    let focus = focus.as_str();
    let (bin, kubeconfig, report) = (
        bin.display().to_string(),
        kubeconfig.display().to_string(),
        dir.display().to_string(),
    );
    let started = Instant::now();
    let mut child = ns
        .cmd(&[
            &bin,
            "--kubeconfig",
            &kubeconfig,
            "--provider",
            "skeleton",
            "--ginkgo.focus",
            focus,
            "--ginkgo.skip",
            &skip,
            "--ginkgo.v",
            "--ginkgo.no-color",
            "--ginkgo.timeout",
            "50m",
            "--report-dir",
            &report,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("start {bin}"))?;
    let log_path = dir.join("output.log");
    let mut log = std::fs::File::create(&log_path)
        .with_context(|| format!("create {}", log_path.display()))?;
    let (mut done, mut failed) = (0, 0);
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            let _ = writeln!(log, "{line}");
            // A spec's end: "• [6.0 seconds]", "• [FAILED] [39.1 seconds]".
            if line.starts_with("• [") {
                done += 1;
                if line.contains("[FAILED]") || line.contains("[PANICKED]") {
                    failed += 1;
                }
                if done % 5 == 0 || line.contains("[FAILED]") {
                    p.note(&format!(
                        "[{}] {done} specs done, {failed} failed, {:.0} s",
                        mode.value(),
                        started.elapsed().as_secs_f64()
                    ));
                }
            }
        }
    }
    let status = child.wait().context("wait for the suite")?;
    let took = started.elapsed();
    let xml = junit_file(&dir)?;
    let text = std::fs::read_to_string(&xml).with_context(|| format!("read {}", xml.display()))?;
    let cases = parse_junit(&text)
        .into_iter()
        .filter(|c| suite.selects(&c.name))
        .map(|c| suite.classify(c))
        .collect::<Vec<_>>();
    if cases.is_empty() {
        bail!(
            "the suite ran no spec ({status}); its output: {}",
            log_path.display()
        );
    }
    Ok(Outcome {
        mode,
        suite,
        cases,
        took,
    })
}

/// The JUnit file the framework wrote in `dir` (`junit_01.xml`).
fn junit_file(dir: &Path) -> Result<PathBuf> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("junit") && n.ends_with(".xml"))
        })
        .with_context(|| format!("no JUnit report in {}", dir.display()))
}

/// The `<testcase>` elements of a ginkgo JUnit report: name, status (`passed`, `failed`,
/// `skipped`; from the `status` attribute, else from a `<failure>` or `<skipped>` child),
/// time.
pub fn parse_junit(xml: &str) -> Vec<Case> {
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find("<testcase ") {
        rest = &rest[start..];
        let tag_end = rest.find('>').unwrap_or(rest.len());
        let tag = &rest[..tag_end];
        let body_end = if tag.ends_with('/') {
            tag_end
        } else {
            rest.find("</testcase>").unwrap_or(rest.len())
        };
        let body = &rest[tag_end..body_end];
        let skipped = body.find("<skipped").and_then(|at| {
            attr(
                &body[at..body[at..].find('>').map_or(body.len(), |e| at + e)],
                "message",
            )
        });
        let why = skipped.as_deref().and_then(|m| {
            let m = m.strip_prefix("skipped").unwrap_or(m);
            let m = m.trim_start_matches([' ', '-', ':']).trim();
            (!m.is_empty()).then(|| m.to_string())
        });
        let interrupted = why
            .as_deref()
            .is_some_and(|m| m.to_ascii_lowercase().contains("interrupt"));
        let status = attr(tag, "status").unwrap_or_else(|| {
            if body.contains("<failure") || body.contains("<error") {
                "failed".into()
            } else if body.contains("<skipped") {
                "skipped".into()
            } else {
                "passed".into()
            }
        });
        out.push(Case {
            name: attr(tag, "name").unwrap_or_default(),
            status: match status.as_str() {
                "panicked" | "interrupted" | "timedout" | "aborted" => "failed".into(),
                // Never started: the run was interrupted before it.
                "skipped" if interrupted => "not run".into(),
                s => s.to_string(),
            },
            why,
            secs: attr(tag, "time")
                .and_then(|t| t.parse().ok())
                .unwrap_or(0.0),
        });
        rest = &rest[body_end.max(1)..];
    }
    out
}

/// The value of attribute `name` in the start tag `tag`, unescaped.
fn attr(tag: &str, name: &str) -> Option<String> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(unescape(&tag[start..start + len]))
}

fn unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&#39;", "'")
        .replace("&#34;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

/// The spec's name without ginkgo's node type and the suite's common prefix.
fn short(suite: Suite, name: &str) -> &str {
    let name = name.strip_prefix("[It] ").unwrap_or(name);
    name.strip_prefix(suite.prefix()).unwrap_or(name)
}

/// `docs/conformance/<suite>.md`: what ran, where (`nodes` kubelet nodes), and each spec's
/// result and time.
pub fn markdown(outcomes: &[Outcome], modes_run: &[Mode], commit: &str, nodes: usize) -> String {
    let Some(first) = outcomes.first() else {
        return String::new();
    };
    let suite = first.suite;
    let mut s = format!(
        "# Conformance: {}\n\n\
         Written by `cargo xtask e2e --conformance {}` (the e2e cluster: kube-apiserver, {} kubelet\n\
         nodes with containerd, calix installed from its chart; kube-proxy in iptables mode in kernel\n\
         mode, none in eBPF mode: calix replaces it; the test bed's cluster DNS for `cluster.local`;\n\
         each node's pods in a cgroup of its own, where its agent's socket programs attach), with\n\
         Kubernetes' own test binary `e2e-network.test` v1.36.2 from `../shared/k8s`, run from the API\n\
         server's namespace:\n\n\
         `--ginkgo.focus '{}' --ginkgo.skip '{}'`\n\n\
         Left out, since they cannot run on this machine:\n\n",
        suite.title(),
        suite.name(),
        nodes,
        suite.focus(),
        suite.skip(),
    );
    for (re, why) in suite.skipped() {
        s.push_str(&format!("- `{re}`: {why}.\n"));
    }
    s.push_str(&format!("\ncalix {commit}.\n\n"));
    s.push_str(
        "| dataplane | passed | failed | skipped | not run (interrupted) | suite time |\n\
         |---|---|---|---|---|---|\n",
    );
    for o in outcomes {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} s |\n",
            o.mode.value(),
            o.count("passed"),
            o.count("failed"),
            o.count("skipped"),
            o.count("not run"),
            o.took.as_secs_f64()
        ));
    }
    for m in [Mode::Ebpf, Mode::Kernel] {
        if !modes_run.contains(&m) {
            s.push_str(&format!("| {} | not run | | | | |\n", m.value()));
        }
    }
    for o in outcomes {
        s.push_str(&format!(
            "\n## {} dataplane\n\n| spec | result | time |\n|---|---|---|\n",
            o.mode.value()
        ));
        let mut cases: Vec<&Case> = o.cases.iter().collect();
        cases.sort_by(|a, b| short(suite, &a.name).cmp(short(suite, &b.name)));
        for c in cases {
            let result = match (&c.why, c.status.as_str()) {
                (Some(why), "skipped") => format!("skipped: {why}"),
                _ => c.status.clone(),
            };
            s.push_str(&format!(
                "| {} | {} | {:.1} s |\n",
                short(suite, &c.name).replace('|', "\\|"),
                result.replace('|', "\\|").replace('\n', " "),
                c.secs
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_ci_reports_only_its_specs() {
        let ci = Suite::ServicesCi;
        assert!(ci.selects("[It] [sig-network] Services should serve a basic endpoint from pods [Conformance] [sig-network, Conformance]"));
        assert!(!ci.selects(
            "[It] [sig-network] Services should create endpoints for unready pods [sig-network]"
        ));
        assert!(!ci.selects("[It] [sig-network] Netpol should serve a basic endpoint from pods"));
        assert!(Suite::Services.selects(
            "[It] [sig-network] Services should create endpoints for unready pods [sig-network]"
        ));
        assert_eq!(SERVICES_CI.len(), ci.focus().matches('|').count() + 1);
    }

    #[test]
    fn the_junit_report_gives_each_spec_its_result_and_time() {
        let xml = r#"<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="3" failures="1">
  <testsuite name="Kubernetes e2e suite" tests="3">
    <testcase name="[It] [sig-network] Netpol NetworkPolicy between server and client should support a &#39;default-deny-ingress&#39; policy [Feature:NetworkPolicy]" classname="Kubernetes e2e suite" status="passed" time="6.025"></testcase>
    <testcase name="[It] [sig-network] Netpol NetworkPolicy between server and client should enforce except clause while egress access to server in CIDR block [Feature:NetworkPolicy]" classname="Kubernetes e2e suite" status="failed" time="39.1"><failure message="x" type="failed">boom &lt;here&gt;</failure></testcase>
    <testcase name="[It] [sig-network] Netpol [Feature:SCTPConnectivity] should support SCTP" classname="Kubernetes e2e suite" time="0"><skipped message="skipped"></skipped></testcase>
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="0.5"/>
    <testcase name="[It] [sig-network] Netpol needs a cloud" classname="Kubernetes e2e suite" status="skipped" time="0.1"><skipped message="skipped - Only supported for providers [gce gke] (not skeleton)"></skipped></testcase>
    <testcase name="[It] [sig-network] Netpol came after the interrupt" classname="Kubernetes e2e suite" status="skipped" time="0"><skipped message="skipped - Spec skipped because an interrupt was received"></skipped></testcase>
    <testcase name="[It] [sig-network] Netpol also after the interrupt" classname="Kubernetes e2e suite" status="skipped" time="0"><skipped message="skipped"></skipped></testcase>
  </testsuite>
</testsuites>"#;
        let cases = parse_junit(xml);
        assert_eq!(cases.len(), 7);
        assert_eq!(cases[0].status, "passed");
        assert!(
            cases[0].name.contains("'default-deny-ingress'"),
            "{:?}",
            cases[0].name
        );
        assert_eq!(cases[0].secs, 6.025);
        assert_eq!((cases[1].status.as_str(), cases[1].secs), ("failed", 39.1));
        assert_eq!(cases[2].status, "skipped");
        assert_eq!(cases[3].name, "[SynchronizedBeforeSuite]");
        assert_eq!(cases[4].status, "skipped");
        assert_eq!(
            cases[4].why.as_deref(),
            Some("Only supported for providers [gce gke] (not skeleton)")
        );
        assert_eq!(cases[5].status, "not run");
        let outcome = Outcome {
            mode: Mode::Ebpf,
            suite: Suite::Netpol,
            cases: cases
                .into_iter()
                .filter(|c| c.name.contains(Suite::Netpol.prefix()))
                .map(|c| Suite::Netpol.classify(c))
                .collect(),
            took: Duration::from_secs(100),
        };
        assert_eq!(outcome.failed().len(), 1);
        let md = markdown(&[outcome], &[Mode::Ebpf], "abc1234", 2);
        assert!(md.contains("| ebpf | 1 | 1 | 2 | 2 | 100 s |"), "{md}");
        assert!(
            md.contains("| also after the interrupt | not run | 0.0 s |"),
            "{md}"
        );
        assert!(
            md.contains("| [Feature:SCTPConnectivity] should support SCTP | skipped | 0.0 s |"),
            "left out by the skip: {md}"
        );
        assert!(
            md.contains("| needs a cloud | skipped: Only supported for providers [gce gke] (not skeleton) | 0.1 s |"),
            "{md}"
        );
        assert!(
            md.contains("| came after the interrupt | not run | 0.0 s |"),
            "{md}"
        );
        assert!(
            md.contains("- `\\[Feature:SCTPConnectivity\\]`: this kernel has no SCTP"),
            "{md}"
        );
        assert!(md.contains("| kernel | not run |"), "{md}");
        assert!(md.contains("| NetworkPolicy between server and client should support a 'default-deny-ingress' policy [Feature:NetworkPolicy] | passed | 6.0 s |"), "{md}");
    }
}
