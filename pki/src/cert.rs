//! What calix reads in a certificate (DER, from a peer or the API): its names, serial,
//! validity and public key; and the one naming rule of route distribution: a node's
//! certificate names that node, in one DNS subject alternative name, and nothing else.
use std::time::SystemTime;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::{from_unix_secs, Name, PkiError};

/// A certificate's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFacts {
    /// The serial number, hex with `:` between bytes.
    pub serial: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// Its subject alternative names, in order.
    pub names: Vec<Name>,
    /// Its SubjectPublicKeyInfo (DER).
    pub public_key: Vec<u8>,
    /// The subject's raw DER (what an issued certificate's issuer must equal byte for byte).
    pub subject: Vec<u8>,
}

/// The facts of certificate `der` (trailing bytes are an error).
pub fn facts(der: &[u8]) -> Result<CertFacts, PkiError> {
    let parse = |detail: String| PkiError::Parse {
        what: "certificate",
        detail,
    };
    let (rest, cert) = X509Certificate::from_der(der).map_err(|e| parse(e.to_string()))?;
    if !rest.is_empty() {
        return Err(parse(format!("{} bytes after it", rest.len())));
    }
    let names = match cert.subject_alternative_name() {
        Ok(Some(san)) => san.value.general_names.iter().map(name).collect(),
        Ok(None) => Vec::new(),
        Err(e) => return Err(parse(format!("subject alternative names: {e}"))),
    };
    let v = cert.validity();
    Ok(CertFacts {
        serial: cert.raw_serial_as_string(),
        not_before: from_unix_secs(v.not_before.timestamp()),
        not_after: from_unix_secs(v.not_after.timestamp()),
        names,
        public_key: cert.public_key().raw.to_vec(),
        subject: cert.subject().as_raw().to_vec(),
    })
}

/// A general name, as calix tells them apart.
pub(super) fn name(g: &GeneralName<'_>) -> Name {
    match g {
        GeneralName::DNSName(n) => Name::Dns((*n).to_string()),
        GeneralName::IPAddress(b) => Name::Other(match b.len() {
            4 => format!("IP:{}", std::net::Ipv4Addr::from([b[0], b[1], b[2], b[3]])),
            16 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(b);
                format!("IP:{}", std::net::Ipv6Addr::from(a))
            }
            n => format!("IP:<{n} bytes>"),
        }),
        GeneralName::RFC822Name(m) => Name::Other(format!("email:{m}")),
        GeneralName::URI(u) => Name::Other(format!("URI:{u}")),
        GeneralName::DirectoryName(d) => Name::Other(format!("dirName:{d}")),
        GeneralName::OtherName(oid, _) => Name::Other(format!("otherName:{oid}")),
        GeneralName::RegisteredID(oid) => Name::Other(format!("registeredID:{oid}")),
        GeneralName::X400Address(_) => Name::Other("x400Address".into()),
        GeneralName::EDIPartyName(_) => Name::Other("ediPartyName".into()),
    }
}

/// Why a certificate does not identify exactly the node expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("the certificate cannot be read: {0}")]
    Unreadable(String),
    #[error("the certificate has no subject alternative name")]
    NoName,
    #[error("the certificate names more than one node or name ({0}): a node's certificate names only its node")]
    MoreThanOne(String),
    #[error("the certificate's name {0} is not a DNS name")]
    NotDns(String),
    #[error("the certificate names {found:?}, not {expected:?}")]
    Other { found: String, expected: String },
}

/// The single node a certificate names: its one subject alternative name, a DNS name.
pub fn single_node(names: &[Name]) -> Result<&str, NameError> {
    match names {
        [] => Err(NameError::NoName),
        [Name::Dns(n)] => Ok(n),
        [other] => Err(NameError::NotDns(other.to_string())),
        many => Err(NameError::MoreThanOne(
            many.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        )),
    }
}

/// Whether certificate `der` names node `node` and nothing else (DNS names compare without
/// regard to case). The chain and dates are the handshake's business.
pub fn names_only(der: &[u8], node: &str) -> Result<(), NameError> {
    let f = facts(der).map_err(|e| NameError::Unreadable(e.to_string()))?;
    let found = single_node(&f.names)?;
    if found.eq_ignore_ascii_case(node) {
        Ok(())
    } else {
        Err(NameError::Other {
            found: found.to_string(),
            expected: node.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType};

    fn cert(sans: Vec<SanType>) -> Vec<u8> {
        let mut p = CertificateParams::default();
        p.subject_alt_names = sans;
        let key = KeyPair::generate().expect("key");
        p.self_signed(&key).expect("cert").der().to_vec()
    }

    fn dns(n: &str) -> SanType {
        SanType::DnsName(n.try_into().expect("ia5"))
    }

    #[test]
    fn a_node_certificate_names_its_node_alone() {
        assert_eq!(names_only(&cert(vec![dns("node-a")]), "node-a"), Ok(()));
        assert_eq!(names_only(&cert(vec![dns("Node-A")]), "node-a"), Ok(()));
        assert!(matches!(
            names_only(&cert(vec![dns("node-b")]), "node-a"),
            Err(NameError::Other { .. })
        ));
        let two = names_only(&cert(vec![dns("node-a"), dns("node-b")]), "node-a");
        assert_eq!(
            two,
            Err(NameError::MoreThanOne("DNS:node-a, DNS:node-b".into()))
        );
        assert!(two.unwrap_err().to_string().contains("more than one node"));
        let ip = SanType::IpAddress("10.0.0.1".parse().expect("ip"));
        assert_eq!(
            names_only(&cert(vec![ip.clone()]), "node-a"),
            Err(NameError::NotDns("IP:10.0.0.1".into()))
        );
        assert!(matches!(
            names_only(&cert(vec![dns("node-a"), ip]), "node-a"),
            Err(NameError::MoreThanOne(_))
        ));
        assert_eq!(names_only(&cert(vec![]), "node-a"), Err(NameError::NoName));
        assert!(matches!(
            names_only(b"\x30\x03\x02\x01\x01", "node-a"),
            Err(NameError::Unreadable(_))
        ));
    }

    #[test]
    fn facts_carry_the_serial_dates_and_key() {
        let mut p = CertificateParams::new(vec!["n".to_string()]).expect("params");
        p.serial_number = Some(vec![0x01, 0xab].into());
        p.not_before = time::OffsetDateTime::from_unix_timestamp(1_000_000).expect("t");
        p.not_after = time::OffsetDateTime::from_unix_timestamp(2_000_000).expect("t");
        let key = KeyPair::generate().expect("key");
        let c = p.self_signed(&key).expect("cert");
        let f = facts(c.der()).expect("facts");
        assert_eq!(f.serial, "01:ab");
        assert_eq!(super::super::unix_secs(f.not_before), 1_000_000);
        assert_eq!(super::super::unix_secs(f.not_after), 2_000_000);
        assert_eq!(f.names, vec![Name::Dns("n".into())]);
        assert_eq!(f.public_key, key.public_key_der());
        let mut long = c.der().to_vec();
        long.push(0);
        assert!(facts(&long).is_err(), "trailing bytes");
    }
}
