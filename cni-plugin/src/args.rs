//! The CNI environment (CNI_COMMAND, CNI_CONTAINERID, ...) and CNI_ARGS, read through a small
//! trait so tests need no `set_var`; and the host veth name derived from them.
use std::collections::BTreeMap;

use sha1::{Digest, Sha1};

use crate::error::{code, CniError};

/// Where environment variables come from.
pub trait Env {
    fn var(&self, key: &str) -> Option<String>;
}

/// The real process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl Env for BTreeMap<String, String> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).cloned()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Gc,
    Status,
}

impl Command {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "VERSION" => Self::Version,
            "GC" => Self::Gc,
            "STATUS" => Self::Status,
            _ => return None,
        })
    }
}

/// The environment of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    pub command: Command,
    pub container_id: String,
    /// Empty when the runtime sent none (allowed for DEL).
    pub netns: String,
    pub ifname: String,
    pub args: CniArgs,
    pub path: Vec<String>,
}

fn invalid_env(msg: impl Into<String>, details: impl Into<String>) -> CniError {
    CniError::new(code::INVALID_ENV, msg, details)
}

impl CniEnv {
    pub fn from_env(env: &dyn Env) -> Result<Self, CniError> {
        let cmd_text = env.var("CNI_COMMAND").unwrap_or_default();
        let command = Command::parse(&cmd_text).ok_or_else(|| {
            invalid_env(
                format!("CNI_COMMAND {cmd_text:?} is not a CNI command"),
                "set CNI_COMMAND to one of ADD, DEL, CHECK, VERSION, GC, STATUS",
            )
        })?;
        let get = |k: &str| env.var(k).unwrap_or_default();
        let e = Self {
            command,
            container_id: get("CNI_CONTAINERID"),
            netns: get("CNI_NETNS"),
            ifname: get("CNI_IFNAME"),
            args: CniArgs::parse(&get("CNI_ARGS"))?,
            path: get("CNI_PATH")
                .split(':')
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect(),
        };
        e.validate()?;
        Ok(e)
    }

    fn validate(&self) -> Result<(), CniError> {
        let needs_container = matches!(self.command, Command::Add | Command::Del | Command::Check);
        if needs_container {
            if self.container_id.is_empty() {
                return Err(invalid_env(
                    "CNI_CONTAINERID is missing",
                    "the runtime must pass the container ID",
                ));
            }
            if !self
                .container_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
            {
                return Err(invalid_env(
                    format!(
                        "CNI_CONTAINERID {:?} has invalid characters",
                        self.container_id
                    ),
                    "only letters, digits, '_', '.' and '-' are allowed",
                ));
            }
            if self.ifname.is_empty() {
                return Err(invalid_env(
                    "CNI_IFNAME is missing",
                    "the runtime must name the interface to create, usually eth0",
                ));
            }
            if self.ifname.len() > 15
                || self.ifname.contains(['/', ' ', ':'])
                || self.ifname == "."
                || self.ifname == ".."
            {
                return Err(invalid_env(
                    format!("CNI_IFNAME {:?} is not a valid interface name", self.ifname),
                    "interface names are 1-15 characters without '/', ':' or spaces",
                ));
            }
        }
        if matches!(self.command, Command::Add | Command::Check) && self.netns.is_empty() {
            return Err(invalid_env(
                "CNI_NETNS is missing",
                "ADD and CHECK need the path of the container's network namespace",
            ));
        }
        Ok(())
    }
}

/// CNI_ARGS: `K=V;K=V`. The Kubernetes keys are parsed; every other key is kept in `other`
/// and otherwise ignored (calix never rejects unknown keys, as if `IgnoreUnknown=1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pub pod_namespace: Option<String>,
    pub pod_name: Option<String>,
    pub pod_uid: Option<String>,
    pub pod_infra_container_id: Option<String>,
    pub other: BTreeMap<String, String>,
}

impl CniArgs {
    pub fn parse(s: &str) -> Result<Self, CniError> {
        let mut a = Self::default();
        for pair in s.split(';').filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| {
                invalid_env(
                    format!("CNI_ARGS entry {pair:?} is not KEY=VALUE"),
                    "CNI_ARGS is a ';'-separated list of KEY=VALUE",
                )
            })?;
            let v = v.to_string();
            match k {
                "K8S_POD_NAMESPACE" => a.pod_namespace = Some(v),
                "K8S_POD_NAME" => a.pod_name = Some(v),
                "K8S_POD_UID" => a.pod_uid = Some(v),
                "K8S_POD_INFRA_CONTAINER_ID" => a.pod_infra_container_id = Some(v),
                _ => {
                    a.other.insert(k.to_string(), v);
                }
            }
        }
        Ok(a)
    }
}

/// The interface name a pod's first (primary) attachment gets; the veth name of every other
/// attachment includes its interface name.
pub const PRIMARY_IFNAME: &str = "eth0";

/// The host-side veth name, always 15 characters (IFNAMSIZ - 1):
/// - `cali` + the first 11 hex characters of SHA-1("<ns>.<pod>") when the runtime names the pod
///   (Kubernetes; the same name Calico gives);
/// - else `cali` + the first 11 characters of the container ID when it is a hex ID (podman,
///   CRI), readable and matching `podman ps`;
/// - else `cali` + 11 hex of SHA-1(containerID): IDs such as ctr's `<namespace>-<name>` share
///   long prefixes and would clash.
///
/// An attachment on another interface than `eth0` (a second calix network of the same pod)
/// hashes `"<ns>.<pod>/<ifname>"` (or `"<containerID>/<ifname>"`): '/' appears in neither pod
/// names nor interface names, so no two attachments share a name by construction.
pub fn host_veth_name(args: &CniArgs, container_id: &str, ifname: &str) -> String {
    let hash = |s: &str| {
        let digest = Sha1::digest(s.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("cali{}", &hex[..11])
    };
    let secondary = ifname != PRIMARY_IFNAME;
    match pod_identity(args) {
        Some((ns, pod)) if secondary => hash(&format!("{ns}.{pod}/{ifname}")),
        Some((ns, pod)) => hash(&format!("{ns}.{pod}")),
        None if secondary => hash(&format!("{container_id}/{ifname}")),
        None if container_id.len() >= 11
            && container_id
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            format!("cali{}", &container_id[..11])
        }
        None => hash(container_id),
    }
}

/// The Kubernetes pod (namespace, name) the runtime names, if it does. The host veth name is
/// then the pod's, whichever sandbox: a new sandbox of a recreated pod takes over the name
/// from the old one.
pub fn pod_identity(args: &CniArgs) -> Option<(&str, &str)> {
    match (&args.pod_namespace, &args.pod_name) {
        (Some(ns), Some(pod)) if !ns.is_empty() && !pod.is_empty() => Some((ns, pod)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn veth_name_from_pod_matches_calico() {
        // Calico: "cali" + sha1("default.nginx")[:11]
        let args = CniArgs::parse("K8S_POD_NAMESPACE=default;K8S_POD_NAME=nginx").expect("args");
        let name = host_veth_name(&args, "abcdef0123456789", "eth0");
        assert_eq!(name.len(), 15);
        let digest = Sha1::digest(b"default.nginx");
        assert_eq!(&name[4..6], format!("{:02x}", digest[0]));
        assert_eq!(name, "cali".to_string() + &hex11(b"default.nginx"));
        // Order of CNI_ARGS does not matter; extra keys don't either.
        let args2 = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAME=nginx;K8S_POD_UID=u;K8S_POD_NAMESPACE=default",
        )
        .expect("args");
        assert_eq!(host_veth_name(&args2, "zzz", "eth0"), name);
    }

    fn hex11(b: &[u8]) -> String {
        Sha1::digest(b)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()[..11]
            .to_string()
    }

    #[test]
    fn veth_name_falls_back_to_container_id() {
        // podman passes only K8S_POD_NAME.
        let args = CniArgs::parse("IgnoreUnknown=1;K8S_POD_NAME=web").expect("args");
        assert_eq!(
            host_veth_name(&args, "0123456789abcdef", "eth0"),
            "cali0123456789a"
        );
        // Non-hex or short IDs are hashed: ctr's "<ns>-<name>" IDs share prefixes.
        let a = host_veth_name(&CniArgs::default(), "default-web1", "eth0");
        let b = host_veth_name(&CniArgs::default(), "default-web2", "eth0");
        assert_ne!(a, b);
        assert_eq!(a, "cali".to_string() + &hex11(b"default-web1"));
        assert_eq!(
            host_veth_name(&CniArgs::default(), "short", "eth0").len(),
            15
        );
    }

    #[test]
    fn every_attachment_of_a_pod_has_its_own_veth_name() {
        let k8s = |pod: &str| {
            CniArgs::parse(&format!("K8S_POD_NAMESPACE=x;K8S_POD_NAME={pod}")).expect("args")
        };
        let eth0 = host_veth_name(&k8s("a"), "c1", "eth0");
        let net1 = host_veth_name(&k8s("a"), "c1", "net1");
        assert_ne!(eth0, net1);
        assert_eq!(net1, "cali".to_string() + &hex11(b"x.a/net1"));
        // Pod "a" on net1 and pod "a.net1" on eth0 (dots are legal in pod names) differ.
        assert_ne!(net1, host_veth_name(&k8s("a.net1"), "c2", "eth0"));
        // Without pod names: the container ID, and the interface for secondary ones.
        let id = "0123456789abcdef";
        assert_eq!(
            host_veth_name(&CniArgs::default(), id, "eth0"),
            "cali0123456789a"
        );
        assert_eq!(
            host_veth_name(&CniArgs::default(), id, "net1"),
            "cali".to_string() + &hex11(b"0123456789abcdef/net1")
        );
        assert!(pod_identity(&k8s("a")).is_some());
        assert!(pod_identity(&CniArgs::parse("K8S_POD_NAME=web").expect("args")).is_none());
    }

    #[test]
    fn env_parses_and_validates() {
        let e = CniEnv::from_env(&env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin::/usr/lib/cni"),
            ("CNI_ARGS", "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;FOO=bar"),
        ]))
        .expect("env");
        assert_eq!(e.command, Command::Add);
        assert_eq!(e.path, vec!["/opt/cni/bin", "/usr/lib/cni"]);
        assert_eq!(e.args.pod_name.as_deref(), Some("p"));
        assert_eq!(e.args.other.get("FOO").map(String::as_str), Some("bar"));
    }

    #[test]
    fn bad_env_is_code_4() {
        for bad in [
            vec![("CNI_COMMAND", "FROB")],
            vec![
                ("CNI_COMMAND", "ADD"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_NETNS", "/x"),
            ],
            vec![
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", "c"),
                ("CNI_NETNS", "/x"),
            ],
            vec![
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", "c"),
                ("CNI_IFNAME", "eth0"),
            ],
            vec![
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", "c/../x"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_NETNS", "/x"),
            ],
            vec![
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", "c"),
                ("CNI_IFNAME", "waytoolonginterface"),
                ("CNI_NETNS", "/x"),
            ],
            vec![
                ("CNI_COMMAND", "DEL"),
                ("CNI_CONTAINERID", "c"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_ARGS", "novalue"),
            ],
        ] {
            let err = CniEnv::from_env(&env(&bad)).expect_err("must fail");
            assert_eq!(err.code, code::INVALID_ENV, "{bad:?}: {err}");
        }
        // DEL without a netns is fine (containerd's second DEL).
        CniEnv::from_env(&env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c"),
            ("CNI_IFNAME", "eth0"),
        ]))
        .expect("DEL without netns");
    }
}
