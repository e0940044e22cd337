//! What several test files share: a client of an agent's IPAM gRPC API, allocations in bulk,
//! and calixctl's IPAM reports; route-distribution certificates through the API
//! ([`certs`]); floods of idle connections ([`flood`]); BGP routers ([`bird`], [`frr`]) and
//! raw BGP peers ([`raw_bgp`]); the Services tests' node ([`services`]).
//! (Each test file is its own crate and uses part of it.)
#![allow(dead_code)]

pub mod bird;
pub mod certs;
pub mod flood;
pub mod frr;
pub mod raw_bgp;
pub mod services;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use calix_proto::v1 as pb;
use calix_testbed::Node;
use serde_json::Value;

pub type Client = pb::ipam_client::IpamClient<tonic::transport::Channel>;

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

pub async fn client(node: &Node) -> Client {
    // Generous: callers wait out the agent's retries while its datastore (etcd, the API
    // server) restarts.
    let ch = calix_proto::connect_unix(&node.socket, Duration::from_secs(120))
        .await
        .expect("connect to agent");
    pb::ipam_client::IpamClient::new(ch)
}

pub async fn allocate(mut c: Client, handle: String) -> Result<IpAddr, tonic::Status> {
    let r = c
        .allocate(pb::AllocateRequest {
            handle,
            ifname: "eth0".into(),
            ipv4: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    let a = &r.addresses[0].address;
    Ok(a.split('/').next().unwrap_or(a).parse().expect("address"))
}

pub async fn release(mut c: Client, handle: String) {
    c.release(pb::ReleaseRequest {
        handle: handle.clone(),
        ifname: "eth0".into(),
    })
    .await
    .unwrap_or_else(|e| panic!("release {handle}: {e}"));
}

/// `n` allocations with handles `net.<tag>-<i>`, `in_flight` at a time; each result in order.
pub async fn allocate_many(
    c: &Client,
    tag: &str,
    n: usize,
    in_flight: usize,
) -> Vec<(String, Result<IpAddr, tonic::Status>)> {
    let sem = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let mut tasks = Vec::new();
    for i in 0..n {
        let handle = format!("net.{tag}-{i}");
        let c = c.clone();
        let sem = sem.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore");
            let r = allocate(c, handle.clone()).await;
            (handle, r)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("join"));
    }
    out
}

/// An `IPPool` object.
pub fn ipam_json(node: &Node, what: &str) -> Value {
    let out = node.calixctl(&["ipam", what, "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "calixctl ipam {what}: {e}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

pub fn findings_of(report: &Value, kind: &str) -> Vec<Value> {
    report["findings"]
        .as_array()
        .map(|f| f.iter().filter(|x| x["kind"] == kind).cloned().collect())
        .unwrap_or_default()
}
