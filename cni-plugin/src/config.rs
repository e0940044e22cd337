//! The network configuration the runtime passes on stdin. Unknown keys are ignored.
use std::path::PathBuf;

use serde::Deserialize;

use crate::error::{code, CniError};

/// Default agent socket.
pub const DEFAULT_AGENT_SOCKET: &str = calix_proto::DEFAULT_AGENT_SOCKET;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    #[serde(default)]
    pub cni_version: String,
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default)]
    pub plugin_type: String,
    #[serde(default)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub ipam: IpamConf,
    #[serde(default, rename = "log_level")]
    pub log_level: Option<String>,
    #[serde(default, rename = "log_file_path")]
    pub log_file_path: Option<PathBuf>,
    #[serde(default, rename = "agent_socket")]
    pub agent_socket: Option<PathBuf>,
    #[serde(default)]
    pub nodename: Option<String>,
    #[serde(default)]
    pub prev_result: Option<serde_json::Value>,
    #[serde(default)]
    pub runtime_config: Option<serde_json::Value>,
    #[serde(default, rename = "container_settings")]
    pub container_settings: ContainerSettings,
    /// GC: the attachments the runtime still knows (CNI 1.1 `cni.dev/valid-attachments`,
    /// or the older `cni.dev/attachments`).
    #[serde(default, rename = "cni.dev/valid-attachments")]
    pub valid_attachments: Option<Vec<Attachment>>,
    #[serde(default, rename = "cni.dev/attachments")]
    pub attachments_legacy: Option<Vec<Attachment>>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ContainerSettings {
    /// Turn on IP forwarding inside the pod (for pods that route, e.g. VPN gateways).
    #[serde(default)]
    pub allow_ip_forwarding: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// What calix reads from `runtimeConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Static addresses asked for (`ips`), as given ("10.1.2.3/32" or "10.1.2.3").
    pub ips: Vec<std::net::IpAddr>,
    /// A MAC for the pod's interface (`mac`).
    pub mac: Option<[u8; 6]>,
}

/// Looks a key up case-insensitively: runtimes differ in capitalisation (DESIGN.md §9).
fn get_ci<'a>(obj: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    obj.as_object()?
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(key))
        .map(|(_, v)| v)
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct IpamConf {
    #[serde(rename = "type", default = "default_ipam")]
    pub ipam_type: String,
    /// Calico-style switches: "true"/"false" strings or booleans.
    #[serde(default)]
    pub assign_ipv4: Option<serde_json::Value>,
    #[serde(default)]
    pub assign_ipv6: Option<serde_json::Value>,
}

fn default_ipam() -> String {
    "calix-ipam".into()
}

impl Default for IpamConf {
    fn default() -> Self {
        Self {
            ipam_type: default_ipam(),
            assign_ipv4: None,
            assign_ipv6: None,
        }
    }
}

fn flag(v: &Option<serde_json::Value>, default: bool) -> Result<bool, CniError> {
    match v {
        None => Ok(default),
        Some(serde_json::Value::Bool(b)) => Ok(*b),
        Some(serde_json::Value::String(s)) if s == "true" => Ok(true),
        Some(serde_json::Value::String(s)) if s == "false" => Ok(false),
        Some(other) => Err(CniError::new(
            code::INVALID_CONFIG,
            format!("ipam.assign_ipv4/assign_ipv6 must be true or false, not {other}"),
            "",
        )),
    }
}

impl IpamConf {
    pub fn families(&self) -> Result<(bool, bool), CniError> {
        let v4 = flag(&self.assign_ipv4, true)?;
        let v6 = flag(&self.assign_ipv6, false)?;
        if !v4 && !v6 {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                "ipam assigns neither IPv4 nor IPv6",
                "set ipam.assign_ipv4 or ipam.assign_ipv6 to true",
            ));
        }
        Ok((v4, v6))
    }
}

impl NetConf {
    /// Parses stdin: undecodable JSON is code 6, a decodable but wrong config is code 7.
    pub fn parse(bytes: &[u8]) -> Result<Self, CniError> {
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
            CniError::new(
                code::DECODE_FAILURE,
                format!("cannot decode the network configuration on stdin: {e}"),
                "the runtime must pass the plugin's JSON configuration on stdin",
            )
        })?;
        let version = value
            .get("cniVersion")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        let conf: NetConf = serde_json::from_value(value).map_err(|e| {
            CniError::new(
                code::INVALID_CONFIG,
                format!("invalid network configuration: {e}"),
                "see the calix README for the configuration keys",
            )
            .with_version(&version)
        })?;
        conf.validate()?;
        Ok(conf)
    }

    fn validate(&self) -> Result<(), CniError> {
        let bad = |msg: String, details: &str| {
            CniError::new(code::INVALID_CONFIG, msg, details).with_version(&self.cni_version)
        };
        if self.name.is_empty() {
            return Err(bad(
                "network configuration has no \"name\"".into(),
                "add a \"name\" to the network configuration",
            ));
        }
        // What the CNI spec allows, and what keeps the IPAM handle unambiguous.
        if !calix_proto::handle::is_cni_name(&self.name) {
            return Err(bad(
                format!(
                    "network name {:?} is not a valid CNI network name",
                    self.name
                ),
                "start with a letter or digit; use only letters, digits, '_', '.' and '-'",
            ));
        }
        if let Some(mtu) = self.mtu {
            if !(68..=65535).contains(&mtu) {
                return Err(bad(
                    format!("mtu {mtu} is out of range"),
                    "use an MTU between 68 and 65535",
                ));
            }
        }
        if self.ipam.ipam_type.is_empty()
            || self.ipam.ipam_type.contains(['/', '\\'])
            || self.ipam.ipam_type.starts_with('.')
        {
            return Err(bad(
                format!("ipam type {:?} is not a plugin name", self.ipam.ipam_type),
                "use \"calix-ipam\" or the name of a CNI IPAM plugin in CNI_PATH",
            ));
        }
        self.ipam
            .families()
            .map_err(|e| e.with_version(&self.cni_version))?;
        self.runtime()?;
        Ok(())
    }

    /// Whether addresses come from the agent (`calix-ipam`) rather than a delegated plugin.
    pub fn agent_ipam(&self) -> bool {
        self.ipam.ipam_type == "calix-ipam"
    }

    /// The `runtimeConfig` keys calix uses; bad values are code 7.
    pub fn runtime(&self) -> Result<RuntimeConfig, CniError> {
        let mut rc = RuntimeConfig::default();
        let Some(v) = &self.runtime_config else {
            return Ok(rc);
        };
        let bad = |msg: String| {
            CniError::new(code::INVALID_CONFIG, msg, "").with_version(&self.cni_version)
        };
        if let Some(ips) = get_ci(v, "ips") {
            let list = ips
                .as_array()
                .ok_or_else(|| bad("runtimeConfig.ips must be a list of addresses".into()))?;
            for ip in list {
                let text = ip.as_str().unwrap_or_default();
                let addr = text
                    .split('/')
                    .next()
                    .and_then(|a| a.parse().ok())
                    .ok_or_else(|| bad(format!("runtimeConfig.ips: {ip} is not an IP address")))?;
                rc.ips.push(addr);
            }
        }
        if let Some(mac) = get_ci(v, "mac") {
            let text = mac.as_str().unwrap_or_default();
            rc.mac =
                Some(calix_kernel::mac::parse(text).ok_or_else(|| {
                    bad(format!("runtimeConfig.mac: {mac} is not a MAC address"))
                })?);
        }
        Ok(rc)
    }

    /// GC's valid attachments (the 1.1 key, else the older one); `None` when absent.
    pub fn gc_attachments(&self) -> Option<&[Attachment]> {
        self.valid_attachments
            .as_deref()
            .or(self.attachments_legacy.as_deref())
    }

    pub fn agent_socket(&self) -> PathBuf {
        self.agent_socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_AGENT_SOCKET))
    }

    /// The IPAM handle of this network's attachments of `container_id`
    /// (`calix_proto::handle`: "<network>:<containerID>").
    pub fn handle(&self, container_id: &str) -> String {
        calix_proto::handle::encode(&self.name, container_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config() {
        let c = NetConf::parse(br#"{"cniVersion":"1.0.0","name":"k8s","type":"calix"}"#)
            .expect("parse");
        assert_eq!(c.ipam.ipam_type, "calix-ipam");
        assert_eq!(c.ipam.families().expect("fam"), (true, false));
        assert_eq!(c.agent_socket(), PathBuf::from(DEFAULT_AGENT_SOCKET));
        assert_eq!(c.handle("abc"), "k8s:abc");
    }

    #[test]
    fn handles_are_unambiguous() {
        let conf = |name: &str| {
            NetConf::parse(
                format!(r#"{{"cniVersion":"1.0.0","name":"{name}","type":"calix"}}"#).as_bytes(),
            )
            .expect("parse")
        };
        // Network and container IDs may both contain dots.
        assert_ne!(conf("a").handle("b.c"), conf("a.b").handle("c"));
    }

    #[test]
    fn full_config_with_unknown_keys() {
        let c = NetConf::parse(
            br#"{"cniVersion":"1.1.0","name":"k8s","type":"calix","mtu":1450,
                 "log_level":"debug","log_file_path":"/tmp/calix.log",
                 "agent_socket":"/tmp/a.sock","nodename":"n1","somethingNew":{"x":1},
                 "ipam":{"type":"calix-ipam","assign_ipv6":"true","extra":1},
                 "runtimeConfig":{"portMappings":[]},
                 "prevResult":{"cniVersion":"1.1.0","ips":[]}}"#,
        )
        .expect("parse");
        assert_eq!(c.mtu, Some(1450));
        assert_eq!(c.log_level.as_deref(), Some("debug"));
        assert_eq!(c.agent_socket(), PathBuf::from("/tmp/a.sock"));
        assert_eq!(c.ipam.families().expect("fam"), (true, true));
        assert!(c.prev_result.is_some());
    }

    #[test]
    fn undecodable_is_6_invalid_is_7() {
        assert_eq!(NetConf::parse(b"{not json").expect_err("6").code, 6);
        assert_eq!(NetConf::parse(b"").expect_err("6").code, 6);
        for bad in [
            &br#"{"cniVersion":"1.0.0","type":"calix"}"#[..],
            br#"{"cniVersion":"1.0.0","name":"a:b"}"#,
            br#"{"cniVersion":"1.0.0","name":"a/b"}"#,
            br#"{"cniVersion":"1.0.0","name":".a"}"#,
            br#"{"cniVersion":"1.0.0","name":"n","mtu":10}"#,
            br#"{"cniVersion":"1.0.0","name":"n","mtu":"big"}"#,
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"type":"../evil"}}"#,
            br#"{"cniVersion":"1.0.0","name":"n","runtimeConfig":{"ips":["nope"]}}"#,
            br#"{"cniVersion":"1.0.0","name":"n","runtimeConfig":{"mac":"zz:zz"}}"#,
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"assign_ipv4":"false"}}"#,
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"assign_ipv4":"maybe"}}"#,
        ] {
            let e = NetConf::parse(bad).expect_err("7");
            assert_eq!(e.code, 7, "{}", String::from_utf8_lossy(bad));
            assert_eq!(e.cni_version, "1.0.0");
        }
    }
}

#[cfg(test)]
mod runtime_tests {
    use super::*;

    #[test]
    fn runtime_config_and_delegation() {
        let c = NetConf::parse(
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"type":"host-local","subnet":"10.9.0.0/24"},
                 "container_settings":{"allow_ip_forwarding":true},
                 "runtimeConfig":{"IPs":["10.9.0.7/24"],"mac":"02:00:00:00:00:07",
                   "portMappings":[{"HostPort":8080,"ContainerPort":80,"Protocol":"tcp"}]}}"#,
        )
        .expect("parse");
        assert!(!c.agent_ipam());
        assert!(c.container_settings.allow_ip_forwarding);
        let rc = c.runtime().expect("rc");
        assert_eq!(
            rc.ips,
            vec!["10.9.0.7".parse::<std::net::IpAddr>().expect("ip")]
        );
        assert_eq!(rc.mac, Some([2, 0, 0, 0, 0, 7]));
    }

    #[test]
    fn gc_attachments_accept_both_keys() {
        let c = NetConf::parse(
            br#"{"cniVersion":"1.1.0","name":"n","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}"#,
        )
        .expect("parse");
        assert_eq!(c.gc_attachments().map(<[_]>::len), Some(1));
        let c = NetConf::parse(
            br#"{"cniVersion":"1.1.0","name":"n","cni.dev/attachments":[{"containerID":"a","ifname":"eth0"},{"containerID":"b","ifname":"eth0"}]}"#,
        )
        .expect("parse");
        assert_eq!(c.gc_attachments().map(<[_]>::len), Some(2));
        let c = NetConf::parse(br#"{"cniVersion":"1.1.0","name":"n"}"#).expect("parse");
        assert!(c.gc_attachments().is_none());
    }
}
