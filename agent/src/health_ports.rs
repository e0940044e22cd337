//! Health check node ports, served when calix replaces kube-proxy (`[services] translate`):
//! for each LoadBalancer Service with `externalTrafficPolicy: Local`, its
//! `healthCheckNodePort` on every address of the node, answering any HTTP GET with whether
//! this node has ready endpoints of it (200) or not (503), in kube-proxy's JSON
//! (`calix_core::services::health`). A load balancer then sends only to nodes that have
//! endpoints. The ports are reconciled with the Services: one listener per port, opened when
//! a Service gets it, closed when none has it; a port that cannot be bound (another process
//! holds it) is said once and tried again at each resync.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::services::ServicesService;

/// How often the ports are compared with the Services without a change (a failed bind is
/// tried again).
const RESYNC: Duration = Duration::from_secs(10);
/// A client has this long to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a request read (its head; the rest is not needed).
const MAX_REQUEST: usize = 8 * 1024;

/// Binds a health check node port on every address of this node: one dual-stack socket on
/// `[::]` (it takes IPv4 too), else `0.0.0.0` where the node has no IPv6.
pub fn bind_all(port: u16) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, port))
        .or_else(|_| std::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port)))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves the health check node ports of `service`'s Services until `changed` closes,
/// binding each with `bind` (the node's addresses: [`bind_all`]).
pub async fn serve<B>(
    service: Arc<ServicesService>,
    mut changed: tokio::sync::watch::Receiver<u64>,
    bind: B,
) where
    B: Fn(u16) -> std::io::Result<std::net::TcpListener>,
{
    let mut open: BTreeMap<u16, JoinHandle<()>> = BTreeMap::new();
    let mut failing: BTreeSet<u16> = BTreeSet::new();
    loop {
        let want = service.health_ports();
        open.retain(|port, task| {
            let keep = want.contains(port);
            if !keep {
                task.abort();
                tracing::info!(port, "health check node port closed");
            }
            keep
        });
        failing.retain(|p| want.contains(p));
        for port in want {
            if open.contains_key(&port) {
                continue;
            }
            match bind(port).and_then(TcpListener::from_std) {
                Ok(l) => {
                    failing.remove(&port);
                    tracing::info!(port, "health check node port open");
                    open.insert(port, tokio::spawn(accept(l, port, service.clone())));
                }
                Err(e) => {
                    if failing.insert(port) {
                        tracing::warn!(port, error = %e, "health check node port cannot be bound; trying again");
                    }
                }
            }
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { break },
            _ = tokio::time::sleep(RESYNC) => {}
        }
    }
    for (_, task) in open {
        task.abort();
    }
}

async fn accept(l: TcpListener, port: u16, service: Arc<ServicesService>) {
    loop {
        match l.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(answer(stream, port, service.clone()));
            }
            Err(e) => {
                tracing::debug!(port, error = %e, "health check node port: accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Reads the request's head (whatever its path, as kube-proxy) and answers.
async fn answer(mut stream: TcpStream, port: u16, service: Arc<ServicesService>) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if read != Ok(true) {
        return;
    }
    let response = match service.health_answer(port) {
        Some((status, body, count)) => response(status, &body, Some(count)),
        None => response(404, "", None),
    };
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// An HTTP/1.1 response with `body` (JSON), closing the connection.
fn response(status: u16, body: &str, endpoints: Option<usize>) -> String {
    let reason = match status {
        200 => "OK",
        503 => "Service Unavailable",
        _ => "Not Found",
    };
    let weight = endpoints
        .map(|n| format!("X-Load-Balancing-Endpoint-Weight: {n}\r\n"))
        .unwrap_or_default();
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n\
         X-Content-Type-Options: nosniff\r\n{weight}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_core::services::admit::Admission;
    use calix_core::services::model::{
        AddressType, Distribution, Endpoint, EndpointSlice, Protocol, Service, ServiceKey,
        ServicePort, SlicePort, TrafficPolicy,
    };
    use calix_core::services::state::{Change, Limits};

    fn lb(port: u16) -> Service {
        Service {
            key: ServiceKey {
                namespace: "shop".into(),
                name: "lb".into(),
            },
            cluster_ips: vec!["10.96.0.20".parse().expect("ip")],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: Some(30080),
            }],
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            affinity_secs: None,
            external_policy: TrafficPolicy::Local,
            internal_policy: TrafficPolicy::Cluster,
            distribution: Distribution::Any,
            health_check_node_port: Some(port),
        }
    }

    fn slice(ready: bool) -> EndpointSlice {
        EndpointSlice {
            name: "shop/lb-1".into(),
            service: lb(0).key,
            address_type: AddressType::V4,
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: Some(8080),
            }],
            endpoints: vec![Endpoint {
                addresses: vec!["10.244.1.5".parse().expect("ip")],
                ready,
                serving: true,
                terminating: !ready,
                node: Some("n1".into()),
                zone: None,
                for_zones: Vec::new(),
                for_nodes: Vec::new(),
            }],
        }
    }

    /// `GET /healthz` on 127.0.0.1:`port`: the status and the body; `None`: refused.
    async fn get(port: u16) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        let status = out.get(9..12)?.parse().ok()?;
        let (_, body) = out.split_once("\r\n\r\n")?;
        Some((status, body.to_string()))
    }

    async fn until(port: u16, want: Option<u16>) -> Option<(u16, String)> {
        for _ in 0..100 {
            let got = get(port).await;
            if got.as_ref().map(|g| g.0) == want {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("port {port} never answered {want:?}");
    }

    #[tokio::test]
    async fn a_port_follows_its_service_and_says_whether_this_node_has_endpoints() {
        // A port free now (the Service's healthCheckNodePort), on loopback.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let service = Arc::new(ServicesService::new(
            "n1",
            None,
            Admission::default(),
            Limits {
                frontends: 100,
                backends: 100,
            },
        ));
        service.set_ready();
        let (tx, rx) = tokio::sync::watch::channel(0u64);
        let task = tokio::spawn(serve(service.clone(), rx, |p| {
            let l = std::net::TcpListener::bind(("127.0.0.1", p))?;
            l.set_nonblocking(true)?;
            Ok(l)
        }));
        assert_eq!(get(port).await, None, "no Service has the port yet");

        service.apply(Change::Service(lb(port)));
        tx.send_modify(|n| *n += 1);
        let (status, body) = until(port, Some(503)).await.expect("an answer");
        assert_eq!(
            body,
            r#"{"service":{"namespace":"shop","name":"lb"},"localEndpoints":0,"serviceProxyHealthy":true}"#
        );
        assert_eq!(status, 503, "no endpoint here");

        service.apply(Change::Slice(slice(true)));
        let (_, body) = until(port, Some(200)).await.expect("an answer");
        assert!(body.contains(r#""localEndpoints":1"#), "{body}");

        service.apply(Change::Slice(slice(false)));
        until(port, Some(503)).await;
        // (Answers follow the state at once: no change signal was needed for those.)

        service.apply(Change::ServiceGone(lb(port).key));
        tx.send_modify(|n| *n += 1);
        until(port, None).await;
        drop(tx);
        task.await.expect("serve ends when the changes end");
    }

    #[test]
    fn the_response_is_http() {
        let r = response(503, "{}", Some(0));
        assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{r}");
        assert!(r.contains("Content-Type: application/json\r\n"), "{r}");
        assert!(r.contains("X-Load-Balancing-Endpoint-Weight: 0\r\n"), "{r}");
        assert!(
            r.ends_with("Content-Length: 2\r\nConnection: close\r\n\r\n{}"),
            "{r}"
        );
    }
}
