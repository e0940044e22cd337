//! Two sources of routes to other nodes' pods share the reconciler: route distribution (the
//! agents' gRPC mesh) and the BGP speaker (the data centre's routers). Each hands over its
//! whole set as it changes ([`RouteSink`]); the reconciler gets their union (a prefix both
//! know goes the way route distribution says), complete only when every running source's set
//! is (until then nothing is removed from the kernel).
use std::sync::Arc;

use calix_core::reconcile::remote::RemoteRoute;
use calix_dataplane::doors::PeerNodes;
use tokio::sync::Mutex;

use crate::distribution::handover::{HandoverError, RouteSink};

/// Which source a set comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Distribution = 0,
    Bgp = 1,
}

/// The latest set of each running source (`None`: not in yet).
type Slots = [Option<Option<(Vec<RemoteRoute>, bool)>>; 2];

/// The union of the sources, handed to `inner` (the reconciler's driver).
pub struct RemoteSources {
    inner: Arc<dyn RouteSink>,
    slots: Mutex<Slots>,
}

impl RemoteSources {
    /// `running`: the sources that will hand sets over (the others count as empty and whole).
    pub fn new(inner: Arc<dyn RouteSink>, running: &[Source]) -> Arc<Self> {
        let mut slots: Slots = [None, None];
        for s in running {
            slots[*s as usize] = Some(None);
        }
        Arc::new(Self {
            inner,
            slots: Mutex::new(slots),
        })
    }

    /// The sink one source hands its sets to.
    pub fn sink(self: &Arc<Self>, source: Source) -> Arc<dyn RouteSink> {
        Arc::new(SourceSink {
            sources: self.clone(),
            source,
        })
    }
}

/// The union of `slots` and whether it is whole.
fn union(slots: &Slots) -> (Vec<RemoteRoute>, bool) {
    let mut out: Vec<RemoteRoute> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut complete = true;
    for slot in slots.iter().flatten() {
        match slot {
            None => complete = false,
            Some((routes, whole)) => {
                complete &= *whole;
                for r in routes {
                    if seen.insert(r.prefix) {
                        out.push(r.clone());
                    }
                }
            }
        }
    }
    out.sort();
    (out, complete)
}

struct SourceSink {
    sources: Arc<RemoteSources>,
    source: Source,
}

#[tonic::async_trait]
impl RouteSink for SourceSink {
    async fn set_remote_routes(
        &self,
        routes: Vec<RemoteRoute>,
        complete: bool,
    ) -> Result<(), HandoverError> {
        // Held across the hand-over: the reconciler gets the unions in order.
        let mut slots = self.sources.slots.lock().await;
        slots[self.source as usize] = Some(Some((routes, complete)));
        let (all, whole) = union(&slots);
        self.sources.inner.set_remote_routes(all, whole).await
    }

    async fn set_peer_nodes(&self, peers: PeerNodes) -> Result<(), HandoverError> {
        self.sources.inner.set_peer_nodes(peers).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calix_core::ipam::pool::VxlanMode;

    #[derive(Default)]
    struct Taken(std::sync::Mutex<Vec<(Vec<String>, bool)>>);

    #[tonic::async_trait]
    impl RouteSink for Taken {
        async fn set_remote_routes(
            &self,
            routes: Vec<RemoteRoute>,
            complete: bool,
        ) -> Result<(), HandoverError> {
            let names = routes
                .iter()
                .map(|r| format!("{} {}", r.prefix, r.node))
                .collect();
            self.0.lock().expect("lock").push((names, complete));
            Ok(())
        }

        async fn set_peer_nodes(&self, _: PeerNodes) -> Result<(), HandoverError> {
            Ok(())
        }
    }

    fn route(prefix: &str, node: &str) -> RemoteRoute {
        RemoteRoute {
            prefix: prefix.parse().expect("net"),
            node: node.into(),
            next_hop: "172.31.1.254".parse().expect("ip"),
            vxlan: VxlanMode::Never,
        }
    }

    #[tokio::test]
    async fn the_union_is_whole_only_when_every_running_source_is() {
        let taken = Arc::new(Taken::default());
        let both = RemoteSources::new(taken.clone(), &[Source::Distribution, Source::Bgp]);
        let (dist, bgp) = (both.sink(Source::Distribution), both.sink(Source::Bgp));
        bgp.set_remote_routes(vec![route("10.244.2.0/26", "bgp:tor")], true)
            .await
            .expect("bgp");
        dist.set_remote_routes(
            vec![route("10.244.2.0/26", "b"), route("10.244.3.0/26", "c")],
            false,
        )
        .await
        .expect("dist");
        dist.set_remote_routes(vec![route("10.244.2.0/26", "b")], true)
            .await
            .expect("dist");
        let got = taken.0.lock().expect("lock").clone();
        assert_eq!(
            got[0],
            (vec!["10.244.2.0/26 bgp:tor".to_string()], false),
            "distribution not in yet"
        );
        assert_eq!(
            got[1],
            (
                vec!["10.244.2.0/26 b".to_string(), "10.244.3.0/26 c".to_string()],
                false
            ),
            "a prefix both know goes route distribution's way"
        );
        assert!(got[2].1, "both whole");

        let taken = Arc::new(Taken::default());
        let alone = RemoteSources::new(taken.clone(), &[Source::Bgp]);
        alone
            .sink(Source::Bgp)
            .set_remote_routes(vec![route("10.244.2.0/26", "bgp:tor")], true)
            .await
            .expect("bgp");
        assert!(
            taken.0.lock().expect("lock")[0].1,
            "a source not running counts as whole"
        );
    }
}
