//! The network configuration list calix installs (`10-calix.conflist`): the `calix` plugin,
//! then `portmap` (hostPort). What it writes is read back with the plugin's own parser before
//! it is installed, so a value the plugin would refuse is an install error, not a node whose
//! every pod fails.
use std::path::PathBuf;

use serde_json::{json, Value};

use crate::InstallError;

/// The file name: `10-` sorts it before most other configs (runtimes use the first file).
pub const DEFAULT_FILE_NAME: &str = "10-calix.conflist";
/// The network name, as Calico names it (a pod's IPAM handles carry it).
pub const DEFAULT_NETWORK: &str = "k8s-pod-network";
/// The CNI version of the list (calix speaks 0.3.0 to 1.1.0; portmap 1.0.0).
pub const CNI_VERSION: &str = "1.0.0";

/// What goes into the conflist.
#[derive(Debug, Clone, PartialEq)]
pub struct Conflist {
    pub network: String,
    /// The pods' MTU; `None`: the agent's answer (docs/reference/config.md, "The CNI network
    /// config").
    pub mtu: Option<u32>,
    /// The agent's socket as the plugin sees it: a path on the node.
    pub agent_socket: PathBuf,
    pub log_level: Option<String>,
    /// The plugin's log file on the node; `None`: stderr (the runtime's log).
    pub log_file: Option<PathBuf>,
    /// `portmap` after `calix` (hostPort).
    pub portmap: bool,
}

impl Default for Conflist {
    fn default() -> Self {
        Self {
            network: DEFAULT_NETWORK.into(),
            mtu: None,
            agent_socket: PathBuf::from(calix_proto::DEFAULT_AGENT_SOCKET),
            log_level: None,
            log_file: None,
            portmap: true,
        }
    }
}

/// The log levels the plugin understands.
const LOG_LEVELS: &[&str] = &["error", "warn", "info", "debug", "trace"];

impl Conflist {
    /// The plugins' types in chain order.
    pub fn plugin_types(&self) -> Vec<&'static str> {
        let mut t = vec!["calix"];
        if self.portmap {
            t.push("portmap");
        }
        t
    }

    /// The file's content (pretty JSON, a trailing newline), checked: see the module.
    pub fn render(&self) -> Result<String, InstallError> {
        if !self.agent_socket.is_absolute() {
            return Err(InstallError::Config {
                key: "agent socket",
                value: self.agent_socket.display().to_string(),
                why: "must be an absolute path on the node",
            });
        }
        if let Some(level) = &self.log_level {
            if !LOG_LEVELS.contains(&level.as_str()) {
                return Err(InstallError::Config {
                    key: "log level",
                    value: level.clone(),
                    why: "must be one of error, warn, info, debug, trace",
                });
            }
        }
        if let Some(file) = &self.log_file {
            if !file.is_absolute() {
                return Err(InstallError::Config {
                    key: "log file",
                    value: file.display().to_string(),
                    why: "must be an absolute path on the node",
                });
            }
        }
        let mut calix = json!({
            "type": "calix",
            "ipam": { "type": "calix-ipam" },
            "agent_socket": self.agent_socket,
        });
        if let Some(mtu) = self.mtu {
            calix["mtu"] = json!(mtu);
        }
        if let Some(level) = &self.log_level {
            calix["log_level"] = json!(level);
        }
        if let Some(file) = &self.log_file {
            calix["log_file_path"] = json!(file);
        }
        check_with_plugin(&self.network, &calix)?;
        let mut plugins = vec![calix];
        if self.portmap {
            plugins.push(json!({
                "type": "portmap",
                "snat": true,
                "capabilities": { "portMappings": true },
            }));
        }
        let list = json!({
            "cniVersion": CNI_VERSION,
            "name": self.network,
            "plugins": plugins,
        });
        let mut text =
            serde_json::to_string_pretty(&list).map_err(|source| InstallError::Json { source })?;
        text.push('\n');
        Ok(text)
    }
}

/// The calix entry as the runtime hands it to the plugin (libcni adds the list's `name` and
/// `cniVersion` to each entry), through the plugin's own parser.
fn check_with_plugin(network: &str, entry: &Value) -> Result<(), InstallError> {
    let mut conf = entry.clone();
    conf["name"] = json!(network);
    conf["cniVersion"] = json!(CNI_VERSION);
    let bytes = serde_json::to_vec(&conf).unwrap_or_default();
    calix_cni::config::NetConf::parse(&bytes).map_err(InstallError::Refused)?;
    Ok(())
}

/// Whether `text` is a conflist whose first plugin is calix: only such a file is removed by
/// an uninstall (a file of the same name someone else wrote stays).
pub fn is_calix(text: &str) -> bool {
    serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| {
            v.get("plugins")?
                .get(0)?
                .get("type")?
                .as_str()
                .map(|t| t == "calix")
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calix_then_portmap_with_the_values_given() {
        let c = Conflist {
            mtu: Some(1450),
            log_level: Some("debug".into()),
            log_file: Some("/var/log/calix/cni.log".into()),
            agent_socket: "/run/x/agent.sock".into(),
            ..Conflist::default()
        };
        let v: Value = serde_json::from_str(&c.render().expect("renders")).expect("json");
        assert_eq!(v["cniVersion"], CNI_VERSION);
        assert_eq!(v["name"], DEFAULT_NETWORK);
        let p = v["plugins"].as_array().expect("plugins");
        assert_eq!(p.len(), 2);
        assert_eq!(p[0]["type"], "calix");
        assert_eq!(p[0]["mtu"], 1450);
        assert_eq!(p[0]["ipam"]["type"], "calix-ipam");
        assert_eq!(p[0]["agent_socket"], "/run/x/agent.sock");
        assert_eq!(p[0]["log_level"], "debug");
        assert_eq!(p[0]["log_file_path"], "/var/log/calix/cni.log");
        assert_eq!(p[1]["type"], "portmap");
        assert_eq!(p[1]["capabilities"]["portMappings"], true);
        assert!(is_calix(&c.render().expect("renders")));
        // Without mtu the key is absent: the agent's answer applies.
        let plain = Conflist {
            portmap: false,
            ..Conflist::default()
        };
        let v: Value = serde_json::from_str(&plain.render().expect("renders")).expect("json");
        assert!(v["plugins"][0].get("mtu").is_none());
        assert_eq!(v["plugins"].as_array().map(Vec::len), Some(1));
    }

    #[test]
    fn values_the_plugin_would_refuse_are_errors_naming_them() {
        let cases: Vec<(Conflist, &str)> = vec![
            (
                Conflist {
                    network: "bad/name".into(),
                    ..Conflist::default()
                },
                "bad/name",
            ),
            (
                Conflist {
                    mtu: Some(20),
                    ..Conflist::default()
                },
                "mtu 20",
            ),
            (
                Conflist {
                    mtu: Some(70000),
                    ..Conflist::default()
                },
                "mtu 70000",
            ),
            (
                Conflist {
                    agent_socket: "agent.sock".into(),
                    ..Conflist::default()
                },
                "agent.sock",
            ),
            (
                Conflist {
                    log_level: Some("loud".into()),
                    ..Conflist::default()
                },
                "loud",
            ),
            (
                Conflist {
                    log_file: Some("cni.log".into()),
                    ..Conflist::default()
                },
                "cni.log",
            ),
        ];
        for (c, named) in cases {
            let e = c.render().expect_err("refused").to_string();
            assert!(e.contains(named), "{e:?} should name {named:?}");
        }
    }

    #[test]
    fn only_a_list_led_by_calix_is_ours() {
        assert!(!is_calix(r#"{"plugins":[{"type":"bridge"}]}"#));
        assert!(!is_calix("not json"));
        assert!(!is_calix(r#"{"plugins":[]}"#));
        assert!(is_calix(
            r#"{"plugins":[{"type":"calix"},{"type":"portmap"}]}"#
        ));
    }
}
