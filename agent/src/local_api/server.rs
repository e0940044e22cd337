//! `calix.v1.Ipam`, `calix.v1.Endpoints`, `calix.v1.RouteInfo` and `calix.v1.PolicyInfo` on
//! the agent's unix socket (`calix.v1.Routes`, between agents, is served on TCP by `crate::distribution`).
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use calix_core::ipam::annotations::{self, AnnotationError, PodIpamError};
use calix_core::ipam::{IpamError, PoolChoice};
use calix_core::model::EndpointRecord;
use calix_core::policy::model::PodKey;
use calix_core::policy::report::PolicyReport;
use calix_core::routes::report::RoutesReport;
use calix_proto::v1 as pb;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::distribution::RoutesHandle;
use crate::endpoints::EndpointView;
use crate::error::AgentError;
use crate::pod_network::Node;
use crate::policy::PolicyService;

fn status(e: AgentError) -> Status {
    let msg = format!("{e:#}");
    let msg = match std::error::Error::source(&e) {
        Some(src) => format!("{msg}: {src}"),
        None => msg,
    };
    match e {
        AgentError::Invalid(_) | AgentError::PodIpam(PodIpamError::Annotation(_)) => {
            Status::invalid_argument(msg)
        }
        AgentError::PodIpam(PodIpamError::NoPool { .. }) => Status::failed_precondition(msg),
        AgentError::Ipam(IpamError::Exhausted { .. }) => Status::resource_exhausted(msg),
        AgentError::Ipam(IpamError::InUse { .. }) => Status::already_exists(msg),
        AgentError::Ipam(
            IpamError::NoPool { .. }
            | IpamError::NotInPool { .. }
            | IpamError::PoolDisabled { .. }
            | IpamError::Reserved { .. }
            | IpamError::ForeignBlock { .. }
            | IpamError::Overlaps { .. }
            | IpamError::MaxBlocks { .. }
            | IpamError::BadBlock { .. }
            | IpamError::HeldOther { .. },
        ) => Status::failed_precondition(msg),
        AgentError::Dataplane { .. } => Status::failed_precondition(msg),
        AgentError::PoolChange(_) | AgentError::ForeignAllocation { .. } => {
            Status::failed_precondition(msg)
        }
        AgentError::Datastore(_) => Status::unavailable(msg),
    }
}

/// An allocation error about an address a pod's `calix.dev/ipAddrs` asked for, as an error of
/// that annotation.
fn annotated(e: AgentError, fixed: &[(std::net::IpAddr, String)]) -> AgentError {
    let addr = match &e {
        AgentError::Ipam(
            IpamError::NotInPool { addr }
            | IpamError::PoolDisabled { addr, .. }
            | IpamError::Reserved { addr, .. }
            | IpamError::InUse { addr }
            | IpamError::ForeignBlock { addr, .. }
            | IpamError::Overlaps { addr, .. }
            | IpamError::MaxBlocks { addr, .. },
        ) => *addr,
        _ => return e,
    };
    match fixed.iter().find(|(a, _)| *a == addr) {
        Some((_, on)) => AgentError::PodIpam(PodIpamError::Annotation(AnnotationError {
            annotation: annotations::IP_ADDRS,
            on: on.clone(),
            detail: e.to_string(),
        })),
        None => e,
    }
}

pub struct IpamSvc(pub Arc<Node>);
pub struct EndpointsSvc(pub Arc<Node>);
/// Route distribution's report for calixctl (`None`: `routes.enabled = false`).
pub struct RouteInfoSvc {
    pub node: String,
    pub routes: Option<Arc<RoutesHandle>>,
}

#[tonic::async_trait]
impl pb::route_info_server::RouteInfo for RouteInfoSvc {
    async fn show(
        &self,
        _req: Request<pb::RouteInfoRequest>,
    ) -> Result<Response<pb::RouteInfoResponse>, Status> {
        let report = match &self.routes {
            Some(r) => r
                .report()
                .await
                .ok_or_else(|| Status::unavailable("route distribution is not running"))?,
            None => RoutesReport {
                node: self.node.clone(),
                ..Default::default()
            },
        };
        serde_json::to_string(&report)
            .map(|json| Response::new(pb::RouteInfoResponse { json }))
            .map_err(|e| Status::internal(format!("cannot encode the report: {e}")))
    }
}

/// NetworkPolicy's report for calixctl (`None`: not followed here, outside Kubernetes).
pub struct PolicyInfoSvc {
    pub node: Arc<Node>,
    pub policy: Option<Arc<PolicyService>>,
    /// The drop events.
    pub monitor: Option<crate::policy::monitor::DropMonitor>,
    /// Route distribution: `trace` asks other nodes through it.
    pub routes: Option<Arc<RoutesHandle>>,
    /// The Services: `trace` shows a Service address's translation.
    pub services: Option<Arc<crate::services::ServicesService>>,
}

type MonitorStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::MonitorEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::policy_info_server::PolicyInfo for PolicyInfoSvc {
    type MonitorStream = MonitorStream;

    async fn trace(
        &self,
        req: Request<pb::TraceRequest>,
    ) -> Result<Response<pb::TraceResponse>, Status> {
        let r = req.into_inner();
        let Some(policy) = &self.policy else {
            return Err(Status::failed_precondition(
                "NetworkPolicy is not followed here (it needs the kubernetes datastore)",
            ));
        };
        let proto = u8::try_from(r.protocol)
            .map_err(|_| Status::invalid_argument("protocol: a number 0-255"))?;
        let port = u16::try_from(r.port).map_err(|_| Status::invalid_argument("port: 0-65535"))?;
        let routes = self.routes.as_deref();
        let report = crate::policy::trace::trace(
            &self.node,
            policy,
            routes,
            self.services.as_deref(),
            &r.src,
            &r.dst,
            proto,
            port,
        )
        .await
        .map_err(Status::invalid_argument)?;
        serde_json::to_string(&report)
            .map(|json| Response::new(pb::TraceResponse { json }))
            .map_err(|e| Status::internal(format!("cannot encode the trace: {e}")))
    }

    async fn monitor(
        &self,
        _req: Request<pb::MonitorRequest>,
    ) -> Result<Response<Self::MonitorStream>, Status> {
        let Some(m) = &self.monitor else {
            return Err(Status::unavailable(
                "no drop events on this node: the agent could not open them (its log says \
                 why; calixctl policy <pod> still shows the counts)",
            ));
        };
        let mut rx = m.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let item = match rx.recv().await {
                    Ok(d) => serde_json::to_string(&*d)
                        .map(|json| pb::MonitorEvent { json })
                        .map_err(|e| Status::internal(format!("encoding an event: {e}"))),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        let lost = calix_core::policy::report::DroppedPacket {
                            why: format!("{n} events lost: the watcher read too slowly"),
                            suppressed: u32::try_from(n).unwrap_or(u32::MAX),
                            ..Default::default()
                        };
                        serde_json::to_string(&lost)
                            .map(|json| pb::MonitorEvent { json })
                            .map_err(|e| Status::internal(format!("encoding an event: {e}")))
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                };
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn show(
        &self,
        req: Request<pb::PolicyInfoRequest>,
    ) -> Result<Response<pb::PolicyInfoResponse>, Status> {
        let req = req.into_inner();
        let asked = !req.namespace.is_empty() || !req.name.is_empty();
        let pod = asked.then_some(PodKey {
            namespace: req.namespace,
            name: req.name,
        });
        let report = match (&self.policy, &pod) {
            (Some(p), Some(k)) => {
                // Counted only where the pod's endpoints are (a pod of another node: none).
                let counts = self
                    .node
                    .endpoints
                    .policy_counts(&k.namespace, &k.name)
                    .await
                    .map_err(status)?;
                p.report_counted(pod.as_ref(), counts.as_ref())
            }
            (Some(p), None) => p.report(None),
            (None, _) => PolicyReport {
                node: self.node.name().to_string(),
                ..Default::default()
            },
        };
        serde_json::to_string(&report)
            .map(|json| Response::new(pb::PolicyInfoResponse { json }))
            .map_err(|e| Status::internal(format!("cannot encode the report: {e}")))
    }
}

#[tonic::async_trait]
impl pb::ipam_server::Ipam for IpamSvc {
    async fn allocate(
        &self,
        req: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let r = req.into_inner();
        let attrs: BTreeMap<String, String> = r.attributes.into_iter().collect();
        let mut requested = r
            .requested
            .iter()
            .map(|a| {
                let text = a.split('/').next().unwrap_or(a);
                text.parse::<std::net::IpAddr>().map_err(|_| {
                    Status::invalid_argument(format!(
                        "requested address {a:?} is not an IP address"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A Kubernetes pod's pools (its namespace's, narrowed by its annotations) and fixed
        // addresses; the runtime's own request for a family wins over the annotation's, and
        // is held to the same pools. An allocation that names no pod uses the pools without a
        // namespaceSelector.
        let families = (
            r.ipv4 || requested.iter().any(std::net::IpAddr::is_ipv4),
            r.ipv6 || requested.iter().any(std::net::IpAddr::is_ipv6),
        );
        let mut choice = PoolChoice::default();
        let mut fixed = Vec::new();
        if let Some(asked) = self.0.pod_ipam(&attrs, families).await.map_err(status)? {
            let (ns, pod) = (&attrs["namespace"], &attrs["pod"]);
            for a in asked.addresses {
                if !requested.iter().any(|r| r.is_ipv4() == a.is_ipv4()) {
                    requested.push(a);
                    fixed.push((a, format!("pod {ns}/{pod}")));
                }
            }
            choice = asked.pools;
        }
        let (out, already) = match self
            .0
            .ipam
            .allocate_from(
                &r.handle, &r.ifname, r.ipv4, r.ipv6, &requested, &attrs, &choice,
            )
            .await
        {
            Ok(v) => v,
            Err(e) => {
                self.0.notice_allocation_failure(&e, &attrs);
                return Err(status(annotated(e, &fixed)));
            }
        };
        let addrs: Vec<std::net::IpAddr> = out.iter().map(|(a, _)| *a).collect();
        Ok(Response::new(pb::AllocateResponse {
            addresses: addresses(out),
            already_allocated: already,
            mtu: self.0.pod_mtu(&addrs).unwrap_or(0),
        }))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = req.into_inner();
        let n = self
            .0
            .ipam
            .release(&r.handle, &r.ifname)
            .await
            .map_err(status)?
            .len();
        Ok(Response::new(pb::ReleaseResponse {
            released: u32::try_from(n).unwrap_or(u32::MAX),
        }))
    }

    async fn lookup(
        &self,
        req: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let r = req.into_inner();
        let held = self
            .0
            .ipam
            .lookup(&r.handle, &r.ifname)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::LookupResponse {
            addresses: addresses(held),
        }))
    }

    async fn gc(&self, req: Request<pb::GcRequest>) -> Result<Response<pb::GcResponse>, Status> {
        let r = req.into_inner();
        let valid = r
            .valid
            .into_iter()
            .map(|a| (a.container_id, a.ifname))
            .collect();
        let (released, stale) = self.0.gc(&r.network, &valid).await.map_err(status)?;
        Ok(Response::new(pb::GcResponse {
            released: released.iter().map(ToString::to_string).collect(),
            stale: stale
                .into_iter()
                .map(|e| pb::StaleEndpoint {
                    container_id: e.container_id,
                    ifname: e.ifname,
                    host_ifname: e.host_ifname,
                })
                .collect(),
        }))
    }

    async fn status(
        &self,
        _req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let (free_v4, free_v6) = self.0.ipam.free().await;
        Ok(Response::new(pb::StatusResponse {
            free_v4,
            free_v6,
            pools: self
                .0
                .ipam
                .pools()
                .iter()
                .filter(|p| !p.disabled)
                .map(|p| p.cidr.to_string())
                .collect(),
            node: self.0.name().to_string(),
        }))
    }

    async fn show(
        &self,
        _req: Request<pb::ShowRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let report = self.0.ipam.ipam_report().await.map_err(status)?;
        json_report(&report)
    }

    async fn check(
        &self,
        _req: Request<pb::CheckRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        let report = self.0.ipam.ipam_check().await.map_err(status)?;
        json_report(&report)
    }

    async fn release_address(
        &self,
        req: Request<pb::ReleaseAddressRequest>,
    ) -> Result<Response<pb::ReleaseAddressResponse>, Status> {
        let r = req.into_inner();
        let addr: std::net::IpAddr = r.address.parse().map_err(|_| {
            Status::invalid_argument(format!("{:?} is not an IP address", r.address))
        })?;
        let reason = if r.reason.is_empty() {
            "released by calixctl".to_string()
        } else {
            r.reason
        };
        let released = self
            .0
            .ipam
            .release_address(addr, (r.seq > 0).then_some(r.seq), &reason)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::ReleaseAddressResponse { released }))
    }
}

fn json_report<T: serde::Serialize>(r: &T) -> Result<Response<pb::ReportResponse>, Status> {
    serde_json::to_string(r)
        .map(|json| Response::new(pb::ReportResponse { json }))
        .map_err(|e| Status::internal(format!("cannot encode the report: {e}")))
}

fn addresses(v: Vec<(std::net::IpAddr, ipnet::IpNet)>) -> Vec<pb::AllocatedAddress> {
    v.into_iter()
        .map(|(addr, pool)| pb::AllocatedAddress {
            address: ipnet::IpNet::from(addr).to_string(),
            pool: pool.to_string(),
        })
        .collect()
}

fn record(e: pb::Endpoint) -> EndpointRecord {
    EndpointRecord {
        container_id: e.container_id,
        ifname: e.ifname,
        host_ifname: e.host_ifname,
        netns: e.netns,
        pod_namespace: e.pod_namespace,
        pod_name: e.pod_name,
        pod_uid: e.pod_uid,
        addresses: e.addresses,
        handle: e.handle,
        mac: e.mac,
        host_ifindex: e.host_ifindex,
    }
}

fn endpoint(r: EndpointRecord) -> pb::Endpoint {
    pb::Endpoint {
        container_id: r.container_id,
        ifname: r.ifname,
        host_ifname: r.host_ifname,
        netns: r.netns,
        pod_namespace: r.pod_namespace,
        pod_name: r.pod_name,
        pod_uid: r.pod_uid,
        addresses: r.addresses,
        handle: r.handle,
        mac: r.mac,
        host_ifindex: r.host_ifindex,
    }
}

fn view(v: EndpointView, node: &Node) -> pb::EndpointStatus {
    let pod = node
        .pod(&v.record.pod_namespace, &v.record.pod_name)
        .map(|p| pb::PodInfo {
            uid: p.uid,
            labels: p.labels.into_iter().collect(),
            phase: p.phase,
            deleting: p.deleting,
        });
    pb::EndpointStatus {
        pod,
        state: v.health.map(|h| h.to_string()).unwrap_or_default(),
        endpoint: Some(endpoint(v.record)),
        host_ifindex: v.ifindex.unwrap_or(0),
        bpf_attached: v.bpf_attached,
        counters: v.counters.map(|c| pb::Counters {
            from_pod_packets: c.from_pod_packets,
            from_pod_bytes: c.from_pod_bytes,
            to_pod_packets: c.to_pod_packets,
            to_pod_bytes: c.to_pod_bytes,
        }),
    }
}

#[tonic::async_trait]
impl pb::endpoints_server::Endpoints for EndpointsSvc {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let ep = req
            .into_inner()
            .endpoint
            .ok_or_else(|| Status::invalid_argument("endpoint is required"))?;
        let a = self
            .0
            .endpoints
            .register(record(ep))
            .await
            .map_err(status)?;
        Ok(Response::new(pb::RegisterResponse {
            host_ifindex: a.ifindex,
            bpf_attached: a.bpf,
        }))
    }

    async fn unregister(
        &self,
        req: Request<pb::UnregisterRequest>,
    ) -> Result<Response<pb::UnregisterResponse>, Status> {
        let r = req.into_inner();
        let handle = (!r.release_handle.is_empty()).then_some(r.release_handle.as_str());
        let (existed, released) = self
            .0
            .unregister(&r.container_id, &r.ifname, handle)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::UnregisterResponse {
            existed,
            released: released.iter().map(ToString::to_string).collect(),
        }))
    }

    async fn drops(
        &self,
        _req: Request<pb::DropsRequest>,
    ) -> Result<Response<pb::DropsResponse>, Status> {
        let drops = self.0.endpoints.drops().await.map_err(status)?;
        Ok(Response::new(pb::DropsResponse {
            drops: drops
                .into_iter()
                .map(|d| pb::DropCounter {
                    ifindex: d.ifindex,
                    ifname: d.ifname.unwrap_or_default(),
                    reason: d.reason,
                    packets: d.packets,
                    bytes: d.bytes,
                })
                .collect(),
            node: self.0.name().to_string(),
        }))
    }

    async fn conntrack(
        &self,
        req: Request<pb::ConntrackRequest>,
    ) -> Result<Response<pb::ConntrackResponse>, Status> {
        let r = req.into_inner();
        let filter = calix_dataplane::nat::FlowFilter {
            ip: match r.ip.as_str() {
                "" => None,
                s => Some(
                    s.parse()
                        .map_err(|_| Status::invalid_argument(format!("ip {s:?}: not IPv4")))?,
                ),
            },
            proto: match r.proto.to_ascii_lowercase().as_str() {
                "" => None,
                "tcp" => Some(calix_common::IPPROTO_TCP),
                "udp" => Some(calix_common::IPPROTO_UDP),
                "icmp" => Some(1),
                other => {
                    return Err(Status::invalid_argument(format!(
                        "proto {other:?}: use tcp, udp or icmp"
                    )))
                }
            },
            port: match r.port {
                0 => None,
                p => Some(
                    u16::try_from(p).map_err(|_| Status::invalid_argument(format!("port {p}")))?,
                ),
            },
        };
        let (flows, flushed) = self.0.conntrack(&filter, r.flush).map_err(status)?;
        Ok(Response::new(pb::ConntrackResponse {
            node: self.0.name().to_string(),
            json: serde_json::to_string(&flows)
                .map_err(|e| Status::internal(format!("encoding flows: {e}")))?,
            flushed: u32::try_from(flushed).unwrap_or(u32::MAX),
        }))
    }

    async fn list(
        &self,
        _req: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        let eps = self.0.endpoints.list().await.map_err(status)?;
        Ok(Response::new(pb::ListResponse {
            endpoints: eps.into_iter().map(|v| view(v, &self.0)).collect(),
            node: self.0.name().to_string(),
        }))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot prepare socket {path}")]
    Socket {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC server failed")]
    Transport(#[from] tonic::transport::Error),
}

/// The agent's socket, bound (mode 0600) but not served yet.
pub struct UnixSocket {
    listener: UnixListener,
    path: std::path::PathBuf,
    /// (device, inode) of the socket file this bind created.
    bound: (u64, u64),
}

impl UnixSocket {
    /// Binds `path`. A stale socket there is replaced: the caller holds the instance lock
    /// ([`crate::instance`]), so no live agent owns it.
    pub fn bind(path: &Path) -> Result<Self, ServeError> {
        let sock_err = |source| ServeError::Socket {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(sock_err)?;
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(sock_err(e)),
        }
        let listener = UnixListener::bind(path).map_err(sock_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(sock_err)?;
        let bound = file_id(path).map_err(sock_err)?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            bound,
        })
    }

    /// Serves the services until `shutdown` resolves; then removes the socket file, unless it
    /// is not the one [`UnixSocket::bind`] created any more (someone else's now).
    pub async fn serve(
        self,
        node: Arc<Node>,
        routes: Option<Arc<RoutesHandle>>,
        reports: super::Reports,
        policy: Option<Arc<PolicyService>>,
        monitor: Option<crate::policy::monitor::DropMonitor>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let path = self.path;
        tracing::info!(socket = %path.display(), "serving gRPC");
        let route_info = RouteInfoSvc {
            node: node.name().to_string(),
            routes: routes.clone(),
        };
        let policy_info = PolicyInfoSvc {
            node: node.clone(),
            policy,
            monitor,
            routes,
            services: reports.services.clone(),
        };
        let result = tonic::transport::Server::builder()
            .add_service(pb::ipam_server::IpamServer::new(IpamSvc(node.clone())))
            .add_service(pb::endpoints_server::EndpointsServer::new(EndpointsSvc(
                node,
            )))
            .add_service(pb::route_info_server::RouteInfoServer::new(route_info))
            .add_service(pb::policy_info_server::PolicyInfoServer::new(policy_info))
            .add_service(pb::bgp_info_server::BgpInfoServer::new(
                super::bgp::BgpInfoSvc { bgp: reports.bgp },
            ))
            .add_service(pb::services_info_server::ServicesInfoServer::new(
                super::services::ServicesInfoSvc {
                    services: reports.services,
                },
            ))
            .serve_with_incoming_shutdown(UnixListenerStream::new(self.listener), shutdown)
            .await;
        match file_id(&path) {
            Ok(id) if id == self.bound => {
                let _ = std::fs::remove_file(&path);
            }
            Ok(_) => tracing::warn!(socket = %path.display(),
                "not removing the socket: it is not the one this agent bound"),
            Err(_) => {}
        }
        Ok(result?)
    }
}

/// (device, inode) of the file at `path`.
fn file_id(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino()))
}
