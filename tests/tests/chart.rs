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

use calix_agent::config::{AgentConfig, DataplaneMode, PoolConfig, Topology};
use calix_testbed::chart_tools;
use serde_json::{json, Value};

/// The Kubernetes version the objects are validated against (the e2e cluster runs v1.36.2).
const KUBE_VERSION: &str = "1.36.0";
const NAMESPACE: &str = "kube-system";

/// Every value changed from its default (with `ALL_B`, every key of values.yaml): the etcd
/// datastore, eBPF with XDP, route reflectors over TLS, per-node host paths.
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
        "metrics": {"bindAddress": "127.0.0.1", "port": 9191},
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
        "routes": {"enabled": true, "port": 5575, "topology": "reflectors",
                   "reflectorLabel": "example.com/rr", "graceSecs": 60, "plaintext": false,
                   "tls": {"secretName": "calix-routes-tls"}},
        "vxlan": {"vni": 4097, "port": 4790},
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
             "nodeSelector": {"pool": "green"}}
        ],
        "routes": {"enabled": true, "plaintext": true, "topology": "mesh"},
        "serviceAccount": {"create": true, "name": "calix-sa"}
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
            "routes without tls",
            json!({"routes": {"enabled": true}, "uplinks": ["eth0"]}),
            vec!["/routes/plaintext", "/routes/tls/secretName"],
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
fn ippools(r: &CaseResult) -> Vec<(String, PoolConfig)> {
    let pools: Vec<(String, PoolConfig)> = objects(r, "IPPool")
        .into_iter()
        .map(|o| {
            let name = o["metadata"]["name"].as_str().expect("name").to_string();
            let pool: PoolConfig = serde_json::from_value(o["spec"].clone())
                .unwrap_or_else(|e| panic!("IPPool {name}: not a pool for the agent: {e}"));
            (name, pool)
        })
        .collect();
    let mut c = AgentConfig {
        node_name: "node-a".into(),
        ..AgentConfig::default()
    };
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
    let notes = r
        .objects
        .iter()
        .find(|(t, _)| t.ends_with("NOTES.txt"))
        .map(|(_, o)| o["notes"].as_str().unwrap_or_default())
        .expect("NOTES.txt");
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
    for resource in ["nodes", "pods"] {
        let mut v = grants("", resource);
        v.sort();
        assert_eq!(v, ["get", "list", "watch"], "{resource}");
    }
    assert_eq!(grants("", "events"), ["create"]);
    assert_eq!(grants("", "namespaces"), ["get"]);
    let mut cidrs = grants("networking.k8s.io", "servicecidrs");
    cidrs.sort();
    assert_eq!(cidrs, ["get", "list", "watch"]);
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
    // Pools are the operator's: read only.
    let mut pools = grants("calix.dev", "ippools");
    pools.sort();
    assert_eq!(pools, ["get", "list", "watch"]);
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

#[test]
fn the_agent_follows_its_daemonset_to_clean_up_on_uninstall() {
    let r = assert_valid("defaults");
    let pod = &one(r, "DaemonSet", "calix")["spec"]["template"]["spec"];
    let args = strings(&pod["containers"][0]["args"]);
    for a in [
        "--owner-daemonset=kube-system/calix",
        "--cni-conf=/host/etc/cni/net.d/10-calix.conflist",
    ] {
        assert!(args.contains(&a.to_string()), "{a} not in {args:?}");
    }
    assert!(has_mount(&pod["containers"][0], "/host/etc/cni/net.d"));
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
    assert!(c.routes.enabled && !c.routes.plaintext);
    assert_eq!(c.routes.listen, "0.0.0.0:5575");
    assert_eq!(c.routes.grace_secs, 60);
    assert_eq!(
        c.routes.tls.cert,
        Path::new("/etc/calix/tls/node.crt").to_path_buf()
    );
    assert_eq!((c.vxlan.vni, c.vxlan.port), (4097, 4790));
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
    // The TLS secret: ca.crt, and the node's own certificate and key by its name.
    let pod = &agents["spec"]["template"]["spec"];
    let mounts = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts");
    let cert = mounts
        .iter()
        .find(|m| m["mountPath"] == "/etc/calix/tls/node.crt")
        .expect("cert mount");
    assert_eq!(cert["subPathExpr"], "$(NODE_NAME).crt");
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
    assert_eq!(pools[0].1.previous_block_sizes, [24]);
    assert_eq!(
        install_cni(one(r, "DaemonSet", "calix"), "n")["plugins"][0]["mtu"],
        9000
    );
}

/// Values that are maps handed to Kubernetes as they are: documented and compared whole.
const FREE_FORM: &[&str] = &[
    "nodeSelector",
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
    let cases = [all_a(), all_b()];
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
