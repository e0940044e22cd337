//! Just enough of the Kubernetes API for the check: an HTTPS GET with the pod's service
//! account (token and CA from the standard mount; the API server from the environment the
//! kubelet sets), answered with JSON.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

/// Where the kubelet mounts the pod's service account.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Largest answer read (a pod list of a large cluster fits).
const MAX_BODY: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{var} is not set: not running in a pod?")]
    Env { var: &'static str },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} holds no PEM certificate")]
    NoCa { path: PathBuf },
    #[error("TLS setup")]
    Tls(#[from] rustls::Error),
    #[error("{host} is not a valid server name")]
    ServerName { host: String },
    #[error("cannot reach the API server at {addr}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP to the API server")]
    Http(#[from] hyper::Error),
    #[error("bad request {path}")]
    Request {
        path: String,
        #[source]
        source: hyper::http::Error,
    },
    #[error("GET {path}: {status}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
    #[error("GET {path}: more than {MAX_BODY} bytes")]
    TooLarge { path: String },
    #[error("GET {path}: reading the answer")]
    Body {
        path: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("GET {path}: not JSON")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

/// An API server and the credentials to use it.
#[derive(Clone)]
pub struct Api {
    host: String,
    port: u16,
    token: String,
    tls: Arc<rustls::ClientConfig>,
}

fn read(path: &Path) -> Result<Vec<u8>, ApiError> {
    std::fs::read(path).map_err(|source| ApiError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl Api {
    /// The API server of the cluster this pod runs in (the kubelet's environment), with the
    /// service account mounted at `dir` (normally [`SERVICE_ACCOUNT_DIR`]).
    pub fn in_cluster(dir: &Path) -> Result<Self, ApiError> {
        let env = |var: &'static str| std::env::var(var).map_err(|_| ApiError::Env { var });
        let host = env("KUBERNETES_SERVICE_HOST")?;
        let port = env("KUBERNETES_SERVICE_PORT")?
            .parse()
            .map_err(|_| ApiError::Env {
                var: "KUBERNETES_SERVICE_PORT",
            })?;
        let token = String::from_utf8_lossy(&read(&dir.join("token"))?)
            .trim()
            .to_string();
        let ca_path = dir.join("ca.crt");
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&read(&ca_path)?).flatten() {
            roots.add(cert)?;
        }
        if roots.is_empty() {
            return Err(ApiError::NoCa { path: ca_path });
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Self {
            host,
            port,
            token,
            tls: Arc::new(tls),
        })
    }

    /// GETs `path` (e.g. `/api/v1/namespaces/x/pods?labelSelector=...`) as JSON.
    pub async fn get(&self, path: &str) -> Result<serde_json::Value, ApiError> {
        let addr = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        let tcp = TcpStream::connect(&addr)
            .await
            .map_err(|source| ApiError::Connect {
                addr: addr.clone(),
                source,
            })?;
        let name = ServerName::try_from(self.host.clone()).map_err(|_| ApiError::ServerName {
            host: self.host.clone(),
        })?;
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|source| ApiError::Connect {
                addr: addr.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        let request = hyper::Request::get(path)
            .header("host", &addr)
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|source| ApiError::Request {
                path: path.to_string(),
                source,
            })?;
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = http_body_util::Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    ApiError::TooLarge {
                        path: path.to_string(),
                    }
                } else {
                    ApiError::Body {
                        path: path.to_string(),
                        source: e,
                    }
                }
            })?
            .to_bytes();
        if status != 200 {
            return Err(ApiError::Status {
                path: path.to_string(),
                status,
                body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
            });
        }
        serde_json::from_slice(&body).map_err(|source| ApiError::Json {
            path: path.to_string(),
            source,
        })
    }
}
