//! Follows one peer: dials its Routes endpoint (TLS: the server's certificate must name the
//! peer's node), watches, and turns the stream into [`PeerEvent`]s for the engine; when the
//! stream ends or cannot be opened, says so (the engine starts the grace period) and tries
//! again with backoff (100 ms doubling to 5 s, jittered; from the start after a stream that
//! delivered a snapshot). With a certificate still on its way (`Dialer::live`), it first
//! waits for it.
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use calix_core::routes::advertise::NextHops;
use calix_core::routes::peers::Target;
use calix_core::update::PeerEvent;
use calix_core::update::WireError;
use calix_core::wire::{self, Assembler};
use calix_proto::v1 as pb;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::ClientConfig;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;
use tonic::codec::Codec;

use super::conn::Conn;
use super::tls::{self, LiveTls, TlsError};
use crate::memory;

/// How this agent dials its peers.
pub struct Dialer {
    /// This node's name (what it watches as).
    pub me: String,
    /// `None`: plain text.
    pub tls: Option<Arc<ClientConfig>>,
    /// The material `tls` presents, when it may not be there yet (a certificate from the
    /// Kubernetes API): followers wait until it is ready before they dial.
    pub live: Option<Arc<LiveTls>>,
    pub connect_timeout: Duration,
    /// Where it dials from: this node's address of the endpoint's family, which its node
    /// record (or Node object) carries — a peer's door refuses sources it does not know.
    /// None for a family: the kernel picks.
    pub source: NextHops,
}

/// What a follower tells the engine.
#[derive(Debug)]
pub struct PeerMessage {
    pub peer: String,
    /// Which follower of that peer (a replaced follower's late messages are ignored).
    pub id: u64,
    pub event: PeerEvent,
    /// One of the follower's [`IN_FLIGHT`] places, freed when the message is dropped (once
    /// the engine took it). `None` for [`PeerEvent::Down`].
    pub place: Option<OwnedSemaphorePermit>,
}

/// Updates of one peer read from its stream and not yet taken by the engine, at most: the
/// follower reads no more until the engine takes one, and the peer's stream waits (HTTP/2
/// flow control), so a peer faster than the engine cannot fill this agent's memory.
pub const IN_FLIGHT: usize = 2;

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
    if let Some(live) = dialer.live.as_ref().filter(|l| !l.is_ready()) {
        tracing::debug!(%peer, "routes: waiting for this node's certificate before following");
        live.wait_ready().await;
    }
    let mut backoff = FIRST_BACKOFF;
    let mut last_error = String::new();
    let places = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let mut delivered = false;
        let result = stream(&peer, &target, &dialer, id, &tx, &places, &mut delivered).await;
        let (reason, broke) = match result {
            Ok(()) => ("the stream ended".to_string(), None),
            Err(Ended::Broke(e)) => (format!("peer broke the protocol: {e}"), Some(e)),
            Err(Ended::Failed(reason)) => (reason, None),
        };
        if reason != last_error {
            tracing::warn!(%peer, endpoint = %target.endpoint, %reason, "routes: cannot follow peer; retrying");
            last_error.clone_from(&reason);
        } else {
            tracing::debug!(%peer, %reason, "routes: still cannot follow peer");
        }
        // A peer that breaks the protocol is retried with a growing backoff, even when it
        // delivered something first.
        let fresh = delivered && broke.is_none();
        let down = PeerMessage {
            peer: peer.clone(),
            id,
            event: PeerEvent::Down { reason, broke },
            place: None,
        };
        if tx.send(down).await.is_err() {
            return;
        }
        if fresh {
            backoff = FIRST_BACKOFF;
            last_error.clear();
        }
        tokio::time::sleep(jitter(backoff)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Why a stream ended.
enum Ended {
    /// The peer broke the protocol or a bound.
    Broke(WireError),
    /// Anything else (could not connect, the connection or the peer ended it).
    Failed(String),
}

/// One stream: connect, watch, forward updates.
async fn stream(
    peer: &str,
    target: &Target,
    dialer: &Dialer,
    id: u64,
    tx: &mpsc::Sender<PeerMessage>,
    places: &Arc<Semaphore>,
    delivered: &mut bool,
) -> Result<(), Ended> {
    let channel = connect(peer, &target.endpoint, dialer)
        .await
        .map_err(|e| Ended::Failed(error_text(&e)))?;
    let mut updates = watch(
        channel,
        pb::WatchRequest {
            node: dialer.me.clone(),
            relayed: target.relayed,
        },
    )
    .await
    .map_err(|s| Ended::Failed(format!("watch refused: {}: {}", s.code(), s.message())))?
    .into_inner();
    let mut assembler = Assembler::default();
    loop {
        // Read on only with a place for what the read may complete.
        let Ok(place) = places.clone().acquire_owned().await else {
            return Ok(());
        };
        let msg = match updates.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(s) => {
                return Err(match broken(&s) {
                    Some(e) => Ended::Broke(e),
                    None => Ended::Failed(format!("stream ended: {}: {}", s.code(), s.message())),
                })
            }
        };
        let Some(event) = assembler.push(msg).map_err(Ended::Broke)? else {
            continue;
        };
        *delivered = true;
        tracing::debug!(%peer, update = %calix_core::routes::engine::describe(&event),
            "routes: update read from peer's stream");
        let m = PeerMessage {
            peer: peer.to_string(),
            id,
            event,
            place: Some(place),
        };
        if tx.send(m).await.is_err() {
            return Ok(());
        }
    }
}

/// The stream's error when it is the peer's doing: a message over
/// [`wire::MAX_MESSAGE_BYTES`], or one that does not decode (tonic's and prost's words).
fn broken(s: &tonic::Status) -> Option<WireError> {
    match s.code() {
        tonic::Code::OutOfRange if s.message().contains("message length too large") => {
            Some(WireError::MessageTooLarge {
                limit: wire::MAX_MESSAGE_BYTES,
            })
        }
        tonic::Code::Internal if s.message().starts_with("failed to decode Protobuf message") => {
            Some(WireError::Undecodable)
        }
        _ => None,
    }
}

/// `calix.v1.Routes/Watch` on `channel`: what the generated client does, with the decode
/// buffer of [`memory::CODEC_BUFFER`] and messages up to [`wire::MAX_MESSAGE_BYTES`].
pub async fn watch(
    channel: PeerChannel,
    req: pb::WatchRequest,
) -> Result<tonic::Response<tonic::Streaming<pb::RouteUpdate>>, tonic::Status> {
    let mut grpc =
        tonic::client::Grpc::new(channel).max_decoding_message_size(wire::MAX_MESSAGE_BYTES);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(error_text(&e)))?;
    let mut req = tonic::Request::new(req);
    req.extensions_mut()
        .insert(tonic::GrpcMethod::new("calix.v1.Routes", "Watch"));
    grpc.server_streaming(
        req,
        http::uri::PathAndQuery::from_static("/calix.v1.Routes/Watch"),
        WatchCodec,
    )
    .await
}

/// prost's codec for `Watch`, with small starting buffers ([`memory::CODEC_BUFFER`]).
struct WatchCodec;

type Prost = tonic_prost::ProstCodec<pb::WatchRequest, pb::RouteUpdate>;

impl Codec for WatchCodec {
    type Encode = pb::WatchRequest;
    type Decode = pb::RouteUpdate;
    type Encoder = tonic_prost::ProstEncoder<pb::WatchRequest>;
    type Decoder = tonic_prost::ProstDecoder<pb::RouteUpdate>;

    fn encoder(&mut self) -> Self::Encoder {
        Prost::raw_encoder(memory::codec_buffers())
    }

    fn decoder(&mut self) -> Self::Decoder {
        Prost::raw_decoder(memory::codec_buffers())
    }
}

/// A connection to a peer: HTTP/2 (hyper) straight on the TLS stream, requests sent with the
/// peer's address as their authority. Not tonic's `Channel`: a follower makes one request per
/// connection and reconnects by itself, and the channel's request queue (1024 slots), its
/// worker task and its reconnect layer were ~12 KiB per peer for nothing ([`memory`]).
#[derive(Clone)]
pub struct PeerChannel {
    send: SendRequest<Body>,
    authority: http::uri::Authority,
}

type ResponseFuture = Pin<
    Box<dyn Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>> + Send>,
>;

impl tower::Service<http::Request<Body>> for PeerChannel {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        self.send.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> ResponseFuture {
        // tonic's clients send the path only; HTTP/2 needs :scheme and :authority.
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        if let Ok(uri) = http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
        Box::pin(self.send.send_request(req))
    }
}

/// A connection to `endpoint` (`address:port`): TCP, then TLS checking that the server is
/// node `peer`, then HTTP/2 with [`memory`]'s windows and pings (a peer that stops answering
/// is dropped within 15 s), all within `dialer.connect_timeout`.
pub async fn connect(
    peer: &str,
    endpoint: &str,
    dialer: &Dialer,
) -> Result<PeerChannel, ConnectError> {
    let server_name = tls::server_name(peer)?;
    let authority: http::uri::Authority =
        endpoint.parse().map_err(|source| ConnectError::Endpoint {
            endpoint: endpoint.to_string(),
            source,
        })?;
    let dial = async {
        let tcp = dial_from(endpoint, &dialer.source)
            .await
            .map_err(ConnectError::Tcp)?;
        tcp.set_nodelay(true).map_err(ConnectError::Tcp)?;
        let conn = match &dialer.tls {
            Some(cfg) => Conn::Tls(Box::new(
                tokio_rustls::TlsConnector::from(cfg.clone())
                    .connect(server_name, tcp)
                    .await
                    .map_err(ConnectError::Tls)?,
            )),
            None => Conn::Plain(tcp),
        };
        hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .initial_stream_window_size(memory::STREAM_WINDOW)
            .initial_connection_window_size(memory::CONNECTION_WINDOW)
            .keep_alive_interval(memory::PEER_KEEPALIVE)
            .keep_alive_timeout(memory::PEER_KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .handshake(TokioIo::new(conn))
            .await
            .map_err(ConnectError::Http2)
    };
    let (send, connection) = tokio::time::timeout(dialer.connect_timeout, dial)
        .await
        .map_err(|_| ConnectError::TimedOut {
            endpoint: endpoint.to_string(),
        })??;
    // Ends when the peer closes, or once every `PeerChannel` and stream is dropped.
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %error_text(&e), "routes: connection to a peer ended");
        }
    });
    Ok(PeerChannel { send, authority })
}

/// Why [`connect`] did not give a channel to the peer.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("the peer's name is not one a certificate can hold")]
    Name(#[from] TlsError),
    #[error("bad endpoint {endpoint:?}")]
    Endpoint {
        endpoint: String,
        source: http::uri::InvalidUri,
    },
    #[error("TCP")]
    Tcp(#[source] std::io::Error),
    #[error("TLS")]
    Tls(#[source] std::io::Error),
    #[error("HTTP/2 handshake")]
    Http2(#[source] hyper::Error),
    #[error("timed out connecting to {endpoint}")]
    TimedOut { endpoint: String },
}

/// TCP to `endpoint` from `source`'s address of its family (when there is one; if that
/// address cannot be bound, from what the kernel picks).
async fn dial_from(endpoint: &str, source: &NextHops) -> std::io::Result<TcpStream> {
    let Ok(to) = endpoint.parse::<SocketAddr>() else {
        return TcpStream::connect(endpoint).await;
    };
    let from = if to.is_ipv4() { source.v4 } else { source.v6 };
    let Some(from) = from.filter(|a| a.is_ipv4() == to.is_ipv4()) else {
        return TcpStream::connect(to).await;
    };
    let sock = if to.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Err(e) = sock.bind(SocketAddr::new(from, 0)) {
        tracing::debug!(%from, error = %e, "routes: cannot dial from this node's address; letting the kernel pick");
        return TcpStream::connect(to).await;
    }
    sock.connect(to).await
}

/// An error with its sources, as one line.
fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    calix_log::error_chain(e)
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
