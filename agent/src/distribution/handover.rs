//! What route distribution hands on: the desired routes to the reconciler, the other nodes to
//! the dataplane's doors ([`RouteSink`]), each on a task of its own, the latest set winning.
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_core::reconcile::remote::RemoteRoute;
use tokio::sync::watch;

use crate::reconcile::driver::{Driver, DriverError};
use calix_dataplane::doors::PeerNodes;
use calix_dataplane::DataplaneError;

/// Why a hand-over did not take (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("the reconciler did not answer")]
    Driver(#[from] DriverError),
    #[error("the dataplane refused it")]
    Dataplane(#[from] DataplaneError),
}

/// Where the desired routes go: the reconciler ([`Driver`]), or a fake in tests; and who the
/// other nodes are (the dataplane closes the agents' ports on their addresses to pods).
#[tonic::async_trait]
pub trait RouteSink: Send + Sync + 'static {
    async fn set_remote_routes(
        &self,
        routes: Vec<RemoteRoute>,
        complete: bool,
    ) -> Result<(), HandoverError>;

    async fn set_peer_nodes(&self, peers: PeerNodes) -> Result<(), HandoverError>;
}

#[tonic::async_trait]
impl RouteSink for Driver {
    async fn set_remote_routes(
        &self,
        routes: Vec<RemoteRoute>,
        complete: bool,
    ) -> Result<(), HandoverError> {
        Ok(Driver::set_remote_routes(self, routes, complete).await?)
    }

    async fn set_peer_nodes(&self, peers: PeerNodes) -> Result<(), HandoverError> {
        Ok(Driver::set_peer_nodes(self, peers).await?)
    }
}

/// A desired set, shared (not copied) between the loop, the hand-over and the report.
pub(crate) type Desired = Arc<Vec<RemoteRoute>>;

/// The last set the reconciler took: routes, complete, when.
pub(crate) type Handed = Arc<Mutex<Option<(Desired, bool, Instant)>>>;

/// The other nodes of `view` (all but `me`): their addresses and their Routes ports.
pub(super) fn peer_nodes(view: &calix_core::routes::view::View, me: &str) -> PeerNodes {
    let mut out = PeerNodes::default();
    for n in view.nodes().filter(|n| n.record.name != me) {
        out.addresses.extend(n.addresses.iter().copied());
        if let Ok(sa) = n.record.routes_endpoint.parse::<std::net::SocketAddr>() {
            out.routes_ports.insert(sa.port());
        }
    }
    out
}

/// Hands each new set of other nodes to the dataplane; a failure is retried every second
/// with the latest set.
pub(super) async fn hand_peers(
    sink: Arc<dyn RouteSink>,
    mut rx: watch::Receiver<Option<PeerNodes>>,
) {
    loop {
        let Some(peers) = rx.borrow_and_update().clone() else {
            if rx.changed().await.is_err() {
                return;
            }
            continue;
        };
        match sink.set_peer_nodes(peers).await {
            Ok(()) => {
                if rx.changed().await.is_err() {
                    return;
                }
            }
            Err(e) => {
                let e = calix_log::error_chain(&e);
                tracing::warn!(error = %e, "routes: the dataplane did not take the other nodes' addresses (doors); retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Hands each new desired set to the reconciler; a failure is retried every second with the
/// latest set.
pub(crate) async fn hand_over(
    sink: Arc<dyn RouteSink>,
    mut rx: watch::Receiver<Option<(Desired, bool)>>,
    handed: Handed,
) {
    loop {
        let Some((routes, complete)) = rx.borrow_and_update().clone() else {
            if rx.changed().await.is_err() {
                return;
            }
            continue;
        };
        let asked = Instant::now();
        match sink.set_remote_routes(routes.to_vec(), complete).await {
            Ok(()) => {
                tracing::debug!(routes = routes.len(), complete, took = ?asked.elapsed(),
                    "routes: the reconciler took the desired routes");
                *handed.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((routes, complete, Instant::now()));
                if rx.changed().await.is_err() {
                    return;
                }
            }
            Err(e) => {
                let e = calix_log::error_chain(&e);
                tracing::warn!(error = %e, "routes: the reconciler did not take the desired routes; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_core::routes::view::fixtures::node_kv;
    use calix_core::routes::view::{Part, View};
    use std::net::IpAddr;

    #[test]
    fn the_other_nodes_are_every_recorded_node_but_this_one() {
        let mut v = View::default();
        v.replace(
            Part::Nodes,
            vec![
                node_kv("a", &["192.0.2.1", "fd00::1"], false),
                node_kv("b", &["192.0.2.2", "fd00::2"], false),
                node_kv("c", &["192.0.2.3"], true),
            ],
        );
        let p = peer_nodes(&v, "a");
        let want: std::collections::BTreeSet<IpAddr> = ["192.0.2.2", "fd00::2", "192.0.2.3"]
            .iter()
            .map(|a| a.parse().expect("ip"))
            .collect();
        assert_eq!(p.addresses, want);
        assert_eq!(p.routes_ports, [5474].into());
        assert_eq!(peer_nodes(&View::default(), "a"), PeerNodes::default());
    }
}
