//! Object names and label values for calix keys. A Kubernetes object name must be a DNS-1123
//! subdomain (lowercase letters, digits, `-` and `.`, starting and ending with a letter or
//! digit, at most 253 characters) and a label value at most 63 characters of `[A-Za-z0-9_.-]`;
//! calix's keys hold anything (a CNI network name, a container ID, a node name, `:` and `/`).
//!
//! The name of the part of a key after its kind's prefix (its *rest*) is the rest itself when
//! that is a valid name that does not look hashed ([`object_name`]): blocks
//! (`10.244.0.64-26`, `fd00--40-122`), nodes and pools read as themselves. Anything else gets a
//! *hashed* name: a readable, sanitised form of the rest, then `-x` and 16 base32 characters of
//! its SHA-256 (80 bits). Plain names never look hashed, so a plain name and a hashed one
//! never meet; two hashed names meet only if SHA-256 collides in 80 bits. The object also
//! carries its whole key in an annotation, which the store checks on every read, so even that
//! would be an error, never one key's object read as another's.
use sha2::{Digest, Sha256};

/// Longest object name (DNS-1123 subdomain).
pub const MAX_NAME: usize = 253;
/// Longest label value.
pub const MAX_LABEL_VALUE: usize = 63;
/// Length of the sanitised part kept in front of a hash.
const READABLE: usize = 200;
/// Base32 characters of the hash (5 bits each: 80 bits).
const HASH_CHARS: usize = 16;
const BASE32: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// The object name for `rest` (the key after its kind's prefix).
pub fn object_name(rest: &str) -> String {
    if is_subdomain(rest) && !looks_hashed(rest) {
        rest.to_string()
    } else {
        hashed(rest, READABLE)
    }
}

/// The value of a label that selects by `value` (e.g. a node name): `value` itself when it is
/// a valid label value that does not look hashed, else a hashed form that fits.
pub fn label_value(value: &str) -> String {
    if is_label_value(value) && !looks_hashed(value) {
        value.to_string()
    } else {
        // 63 = readable part + "-x" + 16.
        hashed(value, MAX_LABEL_VALUE - 2 - HASH_CHARS)
    }
}

/// `<sanitised rest, at most readable chars>-x<hash>`, or `x<hash>` when nothing readable
/// is left.
fn hashed(rest: &str, readable: usize) -> String {
    let digest = Sha256::digest(rest.as_bytes());
    let hash = base32(&digest[..HASH_CHARS * 5 / 8]);
    let mut clean = String::with_capacity(rest.len().min(readable));
    for c in rest.chars() {
        let c = c.to_ascii_lowercase();
        let c = if c.is_ascii_lowercase() || c.is_ascii_digit() {
            c
        } else {
            '-'
        };
        if c == '-' && (clean.is_empty() || clean.ends_with('-')) {
            continue;
        }
        if clean.len() == readable {
            break;
        }
        clean.push(c);
    }
    let clean = clean.trim_end_matches('-');
    if clean.is_empty() {
        format!("x{hash}")
    } else {
        format!("{clean}-x{hash}")
    }
}

/// Whether `name` has the shape of a hashed name: ends with `x` and 16 base32 characters,
/// alone or after a `-`.
fn looks_hashed(name: &str) -> bool {
    let b = name.as_bytes();
    let tail = HASH_CHARS + 1;
    if b.len() < tail {
        return false;
    }
    let start = b.len() - tail;
    b[start] == b'x'
        && b[start + 1..].iter().all(|c| BASE32.contains(c))
        && (start == 0 || b[start - 1] == b'-')
}

/// RFC 4648 base32, lowercase, no padding (`bytes.len() * 8` a multiple of 5 here).
fn base32(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 8 / 5 + 1);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &b in bytes {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(BASE32[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(BASE32[((acc << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// A DNS-1123 subdomain, as Kubernetes checks object names.
pub fn is_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// A label value as Kubernetes checks it (the empty value aside, which calix never uses).
fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL_VALUE
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// What a hostile or merely unusual key may hold.
    fn hostile() -> Vec<String> {
        let mut v: Vec<String> = [
            "",
            "-",
            ".",
            "..",
            "a..b",
            "-a",
            "a-",
            "A",
            "a",
            "Node-A",
            "k8s-pod-network:0123456789abcdef/eth0",
            "k8s-pod-network.0123456789abcdef/eth0",
            "net:a/b/c",
            "n1/c1/eth0",
            "n1/c1/eth1",
            "n1-c1-eth0",
            "x",
            "xaaaaaaaaaaaaaaaa",
            "a-xaaaaaaaaaaaaaaaa",
            "ünïcödé",
            "名前",
            "a\0b",
            "a\nb",
            "a b",
            "a_b",
            "a/b",
            "a:b",
            "10.244.0.64-26",
            "fd00--40-122",
            "fd00::40/122",
            "../../etc/passwd",
            "%2F",
            "*",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.push("a".repeat(253));
        v.push("a".repeat(254));
        v.push("b".repeat(5000));
        v.push(format!("{}/{}", "n".repeat(300), "c".repeat(64)));
        v.push(format!("{}:", "z".repeat(252)));
        // A plain name shaped like the hashed name of another: never taken as plain.
        v.push(object_name("k8s:c/eth0"));
        v.push(label_value("Node A"));
        v
    }

    #[test]
    fn every_name_is_valid_and_distinct() {
        let mut seen: HashMap<String, String> = HashMap::new();
        for rest in hostile() {
            let name = object_name(&rest);
            assert!(
                is_subdomain(&name),
                "{rest:?} → {name:?} is not a valid name"
            );
            if let Some(other) = seen.insert(name.clone(), rest.clone()) {
                assert_eq!(
                    other, rest,
                    "{other:?} and {rest:?} share the name {name:?}"
                );
            }
        }
    }

    #[test]
    fn plain_names_read_as_themselves() {
        for rest in [
            "10.244.0.64-26",
            "fd00--40-122",
            "node-a",
            "default-ipv4",
            "a.b.c",
        ] {
            assert_eq!(object_name(rest), rest);
        }
        // Invalid as names: hashed, but still readable.
        let n = object_name("k8s-pod-network:0123456789abcdef/eth0");
        assert!(
            n.starts_with("k8s-pod-network-0123456789abcdef-eth0-x"),
            "{n}"
        );
        assert_eq!(
            n.len(),
            "k8s-pod-network-0123456789abcdef-eth0-x".len() + 16
        );
        // Case matters in a key: "A" and "a" are different objects.
        assert_ne!(object_name("A"), object_name("a"));
        assert_ne!(object_name("a/b"), object_name("a:b"));
    }

    #[test]
    fn something_shaped_like_a_hash_is_hashed_again() {
        let forged = object_name("k8s:c/eth0");
        assert!(looks_hashed(&forged));
        let again = object_name(&forged);
        assert_ne!(again, forged, "a plain key must not take a hashed name");
        assert!(is_subdomain(&again));
    }

    #[test]
    fn label_values_are_valid_and_distinct() {
        let mut seen: HashMap<String, String> = HashMap::new();
        for v in hostile() {
            let l = label_value(&v);
            assert!(is_label_value(&l), "{v:?} → {l:?} is not a label value");
            if let Some(other) = seen.insert(l.clone(), v.clone()) {
                assert_eq!(other, v, "{other:?} and {v:?} share the label {l:?}");
            }
        }
        assert_eq!(label_value("node-a"), "node-a");
        assert_eq!(label_value("Node_A.1"), "Node_A.1");
    }

    #[test]
    fn base32_matches_rfc4648() {
        assert_eq!(base32(b"fooba"), "mzxw6ytb");
        assert_eq!(base32(b""), "");
        assert_eq!(base32(b"f"), "my");
    }
}
