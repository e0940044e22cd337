//! The tcx mover and the dataplane's release: once the agent lets its dataplane go (shutdown;
//! before an uninstall when its DaemonSet was deleted), nothing moves a hook any more. Needs
//! root (bpffs, BPF programs, network namespaces).
mod common;

use std::net::Ipv4Addr;
use std::time::Duration;

use aya::programs::tc::TcAttachType;
use calix_dataplane::ebpf::{EbpfConfig, EbpfDataplane};
use calix_dataplane::nat::NatSettings;
use calix_dataplane::tcx::{self, TcAttach};
use calix_dataplane::{Dataplane, EndpointSpec};
use common::*;

/// A pod's hooks start as cls_bpf filters and the mover would put them on tcx links 2 s later.
/// The agent releases its dataplane before that (it stops; with `--owner-daemonset` it then
/// uninstalls calix from the node): the mover must not move them afterwards. It did: the link
/// it made after the release would survive an uninstall that ran meanwhile (its pin directory
/// created again), a calix program left on a pod's veth.
#[test]
fn a_released_dataplane_moves_no_hook_afterwards() {
    in_netns(|| {
        let pins = PinDir::new();
        let cfg = EbpfConfig {
            pin_root: pins.0.clone(),
            node: "n1".into(),
            uplinks: Vec::new(),
            object: None,
            xdp: None,
            nat: Some(NatSettings::example()),
            tc_attach: TcAttach::Tcx,
            doors: Default::default(),
            policy: Default::default(),
            services_cgroup: None,
        };
        let links = cfg.tcx_links_dir();
        let ifindex = veth("cxtmv");
        let mut dp = EbpfDataplane::load(cfg).expect("the dataplane loads");
        dp.attach(&EndpointSpec {
            key: "c0/eth0".into(),
            host_ifname: "cxtmv".into(),
            host_ifindex: Some(ifindex),
            ipv4: Some(Ipv4Addr::new(10, 244, 0, 10)),
            ipv6: None,
            mac: Some([2, 0, 0, 0, 0, 10]),
            pod: None,
        })
        .expect("attach");
        let tcx_progs = || -> Vec<u32> {
            [TcAttachType::Ingress, TcAttachType::Egress]
                .into_iter()
                .flat_map(|at| tcx::programs("cxtmv", at).expect("query tcx"))
                .collect()
        };
        assert_eq!(tcx_progs(), Vec::<u32>::new(), "filters first");
        dp.release();
        drop(dp);
        std::thread::sleep(Duration::from_millis(3500));
        let pinned: Vec<_> = std::fs::read_dir(&links)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert_eq!(
            (tcx_progs(), pinned),
            (Vec::new(), Vec::new()),
            "a hook moved to a tcx link after the dataplane was released"
        );
        // What the agent left is what the next agent (or the uninstall) finds: the filters.
        for dir in ["ingress", "egress"] {
            let out = std::process::Command::new("tc")
                .args(["filter", "show", "dev", "cxtmv", dir])
                .output()
                .expect("tc");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("bpf"), "the {dir} filter stays: {text:?}");
        }
    });
}
