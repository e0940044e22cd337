//! Mutual TLS between agents (rustls, ring): every node's certificate is signed by the CA of
//! `routes.tls.ca` and names the node in a DNS subject alternative name. A server asks every
//! client for its certificate and refuses the connection unless it chains to the CA; a
//! client checks that the server's certificate names the node it dialed. Which node a client
//! may act as is checked per request ([`cert_is_for`], in [`super::server`]).
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::config::TlsConfig;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("routes.tls.{what}: cannot read {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("routes.tls.{what}: {path} holds no PEM {expected}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("routes.tls.ca: a certificate in {path} is not usable as a CA")]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error(
        "routes.tls.cert is not for node {node:?}: its certificate must name the node in a DNS subject alternative name"
    )]
    NotThisNode { node: String },
    #[error("node name {0:?} is not a DNS name, so no certificate can name it")]
    NodeName(String),
    #[error("TLS setup failed")]
    Rustls(#[from] rustls::Error),
    #[error("TLS client verifier")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The crypto provider (ring).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// This node's certificate chain and key, and the CA.
#[derive(Debug)]
pub struct TlsMaterial {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for TlsMaterial {
    fn clone(&self) -> Self {
        Self {
            roots: self.roots.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

impl TlsMaterial {
    /// Reads the PEM files of `routes.tls`; the certificate must be for node `me`.
    pub fn load(files: &TlsConfig, me: &str) -> Result<Self, TlsError> {
        let m = Self::from_pem(
            (&files.ca, &read("ca", &files.ca)?),
            (&files.cert, &read("cert", &files.cert)?),
            (&files.key, &read("key", &files.key)?),
        )?;
        if !cert_is_for(&m.chain[0], me) {
            return Err(TlsError::NotThisNode { node: me.into() });
        }
        Ok(m)
    }

    /// From PEM text (each with the path it came from, for errors).
    pub fn from_pem(
        ca: (&Path, &[u8]),
        cert: (&Path, &[u8]),
        key: (&Path, &[u8]),
    ) -> Result<Self, TlsError> {
        let roots = roots(ca.0, ca.1)?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.1)
            .filter_map(Result::ok)
            .collect();
        if chain.is_empty() {
            return Err(TlsError::Pem {
                what: "cert",
                path: cert.0.to_path_buf(),
                expected: "certificate",
            });
        }
        let key = PrivateKeyDer::from_pem_slice(key.1).map_err(|_| TlsError::Pem {
            what: "key",
            path: key.0.to_path_buf(),
            expected: "private key",
        })?;
        Ok(Self {
            roots: Arc::new(roots),
            chain,
            key,
        })
    }

    /// The server side: every client must present a certificate chaining to the CA.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots.clone(),
            provider(),
        )
        .build()?;
        let mut c = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())?;
        c.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(c))
    }

    /// The client side, presenting this node's certificate.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let mut c = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        c.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(c))
    }
}

fn roots(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem).filter_map(Result::ok) {
        roots.add(cert).map_err(|source| TlsError::Ca {
            path: path.to_path_buf(),
            source,
        })?;
    }
    if roots.is_empty() {
        return Err(TlsError::Pem {
            what: "ca",
            path: path.to_path_buf(),
            expected: "certificate",
        });
    }
    Ok(roots)
}

/// A client that checks servers against the CA in `ca_pem` but presents no certificate of
/// its own (what a stranger's client looks like; for tests).
pub fn anonymous_client_config(ca_pem: &[u8]) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = roots(Path::new("(ca)"), ca_pem)?;
    let mut c = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(c))
}

/// Whether `cert` names node `name` in a DNS subject alternative name (the certificate's
/// chain and dates are the handshake's business).
pub fn cert_is_for(cert: &CertificateDer<'_>, name: &str) -> bool {
    let (Ok(ee), Ok(server_name)) = (
        webpki::EndEntityCert::try_from(cert),
        ServerName::try_from(name),
    ) else {
        return false;
    };
    ee.verify_is_valid_for_subject_name(&server_name).is_ok()
}

/// The name a client checks the server's certificate against: the node's.
pub fn server_name(node: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(node.to_string()).map_err(|_| TlsError::NodeName(node.into()))
}
