//! `calix.v1.Routes/Watch`: a peer asks to watch as node N; it is served only if its
//! certificate names N and nothing else, and N has a node record. It gets a snapshot of this agent's routes
//! (with `relayed`, on a reflector: everything it relays), then every delta. A watcher that
//! falls behind gets a new snapshot. A watch waits (up to 10 s, then `UNAVAILABLE`) until
//! the set it asks for is known: this node's routes once the datastore is listed, a
//! reflector's relayed set once every peer answered (or its grace ran out). On shutdown every
//! stream ends with `UNAVAILABLE`, so peers know at once (and keep the routes for their grace
//! period).
use std::pin::Pin;
use std::sync::Arc;

use calix_core::wire;
use calix_proto::v1 as pb;
use futures::Stream;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::conn::PeerInfo;
use super::door::{DoorStats, Known, Throttle};
use super::feed::Feed;
use super::tls::cert_is_for;
use calix_pki::cert::NameError;

/// The sets this agent serves.
pub struct Feeds {
    /// This node's routes.
    pub own: Arc<Feed>,
    /// A reflector's relayed set (its own routes and every node's validated ones).
    pub relay: Arc<Feed>,
    pub reflector: bool,
}

/// The Routes service.
pub struct RoutesSvc {
    pub feeds: Arc<Feeds>,
    pub known: Arc<Known>,
    pub stats: Arc<DoorStats>,
    pub shutdown: watch::Receiver<bool>,
    pub throttle: Arc<Throttle>,
    /// What `Verdict` answers with; `None`: this node computes no NetworkPolicy.
    pub verdicts: Option<Arc<dyn Verdicts>>,
}

/// What a node answers its peers' `Verdict` calls with (`calixctl trace` on another node).
#[tonic::async_trait]
pub trait Verdicts: Send + Sync + 'static {
    /// The step as JSON; `Err`: why there is none (the pod is not on this node...).
    async fn verdict(&self, req: &pb::VerdictRequest) -> Result<String, String>;
}

/// `Verdict` calls answered at once: a trace is an operator's command, not traffic.
static VERDICT_SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);

/// How long a watch waits for the feed to be ready before it is told to try again.
const READY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

type Updates = Pin<Box<dyn Stream<Item = Result<pb::RouteUpdate, Status>> + Send>>;

impl RoutesSvc {
    /// Who may watch as `node`: with TLS, a client whose certificate names `node`; and
    /// `node` must be a node of the datastore.
    fn authorize(&self, peer: Option<&PeerInfo>, node: &str) -> Result<(), Unauthorized> {
        let node = node.to_string();
        let Some(peer) = peer else {
            return Err(Unauthorized::NoConnection);
        };
        if let Some(cert) = &peer.cert {
            if let Err(e) = cert_is_for(cert, &node) {
                return Err(match e {
                    NameError::Other { found, .. } if self.known.contains(&found) => {
                        Unauthorized::OtherNodesCertificate { node, found }
                    }
                    NameError::Other { .. } => Unauthorized::NotNamed { node },
                    why => Unauthorized::Certificate { node, why },
                });
            }
        }
        if !self.known.contains(&node) {
            return Err(Unauthorized::UnknownNode { node });
        }
        Ok(())
    }
}

impl RoutesSvc {
    /// [`RoutesSvc::authorize`], a refusal counted, logged (throttled) and answered.
    fn admit(&self, peer: Option<&PeerInfo>, node: &str, what: &str) -> Result<(), Status> {
        self.authorize(peer, node).map_err(|reason| {
            self.stats.refused_identity();
            let remote = peer.map(|p| p.remote.to_string()).unwrap_or_default();
            if self.throttle.allow() {
                tracing::warn!(%remote, %reason, "routes: refused a peer's {what}");
            }
            Status::permission_denied(reason.to_string())
        })
    }
}

/// Why a peer may not watch as the node it names.
#[derive(Debug, thiserror::Error)]
pub enum Unauthorized {
    #[error("no connection information")]
    NoConnection,
    #[error("asked to watch as node {node:?} with the certificate of node {found:?}")]
    OtherNodesCertificate { node: String, found: String },
    #[error("asked to watch as node {node:?} with a certificate that does not name it")]
    NotNamed { node: String },
    /// (`why` is shown, not chained: the peer gets this one line.)
    #[error("asked to watch as node {node:?}: {why}")]
    Certificate { node: String, why: NameError },
    #[error("node {node:?} has no node record in the datastore")]
    UnknownNode { node: String },
}

#[tonic::async_trait]
impl pb::routes_server::Routes for RoutesSvc {
    type WatchStream = Updates;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let peer = req.extensions().get::<PeerInfo>().cloned();
        let r = req.into_inner();
        if *self.shutdown.borrow() {
            return Err(Status::unavailable("calix-agent is shutting down"));
        }
        self.admit(peer.as_ref(), &r.node, "watch")?;
        let feed = if r.relayed && self.feeds.reflector {
            self.feeds.relay.clone()
        } else {
            self.feeds.own.clone()
        };
        // A starting agent serves nothing before its routes are known (a reflector: before
        // every peer answered): an early, partial snapshot would withdraw routes from the
        // watcher.
        if !feed.ready(READY_WAIT).await {
            return Err(Status::unavailable(
                "calix-agent is still learning its routes; try again",
            ));
        }
        tracing::info!(peer = %r.node, relayed = r.relayed && self.feeds.reflector, "routes: peer watches");
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(serve_stream(feed, tx, self.shutdown.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn verdict(
        &self,
        req: Request<pb::VerdictRequest>,
    ) -> Result<Response<pb::VerdictResponse>, Status> {
        let peer = req.extensions().get::<PeerInfo>().cloned();
        let r = req.into_inner();
        self.admit(peer.as_ref(), &r.node, "verdict call")?;
        let Some(v) = &self.verdicts else {
            return Err(Status::unimplemented(
                "this node computes no NetworkPolicy (not in Kubernetes mode)",
            ));
        };
        let Ok(_slot) = VERDICT_SLOTS.try_acquire() else {
            return Err(Status::resource_exhausted(
                "too many trace calls at once; try again",
            ));
        };
        tracing::debug!(peer = %r.node, pod = %r.pod_address, "routes: a peer asks a verdict");
        v.verdict(&r)
            .await
            .map(|json| Response::new(pb::VerdictResponse { json }))
            .map_err(Status::failed_precondition)
    }
}

/// Sends the snapshot, then the deltas, until the watcher goes or the agent stops.
async fn serve_stream(
    feed: Arc<Feed>,
    tx: mpsc::Sender<Result<pb::RouteUpdate, Status>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let (snapshot, mut rx) = feed.subscribe();
    if send_all(&tx, wire::encode_snapshot(&snapshot))
        .await
        .is_err()
    {
        return;
    }
    loop {
        let msgs = tokio::select! {
            d = rx.recv() => match d {
                Ok(delta) => wire::encode_delta(&delta),
                // Behind by more than the buffer: start over from a snapshot.
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let (snapshot, fresh) = feed.subscribe();
                    rx = fresh;
                    wire::encode_snapshot(&snapshot)
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = shutdown.changed() => {
                let _ = tx.send(Err(Status::unavailable("calix-agent is shutting down"))).await;
                return;
            }
            _ = tx.closed() => return,
        };
        if send_all(&tx, msgs).await.is_err() {
            return;
        }
    }
}

async fn send_all(
    tx: &mpsc::Sender<Result<pb::RouteUpdate, Status>>,
    msgs: Vec<pb::RouteUpdate>,
) -> Result<(), ()> {
    for m in msgs {
        tx.send(Ok(m)).await.map_err(|_| ())?;
    }
    Ok(())
}
