//! The agent's HTTP door: Prometheus `/metrics` (endpoint traffic counters, eBPF drop counters
//! by reason, IPAM free addresses, route distribution), `/healthz` and `/readyz` (200 once the initial sync is
//! done, 503 before). A tiny hand-written responder (one GET, then close) keeps the agent free
//! of an HTTP server stack; it caps connections, bounds reads and writes in time and size,
//! backs off when accept fails, and renders from the agent's snapshots (the endpoints lock is
//! held only to copy the registry, never while maps are read or text is built).
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::pod_network::Node;
use crate::prometheus::label_value;
use crate::reconcile::Health;

/// Renders the metrics text.
pub async fn render(node: &Node) -> String {
    let mut out = String::new();
    let name = node.name();
    let _ = writeln!(
        out,
        "# HELP calix_endpoints Endpoints on this node.\n# TYPE calix_endpoints gauge"
    );
    let eps = node.endpoints.list().await.unwrap_or_default();
    let _ = writeln!(out, "calix_endpoints{{node=\"{name}\"}} {}", eps.len());
    let _ = writeln!(
        out,
        "# HELP calix_endpoint_packets_total Packets through an endpoint's host veth.\n# TYPE calix_endpoint_packets_total counter"
    );
    let mut bytes = String::new();
    for e in &eps {
        let Some(c) = e.counters else { continue };
        let iface = &e.record.host_ifname;
        for (dir, p, b) in [
            ("from_pod", c.from_pod_packets, c.from_pod_bytes),
            ("to_pod", c.to_pod_packets, c.to_pod_bytes),
        ] {
            let _ = writeln!(
                out,
                "calix_endpoint_packets_total{{interface=\"{iface}\",direction=\"{dir}\"}} {p}"
            );
            let _ = writeln!(
                bytes,
                "calix_endpoint_bytes_total{{interface=\"{iface}\",direction=\"{dir}\"}} {b}"
            );
        }
    }
    let _ = writeln!(out, "# HELP calix_endpoint_bytes_total Bytes through an endpoint's host veth.\n# TYPE calix_endpoint_bytes_total counter");
    out.push_str(&bytes);
    let _ = writeln!(
        out,
        "# HELP calix_drops_total Packets the eBPF dataplane dropped, by interface and reason.\n# TYPE calix_drops_total counter"
    );
    let drops = node.endpoints.drops().await.unwrap_or_default();
    let mut drop_bytes = String::new();
    for d in &drops {
        let iface = d
            .ifname
            .clone()
            .unwrap_or_else(|| format!("ifindex{}", d.ifindex));
        let _ = writeln!(
            out,
            "calix_drops_total{{interface=\"{iface}\",reason=\"{}\"}} {}",
            d.reason, d.packets
        );
        let _ = writeln!(
            drop_bytes,
            "calix_drop_bytes_total{{interface=\"{iface}\",reason=\"{}\"}} {}",
            d.reason, d.bytes
        );
    }
    let _ = writeln!(out, "# HELP calix_drop_bytes_total Bytes the eBPF dataplane dropped.\n# TYPE calix_drop_bytes_total counter");
    out.push_str(&drop_bytes);
    let _ = writeln!(
        out,
        "# HELP calix_policy_denied_packets_total Packets NetworkPolicy denied, by endpoint and direction (both dataplanes; kernel mode from its nftables counters).\n# TYPE calix_policy_denied_packets_total counter"
    );
    for (iface, pod, ingress, egress) in node.endpoints.policy_denied().await {
        let pod = label_value(pod.as_deref().unwrap_or(""));
        for (dir, n) in [("ingress", ingress), ("egress", egress)] {
            let _ = writeln!(
                out,
                "calix_policy_denied_packets_total{{interface=\"{iface}\",pod=\"{pod}\",direction=\"{dir}\"}} {n}"
            );
        }
    }
    let (v4, v6) = node.ipam.free().await;
    let _ = writeln!(
        out,
        "# HELP calix_ipam_free_addresses Addresses this node can still allocate.\n# TYPE calix_ipam_free_addresses gauge\ncalix_ipam_free_addresses{{family=\"ipv4\"}} {v4}\ncalix_ipam_free_addresses{{family=\"ipv6\"}} {v6}"
    );
    out.push_str(&crate::ipam::service::report::ignored_metrics(
        &node.ipam.ignored().await,
    ));
    out.push_str(&crate::ipam::service::report::retained_metrics(
        node.ipam.retained().len(),
    ));
    let _ = writeln!(
        out,
        "# HELP calix_repairs_total Drift the reconciler found and repaired, by kind.\n# TYPE calix_repairs_total counter"
    );
    let rec = node.endpoints.reconciler().await;
    for (kind, n) in &rec.repairs {
        let _ = writeln!(out, "calix_repairs_total{{kind=\"{kind}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP calix_resyncs_total Full passes of the reconciler over every endpoint.\n# TYPE calix_resyncs_total counter\ncalix_resyncs_total {}",
        rec.resyncs
    );
    let unhealthy = eps
        .iter()
        .filter(|e| e.health.as_ref().is_some_and(|h| *h != Health::Ok))
        .count();
    let _ = writeln!(
        out,
        "# HELP calix_endpoints_not_ok Endpoints not in their desired state (calixctl endpoints says why).\n# TYPE calix_endpoints_not_ok gauge\ncalix_endpoints_not_ok {unhealthy}"
    );
    let _ = writeln!(
        out,
        "# HELP calix_node_not_ok 1 while the node's own objects (forwarding, nftables tables) cannot be brought to their desired state (the agent's log says why).\n# TYPE calix_node_not_ok gauge\ncalix_node_not_ok {}",
        u8::from(rec.node_error.is_some())
    );
    let _ = writeln!(
        out,
        "# HELP calix_routes_not_ok 1 while the routes to other nodes (and their VXLAN devices) cannot be brought to their desired state (the agent's log says why).\n# TYPE calix_routes_not_ok gauge\ncalix_routes_not_ok {}",
        u8::from(rec.routes_error.is_some())
    );
    let _ = writeln!(
        out,
        "# HELP calix_routes_not_programmed Desired routes to other nodes that cannot be programmed as asked (a next hop of another family, off every subnet with vxlan = never...; logged).\n# TYPE calix_routes_not_programmed gauge\ncalix_routes_not_programmed {}",
        rec.route_problems.len()
    );
    out
}

/// What the HTTP door knows: the agent once it exists, and whether its initial sync is done.
#[derive(Default)]
pub struct HttpState {
    node: std::sync::OnceLock<Arc<Node>>,
    /// Route distribution, when it runs.
    routes: std::sync::OnceLock<Arc<crate::distribution::RoutesHandle>>,
    /// The BGP speaker, when it runs.
    bgp: std::sync::OnceLock<Arc<crate::bgp::speaker::BgpHandle>>,
    /// NetworkPolicy, when it is followed (Kubernetes mode).
    policy: std::sync::OnceLock<Arc<crate::policy::PolicyService>>,
    services: std::sync::OnceLock<Arc<crate::services::ServicesService>>,
    ready: std::sync::atomic::AtomicBool,
    refused: std::sync::atomic::AtomicU64,
}

impl HttpState {
    /// The initial sync is done: /metrics, /healthz and /readyz answer from now on.
    pub fn set_ready(&self, node: Arc<Node>) {
        let _ = self.node.set(node);
        self.ready.store(true, Ordering::Release);
    }

    /// Route distribution's metrics from now on.
    pub fn set_routes(&self, routes: Arc<crate::distribution::RoutesHandle>) {
        let _ = self.routes.set(routes);
    }

    /// The BGP speaker's metrics from now on.
    pub fn set_bgp(&self, bgp: Arc<crate::bgp::speaker::BgpHandle>) {
        let _ = self.bgp.set(bgp);
    }

    /// NetworkPolicy's metrics from now on.
    pub fn set_policy(&self, policy: Arc<crate::policy::PolicyService>) {
        let _ = self.policy.set(policy);
    }

    /// The Services calculation's metrics from now on.
    pub fn set_services(&self, services: Arc<crate::services::ServicesService>) {
        let _ = self.services.set(services);
    }

    fn node(&self) -> Option<&Arc<Node>> {
        self.ready
            .load(Ordering::Acquire)
            .then(|| self.node.get())
            .flatten()
    }
}

/// Limits of the HTTP door: nothing a scraper (or anyone who can reach the port) does may cost
/// the agent more than this.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections served at once; more are closed at once (and counted).
    pub max_connections: usize,
    /// Time to send the request head.
    pub read_timeout: Duration,
    /// Time to take the response.
    pub write_timeout: Duration,
    /// Largest request head read.
    pub max_request_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 16,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            max_request_bytes: 8192,
        }
    }
}

/// First pause after a failed accept (EMFILE...); doubles up to [`MAX_ACCEPT_BACKOFF`].
const FIRST_ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until the process exits. Before the
/// initial sync every path answers 503. A bind failure is logged, not fatal.
pub fn spawn(state: Arc<HttpState>, addr: String, limits: HttpLimits) {
    tokio::spawn(async move {
        let listener = match TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(%addr, error = %e, "cannot serve /metrics");
                return;
            }
        };
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
        let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
        let mut backoff = FIRST_ACCEPT_BACKOFF;
        loop {
            let sock = match listener.accept().await {
                Ok((sock, _)) => {
                    backoff = FIRST_ACCEPT_BACKOFF;
                    sock
                }
                Err(e) => {
                    // Out of descriptors or memory: wait, don't spin.
                    tracing::warn!(error = %e, ?backoff, "accept on the metrics port failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                state.refused.fetch_add(1, Ordering::Relaxed);
                drop(sock);
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                serve_one(sock, &state, limits).await;
                drop(permit);
            });
        }
    });
}

/// One request, then close.
async fn serve_one(mut sock: tokio::net::TcpStream, state: &HttpState, limits: HttpLimits) {
    let Ok(Some(head)) = tokio::time::timeout(
        limits.read_timeout,
        read_head(&mut sock, limits.max_request_bytes),
    )
    .await
    else {
        return;
    };
    let path = head
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("GET "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("");
    let node = state.node();
    let (status, body) = match (path, node) {
        ("/metrics" | "/healthz" | "/readyz", None) => (
            "503 Service Unavailable",
            "initial sync not done\n".to_string(),
        ),
        ("/metrics", Some(node)) => {
            let mut body = render(node).await;
            if let Some(routes) = state.routes.get() {
                body.push_str(&routes.metrics().await);
            }
            if let Some(bgp) = state.bgp.get() {
                body.push_str(&bgp.metrics().await);
            }
            if let Some(policy) = state.policy.get() {
                body.push_str(&policy.metrics());
            }
            if let Some(services) = state.services.get() {
                body.push_str(&services.metrics());
            }
            let _ = writeln!(
                body,
                "# HELP calix_http_refused_total Connections to this port closed at once: too many open.\n# TYPE calix_http_refused_total counter\ncalix_http_refused_total {}",
                state.refused.load(Ordering::Relaxed)
            );
            ("200 OK", body)
        }
        ("/healthz" | "/readyz", Some(_)) => ("200 OK", "ok\n".to_string()),
        _ => (
            "404 Not Found",
            "GET /metrics, /healthz or /readyz\n".to_string(),
        ),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(limits.write_timeout, async {
        sock.write_all(resp.as_bytes()).await?;
        sock.shutdown().await
    })
    .await;
}

/// Reads until the end of the request head (an empty line), at most `max` bytes; `None` when
/// the peer closes first or sends more.
async fn read_head(sock: &mut tokio::net::TcpStream, max: usize) -> Option<String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Some(String::from_utf8_lossy(&buf).into_owned());
        }
        if buf.len() > max {
            return None;
        }
    }
}
