//! What serde cannot check: a node name, every number's bounds ([`Bounded`], one list that
//! the chart's values.schema.json is held to as well), pools (block sizes, overlaps,
//! selectors), and each section's rules.
use calix_core::ipam::pool::PoolSpec;
use ipnet::IpNet;

use super::error::ConfigError;
use super::sections::{DatastoreConfig, IpamConfig, RoutesConfig, TlsConfig, VxlanConfig};
use super::{AgentConfig, DataplaneMode};
use crate::distribution::settings::ListenOn;
use crate::distribution::tls::CertSource;

impl RoutesConfig {
    /// `listen`, or what it must be.
    pub(super) fn checked_listen(&self) -> Result<ListenOn, ConfigError> {
        self.listen_on().ok_or(ConfigError::Routes {
            key: "listen",
            what: "\":port\" (this node's addresses) or \"address:port\", with a port of 1–65535, e.g. \":5474\", \"192.0.2.10:5474\" or \"[::]:5474\"",
        })
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        self.checked_listen()?;
        if !is_label_key(&self.reflector_label) {
            return Err(ConfigError::Routes {
                key: "reflector_label",
                what: "a Kubernetes label key ([prefix/]name, e.g. \"node-restriction.kubernetes.io/calix-route-reflector\")",
            });
        }
        for a in &self.node_addresses {
            if a.parse::<std::net::IpAddr>().is_err() {
                return Err(ConfigError::Routes {
                    key: "node_addresses",
                    what: "IP addresses, e.g. [\"192.0.2.10\"]",
                });
            }
        }
        if !self.plaintext {
            self.tls.validate()?;
        }
        Ok(())
    }
}

/// Whether `key` is a Kubernetes label key: an optional DNS subdomain prefix and `/`, then a
/// name of at most 63 characters of `[A-Za-z0-9_.-]`, starting and ending alphanumeric.
pub fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    let prefix_ok = prefix.is_none_or(|p| {
        p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && l.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && l.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    });
    name_ok && prefix_ok
}

impl TlsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match self.source {
            CertSource::Files if !self.is_set() => Err(ConfigError::RoutesNoTls),
            CertSource::Files => Ok(()),
            CertSource::Kubernetes => {
                let signer = self.signer_name.split_once('/');
                if !signer.is_some_and(|(d, p)| !d.is_empty() && !p.is_empty()) {
                    return Err(ConfigError::Routes {
                        key: "tls.signer_name",
                        what: "a signer name <domain>/<path>, e.g. \"calix.dev/routes\"",
                    });
                }
                if self.ca_config_map().is_none() {
                    return Err(ConfigError::Routes {
                        key: "tls.ca_config_map",
                        what: "<namespace>/<name> of a ConfigMap, e.g. \"kube-system/calix-routes-ca\"",
                    });
                }
                Ok(())
            }
        }
    }
}

impl VxlanConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=0xff_ffff).contains(&self.vni) {
            return Err(ConfigError::Vxlan {
                key: "vni",
                what: "1–16777215",
            });
        }
        if self.port == 0 {
            return Err(ConfigError::Vxlan {
                key: "port",
                what: "1–65535",
            });
        }
        Ok(())
    }
}

impl IpamConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}

impl DatastoreConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match self.kind.as_str() {
            "embedded" => Ok(()),
            "etcd" if self.endpoints.is_empty() => Err(ConfigError::NoEtcdEndpoints),
            "etcd" | "kubernetes" => Ok(()),
            other => Err(ConfigError::DatastoreKind { kind: other.into() }),
        }
    }
}

/// A pool's block sizes (the current one and `previousBlockSizes`) and namespace selector.
/// The cluster's IPPools that this agent serves, and the others by name with why: in name
/// order, each is checked as a configured pool is, and refused when it is malformed, has the
/// CIDR of a pool admitted before it or overlaps one, or overlaps a Service CIDR (of
/// `service_cidrs`). A pool in the config file is an error that stops the agent; an object in
/// the cluster is anyone's, and one bad IPPool must not stop every agent that reads it.
pub fn admit_pools(
    mut named: Vec<(String, PoolSpec)>,
    service_cidrs: &[String],
) -> (Vec<PoolSpec>, Vec<(String, String)>) {
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let services: Vec<IpNet> = service_cidrs
        .iter()
        .filter_map(|s| calix_dataplane::xdp::parse_deny(s))
        .collect();
    let overlap = |a: &IpNet, b: &IpNet| a.contains(&b.network()) || b.contains(&a.network());
    let mut admitted: Vec<(String, PoolSpec)> = Vec::new();
    let mut refused = Vec::new();
    for (name, p) in named {
        let why = if let Err(e) = validate_pool(&p) {
            Some(e.to_string())
        } else if let Some((other, q)) = admitted.iter().find(|(_, q)| overlap(&q.cidr, &p.cidr)) {
            Some(match q.cidr == p.cidr {
                true => format!("its CIDR {} is IPPool {other}'s", p.cidr),
                false => format!("{} overlaps IPPool {other} ({})", p.cidr, q.cidr),
            })
        } else {
            services
                .iter()
                .find(|s| overlap(s, &p.cidr.trunc()))
                .map(|s| format!("{} overlaps the Service CIDR {s}", p.cidr))
        };
        match why {
            Some(why) => refused.push((name, why)),
            None => admitted.push((name, p)),
        }
    }
    (admitted.into_iter().map(|(_, p)| p).collect(), refused)
}

fn validate_pool(p: &PoolSpec) -> Result<(), ConfigError> {
    let range = calix_core::ipam::wellformed::block_sizes(matches!(p.cidr, IpNet::V4(_)));
    for bs in std::iter::once(p.block_size()).chain(p.previous_block_sizes.iter().copied()) {
        if !range.contains(&bs) {
            return Err(ConfigError::BlockSize {
                cidr: p.cidr,
                block_size: bs,
            });
        }
        if bs < p.cidr.prefix_len() {
            return Err(ConfigError::BlockLargerThanPool {
                cidr: p.cidr,
                block_size: bs,
                prefix: p.cidr.prefix_len(),
            });
        }
    }
    if let Some(sel) = &p.namespace_selector {
        sel.validate()
            .map_err(|source| ConfigError::NamespaceSelector {
                cidr: p.cidr,
                source,
            })?;
    }
    Ok(())
}

/// A day, in seconds: the longest most durations of the config may be.
pub const DAY: u64 = 86_400;

/// One number of the config and its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounded {
    /// Its key in the config file (`section.key`).
    pub key: &'static str,
    pub value: u64,
    pub min: u64,
    pub max: u64,
}

impl Bounded {
    fn new(key: &'static str, value: impl Into<u64>, min: u64, max: u64) -> Self {
        Self {
            key,
            value: value.into(),
            min,
            max,
        }
    }

    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if (self.min..=self.max).contains(&self.value) {
            Ok(())
        } else {
            Err(ConfigError::OutOfRange {
                key: self.key,
                value: self.value,
                min: self.min,
                max: self.max,
            })
        }
    }
}

impl AgentConfig {
    /// Every duration and size of the config with its bounds, in one place: what
    /// [`AgentConfig::validate`] checks, and what the chart's values.schema.json may not exceed
    /// (tests/tests/chart.rs holds them together). Durations stay far below what an `Instant`
    /// or a timer can add without overflowing, sizes below what the node can hold.
    pub fn bounded(&self) -> Vec<Bounded> {
        let (k, n, i, r, d) = (
            &self.kubernetes,
            &self.nat,
            &self.ipam,
            &self.routes,
            &self.datastore,
        );
        let week = 7 * DAY;
        vec![
            Bounded::new("resync_interval_secs", self.resync_interval_secs, 1, DAY),
            Bounded::new(
                "kubernetes.pod_gone_grace_secs",
                k.pod_gone_grace_secs,
                0,
                DAY,
            ),
            Bounded::new(
                "kubernetes.pod_check_interval_secs",
                k.pod_check_interval_secs,
                1,
                3_600,
            ),
            Bounded::new("routes.grace_secs", r.grace_secs, 1, DAY),
            Bounded::new("datastore.timeout_ms", d.timeout_ms, 1, 300_000),
            Bounded::new("datastore.attempts", d.attempts, 1, 1_000),
            Bounded::new(
                "ipam.maxBlocksPerNode",
                i.max_blocks_per_node as u64,
                1,
                65_536,
            ),
            Bounded::new(
                "ipam.leakCheckIntervalSecs",
                i.leak_check_interval_secs,
                1,
                DAY,
            ),
            Bounded::new("ipam.leakGraceSecs", i.leak_grace_secs, 0, week),
            Bounded::new(
                "ipam.emptyBlockGraceSecs",
                i.empty_block_grace_secs,
                0,
                week,
            ),
            Bounded::new("nat.conntrack_entries", n.conntrack_entries, 2, 1 << 24),
            Bounded::new("policy.entries", self.policy.entries, 1, 1 << 24),
            Bounded::new("policy.flows", self.policy.flows, 16, 1 << 22),
            // At most what the eBPF dataplane's maps hold (their sizes are fixed): a room
            // beyond would have Services written past the maps' end and refused by the kernel.
            Bounded::new(
                "services.frontends",
                self.services.frontends,
                1,
                u64::from(calix_common::DEFAULT_SVC_FRONTENDS),
            ),
            Bounded::new(
                "services.backends",
                self.services.backends,
                1,
                u64::from(calix_common::DEFAULT_SVC_BACKENDS),
            ),
            Bounded::new(
                "nat.pressure_unanswered_secs",
                n.pressure_unanswered_secs,
                1,
                3_600,
            ),
            Bounded::new("nat.tcp_established_secs", n.tcp_established_secs, 1, week),
            Bounded::new("nat.tcp_syn_secs", n.tcp_syn_secs, 1, 3_600),
            Bounded::new("nat.tcp_closing_secs", n.tcp_closing_secs, 1, 3_600),
            Bounded::new("nat.udp_secs", n.udp_secs, 1, DAY),
            Bounded::new("nat.icmp_secs", n.icmp_secs, 1, 3_600),
            Bounded::new(
                "nat.cleaner_interval_secs",
                n.cleaner_interval_secs,
                1,
                3_600,
            ),
        ]
    }
}

impl AgentConfig {
    /// Checks what serde cannot: block sizes, a node name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_name.trim().is_empty() {
            return Err(ConfigError::NoNodeName);
        }
        if self.node_name.contains('/') || self.node_name.chars().any(char::is_control) {
            return Err(ConfigError::BadNodeName {
                name: self.node_name.clone(),
            });
        }
        for b in self.bounded() {
            b.check()?;
        }
        self.datastore.validate()?;
        if self.datastore.is_kubernetes() && self.pools_configured {
            return Err(ConfigError::PoolsInKubernetes);
        }
        self.ipam.validate()?;
        self.routes.validate()?;
        self.vxlan.validate()?;
        self.bgp.validate()?;
        self.xdp_policy()?;
        self.nat_settings()?;
        self.services_external_cidrs()?;
        if self.services.enabled && !self.datastore.is_kubernetes() {
            return Err(ConfigError::ServicesNeedKubernetes);
        }
        if self.services.translate
            && (!self.services.enabled || self.dataplane != DataplaneMode::Ebpf)
        {
            return Err(ConfigError::TranslateNeedsEbpf);
        }
        if self.xdp.enabled && self.dataplane != DataplaneMode::Ebpf {
            return Err(ConfigError::XdpNeedsEbpf);
        }
        if self.xdp.enabled && self.uplinks.is_empty() {
            return Err(ConfigError::XdpNoUplinks);
        }
        if self.routes.enabled && self.uplinks.is_empty() {
            return Err(ConfigError::RoutesNoUplinks);
        }
        self.pools.iter().try_for_each(validate_pool)?;
        if let Some(p) = self
            .pools
            .iter()
            .find(|p| p.namespace_selector.is_some() && !self.datastore.is_kubernetes())
        {
            return Err(ConfigError::NamespaceSelectorNeedsKubernetes { cidr: p.cidr });
        }
        for (i, a) in self.pools.iter().enumerate() {
            for b in &self.pools[i + 1..] {
                if a.cidr == b.cidr {
                    return Err(ConfigError::Duplicate { cidr: a.cidr });
                }
                if a.cidr.contains(&b.cidr.network()) || b.cidr.contains(&a.cidr.network()) {
                    return Err(ConfigError::Overlap {
                        a: a.cidr,
                        b: b.cidr,
                    });
                }
            }
        }
        Ok(())
    }
}
