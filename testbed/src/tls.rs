//! Certificates for route distribution's mutual TLS, made in Rust (rcgen, ring): a CA, and
//! per node a certificate whose DNS subject alternative name is the node's name (usable as a
//! client and as a server), written as the PEM files `[routes.tls]` names.
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

use crate::{Error, Result};

fn rcgen_err(what: &str) -> impl FnOnce(rcgen::Error) -> Error + '_ {
    move |e| Error::Unexpected {
        what: what.to_string(),
        found: e.to_string(),
        expected: "a certificate".into(),
    }
}

/// A certificate authority.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// One node's certificate and key (PEM).
#[derive(Debug, Clone)]
pub struct NodeCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The PEM files of one node.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// The `[routes.tls]` section naming them.
    pub fn toml(&self) -> String {
        format!(
            "[routes.tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
            self.cert.display(),
            self.key.display(),
            self.ca.display()
        )
    }
}

impl Ca {
    /// A new CA named `name` (its common name).
    pub fn new(name: &str) -> Result<Self> {
        let key = KeyPair::generate().map_err(rcgen_err("CA key"))?;
        Self::with_key(name, key)
    }

    /// The CA named `name` with `key`: the same key and name always make a certificate with
    /// the same subject and public key, so what it issues chains to any earlier one of them.
    fn with_key(name: &str, key: KeyPair) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rcgen_err("CA"))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).map_err(rcgen_err("CA"))?;
        Ok(Self { cert, key })
    }

    /// Writes the CA itself into `dir` — `ca.crt`, and its key `ca.key` (mode 0600) — for a
    /// process that issues certificates of its own ([`Ca::load`]).
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(Error::io(format!("create {}", dir.display())))?;
        write_file(&dir.join(CA_CERT), &self.pem(), 0o644)?;
        write_file(&dir.join(CA_KEY), &self.key.serialize_pem(), 0o600)
    }

    /// The CA named `name` that [`Ca::save`] wrote into `dir`.
    pub fn load(dir: &Path, name: &str) -> Result<Self> {
        let path = dir.join(CA_KEY);
        let pem = std::fs::read_to_string(&path)
            .map_err(Error::io(format!("read {}", path.display())))?;
        let key = KeyPair::from_pem(&pem).map_err(rcgen_err("CA key"))?;
        Self::with_key(name, key)
    }

    /// The CA named `name` whose key is `key_pem` (e.g. calix-signer's, read from its Secret):
    /// what it issues chains to that CA's certificate.
    pub fn from_key_pem(name: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem).map_err(rcgen_err("CA key"))?;
        Self::with_key(name, key)
    }

    /// The CA's certificate (PEM).
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for node `name` (SAN DNS `name`, client and server use).
    pub fn issue(&self, name: &str) -> Result<NodeCert> {
        self.issue_names(&[name])
    }

    /// A certificate whose DNS SANs are `names` (CN the first), client and server use: what
    /// no node may present (a certificate naming two nodes).
    pub fn issue_names(&self, names: &[&str]) -> Result<NodeCert> {
        let name = names.first().copied().unwrap_or_default();
        let sans: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(sans).map_err(rcgen_err(name))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(rcgen_err(name))?;
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .map_err(rcgen_err(name))?;
        Ok(NodeCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Issues node `name`'s certificate and writes `ca.crt`, `<name>.crt` and `<name>.key`
    /// (mode 0600) into `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> Result<TlsFiles> {
        self.write_cert(dir, name, &self.issue(name)?)
    }

    /// Writes `cert` as node `name`'s files in `dir`, with this CA.
    pub fn write_cert(&self, dir: &Path, name: &str, cert: &NodeCert) -> Result<TlsFiles> {
        std::fs::create_dir_all(dir).map_err(Error::io(format!("create {}", dir.display())))?;
        let files = TlsFiles {
            ca: dir.join(CA_CERT),
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        write_file(&files.ca, &self.pem(), 0o644)?;
        write_file(&files.cert, &cert.cert_pem, 0o644)?;
        write_file(&files.key, &cert.key_pem, 0o600)?;
        Ok(files)
    }
}

/// The CA's certificate and key in a directory ([`Ca::write`], [`Ca::save`]).
const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";

/// Writes `text` to `path` (created with `mode`, or truncated).
fn write_file(path: &Path, text: &str, mode: u32) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(Error::io(format!("write {}", path.display())))
}
