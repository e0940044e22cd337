//! X.509 for route distribution's certificates, with no I/O:
//!
//! ```text
//!  agent: request::new_request ──PEM──► (CertificateSigningRequest) ──► signer
//!                                                                        │ request::parse (hostile bytes)
//!                                                                        │ ca::Ca::issue (its own fields, never the request's)
//!  agent: cert::facts (is it mine? when does it expire?) ◄──PEM── status.certificate
//! ```
//!
//! - [`cert`]: what calix reads in a certificate: its names, serial, validity, public key;
//!   [`cert::names_only`], the rule both ends of a Routes connection apply (exactly one
//!   name, the expected node's DNS name);
//! - [`request`]: a PKCS#10 request read and its signature checked ([`request::parse`]), and
//!   the agent's new key and request ([`request::new_request`]);
//! - [`ca`]: the signer's CA: made, loaded, and what it issues.
//!
//! Everything that parses (x509-parser) takes bytes another party chose: it returns an error,
//! never panics.
pub mod ca;
pub mod cert;
pub mod request;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The signer (a CertificateSigningRequest's `signerName`) of route-distribution
/// certificates, by default: what the agents ask (`routes.tls.signer_name`) and calix-signer
/// answers for.
pub const ROUTES_SIGNER: &str = "calix.dev/routes";

/// A name in a certificate or request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Name {
    /// A DNS subject alternative name.
    Dns(String),
    /// Any other kind (IP address, URI, e-mail...), described.
    Other(String),
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Name::Dns(n) => write!(f, "DNS:{n}"),
            Name::Other(o) => f.write_str(o),
        }
    }
}

/// Why bytes are not a usable certificate, request or key.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("no PEM {expected} in it")]
    Pem { expected: &'static str },
    #[error("cannot parse the {what}: {detail}")]
    Parse { what: &'static str, detail: String },
    #[error("the request's signature does not verify with its own key: {0}")]
    Signature(String),
    #[error("unsupported key algorithm {0} (calix takes ECDSA P-256 or P-384, or Ed25519)")]
    KeyAlgorithm(String),
    #[error("the CA's key does not match its certificate")]
    KeyMismatch,
    #[error("the CA certificate's subject cannot be reproduced (not made by calix-signer)")]
    ForeignCa,
    #[error("making a {what}")]
    Make {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
}

/// Seconds since the epoch (0 before it).
pub fn unix_secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The time `secs` after the epoch (the epoch for a negative value).
pub fn from_unix_secs(secs: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}
