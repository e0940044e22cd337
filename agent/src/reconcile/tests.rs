//! The reconciler against an in-memory kernel ([`FakeHost`]) and a dataplane that records
//! what it is asked: no root needed.
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use calix_kernel::host::FakeHost;
use calix_kernel::pod::{host_settings, node_settings, HostRoute};

use super::*;
use calix_dataplane::Drift;

/// What the fake dataplane saw, and the drift it reports next.
#[derive(Default)]
pub(super) struct Seen {
    attached: Vec<String>,
    detached: Vec<String>,
    drift: Vec<Drift>,
    fail_attach: usize,
    /// The node-wide drift reported next (cleared by a repair), and repairs to fail.
    node_drift: Vec<Drift>,
    node_repairs: usize,
    fail_node_repair: usize,
    /// Host devices' drift by name (cleared by an attach), and the attaches.
    pub(super) host_dev_drift: std::collections::BTreeMap<String, Vec<Drift>>,
    pub(super) host_dev_attached: Vec<String>,
}

pub(super) struct FakeDataplane(pub(super) Arc<Mutex<Seen>>);

impl Dataplane for FakeDataplane {
    fn attach(&mut self, ep: &EndpointSpec) -> Result<Attached, DataplaneError> {
        let mut seen = self.0.lock().expect("lock");
        if seen.fail_attach > 0 {
            seen.fail_attach -= 1;
            return Err(DataplaneError::NoInterface {
                ifname: ep.host_ifname.clone(),
            });
        }
        seen.attached.push(ep.key.clone());
        seen.drift.clear();
        Ok(Attached {
            ifindex: ep.host_ifindex.unwrap_or(0),
            bpf: true,
        })
    }
    fn detach(&mut self, key: &str) -> Result<(), DataplaneError> {
        self.0.lock().expect("lock").detached.push(key.into());
        Ok(())
    }
    fn verify(
        &self,
        _ep: &EndpointSpec,
        _kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        Ok(self.0.lock().expect("lock").drift.clone())
    }
    fn node_drift(&self) -> Result<Vec<Drift>, DataplaneError> {
        Ok(self.0.lock().expect("lock").node_drift.clone())
    }
    fn repair_node(&mut self) -> Result<(), DataplaneError> {
        let mut seen = self.0.lock().expect("lock");
        if seen.fail_node_repair > 0 {
            seen.fail_node_repair -= 1;
            return Err(DataplaneError::Nftables(
                calix_kernel::nft::NftError::Refused {
                    table: "inet calix_antispoof".into(),
                    message: "creating the table".into(),
                    errno: nix::errno::Errno::EPERM,
                    others: 0,
                },
            ));
        }
        seen.node_repairs += 1;
        seen.node_drift.clear();
        Ok(())
    }
    fn attach_host_dev(&mut self, ifname: &str) -> Result<(), DataplaneError> {
        let mut seen = self.0.lock().expect("lock");
        seen.host_dev_attached.push(ifname.into());
        seen.host_dev_drift.remove(ifname);
        Ok(())
    }
    fn verify_host_dev(
        &self,
        ifname: &str,
        _index: u32,
        _kernel: &mut dyn HostKernel,
    ) -> Result<Vec<Drift>, DataplaneError> {
        Ok(self
            .0
            .lock()
            .expect("lock")
            .host_dev_drift
            .get(ifname)
            .cloned()
            .unwrap_or_default())
    }
}

const IF: &str = "cali0123456789a";
const IDX: u32 = 7;

fn spec() -> EndpointSpec {
    EndpointSpec {
        key: "c1/eth0".into(),
        host_ifname: IF.into(),
        host_ifindex: Some(IDX),
        ipv4: Some(Ipv4Addr::new(10, 244, 0, 5)),
        ipv6: None,
        mac: Some([2, 0, 0, 0, 0, 1]),
        pod: None,
    }
}

/// A node as the plugin leaves it after ADD: the veth up, its settings and its route.
pub(super) fn wired() -> FakeHost {
    let mut k = FakeHost::default();
    k.add_link(IF, IDX);
    mark(&mut k, IF, "c1/eth0");
    for s in host_settings(IF, true, false)
        .into_iter()
        .chain(node_settings())
    {
        k.sysctls.insert(s.path, s.value.into());
    }
    k.routes.extend(HostRoute::of_pod(IDX, spec().ipv4, None));
    k
}

/// Gives link `name` the owner alias the plugin gives the veth of endpoint `key`.
pub(super) fn mark(k: &mut FakeHost, name: &str, key: &str) {
    let (cid, ifname) = key.split_once('/').expect("containerID/ifname");
    k.links.get_mut(name).expect("the link").alias =
        Some(calix_kernel::pod::owner_alias(cid, ifname));
}

pub(super) fn reconciler(k: FakeHost) -> (Reconciler<FakeHost>, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let r = Reconciler::new(k, Box::new(FakeDataplane(seen.clone())), Backoff::default());
    (r, seen)
}

pub(super) fn kinds(pass: &Pass) -> Vec<&'static str> {
    pass.repairs.iter().map(|(_, r)| r.kind).collect()
}

#[test]
fn an_idle_node_gets_no_writes() {
    let (mut r, seen) = reconciler(wired());
    r.upsert(spec()).expect("upsert");
    let now = Instant::now();
    for i in 0..10 {
        let pass = r.resync(now + Duration::from_secs(30 * i));
        assert_eq!(pass.checked, 1);
        assert!(pass.repairs.is_empty(), "{pass:?}");
    }
    assert!(r.kernel.writes.is_empty(), "{:?}", r.kernel.writes);
    assert_eq!(
        seen.lock().expect("lock").attached.len(),
        1,
        "only the upsert"
    );
    assert_eq!(r.health()["c1/eth0"], Health::Ok);
}

#[test]
fn drift_is_repaired_counted_and_then_left_alone() {
    let (mut r, seen) = reconciler(wired());
    r.upsert(spec()).expect("upsert");
    // Sabotage: the route, a setting, the link state, the programs.
    r.kernel.routes.clear();
    r.kernel
        .sysctls
        .insert(format!("ipv4/conf/{IF}/proxy_arp"), "0".into());
    r.kernel.links.get_mut(IF).expect("link").up = false;
    seen.lock().expect("lock").drift = vec![
        Drift::Filter {
            ingress: true,
            found: None,
        },
        Drift::EndpointEntry,
    ];
    let now = Instant::now();
    let pass = r.resync(now);
    let mut got = kinds(&pass);
    got.sort();
    assert_eq!(
        got,
        ["endpoint_map", "link_up", "route", "sysctl", "tc_filter"]
    );
    assert_eq!(r.repairs()["route"], 1);
    assert!(r
        .kernel
        .routes
        .contains(&HostRoute::of_pod(IDX, spec().ipv4, None)[0]));
    assert_eq!(r.kernel.sysctls[&format!("ipv4/conf/{IF}/proxy_arp")], "1");
    assert!(r.kernel.links[IF].up);
    assert_eq!(
        seen.lock().expect("lock").attached.len(),
        2,
        "re-attached once"
    );
    // Repaired: the next pass writes nothing.
    let writes = r.kernel.writes.len();
    assert!(r.resync(now + Duration::from_secs(30)).repairs.is_empty());
    assert_eq!(r.kernel.writes.len(), writes);
}

#[test]
fn a_stale_route_through_another_interface_is_replaced() {
    let mut k = wired();
    k.routes.clear();
    k.add_link("caliold", 3);
    k.routes.extend(HostRoute::of_pod(3, spec().ipv4, None));
    let (mut r, _) = reconciler(k);
    r.upsert(spec()).expect("upsert");
    let pass = r.resync(Instant::now());
    assert_eq!(kinds(&pass), ["route"]);
    let routes: Vec<HostRoute> = r.kernel.routes.iter().copied().collect();
    assert_eq!(routes, HostRoute::of_pod(IDX, spec().ipv4, None));
}

#[test]
fn a_missing_or_replaced_veth_is_reported_not_recreated() {
    let (mut r, seen) = reconciler(wired());
    r.upsert(spec()).expect("upsert");
    r.kernel.links.clear();
    r.kernel.routes.clear();
    let now = Instant::now();
    let pass = r.resync(now);
    assert_eq!(pass.unhealthy, 1);
    assert_eq!(r.health()["c1/eth0"], Health::InterfaceMissing);
    assert!(
        r.kernel.writes.is_empty(),
        "nothing re-created: {:?}",
        r.kernel.writes
    );
    assert!(r.kernel.links.is_empty());
    // Another link took the name.
    r.kernel.add_link(IF, 99);
    r.resync(now + Duration::from_secs(1));
    assert_eq!(r.health()["c1/eth0"], Health::Replaced { found: 99 });
    assert!(r.kernel.writes.is_empty());
    // Its own link back (renamed back): programmed again.
    r.kernel.links.clear();
    r.kernel.add_link(IF, IDX);
    mark(&mut r.kernel, IF, "c1/eth0");
    let before = seen.lock().expect("lock").attached.len();
    let pass = r.resync(now + Duration::from_secs(2));
    assert_eq!(r.health()["c1/eth0"], Health::Ok);
    assert_eq!(kinds(&pass), ["route"]);
    assert_eq!(seen.lock().expect("lock").attached.len(), before + 1);
}

#[test]
fn a_failure_stays_dirty_and_is_retried_with_backoff() {
    let mut k = wired();
    k.routes.clear();
    k.fail.push("add_route");
    let (mut r, seen) = reconciler(k);
    r.upsert(spec()).expect("upsert");
    let t0 = Instant::now();
    let pass = r.resync(t0);
    assert_eq!(pass.unhealthy, 1);
    assert!(matches!(r.health()["c1/eth0"], Health::Failing { .. }));
    let due = r.next_retry().expect("a retry is scheduled");
    assert!(due > t0);
    // Not due yet: nothing happens.
    assert_eq!(r.retry_due(t0).checked, 0);
    // Due: applied.
    let pass = r.retry_due(due);
    assert_eq!(pass.checked, 1);
    assert_eq!(kinds(&pass), ["route"]);
    assert_eq!(r.health()["c1/eth0"], Health::Ok);
    assert_eq!(r.next_retry(), None);
    // A failing attach (the dataplane) is retried the same way.
    seen.lock().expect("lock").drift = vec![Drift::EndpointEntry];
    seen.lock().expect("lock").fail_attach = 2;
    let t1 = due + Duration::from_secs(30);
    r.resync(t1);
    let first = r.next_retry().expect("retry");
    r.retry_due(first);
    let second = r.next_retry().expect("retry again");
    assert!(second - first > first - t1, "the backoff grows");
    r.retry_due(second);
    assert_eq!(r.health()["c1/eth0"], Health::Ok);
}

#[test]
fn an_older_sandbox_on_the_same_interface_is_no_longer_desired() {
    let (mut r, seen) = reconciler(wired());
    r.upsert(spec()).expect("upsert A");
    let mut b = spec();
    b.key = "c2/eth0".into();
    // The plugin replaced A's veth with B's (same name, B's owner alias).
    mark(&mut r.kernel, IF, "c2/eth0");
    r.upsert(b).expect("upsert B");
    assert_eq!(r.keys(), HashSet::from(["c2/eth0".to_string()]));
    // Removing A's key later (its late DEL) detaches only A.
    r.remove("c1/eth0").expect("remove A");
    assert_eq!(seen.lock().expect("lock").detached, ["c1/eth0"]);
    assert_eq!(r.keys(), HashSet::from(["c2/eth0".to_string()]));
}

#[test]
fn backoff_doubles_up_to_its_cap() {
    let b = Backoff {
        first: Duration::from_millis(500),
        max: Duration::from_secs(4),
    };
    let waits: Vec<u64> = (1..=6).map(|n| b.after(n).as_millis() as u64).collect();
    assert_eq!(waits, [500, 1000, 2000, 4000, 4000, 4000]);
}

#[test]
fn the_nodes_own_objects_are_repaired_and_retried() {
    let (mut r, seen) = reconciler(wired());
    let t0 = Instant::now();
    // Forwarding switched off, the anti-spoofing table flushed away.
    r.kernel
        .sysctls
        .insert("ipv4/ip_forward".into(), "0".into());
    seen.lock().expect("lock").node_drift = vec![Drift::NftTable {
        table: "inet calix_antispoof".into(),
        what: "is missing",
    }];
    let pass = r.resync(t0);
    let mut got = kinds(&pass);
    got.sort();
    assert_eq!(got, ["nft_table", "sysctl"]);
    assert!(pass.repairs.iter().all(|(k, _)| k == NODE));
    assert_eq!(r.kernel.sysctls["ipv4/ip_forward"], "1");
    assert_eq!(seen.lock().expect("lock").node_repairs, 1);
    assert_eq!(r.repairs()["nft_table"], 1);
    // Repaired: the next pass writes nothing.
    let writes = r.kernel.writes.len();
    assert!(r.resync(t0 + Duration::from_secs(30)).repairs.is_empty());
    assert_eq!(r.kernel.writes.len(), writes);
    // A repair that fails is reported and retried with backoff until it succeeds.
    {
        let mut s = seen.lock().expect("lock");
        s.node_drift = vec![Drift::NftTable {
            table: "ip calix".into(),
            what: "was changed by something else",
        }];
        s.fail_node_repair = 2;
    }
    let t1 = t0 + Duration::from_secs(60);
    r.resync(t1);
    let error = r.node_error().unwrap_or_default().to_string();
    assert!(error.contains("not permitted"), "{error}");
    let first = r.next_retry().expect("a retry is scheduled");
    assert!(first > t1);
    assert!(r.retry_due(t1).repairs.is_empty(), "not due yet");
    r.retry_due(first);
    let second = r.next_retry().expect("retried again");
    assert!(second - first > first - t1, "the backoff grows");
    let pass = r.retry_due(second);
    assert_eq!(kinds(&pass), ["nft_table"]);
    assert_eq!(r.node_error(), None);
    assert_eq!(r.next_retry(), None);
}

#[test]
fn an_optional_node_setting_the_kernel_lacks_is_left_alone() {
    let mut k = wired();
    k.sysctls.remove("ipv6/conf/all/forwarding");
    let (mut r, _) = reconciler(k);
    assert!(r.resync(Instant::now()).repairs.is_empty());
    assert!(r.kernel.writes.is_empty(), "{:?}", r.kernel.writes);
}

/// A record (from the datastore: whoever can write it) naming an interface calix did not make
/// for that endpoint — the uplink, or a cali link whose owner alias names another endpoint —
/// is never programmed: no write to the kernel, nothing attached; reported, and refused at
/// once on the CNI path.
#[test]
fn an_interface_without_calixs_mark_for_the_endpoint_is_never_programmed() {
    let mut k = FakeHost::default();
    k.add_link("eth0", 2);
    k.add_link(IF, IDX);
    mark(&mut k, IF, "someone-else/eth0");
    k.add_link("cali1111111111a", 8);
    let (mut r, seen) = reconciler(k);
    let uplink = EndpointSpec {
        key: "forged/eth0".into(),
        host_ifname: "eth0".into(),
        host_ifindex: Some(2),
        ..spec()
    };
    let impostor = EndpointSpec {
        key: "forged2/eth0".into(),
        ..spec()
    };
    let unmarked = EndpointSpec {
        key: "forged3/eth0".into(),
        host_ifname: "cali1111111111a".into(),
        host_ifindex: Some(8),
        ..spec()
    };
    for s in [&uplink, &impostor, &unmarked] {
        r.adopt(s.clone());
    }
    let now = Instant::now();
    for i in 0..3 {
        let pass = r.resync(now + Duration::from_secs(30 * i));
        assert_eq!(pass.unhealthy, 3, "{pass:?}");
    }
    let health = r.health();
    assert_eq!(
        health["forged/eth0"],
        Health::NotCalix {
            found: "not a cali… link".into()
        }
    );
    assert_eq!(
        health["forged2/eth0"],
        Health::NotCalix {
            found: "its owner alias is \"calix:someone-else/eth0\"".into()
        }
    );
    assert_eq!(
        health["forged3/eth0"],
        Health::NotCalix {
            found: "it has no owner alias".into()
        }
    );
    assert!(health["forged/eth0"].to_string().contains("not calix's"));
    // Nothing written, nothing attached: only the node's own settings.
    let node_paths: Vec<String> = node_settings().into_iter().map(|s| s.path).collect();
    let writes: Vec<&String> = r
        .kernel
        .writes
        .iter()
        .filter(|w| !node_paths.iter().any(|p| w.contains(p.as_str())))
        .collect();
    assert!(writes.is_empty(), "{writes:?}");
    assert!(r.kernel.routes.is_empty());
    assert!(seen.lock().expect("lock").attached.is_empty());
    assert!(r.programmed_interfaces().is_empty());
    // The CNI path: refused before anything is programmed.
    let e = r.upsert(uplink).expect_err("the uplink");
    assert!(matches!(e, DataplaneError::NotCalix { .. }), "{e}");
    assert!(seen.lock().expect("lock").attached.is_empty());
}
