//! PKCS#10 certificate requests: the agent's new key and its request naming its node
//! ([`new_request`]), and what the signer reads in a request somebody sent ([`parse`]): its
//! subject, names, other extensions and attributes, and its public key, once its signature
//! has been checked with that key (proof the requester holds the private key).
use rcgen::{CertificateParams, DnType, KeyPair, SanType};
use x509_parser::cri_attributes::ParsedCriAttribute;
use x509_parser::extensions::ParsedExtension;
use x509_parser::prelude::{FromDer, X509CertificationRequest};

use super::{Name, PkiError};

/// The subjectAltName extension's OID.
const SAN_OID: &str = "2.5.29.17";
/// The extensionRequest attribute's OID (PKCS #9).
const EXTENSION_REQUEST_OID: &str = "1.2.840.113549.1.9.14";

/// The kind of public key a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    EcdsaP256,
    EcdsaP384,
    Ed25519,
}

impl KeyKind {
    /// The algorithm rcgen writes the key's SubjectPublicKeyInfo with.
    pub fn algorithm(self) -> &'static rcgen::SignatureAlgorithm {
        match self {
            KeyKind::EcdsaP256 => &rcgen::PKCS_ECDSA_P256_SHA256,
            KeyKind::EcdsaP384 => &rcgen::PKCS_ECDSA_P384_SHA384,
            KeyKind::Ed25519 => &rcgen::PKCS_ED25519,
        }
    }
}

/// A request's public key: its kind, the key bits, and the whole SubjectPublicKeyInfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    pub kind: KeyKind,
    /// The subjectPublicKey BIT STRING's bytes.
    pub bits: Vec<u8>,
    /// The SubjectPublicKeyInfo (DER), as an issued certificate carries it.
    pub spki: Vec<u8>,
}

impl rcgen::PublicKeyData for RequestKey {
    fn der_bytes(&self) -> &[u8] {
        &self.bits
    }

    fn algorithm(&self) -> &rcgen::SignatureAlgorithm {
        self.kind.algorithm()
    }
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFacts {
    /// The subject's attributes, in order: (OID, value; `None`: not a string).
    pub subject: Vec<(String, Option<String>)>,
    /// Every subject alternative name requested (from every extension request).
    pub names: Vec<Name>,
    /// Extensions other than subjectAltName, by OID.
    pub other_extensions: Vec<String>,
    /// Attributes other than the extension request (a challenge password...), by OID.
    pub other_attributes: Vec<String>,
    pub key: RequestKey,
}

/// The common name's OID.
pub const COMMON_NAME_OID: &str = "2.5.4.3";

impl RequestFacts {
    /// The subject's common names.
    pub fn common_names(&self) -> Vec<&str> {
        self.subject
            .iter()
            .filter(|(oid, _)| oid == COMMON_NAME_OID)
            .filter_map(|(_, v)| v.as_deref())
            .collect()
    }
}

/// Reads request `der` (trailing bytes are an error) and checks its signature with its own
/// key. Keys other than ECDSA P-256/P-384 and Ed25519 are refused (before the signature).
pub fn parse(der: &[u8]) -> Result<RequestFacts, PkiError> {
    let err = |detail: String| PkiError::Parse {
        what: "certificate request",
        detail,
    };
    let (rest, csr) = X509CertificationRequest::from_der(der).map_err(|e| err(e.to_string()))?;
    if !rest.is_empty() {
        return Err(err(format!("{} bytes after it", rest.len())));
    }
    let info = &csr.certification_request_info;
    let spki = &info.subject_pki;
    let alg = spki.algorithm.algorithm.to_id_string();
    let curve = spki
        .algorithm
        .parameters
        .as_ref()
        .filter(|p| p.header.tag() == x509_parser::der_parser::asn1_rs::Tag::Oid)
        .and_then(|p| x509_parser::der_parser::oid::Oid::try_from(p).ok())
        .map(|o| o.to_id_string());
    let kind = match (alg.as_str(), curve.as_deref()) {
        ("1.2.840.10045.2.1", Some("1.2.840.10045.3.1.7")) => KeyKind::EcdsaP256,
        ("1.2.840.10045.2.1", Some("1.3.132.0.34")) => KeyKind::EcdsaP384,
        ("1.3.101.112", None) => KeyKind::Ed25519,
        (a, c) => {
            return Err(PkiError::KeyAlgorithm(match c {
                Some(c) => format!("{a} ({c})"),
                None => a.to_string(),
            }))
        }
    };
    // The key first (a clear refusal for a kind calix does not take), then the proof that
    // the requester holds it.
    csr.verify_signature()
        .map_err(|e| PkiError::Signature(e.to_string()))?;
    let subject = info
        .subject
        .iter_attributes()
        .map(|a| {
            (
                a.attr_type().to_id_string(),
                a.as_str().ok().map(str::to_string),
            )
        })
        .collect();
    let mut names = Vec::new();
    let mut other_extensions = Vec::new();
    let mut other_attributes = Vec::new();
    for attr in info.iter_attributes() {
        match attr.parsed_attribute() {
            ParsedCriAttribute::ExtensionRequest(req) => {
                for ext in &req.extensions {
                    match ext.parsed_extension() {
                        ParsedExtension::SubjectAlternativeName(san) => {
                            names.extend(san.general_names.iter().map(super::cert::name));
                        }
                        _ if ext.oid.to_id_string() == SAN_OID => {
                            return Err(err("a subjectAltName that does not parse".into()))
                        }
                        _ => other_extensions.push(ext.oid.to_id_string()),
                    }
                }
            }
            _ if attr.oid.to_id_string() == EXTENSION_REQUEST_OID => {
                return Err(err("an extension request that does not parse".into()))
            }
            _ => other_attributes.push(attr.oid.to_id_string()),
        }
    }
    Ok(RequestFacts {
        subject,
        names,
        other_extensions,
        other_attributes,
        key: RequestKey {
            kind,
            bits: spki.subject_public_key.data.to_vec(),
            spki: spki.raw.to_vec(),
        },
    })
}

/// Reads a PEM request (what a CertificateSigningRequest's `spec.request` holds).
pub fn parse_pem(pem: &[u8]) -> Result<RequestFacts, PkiError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateSigningRequestDer;
    let der = CertificateSigningRequestDer::from_pem_slice(pem).map_err(|_| PkiError::Pem {
        expected: "CERTIFICATE REQUEST",
    })?;
    parse(der.as_ref())
}

/// A node's new key (ECDSA P-256, made here, in memory) and its request: subject CN = the
/// node, one DNS subject alternative name = the node, nothing else.
pub struct NewRequest {
    pub key: KeyPair,
    /// The request, PEM.
    pub pem: String,
}

/// A new key and request for node `node`.
pub fn new_request(node: &str) -> Result<NewRequest, PkiError> {
    let make = |what| move |source| PkiError::Make { what, source };
    let key = KeyPair::generate().map_err(make("key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, node.to_string());
    params.subject_alt_names = vec![SanType::DnsName(
        node.to_string().try_into().map_err(make("request"))?,
    )];
    let csr = params.serialize_request(&key).map_err(make("request"))?;
    let pem = csr.pem().map_err(make("request"))?;
    Ok(NewRequest { key, pem })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_request_names_its_node_and_carries_its_key() {
        let r = new_request("node-a").expect("request");
        let f = parse_pem(r.pem.as_bytes()).expect("parse");
        assert_eq!(f.common_names(), ["node-a"]);
        assert_eq!(f.subject.len(), 1);
        assert_eq!(f.names, vec![Name::Dns("node-a".into())]);
        assert!(f.other_extensions.is_empty() && f.other_attributes.is_empty());
        assert_eq!(f.key.kind, KeyKind::EcdsaP256);
        assert_eq!(f.key.spki, r.key.public_key_der());
    }

    #[test]
    fn a_request_whose_signature_is_not_its_keys_is_refused() {
        let r = new_request("node-a").expect("request");
        use rustls_pki_types::pem::PemObject;
        let mut der =
            rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(r.pem.as_bytes())
                .expect("pem")
                .as_ref()
                .to_vec();
        // Flip a bit in the signature (the request's last bytes).
        let last = der.len() - 1;
        der[last] ^= 1;
        assert!(matches!(parse(&der), Err(PkiError::Signature(_))));
        // And garbage, truncated or trailing bytes are errors, never a panic.
        let good = rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(r.pem.as_bytes())
            .expect("pem")
            .as_ref()
            .to_vec();
        for n in 0..good.len() {
            assert!(parse(&good[..n]).is_err());
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(parse(&trailing).is_err());
        assert!(parse_pem(b"not pem").is_err());
    }

    #[test]
    fn every_name_and_extension_of_a_request_is_seen() {
        let key = KeyPair::generate().expect("key");
        let mut p =
            CertificateParams::new(vec!["a".to_string(), "10.0.0.1".to_string()]).expect("params");
        p.distinguished_name.push(DnType::CommonName, "a");
        p.distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        p.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
        let pem = p.serialize_request(&key).expect("csr").pem().expect("pem");
        let f = parse_pem(pem.as_bytes()).expect("parse");
        assert_eq!(
            f.names,
            vec![Name::Dns("a".into()), Name::Other("IP:10.0.0.1".into())]
        );
        assert_eq!(f.other_extensions, ["2.5.29.15"]);
        assert!(f
            .subject
            .contains(&("2.5.4.10".into(), Some("system:masters".into()))));
    }

    /// `openssl req -new -newkey rsa:1024 -subj /CN=node-a -addext subjectAltName=DNS:node-a`
    const RSA_REQUEST: &str = "-----BEGIN CERTIFICATE REQUEST-----
MIIBdDCB3gIBADARMQ8wDQYDVQQDDAZub2RlLWEwgZ8wDQYJKoZIhvcNAQEBBQAD
gY0AMIGJAoGBAMxDokArrYKdCEKZgzteyQamIPNY+vkPpVh4kF6Tltg6vA09DdcC
PM9gujNH0amZlTQb+UNpUhn72Bef2ssB5xeUJ4uZn2NGih27aUAHQjq7DL/TLJ3F
yEhxWxVL9s2ggkL1M0ZqTAxy+L/ptOuiN4fbrvbtxdK8Q5nDvtyZmY1tAgMBAAGg
JDAiBgkqhkiG9w0BCQ4xFTATMBEGA1UdEQQKMAiCBm5vZGUtYTANBgkqhkiG9w0B
AQsFAAOBgQDFjFh7MVXpLMNkXfBa5ZiOPGU9Mvc8jSmlYAhGqOuJG8Sk2vtQnQ23
Cep/Sc9F/qLdvSqeo2a0Qmo3AO4/FHNjCsq4dneGEtfhhJrptSKsCHuQVoWkc69j
cKwy5s+m8xZDdQrfGhoNtL750gZl4IQtyUITvhhXu6tc9wiJLX7B0A==
-----END CERTIFICATE REQUEST-----
";

    #[test]
    fn an_rsa_key_is_refused_by_its_algorithm() {
        match parse_pem(RSA_REQUEST.as_bytes()) {
            Err(PkiError::KeyAlgorithm(alg)) => assert_eq!(alg, "1.2.840.113549.1.1.1"),
            other => panic!("{other:?}"),
        }
    }
}
