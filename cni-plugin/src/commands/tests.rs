//! ADD, its rollback and DEL through the seams, against the fakes: no root, no agent, no
//! kernel. The root tests (tests/tests/cni_verbs.rs) run the same verbs for real.
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use serde_json::{json, Value};

use super::fake::{FakeAgent, FakeDelegate, FakeKernel, World};
use super::Invocation;
use crate::args::CniEnv;
use crate::config::NetConf;
use crate::error::{code, CniError};

/// One invocation's environment and configuration.
struct Case {
    env: CniEnv,
    conf: NetConf,
    raw: Vec<u8>,
}

const NETNS: &str = "/run/netns/pod";

impl Case {
    /// `command` for container `c1`, interface `ifname`, pod ns/web; `extra` merged into a
    /// minimal network configuration.
    fn new(command: &str, ifname: &str, extra: Value) -> Self {
        let vars: BTreeMap<String, String> = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", NETNS),
            ("CNI_IFNAME", ifname),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let env = CniEnv::from_env(&vars).expect("env");
        let mut conf = json!({"cniVersion": "1.0.0", "name": "k8s", "type": "calix"});
        if let (Some(c), Some(e)) = (conf.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        let raw = conf.to_string().into_bytes();
        let conf = NetConf::parse(&raw).expect("conf");
        Self { env, conf, raw }
    }

    fn add(extra: Value) -> Self {
        Self::new("ADD", "eth0", extra)
    }

    fn inv(&self) -> Invocation<'_> {
        Invocation {
            env: &self.env,
            conf: &self.conf,
            raw: &self.raw,
        }
    }

    fn host_ifname(&self) -> String {
        crate::args::host_veth_name(&self.env.args, &self.env.container_id, &self.env.ifname)
    }

    /// This case's DEL.
    fn del(&self) -> Self {
        let mut d = Self {
            env: self.env.clone(),
            conf: self.conf.clone(),
            raw: self.raw.clone(),
        };
        d.env.command = crate::args::Command::Del;
        d
    }
}

async fn add(world: &Rc<RefCell<World>>, case: &Case) -> Result<Value, CniError> {
    super::add::add(
        &case.inv(),
        &mut FakeKernel(world.clone()),
        &mut FakeAgent(world.clone()),
        &mut FakeDelegate(world.clone()),
        &super::add::Phases::start(),
    )
    .await
}

async fn del(world: &Rc<RefCell<World>>, case: &Case) -> Result<(), CniError> {
    super::del::del(
        &case.inv(),
        &mut FakeKernel(world.clone()),
        &mut FakeAgent(world.clone()),
        &mut FakeDelegate(world.clone()),
        std::time::Instant::now(),
    )
    .await
}

fn journal(world: &Rc<RefCell<World>>) -> Vec<String> {
    world.borrow().journal.clone()
}

fn leftovers(world: &Rc<RefCell<World>>) -> Vec<String> {
    world.borrow().leftovers()
}

/// The spec's error JSON: cniVersion, code, msg (and details when there are some).
fn assert_spec_json(e: &CniError, version: &str) {
    let v: Value = serde_json::from_str(&e.clone().with_version(version).to_json()).expect("json");
    assert_eq!(v["cniVersion"], version, "{v}");
    assert_eq!(v["code"], e.code, "{v}");
    assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[tokio::test]
async fn add_wires_the_pod_registers_it_and_returns_the_result() {
    let world = World::new();
    let case = Case::add(json!({
        "ipam": {"type": "calix-ipam", "assign_ipv6": true},
        "runtimeConfig": {"mac": "02:ca:11:00:00:09"},
    }));
    let result = add(&world, &case).await.expect("ADD");
    let w = world.borrow();
    let link = &w.links[&case.host_ifname()];
    assert_eq!(link.alias.as_deref(), Some("calix:c1/eth0"));
    assert!(link.up);
    assert_eq!(link.pod_mac, [2, 0xca, 0x11, 0, 0, 9]);
    assert_eq!(link.pod_addresses.len(), 2);
    assert_eq!(link.host_routes, link.pod_addresses);
    assert!(
        w.source_rules.is_empty(),
        "a primary attachment has no rules"
    );
    let ep = &w.endpoints[&("c1".to_string(), "eth0".to_string())];
    assert_eq!(ep.host_ifname, case.host_ifname());
    assert_eq!(ep.host_ifindex, link.index);
    assert_eq!(ep.mac, "02:ca:11:00:00:09");
    assert_eq!(ep.handle, "k8s:c1");
    assert_eq!(ep.addresses.len(), 2);
    assert_eq!(result["cniVersion"], "1.0.0");
    assert_eq!(result["interfaces"][0]["name"], case.host_ifname().as_str());
    assert_eq!(result["interfaces"][0]["mac"], "ee:ee:ee:ee:ee:ee");
    assert_eq!(result["interfaces"][1]["sandbox"], NETNS);
    assert_eq!(result["ips"][0]["address"], "10.244.0.3/32");
    assert_eq!(result["ips"][0]["gateway"], "169.254.1.1");
    assert_eq!(result["ips"][1]["gateway"], "fe80::ecee:eeff:feee:eeee");
    assert_eq!(result["routes"].as_array().map(Vec::len), Some(2));
}

/// The undo of a step of ADD, if it has one.
fn undo_of(call: &str, host_ifname: &str, secondary: bool) -> Option<String> {
    match call.split(' ').next() {
        Some("allocate") => Some("release".into()),
        Some("delegate") => Some("delegate DEL".into()),
        Some("create_veth") => Some(format!("delete_host_link {host_ifname}")),
        Some("configure_pod") if secondary => Some(format!("forget_source_rules {NETNS}")),
        Some("register") => Some("unregister".into()),
        _ => None,
    }
}

fn is_undo(call: &str) -> bool {
    [
        "release",
        "delegate DEL",
        "delete_host_link",
        "forget_source_rules",
        "unregister",
    ]
    .iter()
    .any(|u| call.starts_with(u))
}

/// Makes each call of a successful ADD of `case` fail in turn (on a fresh world, set up by
/// `prepare`), and checks what the failed ADD answered and left.
async fn fail_each_step(case: &Case, secondary: bool, prepare: impl Fn(&mut World)) {
    let world = World::new();
    prepare(&mut world.borrow_mut());
    add(&world, case).await.expect("the ADD to break");
    let steps = journal(&world);
    let host_ifname = case.host_ifname();
    for (i, step) in steps.iter().enumerate() {
        let name = step.split(' ').next().expect("a name");
        if steps[..i].iter().any(|s| s.split(' ').next() == Some(name)) {
            continue; // the first of a repeated call is the one that fails
        }
        let world = World::new();
        prepare(&mut world.borrow_mut());
        world.borrow_mut().fail = Some((name.to_string(), tonic::Code::Internal));
        let e = add(&world, case).await.expect_err(step);

        let left = leftovers(&world);
        assert!(left.is_empty(), "{step} failed, left behind: {left:?}");
        let want_code = match name {
            "allocate" | "register" => code::AGENT_REFUSED,
            "delegate" => code::IO_FAILURE,
            _ => code::WIRING_FAILED,
        };
        assert_eq!(e.code, want_code, "{step}: {e}");
        assert_spec_json(&e, "1.0.0");

        // Each step done is undone, the last done first; nothing else is undone.
        let calls = journal(&world);
        let failed_at = calls
            .iter()
            .position(|c| c == step)
            .expect("the failed call");
        let done: Vec<&String> = calls
            .iter()
            .enumerate()
            .filter(|(j, c)| !is_undo(c) && (*j != failed_at || name == "configure_pod"))
            .map(|(_, c)| c)
            .collect();
        let want: Vec<String> = done
            .iter()
            .rev()
            .filter_map(|c| undo_of(c, &host_ifname, secondary))
            .collect();
        let undone: Vec<String> = calls.iter().filter(|c| is_undo(c)).cloned().collect();
        assert_eq!(undone, want, "{step} failed; calls: {calls:?}");
    }
}

#[tokio::test]
async fn a_failure_at_each_step_of_add_leaves_nothing_behind() {
    // Dual stack, a MAC and IP forwarding asked for: every step of ADD is taken.
    let extra = json!({
        "ipam": {"type": "calix-ipam", "assign_ipv6": true},
        "runtimeConfig": {"mac": "02:ca:11:00:00:09"},
        "container_settings": {"allow_ip_forwarding": true},
    });
    fail_each_step(&Case::add(extra.clone()), false, |_| {}).await;
    // A secondary attachment: its source rules outlive the veth, and go too.
    let net1 = Case::new("ADD", "net1", extra);
    fail_each_step(&net1, true, |w| w.foreign_default = (true, true)).await;
    // A delegated IPAM plugin gives the address back (its DEL).
    let delegated = Case::add(json!({"ipam": {"type": "host-local"}}));
    fail_each_step(&delegated, false, |_| {}).await;
}

#[tokio::test]
async fn dual_stack_is_all_or_nothing() {
    let extra = json!({"ipam": {"type": "calix-ipam", "assign_ipv6": true}});
    // The IPv6 half of the pod side fails after the IPv4 half was done.
    let world = World::new();
    world.borrow_mut().fail = Some(("configure_pod".into(), tonic::Code::Internal));
    let e = add(&world, &Case::add(extra.clone()))
        .await
        .expect_err("v6 fails");
    assert_eq!(e.code, code::WIRING_FAILED);
    assert!(journal(&world).contains(&"release".to_string()));
    assert_eq!(leftovers(&world), Vec::<String>::new());
    // No IPv6 address left: the agent refuses, with what to do; nothing is held.
    let world = World::new();
    world.borrow_mut().free_v6 = 0;
    let e = add(&world, &Case::add(extra)).await.expect_err("no v6");
    assert_eq!(e.code, code::AGENT_REFUSED, "{e}");
    assert!(e.msg.contains("IPv6"), "{e}");
    assert!(e.details.contains("pools are full"), "{e}");
    assert_eq!(leftovers(&world), Vec::<String>::new());
}

#[tokio::test]
async fn agent_failures_are_spec_errors_with_their_codes() {
    for (status, want) in [
        (tonic::Code::Unavailable, code::TRY_AGAIN),
        (tonic::Code::DeadlineExceeded, code::TRY_AGAIN),
        (tonic::Code::ResourceExhausted, code::AGENT_REFUSED),
        (tonic::Code::InvalidArgument, code::AGENT_REFUSED),
        (tonic::Code::AlreadyExists, code::AGENT_REFUSED),
    ] {
        for step in ["allocate", "register"] {
            let world = World::new();
            world.borrow_mut().fail = Some((step.into(), status));
            let e = add(&world, &Case::add(json!({}))).await.expect_err(step);
            assert_eq!(e.code, want, "{step} {status:?}: {e}");
            assert_spec_json(&e, "1.0.0");
            assert_eq!(leftovers(&world), Vec::<String>::new(), "{step} {status:?}");
        }
    }
    // A static address someone else holds: refused, what to do said, nothing left.
    let world = World::new();
    add(
        &world,
        &Case::add(json!({"runtimeConfig": {"ips": ["10.244.9.9"]}})),
    )
    .await
    .expect("first");
    let mut other = Case::add(json!({"runtimeConfig": {"ips": ["10.244.9.9"]}}));
    other.env.container_id = "c2".into();
    other.env.args =
        crate::args::CniArgs::parse("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=other").expect("args");
    let e = add(&world, &other).await.expect_err("taken");
    assert_eq!(e.code, code::AGENT_REFUSED);
    assert!(
        e.msg.contains("in use") && e.details.contains("another address"),
        "{e}"
    );
    assert_eq!(world.borrow().links.len(), 1);
    assert_eq!(world.borrow().allocations.len(), 1);
}

#[tokio::test]
async fn a_result_that_cannot_be_chained_is_undone_after_registration() {
    let world = World::new();
    let case = Case::add(json!({"prevResult": {"ips": [{"address": "nope"}]}}));
    let e = add(&world, &case).await.expect_err("bad prevResult");
    assert_eq!(e.code, code::DECODE_FAILURE);
    let calls = journal(&world);
    let tail: Vec<&str> = calls[calls.len() - 3..]
        .iter()
        .map(String::as_str)
        .collect();
    let delete = format!("delete_host_link {}", case.host_ifname());
    assert_eq!(tail, ["unregister", delete.as_str(), "release"]);
    assert_eq!(leftovers(&world), Vec::<String>::new());
}

#[tokio::test]
async fn add_again_of_a_live_attachment_fails_and_harms_nothing() {
    let world = World::new();
    let case = Case::add(json!({}));
    add(&world, &case).await.expect("first ADD");
    let before = leftovers(&world);
    let e = add(&world, &case).await.expect_err("second ADD");
    assert_eq!(e.code, code::WIRING_FAILED);
    assert!(e.msg.contains("DEL it first"), "{e}");
    // The addresses were the first ADD's: not released, nor the veth deleted.
    assert_eq!(leftovers(&world), before);
    assert!(!journal(&world).iter().any(|c| is_undo(c)));
}

#[tokio::test]
async fn an_older_sandbox_of_the_pod_gives_up_its_veth_and_a_foreign_link_is_left_alone() {
    let world = World::new();
    let case = Case::add(json!({}));
    let name = case.host_ifname();
    // The same pod's older sandbox (another container ID) still has the veth name.
    let mut old = Case::add(json!({}));
    old.env.container_id = "c0".into();
    add(&world, &old).await.expect("old sandbox");
    add(&world, &case).await.expect("new sandbox");
    assert_eq!(
        world.borrow().links[&name].alias.as_deref(),
        Some("calix:c1/eth0")
    );
    // The old sandbox's addresses stay until its own DEL.
    assert_eq!(world.borrow().allocations.len(), 2);

    // A link of that name that is not calix's: refused, not touched, the address released.
    let world = World::new();
    world.borrow_mut().links.insert(
        name.clone(),
        super::fake::Link {
            index: 3,
            alias: None,
            pod_ifname: "x".into(),
            pod_index: 4,
            pod_mac: [2; 6],
            up: true,
            pod_addresses: vec![],
            host_routes: vec![],
        },
    );
    let e = add(&world, &case).await.expect_err("foreign link");
    assert_eq!(e.code, code::WIRING_FAILED);
    assert!(e.msg.contains("not calix"), "{e}");
    let w = world.borrow();
    assert_eq!(w.links[&name].index, 3);
    assert!(w.allocations.is_empty());
    assert!(!w.journal.iter().any(|c| c.starts_with("delete_host_link")));
}

#[tokio::test]
async fn del_is_idempotent() {
    for extra in [
        json!({"ipam": {"type": "calix-ipam", "assign_ipv6": true}}),
        json!({"ipam": {"type": "host-local"}}),
    ] {
        let world = World::new();
        let case = Case::add(extra.clone());
        // DEL of what was never added.
        del(&world, &case.del()).await.expect("DEL of nothing");
        add(&world, &case).await.expect("ADD");
        assert!(!leftovers(&world).is_empty());
        for _ in 0..2 {
            del(&world, &case.del()).await.expect("DEL");
            assert_eq!(leftovers(&world), Vec::<String>::new(), "{extra}");
        }
        // A DEL without a namespace (the runtime's second DEL) is fine too.
        let mut gone = case.del();
        gone.env.netns.clear();
        del(&world, &gone).await.expect("DEL without netns");
    }
    // A secondary attachment's source rules go with its DEL.
    let world = World::new();
    world.borrow_mut().foreign_default = (true, false);
    let net1 = Case::new("ADD", "net1", json!({}));
    add(&world, &net1).await.expect("ADD net1");
    assert_eq!(world.borrow().source_rules.len(), 1);
    del(&world, &net1.del()).await.expect("DEL net1");
    assert_eq!(leftovers(&world), Vec::<String>::new());
}

#[tokio::test]
async fn del_never_takes_another_attachments_veth_and_says_why_it_failed() {
    let world = World::new();
    let mine = Case::add(json!({}));
    let mut other = Case::add(json!({}));
    other.env.container_id = "c2".into();
    // A newer sandbox of the same pod took the veth name over: the old one's DEL leaves it.
    add(&world, &other).await.expect("other ADD");
    del(&world, &mine.del()).await.expect("DEL");
    assert!(world.borrow().links.contains_key(&mine.host_ifname()));
    assert_eq!(world.borrow().endpoints.len(), 1);

    // The agent unreachable: try again (11); the veth is gone already, a retry finishes.
    let world = World::new();
    add(&world, &mine).await.expect("ADD");
    world.borrow_mut().fail = Some(("unregister".into(), tonic::Code::Unavailable));
    let e = del(&world, &mine.del()).await.expect_err("agent down");
    assert_eq!(e.code, code::TRY_AGAIN);
    assert_spec_json(&e, "1.0.0");
    del(&world, &mine.del()).await.expect("retried DEL");
    assert_eq!(leftovers(&world), Vec::<String>::new());
}
