//! The e2e checks' web pods (busybox httpd answering its pod's name), their Services, and
//! their removal.
use std::time::Duration;

use anyhow::{bail, Context, Result};
use calix_testbed::kubelet::web_pod;
use serde_json::json;

use super::{wait, HOST_PORT};
use crate::cluster::{E2eCluster, POOL};
use crate::Mode;

pub(super) struct WebPod {
    pub(super) name: String,
    pub(super) node: usize,
    pub(super) ip: String,
    pub(super) netns: String,
    pub(super) host_port: bool,
}

/// The web pods (busybox httpd answering its pod's name) and their Service.
pub(super) struct Web {
    pub(super) pods: Vec<WebPod>,
    pub(super) service: String,
    pub(super) cluster_ip: String,
    /// The same pods behind a Service with `internalTrafficPolicy: Local`.
    pub(super) local_ip: String,
    /// The NodePort of a NodePort Service of the same pods (`externalTrafficPolicy: Cluster`),
    /// and of one with `Local`.
    pub(super) node_port: u16,
    pub(super) node_port_local: u16,
}

impl Web {
    pub(super) fn create(c: &E2eCluster, mode: Mode) -> Result<Self> {
        let api = &c.api;
        let app = format!("e2e-web-{}", mode.value());
        // (node, hostPort): two on node 0 (one with the hostPort), one on node 1.
        let layout = [(0, true), (1, true), (0, false)];
        let names: Vec<String> = (0..layout.len()).map(|i| format!("{app}-{i}")).collect();
        for (name, (node, host_port)) in names.iter().zip(layout) {
            api.apply(web_pod(
                name,
                c.name(node),
                json!({"app": app}),
                host_port.then_some(HOST_PORT),
            ))?;
        }
        let svc = api.apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": app, "namespace": "default"},
            "spec": {"selector": {"app": app}, "ports": [{"port": 80, "targetPort": 8080}]},
        }))?;
        let cluster_ip = svc["spec"]["clusterIP"]
            .as_str()
            .context("the Service's clusterIP")?
            .to_string();
        let local = api.apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("{app}-local"), "namespace": "default"},
            "spec": {"selector": {"app": app}, "ports": [{"port": 80, "targetPort": 8080}],
                "internalTrafficPolicy": "Local"},
        }))?;
        let local_ip = local["spec"]["clusterIP"]
            .as_str()
            .context("the Local Service's clusterIP")?
            .to_string();
        let node_port = |suffix: &str, policy: &str| -> Result<u16> {
            let svc = api.apply(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("{app}-{suffix}"), "namespace": "default"},
                "spec": {"type": "NodePort", "selector": {"app": app},
                    "ports": [{"port": 80, "targetPort": 8080}],
                    "externalTrafficPolicy": policy},
            }))?;
            svc["spec"]["ports"][0]["nodePort"]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .with_context(|| format!("the {policy} NodePort Service's nodePort"))
        };
        let node_port_local = node_port("np-local", "Local")?;
        let node_port = node_port("np", "Cluster")?;
        let running = wait(
            c,
            "the web pods Running with addresses",
            Duration::from_secs(120),
            || {
                let p = api.list("v1", "Pod", &format!("app={app}"))?;
                Ok((p.len() == names.len()
                    && p.iter().all(|p| {
                        p["status"]["phase"] == "Running" && p["status"]["podIP"].is_string()
                    }))
                .then_some(p))
            },
        )?;
        let pool: ipnet::Ipv4Net = POOL.parse()?;
        let mut pods = Vec::new();
        for (name, (node, host_port)) in names.iter().zip(layout) {
            let p = running
                .iter()
                .find(|p| p["metadata"]["name"] == name.as_str())
                .context("a web pod")?;
            let ip = p["status"]["podIP"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let addr: std::net::Ipv4Addr = ip.parse().with_context(|| format!("podIP {ip}"))?;
            if !pool.contains(&addr) {
                bail!("{name}'s podIP {ip} is not in calix's pool {POOL}");
            }
            let netns = c.kubes[node]
                .pod_netns("default", name)
                .with_context(|| format!("no sandbox namespace for {name}"))?;
            pods.push(WebPod {
                name: name.clone(),
                node,
                ip,
                netns,
                host_port,
            });
        }
        Ok(Self {
            pods,
            service: app,
            cluster_ip,
            local_ip,
            node_port,
            node_port_local,
        })
    }

    /// Deletes the pods and the Service; until the pods are gone from the API.
    pub(super) fn delete(self, c: &E2eCluster) -> Result<()> {
        for w in &self.pods {
            c.api.delete_in("v1", "Pod", "default", &w.name)?;
        }
        c.api.delete_in("v1", "Service", "default", &self.service)?;
        for suffix in ["local", "np", "np-local"] {
            c.api.delete_in(
                "v1",
                "Service",
                "default",
                &format!("{}-{suffix}", self.service),
            )?;
        }
        wait(c, "the web pods gone", Duration::from_secs(60), || {
            let left = c.api.list("v1", "Pod", &format!("app={}", self.service))?;
            Ok(left.is_empty().then_some(()))
        })
    }
}
