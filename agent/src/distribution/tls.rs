//! Mutual TLS between agents (rustls, ring): every node's certificate is signed by a CA of
//! the trust bundle and names the node in one DNS subject alternative name, and nothing else
//! ([`calix_pki::cert::names_only`]). A server asks every client for its certificate and
//! refuses the connection unless it chains to the bundle; a client checks that the server's
//! certificate names the node it dialed, and only it. Which node a client may act as is
//! checked per request ([`cert_is_for`], in [`super::server`]).
//!
//! The material is live ([`LiveTls`]): the server's certificate resolver, the client's
//! certificate resolver and both verifiers read the current certificate and bundle at each
//! handshake, so a renewed certificate (or a new bundle) is used by the next connection while
//! established ones go on untouched. It comes from PEM files (`routes.tls.{ca,cert,key}`,
//! [`TlsMaterial`]), or from the Kubernetes API ([`crate::kubernetes::certificates`]), which starts
//! it empty ([`LiveTls::pending`]): followers wait until it is ready, and the door refuses
//! handshakes until then.
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use calix_core::routes::report::CertStatus;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore};
use rustls::{ServerConfig, SignatureScheme};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use calix_pki::cert::{self, CertFacts, NameError};

/// Where a node's route-distribution certificate comes from (`routes.tls.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CertSource {
    /// PEM files ([`TlsFiles`]).
    #[default]
    Files,
    /// A key made on this node and its certificate through the Kubernetes API
    /// (`crate::kubernetes::certificates`).
    Kubernetes,
}

/// This node's certificate (chain), its key and the CA, as PEM files (`routes.tls.{cert,key,ca}`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

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
    #[error("this node's certificate is not for node {node:?}: {reason}")]
    NotThisNode { node: String, reason: NameError },
    #[error("this node's certificate does not verify against the trust bundle: {0}")]
    Untrusted(rustls::Error),
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

/// This node's certificate chain and key, and the CA, from PEM.
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
    /// Reads the PEM files of `routes.tls`; the certificate must name node `me` alone.
    pub fn load(files: &TlsFiles, me: &str) -> Result<Self, TlsError> {
        let m = Self::from_pem(
            (&files.ca, &read("ca", &files.ca)?),
            (&files.cert, &read("cert", &files.cert)?),
            (&files.key, &read("key", &files.key)?),
        )?;
        cert_is_for(&m.chain[0], me).map_err(|reason| TlsError::NotThisNode {
            node: me.into(),
            reason,
        })?;
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

    /// The material, live (fixed: nothing renews it), as it is: a test's or a simulation's
    /// certificate may name anything ([`TlsMaterial::load`] is the agent's, checked).
    fn live(&self) -> Result<Arc<LiveTls>, TlsError> {
        let live = LiveTls::pending("", CertSource::Files);
        live.set_roots(self.roots.clone())?;
        live.install(self.chain.clone(), self.key.clone_key(), false)?;
        Ok(live)
    }

    /// The server side: every client must present a certificate chaining to the CA. The
    /// material is taken as it is (see [`TlsMaterial::load`] for the checked one).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        self.live()?.server_config()
    }

    /// The client side, presenting this node's certificate.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        self.live()?.client_config()
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

/// The trust bundle in `pem` (one CA certificate or more), e.g. a ConfigMap's `ca.crt`;
/// `origin` names it in errors.
pub fn bundle(origin: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
    roots(origin, pem).map(Arc::new)
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

/// Whether `cert` names node `name` and nothing else (one DNS subject alternative name; the
/// certificate's chain and dates are the handshake's business).
pub fn cert_is_for(cert: &CertificateDer<'_>, name: &str) -> Result<(), NameError> {
    cert::names_only(cert.as_ref(), name)
}

/// The name a client checks the server's certificate against: the node's.
pub fn server_name(node: &str) -> Result<ServerName<'static>, TlsError> {
    match ServerName::try_from(node.to_string()) {
        Ok(n @ ServerName::DnsName(_)) => Ok(n),
        _ => Err(TlsError::NodeName(node.into())),
    }
}

/// This node's live TLS material: the trust bundle and its certificate with key, either of
/// which may be replaced at any time (see the module doc).
pub struct LiveTls {
    me: String,
    source: CertSource,
    state: RwLock<State>,
    /// Ready: a bundle and a certificate.
    ready: watch::Sender<bool>,
    /// +1 at each new bundle.
    bundles: watch::Sender<u64>,
}

#[derive(Default)]
struct State {
    roots: Option<Arc<RootCertStore>>,
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
    server_verifier: Option<Arc<WebPkiServerVerifier>>,
    key: Option<Arc<CertifiedKey>>,
    facts: Option<CertFacts>,
    issued: u64,
    failures: u64,
    last_error: Option<String>,
}

impl std::fmt::Debug for LiveTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveTls")
            .field("me", &self.me)
            .field("source", &self.source)
            .field("ready", &*self.ready.borrow())
            .finish()
    }
}

impl LiveTls {
    /// Empty: no bundle, no certificate yet.
    pub fn pending(me: &str, source: CertSource) -> Arc<Self> {
        Arc::new(Self {
            me: me.to_string(),
            source,
            state: RwLock::new(State::default()),
            ready: watch::channel(false).0,
            bundles: watch::channel(0).0,
        })
    }

    /// From PEM files, checked: the certificate must name node `me` alone and chain to the
    /// CA file.
    pub fn from_files(files: &TlsFiles, me: &str) -> Result<Arc<Self>, TlsError> {
        let m = TlsMaterial::load(files, me)?;
        let live = Self::pending(me, CertSource::Files);
        live.set_roots(m.roots.clone())?;
        live.set_identity(m.chain.clone(), m.key.clone_key())?;
        Ok(live)
    }

    pub fn node(&self) -> &str {
        &self.me
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the trust bundle: handshakes from now on verify peers against it.
    pub fn set_roots(&self, roots: Arc<RootCertStore>) -> Result<(), TlsError> {
        let client =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()?;
        let server =
            WebPkiServerVerifier::builder_with_provider(roots.clone(), provider()).build()?;
        {
            let mut s = self.write();
            s.roots = Some(roots);
            s.client_verifier = Some(client);
            s.server_verifier = Some(server);
        }
        self.bundles.send_modify(|n| *n += 1);
        self.update_ready();
        Ok(())
    }

    /// Puts `chain` (this node's certificate first) and `key` in place for every handshake
    /// from now on, once checked: the key is the certificate's, the certificate names this
    /// node alone and, when the bundle is known, chains to it and is valid now.
    pub fn set_identity(
        &self,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<CertFacts, TlsError> {
        self.install(chain, key, true)
    }

    /// [`LiveTls::set_identity`]; `check: false` skips the name and trust checks (material
    /// taken as it is, for tests and simulations).
    fn install(
        &self,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        check: bool,
    ) -> Result<CertFacts, TlsError> {
        let leaf = chain.first().ok_or(TlsError::NotThisNode {
            node: self.me.clone(),
            reason: NameError::NoName,
        })?;
        if check {
            cert_is_for(leaf, &self.me).map_err(|reason| TlsError::NotThisNode {
                node: self.me.clone(),
                reason,
            })?;
        }
        let facts = cert::facts(leaf.as_ref()).map_err(|e| TlsError::NotThisNode {
            node: self.me.clone(),
            reason: NameError::Unreadable(e.to_string()),
        })?;
        let certified = CertifiedKey::from_der(chain.clone(), key, &provider())?;
        if let Some(v) = self.read().server_verifier.clone().filter(|_| check) {
            self.verify_own(&v, &chain)?;
        }
        {
            let mut s = self.write();
            s.key = Some(Arc::new(certified));
            s.facts = Some(facts.clone());
            s.issued += 1;
            s.last_error = None;
        }
        self.update_ready();
        Ok(facts)
    }

    fn verify_own(
        &self,
        v: &WebPkiServerVerifier,
        chain: &[CertificateDer<'static>],
    ) -> Result<(), TlsError> {
        let name = server_name(&self.me)?;
        v.verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now())
            .map(|_| ())
            .map_err(TlsError::Untrusted)
    }

    /// Whether this node's certificate verifies against the current bundle now (false
    /// without either).
    pub fn identity_trusted(&self) -> bool {
        let (v, key) = {
            let s = self.read();
            (s.server_verifier.clone(), s.key.clone())
        };
        match (v, key) {
            (Some(v), Some(k)) => self.verify_own(&v, &k.cert).is_ok(),
            _ => false,
        }
    }

    /// Counts a failed attempt to get a certificate, with why.
    pub fn record_failure(&self, error: String) {
        let mut s = self.write();
        s.failures += 1;
        s.last_error = Some(error);
    }

    fn update_ready(&self) {
        let ready = {
            let s = self.read();
            s.roots.is_some() && s.key.is_some()
        };
        self.ready.send_if_modified(|r| {
            let changed = *r != ready;
            *r = ready;
            changed
        });
    }

    /// A bundle and a certificate are in place.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Until [`LiveTls::is_ready`].
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Changes each time the bundle is replaced.
    pub fn bundle_changes(&self) -> watch::Receiver<u64> {
        self.bundles.subscribe()
    }

    /// This node's current certificate's facts.
    pub fn facts(&self) -> Option<CertFacts> {
        self.read().facts.clone()
    }

    pub fn status(&self, now: SystemTime) -> CertStatus {
        let s = self.read();
        let not_after = s.facts.as_ref().map(|f| calix_pki::unix_secs(f.not_after));
        CertStatus {
            source: match self.source {
                CertSource::Files => "files",
                CertSource::Kubernetes => "kubernetes",
            }
            .into(),
            serial: s.facts.as_ref().map(|f| f.serial.clone()),
            not_after,
            expires_in_secs: not_after.map(|t| t - calix_pki::unix_secs(now)),
            bundle: s.roots.is_some(),
            issued: s.issued,
            failures: s.failures,
            last_error: s.last_error.clone(),
        }
    }

    fn certified_key(&self) -> Option<Arc<CertifiedKey>> {
        self.read().key.clone()
    }

    /// The server side: every client must present a certificate chaining to the bundle;
    /// this node's current certificate is served.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        let mut c = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(Arc::new(Peers(self.clone())))
            .with_cert_resolver(Arc::new(Peers(self.clone())));
        c.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(c))
    }

    /// The client side: servers are checked against the bundle and must name the node
    /// dialed alone; this node's current certificate is presented.
    pub fn client_config(self: &Arc<Self>) -> Result<Arc<ClientConfig>, TlsError> {
        let mut c = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Peers(self.clone())))
            .with_client_cert_resolver(Arc::new(Peers(self.clone())));
        c.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(c))
    }
}

/// The resolvers and verifiers over a [`LiveTls`].
#[derive(Debug)]
struct Peers(Arc<LiveTls>);

fn no_bundle() -> rustls::Error {
    rustls::Error::General("no trust bundle yet (routes.tls)".into())
}

impl ResolvesServerCert for Peers {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.certified_key()
    }
}

impl ResolvesClientCert for Peers {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.0.certified_key()
    }

    fn has_certs(&self) -> bool {
        self.0.certified_key().is_some()
    }
}

impl ClientCertVerifier for Peers {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let v = self
            .0
            .read()
            .client_verifier
            .clone()
            .ok_or_else(no_bundle)?;
        v.verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ServerCertVerifier for Peers {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let v = self
            .0
            .read()
            .server_verifier
            .clone()
            .ok_or_else(no_bundle)?;
        v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        let ServerName::DnsName(name) = server_name else {
            return Err(rustls::Error::UnsupportedNameType);
        };
        cert_is_for(end_entity, name.as_ref())
            .map_err(|e| rustls::Error::General(format!("server certificate: {e}")))?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        ClientCertVerifier::verify_tls12_signature(self, message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        ClientCertVerifier::verify_tls13_signature(self, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        ClientCertVerifier::supported_verify_schemes(self)
    }
}
