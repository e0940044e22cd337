//! Fuzzes everything the `calix` plugin parses from the runtime before it touches the network:
//! the CNI environment (CNI_COMMAND, CNI_CONTAINERID, ..., CNI_ARGS), the network configuration
//! on stdin (runtimeConfig, prevResult, GC attachments), the cniVersion check, the host veth
//! name, MAC parsing and the result rendering.
//!
//! Input layout: `<env part>\0<stdin bytes>` (no NUL: all of it is the env part, stdin empty).
//! The env part (lossy UTF-8) is one `KEY=VALUE` per line and becomes the environment; it is
//! also parsed whole as a CNI_ARGS string. A line without `=` is taken as CNI_ARGS if the env
//! has none, so short inputs still reach the CNI_ARGS parser through `CniEnv::from_env`.
//!
//! Properties checked besides "no panic": every error renders to valid JSON with its code; a
//! validated ADD/DEL/CHECK environment gives a `cali` veth name of at most 15 bytes; a rendered
//! result (chained after the input's prevResult) is valid JSON carrying the requested version
//! and decodes back to the same result; a parsed MAC round-trips; VERSION through
//! `calix_cni::run` prints valid JSON (VERSION never reaches the network or the agent).
#![no_main]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use calix_cni::args::{host_veth_name, CniArgs, CniEnv, Command};
use calix_cni::config::NetConf;
use calix_cni::error::CniError;
use calix_cni::result::{AddResult, Interface};
use calix_cni::version;
use calix_kernel::mac;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (env_part, stdin) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &data[data.len()..]),
    };
    let env_text = String::from_utf8_lossy(env_part);

    // CNI_ARGS on its own.
    match CniArgs::parse(&env_text) {
        Ok(args) => {
            let name = host_veth_name(&args, "0123456789abcdef", "eth0");
            assert!(name.starts_with("cali"), "{name:?}");
        }
        Err(e) => check_error(&e),
    }

    // The whole environment.
    let env = env_map(&env_text);
    let cni = match CniEnv::from_env(&env) {
        Ok(cni) => {
            if matches!(cni.command, Command::Add | Command::Del | Command::Check) {
                let name = host_veth_name(&cni.args, &cni.container_id, &cni.ifname);
                assert!(
                    name.starts_with("cali") && name.len() <= 15,
                    "bad host veth name {name:?} for {cni:?}"
                );
            }
            Some(cni)
        }
        Err(e) => {
            check_error(&e);
            None
        }
    };

    // The network configuration on stdin, its version, and the result rendered for it.
    match NetConf::parse(stdin) {
        Ok(conf) => {
            let _ = conf.agent_socket();
            let _ = conf.handle(cni.as_ref().map_or("c", |c| c.container_id.as_str()));
            let _ = conf.ipam.families();
            let _ = conf.agent_ipam();
            let _ = conf.gc_attachments().map(<[_]>::len);
            if let Err(e) = conf.runtime() {
                check_error(&e);
            }
            if version::is_supported(&conf.cni_version) {
                let mut result = sample_result(cni.as_ref(), stdin);
                // Chaining: our result placed after the prevResult the runtime sent.
                if let Some(prev) = &conf.prev_result {
                    match AddResult::from_json(prev) {
                        Ok(prev) => result = result.after(prev),
                        Err(e) => check_error(&e),
                    }
                }
                let v = result.to_json(&conf.cni_version);
                let text = v.to_string();
                let back: serde_json::Value =
                    serde_json::from_str(&text).expect("result is valid JSON");
                assert!(back["cniVersion"].is_string());
                if !conf.cni_version.is_empty() {
                    assert_eq!(back["cniVersion"], conf.cni_version.as_str());
                }
                // What we print parses back (as the next plugin's prevResult) to the same.
                let again = AddResult::from_json(&back).expect("our own result decodes");
                assert_eq!(again, result, "result does not round-trip: {text}");
            } else {
                check_error(&CniError::unsupported_version(&conf.cni_version));
            }
        }
        Err(e) => check_error(&e),
    }
    // Any JSON on stdin as a prevResult or a delegate's answer.
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(stdin) {
        if let Err(e) = AddResult::from_json(&v) {
            check_error(&e);
        }
    }
    // MACs (runtimeConfig.mac, prevResult interfaces) from every env line.
    for line in env_text.split('\n') {
        if let Some(m) = mac::parse(line) {
            assert_eq!(mac::parse(&mac::format(&m)), Some(m));
        }
    }
    // Versions straight from the input, not only from a decodable config.
    if !version::is_supported(&env_text) {
        check_error(&CniError::unsupported_version(&env_text));
    }

    // The real entry point, for VERSION only: it returns before the config or the network.
    let mut version_env = env;
    version_env.insert("CNI_COMMAND".into(), "VERSION".into());
    let mut stdin_reader = stdin;
    let mut fut = pin!(calix_cni::run(&version_env, &mut stdin_reader));
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => {
            let v: serde_json::Value =
                serde_json::from_str(&out.stdout).expect("VERSION output is valid JSON");
            if out.exit_code == 0 {
                assert!(v["supportedVersions"].is_array(), "{v}");
            } else {
                assert!(v["code"].is_u64(), "{v}");
            }
        }
        Poll::Pending => panic!("VERSION must not wait on anything"),
    }
});

/// `KEY=VALUE` lines; a line without `=` is CNI_ARGS unless a line sets it.
fn env_map(text: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut bare = None;
    for line in text.split('\n') {
        match line.split_once('=') {
            Some((k, v)) => {
                env.insert(k.to_string(), v.to_string());
            }
            None if bare.is_none() => bare = Some(line.to_string()),
            None => {}
        }
    }
    if let Some(b) = bare {
        env.entry("CNI_ARGS".into()).or_insert(b);
    }
    env
}

/// An error must render to the spec's JSON with its code and a message.
fn check_error(e: &CniError) {
    let v: serde_json::Value = serde_json::from_str(&e.to_json()).expect("error JSON");
    assert_eq!(v["code"].as_u64(), Some(u64::from(e.code)));
    assert!(v["msg"].is_string());
    assert!(!e.to_string().is_empty());
}

/// A result shaped like ADD's, with names, MACs and addresses taken from the input.
fn sample_result(cni: Option<&CniEnv>, bytes: &[u8]) -> AddResult {
    let byte = |i: usize| bytes.get(i).copied().unwrap_or(0);
    let mut mac = [0u8; 6];
    for (i, m) in mac.iter_mut().enumerate() {
        *m = byte(i);
    }
    let (host, ifname, sandbox) = match cni {
        Some(c) => (
            host_veth_name(&c.args, &c.container_id, &c.ifname),
            c.ifname.clone(),
            Some(c.netns.clone()),
        ),
        None => ("cali0123456789a".into(), "eth0".into(), None),
    };
    let v4 = Ipv4Addr::new(byte(6), byte(7), byte(8), byte(9));
    let v6 = Ipv6Addr::from(u128::from_le_bytes(std::array::from_fn(|i| byte(10 + i))));
    let v4net = IpNet::V4(Ipv4Net::new(v4, byte(26) % 33).expect("v4 prefix"));
    let v6net = IpNet::V6(Ipv6Net::new(v6, byte(27) % 129).expect("v6 prefix"));
    let gw = IpAddr::V4(Ipv4Addr::new(169, 254, 1, 1));
    AddResult {
        interfaces: vec![
            Interface {
                name: host,
                mac: calix_kernel::pod::HOST_VETH_MAC,
                sandbox: None,
            },
            Interface {
                name: ifname,
                mac,
                sandbox,
            },
        ],
        ips: vec![
            (v4net, gw, 1),
            (v6net, IpAddr::V6(v6), usize::from(byte(28))),
        ],
        routes: vec![(v4net, gw), (v6net, IpAddr::V6(Ipv6Addr::UNSPECIFIED))],
    }
}
