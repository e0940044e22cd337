//! Prometheus `/metrics` over plain HTTP/1.x: endpoint traffic counters, eBPF drop counters by
//! reason, IPAM free addresses. A tiny hand-written responder (one GET, then close) keeps the
//! agent free of an HTTP server stack.
use std::fmt::Write as _;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::agent::Agent;

/// Renders the metrics text.
pub async fn render(agent: &Agent) -> String {
    let mut out = String::new();
    let node = agent.node();
    let _ = writeln!(
        out,
        "# HELP calix_endpoints Endpoints on this node.\n# TYPE calix_endpoints gauge"
    );
    let eps = agent.list().await.unwrap_or_default();
    let _ = writeln!(out, "calix_endpoints{{node=\"{node}\"}} {}", eps.len());
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
    let drops = agent.drops().await.unwrap_or_default();
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
    let (v4, v6) = agent.free().await;
    let _ = writeln!(
        out,
        "# HELP calix_ipam_free_addresses Addresses this node can still allocate.\n# TYPE calix_ipam_free_addresses gauge\ncalix_ipam_free_addresses{{family=\"ipv4\"}} {v4}\ncalix_ipam_free_addresses{{family=\"ipv6\"}} {v6}"
    );
    out
}

/// Serves `/metrics` on `addr` until the process exits. A bind failure is logged, not fatal.
pub fn spawn(agent: Arc<Agent>, addr: String) {
    tokio::spawn(async move {
        let listener = match TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(%addr, error = %e, "cannot serve /metrics");
                return;
            }
        };
        tracing::info!(%addr, "serving /metrics");
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let agent = agent.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = match tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.read(&mut buf),
                )
                .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let req = String::from_utf8_lossy(&buf[..n]);
                let (status, body) = if req.starts_with("GET /metrics") {
                    ("200 OK", render(&agent).await)
                } else {
                    ("404 Not Found", "try GET /metrics\n".to_string())
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
}
