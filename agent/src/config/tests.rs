//! The config's tests: parsing, validation with its bounds, and the conversion into each
//! module's settings.
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use calix_core::ipam::pool::VxlanMode;
use calix_core::routes::peers::Topology;

use super::error::ConfigError;
use super::sections::{DoorsConfig, NatConfig, RoutesConfig, TlsConfig};
use super::*;
use crate::distribution::settings::ListenOn;
use crate::distribution::tls::CertSource;
use calix_dataplane::xdp::XdpMode;

#[test]
fn empty_file_gives_defaults() {
    let c = AgentConfig::from_toml("").expect("parse");
    assert_eq!(c, AgentConfig::default());
    assert_eq!(c.pools[0].block_size(), 26);
    assert_eq!(c.dataplane, DataplaneMode::Ebpf);
}

#[test]
fn full_file_parses() {
    let c = AgentConfig::from_toml(
        r#"
        node_name = "node-a"
        socket = "/tmp/a.sock"
        dataplane = "kernel"
        tc_attach = "tc"
        [datastore]
        type = "embedded"
        path = "/tmp/store.json"
        [[pools]]
        cidr = "10.10.0.0/16"
        blockSize = 28
        natOutgoing = true
        [[pools]]
        cidr = "fd00:10::/64"
        "#,
    )
    .expect("parse");
    assert_eq!(c.node_name, "node-a");
    assert_eq!(c.dataplane, DataplaneMode::Kernel);
    assert_eq!(c.tc_attach, calix_dataplane::tcx::TcAttach::Tc);
    assert_eq!(c.datastore.path, PathBuf::from("/tmp/store.json"));
    assert_eq!(c.pools.len(), 2);
    assert_eq!(c.pools[0].block_size(), 28);
    assert!(c.pools[0].nat_outgoing);
    assert_eq!(c.pools[1].block_size(), 122);
    c.validate().expect("valid");
}

#[test]
fn unknown_keys_and_bad_values_are_errors() {
    assert!(AgentConfig::from_toml("nodename = \"x\"").is_err());
    assert!(AgentConfig::from_toml("dataplane = \"xdp\"").is_err());
    assert!(AgentConfig::from_toml("tc_attach = \"netkit\"").is_err());
    assert!(AgentConfig::from_toml("[[pools]]\ncidr = \"10.0.0.0/33\"").is_err());
}

#[test]
fn block_size_out_of_range_names_the_pool() {
    let mut c = AgentConfig {
        node_name: "n".into(),
        ..Default::default()
    };
    c.pools[0].block_size = Some(19);
    let err = c.validate().expect_err("19 is out of range").to_string();
    assert!(err.contains("10.244.0.0/16"), "{err}");
    c.pools[0] = PoolSpec::new("10.0.0.0/28".parse().expect("cidr"));
    c.pools[0].block_size = Some(26);
    assert!(matches!(
        c.validate(),
        Err(ConfigError::BlockLargerThanPool { .. })
    ));
}

#[test]
fn previous_block_sizes_are_checked_like_the_block_size_and_reach_the_allocator() {
    let text = "node_name = \"n\"\n[[pools]]\ncidr = \"10.0.0.0/16\"\nblockSize = 28\npreviousBlockSizes = [26, 24]";
    let c = AgentConfig::from_toml(text).expect("parse");
    c.validate().expect("valid");
    assert_eq!(c.node_pools()[0].previous_block_sizes, [26, 24]);
    for bad in ["[19]", "[15]", "[33]"] {
        let c = AgentConfig::from_toml(&format!(
            "node_name = \"n\"\n[[pools]]\ncidr = \"10.0.0.0/16\"\npreviousBlockSizes = {bad}"
        ))
        .expect("parse");
        let err = c.validate().expect_err(bad).to_string();
        assert!(err.contains("10.0.0.0/16"), "{bad}: {err}");
    }
}

#[test]
fn overlapping_pools_name_both() {
    let c = AgentConfig::from_toml(
        "node_name = \"n\"\n[[pools]]\ncidr = \"10.0.0.0/16\"\n[[pools]]\ncidr = \"10.0.128.0/20\"",
    )
    .expect("parse");
    let err = c.validate().expect_err("overlap").to_string();
    assert!(
        err.contains("10.0.0.0/16") && err.contains("10.0.128.0/20"),
        "{err}"
    );
}

#[test]
fn kubernetes_takes_a_kubeconfig_and_refuses_configured_pools() {
    let c = AgentConfig::from_toml(
        "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\nkubeconfig = \"/etc/calix/kubeconfig\"\n",
    )
    .expect("parse");
    c.validate().expect("valid");
    let k = c.datastore.kubernetes();
    assert_eq!(
        k.kubeconfig.as_deref(),
        Some(Path::new("/etc/calix/kubeconfig"))
    );
    assert_eq!((k.timeout.as_millis(), k.attempts), (2000, 12));
    // No kubeconfig: the pod's service account.
    let c = AgentConfig::from_toml("node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\n")
        .expect("parse");
    assert_eq!(c.datastore.kubernetes().kubeconfig, None);
    // Pools are IPPool objects there: [[pools]] is an error that says so.
    let c = AgentConfig::from_toml(
        "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\n[[pools]]\ncidr = \"10.1.0.0/16\"\n",
    )
    .expect("parse");
    let e = c.validate().expect_err("pools refused");
    assert!(matches!(e, ConfigError::PoolsInKubernetes), "{e}");
    assert!(e.to_string().contains("IPPool"), "{e}");
    let mut c = AgentConfig::from_toml(
        "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\nattempts = 0\n",
    )
    .expect("parse");
    assert!(matches!(
        c.validate(),
        Err(ConfigError::OutOfRange {
            key: "datastore.attempts",
            ..
        })
    ));
    c.datastore.kind = "etcd".into();
    c.datastore.endpoints = vec!["http://127.0.0.1:2379".into()];
    assert!(matches!(
        c.validate(),
        Err(ConfigError::OutOfRange {
            key: "datastore.attempts",
            ..
        })
    ));
}

#[test]
fn node_selector_picks_pools_and_etcd_needs_endpoints() {
    let mut c = AgentConfig::from_toml(
        r#"
        node_name = "n"
        node_labels = { zone = "a" }
        [ipam]
        strictAffinity = true
        maxBlocksPerNode = 4
        [datastore]
        type = "etcd"
        [[pools]]
        cidr = "10.1.0.0/16"
        nodeSelector = { zone = "a" }
        [[pools]]
        cidr = "10.2.0.0/16"
        nodeSelector = { zone = "b" }
        "#,
    )
    .expect("parse");
    assert!(matches!(c.validate(), Err(ConfigError::NoEtcdEndpoints)));
    c.datastore.endpoints = vec!["http://127.0.0.1:2379".into()];
    c.validate().expect("valid");
    let pools = c.node_pools();
    assert_eq!(pools.len(), 2);
    assert_eq!(pools[0].cidr.to_string(), "10.1.0.0/16");
    assert!(!pools[0].disabled);
    assert!(pools[1].disabled, "zone b's pool: nothing new from it here");
    assert!(c.ipam.policy().strict_affinity);
    assert_eq!(c.ipam.policy().max_blocks_per_node, 4);
    c.datastore.kind = "consul".into();
    assert!(matches!(
        c.validate(),
        Err(ConfigError::DatastoreKind { .. })
    ));
}

#[test]
fn a_namespace_selector_restricts_a_pool_and_needs_kubernetes() {
    let text = r#"
        node_name = "n"
        [[pools]]
        cidr = "10.1.0.0/16"
        [[pools]]
        cidr = "10.2.0.0/16"
        namespaceSelector = { matchLabels = { tenant = "a" }, matchExpressions = [
            { key = "env", operator = "NotIn", values = ["prod"] } ] }
        "#;
    let mut c = AgentConfig::from_toml(text).expect("parse");
    let sel = c.pools[1].namespace_selector.clone().expect("the selector");
    assert_eq!(sel.to_string(), "tenant=a,env notin (prod)");
    let pools = c.node_pools();
    assert!(!pools[0].restricted && pools[1].restricted);
    assert!(!pools[1].disabled);
    let e = c.validate().expect_err("embedded datastore");
    assert!(
        matches!(e, ConfigError::NamespaceSelectorNeedsKubernetes { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("10.2.0.0/16"), "{e}");
    // With the kubernetes datastore the pools are IPPools, validated the same way.
    c.datastore.kind = "kubernetes".into();
    c.pools_configured = false;
    c.validate().expect("valid");
    c.pools[1].namespace_selector = Some(
        serde_json::from_str(r#"{"matchExpressions": [{"key": "tenant", "operator": "In"}]}"#)
            .expect("parse"),
    );
    let e = c.validate().expect_err("In without values");
    assert!(matches!(e, ConfigError::NamespaceSelector { .. }), "{e}");
    assert!(
        format!("{:#}", anyhow::Error::from(e)).contains("needs at least one value"),
        "the source says why"
    );
}

#[test]
fn xdp_section_parses_and_names_bad_entries() {
    let c = AgentConfig::from_toml(
        r#"
        node_name = "n"
        uplinks = ["eth0"]
        metrics_addr = "0.0.0.0:9191"
        [xdp]
        enabled = true
        mode = "generic"
        deny_cidrs = ["192.0.2.0/24", "198.51.100.7", "2001:db8::/32", "192.0.2.9/24"]
        failsafe_ports = ["tcp:2222", "udp:53"]
        "#,
    )
    .expect("parse");
    c.validate().expect("valid");
    let s = c.xdp_settings().expect("settings").expect("enabled");
    assert_eq!(s.mode, XdpMode::Generic);
    let deny: Vec<String> = s.policy.deny.iter().map(ToString::to_string).collect();
    assert_eq!(
        deny,
        ["192.0.2.0/24", "198.51.100.7/32", "2001:db8::/32"],
        "host bits cleared, duplicates folded"
    );
    let ports: Vec<String> = s.policy.failsafe.iter().map(ToString::to_string).collect();
    assert_eq!(
        ports,
        ["tcp:2222", "tcp:9191", "udp:53"],
        "metrics port added"
    );

    let mut bad = c.clone();
    bad.xdp.deny_cidrs.push("192.0.2.0/33".into());
    let err = bad.validate().expect_err("bad CIDR").to_string();
    assert!(err.contains("192.0.2.0/33"), "{err}");
    let mut bad = c.clone();
    bad.xdp.failsafe_ports.push("tcp:ssh".into());
    let err = bad.validate().expect_err("bad port").to_string();
    assert!(err.contains("tcp:ssh"), "{err}");
    let mut bad = c.clone();
    bad.uplinks.clear();
    assert!(matches!(bad.validate(), Err(ConfigError::XdpNoUplinks)));
    bad.dataplane = DataplaneMode::Kernel;
    assert!(matches!(bad.validate(), Err(ConfigError::XdpNeedsEbpf)));
    assert!(AgentConfig::from_toml("[xdp]\nmode = \"offload\"").is_err());
}

#[test]
fn xdp_is_off_by_default_with_ssh_and_metrics_failsafe() {
    let c = AgentConfig {
        node_name: "n".into(),
        ..Default::default()
    };
    c.validate().expect("valid");
    assert_eq!(c.xdp_settings().expect("settings"), None);
    let ports: Vec<String> = c
        .xdp_policy()
        .expect("policy")
        .failsafe
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ports, ["tcp:22", "tcp:9091"]);
}

#[test]
fn nat_section_parses_and_is_checked() {
    let c = AgentConfig::from_toml(
        r#"
        node_name = "n"
        uplinks = ["eth0"]
        [[pools]]
        cidr = "10.10.0.0/16"
        natOutgoing = true
        [[pools]]
        cidr = "10.20.0.0/16"
        [[pools]]
        cidr = "fd00:10::/64"
        natOutgoing = true
        [nat]
        non_masquerade_cidrs = ["192.168.0.0/16", "172.16.0.9"]
        conntrack_entries = 1000
        tcp_established_secs = 100
        tcp_syn_secs = 20
        tcp_closing_secs = 3
        udp_secs = 30
        icmp_secs = 10
        port_min = 20000
        port_max = 20999
        cleaner_interval_secs = 2
        "#,
    )
    .expect("parse");
    c.validate().expect("valid");
    let s = c.nat_settings().expect("settings");
    let strs = |v: &[ipnet::Ipv4Net]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
    assert_eq!(
        strs(&s.nat_pools),
        ["10.10.0.0/16"],
        "IPv4 natOutgoing pools only"
    );
    assert_eq!(
        strs(&s.no_snat),
        [
            "10.10.0.0/16",
            "10.20.0.0/16",
            "192.168.0.0/16",
            "172.16.0.9/32"
        ]
    );
    assert_eq!(
        (s.port_min, s.port_max, s.conntrack_entries),
        (20000, 20999, 1000)
    );
    assert_eq!(s.timeouts.tcp_closing.as_secs(), 3);
    let mut bad = c.clone();
    bad.nat.non_masquerade_cidrs.push("2001:db8::/32".into());
    assert!(matches!(bad.validate(), Err(ConfigError::NatCidr { .. })));
    let mut bad = c.clone();
    bad.nat.port_max = 100;
    assert!(matches!(bad.validate(), Err(ConfigError::Nat { .. })));
    let mut bad = c;
    bad.nat.udp_secs = 0;
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::OutOfRange {
            key: "nat.udp_secs",
            ..
        })
    ));
    let d = NatConfig::default();
    assert!(d.port_max < 32768, "below the kernel's ephemeral ports");
}

/// `service_cidrs`: IPv4 and IPv6 ranges (or addresses), never a pool's; the IPv4 ones
/// join what the programs never translate (SIGHUP reloads them with the rest).
#[test]
fn service_cidrs_parse_and_never_overlap_pools() {
    let text = r#"
        node_name = "n"
        [[pools]]
        cidr = "10.244.0.0/16"
        natOutgoing = true
        [nat]
        non_masquerade_cidrs = ["192.168.0.0/16"]
        service_cidrs = ["10.96.0.0/12", "fd00:96::/108", "203.0.113.7"]
        "#;
    let c = AgentConfig::from_toml(text).expect("parse");
    c.validate().expect("valid");
    let s = c.nat_settings().expect("settings");
    let strs = |v: &[ipnet::Ipv4Net]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
    assert_eq!(strs(&s.service), ["10.96.0.0/12", "203.0.113.7/32"]);
    assert_eq!(
        s.services()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.96.0.0/12", "203.0.113.7/32", "fd00:96::/108"],
        "NetworkPolicy's Service ranges: both families"
    );
    assert_eq!(
        strs(&s.untranslated()),
        [
            "10.244.0.0/16",
            "192.168.0.0/16",
            "10.96.0.0/12",
            "203.0.113.7/32"
        ]
    );
    let mut bad = c.clone();
    bad.nat.service_cidrs = vec!["10.96.0.0/33".into()];
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::ServiceCidr { entry }) if entry == "10.96.0.0/33"
    ));
    let mut bad = c.clone();
    bad.nat.service_cidrs = vec!["10.0.0.0/8".into()];
    let err = bad.validate().expect_err("a Service range over the pool");
    assert!(
        matches!(err, ConfigError::ServiceOverlapsPool { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("10.244.0.0/16"), "{err}");
    let mut bad = c;
    bad.nat.service_cidrs = vec!["10.244.5.0/24".into()];
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::ServiceOverlapsPool { .. })
    ));
}

/// `[policy]` sizes the eBPF dataplane's NetworkPolicy maps, within bounds, and says whether
/// established flows outlive a change.
#[test]
fn the_policy_map_sizes_come_from_the_config() {
    let c = AgentConfig::from_toml(
        "node_name = \"n\"\n[policy]\nentries = 1000\nflows = 4096\nkeep_established = true\n",
    )
    .expect("parse");
    let e = c.ebpf_config(None).expect("settings");
    assert_eq!(
        (e.policy.entries, e.policy.flows, e.policy.keep_established),
        (1000, 4096, true)
    );
    let d = AgentConfig::default().ebpf_config(None).expect("settings");
    assert_eq!(
        (d.policy.entries, d.policy.flows, d.policy.keep_established),
        (
            calix_common::DEFAULT_POLICY_ENTRIES,
            calix_common::DEFAULT_POLICY_FLOWS,
            false
        )
    );
    for (toml, key) in [
        ("entries = 0", "policy.entries"),
        ("entries = 16777217", "policy.entries"),
        ("flows = 8", "policy.flows"),
        ("flows = 4194305", "policy.flows"),
    ] {
        let c = AgentConfig::from_toml(&format!("node_name = \"n\"\n[policy]\n{toml}\n"))
            .expect("parse");
        match c.validate() {
            Err(ConfigError::OutOfRange { key: k, .. }) => assert_eq!(k, key, "{toml}"),
            other => panic!("{toml}: {other:?}"),
        }
    }
    assert!(AgentConfig::from_toml("node_name = \"n\"\n[policy]\nsize = 5\n").is_err());
}

/// The per-endpoint budget defaults to a quarter of the table's flows; 0 turns it off.
#[test]
fn the_conntrack_budget_and_pressure_settings() {
    let c = AgentConfig::from_toml("node_name = \"n\"\n[nat]\nconntrack_entries = 64\n")
        .expect("parse");
    let s = c.nat_settings().expect("settings");
    assert_eq!(s.ct_budget, 8);
    assert_eq!(s.program_config(&[1]).ct_budget, 8);
    assert_eq!(s.pressure_unanswered, std::time::Duration::from_secs(2));
    let c = AgentConfig::from_toml(
        "node_name = \"n\"\n[nat]\nconntrack_flows_per_endpoint = 0\npressure_unanswered_secs = 5\n",
    )
    .expect("parse");
    let s = c.nat_settings().expect("settings");
    assert_eq!((s.ct_budget, s.pressure_unanswered.as_secs()), (0, 5));
    let mut bad = c.clone();
    bad.nat.pressure_unanswered_secs = 0;
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::OutOfRange {
            key: "nat.pressure_unanswered_secs",
            ..
        })
    ));
    let mut bad = c.clone();
    bad.nat.conntrack_flows_per_endpoint = Some(u32::MAX);
    assert!(matches!(bad.validate(), Err(ConfigError::Nat { .. })));
    // The programs' ports must leave the host's masquerade some.
    let mut bad = c;
    (bad.nat.port_min, bad.nat.port_max) = (1024, 65535);
    assert!(matches!(bad.validate(), Err(ConfigError::Nat { .. })));
}

#[test]
fn missing_node_name_is_an_error() {
    assert!(matches!(
        AgentConfig::default().validate(),
        Err(ConfigError::NoNodeName)
    ));
    for bad in ["a/b", "a\nb"] {
        let c = AgentConfig {
            node_name: bad.into(),
            ..AgentConfig::default()
        };
        assert!(
            matches!(c.validate(), Err(ConfigError::BadNodeName { .. })),
            "{bad:?}"
        );
    }
}

#[test]
fn missing_default_file_is_defaults_but_required_file_is_error() {
    let p = Path::new("/nonexistent/calix/agent.toml");
    assert_eq!(
        AgentConfig::load(p, false).expect("defaults"),
        AgentConfig::default()
    );
    assert!(matches!(
        AgentConfig::load(p, true),
        Err(ConfigError::Read { .. })
    ));
}

#[test]
fn pods_reach_no_agent_port_unless_allowed() {
    let mut c = AgentConfig::from_toml(
        "metrics_addr = \"0.0.0.0:9091\"\n[routes]\nenabled = true\nlisten = \":6000\"\nplaintext = true\n",
    )
    .expect("parse");
    assert_eq!(c.doors, DoorsConfig::default());
    let p = c.door_policy();
    assert_eq!(p.ports, [6000, 9091].into());
    assert!(p.peer_routes_ports);
    c.doors = AgentConfig::from_toml("[doors]\npods_reach_metrics = true\n")
        .expect("parse")
        .doors;
    assert_eq!(c.door_policy().ports, [6000].into(), "Prometheus in a pod");
    c.doors.pods_reach_routes = true;
    let p = c.door_policy();
    assert!(p.ports.is_empty() && !p.peer_routes_ports, "{p:?}");
    // Metrics on loopback only: no pod reaches it anyway; routes off: no Routes port.
    let d = AgentConfig::default();
    assert!(d.door_policy().ports.is_empty(), "{:?}", d.door_policy());
    assert!(AgentConfig::from_toml("[doors]\npods_reach_everything = true\n").is_err());
}

#[test]
fn routes_and_vxlan_parse_and_validate() {
    let text = r#"
        node_name = "n1"
        uplinks = ["eth0"]
        [routes]
        enabled = true
        listen = "0.0.0.0:5474"
        node_addresses = ["192.0.2.10"]
        topology = "reflectors"
        grace_secs = 30
        [routes.tls]
        cert = "/etc/calix/tls/node.crt"
        key = "/etc/calix/tls/node.key"
        ca = "/etc/calix/tls/ca.crt"
        [vxlan]
        vni = 7
        [[pools]]
        cidr = "10.244.0.0/16"
        vxlan = "always"
        [[pools]]
        cidr = "10.245.0.0/16"
    "#;
    let c = AgentConfig::from_toml(text).expect("parse");
    c.validate().expect("valid");
    assert_eq!(c.routes.topology, Topology::Reflectors);
    assert_eq!(c.pools[0].vxlan, VxlanMode::Always);
    assert_eq!(c.pools[1].vxlan, VxlanMode::CrossSubnet, "the default");
    assert_eq!((c.vxlan.vni, c.vxlan.port), (7, 4789));
    // The Routes port is failsafe for XDP.
    assert!(c
        .xdp_policy()
        .expect("policy")
        .failsafe
        .iter()
        .any(|f| f.port == 5474));

    let mut bad = c.clone();
    bad.routes.tls = TlsConfig::default();
    assert!(matches!(bad.validate(), Err(ConfigError::RoutesNoTls)));
    bad.routes.plaintext = true;
    bad.validate().expect("plain text when asked for");
    // A certificate through the Kubernetes API: no files needed, a signer and a
    // ConfigMap named.
    let k = AgentConfig::from_toml(
        "node_name = \"n1\"\nuplinks = [\"eth0\"]\n[routes]\nenabled = true\n[routes.tls]\nsource = \"kubernetes\"\n",
    )
    .expect("parse");
    k.validate().expect("kubernetes source");
    assert_eq!(k.routes.tls.source, CertSource::Kubernetes);
    assert_eq!(k.routes.tls.signer_name, "calix.dev/routes");
    assert_eq!(
        k.routes.tls.ca_config_map(),
        Some(("kube-system", "calix-routes-ca"))
    );
    for (signer, cm, key) in [
        ("calix.dev", "kube-system/x", "tls.signer_name"),
        ("/routes", "kube-system/x", "tls.signer_name"),
        ("calix.dev/routes", "x", "tls.ca_config_map"),
        ("calix.dev/routes", "ns/", "tls.ca_config_map"),
        ("calix.dev/routes", "a/b/c", "tls.ca_config_map"),
    ] {
        let mut bad = k.clone();
        bad.routes.tls.signer_name = signer.into();
        bad.routes.tls.ca_config_map = cm.into();
        match bad.validate() {
            Err(ConfigError::Routes { key: k, .. }) => assert_eq!(k, key, "{signer} {cm}"),
            other => panic!("{signer} {cm}: {other:?}"),
        }
    }
    assert!(
        AgentConfig::from_toml("[routes.tls]\nsource = \"secret\"\n").is_err(),
        "an unknown source"
    );
    let mut bad = c.clone();
    bad.uplinks.clear();
    let err = bad.validate().expect_err("no uplinks");
    assert!(matches!(err, ConfigError::RoutesNoUplinks), "{err}");
    assert!(err.to_string().contains("uplinks"), "{err}");
    assert_eq!(
        c.routes.listen_on(),
        Some(ListenOn::Address("0.0.0.0:5474".parse().expect("addr")))
    );
    assert_eq!(
        RoutesConfig::default().listen_on(),
        Some(ListenOn::NodeAddresses { port: 5474 }),
        "the node's own addresses by default"
    );
    for (listen, want) in [
        (":6000", Some(ListenOn::NodeAddresses { port: 6000 })),
        (
            "[fd00::1]:5474",
            Some(ListenOn::Address("[fd00::1]:5474".parse().expect("addr"))),
        ),
        ("0.0.0.0", None),
        (":0", None),
        (":", None),
        ("node-a:5474", None),
        ("192.0.2.1:99999", None),
    ] {
        let mut r = c.routes.clone();
        r.listen = listen.into();
        assert_eq!(r.listen_on(), want, "{listen}");
        let mut bad = c.clone();
        bad.routes.listen = listen.into();
        if want.is_none() {
            let err = bad.validate().expect_err(listen);
            assert!(
                matches!(err, ConfigError::Routes { key: "listen", .. }),
                "{listen}: {err}"
            );
            assert!(err.to_string().contains("\":5474\""), "{err}");
        } else {
            bad.validate().expect(listen);
        }
    }
    let mut bad = c.clone();
    bad.routes.node_addresses = vec!["node-a".into()];
    assert!(matches!(bad.validate(), Err(ConfigError::Routes { .. })));
    let mut bad = c.clone();
    bad.vxlan.vni = 1 << 24;
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::Vxlan { key: "vni", .. })
    ));
    assert!(
        AgentConfig::from_toml("[[pools]]\ncidr = \"10.0.0.0/8\"\nvxlan = \"sometimes\"\n")
            .is_err()
    );
    // Off (the default): nothing of it is checked.
    let mut off = c;
    off.routes = RoutesConfig {
        enabled: false,
        listen: "nonsense".into(),
        ..RoutesConfig::default()
    };
    off.validate().expect("routes off");
}

/// A config with `key` (`section.name` or `name`) set to `value`, with what validation
/// needs besides (a node name; routes on over plain text, so that routes.* counts).
fn with(key: &str, value: u64) -> Result<AgentConfig, String> {
    let (section, name) = key.split_once('.').unwrap_or(("", key));
    let mut text = "node_name = \"n\"\nuplinks = [\"eth0\"]\n".to_string();
    if section.is_empty() {
        text.push_str(&format!("{name} = {value}\n"));
    }
    let mut routes = "[routes]\nenabled = true\nplaintext = true\n".to_string();
    if section == "routes" {
        routes.push_str(&format!("{name} = {value}\n"));
    } else if !section.is_empty() {
        text.push_str(&format!("[{section}]\n{name} = {value}\n"));
    }
    text.push_str(&routes);
    let c = AgentConfig::from_toml(&text).map_err(|e| format!("{text}: {e}"))?;
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

#[test]
fn every_duration_and_size_has_a_bound_and_one_past_it_is_refused_naming_it() {
    let c = AgentConfig::default();
    for b in c.bounded() {
        with(b.key, b.max).unwrap_or_else(|e| panic!("{}'s maximum is refused: {e}", b.key));
        let e = with(b.key, b.max + 1).expect_err(b.key);
        assert!(
            e.contains(b.key) && e.contains(&b.max.to_string()),
            "{}: {e}",
            b.key
        );
        if b.min > 0 {
            let e = with(b.key, b.min - 1).expect_err(b.key);
            assert!(e.contains(b.key), "{}: {e}", b.key);
        }
    }
    // What used to panic the routes task (an Instant plus the grace period).
    let e = with("routes.grace_secs", i64::MAX as u64).expect_err("a huge grace period");
    assert!(e.contains("routes.grace_secs"), "{e}");
}

#[test]
fn every_number_of_the_config_is_bounded() {
    // Numbers bounded by their type or a check of their own.
    let elsewhere = [
        "vxlan.vni",
        "vxlan.port",
        "nat.port_min",
        "nat.port_max",
        "nat.conntrack_flows_per_endpoint",
        "bgp.listen_port",
        // BgpConfig::validate (when BGP is on).
        "bgp.as_number",
        "bgp.restart_time_secs",
    ];
    let c = AgentConfig::default();
    let bounded: Vec<&str> = c.bounded().iter().map(|b| b.key).collect();
    let tree = toml::Value::try_from(&c).expect("the config as TOML");
    let mut numbers = Vec::new();
    fn walk(v: &toml::Value, path: String, out: &mut Vec<String>) {
        match v {
            toml::Value::Integer(_) | toml::Value::Float(_) => out.push(path),
            toml::Value::Table(t) if path != "pools" => {
                for (k, v) in t {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(v, p, out);
                }
            }
            _ => {}
        }
    }
    walk(&tree, String::new(), &mut numbers);
    assert!(numbers.len() > 10, "{numbers:?}");
    for n in &numbers {
        assert!(
            bounded.contains(&n.as_str()) || elsewhere.contains(&n.as_str()),
            "{n} has no bound in AgentConfig::bounded()"
        );
    }
}

// A pod's MTU (crate::pod_network::mtu) from the config.

fn mtu_config(toml: &str) -> AgentConfig {
    let cfg: AgentConfig = toml::from_str(toml).expect("config");
    cfg
}

const POOLS: &str = r#"
uplinks = ["eth0"]
[routes]
enabled = true
plaintext = true
[[pools]]
cidr = "10.244.0.0/16"
[[pools]]
cidr = "fd00:244::/64"
[[pools]]
cidr = "10.245.0.0/16"
vxlan = "never"
"#;

#[test]
fn the_encapsulation_comes_off_where_vxlan_may_carry_the_pod() {
    let m = mtu_config(POOLS).pod_mtu();
    let ip = |s: &str| -> IpAddr { s.parse().expect("ip") };
    assert_eq!(m.compute(&[ip("10.244.0.5")], 1500), Some(1450));
    assert_eq!(m.compute(&[ip("fd00:244::5")], 1500), Some(1430));
    // Dual stack: the larger encapsulation.
    assert_eq!(
        m.compute(&[ip("10.244.0.5"), ip("fd00:244::5")], 9000),
        Some(8930)
    );
    // A pool that never tunnels, an address outside every pool: no opinion.
    assert_eq!(m.compute(&[ip("10.245.0.5")], 1500), None);
    assert_eq!(m.compute(&[ip("192.0.2.1")], 1500), None);
}

#[test]
fn no_opinion_on_a_single_node_or_without_an_uplink() {
    let single = POOLS.replace("enabled = true", "enabled = false");
    let m = mtu_config(&single).pod_mtu();
    assert_eq!(m, crate::pod_network::mtu::PodMtu::default());
    assert_eq!(m.compute(&["10.244.0.5".parse().expect("ip")], 1500), None);
    let no_uplink = POOLS.replace("uplinks = [\"eth0\"]", "");
    let m = mtu_config(&no_uplink).pod_mtu();
    assert_eq!(m.compute(&["10.244.0.5".parse().expect("ip")], 1500), None);
}

// The modules' own defaults, for their tests and fakes, are the config's.

#[test]
fn the_modules_test_defaults_are_the_configs() {
    let c = AgentConfig::default();
    let no_pools = AgentConfig {
        pools: Vec::new(),
        ..c.clone()
    };
    assert_eq!(
        calix_dataplane::nat::NatSettings::example(),
        no_pools.nat_settings().expect("default [nat]")
    );
    let v = calix_core::reconcile::remote::VxlanSettings::default();
    assert_eq!((v.vni, v.port), (c.vxlan.vni, c.vxlan.port));
    assert_eq!(
        c.routes.reflector_label,
        crate::kubernetes::peers::REFLECTOR_LABEL
    );
    assert_eq!(c.routes.tls.signer_name, calix_pki::ROUTES_SIGNER);
}

/// Route distribution's settings: off, or everything it needs from `[routes]`, the uplinks and
/// the pools.
#[test]
fn routes_settings_come_from_routes_uplinks_and_pools() {
    let off = AgentConfig::from_toml("node_name = \"n\"\n").expect("parse");
    assert_eq!(off.routes_settings().expect("settings"), None);
    let c = AgentConfig::from_toml(
        r#"
        node_name = "n1"
        uplinks = ["eth0"]
        [routes]
        enabled = true
        listen = ":6000"
        node_addresses = ["192.0.2.10"]
        topology = "reflectors"
        grace_secs = 30
        plaintext = true
        [[pools]]
        cidr = "10.244.0.0/16"
        vxlan = "always"
        "#,
    )
    .expect("parse");
    c.validate().expect("valid");
    let s = c.routes_settings().expect("settings").expect("on");
    assert_eq!(s.me, "n1");
    assert_eq!(s.listen, ListenOn::NodeAddresses { port: 6000 });
    let addr: IpAddr = "192.0.2.10".parse().expect("ip");
    assert_eq!(s.node_addresses, [addr]);
    assert_eq!((s.topology, s.grace.as_secs()), (Topology::Reflectors, 30));
    assert_eq!(s.tls, None, "plain text");
    assert_eq!(
        c.peering().expect("peering"),
        None,
        "the agents' node records"
    );
    assert_eq!(s.pools, [(c.pools[0].cidr, VxlanMode::Always)]);
    assert_eq!(s.blocks, c.node_pools());
    assert_eq!(c.underlay().node_addresses, [addr]);
    assert_eq!(c.underlay().uplinks, ["eth0"]);
    let mut k = c.clone();
    k.datastore.kind = "kubernetes".into();
    k.pools_configured = false;
    k.validate().expect("valid");
    let p = k.peering().expect("peering").expect("Kubernetes' Nodes");
    assert_eq!(
        (p.port, p.reflector_label.as_str()),
        (6000, crate::kubernetes::peers::REFLECTOR_LABEL)
    );
}

#[test]
fn cluster_ippools_that_cannot_be_served_are_refused_one_by_one_in_name_order() {
    let pool = |cidr: &str, block: Option<u8>| {
        let mut p = PoolSpec::new(cidr.parse().expect("test CIDR"));
        p.block_size = block;
        p
    };
    let named = vec![
        ("b-dup".to_string(), pool("10.1.0.0/24", None)),
        ("a-first".to_string(), pool("10.1.0.0/24", None)),
        ("c-inside".to_string(), pool("10.1.0.128/25", None)),
        ("d-services".to_string(), pool("10.96.0.0/16", None)),
        ("e-block".to_string(), pool("10.2.0.0/24", Some(20))),
        ("f-fine".to_string(), pool("10.3.0.0/24", None)),
        ("g-around".to_string(), pool("10.0.0.0/8", None)),
    ];
    let (pools, refused) =
        super::validate::admit_pools(named, &["10.96.0.0/12".to_string(), "bad".to_string()]);
    let cidrs: Vec<String> = pools.iter().map(|p| p.cidr.to_string()).collect();
    assert_eq!(cidrs, ["10.1.0.0/24", "10.3.0.0/24"]);
    let names: Vec<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["b-dup", "c-inside", "d-services", "e-block", "g-around"]
    );
    let why = |n: &str| &refused.iter().find(|(r, _)| r == n).expect("refused").1;
    assert!(
        why("b-dup").contains("is IPPool a-first's"),
        "{}",
        why("b-dup")
    );
    assert!(
        why("c-inside").contains("overlaps IPPool a-first"),
        "{}",
        why("c-inside")
    );
    assert!(
        why("d-services").contains("Service CIDR 10.96.0.0/12"),
        "{}",
        why("d-services")
    );
    assert!(why("e-block").contains("block"), "{}", why("e-block"));
    assert!(
        why("g-around").contains("overlaps IPPool a-first"),
        "{}",
        why("g-around")
    );
    // Nothing refused: every pool served, as given.
    let (pools, refused) =
        super::validate::admit_pools(vec![("x".into(), pool("10.5.0.0/24", None))], &[]);
    assert_eq!(pools.len(), 1);
    assert!(refused.is_empty());
}

/// `[services]`: off by default, Kubernetes only, its CIDRs parsed and its room within bounds.
#[test]
fn the_services_section_is_checked() {
    let d = AgentConfig::default();
    assert!(!d.services.enabled && d.services.external_cidrs.is_empty());
    let k8s = "node_name = \"n\"\n[datastore]\ntype = \"kubernetes\"\n";
    let c = AgentConfig::from_toml(&format!(
        "{k8s}[services]\nenabled = true\nexternal_cidrs = [\"203.0.113.0/24\", \"2001:db8::7\"]\nfrontends = 10\nbackends = 20\n"
    ))
    .expect("parse");
    c.validate().expect("valid");
    let nets: Vec<String> = c
        .services_external_cidrs()
        .expect("cidrs")
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(nets, ["203.0.113.0/24", "2001:db8::7/128"]);
    let c =
        AgentConfig::from_toml("node_name = \"n\"\n[services]\nenabled = true\n").expect("parse");
    assert!(matches!(
        c.validate(),
        Err(ConfigError::ServicesNeedKubernetes)
    ));
    let c = AgentConfig::from_toml(&format!(
        "{k8s}[services]\nexternal_cidrs = [\"203.0.113.0/33\"]\n"
    ))
    .expect("parse");
    assert!(matches!(
        c.validate(),
        Err(ConfigError::ExternalCidr { entry }) if entry == "203.0.113.0/33"
    ));
    for (toml, key) in [
        ("frontends = 0", "services.frontends"),
        ("frontends = 65537", "services.frontends"),
        ("backends = 0", "services.backends"),
        ("backends = 262145", "services.backends"),
    ] {
        let c = AgentConfig::from_toml(&format!("{k8s}[services]\n{toml}\n")).expect("parse");
        match c.validate() {
            Err(ConfigError::OutOfRange { key: k, .. }) => assert_eq!(k, key, "{toml}"),
            other => panic!("{toml}: {other:?}"),
        }
    }
    assert!(AgentConfig::from_toml("node_name = \"n\"\n[services]\nsize = 5\n").is_err());
}

/// The Services' cgroup: the path as set when it is a cgroup v2 (or nothing is there), its
/// `unified` when that is where a hybrid host keeps the v2 hierarchy.
#[test]
fn the_services_cgroup_is_the_v2_hierarchy_below_the_path_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let with = |at: &Path| {
        let mut c = AgentConfig::from_toml("").expect("parse");
        c.services.cgroup = Some(at.to_path_buf());
        c.services_cgroup()
    };
    assert_eq!(with(dir.path()), dir.path(), "nothing there: as given");
    std::fs::create_dir(dir.path().join("unified")).expect("mkdir");
    std::fs::write(dir.path().join("unified/cgroup.procs"), "").expect("write");
    assert_eq!(
        with(dir.path()),
        dir.path().join("unified"),
        "a hybrid host's /sys/fs/cgroup"
    );
    std::fs::write(dir.path().join("cgroup.procs"), "").expect("write");
    assert_eq!(with(dir.path()), dir.path(), "a v2 root as it is");
}
