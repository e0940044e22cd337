//! One dataplane mode, end to end: install the chart, wait for the DaemonSet, check what an
//! operator expects of a pod network, restart the agents under a flow, release, uninstall.
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calix_testbed::chart_tools;
use calix_testbed::kubelet::http_get;
use calix_testbed::pod_net::{in_pod, Flow};
use serde_json::{json, Value};

use crate::cluster::{E2eCluster, POOL, RELEASE_NAMESPACE};
use crate::progress::Progress;
use crate::{conformance, helm, node_state, Mode};

/// How many progress steps [`run`] shows.
pub const STEPS: usize = 10;
/// The web pods' hostPort (portmap, chained after calix).
const HOST_PORT: u16 = 18080;
/// The chart's release name (its DaemonSet's name).
const RELEASE: &str = "calix";
/// The chart's signer Deployment.
const SIGNER: &str = "calix-signer";
/// The signer name the agents' requests carry.
const SIGNER_NAME: &str = "calix.dev/routes";

/// One mode's figures, a row of the final table.
pub struct Report {
    mode: Mode,
    ready: Duration,
    pods: Duration,
    rollout: Duration,
    gap: Duration,
    echoes: u64,
    uninstall: Duration,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "| {} | {:.1} s | {:.1} s | {:.1} s | {} ms ({} echoes) | {:.1} s |",
            self.mode.value(),
            self.ready.as_secs_f64(),
            self.pods.as_secs_f64(),
            self.rollout.as_secs_f64(),
            self.gap.as_millis(),
            self.echoes,
            self.uninstall.as_secs_f64()
        )
    }
}

/// Polls `f` every 200 ms until it gives something, at most `timeout`; then an error naming
/// `what` with the cluster's logs.
fn wait<T>(
    c: &E2eCluster,
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() > deadline {
            let why = last_err
                .map(|e| format!(" (last error: {e:#})"))
                .unwrap_or_default();
            bail!("not within {timeout:?}: {what}{why}\n{}", c.show());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `suites`: upstream conformance suites to run after the checks, before the uninstall, in
/// order; their outcomes go to `outcomes`.
pub fn run(
    c: &mut E2eCluster,
    mode: Mode,
    p: &mut Progress,
    suites: &[conformance::Suite],
    outcomes: &mut Vec<conformance::Outcome>,
) -> Result<Report> {
    let m = mode.value();
    let api = &c.api;
    p.step(&format!(
        "[{m}] helm install: the chart rendered by Helm's library, applied in Helm's order; until the DaemonSet is ready"
    ));
    let rendered = chart_tools::render(&chart_tools::workspace_root(), &c.values(mode))
        .context("rendering the chart")?;
    let earlier_requests = certificate_requests(c)?;
    let started = Instant::now();
    let n = helm::install(api, &rendered)?;
    p.note(&format!("{n} objects applied"));
    daemonset_ready(c, None)?;
    let count = c.count();
    wait(c, "every node Ready", Duration::from_secs(60), || {
        let nodes = api.list("v1", "Node", "")?;
        Ok((nodes.len() == count && nodes.iter().all(ready)).then_some(()))
    })?;
    let ready = started.elapsed();
    p.note(&format!(
        "DaemonSet {RELEASE}: {count}/{count} ready, every node Ready, {ready:.1?} after install"
    ));
    let issued = certificates_issued(c, &earlier_requests)?;
    p.note(&format!(
        "{SIGNER} available; each agent's certificate through the API ({issued}), {:.1?} after install",
        started.elapsed()
    ));
    if mode == Mode::Ebpf {
        // Installed beside kube-proxy, as on a cluster moving to calix's Services: now it goes
        // (docs/install.md, "Replacing kube-proxy"); everything below runs without it.
        c.kube_proxy(false, p)?;
    }
    let c: &E2eCluster = c;
    let api = &c.api;
    p.step(&format!(
        "[{m}] pods: a web server on each node and a second one on node 0, behind a ClusterIP Service"
    ));
    let started = Instant::now();
    let web = Web::create(c, mode)?;
    let pods_took = started.elapsed();
    p.note(&format!(
        "Running with calix addresses in {POOL} after {pods_took:.1?}: {}",
        web.pods
            .iter()
            .map(|w| format!("{} {} (node {})", w.name, w.ip, w.node))
            .collect::<Vec<_>>()
            .join(", ")
    ));

    p.step(&format!(
        "[{m}] kubectl exec through the API server into a pod on each node (how the upstream suites probe)"
    ));
    for w in web.pods.iter().take(2) {
        let out = kubectl(c, &["exec", "-n", "default", &w.name, "--", "hostname"])?;
        if out.trim() != w.name {
            bail!(
                "kubectl exec {} -- hostname answered {out:?}\n{}",
                w.name,
                c.show()
            );
        }
        p.note(&format!("{} (node {}): hostname answered", w.name, w.node));
    }

    p.step(&format!(
        "[{m}] pod to pod by ping and TCP: same node, and across nodes both ways (through VXLAN: the nodes' subnets differ)"
    ));
    for (from, to) in [(0, 2), (0, 1), (1, 0), (2, 1)] {
        let (a, b) = (&web.pods[from], &web.pods[to]);
        wait(
            c,
            &format!("{} pings {} at {}", a.name, b.name, b.ip),
            Duration::from_secs(30),
            || Ok(in_pod(&a.netns, &["ping", "-c", "1", "-W", "1", &b.ip]).map(|_| ())),
        )?;
        wait(
            c,
            &format!("{} gets {}'s page from {}:8080", a.name, b.name, b.ip),
            Duration::from_secs(20),
            || {
                Ok((http_get(&a.netns, &format!("{}:8080", b.ip)).as_deref()
                    == Some(b.name.as_str()))
                .then_some(()))
            },
        )?;
        p.note(&format!(
            "{} (node {}) -> {} (node {}): ping, TCP",
            a.name, a.node, b.name, b.node
        ));
    }

    let proxy = match mode {
        Mode::Ebpf => "calix at the sockets, no kube-proxy",
        Mode::Kernel => "kube-proxy",
    };
    p.step(&format!(
        "[{m}] the ClusterIP Service ({proxy}) from a pod on each node, from calix's natOutgoing pool: every backend answers, by name too; with internalTrafficPolicy Local, only the client's node's"
    ));
    for from in [0, 1] {
        let a = &web.pods[from];
        let mut seen = BTreeSet::new();
        wait(
            c,
            &format!(
                "{} reaches all 3 backends through {}:80 (seen {seen:?})",
                a.name, web.cluster_ip
            ),
            Duration::from_secs(60),
            || {
                if let Some(b) = get_in_pod(c, &a.name, &web.cluster_ip) {
                    seen.insert(b);
                }
                Ok((seen.len() == web.pods.len()).then_some(()))
            },
        )?;
        p.note(&format!(
            "from {} (node {}): {} answered",
            a.name,
            a.node,
            seen.into_iter().collect::<Vec<_>>().join(", ")
        ));
        let local: BTreeSet<String> = web
            .pods
            .iter()
            .filter(|w| w.node == a.node)
            .map(|w| w.name.clone())
            .collect();
        let (mut seen, mut other) = (BTreeSet::new(), None);
        wait(
            c,
            &format!(
                "{} reaches its node's backends {local:?} through {}:80, internalTrafficPolicy Local (seen {seen:?})",
                a.name, web.local_ip
            ),
            Duration::from_secs(60),
            || {
                match get_in_pod(c, &a.name, &web.local_ip) {
                    Some(b) if !local.contains(&b) => other = Some(b),
                    Some(b) => {
                        seen.insert(b);
                    }
                    None => {}
                }
                Ok((seen == local || other.is_some()).then_some(()))
            },
        )?;
        if let Some(b) = other {
            bail!(
                "{b}, on another node, answered {} through the internalTrafficPolicy Local Service\n{}",
                a.name,
                c.show()
            );
        }
        p.note(&format!(
            "internalTrafficPolicy Local, from {} (node {}): {} answered, no other",
            a.name,
            a.node,
            seen.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    // By name, as the upstream Services suite dials it: the pod's resolv.conf (the kubelet's
    // clusterDNS) and the test bed's cluster DNS. (busybox's own resolver: its static wget
    // crashes in glibc's name lookup.)
    let a = &web.pods[1];
    let fqdn = format!("{}.default.svc.cluster.local", web.service);
    wait(
        c,
        &format!("{} resolves {fqdn} to {}", a.name, web.cluster_ip),
        Duration::from_secs(30),
        || {
            let args = [
                "exec", "-n", "default", &a.name, "--", "busybox", "nslookup", &fqdn,
            ];
            let out = kubectl(c, &args)?;
            Ok(out
                .lines()
                .any(|l| l.contains("Address") && l.trim_end().ends_with(web.cluster_ip.as_str()))
                .then_some(()))
        },
    )?;
    p.note(&format!(
        "from {} (node {}): {fqdn} resolved to {} (the cluster DNS)",
        a.name, a.node, web.cluster_ip
    ));

    p.step(&format!(
        "[{m}] hostPort {HOST_PORT} on each node, and NodePorts (Cluster: every backend; Local: that node's), from the underlay's router"
    ));
    let underlay = c.nodes.underlay().path();
    for w in web.pods.iter().filter(|w| w.host_port) {
        let addr = format!("{}:{HOST_PORT}", c.nodes.address(w.node));
        wait(
            c,
            &format!("{addr} answers as {}", w.name),
            Duration::from_secs(20),
            || Ok((http_get(&underlay, &addr).as_deref() == Some(w.name.as_str())).then_some(())),
        )?;
        p.note(&format!("{addr} -> {}", w.name));
    }
    // A client outside the nodes (calix per packet in eBPF mode, kube-proxy in kernel mode): at
    // either node's address, a Cluster NodePort reaches every backend (those of the other node
    // too), a Local one only that node's.
    for node in [0, 1] {
        let at = c.nodes.address(node);
        let all: BTreeSet<String> = web.pods.iter().map(|w| w.name.clone()).collect();
        let addr = format!("{at}:{}", web.node_port);
        let mut seen = BTreeSet::new();
        wait(
            c,
            &format!("{addr} (NodePort, Cluster) reaches every backend {all:?}"),
            Duration::from_secs(60),
            || {
                if let Some(b) = http_get(&underlay, &addr) {
                    seen.insert(b);
                }
                Ok((seen == all).then_some(()))
            },
        )?;
        p.note(&format!(
            "{addr} (Cluster) -> {}",
            all.into_iter().collect::<Vec<_>>().join(", ")
        ));
        let local: BTreeSet<String> = web
            .pods
            .iter()
            .filter(|w| w.node == node)
            .map(|w| w.name.clone())
            .collect();
        let addr = format!("{at}:{}", web.node_port_local);
        let (mut seen, mut other) = (BTreeSet::new(), None);
        wait(
            c,
            &format!("{addr} (NodePort, Local) reaches its node's backends {local:?}"),
            Duration::from_secs(60),
            || {
                match http_get(&underlay, &addr) {
                    Some(b) if !local.contains(&b) => other = Some(b),
                    Some(b) => {
                        seen.insert(b);
                    }
                    None => {}
                }
                Ok((seen == local || other.is_some()).then_some(()))
            },
        )?;
        if let Some(b) = other {
            bail!(
                "{b}, on another node, answered at {addr} through the externalTrafficPolicy Local NodePort\n{}",
                c.show()
            );
        }
        p.note(&format!(
            "{addr} (Local) -> {}, no other",
            seen.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }

    p.step(&format!(
        "[{m}] helm test: the chart's pod-to-pod check (an echo server on every node, a client pod)"
    ));
    let took = helm::test(api, &rendered, Duration::from_secs(120), |_, _| c.show())?;
    p.note(&format!("the test pod succeeded in {took:.1?}"));

    p.step(&format!(
        "[{m}] kubectl rollout restart daemonset/{RELEASE} under an established pod-to-pod TCP flow (node 0 -> node 1)"
    ));
    let old_agents = agent_pods(c)?;
    let before_rollout = certificate_requests(c)?;
    let (w0, w1) = (&web.pods[0], &web.pods[1]);
    let flow = Flow::start(&w0.netns, &w1.netns, &w1.ip);
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    kubectl(c, &["rollout", "restart", &format!("daemonset/{RELEASE}")])?;
    kubectl(
        c,
        &[
            "rollout",
            "status",
            &format!("daemonset/{RELEASE}"),
            "--timeout=240s",
        ],
    )?;
    daemonset_ready(c, Some(&old_agents))?;
    let rollout = started.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let (echoes, gap) = flow.finish().map_err(|e| {
        anyhow::anyhow!(
            "the TCP flow broke during the rollout: {}\n{}",
            calix_log::error_chain(&e),
            c.show()
        )
    })?;
    p.note(&format!(
        "every agent replaced in {rollout:.1?}; the flow carried on: {echoes} echoes, longest gap {gap:?}"
    ));
    let reissued = certificates_issued(c, &before_rollout)?;
    p.note(&format!(
        "the new agents made new keys and got new certificates ({reissued})"
    ));
    if gap > Duration::from_secs(2) {
        bail!("the flow stalled for {gap:?} during the rollout");
    }

    let before_suites = c.namespaces()?;
    for &suite in suites {
        p.step(&format!(
            "[{m}] the upstream {} suite (e2e-network.test v1.36.2), from the API server's namespace",
            suite.name()
        ));
        let o = conformance::run(c, mode, suite, p);
        // Whatever the suite left (its namespaces are deleted as it goes, not waited for; a
        // terminating-endpoints spec's pods take minutes to end) goes before anything else.
        c.clear_namespaces(&before_suites)?;
        let o = o?;
        p.note(&format!(
            "{} specs: {} failed, in {:.0} s",
            o.cases.len(),
            o.failed().len(),
            o.took.as_secs_f64()
        ));
        outcomes.push(o);
    }

    p.step(&format!(
        "[{m}] the pods deleted: every address, endpoint and veth released"
    ));
    web.delete(c)?;
    let released = wait(
        c,
        "no IPAMHandle, no CalixEndpoint, no cali* link left",
        Duration::from_secs(60),
        || {
            let handles = api.list("calix.dev/v1", "IPAMHandle", "")?;
            let endpoints = api.list("calix.dev/v1", "CalixEndpoint", "")?;
            let links: usize = c.nodes.nodes.iter().map(|n| n.cali_links().len()).sum();
            Ok((handles.is_empty() && endpoints.is_empty() && links == 0).then_some(()))
        },
    );
    released?;
    p.note("0 handles, 0 endpoints, 0 cali links on any node");
    p.step(&format!(
        "[{m}] helm uninstall: the conflist, pins, routes, VXLAN device and nftables tables gone from every node"
    ));
    // What there is to remove: the pods are gone, their nodes' blocks and the routes to them
    // stay (an empty block is released only after its grace period).
    for i in 0..c.count() {
        let found = node_state::calix_on(&c.nodes.nodes[i].ns, &c.paths(i));
        let has = |what: &str| found.iter().any(|f| f.starts_with(what));
        let mut expected = vec!["the conflist", "route "];
        if mode == Mode::Ebpf {
            expected.push("the pins");
        }
        if let Some(missing) = expected.iter().find(|w| !has(w)) {
            bail!("node {i} before uninstall lacks {missing:?}: {found:?}");
        }
        if mode == Mode::Ebpf
            && !found
                .iter()
                .any(|f| f.contains("program from_host_dev on eth0"))
        {
            bail!("node {i} before uninstall has no from_host_dev on eth0: {found:?}");
        }
        p.note(&format!("node {i} before: {}", found.join(", ")));
    }
    let started = Instant::now();
    helm::uninstall(api, &rendered)?;
    wait(
        c,
        "the calix agent pods gone",
        Duration::from_secs(60),
        || Ok(agent_pods(c)?.is_empty().then_some(())),
    )?;
    wait(
        c,
        "nothing of calix left on any node",
        Duration::from_secs(30),
        || {
            let left: Vec<String> = (0..c.count())
                .flat_map(|i| node_state::calix_on(&c.nodes.nodes[i].ns, &c.paths(i)))
                .collect();
            Ok(left.is_empty().then_some(()))
        },
    )?;
    let uninstall = started.elapsed();
    p.note(&format!("every node clean {uninstall:.1?} after uninstall"));
    Ok(Report {
        mode,
        ready,
        pods: pods_took,
        rollout,
        gap,
        echoes,
        uninstall,
    })
}

/// The names of the CertificateSigningRequests for calix's signer.
fn certificate_requests(c: &E2eCluster) -> Result<BTreeSet<String>> {
    Ok(c.api
        .list("certificates.k8s.io/v1", "CertificateSigningRequest", "")?
        .iter()
        .filter(|r| r["spec"]["signerName"] == SIGNER_NAME)
        .filter_map(|r| r["metadata"]["name"].as_str().map(String::from))
        .collect())
}

/// Until the signer's Deployment is available and every node has a certificate issued
/// through a request not in `earlier`, made by the agents' ServiceAccount with credentials
/// the API server bound to that node; "node: request" of each.
fn certificates_issued(c: &E2eCluster, earlier: &BTreeSet<String>) -> Result<String> {
    let agents = format!("system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}");
    wait(
        c,
        &format!("{SIGNER} available and a certificate issued through the API for each node"),
        Duration::from_secs(120),
        || {
            let available = c
                .api
                .get("apps/v1", "Deployment", Some(RELEASE_NAMESPACE), SIGNER)?
                .is_some_and(|d| d["status"]["availableReplicas"] == 1);
            let requests = c
                .api
                .list("certificates.k8s.io/v1", "CertificateSigningRequest", "")?;
            let mut issued = Vec::new();
            for i in 0..c.count() {
                let node = c.name(i);
                let found = requests.iter().find(|r| {
                    let name = r["metadata"]["name"].as_str().unwrap_or_default();
                    !earlier.contains(name)
                        && r["spec"]["signerName"] == SIGNER_NAME
                        && r["spec"]["username"] == agents.as_str()
                        && r["spec"]["extra"]["authentication.kubernetes.io/node-name"]
                            == json!([node])
                        && r["status"]["certificate"]
                            .as_str()
                            .is_some_and(|c| !c.is_empty())
                });
                if let Some(r) = found {
                    issued.push(format!(
                        "{node}: {}",
                        r["metadata"]["name"].as_str().unwrap_or_default()
                    ));
                }
            }
            Ok((available && issued.len() == c.count()).then(|| issued.join(", ")))
        },
    )
}

fn ready(node: &Value) -> bool {
    node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// The agents' pods (name → UID).
fn agent_pods(c: &E2eCluster) -> Result<BTreeSet<(String, String)>> {
    Ok(c.api
        .list(
            "v1",
            "Pod",
            "app.kubernetes.io/name=calix,app.kubernetes.io/component=agent",
        )?
        .iter()
        .filter(|p| p["metadata"]["namespace"] == RELEASE_NAMESPACE)
        .map(|p| {
            (
                p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                p["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect())
}

/// Until the DaemonSet has a pod on every node, all up to date, ready and available (and, after a
/// restart, none of `old`).
fn daemonset_ready(c: &E2eCluster, old: Option<&BTreeSet<(String, String)>>) -> Result<()> {
    wait(
        c,
        &format!("DaemonSet {RELEASE} ready on every node"),
        Duration::from_secs(240),
        || {
            let Some(ds) = c
                .api
                .get("apps/v1", "DaemonSet", Some(RELEASE_NAMESPACE), RELEASE)?
            else {
                return Ok(None);
            };
            let s = &ds["status"];
            let n = |k: &str| s[k].as_i64().unwrap_or(0);
            let current = s["observedGeneration"].as_i64() >= ds["metadata"]["generation"].as_i64();
            let count = c.count() as i64;
            let all = n("desiredNumberScheduled") == count
                && n("numberReady") == count
                && n("updatedNumberScheduled") == count
                && n("numberAvailable") == count;
            let renewed = match old {
                Some(old) => agent_pods(c)?.is_disjoint(old),
                None => true,
            };
            Ok((current && all && renewed).then_some(()))
        },
    )
}

/// The body `pod` (a web pod, in `default`) gets for an HTTP GET of `addr` (port 80): busybox's
/// `nc` in the pod, through the API's exec (its static `wget` segfaults in glibc's address
/// lookup). A process of the pod, in its node's cgroup: the Service translation a pod's own
/// connection meets.
fn get_in_pod(c: &E2eCluster, pod: &str, addr: &str) -> Option<String> {
    let get = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {addr} 80");
    let out = kubectl(c, &["exec", "-n", "default", pod, "--", "sh", "-c", &get]).ok()?;
    let (_, body) = out.split_once("\r\n\r\n")?;
    let body = body.trim();
    (!body.is_empty()).then(|| body.to_string())
}

/// `kubectl <args> -n kube-system` as the admin, in the API server's namespace.
fn kubectl(c: &E2eCluster, args: &[&str]) -> Result<String> {
    let ns = c.api.ns.as_ref().context("the API server's namespace")?;
    let kubeconfig = c.api.kubeconfig().display().to_string();
    let mut argv = vec![
        "kubectl",
        "--kubeconfig",
        &kubeconfig,
        "-n",
        RELEASE_NAMESPACE,
    ];
    argv.extend_from_slice(args);
    let out = ns.exec(&argv);
    if !out.status.success() {
        bail!(
            "kubectl {}: {}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr),
            c.show()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[path = "web.rs"]
mod web;
use web::Web;
