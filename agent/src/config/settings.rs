//! The config turned into each module's own settings: IPAM's pools and policy, the
//! datastore's backend, the dataplane's XDP, NAT and doors, route distribution's, the
//! underlay, a pod's MTU, Kubernetes' certificates and pods, and what a reload applies. The
//! config is validated first ([`AgentConfig::validate`]); what a conversion checks again it
//! reports with the same errors.
use std::path::PathBuf;
use std::time::Duration;

use calix_core::ipam::pool::VxlanMode;
use calix_core::reconcile::remote::{Underlay, VxlanSettings};
use ipnet::IpNet;

use super::error::ConfigError;
use super::sections::{DatastoreConfig, IpamConfig};
use super::AgentConfig;
use crate::distribution::settings::{RoutesSettings, TlsSettings};
use crate::distribution::tls::TlsFiles;
use crate::ipam::service::Housekeeping;
use crate::kubernetes::certificates;
use crate::kubernetes::peers::Peering;
use crate::kubernetes::pods::PodsConfig;
use crate::pod_network::mtu::PodMtu;
use crate::tasks::Reloaded;
use calix_dataplane::ebpf::EbpfConfig;
use calix_dataplane::xdp::{self, Failsafe, XdpPolicy, XdpSettings};
use calix_dataplane::Reload;
use calix_datastore::Backend;

impl IpamConfig {
    pub fn policy(&self) -> calix_core::ipam::Policy {
        calix_core::ipam::Policy {
            strict_affinity: self.strict_affinity,
            max_blocks_per_node: self.max_blocks_per_node,
        }
    }
}

impl DatastoreConfig {
    pub fn kubernetes(&self) -> calix_datastore::KubeConfig {
        calix_datastore::KubeConfig {
            kubeconfig: (!self.kubeconfig.as_os_str().is_empty()).then(|| self.kubeconfig.clone()),
            timeout: std::time::Duration::from_millis(self.timeout_ms),
            attempts: self.attempts,
        }
    }

    pub fn etcd(&self) -> calix_datastore::EtcdConfig {
        calix_datastore::EtcdConfig {
            endpoints: self.endpoints.clone(),
            prefix: self.prefix.clone(),
            timeout: std::time::Duration::from_millis(self.timeout_ms),
            attempts: self.attempts,
        }
    }

    /// The backend `type` names (validated: `embedded`, `etcd` or `kubernetes`).
    pub fn backend(&self) -> Backend {
        match self.kind.as_str() {
            "etcd" => Backend::Etcd(self.etcd()),
            "kubernetes" => Backend::Kubernetes(self.kubernetes()),
            _ => Backend::Embedded {
                path: self.path.clone(),
            },
        }
    }
}

impl AgentConfig {
    /// `services.external_cidrs`, parsed (an address is its /32 or /128).
    pub fn services_external_cidrs(&self) -> Result<Vec<IpNet>, ConfigError> {
        self.services
            .external_cidrs
            .iter()
            .map(|entry| {
                xdp::parse_deny(entry).ok_or_else(|| ConfigError::ExternalCidr {
                    entry: entry.clone(),
                })
            })
            .collect()
    }

    /// The XDP prefilter's policy: the deny list and the failsafe ports (the configured ones
    /// plus the metrics port), each entry checked.
    pub fn xdp_policy(&self) -> Result<XdpPolicy, ConfigError> {
        let mut deny = Vec::new();
        for entry in &self.xdp.deny_cidrs {
            let net = xdp::parse_deny(entry).ok_or_else(|| ConfigError::XdpCidr {
                entry: entry.clone(),
            })?;
            if !deny.contains(&net) {
                deny.push(net);
            }
        }
        for v4 in [true, false] {
            let n = deny
                .iter()
                .filter(|n| matches!(n, IpNet::V4(_)) == v4)
                .count();
            if n > XdpPolicy::MAX_DENY_PER_FAMILY {
                return Err(ConfigError::XdpTooMany {
                    key: "deny_cidrs",
                    max: XdpPolicy::MAX_DENY_PER_FAMILY,
                    per: if v4 { " of IPv4" } else { " of IPv6" },
                });
            }
        }
        let mut failsafe = Vec::new();
        for entry in &self.xdp.failsafe_ports {
            let port: Failsafe = entry.parse().map_err(|()| ConfigError::XdpPort {
                entry: entry.clone(),
            })?;
            failsafe.push(port);
        }
        // The agent's own TCP ports: metrics, and the Routes service when enabled.
        let metrics_port = self
            .metrics_addr
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .filter(|p| *p != 0);
        if let Some(port) = metrics_port {
            failsafe.push(Failsafe {
                proto: xdp::L4Proto::Tcp,
                port,
            });
        }
        // Peers' route streams: the cluster must not lose its routes to a deny entry.
        if let Some(port) = self
            .routes
            .enabled
            .then(|| self.routes.listen_port())
            .flatten()
        {
            failsafe.push(Failsafe {
                proto: xdp::L4Proto::Tcp,
                port,
            });
        }
        failsafe.sort();
        failsafe.dedup();
        if failsafe.len() > XdpPolicy::MAX_FAILSAFE {
            return Err(ConfigError::XdpTooMany {
                key: "failsafe_ports",
                max: XdpPolicy::MAX_FAILSAFE,
                per: "",
            });
        }
        Ok(XdpPolicy { deny, failsafe })
    }

    /// The TCP ports closed to pods ([`calix_dataplane::doors`]): the metrics port when it
    /// listens beyond loopback, the Routes port (this node's and the other nodes') when route
    /// distribution is on, each unless `[doors]` lets pods in.
    pub fn door_policy(&self) -> calix_dataplane::doors::DoorPolicy {
        let mut ports = std::collections::BTreeSet::new();
        let metrics = self.metrics_addr.parse::<std::net::SocketAddr>().ok();
        if let Some(m) = metrics.filter(|m| !m.ip().is_loopback() && m.port() != 0) {
            if !self.doors.pods_reach_metrics {
                ports.insert(m.port());
            }
        }
        let routes = self.routes.enabled && !self.doors.pods_reach_routes;
        if routes {
            ports.extend(self.routes.listen_port());
        }
        calix_dataplane::doors::DoorPolicy {
            ports,
            peer_routes_ports: routes,
        }
    }

    /// The XDP prefilter's settings when it is enabled.
    pub fn xdp_settings(&self) -> Result<Option<XdpSettings>, ConfigError> {
        if !self.xdp.enabled {
            return Ok(None);
        }
        Ok(Some(XdpSettings {
            mode: self.xdp.mode,
            policy: self.xdp_policy()?,
        }))
    }

    /// SNAT's settings: `natOutgoing` IPv4 pools (of this node), no-SNAT destinations (every
    /// pool, whatever node it is for, plus `non_masquerade_cidrs`), sizes and timeouts.
    pub fn nat_settings(&self) -> Result<calix_dataplane::nat::NatSettings, ConfigError> {
        use calix_dataplane::nat::{NatSettings, Timeouts};
        use std::time::Duration;
        let n = &self.nat;
        let v4 = |p: &IpNet| match p {
            IpNet::V4(n) => Some(n.trunc()),
            IpNet::V6(_) => None,
        };
        let mut no_snat: Vec<ipnet::Ipv4Net> =
            self.pools.iter().filter_map(|p| v4(&p.cidr)).collect();
        for entry in &n.non_masquerade_cidrs {
            let net = match xdp::parse_deny(entry) {
                Some(IpNet::V4(net)) => net,
                _ => {
                    return Err(ConfigError::NatCidr {
                        entry: entry.clone(),
                    })
                }
            };
            if !no_snat.contains(&net) {
                no_snat.push(net);
            }
        }
        if no_snat.len() > calix_common::MAX_NO_SNAT_CIDRS as usize {
            return Err(ConfigError::Nat {
                key: "non_masquerade_cidrs",
                what: "at most 4096 entries, pools included",
            });
        }
        if n.port_min == 0 || n.port_max < n.port_min {
            return Err(ConfigError::Nat {
                key: "port_min/port_max",
                what: "a range 1 ≤ port_min ≤ port_max ≤ 65535",
            });
        }
        if n.port_min <= 1024 && n.port_max == u16::MAX {
            return Err(ConfigError::Nat {
                key: "port_min/port_max",
                what: "a range that leaves ports of 1024–65535 to the host's own masquerade",
            });
        }
        if n.conntrack_entries < 2 {
            return Err(ConfigError::Nat {
                key: "conntrack_entries",
                what: "at least 2",
            });
        }
        let ct_budget = n
            .conntrack_flows_per_endpoint
            .unwrap_or(n.conntrack_entries / 8);
        if ct_budget > i32::MAX as u32 {
            return Err(ConfigError::Nat {
                key: "conntrack_flows_per_endpoint",
                what: "at most 2147483647",
            });
        }
        let mut service = Vec::new();
        let mut service_v6 = Vec::new();
        for entry in &n.service_cidrs {
            let net = xdp::parse_deny(entry).ok_or_else(|| ConfigError::ServiceCidr {
                entry: entry.clone(),
            })?;
            if let Some(pool) = self.pools.iter().find(|p| {
                p.cidr.contains(&net.network()) || net.contains(&p.cidr.trunc().network())
            }) {
                return Err(ConfigError::ServiceOverlapsPool {
                    service: net,
                    pool: pool.cidr,
                });
            }
            match net {
                IpNet::V4(v4) if !service.contains(&v4) => service.push(v4),
                IpNet::V6(v6) if !service_v6.contains(&v6) => service_v6.push(v6),
                _ => {}
            }
        }
        if no_snat.len() + service.len() > calix_common::MAX_NO_SNAT_CIDRS as usize {
            return Err(ConfigError::Nat {
                key: "non_masquerade_cidrs/service_cidrs",
                what: "at most 4096 entries together, pools included",
            });
        }
        for b in self.bounded().iter().filter(|b| b.key.starts_with("nat.")) {
            b.check()?;
        }
        Ok(NatSettings {
            nat_pools: self
                .pools
                .iter()
                .filter(|p| p.nat_outgoing && p.selects(&self.node_labels))
                .filter_map(|p| v4(&p.cidr))
                .collect(),
            no_snat,
            service,
            service_v6,
            conntrack_entries: n.conntrack_entries,
            ct_budget,
            pressure_unanswered: Duration::from_secs(n.pressure_unanswered_secs),
            timeouts: Timeouts {
                tcp_established: Duration::from_secs(n.tcp_established_secs),
                tcp_syn: Duration::from_secs(n.tcp_syn_secs),
                tcp_closing: Duration::from_secs(n.tcp_closing_secs),
                udp: Duration::from_secs(n.udp_secs),
                icmp: Duration::from_secs(n.icmp_secs),
            },
            port_min: n.port_min,
            port_max: n.port_max,
            tunnel_port: self.vxlan.port,
            cleaner_interval: Duration::from_secs(n.cleaner_interval_secs),
        })
    }

    /// Every pool as this node's allocator sees it: one whose `nodeSelector` does not select
    /// this node is disabled here (no new addresses from it), not gone — the addresses the node
    /// holds in it stay valid, so a label change never counts as removing a pool under live
    /// addresses, and the dataplane still knows the pool's addresses as pods'.
    pub fn node_pools(&self) -> Vec<calix_core::ipam::Pool> {
        self.pools
            .iter()
            .map(|p| calix_core::ipam::Pool {
                cidr: p.cidr.trunc(),
                block_size: p.block_size(),
                disabled: p.disabled || !p.selects(&self.node_labels),
                restricted: p.namespace_selector.is_some(),
                previous_block_sizes: p.previous_block_sizes.clone(),
            })
            .collect()
    }

    /// The eBPF dataplane's settings (`object`: `--bpf-object`).
    pub fn ebpf_config(&self, object: Option<PathBuf>) -> Result<EbpfConfig, ConfigError> {
        Ok(EbpfConfig {
            pin_root: self.bpf_pin_root.clone(),
            node: self.node_name.clone(),
            uplinks: self.uplinks.clone(),
            object,
            xdp: self.xdp_settings()?,
            nat: Some(self.nat_settings()?),
            tc_attach: self.tc_attach,
            doors: self.door_policy(),
            policy: calix_dataplane::ebpf::PolicySettings {
                entries: self.policy.entries,
                flows: self.policy.flows,
                keep_established: self.policy.keep_established,
            },
            services_cgroup: self.services.translate.then(|| self.services_cgroup()),
        })
    }

    /// The cgroup whose sockets `[services] translate` covers: `[services] cgroup` (default
    /// `/sys/fs/cgroup`), or its `unified` below it when that is where the v2 hierarchy is (a
    /// host with cgroup v1 and v2 side by side: the chart's default mount of the host's
    /// `/sys/fs/cgroup` works on both kinds of host).
    pub fn services_cgroup(&self) -> PathBuf {
        let at = self
            .services
            .cgroup
            .clone()
            .unwrap_or_else(|| PathBuf::from("/sys/fs/cgroup"));
        let hybrid = at.join("unified");
        if !at.join("cgroup.procs").exists() && hybrid.join("cgroup.procs").exists() {
            hybrid
        } else {
            at
        }
    }

    /// Route distribution's settings; `None` when it is off (`routes.enabled = false`).
    pub fn routes_settings(&self) -> Result<Option<RoutesSettings>, ConfigError> {
        let r = &self.routes;
        if !r.enabled {
            return Ok(None);
        }
        Ok(Some(RoutesSettings {
            me: self.node_name.clone(),
            listen: r.checked_listen()?,
            // Validated with the rest of `[routes]`.
            node_addresses: r
                .node_addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect(),
            uplinks: self.uplinks.clone(),
            topology: r.topology,
            reflector: r.reflector,
            grace: Duration::from_secs(r.grace_secs),
            tls: (!r.plaintext).then(|| TlsSettings {
                source: r.tls.source,
                files: TlsFiles {
                    cert: r.tls.cert.clone(),
                    key: r.tls.key.clone(),
                    ca: r.tls.ca.clone(),
                },
            }),
            pools: self.pools.iter().map(|p| (p.cidr, p.vxlan)).collect(),
            blocks: self.node_pools(),
        }))
    }

    /// How route distribution reads Kubernetes' Node objects as its peers, with the
    /// `kubernetes` datastore (routes on): the port every agent listens on, the reflector
    /// label. `None`: the agents' own node records.
    pub fn peering(&self) -> Result<Option<Peering>, ConfigError> {
        if !self.routes.enabled || !self.datastore.is_kubernetes() {
            return Ok(None);
        }
        Ok(Some(Peering {
            port: self.routes.checked_listen()?.port(),
            reflector_label: self.routes.reflector_label.clone(),
        }))
    }

    /// What this node's certificate is asked for with `routes.tls.source = "kubernetes"`
    /// (validated: `ca_config_map` is `<namespace>/<name>`).
    pub fn certificate_settings(&self) -> certificates::Settings {
        let tls = &self.routes.tls;
        let (ns, name) = tls
            .ca_config_map()
            .unwrap_or(("kube-system", "calix-routes-ca"));
        certificates::Settings {
            node: self.node_name.clone(),
            signer: tls.signer_name.clone(),
            ca_namespace: ns.to_string(),
            ca_name: name.to_string(),
        }
    }

    /// This node's side of the underlay: the uplinks, `routes.node_addresses`, `[vxlan]`.
    pub fn underlay(&self) -> Underlay {
        Underlay {
            uplinks: self.uplinks.clone(),
            // Validated with the rest of `[routes]`.
            node_addresses: self
                .routes
                .node_addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect(),
            vxlan: VxlanSettings {
                vni: self.vxlan.vni,
                port: self.vxlan.port,
            },
        }
    }

    /// What decides a pod's MTU: the first uplink and this node's pools whose `vxlan` is not
    /// `never`, when route distribution is on (a single node encapsulates nothing).
    pub fn pod_mtu(&self) -> PodMtu {
        if !self.routes.enabled {
            return PodMtu::default();
        }
        PodMtu::new(
            self.uplinks.first().cloned(),
            self.pools
                .iter()
                .filter(|p| p.selects(&self.node_labels) && p.vxlan != VxlanMode::Never)
                .map(|p| p.cidr)
                .collect(),
        )
    }

    /// IPAM housekeeping's grace periods (`[ipam]`).
    pub fn housekeeping(&self) -> Housekeeping {
        Housekeeping {
            leak_grace: Duration::from_secs(self.ipam.leak_grace_secs),
            empty_block_grace: Duration::from_secs(self.ipam.empty_block_grace_secs),
        }
    }

    /// The cleanup of endpoints whose pod is gone (`[kubernetes]`).
    pub fn pods_config(&self) -> PodsConfig {
        PodsConfig {
            grace: Duration::from_secs(self.kubernetes.pod_gone_grace_secs),
            every: Duration::from_secs(self.kubernetes.pod_check_interval_secs),
        }
    }

    /// What a reload applies (this config read again), and whether it changed what only a
    /// restart applies, against `started`.
    pub fn reloaded(&self, started: &AgentConfig) -> Result<Reloaded, ConfigError> {
        let restart_only = |c: &AgentConfig| {
            (
                c.xdp.enabled,
                c.xdp.mode,
                c.uplinks.clone(),
                c.dataplane,
                c.tc_attach,
                c.resync_interval_secs,
                c.vxlan.clone(),
                c.routes.clone(),
                c.bgp.enabled,
            )
        };
        Ok(Reloaded {
            pools: self.node_pools(),
            policy: self.ipam.policy(),
            pod_mtu: self.pod_mtu(),
            dataplane: Reload {
                xdp: self.xdp_policy()?,
                nat: self.nat_settings()?,
            },
            needs_restart: restart_only(self) != restart_only(started)
                || vxlan_changed(started, self),
            service_cidrs: self.nat.service_cidrs.clone(),
            node_labels: self.node_labels.clone(),
            refused_pools: self.refused_pools.clone(),
            bgp: self.bgp_settings()?,
            refused_bgp_peers: self.bgp.refused_peers.clone(),
        })
    }
}

/// Whether a pool's `vxlan` differs from what route distribution started with (a pool added
/// since counts when it asks for anything but the default).
fn vxlan_changed(started: &AgentConfig, now: &AgentConfig) -> bool {
    now.pools.iter().any(|p| {
        let was = started
            .pools
            .iter()
            .find(|q| q.cidr == p.cidr)
            .map(|q| q.vxlan);
        was.unwrap_or_default() != p.vxlan
    })
}
