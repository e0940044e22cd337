//! `[bgp]`: the speaker that tells the data centre's routers where this node's pods live
//! (issue 23), and its peers (`[[bgp.peers]]`). Parsed, checked and turned into the speaker's
//! own settings ([`crate::bgp::settings`]) here.
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use calix_bgp::peer::LimitAction;
use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::AgentConfig;
use crate::bgp::settings::{BgpSettings, PeerSettings};

/// The speaker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BgpConfig {
    pub enabled: bool,
    /// This node's AS number (1–4294967295; 23456, AS_TRANS, is reserved).
    pub as_number: u32,
    /// The BGP identifier, an IPv4 address; empty: this node's IPv4 next hop.
    pub router_id: String,
    /// The next hops this node advertises (one IPv4, one IPv6); empty: the first global
    /// address of each family on the first uplink.
    pub node_addresses: Vec<String>,
    /// How long the routers keep this node's routes when the agent restarts (graceful
    /// restart), and how long a restarted agent waits for its peers' routes before it
    /// removes those not announced again. 1–4095 s (RFC 4724's 12 bits).
    pub restart_time_secs: u64,
    /// The port it listens on for its peers' connections (on its next hops); 0: it only
    /// connects to them.
    pub listen_port: u16,
    /// Service ranges advertised as well (every node the same: the routers spread the
    /// traffic over the nodes, kube-proxy takes it from there): ClusterIP, external and
    /// LoadBalancer ranges, CIDRs.
    pub service_cluster_ips: Vec<String>,
    pub service_external_ips: Vec<String>,
    pub service_load_balancer_ips: Vec<String>,
    pub peers: Vec<BgpPeerConfig>,
    /// With the `kubernetes` datastore: where the Secrets BGPPeers' passwords name are
    /// mounted (`<dir>/<secret>/<key>`).
    pub password_dir: PathBuf,
    /// The cluster's BGPPeers for this node that cannot be used, by name, with why.
    #[serde(skip)]
    pub refused_peers: Vec<(String, String)>,
}

impl Default for BgpConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            as_number: 64512,
            router_id: String::new(),
            node_addresses: Vec::new(),
            restart_time_secs: 120,
            listen_port: crate::bgp::conn::PORT,
            service_cluster_ips: Vec::new(),
            service_external_ips: Vec::new(),
            service_load_balancer_ips: Vec::new(),
            peers: Vec::new(),
            password_dir: PathBuf::from("/etc/calix/bgp-passwords"),
            refused_peers: Vec::new(),
        }
    }
}

/// What happens when a peer announces more prefixes than `max_prefixes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LimitConfig {
    /// The prefixes past the limit are not taken; the session stays up.
    #[default]
    Refuse,
    /// The session ends with Cease "maximum number of prefixes reached" and comes back after
    /// a back-off.
    Reset,
}

/// One peer (`[[bgp.peers]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BgpPeerConfig {
    /// A name for logs, metrics and calixctl: letters, digits, '.', '-' and '_', 1–63.
    pub name: String,
    pub address: String,
    pub port: u16,
    pub as_number: u32,
    /// A file holding the TCP MD5 password (RFC 2385), e.g. a mounted Secret's key; its
    /// trailing newline is not part of it. Empty: no password.
    pub password_file: PathBuf,
    /// Proposed hold time: 0 (none), or 3–65535 s. Keepalives every third of it.
    pub hold_time_secs: u64,
    pub graceful_restart: bool,
    /// The most prefixes taken from the peer (1 or more).
    pub max_prefixes: u64,
    pub max_prefixes_action: LimitConfig,
    /// Communities put on every route advertised to the peer: "asn:value".
    pub communities: Vec<String>,
}

impl Default for BgpPeerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            address: String::new(),
            port: crate::bgp::conn::PORT,
            as_number: 0,
            password_file: PathBuf::new(),
            hold_time_secs: 90,
            graceful_restart: true,
            max_prefixes: 10_000,
            max_prefixes_action: LimitConfig::Refuse,
            communities: Vec::new(),
        }
    }
}

fn bad(key: String, what: &str) -> ConfigError {
    ConfigError::Bgp {
        key,
        what: what.to_string(),
    }
}

fn check_asn(key: String, asn: u32) -> Result<(), ConfigError> {
    if asn == 0 || asn == 23456 {
        return Err(bad(
            key,
            "an AS number of 1–4294967295 other than 23456 (AS_TRANS)",
        ));
    }
    Ok(())
}

fn community(text: &str) -> Option<u32> {
    let (a, v) = text.split_once(':')?;
    let (a, v): (u16, u16) = (a.trim().parse().ok()?, v.trim().parse().ok()?);
    Some((u32::from(a) << 16) | u32::from(v))
}

fn valid_name(n: &str) -> bool {
    (1..=63).contains(&n.len())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

impl BgpConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        check_asn("as_number".into(), self.as_number)?;
        if !self.router_id.is_empty() && self.router_id.parse::<Ipv4Addr>().is_err() {
            return Err(bad(
                "router_id".into(),
                "an IPv4 address, e.g. \"172.31.1.1\"",
            ));
        }
        if self
            .node_addresses
            .iter()
            .any(|a| a.parse::<IpAddr>().is_err())
        {
            return Err(bad(
                "node_addresses".into(),
                "addresses, e.g. [\"172.31.1.1\"]",
            ));
        }
        if !(1..=4095).contains(&self.restart_time_secs) {
            return Err(bad("restart_time_secs".into(), "1–4095"));
        }
        for (key, list) in self.service_ranges() {
            if let Some(c) = list.iter().find(|c| c.parse::<ipnet::IpNet>().is_err()) {
                return Err(ConfigError::Bgp {
                    key: key.into(),
                    what: format!("CIDRs, e.g. [\"10.96.0.0/12\"], not {c:?}"),
                });
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            validate_peer(&format!("peers[{i}]"), p)?;
            if !names.insert(p.name.as_str()) {
                return Err(bad(format!("peers[{i}].name"), "unique among the peers"));
            }
        }
        Ok(())
    }

    fn service_ranges(&self) -> [(&'static str, &Vec<String>); 3] {
        [
            ("service_cluster_ips", &self.service_cluster_ips),
            ("service_external_ips", &self.service_external_ips),
            ("service_load_balancer_ips", &self.service_load_balancer_ips),
        ]
    }

    /// Takes the cluster's part (the `kubernetes` datastore): `node.<node>` over `default`
    /// BGPConfiguration over this file, and the BGPPeers that select this node (`labels`:
    /// its labels) after the file's peers. A peer that cannot be used (a bad value, its
    /// password not mounted) is left out, named in `refused_peers`. The Node's `InternalIP`s
    /// (`internal_ips`) are the next hops when nothing else names them.
    pub(super) fn merge_cluster(
        &mut self,
        node: &str,
        labels: &std::collections::BTreeMap<String, String>,
        internal_ips: Vec<String>,
        (configurations, peers): (
            crate::kubernetes::cluster::BgpConfigurations,
            crate::kubernetes::cluster::BgpPeers,
        ),
    ) {
        let eff = calix_core::bgp::effective(&configurations, node);
        if let Some(a) = eff.as_number {
            self.as_number = a;
        }
        if let Some(r) = eff.router_id {
            self.router_id = r;
        }
        if let Some(t) = eff.restart_time_secs {
            self.restart_time_secs = t;
        }
        if let Some(p) = eff.listen_port {
            self.listen_port = p;
        }
        if !eff.node_addresses.is_empty() {
            self.node_addresses = eff.node_addresses;
        }
        for (mine, theirs) in [
            (&mut self.service_cluster_ips, eff.service_cluster_ips),
            (&mut self.service_external_ips, eff.service_external_ips),
            (
                &mut self.service_load_balancer_ips,
                eff.service_load_balancer_ips,
            ),
        ] {
            for r in theirs {
                if !mine.contains(&r.cidr) {
                    mine.push(r.cidr);
                }
            }
        }
        if self.node_addresses.is_empty() {
            self.node_addresses = internal_ips;
        }
        for (name, p) in peers.into_iter().filter(|(_, p)| p.selects(node, labels)) {
            let defaults = BgpPeerConfig::default();
            let peer = BgpPeerConfig {
                name: name.clone(),
                address: p.peer_ip,
                port: p.port.unwrap_or(defaults.port),
                as_number: p.as_number,
                password_file: p
                    .password
                    .map(|pw| {
                        self.password_dir
                            .join(&pw.secret_key_ref.name)
                            .join(&pw.secret_key_ref.key)
                    })
                    .unwrap_or_default(),
                hold_time_secs: p.hold_time_secs.unwrap_or(defaults.hold_time_secs),
                graceful_restart: p.graceful_restart.unwrap_or(defaults.graceful_restart),
                max_prefixes: p.max_prefixes.unwrap_or(defaults.max_prefixes),
                max_prefixes_action: match p.max_prefixes_action.as_deref() {
                    None | Some("refuse") => LimitConfig::Refuse,
                    Some("reset") => LimitConfig::Reset,
                    Some(other) => {
                        self.refused_peers.push((
                            name,
                            format!(
                                "maxPrefixesAction {other:?} is neither \"refuse\" nor \"reset\""
                            ),
                        ));
                        continue;
                    }
                },
                communities: p.communities,
            };
            if let Err(e) = validate_peer(&format!("BGPPeer {name}"), &peer) {
                self.refused_peers.push((name, e.to_string()));
                continue;
            }
            let file = &peer.password_file;
            if !file.as_os_str().is_empty() && !file.is_file() {
                self.refused_peers.push((
                    name,
                    format!(
                        "its password is not mounted at {} (the agent reads the Secret the chart mounts, bgp.passwordSecret)",
                        file.display()
                    ),
                ));
                continue;
            }
            if self.peers.iter().any(|q| q.name == peer.name) {
                self.refused_peers
                    .push((name, "a peer of the config file has its name".into()));
                continue;
            }
            self.peers.push(peer);
        }
    }
}

/// One peer's values (`key`: how errors name it).
fn validate_peer(key: &str, p: &BgpPeerConfig) -> Result<(), ConfigError> {
    let key = |k: &str| format!("{key}.{k}");
    if !valid_name(&p.name) {
        return Err(bad(key("name"), "1–63 letters, digits, '.', '-' or '_'"));
    }
    if p.address.parse::<IpAddr>().is_err() {
        return Err(bad(key("address"), "an IP address, e.g. \"172.31.1.254\""));
    }
    if p.port == 0 {
        return Err(bad(key("port"), "1–65535"));
    }
    check_asn(key("as_number"), p.as_number)?;
    if p.hold_time_secs != 0 && !(3..=65535).contains(&p.hold_time_secs) {
        return Err(bad(key("hold_time_secs"), "0 or 3–65535"));
    }
    if p.max_prefixes == 0 {
        return Err(bad(key("max_prefixes"), "1 or more"));
    }
    if let Some(c) = p.communities.iter().find(|c| community(c).is_none()) {
        return Err(ConfigError::Bgp {
            key: key("communities"),
            what: format!("\"asn:value\" with each 0–65535, not {c:?}"),
        });
    }
    Ok(())
}

impl AgentConfig {
    /// The speaker's settings; `None` when `bgp.enabled` is off. Reads the password files.
    pub fn bgp_settings(&self) -> Result<Option<BgpSettings>, ConfigError> {
        let b = &self.bgp;
        if !b.enabled {
            return Ok(None);
        }
        b.validate()?;
        let mut peers = Vec::new();
        for (i, p) in b.peers.iter().enumerate() {
            let password = if p.password_file.as_os_str().is_empty() {
                None
            } else {
                let text = std::fs::read(&p.password_file).map_err(|e| ConfigError::Bgp {
                    key: format!("peers[{i}].password_file"),
                    what: format!("a readable file ({}: {e})", p.password_file.display()),
                })?;
                let key = text.strip_suffix(b"\n").unwrap_or(&text).to_vec();
                if key.is_empty() || key.len() > crate::bgp::md5::MAX_KEY_LEN {
                    return Err(bad(
                        format!("peers[{i}].password_file"),
                        "a file holding a password of 1–80 bytes",
                    ));
                }
                Some(key)
            };
            peers.push(PeerSettings {
                name: p.name.clone(),
                // Validated above.
                address: p
                    .address
                    .parse()
                    .map_err(|_| bad(format!("peers[{i}].address"), "an IP address"))?,
                port: p.port,
                asn: p.as_number,
                password,
                hold_time: u16::try_from(p.hold_time_secs).unwrap_or(u16::MAX),
                graceful_restart: p.graceful_restart,
                max_prefixes: usize::try_from(p.max_prefixes).unwrap_or(usize::MAX),
                limit_action: match p.max_prefixes_action {
                    LimitConfig::Refuse => LimitAction::Refuse,
                    LimitConfig::Reset => LimitAction::Reset,
                },
                communities: p.communities.iter().filter_map(|c| community(c)).collect(),
            });
        }
        Ok(Some(BgpSettings {
            me: self.node_name.clone(),
            asn: b.as_number,
            router_id: b.router_id.parse().ok(),
            node_addresses: b
                .node_addresses
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect(),
            uplinks: self.uplinks.clone(),
            restart_time: Duration::from_secs(b.restart_time_secs),
            listen_port: b.listen_port,
            services: b
                .service_ranges()
                .iter()
                .flat_map(|(_, l)| l.iter())
                .filter_map(|c| c.parse::<ipnet::IpNet>().ok())
                .map(|n| n.trunc())
                .collect(),
            pools: self.pools.iter().map(|p| p.cidr).collect(),
            blocks: self.node_pools(),
            peers,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> AgentConfig {
        let mut c = AgentConfig::from_toml(text).expect("toml");
        c.node_name = "n1".into();
        c
    }

    const GOOD: &str = r#"
uplinks = ["eth0"]
[bgp]
enabled = true
as_number = 64601
[[bgp.peers]]
name = "tor-a"
address = "172.31.1.254"
as_number = 65000
communities = ["65000:100"]
max_prefixes_action = "reset"
"#;

    #[test]
    fn a_peer_with_defaults() {
        let c = parse(GOOD);
        c.validate().expect("valid");
        let s = c.bgp_settings().expect("settings").expect("enabled");
        assert_eq!(s.asn, 64601);
        let p = &s.peers[0];
        assert_eq!((p.port, p.hold_time, p.max_prefixes), (179, 90, 10_000));
        assert!(p.graceful_restart);
        assert_eq!(p.limit_action, LimitAction::Reset);
        assert_eq!(p.communities, [(65000 << 16) | 100]);
        assert_eq!(p.password, None);
        assert!(parse("").bgp_settings().expect("off").is_none());
    }

    #[test]
    fn bad_values_name_their_key() {
        for (edit, key) in [
            (("as_number = 64601", "as_number = 23456"), "bgp.as_number"),
            (
                ("as_number = 65000", "as_number = 0"),
                "bgp.peers[0].as_number",
            ),
            (("\"172.31.1.254\"", "\"tor\""), "bgp.peers[0].address"),
            (("\"tor-a\"", "\"tor a\""), "bgp.peers[0].name"),
            (
                ("\"65000:100\"", "\"65000:70000\""),
                "bgp.peers[0].communities",
            ),
            (
                ("enabled = true", "enabled = true\nrouter_id = \"fd00::1\""),
                "bgp.router_id",
            ),
            (
                ("enabled = true", "enabled = true\nrestart_time_secs = 5000"),
                "bgp.restart_time_secs",
            ),
            (
                (
                    "max_prefixes_action",
                    "hold_time_secs = 2\nmax_prefixes_action",
                ),
                "bgp.peers[0].hold_time_secs",
            ),
            (
                (
                    "max_prefixes_action",
                    "max_prefixes = 0\nmax_prefixes_action",
                ),
                "bgp.peers[0].max_prefixes",
            ),
        ] {
            let c = parse(&GOOD.replace(edit.0, edit.1));
            let e = c.validate().expect_err(key).to_string();
            assert!(e.starts_with(key), "{key}: {e}");
        }
        let twice = format!("{GOOD}\n[[bgp.peers]]\nname = \"tor-a\"\naddress = \"172.31.1.253\"\nas_number = 65000\n");
        let e = parse(&twice).validate().expect_err("twice").to_string();
        assert!(e.contains("unique"), "{e}");
    }

    #[test]
    fn the_password_comes_from_its_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("password");
        std::fs::write(&file, "s3cret\n").expect("write");
        let text = GOOD.replace(
            "as_number = 65000",
            &format!(
                "as_number = 65000\npassword_file = {:?}",
                file.display().to_string()
            ),
        );
        let s = parse(&text).bgp_settings().expect("settings").expect("on");
        assert_eq!(s.peers[0].password.as_deref(), Some(&b"s3cret"[..]));
        std::fs::write(&file, "").expect("write");
        let e = parse(&text).bgp_settings().expect_err("empty").to_string();
        assert!(e.contains("password_file"), "{e}");
        std::fs::remove_file(&file).expect("rm");
        let e = parse(&text)
            .bgp_settings()
            .expect_err("missing")
            .to_string();
        assert!(e.contains("readable"), "{e}");
    }

    #[test]
    fn the_clusters_resources_merge_for_this_node() {
        use calix_core::bgp::{BgpConfigurationSpec, BgpPeerSpec, ServiceRange};
        let mut c = parse(GOOD).bgp;
        let mut confs = std::collections::BTreeMap::new();
        confs.insert(
            "default".to_string(),
            BgpConfigurationSpec {
                as_number: Some(64512),
                listen_port: Some(0),
                service_cluster_ips: vec![ServiceRange {
                    cidr: "10.96.0.0/12".into(),
                }],
                ..Default::default()
            },
        );
        let peer = |ip: &str, node: Option<&str>, action: Option<&str>| BgpPeerSpec {
            peer_ip: ip.into(),
            as_number: 65001,
            port: None,
            node: node.map(Into::into),
            node_selector: Default::default(),
            password: None,
            hold_time_secs: Some(30),
            graceful_restart: None,
            max_prefixes: None,
            max_prefixes_action: action.map(Into::into),
            communities: Vec::new(),
        };
        let peers = vec![
            ("mine".to_string(), peer("172.31.1.253", Some("n1"), None)),
            ("theirs".to_string(), peer("172.31.1.252", Some("n2"), None)),
            ("bad-ip".to_string(), peer("tor", None, None)),
            (
                "bad-action".to_string(),
                peer("172.31.1.251", None, Some("drop")),
            ),
        ];
        c.merge_cluster(
            "n1",
            &Default::default(),
            vec!["172.31.1.1".into()],
            (confs, peers),
        );
        assert_eq!(c.as_number, 64512, "the cluster's AS over the file's");
        assert_eq!(
            c.listen_port, 0,
            "the cluster's listen port over the file's"
        );
        assert_eq!(c.node_addresses, ["172.31.1.1"], "the Node's InternalIP");
        assert_eq!(c.service_cluster_ips, ["10.96.0.0/12"]);
        let names: Vec<&str> = c.peers.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            ["tor-a", "mine"],
            "the file's, then the cluster's for n1"
        );
        assert_eq!(c.peers[1].hold_time_secs, 30);
        let refused: Vec<&str> = c.refused_peers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(refused, ["bad-ip", "bad-action"], "{:?}", c.refused_peers);
    }
}
