//! The Helm chart (charts/calix), through Helm's own library (PyPI `helm-python-sdk`: Helm v4's
//! Go SDK, no helm binary) and `kubernetes-validate`, both run by charts/tools/check.py from the
//! environment `cargo xtask setup` installs (calix_testbed::chart_tools). One Python run lints,
//! renders and validates every case below; the assertions are here:
//! - the chart lints clean and renders with the defaults and with every value set (two cases
//!   that between them change every key of values.yaml, which docs/install.md must document);
//! - every rendered object validates against the Kubernetes 1.36 schemas (strict: no unknown
//!   fields), calix's own kinds against the chart's CRDs;
//! - the agent config in the ConfigMap is read and validated by the agent's own config code,
//!   the IPPool objects' specs as the agent's pools, and the init container's arguments run
//!   the real calix-install-cni into a conflist the plugin's own parser accepts;
//! - bad values are refused by values.schema.json (or the templates' own checks) with a
//!   message naming the value, and nothing renders.
//!
//! No root needed. The binaries come from target/debug (`cargo build --workspace --bins`).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use calix_agent::config::{AgentConfig, DataplaneMode};
use calix_agent::distribution::tls::CertSource;
use calix_core::ipam::pool::PoolSpec;
use calix_core::routes::peers::Topology;
use calix_testbed::chart_tools;
use serde_json::{json, Value};

/// The Kubernetes version the objects are validated against (the e2e cluster runs v1.36.2).
const KUBE_VERSION: &str = "1.36.0";
const NAMESPACE: &str = "kube-system";

/// Every value changed from its default (with `ALL_B`, every key of values.yaml): the etcd
/// datastore, eBPF with XDP, route reflectors over TLS from files on each node, per-node host
/// paths.
fn all_a() -> Value {
    json!({
        "image": {"repository": "registry.example/calix/calix", "tag": "v9.9.9", "pullPolicy": "Never"},
        "imagePullSecrets": [{"name": "regcred"}],
        "cniBinDir": "/usr/libexec/cni",
        "cniNetDir": "/etc/cni/calix.d",
        "runDir": "/run/calix-test",
        "stateDir": "/var/lib/calix-test",
        "hostPathsPerNode": true,
        "cleanupOnUninstall": false,
        "cni": {"networkName": "calix-net", "confName": "05-calix.conflist", "mtu": 1400,
                "portmap": false, "logLevel": "debug", "logFile": "/var/log/calix/cni.log",
                "uninstallOnStop": true},
        "datastore": {"type": "etcd",
                      "etcd": {"endpoints": ["http://192.0.2.10:2379", "https://etcd.example:2379"],
                               "prefix": "/calix-a/"},
                      "timeoutMs": 3000, "attempts": 5},
        "dataplane": "ebpf",
        "logLevel": "calix_agent=debug",
        "uplinks": ["eth0", "eth1"],
        "metrics": {"bindAddress": "127.0.0.1", "port": 9191, "reachableFromPods": true},
        "resyncIntervalSecs": 10,
        "pools": [
            {"name": "pods-a", "cidr": "10.250.0.0/16", "blockSize": 24, "previousBlockSizes": [26, 28], "natOutgoing": false,
             "disabled": true, "vxlan": "always", "nodeSelector": {"zone": "a", "calix.dev/tier": "x"}},
            {"name": "pods-v6", "cidr": "fd00:250::/48", "blockSize": 120, "natOutgoing": false,
             "vxlan": "never"}
        ],
        "ipam": {"strictAffinity": true, "maxBlocksPerNode": 8, "leakCheckIntervalSecs": 30,
                 "leakGraceSecs": 120, "emptyBlockGraceSecs": 60},
        "xdp": {"enabled": true, "mode": "generic", "denyCidrs": ["192.0.2.0/24", "2001:db8::/32", "198.51.100.7"],
                "failsafePorts": ["tcp:22", "udp:53"]},
        "nat": {"serviceCidrs": ["10.100.0.0/16", "fd00:96::/108"], "nonMasqueradeCidrs": ["172.16.0.0/12"],
                "conntrackEntries": 65536, "portMin": 20000, "portMax": 30000},
        "policy": {"entries": 100000, "flows": 65536, "keepEstablished": true},
        "routes": {"enabled": true, "port": 5575, "bindAddress": "[::]", "reachableFromPods": true,
                   "topology": "reflectors",
                   "reflectorLabel": "example.com/rr", "graceSecs": 60, "plaintext": false,
                   "tls": {"source": "hostPath", "hostPath": "/etc/calix/pki"}},
        "vxlan": {"vni": 4097, "port": 4790},
        "bgp": {"enabled": true, "passwordSecret": "calix-bgp-a"},
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}},
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "priorityClassName": "calix-critical",
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "net", "effect": "NoSchedule"}],
        "nodeSelector": {"kubernetes.io/os": "linux", "calix": "yes"},
        "podAnnotations": {"example.com/owner": "net-team"},
        "podLabels": {"team": "net"},
        "terminationGracePeriodSeconds": 60,
        "probes": {"liveness": {"initialDelaySeconds": 20, "periodSeconds": 15, "timeoutSeconds": 3, "failureThreshold": 4},
                   "readiness": {"periodSeconds": 3, "timeoutSeconds": 2, "failureThreshold": 5}},
        "serviceAccount": {"create": false, "name": "calix-existing"},
        "nodeAuthority": {"enabled": false},
        "prometheus": {"scrape": false},
        "test": {"port": 9090, "timeoutSeconds": 300}
    })
}

/// The other side: the kubernetes datastore, the kernel dataplane, a plain-text mesh, and the
/// remaining keys' other values.
fn all_b() -> Value {
    json!({
        "datastore": {"type": "kubernetes"},
        "dataplane": "kernel",
        "uplinks": ["ens3"],
        "cni": {"mtu": 9000, "portmap": true, "logLevel": "", "uninstallOnStop": false},
        "pools": [
            {"name": "blue", "cidr": "10.244.0.0/16", "blockSize": 26, "previousBlockSizes": [24], "natOutgoing": true, "vxlan": "crossSubnet"},
            {"name": "green", "cidr": "10.245.0.0/16", "natOutgoing": true, "disabled": false,
             "nodeSelector": {"pool": "green"},
             "namespaceSelector": {"matchLabels": {"tenant": "green"},
                                   "matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["prod"]},
                                                        {"key": "legacy", "operator": "DoesNotExist"}]}}
        ],
        "routes": {"enabled": true, "plaintext": true, "topology": "mesh",
                   "tls": {"signer": {"certificateLifetimeSecs": 3600,
                                      "resources": {"requests": {"cpu": "20m", "memory": "48Mi"}}}}},
        "serviceAccount": {"create": true, "name": "calix-sa"},
        "nodeAuthority": {"validationActions": ["Warn", "Audit"]}
    })
}

/// kube-proxy replaced: the kubernetes datastore, the eBPF dataplane, every value of
/// `kubeProxyReplacement` changed.
const KUBE_PROXY_REPLACED: &str = "kube-proxy-replaced";

fn kube_proxy_replaced() -> Value {
    json!({
        "datastore": {"type": "kubernetes"},
        "dataplane": "ebpf",
        "kubeProxyReplacement": {"enabled": true, "cgroup": "/sys/fs/cgroup/unified",
            "apiServer": {"host": "192.0.2.1", "port": 443},
            "externalCidrs": ["203.0.113.0/24", "2001:db8::7"],
            "frontends": 1000, "backends": 4000},
        "routes": {"enabled": true},
        "uplinks": ["eth0"],
    })
}

/// kube-proxy kept: the defaults with `kubeProxyReplacement.enabled` false.
const KUBE_PROXY_KEPT: &str = "kube-proxy-kept";

fn kube_proxy_kept() -> Value {
    json!({"kubeProxyReplacement": {"enabled": false}})
}

/// Routes over TLS with the defaults: certificates through the Kubernetes API, the signer.
const ROUTES_CERTIFICATES: &str = "routes-certificates";

fn routes_certificates() -> Value {
    json!({
        "routes": {"enabled": true, "tls": {"signer": {"certificateLifetimeSecs": 7200}}},
        "uplinks": ["eth0"],
    })
}

/// Values helm must refuse, and what its message must name.
fn bad_cases() -> Vec<(&'static str, Value, Vec<&'static str>)> {
    vec![
        (
            "unknown dataplane",
            json!({"dataplane": "bpf"}),
            vec!["/dataplane", "'ebpf', 'kernel'"],
        ),
        (
            "node authority: deny and warn",
            json!({"nodeAuthority": {"validationActions": ["Deny", "Warn"]}}),
            vec!["/nodeAuthority/validationActions"],
        ),
        (
            "node authority: no action",
            json!({"nodeAuthority": {"validationActions": []}}),
            vec!["/nodeAuthority/validationActions"],
        ),
        (
            "node authority: unknown action",
            json!({"nodeAuthority": {"validationActions": ["Block"]}}),
            vec![
                "/nodeAuthority/validationActions/0",
                "'Deny', 'Warn', 'Audit'",
            ],
        ),
        (
            "unknown datastore",
            json!({"datastore": {"type": "embedded"}}),
            vec!["/datastore/type"],
        ),
        (
            "cidr prefix too long",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/33"}]}),
            vec!["/pools/0/cidr", "10.244.0.0/33"],
        ),
        (
            "cidr not an address",
            json!({"pools": [{"name": "p", "cidr": "10.300.0.0/16"}]}),
            vec!["/pools/0/cidr", "10.300.0.0/16"],
        ),
        (
            "cidr without prefix",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0"}]}),
            vec!["/pools/0/cidr", "10.244.0.0"],
        ),
        (
            "v6 cidr garbage",
            json!({"pools": [{"name": "p", "cidr": "fd00::zz/48"}]}),
            vec!["/pools/0/cidr", "fd00::zz/48"],
        ),
        (
            "v4 block size",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/16", "blockSize": 19}]}),
            vec!["/pools/0/blockSize", "19"],
        ),
        (
            "v6 block size",
            json!({"pools": [{"name": "p", "cidr": "fd00::/48", "blockSize": 26}]}),
            vec!["/pools/0/blockSize", "26"],
        ),
        (
            "pool name not DNS",
            json!({"pools": [{"name": "Pods_A", "cidr": "10.244.0.0/16"}]}),
            vec!["/pools/0/name", "Pods_A"],
        ),
        (
            "pool without cidr",
            json!({"pools": [{"name": "p"}]}),
            vec!["/pools/0", "cidr"],
        ),
        ("no pools", json!({"pools": []}), vec!["/pools"]),
        (
            "unknown pool vxlan",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/16", "vxlan": "sometimes"}]}),
            vec!["/pools/0/vxlan"],
        ),
        (
            "mtu a string",
            json!({"cni": {"mtu": "big"}}),
            vec!["/cni/mtu", "string"],
        ),
        (
            "mtu too small",
            json!({"cni": {"mtu": 40}}),
            vec!["/cni/mtu", "40"],
        ),
        (
            "port a string",
            json!({"metrics": {"port": "9091"}}),
            vec!["/metrics/port", "string"],
        ),
        (
            "port out of range",
            json!({"routes": {"port": 70000}}),
            vec!["/routes/port", "maximum"],
        ),
        (
            "boolean a string",
            json!({"xdp": {"enabled": "yes"}}),
            vec!["/xdp/enabled", "string"],
        ),
        (
            "list a string",
            json!({"uplinks": "eth0"}),
            vec!["/uplinks", "string"],
        ),
        (
            "typo in a key",
            json!({"dataplan": "ebpf"}),
            vec!["dataplan"],
        ),
        (
            "typo in a nested key",
            json!({"cni": {"mut": 1400}}),
            vec!["/cni", "mut"],
        ),
        (
            "relative cni bin dir",
            json!({"cniBinDir": "opt/cni/bin"}),
            vec!["/cniBinDir", "opt/cni/bin"],
        ),
        (
            "conf name without .conflist",
            json!({"cni": {"confName": "10-calix.conf"}}),
            vec!["/cni/confName", "10-calix.conf"],
        ),
        (
            "bad network name",
            json!({"cni": {"networkName": "a/b"}}),
            vec!["/cni/networkName", "a/b"],
        ),
        (
            "unknown cni log level",
            json!({"cni": {"logLevel": "loud"}}),
            vec!["/cni/logLevel"],
        ),
        (
            "etcd without endpoints",
            json!({"datastore": {"type": "etcd"}}),
            vec!["/datastore"],
        ),
        (
            "etcd endpoint not a URL",
            json!({"datastore": {"type": "etcd", "etcd": {"endpoints": ["10.0.0.1:2379"]}}}),
            vec!["/datastore/etcd/endpoints/0", "10.0.0.1:2379"],
        ),
        (
            "xdp on the kernel dataplane",
            json!({"dataplane": "kernel", "uplinks": ["eth0"], "xdp": {"enabled": true}}),
            vec!["/dataplane", "ebpf"],
        ),
        (
            "xdp without uplinks",
            json!({"xdp": {"enabled": true}}),
            vec!["/uplinks"],
        ),
        (
            "bad deny cidr",
            json!({"xdp": {"denyCidrs": ["192.0.2.0/40"]}}),
            vec!["/xdp/denyCidrs/0", "192.0.2.0/40"],
        ),
        (
            "bad failsafe port",
            json!({"xdp": {"failsafePorts": ["tcp:0"]}}),
            vec!["/xdp/failsafePorts/0", "tcp:0"],
        ),
        (
            "unknown xdp mode",
            json!({"xdp": {"mode": "turbo"}}),
            vec!["/xdp/mode"],
        ),
        (
            "v6 in non-masquerade",
            json!({"nat": {"nonMasqueradeCidrs": ["fd00::/8"]}}),
            vec!["/nat/nonMasqueradeCidrs/0", "fd00::/8"],
        ),
        (
            "bad service cidr",
            json!({"nat": {"serviceCidrs": ["10.96.0.0/12x"]}}),
            vec!["/nat/serviceCidrs/0", "10.96.0.0/12x"],
        ),
        (
            "routes without uplinks",
            json!({"routes": {"enabled": true, "plaintext": true}}),
            vec!["/uplinks"],
        ),
        (
            "the removed Secret of every node's keys",
            json!({"routes": {"enabled": true, "tls": {"secretName": "calix-routes-tls"}}, "uplinks": ["eth0"]}),
            vec!["/routes/tls", "'secretName'"],
        ),
        (
            "unknown tls source",
            json!({"routes": {"tls": {"source": "secret"}}}),
            vec!["/routes/tls/source", "'kubernetes', 'hostPath'"],
        ),
        (
            "relative tls host path",
            json!({"routes": {"tls": {"source": "hostPath", "hostPath": "etc/calix/tls"}}}),
            vec!["/routes/tls/hostPath", "etc/calix/tls"],
        ),
        (
            "certificate lifetime too short",
            json!({"routes": {"tls": {"signer": {"certificateLifetimeSecs": 30}}}}),
            vec!["/routes/tls/signer/certificateLifetimeSecs", "minimum"],
        ),
        (
            "unknown topology",
            json!({"routes": {"topology": "star"}}),
            vec!["/routes/topology"],
        ),
        (
            "vni out of range",
            json!({"vxlan": {"vni": 16777216}}),
            vec!["/vxlan/vni", "maximum"],
        ),
        (
            "zero resync",
            json!({"resyncIntervalSecs": 0}),
            vec!["/resyncIntervalSecs", "0"],
        ),
        (
            "unknown pull policy",
            json!({"image": {"pullPolicy": "Sometimes"}}),
            vec!["/image/pullPolicy"],
        ),
        (
            "bad node selector label",
            json!({"nodeSelector": {"bad key!": "x"}}),
            vec!["/nodeSelector", "'bad key!'"],
        ),
        (
            "namespace selector with an unknown operator",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/16",
                "namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Like", "values": ["x"]}]}}]}),
            vec!["/pools/0/namespaceSelector/matchExpressions/0/operator"],
        ),
        (
            "namespace selector In without values",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/16",
                "namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]}),
            vec!["/pools/0/namespaceSelector/matchExpressions/0", "values"],
        ),
    ]
}

/// Values the schema cannot judge (relations between values): the templates refuse them.
fn template_refusals() -> Vec<(&'static str, Value, Vec<&'static str>)> {
    vec![
        (
            "nat ports reversed",
            json!({"nat": {"portMin": 30000, "portMax": 20000}}),
            vec!["nat.portMin", "30000", "nat.portMax", "20000"],
        ),
        (
            "pool names twice",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/16"}, {"name": "p", "cidr": "10.245.0.0/16"}]}),
            vec!["pools", "\"p\""],
        ),
        (
            "block larger than its pool",
            json!({"pools": [{"name": "p", "cidr": "10.244.0.0/24", "blockSize": 22}]}),
            vec!["pools", "10.244.0.0/24", "blockSize 22"],
        ),
        (
            "namespace selector outside the kubernetes datastore",
            json!({"datastore": {"type": "etcd", "etcd": {"endpoints": ["http://192.0.2.10:2379"]}},
                "pools": [{"name": "p", "cidr": "10.244.0.0/16",
                    "namespaceSelector": {"matchLabels": {"tenant": "a"}}}]}),
            vec![
                "pools",
                "p",
                "namespaceSelector",
                "datastore.type kubernetes",
            ],
        ),
    ]
}

/// Values that render but make objects Kubernetes refuses: the validation must see them.
fn invalid_objects() -> Vec<(&'static str, Value, &'static str)> {
    vec![
        (
            "resources of the wrong shape",
            json!({"resources": {"requests": {"cpu": ["1"]}}}),
            "resources",
        ),
        (
            "a toleration with an unknown field",
            json!({"tolerations": [{"operator": "Exists", "tolerateAll": true}]}),
            "tolerateAll",
        ),
    ]
}

#[derive(Debug)]
struct CaseResult {
    lint: Vec<Value>,
    schema_error: Option<String>,
    render_error: Option<String>,
    objects: Vec<(String, Value)>,
    problems: Vec<String>,
    unchecked: Vec<String>,
}

struct Checked {
    defaults: Value,
    cases: BTreeMap<String, CaseResult>,
}

/// Runs check.py once for every case of this file.
fn checked() -> &'static Checked {
    static CHECKED: OnceLock<Checked> = OnceLock::new();
    CHECKED.get_or_init(|| {
        let root = chart_tools::workspace_root();
        let venv = chart_tools::venv_dir(&root).expect("charts/tools/requirements.txt");
        assert!(
            chart_tools::is_complete(&venv),
            "the chart tools are not installed at {}: run `cargo xtask setup`",
            venv.display()
        );
        let mut cases = vec![
            json!({"name": "defaults", "values": {}}),
            json!({"name": "all-a", "values": all_a()}),
            json!({"name": "all-b", "values": all_b()}),
            // The kubernetes datastore with route reflectors: two DaemonSets of one release.
            json!({"name": "reflectors", "values":
                {"uplinks": ["eth0"],
                 "routes": {"enabled": true, "topology": "reflectors", "plaintext": true}}}),
            json!({"name": "no-node-authority", "values": {"nodeAuthority": {"enabled": false}}}),
            json!({"name": ROUTES_CERTIFICATES, "values": routes_certificates()}),
            json!({"name": KUBE_PROXY_REPLACED, "values": kube_proxy_replaced()}),
            json!({"name": KUBE_PROXY_KEPT, "values": kube_proxy_kept()}),
        ];
        for (name, values, _) in bad_cases().into_iter().chain(template_refusals()) {
            cases.push(json!({"name": name, "values": values}));
        }
        for (name, values, _) in invalid_objects() {
            cases.push(json!({"name": name, "values": values}));
        }
        let dir = tempfile_dir();
        let cases_file = dir.join("cases.json");
        std::fs::write(&cases_file, serde_json::to_vec(&cases).expect("json")).expect("write");
        let started = std::time::Instant::now();
        let out = Command::new(chart_tools::python(&venv))
            .arg(root.join(chart_tools::CHECK_SCRIPT))
            .arg(root.join(chart_tools::CHART))
            .arg(&cases_file)
            .arg(KUBE_VERSION)
            .output()
            .expect("run charts/tools/check.py");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "check.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!(
            "check.py: {} cases linted, rendered and validated in {:?}",
            cases.len(),
            started.elapsed()
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("check.py prints JSON");
        let mut results = BTreeMap::new();
        for r in v["results"].as_array().expect("results") {
            let text = |k: &str| r[k].as_str().map(str::to_string);
            results.insert(
                r["name"].as_str().expect("name").to_string(),
                CaseResult {
                    lint: r["lint"].as_array().cloned().unwrap_or_default(),
                    schema_error: text("schema_error"),
                    render_error: text("render_error"),
                    objects: r["objects"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|o| {
                            (
                                o["template"].as_str().unwrap_or_default().to_string(),
                                o["object"].clone(),
                            )
                        })
                        .collect(),
                    problems: strings(&r["problems"]),
                    unchecked: strings(&r["unchecked"]),
                },
            );
        }
        Checked {
            defaults: v["defaults"].clone(),
            cases: results,
        }
    })
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// A new temporary directory of this test process (the caller removes it).
fn tempfile_dir() -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("calix-chart-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn case(name: &str) -> &'static CaseResult {
    checked()
        .cases
        .get(name)
        .unwrap_or_else(|| panic!("no result for case {name}"))
}

/// The rendered objects of `name` of `kind`.
fn objects<'a>(r: &'a CaseResult, kind: &str) -> Vec<&'a Value> {
    r.objects
        .iter()
        .map(|(_, o)| o)
        .filter(|o| o["kind"] == kind)
        .collect()
}

fn one<'a>(r: &'a CaseResult, kind: &str, name: &str) -> &'a Value {
    objects(r, kind)
        .into_iter()
        .find(|o| o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// A rendered case must lint clean, render, and validate; calix's kinds against the CRDs.
fn assert_valid(name: &str) -> &'static CaseResult {
    let r = case(name);
    let noisy: Vec<&Value> = r.lint.iter().filter(|m| m["severity"] != "info").collect();
    assert!(noisy.is_empty(), "{name}: lint: {noisy:#?}");
    assert_eq!(r.schema_error, None, "{name}");
    assert_eq!(r.render_error, None, "{name}");
    assert!(r.problems.is_empty(), "{name}: {:#?}", r.problems);
    assert!(r.unchecked.is_empty(), "{name}: {:#?}", r.unchecked);
    assert!(
        r.objects.len() >= 6,
        "{name}: only {} objects",
        r.objects.len()
    );
    r
}

/// The agent config in the ConfigMap, read and validated by the agent's own code.
fn agent_config(r: &CaseResult, file: &str) -> AgentConfig {
    let cm = objects(r, "ConfigMap")
        .into_iter()
        .find(|c| c["data"].get(file).is_some())
        .unwrap_or_else(|| panic!("no ConfigMap with {file}"));
    let text = cm["data"][file].as_str().expect("text");
    let mut c = AgentConfig::from_toml(text)
        .unwrap_or_else(|e| panic!("{file} is not the agent's TOML: {e}\n{text}"));
    // Each agent gets --node-name from the downward API.
    assert_eq!(
        c.node_name, "",
        "node_name must come from the pod, not the file"
    );
    c.node_name = "node-a".into();
    c.validate()
        .unwrap_or_else(|e| panic!("{file} refused by the agent: {e}\n{text}"));
    c
}

/// The IPPool objects' specs, as the agent reads them, validated together as its pools.
fn ippools(r: &CaseResult) -> Vec<(String, PoolSpec)> {
    let pools: Vec<(String, PoolSpec)> = objects(r, "IPPool")
        .into_iter()
        .map(|o| {
            let name = o["metadata"]["name"].as_str().expect("name").to_string();
            let pool: PoolSpec = serde_json::from_value(o["spec"].clone())
                .unwrap_or_else(|e| panic!("IPPool {name}: not a pool for the agent: {e}"));
            (name, pool)
        })
        .collect();
    let mut c = AgentConfig {
        node_name: "node-a".into(),
        ..AgentConfig::default()
    };
    // (IPPool objects are the kubernetes datastore's pools.)
    c.datastore.kind = "kubernetes".into();
    c.pools = pools.iter().map(|(_, p)| p.clone()).collect();
    c.validate().expect("the IPPools are a valid pool set");
    pools
}

/// The init container's arguments, with the kubelet's `$(NODE_NAME)` expanded and the host
/// paths pointed at temporary directories, run through the real calix-install-cni; the
/// conflist it writes, checked by the plugin's own parser.
fn install_cni(ds: &Value, node: &str) -> Value {
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["name"], "install-cni");
    let dir = tempfile_dir();
    let (bin, net) = (dir.join("bin"), dir.join("net"));
    std::fs::create_dir_all(&bin).expect("mkdir");
    std::fs::create_dir_all(&net).expect("mkdir");
    // The node's portmap.
    std::fs::write(bin.join("portmap"), "").expect("portmap");
    let plugin = calix_testbed::bin("calix");
    let mut args = Vec::new();
    for a in init["args"].as_array().expect("args") {
        let a = a.as_str().expect("string").replace("$(NODE_NAME)", node);
        let a = if a.starts_with("--bin-dir=") {
            format!("--bin-dir={}", bin.display())
        } else if a.starts_with("--net-dir=") {
            format!("--net-dir={}", net.display())
        } else if a.starts_with("--plugin=") {
            format!("--plugin={}", plugin.display())
        } else {
            a
        };
        args.push(a);
    }
    let out = Command::new(calix_testbed::bin("calix-install-cni"))
        .args(&args)
        .output()
        .expect("run calix-install-cni");
    assert!(
        out.status.success(),
        "calix-install-cni {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conf_name = args
        .iter()
        .find_map(|a| a.strip_prefix("--conf-name="))
        .expect("--conf-name");
    let text = std::fs::read_to_string(net.join(conf_name)).expect("the conflist");
    let list: Value = serde_json::from_str(&text).expect("json");
    let mut entry = list["plugins"][0].clone();
    entry["name"] = list["name"].clone();
    entry["cniVersion"] = list["cniVersion"].clone();
    calix_cni::config::NetConf::parse(entry.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("the plugin refuses the conflist: {e:?}\n{text}"));
    assert!(bin.join("calix").is_file(), "the plugin was not installed");
    let _ = std::fs::remove_dir_all(&dir);
    list
}

/// What NOTES.txt says after an install.
fn notes(r: &CaseResult) -> &str {
    r.objects
        .iter()
        .find(|(t, _)| t.ends_with("NOTES.txt"))
        .map(|(_, o)| o["notes"].as_str().unwrap_or_default())
        .expect("NOTES.txt")
}

fn has_mount(container: &Value, path: &str) -> bool {
    container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|m| m["mountPath"] == path)
}

fn host_paths(ds: &Value) -> Vec<String> {
    ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["hostPath"]["path"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn defaults_render_valid_objects_for_every_node() {
    let r = assert_valid("defaults");
    // A reflector label no kubelet can set on its own Node.
    let c = agent_config(r, "agent.toml");
    assert_eq!(
        c.routes.reflector_label,
        "node-restriction.kubernetes.io/calix-route-reflector"
    );
    let ds = one(r, "DaemonSet", "calix");
    let pod = &ds["spec"]["template"]["spec"];
    let agent = &pod["containers"][0];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(agent["securityContext"]["privileged"], true);
    assert_eq!(
        pod["tolerations"],
        json!([{"operator": "Exists"}]),
        "tolerates every taint"
    );
    assert_eq!(ds["spec"]["updateStrategy"]["type"], "RollingUpdate");
    // Host paths, and where each is mounted.
    let paths = host_paths(ds);
    for p in [
        "/sys/fs/bpf",
        "/opt/cni/bin",
        "/etc/cni/net.d",
        "/var/run/calix",
        "/var/lib/calix",
    ] {
        assert!(paths.iter().any(|h| h == p), "no hostPath {p}: {paths:?}");
    }
    for m in ["/sys/fs/bpf", "/var/run/calix", "/var/lib/calix"] {
        assert!(has_mount(agent, m), "agent lacks {m}");
    }
    let init = &pod["initContainers"][0];
    assert!(has_mount(init, "/host/opt/cni/bin") && has_mount(init, "/host/etc/cni/net.d"));
    // Probes on the agent's HTTP door, which the config binds where the kubelet reaches it.
    assert_eq!(agent["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(agent["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(agent["livenessProbe"]["httpGet"]["port"], "metrics");
    let metrics_port = agent["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("metrics port")["containerPort"]
        .clone();
    assert_eq!(metrics_port, 9091);
    let annotations = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "9091");
    assert!(annotations["checksum/config"].is_string());
    assert!(agent["resources"]["requests"]["cpu"].is_string());
    // The image `cargo xtask image` builds: localhost/calix:<workspace version> (the chart's
    // appVersion must follow the workspace's).
    assert_eq!(
        agent["image"],
        format!("localhost/calix:{}", env!("CARGO_PKG_VERSION"))
    );
    // The agent's config: the kubernetes datastore, the metrics door on every address.
    let c = agent_config(r, "agent.toml");
    assert_eq!(c.datastore.kind, "kubernetes");
    assert_eq!(c.metrics_addr, "0.0.0.0:9091");
    assert_eq!(
        c.routes.listen, ":5474",
        "the Routes port on the node's own addresses"
    );
    assert!(
        !c.doors.pods_reach_metrics && !c.doors.pods_reach_routes,
        "pods reach no agent port"
    );
    assert_eq!(c.dataplane, DataplaneMode::Ebpf);
    // Pools are IPPool objects.
    let pools = ippools(r);
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0].0, "default-ipv4");
    assert_eq!(pools[0].1.cidr.to_string(), "10.244.0.0/16");
    assert!(pools[0].1.nat_outgoing);
    // The init container installs a conflist: calix, then portmap, the agent's socket.
    let list = install_cni(ds, "node-a");
    assert_eq!(list["name"], "k8s-pod-network");
    assert_eq!(list["plugins"][0]["type"], "calix");
    assert_eq!(list["plugins"][1]["type"], "portmap");
    assert_eq!(
        list["plugins"][0]["agent_socket"],
        "/var/run/calix/agent.sock"
    );
    assert!(list["plugins"][0].get("mtu").is_none());
    // RBAC: the DaemonSet's service account, bound to the role.
    let sa = pod["serviceAccountName"].as_str().expect("sa");
    one(r, "ServiceAccount", sa);
    let binding = one(r, "ClusterRoleBinding", "calix");
    assert_eq!(binding["roleRef"]["name"], "calix");
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}])
    );
    // The helm test hooks and NOTES.txt.
    let test_pod = one(r, "Pod", "calix-test-pod-to-pod");
    assert_eq!(test_pod["metadata"]["annotations"]["helm.sh/hook"], "test");
    let echo = one(r, "DaemonSet", "calix-test-echo");
    assert_eq!(echo["metadata"]["annotations"]["helm.sh/hook"], "test");
    let args = strings(&test_pod["spec"]["containers"][0]["command"]);
    assert!(
        args.contains(&"--pool=10.244.0.0/16".to_string()),
        "{args:?}"
    );
    let notes = notes(r);
    assert!(notes.contains("helm test calix"), "{notes}");
    assert!(notes.contains("routes.enabled is false"), "{notes}");
}

#[test]
fn the_cluster_role_is_least_privilege() {
    let r = assert_valid("defaults");
    let role = one(r, "ClusterRole", "calix");
    let rules = role["rules"].as_array().expect("rules");
    let grants = |group: &str, resource: &str| -> Vec<String> {
        rules
            .iter()
            .filter(|r| strings(&r["apiGroups"]).iter().any(|g| g == group))
            .filter(|r| strings(&r["resources"]).iter().any(|x| x == resource))
            .flat_map(|r| strings(&r["verbs"]))
            .collect()
    };
    for rule in rules {
        for field in ["apiGroups", "resources", "verbs"] {
            assert!(
                !strings(&rule[field]).iter().any(|s| s == "*"),
                "wildcard {field} in {rule}"
            );
        }
        assert!(
            !strings(&rule["resources"])
                .iter()
                .any(|s| s == "secrets" || s == "configmaps"),
            "{rule}"
        );
    }
    // Read only: every Node, Pod and Namespace (NetworkPolicy's selectors read them all).
    for resource in ["nodes", "pods", "namespaces"] {
        let mut v = grants("", resource);
        v.sort();
        assert_eq!(v, ["get", "list", "watch"], "{resource}");
    }
    assert_eq!(grants("", "events"), ["create"]);
    for resource in ["servicecidrs", "networkpolicies"] {
        let mut v = grants("networking.k8s.io", resource);
        v.sort();
        assert_eq!(v, ["get", "list", "watch"], "{resource}");
    }
    assert!(!grants("", "pods").contains(&"delete".to_string()));
    for kind in [
        "ipamblocks",
        "ipamhandles",
        "blockaffinities",
        "calixnodes",
        "calixendpoints",
    ] {
        let v = grants("calix.dev", kind);
        for verb in ["get", "list", "watch", "create", "update", "delete"] {
            assert!(v.iter().any(|x| x == verb), "{kind}: {verb} missing");
        }
    }
    // Pools and BGP's settings are the operator's: read only.
    for kind in ["ippools", "bgpconfigurations", "bgppeers"] {
        let mut read = grants("calix.dev", kind);
        read.sort();
        assert_eq!(read, ["get", "list", "watch"], "{kind}");
    }
    // cleanupOnUninstall: in the release's namespace, the agent's own DaemonSets only, read
    // only (a stop is an uninstall when its DaemonSet is gone).
    let role = one(r, "Role", "calix");
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": ["apps"], "resources": ["daemonsets"],
            "resourceNames": ["calix", "calix-reflector"], "verbs": ["get", "list", "watch"]}])
    );
    assert_eq!(one(r, "RoleBinding", "calix")["roleRef"]["name"], "calix");
}

/// `(kind, name) -> (apiVersion, spec)` of the node authority's rendered objects.
fn authority_objects(r: &CaseResult) -> BTreeMap<(String, String), Value> {
    r.objects
        .iter()
        .map(|(_, o)| o)
        .filter(|o| {
            o["kind"] == "ValidatingAdmissionPolicy"
                || o["kind"] == "ValidatingAdmissionPolicyBinding"
        })
        .map(|o| {
            (
                (
                    o["kind"].as_str().unwrap_or_default().to_string(),
                    o["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                ),
                json!({"apiVersion": o["apiVersion"], "spec": o["spec"]}),
            )
        })
        .collect()
}

#[test]
fn the_node_authority_is_the_one_the_test_bed_installs_for_the_agents_service_account() {
    // The tests run their agents under calix_testbed::authority's objects: the chart must
    // render exactly those, for its own ServiceAccount and actions.
    for (case_name, sa, actions) in [
        ("defaults", "calix", vec!["Deny"]),
        ("all-b", "calix-sa", vec!["Warn", "Audit"]),
    ] {
        let r = assert_valid(case_name);
        let want: BTreeMap<(String, String), Value> =
            calix_testbed::authority::node_authority("calix", NAMESPACE, sa, &actions)
                .expect("the test bed's node authority")
                .into_iter()
                .map(|o| {
                    (
                        (
                            o["kind"].as_str().unwrap_or_default().to_string(),
                            o["metadata"]["name"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string(),
                        ),
                        json!({"apiVersion": o["apiVersion"], "spec": o["spec"]}),
                    )
                })
                .collect();
        assert_eq!(want.len(), 12, "{case_name}: {:?}", want.keys());
        assert_eq!(authority_objects(r), want, "{case_name}");
        for (_, o) in r.objects.iter().filter(|(_, o)| {
            o["kind"] == "ValidatingAdmissionPolicy"
                || o["kind"] == "ValidatingAdmissionPolicyBinding"
        }) {
            assert_eq!(
                o["metadata"]["labels"]["app.kubernetes.io/name"], "calix",
                "{o}"
            );
        }
        let policy = one(r, "ValidatingAdmissionPolicy", "calix-ipamblocks");
        assert_eq!(
            policy["spec"]["matchConditions"][0]["expression"],
            format!("request.userInfo.username == \"system:serviceaccount:{NAMESPACE}:{sa}\""),
        );
        assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    }
    // None with the etcd datastore (nothing in the API to guard), nor when turned off.
    for case_name in ["all-a", "no-node-authority"] {
        assert!(
            authority_objects(assert_valid(case_name)).is_empty(),
            "{case_name}"
        );
    }
}

#[test]
fn the_agent_follows_its_daemonset_to_clean_up_on_uninstall() {
    let r = assert_valid("defaults");
    let pod = &one(r, "DaemonSet", "calix")["spec"]["template"]["spec"];
    let args = strings(&pod["containers"][0]["args"]);
    for a in [
        "--owner-daemonset=kube-system/calix",
        // Its sibling, even in mesh topology: a switch to reflectors and back deletes one.
        "--sibling-daemonset=kube-system/calix-reflector",
        "--cni-conf=/host/etc/cni/net.d/10-calix.conflist",
    ] {
        assert!(args.contains(&a.to_string()), "{a} not in {args:?}");
    }
    assert!(has_mount(&pod["containers"][0], "/host/etc/cni/net.d"));
    // With reflectors, each DaemonSet names the other.
    let r = assert_valid("reflectors");
    for (ds, sibling) in [("calix", "calix-reflector"), ("calix-reflector", "calix")] {
        let args =
            strings(&one(r, "DaemonSet", ds)["spec"]["template"]["spec"]["containers"][0]["args"]);
        let want = format!("--sibling-daemonset=kube-system/{sibling}");
        assert!(args.contains(&want), "{ds}: {want} not in {args:?}");
    }
    // all-a: the etcd datastore (no API to follow the DaemonSet by) and cleanupOnUninstall
    // false: neither the flags nor the Role.
    let case_name = "all-a";
    let r = assert_valid(case_name);
    let ds = &objects(r, "DaemonSet")
        .into_iter()
        .find(|d| d["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .expect("the agents' DaemonSet");
    let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(
        !args.iter().any(|a| a.starts_with("--owner-daemonset")),
        "{case_name}: {args:?}"
    );
    assert!(
        objects(r, "Role")
            .iter()
            .all(|r| r["metadata"]["annotations"]["helm.sh/hook"] == "test"),
        "{case_name}: only the helm test's Role"
    );
}

#[test]
fn every_value_set_renders_and_reaches_the_agent() {
    let r = assert_valid("all-a");
    // Route reflectors: two DaemonSets whose node selections never overlap.
    let agents = one(r, "DaemonSet", "calix");
    let reflectors = one(r, "DaemonSet", "calix-reflector");
    assert_eq!(
        reflectors["spec"]["template"]["spec"]["nodeSelector"]["example.com/rr"],
        "true"
    );
    let term = &agents["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        ["matchExpressions"][0];
    assert_eq!(
        (&term["key"], &term["operator"]),
        (&json!("example.com/rr"), &json!("NotIn"))
    );
    let c = agent_config(r, "agent.toml");
    let rc = agent_config(r, "reflector.toml");
    assert!(!c.routes.reflector && rc.routes.reflector);
    assert_eq!(c.routes.topology, Topology::Reflectors);
    // The Node label that makes a reflector reaches both kinds of agents.
    assert_eq!(c.routes.reflector_label, "example.com/rr");
    assert_eq!(rc.routes.reflector_label, "example.com/rr");
    // Every value of all-a, as the agent reads it.
    assert_eq!(c.dataplane, DataplaneMode::Ebpf);
    assert_eq!(c.log_level, "calix_agent=debug");
    assert_eq!(c.uplinks, ["eth0", "eth1"]);
    assert_eq!(c.metrics_addr, "127.0.0.1:9191");
    assert_eq!(c.resync_interval_secs, 10);
    assert_eq!(c.datastore.kind, "etcd");
    assert_eq!(
        c.datastore.endpoints,
        ["http://192.0.2.10:2379", "https://etcd.example:2379"]
    );
    assert_eq!(c.datastore.prefix, "/calix-a/");
    assert_eq!((c.datastore.timeout_ms, c.datastore.attempts), (3000, 5));
    assert!(c.ipam.strict_affinity);
    assert_eq!(
        (
            c.ipam.max_blocks_per_node,
            c.ipam.leak_check_interval_secs,
            c.ipam.leak_grace_secs,
            c.ipam.empty_block_grace_secs
        ),
        (8, 30, 120, 60)
    );
    assert!(c.xdp.enabled);
    assert_eq!(
        c.xdp.deny_cidrs,
        ["192.0.2.0/24", "2001:db8::/32", "198.51.100.7"]
    );
    assert_eq!(c.xdp.failsafe_ports, ["tcp:22", "udp:53"]);
    assert_eq!(c.nat.service_cidrs, ["10.100.0.0/16", "fd00:96::/108"]);
    assert_eq!(c.nat.non_masquerade_cidrs, ["172.16.0.0/12"]);
    assert_eq!(
        (c.nat.conntrack_entries, c.nat.port_min, c.nat.port_max),
        (65536, 20000, 30000)
    );
    assert_eq!(
        (c.policy.entries, c.policy.flows, c.policy.keep_established),
        (100000, 65536, true)
    );
    assert!(c.routes.enabled && !c.routes.plaintext);
    assert_eq!(c.routes.listen, "[::]:5575");
    assert!(c.doors.pods_reach_routes && c.doors.pods_reach_metrics);
    assert_eq!(c.routes.grace_secs, 60);
    assert_eq!(
        c.routes.tls.cert,
        Path::new("/etc/calix/tls/node.crt").to_path_buf()
    );
    assert_eq!((c.vxlan.vni, c.vxlan.port), (4097, 4790));
    assert!(c.bgp.enabled);
    assert_eq!(c.bgp.password_dir, Path::new("/etc/calix/bgp-passwords"));
    // etcd: the pools are in the config file.
    assert_eq!(c.pools.len(), 2);
    assert_eq!(c.pools[0].cidr.to_string(), "10.250.0.0/16");
    assert_eq!(c.pools[0].block_size, Some(24));
    assert_eq!(c.pools[0].previous_block_sizes, [26, 28]);
    assert!(c.pools[0].disabled && !c.pools[0].nat_outgoing);
    assert_eq!(
        c.pools[0]
            .node_selector
            .get("calix.dev/tier")
            .map(String::as_str),
        Some("x")
    );
    assert_eq!(c.pools[1].cidr.to_string(), "fd00:250::/48");
    assert!(objects(r, "IPPool").is_empty(), "etcd: no IPPool objects");
    // TLS from files on each node: its own directory of the host path, read only; no
    // Secret, no signer.
    assert_eq!(c.routes.tls.source, CertSource::Files);
    let pod = &agents["spec"]["template"]["spec"];
    let mounts = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts");
    let tls = mounts
        .iter()
        .find(|m| m["mountPath"] == "/etc/calix/tls")
        .expect("the TLS mount");
    assert_eq!(
        (&tls["subPathExpr"], &tls["readOnly"]),
        (&json!("$(NODE_NAME)"), &json!(true))
    );
    let volume = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == tls["name"])
        .expect("its volume");
    assert_eq!(
        volume["hostPath"],
        json!({"path": "/etc/calix/pki", "type": "Directory"})
    );
    assert!(objects(r, "Deployment").is_empty(), "no signer with files");
    assert!(objects(r, "Secret").is_empty());
    // Per-node host paths: each node's own subdirectory, and its socket in the conflist.
    assert!(mounts
        .iter()
        .any(|m| m["mountPath"] == "/var/run/calix" && m["subPathExpr"] == "$(NODE_NAME)"));
    assert!(host_paths(agents).contains(&"/usr/libexec/cni".to_string()));
    let list = install_cni(agents, "node-b");
    assert_eq!(list["name"], "calix-net");
    assert_eq!(
        list["plugins"][0]["agent_socket"],
        "/run/calix-test/node-b/agent.sock"
    );
    assert_eq!(list["plugins"][0]["mtu"], 1400);
    assert_eq!(list["plugins"][0]["log_level"], "debug");
    assert_eq!(
        list["plugins"].as_array().map(Vec::len),
        Some(1),
        "no portmap"
    );
    // uninstallOnStop: the preStop removes the conflist.
    let pre_stop = strings(&pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]);
    assert!(
        pre_stop.contains(&"--uninstall".to_string()),
        "{pre_stop:?}"
    );
    assert_eq!(pod["serviceAccountName"], "calix-existing");
    assert!(objects(r, "ServiceAccount")
        .iter()
        .all(|s| s["metadata"]["annotations"]["helm.sh/hook"] == "test"));
    assert_eq!(
        pod["containers"][0]["image"],
        "registry.example/calix/calix:v9.9.9"
    );

    let r = assert_valid("all-b");
    let c = agent_config(r, "agent.toml");
    assert_eq!(c.dataplane, DataplaneMode::Kernel);
    assert_eq!(c.datastore.kind, "kubernetes");
    assert!(c.routes.enabled && c.routes.plaintext);
    let pools = ippools(r);
    assert_eq!(
        pools.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["blue", "green"]
    );
    assert_eq!(
        pools[1].1.node_selector.get("pool").map(String::as_str),
        Some("green")
    );
    assert_eq!(pools[0].1.namespace_selector, None, "{{}}: no selector");
    assert_eq!(
        pools[1]
            .1
            .namespace_selector
            .as_ref()
            .map(ToString::to_string)
            .as_deref(),
        Some("tenant=green,env notin (prod),!legacy")
    );
    assert_eq!(pools[0].1.previous_block_sizes, [24]);
    assert_eq!(
        install_cni(one(r, "DaemonSet", "calix"), "n")["plugins"][0]["mtu"],
        9000
    );
}

/// Values that are maps handed to Kubernetes as they are: documented and compared whole.
const FREE_FORM: &[&str] = &[
    "nodeSelector",
    "routes.tls.signer.resources",
    "podAnnotations",
    "podLabels",
    "resources",
    "updateStrategy",
    "probes.liveness",
    "probes.readiness",
];

/// Leaf keys of `v`, dotted (lists and [`FREE_FORM`] maps are leaves; the pools' keys are
/// checked as `pools[].key`).
fn leaves(prefix: &str, v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) if !m.is_empty() && !FREE_FORM.contains(&prefix) => {
            for (k, x) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&p, x, out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

fn at<'a>(v: &'a Value, dotted: &str) -> Option<&'a Value> {
    dotted.split('.').try_fold(v, |v, k| v.get(k))
}

#[test]
fn the_all_value_cases_change_every_documented_value() {
    let defaults = &checked().defaults;
    let mut keys = Vec::new();
    leaves("", defaults, &mut keys);
    assert!(keys.len() > 40, "only {} keys: {keys:?}", keys.len());
    let cases = [all_a(), all_b(), kube_proxy_replaced(), kube_proxy_kept()];
    let docs = std::fs::read_to_string(chart_tools::workspace_root().join("docs/install.md"))
        .expect("docs/install.md");
    let mut missing = Vec::new();
    for key in &keys {
        let changed = cases
            .iter()
            .any(|c| at(c, key).is_some_and(|v| Some(v) != at(defaults, key)));
        if !changed && key != "pools" {
            missing.push(format!("{key}: no case sets another value"));
        }
        if !docs.contains(&format!("`{key}`")) {
            missing.push(format!("{key}: not in docs/install.md"));
        }
    }
    // The pools' keys, in some pool of some case.
    let pool_keys: Vec<String> = defaults["pools"][0]
        .as_object()
        .expect("a default pool")
        .keys()
        .cloned()
        .collect();
    for k in &pool_keys {
        let default = &defaults["pools"][0][k];
        let changed = cases.iter().any(|c| {
            c["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p.get(k).is_some_and(|v| v != default))
        });
        if !changed {
            missing.push(format!("pools[].{k}: no case sets another value"));
        }
        if !docs.contains(&format!("`pools[].{k}`")) {
            missing.push(format!("pools[].{k}: not in docs/install.md"));
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");
}

#[test]
fn bad_values_are_refused_naming_the_value() {
    let mut failures = Vec::new();
    for (name, _, named) in bad_cases() {
        let r = case(name);
        match (&r.schema_error, &r.render_error) {
            (Some(schema), Some(_)) => {
                for n in &named {
                    if !schema.contains(n) {
                        failures.push(format!("{name}: message does not name {n:?}: {schema}"));
                    }
                }
            }
            _ => failures.push(format!(
                "{name}: accepted (schema {:?}, render {:?})",
                r.schema_error, r.render_error
            )),
        }
        if !r.objects.is_empty() {
            failures.push(format!("{name}: rendered objects anyway"));
        }
    }
    for (name, _, named) in template_refusals() {
        let r = case(name);
        match &r.render_error {
            Some(e) => {
                for n in &named {
                    if !e.contains(n) {
                        failures.push(format!("{name}: message does not name {n:?}: {e}"));
                    }
                }
            }
            None => failures.push(format!("{name}: rendered")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn objects_kubernetes_would_refuse_are_caught_by_the_validation() {
    for (name, _, field) in invalid_objects() {
        let r = case(name);
        assert_eq!(r.render_error, None, "{name} renders");
        assert!(
            r.problems.iter().any(|p| p.contains(field)),
            "{name}: the validation did not see {field}: {:#?}",
            r.problems
        );
    }
}

/// Every integer of values.schema.json (path, minimum, maximum).
fn schema_integers() -> Vec<(String, Option<u64>, Option<u64>)> {
    let path = chart_tools::workspace_root().join("charts/calix/values.schema.json");
    let schema: Value =
        serde_json::from_slice(&std::fs::read(&path).expect("the schema")).expect("JSON");
    fn walk(v: &Value, path: &str, out: &mut Vec<(String, Option<u64>, Option<u64>)>) {
        match v {
            Value::Object(m) => {
                if m.get("type") == Some(&json!("integer")) {
                    out.push((
                        path.to_string(),
                        m.get("minimum").and_then(Value::as_u64),
                        m.get("maximum").and_then(Value::as_u64),
                    ));
                }
                for (k, v) in m {
                    let p = match k.as_str() {
                        "properties" | "$defs" | "anyOf" | "oneOf" | "allOf" => path.to_string(),
                        _ if path.is_empty() => k.clone(),
                        _ => format!("{path}.{k}"),
                    };
                    walk(v, &p, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, path, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&schema, "", &mut out);
    out
}

/// Issue 20, item 8: every duration and size of the values has a maximum, and a value the
/// agent also bounds has the agent's maximum (AgentConfig::bounded, one truth): helm refuses
/// what the agent would, and nothing it lets through makes the agent fail to start.
#[test]
fn every_number_of_the_values_has_a_maximum_the_agent_agrees_with() {
    let integers = schema_integers();
    assert!(integers.len() > 10, "{integers:?}");
    let unbounded: Vec<&String> = integers
        .iter()
        .filter(|(_, _, max)| max.is_none())
        .map(|(p, ..)| p)
        .collect();
    assert!(
        unbounded.is_empty(),
        "no maximum in values.schema.json: {unbounded:?}"
    );
    // The values the agent's config takes, and its key for each.
    let agent_keys = [
        ("datastore.timeoutMs", "datastore.timeout_ms"),
        ("datastore.attempts", "datastore.attempts"),
        ("resyncIntervalSecs", "resync_interval_secs"),
        ("ipam.maxBlocksPerNode", "ipam.maxBlocksPerNode"),
        ("ipam.leakCheckIntervalSecs", "ipam.leakCheckIntervalSecs"),
        ("ipam.leakGraceSecs", "ipam.leakGraceSecs"),
        ("ipam.emptyBlockGraceSecs", "ipam.emptyBlockGraceSecs"),
        ("nat.conntrackEntries", "nat.conntrack_entries"),
        ("policy.entries", "policy.entries"),
        ("policy.flows", "policy.flows"),
        ("kubeProxyReplacement.frontends", "services.frontends"),
        ("kubeProxyReplacement.backends", "services.backends"),
        ("routes.graceSecs", "routes.grace_secs"),
    ];
    let bounds = AgentConfig::default().bounded();
    for (value, key) in agent_keys {
        let (_, min, max) = integers
            .iter()
            .find(|(p, ..)| p == value)
            .unwrap_or_else(|| panic!("{value} is not in the schema"));
        let b = bounds
            .iter()
            .find(|b| b.key == key)
            .unwrap_or_else(|| panic!("the agent does not bound {key}"));
        assert_eq!(
            (*min, *max),
            (Some(b.min), Some(b.max)),
            "{value}: the schema's range differs from the agent's {key}"
        );
    }
}

/// The rules of a rendered (Cluster)Role `name` that grant `verb` on `resource` of `group`,
/// as (resourceNames, verbs).
fn grants_of(role: &Value, group: &str, resource: &str) -> Vec<(Vec<String>, Vec<String>)> {
    role["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| strings(&r["apiGroups"]).iter().any(|g| g == group))
        .filter(|r| strings(&r["resources"]).iter().any(|x| x == resource))
        .map(|r| (strings(&r["resourceNames"]), strings(&r["verbs"])))
        .collect()
}

#[test]
fn routes_over_tls_by_default_get_certificates_through_the_api_from_a_least_privileged_signer() {
    let r = assert_valid(ROUTES_CERTIFICATES);
    let c = agent_config(r, "agent.toml");
    assert!(c.routes.enabled && !c.routes.plaintext);
    assert_eq!(c.routes.tls.source, CertSource::Kubernetes);
    assert_eq!(c.routes.tls.signer_name, "calix.dev/routes");
    assert_eq!(
        c.routes.tls.ca_config_map(),
        Some((NAMESPACE, "calix-routes-ca"))
    );
    // No key reaches the agents' pods: no Secret, no TLS volume.
    let ds = one(r, "DaemonSet", "calix");
    let pod = &ds["spec"]["template"]["spec"];
    assert!(!has_mount(&pod["containers"][0], "/etc/calix/tls"));
    assert!(
        !pod["volumes"].to_string().contains("secret"),
        "{}",
        pod["volumes"]
    );
    assert!(objects(r, "Secret").is_empty());
    // The signer: one, on the host network, on any node, unprivileged, its lifetime.
    let d = one(r, "Deployment", "calix-signer");
    assert_eq!(d["spec"]["replicas"], 1);
    assert_eq!(d["spec"]["strategy"]["type"], "Recreate");
    let spec = &d["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["tolerations"], json!([{"operator": "Exists"}]));
    assert_eq!(spec["serviceAccountName"], "calix-signer");
    let container = &spec["containers"][0];
    assert_eq!(container["securityContext"]["runAsNonRoot"], true);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    let args = strings(&container["args"]);
    for a in [
        "--agent-service-account=kube-system/calix",
        "--namespace=kube-system",
        "--ca-secret=calix-routes-ca",
        "--ca-config-map=calix-routes-ca",
        "--lifetime-secs=7200",
    ] {
        assert!(args.contains(&a.to_string()), "{a} not in {args:?}");
    }
    assert_eq!(
        one(r, "ServiceAccount", "calix-signer")["kind"],
        "ServiceAccount"
    );
    // The agents: ask and follow requests, read the bundle; never approve or sign, never a
    // Secret.
    let agent = one(r, "ClusterRole", "calix");
    let mut csr = grants_of(agent, "certificates.k8s.io", "certificatesigningrequests");
    assert_eq!(csr.len(), 1, "{csr:?}");
    csr[0].1.sort();
    assert_eq!(csr[0].1, ["create", "get", "list", "watch"]);
    for sub in [
        "certificatesigningrequests/approval",
        "certificatesigningrequests/status",
        "signers",
    ] {
        assert!(
            grants_of(agent, "certificates.k8s.io", sub).is_empty(),
            "{sub}"
        );
    }
    let reader = one(r, "Role", "calix-routes-ca-reader");
    assert_eq!(
        reader["rules"],
        json!([{"apiGroups": [""], "resources": ["configmaps"],
            "resourceNames": ["calix-routes-ca"], "verbs": ["get", "list", "watch"]}])
    );
    let binding = one(r, "RoleBinding", "calix-routes-ca-reader");
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "calix", "namespace": NAMESPACE}])
    );
    for b in objects(r, "RoleBinding")
        .into_iter()
        .chain(objects(r, "ClusterRoleBinding"))
    {
        if b["subjects"][0]["name"] != "calix" {
            continue;
        }
        let role = one(
            r,
            b["roleRef"]["kind"].as_str().unwrap_or_default(),
            b["roleRef"]["name"].as_str().unwrap_or_default(),
        );
        assert!(
            grants_of(role, "", "secrets").is_empty(),
            "the agents may read a Secret: {role}"
        );
    }
    // The signer: approve and sign for calix.dev/routes only; the requests' approval and
    // status patched, nothing else of them written; Nodes read.
    let signer = one(r, "ClusterRole", "calix-signer");
    assert_eq!(
        grants_of(signer, "certificates.k8s.io", "signers"),
        [(
            vec!["calix.dev/routes".to_string()],
            vec!["approve".to_string(), "sign".to_string()]
        )]
    );
    for sub in [
        "certificatesigningrequests/approval",
        "certificatesigningrequests/status",
    ] {
        assert_eq!(
            grants_of(signer, "certificates.k8s.io", sub),
            [(vec![], vec!["patch".to_string()])],
            "{sub}"
        );
    }
    let mut read = grants_of(signer, "certificates.k8s.io", "certificatesigningrequests");
    read[0].1.sort();
    assert_eq!(read[0].1, ["get", "list", "watch"]);
    assert_eq!(
        grants_of(signer, "", "nodes"),
        [(vec![], vec!["get".to_string()])]
    );
    assert!(
        grants_of(signer, "", "secrets").is_empty(),
        "no Secret cluster-wide"
    );
    // In the release's namespace: its CA's Secret read by name, the bundle read and written
    // by name, both created (a create has no name to limit it to), its ServiceAccount read.
    let role = one(r, "Role", "calix-signer");
    let secrets = grants_of(role, "", "secrets");
    assert!(secrets.contains(&(vec!["calix-routes-ca".to_string()], vec!["get".to_string()])));
    assert!(secrets.contains(&(vec![], vec!["create".to_string()])));
    assert_eq!(secrets.len(), 2, "{secrets:?}");
    let cms = grants_of(role, "", "configmaps");
    assert!(cms.contains(&(
        vec!["calix-routes-ca".to_string()],
        vec!["get".to_string(), "update".to_string()]
    )));
    assert!(grants_of(role, "", "serviceaccounts").is_empty());
    // Off without routes, or in plain text.
    for name in ["defaults", "all-b"] {
        let r = assert_valid(name);
        assert!(objects(r, "Deployment").is_empty(), "{name}");
        assert!(
            grants_of(
                one(r, "ClusterRole", "calix"),
                "certificates.k8s.io",
                "certificatesigningrequests"
            )
            .is_empty(),
            "{name}"
        );
    }
}

#[test]
fn kube_proxy_replaced_reaches_the_agent_with_the_hosts_cgroup_and_the_api_server() {
    let r = assert_valid(KUBE_PROXY_REPLACED);
    let c = agent_config(r, "agent.toml");
    assert!(c.services.enabled && c.services.translate);
    assert_eq!(c.services.external_cidrs, ["203.0.113.0/24", "2001:db8::7"]);
    assert_eq!((c.services.frontends, c.services.backends), (1000, 4000));
    assert_eq!(c.services_cgroup(), PathBuf::from("/run/calix/cgroup"));
    let ds = one(r, "DaemonSet", "calix");
    let pod = &ds["spec"]["template"]["spec"];
    let agent = &pod["containers"][0];
    assert!(has_mount(agent, "/run/calix/cgroup"));
    assert!(
        host_paths(ds).contains(&"/sys/fs/cgroup/unified".to_string()),
        "{:?}",
        host_paths(ds)
    );
    let env = |c: &Value| -> Vec<(String, String)> {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| {
                Some((
                    e["name"].as_str()?.to_string(),
                    e["value"].as_str()?.to_string(),
                ))
            })
            .collect()
    };
    let direct = [
        (
            "KUBERNETES_SERVICE_HOST".to_string(),
            "192.0.2.1".to_string(),
        ),
        ("KUBERNETES_SERVICE_PORT".to_string(), "443".to_string()),
    ];
    for e in &direct {
        assert!(env(agent).contains(e), "{:?}", env(agent));
    }
    let signer = one(r, "Deployment", "calix-signer");
    let signer = &signer["spec"]["template"]["spec"]["containers"][0];
    for e in &direct {
        assert!(env(signer).contains(e), "{:?}", env(signer));
    }
    // On by default (the kubernetes datastore, the eBPF dataplane): the host's /sys/fs/cgroup
    // (the agent takes its `unified` on a hybrid host), the kubernetes Service as before until
    // apiServer.host is set.
    let d = assert_valid("defaults");
    let c = agent_config(d, "agent.toml");
    assert!(c.services.enabled && c.services.translate);
    assert_eq!(c.services_cgroup(), PathBuf::from("/run/calix/cgroup"));
    let ds = one(d, "DaemonSet", "calix");
    assert!(has_mount(
        &ds["spec"]["template"]["spec"]["containers"][0],
        "/run/calix/cgroup"
    ));
    assert!(host_paths(ds).contains(&"/sys/fs/cgroup".to_string()));
    assert!(!ds.to_string().contains("KUBERNETES_SERVICE_HOST"));
    assert!(
        notes(d).contains("Services: calix translates them"),
        "{}",
        notes(d)
    );
    // Kernel mode (all-b) and the etcd datastore (all-a) keep kube-proxy, whatever the value
    // says, and the notes say so: no [services], no cgroup.
    for (name, kept) in [
        ("all-b", "the kernel dataplane"),
        ("all-a", "the etcd datastore"),
    ] {
        let r = assert_valid(name);
        let c = agent_config(r, "agent.toml");
        assert!(!c.services.enabled && !c.services.translate, "{name}");
        let ds = one(r, "DaemonSet", "calix");
        assert!(
            !has_mount(
                &ds["spec"]["template"]["spec"]["containers"][0],
                "/run/calix/cgroup"
            ),
            "{name}"
        );
        let n = notes(r);
        assert!(
            n.contains("Services: kube-proxy's") && n.contains(kept),
            "{name}: {n}"
        );
    }
    // Turned off: kube-proxy's Services, nothing said.
    let r = assert_valid(KUBE_PROXY_KEPT);
    let c = agent_config(r, "agent.toml");
    assert!(!c.services.enabled && !c.services.translate);
    let ds = one(r, "DaemonSet", "calix");
    assert!(!has_mount(
        &ds["spec"]["template"]["spec"]["containers"][0],
        "/run/calix/cgroup"
    ));
    assert!(!notes(r).contains("Services:"), "{}", notes(r));
}
