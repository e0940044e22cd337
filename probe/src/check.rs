//! The client's check: wait for the echo DaemonSet to be ready everywhere, then reach every
//! server pod. The decisions (is it ready, who are the targets, is an address calix's) are
//! pure functions of the API's JSON, tested without a cluster.
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use serde_json::Value;

use crate::api::{Api, ApiError};
use crate::echo;

/// One echo server pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub pod: String,
    pub node: String,
    pub ip: IpAddr,
}

/// Where the servers stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Every pod the DaemonSet wants is ready and has an address.
    Ready(Vec<Target>),
    Waiting(String),
}

/// From the DaemonSet and the list of its pods (label-selected).
pub fn readiness(daemonset: &Value, pods: &Value) -> Readiness {
    let status = &daemonset["status"];
    let desired = status["desiredNumberScheduled"].as_u64().unwrap_or(0);
    let ready = status["numberReady"].as_u64().unwrap_or(0);
    let generation = daemonset["metadata"]["generation"].as_u64();
    let observed = status["observedGeneration"].as_u64();
    if desired == 0 || generation.is_none() || generation != observed {
        return Readiness::Waiting(format!(
            "the DaemonSet has scheduled no pod yet (desired {desired})"
        ));
    }
    let mut targets = Vec::new();
    for pod in pods["items"].as_array().into_iter().flatten() {
        if pod["metadata"]["deletionTimestamp"].is_string() {
            continue;
        }
        let is_ready = pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        let ip = pod["status"]["podIP"]
            .as_str()
            .and_then(|s| s.parse::<IpAddr>().ok());
        if let (true, Some(ip)) = (is_ready, ip) {
            targets.push(Target {
                pod: pod["metadata"]["name"].as_str().unwrap_or("?").to_string(),
                node: pod["spec"]["nodeName"].as_str().unwrap_or("?").to_string(),
                ip,
            });
        }
    }
    if ready < desired || (targets.len() as u64) < desired {
        return Readiness::Waiting(format!(
            "{} of {desired} echo pods ready with an address",
            targets.len().min(ready as usize)
        ));
    }
    targets.sort_by(|a, b| a.node.cmp(&b.node).then(a.pod.cmp(&b.pod)));
    Readiness::Ready(targets)
}

/// Whether `ip` is in one of `pools` (no pools given: anything goes).
pub fn in_pools(ip: IpAddr, pools: &[IpNet]) -> bool {
    pools.is_empty() || pools.iter().any(|p| p.contains(&ip))
}

/// What the check is given.
#[derive(Debug, Clone)]
pub struct Plan {
    pub namespace: String,
    pub daemonset: String,
    /// A label selector for the DaemonSet's pods.
    pub selector: String,
    pub port: u16,
    pub pools: Vec<IpNet>,
    /// This pod's own address (downward API), checked against the pools too.
    pub own_ip: Option<IpAddr>,
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("this pod's address {ip} is in none of the calix pools {pools:?}")]
    OwnAddress { ip: IpAddr, pools: Vec<IpNet> },
    #[error("the echo servers were not ready within {timeout:?}: {last}")]
    NotReady { timeout: Duration, last: String },
    #[error("the Kubernetes API")]
    Api(#[from] ApiError),
    #[error("{failed} of {total} echo pods failed the check")]
    Failed { failed: usize, total: usize },
}

/// Runs the check, printing one line per step; `Ok` when every server answered.
pub async fn run(api: &Api, plan: &Plan) -> Result<usize, CheckError> {
    if let Some(ip) = plan.own_ip {
        if !in_pools(ip, &plan.pools) {
            return Err(CheckError::OwnAddress {
                ip,
                pools: plan.pools.clone(),
            });
        }
        println!("this pod: {ip}");
    }
    let deadline = Instant::now() + plan.timeout;
    let ds_path = format!(
        "/apis/apps/v1/namespaces/{}/daemonsets/{}",
        plan.namespace, plan.daemonset
    );
    let pods_path = format!(
        "/api/v1/namespaces/{}/pods?labelSelector={}",
        plan.namespace,
        encode(&plan.selector)
    );
    let mut last = String::new();
    let targets = loop {
        // A transient API error (it may restart) is a reason to wait, not to fail.
        let state = match (api.get(&ds_path).await, api.get(&pods_path).await) {
            (Ok(ds), Ok(pods)) => readiness(&ds, &pods),
            (Err(e), _) | (_, Err(e)) => Readiness::Waiting(calix_log::error_chain(&e)),
        };
        match state {
            Readiness::Ready(t) => break t,
            Readiness::Waiting(why) => {
                if why != last {
                    println!("waiting: {why}");
                    last = why;
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(CheckError::NotReady {
                timeout: plan.timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let mut failed = 0;
    for (i, t) in targets.iter().enumerate() {
        let token = format!("calix-probe {} {} {i}", std::process::id(), t.pod);
        let addr = SocketAddr::new(t.ip, plan.port);
        if !in_pools(t.ip, &plan.pools) {
            println!(
                "FAIL {} on {}: {} is in none of the pools {:?}",
                t.pod, t.node, t.ip, plan.pools
            );
            failed += 1;
            continue;
        }
        // A few tries: a server just marked ready may still be settling.
        let mut result = Err(None);
        for _ in 0..3 {
            match echo::exchange(addr, &token, Duration::from_secs(5)).await {
                Ok(rtt) => {
                    result = Ok(rtt);
                    break;
                }
                Err(e) => result = Err(Some(e)),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        match result {
            Ok(rtt) => println!("ok   {} on {}: {addr} answered in {rtt:?}", t.pod, t.node),
            Err(e) => {
                failed += 1;
                let why = e.map(|e| calix_log::error_chain(&e)).unwrap_or_default();
                println!("FAIL {} on {}: {why}", t.pod, t.node);
            }
        }
    }
    if failed > 0 {
        return Err(CheckError::Failed {
            failed,
            total: targets.len(),
        });
    }
    Ok(targets.len())
}

/// Percent-encodes a label selector for a query string.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ds(desired: u64, ready: u64) -> Value {
        json!({"metadata": {"generation": 2},
               "status": {"observedGeneration": 2, "desiredNumberScheduled": desired, "numberReady": ready}})
    }

    fn pod(name: &str, node: &str, ip: Option<&str>, ready: bool) -> Value {
        json!({"metadata": {"name": name}, "spec": {"nodeName": node},
               "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}})
    }

    #[test]
    fn ready_only_when_every_wanted_pod_is_ready_with_an_address() {
        let pods = json!({"items": [pod("b", "n2", Some("10.244.1.5"), true),
                                     pod("a", "n1", Some("10.244.0.7"), true)]});
        match readiness(&ds(2, 2), &pods) {
            Readiness::Ready(t) => {
                assert_eq!(t.len(), 2);
                assert_eq!((t[0].pod.as_str(), t[0].node.as_str()), ("a", "n1"));
                assert_eq!(t[1].ip, "10.244.1.5".parse::<IpAddr>().expect("ip"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(readiness(&ds(3, 2), &pods), Readiness::Waiting(_)));
        assert!(matches!(readiness(&ds(0, 0), &pods), Readiness::Waiting(_)));
        let unready = json!({"items": [pod("a", "n1", Some("10.244.0.7"), true),
                                        pod("b", "n2", None, true)]});
        assert!(matches!(
            readiness(&ds(2, 2), &unready),
            Readiness::Waiting(_)
        ));
        let mut stale = ds(2, 2);
        stale["status"]["observedGeneration"] = json!(1);
        assert!(matches!(readiness(&stale, &pods), Readiness::Waiting(_)));
    }

    #[test]
    fn pool_membership_and_selector_encoding() {
        let pools: Vec<IpNet> = vec!["10.244.0.0/16".parse().expect("cidr")];
        assert!(in_pools("10.244.3.4".parse().expect("ip"), &pools));
        assert!(!in_pools("192.0.2.1".parse().expect("ip"), &pools));
        assert!(in_pools("192.0.2.1".parse().expect("ip"), &[]));
        assert_eq!(
            encode("app.kubernetes.io/name=calix,x=y"),
            "app.kubernetes.io%2Fname%3Dcalix%2Cx%3Dy"
        );
    }
}
