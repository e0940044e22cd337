//! The calix test bed, shared by the integration tests (tests/) and the benchmarks (`cargo
//! xtask bench`): throwaway network namespaces, "nodes" each running a real calix-agent, "pods"
//! wired by the real `calix` CNI binary exec'd the way a runtime does, conflists, etcd, and the
//! traffic measurements ([`traffic`]: netperf-style request/response, iperf3, nstat, CPU time,
//! [`bpf`] program run time). Everything is removed on drop, even when a test fails or a bench
//! stops on an error.
//!
//! Tests name what they create `cxt<pid>x<n><tag>` ([`unique`]) and use the constructors that
//! panic (`Node::start`, `Pod::add`, `Netns::new`); benches name theirs `cxb-<pid>-<tag>` and use
//! the ones that return errors (`Node::launch`, `Netns::create`). Root only: build the binaries
//! first (`cargo xtask test` does it all).
//!
//! It depends on nothing that needs the eBPF toolchain: xtask builds on it before `cargo xtask
//! setup` has installed one.
use std::sync::atomic::{AtomicU32, Ordering};

mod agent;
pub mod authority;
pub mod bpf;
pub mod chart_tools;
mod cluster;
mod cni;
mod conflist;
mod error;
mod etcd;
pub mod image;
pub mod k8s;
pub mod kubelet;
mod netns;
mod node;
pub mod packets;
mod pod;
pub mod pod_net;
mod process;
pub mod signer;
pub mod stats;
pub mod tls;
mod tmpfs;
pub mod traffic;

pub use agent::{Agent, AgentSpec, Dataplane, RootAgent, POOL};
pub use bpf::{bpf_map_dump, bpf_map_u32_keys, bpf_maps_of};
pub use cluster::{Cluster, SUBNETS};
pub use cni::{cni_call, Call, CniOutput, Plugin, CNI_DIR};
pub use conflist::ConfList;
pub use error::{Error, Result};
pub use etcd::EtcdNs;
pub use k8s::KubeApi;
pub use kubelet::{CniDirs, KubeNode, KubeletServes};
pub use netns::{uplink, veth, Capture, Netns};
pub use node::{Node, NODE_IP};
pub use pod::Pod;
pub use process::{
    bin, bin_dir, checked, json, num, require_root, run, run_ok, stdout, upgrade_test_object,
    Guarded,
};
pub use tmpfs::Tmpfs;

/// Prefix of every namespace and directory the tests create.
pub const PREFIX: &str = "cxt";

/// A name unique to this process and call: `cxt<pid>x<n><tag>`.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{PREFIX}{}x{}{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `f` every 50 ms until it gives something, at most `timeout`; then panics naming
/// `what` and showing `show()` (e.g. an agent's log).
pub fn wait_for<T>(
    what: &str,
    timeout: std::time::Duration,
    mut f: impl FnMut() -> Option<T>,
    show: impl Fn() -> String,
) -> T {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not within {timeout:?}: {what}\n{}",
            show()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
