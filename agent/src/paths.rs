//! Every runtime path the agent uses by default, in one place.

/// The agent's gRPC unix socket (mode 0600).
pub const AGENT_SOCKET: &str = calix_proto::DEFAULT_AGENT_SOCKET;
/// The agent's config file; missing is fine (defaults apply).
pub const CONFIG_FILE: &str = "/etc/calix/agent.toml";
/// The embedded datastore's file.
pub const EMBEDDED_STORE: &str = "/var/lib/calix/store.json";
/// bpffs directory of the pinned maps and programs; each node pins below `<root>/<node>/`.
pub const BPF_PIN_ROOT: &str = "/sys/fs/bpf/calix";
