//! The calix gRPC API, `calix.v1`: generated tonic/prost code for `Ipam`, `Endpoints`,
//! `Routes` (between agents, TCP) and `RouteInfo` (calixctl), plus the unix-socket channel
//! every client uses; and the clients of the part of etcd's v3 API the agent's etcd datastore
//! speaks (`etcd`).
//! `handle` is the IPAM handle encoding the plugin and the agent share.
//! Domain conversions live with their users (agent/src/local_api, datastore/src/etcd.rs).
//!
//! Without the `grpc` feature (on by default), `calix.v1`'s messages only: no tonic, no tokio.
#[cfg(feature = "grpc")]
use std::path::{Path, PathBuf};
#[cfg(feature = "grpc")]
use std::time::Duration;

pub mod handle;

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/calix.v1.rs"));
}

/// etcd's v3 API, the subset calix uses: `KV` (Range, Put, DeleteRange, Txn, Compact) and `Watch`.
#[cfg(feature = "grpc")]
pub mod etcd {
    #![allow(clippy::all, missing_docs)]
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
}

/// Default path of the agent's unix socket.
pub const DEFAULT_AGENT_SOCKET: &str = "/var/run/calix/agent.sock";

/// Opens a gRPC channel to the agent over its unix socket.
///
/// `timeout` bounds both the connection and every request made on the channel, so a caller
/// (the CNI plugin above all) never hangs on a wedged agent.
///
/// The peer must be root (`SO_PEERCRED`): the agent runs as root, and a process of anyone else
/// listening on the socket's path (a stale path in a world-writable directory, a mount) is not
/// the agent. Such a connection fails with `PermissionDenied`, naming the peer's uid and pid.
#[cfg(feature = "grpc")]
pub async fn connect_unix(
    path: impl AsRef<Path>,
    timeout: Duration,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path: PathBuf = path.as_ref().to_path_buf();
    // The URI is required by tonic but unused: the connector below ignores it.
    tonic::transport::Endpoint::from_static("http://calix-agent.local")
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(&path).await?;
                let peer = stream.peer_cred()?;
                if peer.uid() != 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!(
                            "{} is served by uid {} (pid {}), not by root: not calix-agent",
                            path.display(),
                            peer.uid(),
                            peer.pid()
                                .map_or_else(|| "?".to_string(), |p| p.to_string())
                        ),
                    ));
                }
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}
