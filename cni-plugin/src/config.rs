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
        if let Some(mtu) = self.mtu {
            if !(68..=65535).contains(&mtu) {
                return Err(bad(
                    format!("mtu {mtu} is out of range"),
                    "use an MTU between 68 and 65535",
                ));
            }
        }
        if self.ipam.ipam_type != "calix-ipam" {
            return Err(bad(
                format!("ipam type {:?} is not supported yet", self.ipam.ipam_type),
                "use \"calix-ipam\"",
            ));
        }
        self.ipam
            .families()
            .map_err(|e| e.with_version(&self.cni_version))?;
        Ok(())
    }

    pub fn agent_socket(&self) -> PathBuf {
        self.agent_socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_AGENT_SOCKET))
    }

    /// The IPAM handle: "<network>.<containerID>".
    pub fn handle(&self, container_id: &str) -> String {
        format!("{}.{container_id}", self.name)
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
        assert_eq!(c.handle("abc"), "k8s.abc");
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
            br#"{"cniVersion":"1.0.0","name":"n","mtu":10}"#,
            br#"{"cniVersion":"1.0.0","name":"n","mtu":"big"}"#,
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"type":"dhcp"}}"#,
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"assign_ipv4":"false"}}"#,
            br#"{"cniVersion":"1.0.0","name":"n","ipam":{"assign_ipv4":"maybe"}}"#,
        ] {
            let e = NetConf::parse(bad).expect_err("7");
            assert_eq!(e.code, 7, "{}", String::from_utf8_lossy(bad));
            assert_eq!(e.cni_version, "1.0.0");
        }
    }
}
