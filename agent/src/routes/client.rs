//! Follows one peer: dials its Routes endpoint (TLS: the server's certificate must name the
//! peer's node), watches, and turns the stream into [`PeerEvent`]s for the engine; when the
//! stream ends or cannot be opened, says so (the engine starts the grace period) and tries
//! again with backoff (100 ms doubling to 5 s, jittered; from the start after a stream that
//! delivered a snapshot).
use std::sync::Arc;
use std::time::Duration;

use calix_proto::v1 as pb;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::conn::Conn;
use super::engine::PeerEvent;
use super::peers::Target;
use super::tls;
use super::wire::{self, Assembler};

/// How this agent dials its peers.
pub struct Dialer {
    /// This node's name (what it watches as).
    pub me: String,
    /// `None`: plain text.
    pub tls: Option<Arc<ClientConfig>>,
    pub connect_timeout: Duration,
}

/// What a follower tells the engine.
#[derive(Debug)]
pub struct PeerMessage {
    pub peer: String,
    /// Which follower of that peer (a replaced follower's late messages are ignored).
    pub id: u64,
    pub event: PeerEvent,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Follows `peer` until the task is aborted (or the engine is gone).
pub async fn follow(
    peer: String,
    target: Target,
    dialer: Arc<Dialer>,
    id: u64,
    tx: mpsc::Sender<PeerMessage>,
) {
    let mut backoff = FIRST_BACKOFF;
    let mut last_error = String::new();
    loop {
        let mut delivered = false;
        let result = stream(&peer, &target, &dialer, id, &tx, &mut delivered).await;
        let reason = match result {
            Ok(()) => "the stream ended".to_string(),
            Err(e) => e,
        };
        if reason != last_error {
            tracing::warn!(%peer, endpoint = %target.endpoint, %reason, "routes: cannot follow peer; retrying");
            last_error.clone_from(&reason);
        } else {
            tracing::debug!(%peer, %reason, "routes: still cannot follow peer");
        }
        let down = PeerMessage {
            peer: peer.clone(),
            id,
            event: PeerEvent::Down { reason },
        };
        if tx.send(down).await.is_err() {
            return;
        }
        if delivered {
            backoff = FIRST_BACKOFF;
            last_error.clear();
        }
        tokio::time::sleep(jitter(backoff)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One stream: connect, watch, forward updates. `Err` says why it could not go on.
async fn stream(
    peer: &str,
    target: &Target,
    dialer: &Dialer,
    id: u64,
    tx: &mpsc::Sender<PeerMessage>,
    delivered: &mut bool,
) -> Result<(), String> {
    let channel = connect(peer, &target.endpoint, dialer).await?;
    let mut client = pb::routes_client::RoutesClient::new(channel)
        .max_decoding_message_size(wire::MAX_MESSAGE_BYTES);
    let mut updates = client
        .watch(pb::WatchRequest {
            node: dialer.me.clone(),
            relayed: target.relayed,
        })
        .await
        .map_err(|s| format!("watch refused: {}: {}", s.code(), s.message()))?
        .into_inner();
    let mut assembler = Assembler::default();
    loop {
        let msg = match updates.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(s) => return Err(format!("stream ended: {}: {}", s.code(), s.message())),
        };
        let Some(event) = assembler
            .push(msg)
            .map_err(|e| format!("peer broke the protocol: {e}"))?
        else {
            continue;
        };
        *delivered = true;
        let m = PeerMessage {
            peer: peer.to_string(),
            id,
            event,
        };
        if tx.send(m).await.is_err() {
            return Ok(());
        }
    }
}

/// A gRPC channel to `endpoint` (`address:port`): TCP, then TLS checking that the server is
/// node `peer`, HTTP/2 pings every 10 s while idle (a peer that stops answering is dropped
/// within 15 s).
pub async fn connect(
    peer: &str,
    endpoint: &str,
    dialer: &Dialer,
) -> Result<tonic::transport::Channel, String> {
    let server_name = tls::server_name(peer).map_err(|e| e.to_string())?;
    let addr = endpoint.to_string();
    let tls_cfg = dialer.tls.clone();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let (addr, tls_cfg, server_name) = (addr.clone(), tls_cfg.clone(), server_name.clone());
        async move {
            let tcp = TcpStream::connect(&addr).await?;
            tcp.set_nodelay(true)?;
            let conn = match tls_cfg {
                Some(cfg) => Conn::Tls(Box::new(
                    tokio_rustls::TlsConnector::from(cfg)
                        .connect(server_name, tcp)
                        .await?,
                )),
                None => Conn::Plain(tcp),
            };
            Ok::<_, std::io::Error>(TokioIo::new(conn))
        }
    });
    tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
        .map_err(|e| format!("bad endpoint {endpoint:?}: {e}"))?
        .connect_timeout(dialer.connect_timeout)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect_with_connector(connector)
        .await
        .map_err(|e| {
            let mut text = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                let more = s.to_string();
                if !text.contains(&more) {
                    text = format!("{text}: {more}");
                }
                src = s.source();
            }
            text
        })
}

/// ±20 % so that peers of a restarted agent do not all reconnect at once.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    let f = 0.8 + f64::from(nanos % 400) / 1000.0;
    d.mul_f64(f)
}
