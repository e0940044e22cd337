//! The signer's certificate authority: made once (ECDSA P-256, self-signed), kept as PEM (in
//! a Secret), loaded back, and what it issues: a certificate whose every field is the
//! signer's choice — the subject CN and the one DNS subject alternative name are the node,
//! usages digital signature with server and client authentication, not a CA, the lifetime
//! given — and only the public key comes from the request.
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use time::OffsetDateTime;

use super::request::RequestKey;
use super::{cert, unix_secs, PkiError};

/// A CA: its certificate (as published) and key.
pub struct Ca {
    /// Rebuilt from the key and the subject's common name: what issuing needs (the issuer's
    /// name and key identifier). Its bytes are never published.
    issuer: rcgen::Certificate,
    key: KeyPair,
    cert_pem: String,
}

fn make(what: &'static str) -> impl Fn(rcgen::Error) -> PkiError {
    move |source| PkiError::Make { what, source }
}

fn at(t: SystemTime) -> Result<OffsetDateTime, PkiError> {
    OffsetDateTime::from_unix_timestamp(unix_secs(t)).map_err(|e| PkiError::Parse {
        what: "time",
        detail: e.to_string(),
    })
}

/// The CA certificate's fields for common name `name`.
fn ca_params(name: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p
}

impl Ca {
    /// A new CA named `name`, valid from `now` (backdated an hour, for clocks behind) for
    /// `validity`.
    pub fn generate(name: &str, now: SystemTime, validity: Duration) -> Result<Self, PkiError> {
        let key = KeyPair::generate().map_err(make("CA key"))?;
        let mut p = ca_params(name);
        p.not_before = at(now - Duration::from_secs(3600))?;
        p.not_after = at(now + validity)?;
        p.serial_number = Some(SerialNumber::from_slice(&random_serial()?));
        let cert = p.self_signed(&key).map_err(make("CA certificate"))?;
        let cert_pem = cert.pem();
        Self::from_pem(&cert_pem, &key.serialize_pem())
    }

    /// The CA stored as `cert_pem` and `key_pem`. The key must be the certificate's, and the
    /// certificate's subject a common name calix-signer reproduces byte for byte (issued
    /// certificates must name it as their issuer exactly).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        use rustls_pki_types::pem::PemObject;
        let der = rustls_pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(
            |_| PkiError::Pem {
                expected: "CERTIFICATE",
            },
        )?;
        let stored = cert::facts(der.as_ref())?;
        let key = KeyPair::from_pem(key_pem).map_err(|_| PkiError::Pem {
            expected: "PRIVATE KEY",
        })?;
        if key.public_key_der() != stored.public_key {
            return Err(PkiError::KeyMismatch);
        }
        let name = common_name(&stored.subject).ok_or(PkiError::ForeignCa)?;
        let issuer = ca_params(&name)
            .self_signed(&key)
            .map_err(make("CA certificate"))?;
        if cert::facts(issuer.der())?.subject != stored.subject {
            return Err(PkiError::ForeignCa);
        }
        Ok(Self {
            issuer,
            key,
            cert_pem: cert_pem.to_string(),
        })
    }

    /// The CA certificate (PEM), as stored and published.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's key (PEM): for its Secret only.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A certificate for node `node` with `key` (from its request), valid from `not_before`
    /// to `not_after`, serial `serial`. PEM.
    pub fn issue(
        &self,
        node: &str,
        key: &RequestKey,
        not_before: SystemTime,
        not_after: SystemTime,
        serial: &[u8],
    ) -> Result<String, PkiError> {
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, node);
        p.subject_alt_names = vec![SanType::DnsName(
            node.to_string().try_into().map_err(make("certificate"))?,
        )];
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        p.not_before = at(not_before)?;
        p.not_after = at(not_after)?;
        p.serial_number = Some(SerialNumber::from_slice(serial));
        let cert = p
            .signed_by(key, &self.issuer, &self.key)
            .map_err(make("certificate"))?;
        Ok(cert.pem())
    }
}

/// The common name of a name's raw DER, when it is one common name and nothing else.
fn common_name(subject: &[u8]) -> Option<String> {
    use x509_parser::prelude::{FromDer, X509Name};
    let (_, name) = X509Name::from_der(subject).ok()?;
    let attrs: Vec<_> = name.iter_attributes().collect();
    match attrs.as_slice() {
        [a] if a.attr_type().to_id_string() == super::request::COMMON_NAME_OID => {
            a.as_str().ok().map(str::to_string)
        }
        _ => None,
    }
}

/// 16 random bytes, the first below 0x80 (a positive serial number of at most 16 bytes).
pub fn random_serial() -> Result<[u8; 16], PkiError> {
    use ring::rand::SecureRandom;
    let mut s = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut s)
        .map_err(|_| PkiError::Parse {
            what: "random serial",
            detail: "the system's random source failed".into(),
        })?;
    s[0] &= 0x7f;
    s[0] |= 0x01;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::super::request::{new_request, parse_pem};
    use super::super::Name;
    use super::*;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem")
    }

    #[test]
    fn an_issued_certificate_chains_to_the_ca_names_its_node_alone_and_holds_the_requests_key() {
        let now = SystemTime::now();
        let ca =
            Ca::generate("calix routes CA", now, Duration::from_secs(86400 * 365)).expect("ca");
        let req = new_request("node-a").expect("request");
        let facts = parse_pem(req.pem.as_bytes()).expect("facts");
        let pem = ca
            .issue(
                "node-a",
                &facts.key,
                now - Duration::from_secs(60),
                now + Duration::from_secs(30),
                &random_serial().expect("serial"),
            )
            .expect("issue");
        let leaf = der(&pem);
        let f = cert::facts(leaf.as_ref()).expect("facts");
        assert_eq!(f.names, vec![Name::Dns("node-a".into())]);
        assert_eq!(f.public_key, req.key.public_key_der());
        assert_eq!(unix_secs(f.not_after) - unix_secs(now), 30);
        // webpki: the chain to the CA, for server and client use, and the name.
        let anchor = webpki::anchor_from_trusted_cert(&der(ca.cert_pem()))
            .expect("anchor")
            .to_owned();
        let ee = webpki::EndEntityCert::try_from(&leaf).expect("ee");
        let algs = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        let t = UnixTime::since_unix_epoch(now.duration_since(std::time::UNIX_EPOCH).expect("now"));
        for usage in [
            webpki::KeyUsage::server_auth(),
            webpki::KeyUsage::client_auth(),
        ] {
            ee.verify_for_usage(
                algs.all,
                std::slice::from_ref(&anchor),
                &[],
                t,
                usage,
                None,
                None,
            )
            .expect("chains to the CA");
        }
        let name = ServerName::try_from("node-a").expect("name");
        ee.verify_is_valid_for_subject_name(&name)
            .expect("names node-a");
        // Expired after its lifetime.
        let later = UnixTime::since_unix_epoch(
            (now + Duration::from_secs(31))
                .duration_since(std::time::UNIX_EPOCH)
                .expect("later"),
        );
        assert!(ee
            .verify_for_usage(
                algs.all,
                &[anchor],
                &[],
                later,
                webpki::KeyUsage::server_auth(),
                None,
                None
            )
            .is_err());
    }

    #[test]
    fn the_ca_loads_back_from_its_pem_and_refuses_a_key_that_is_not_its_own() {
        let now = SystemTime::now();
        let ca = Ca::generate("calix routes CA", now, Duration::from_secs(3600)).expect("ca");
        let again = Ca::from_pem(ca.cert_pem(), &ca.key_pem()).expect("loads");
        // What the loaded CA issues chains to the stored certificate.
        let req = new_request("n").expect("request");
        let key = parse_pem(req.pem.as_bytes()).expect("facts").key;
        let pem = again
            .issue("n", &key, now, now + Duration::from_secs(60), &[1])
            .expect("issue");
        let anchor = webpki::anchor_from_trusted_cert(&der(ca.cert_pem()))
            .expect("anchor")
            .to_owned();
        let leaf = der(&pem);
        let ee = webpki::EndEntityCert::try_from(&leaf).expect("ee");
        let algs = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        let t = UnixTime::since_unix_epoch(
            (now + Duration::from_secs(1))
                .duration_since(std::time::UNIX_EPOCH)
                .expect("now"),
        );
        ee.verify_for_usage(
            algs.all,
            &[anchor],
            &[],
            t,
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .expect("chains to the stored CA");
        let other = Ca::generate("calix routes CA", now, Duration::from_secs(3600)).expect("ca");
        assert!(matches!(
            Ca::from_pem(ca.cert_pem(), &other.key_pem()),
            Err(PkiError::KeyMismatch)
        ));
        assert!(Ca::from_pem("junk", &ca.key_pem()).is_err());
        assert!(Ca::from_pem(ca.cert_pem(), "junk").is_err());
    }

    #[test]
    fn serials_are_positive_and_differ() {
        let a = random_serial().expect("serial");
        let b = random_serial().expect("serial");
        assert_ne!(a, b);
        assert!(a[0] < 0x80 && a[0] > 0);
    }
}
