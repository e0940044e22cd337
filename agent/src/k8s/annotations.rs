//! A pod's IPAM annotations, as Calico has them: `calix.dev/ipv4pools` and
//! `calix.dev/ipv6pools` (a JSON list of IPPool names or CIDRs: the pod's address of that
//! family comes only from those pools) and `calix.dev/ipAddrs` (a JSON list of at most one
//! address per family: the pod gets exactly that address). The pool annotations of the pod's
//! namespace are the fallback for a pod without its own; a fixed address is the pod's alone
//! (a namespace-wide fixed address would be every pod's). Everything here is what a user who
//! may create pods wrote: anything malformed is an error that names the annotation and where
//! it is, and nothing is guessed.
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

pub const IPV4_POOLS: &str = "calix.dev/ipv4pools";
pub const IPV6_POOLS: &str = "calix.dev/ipv6pools";
pub const IP_ADDRS: &str = "calix.dev/ipAddrs";
/// Most entries one annotation may list.
const MAX_ENTRIES: usize = 16;

/// A bad annotation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation} on {on}: {detail}")]
pub struct AnnotationError {
    pub annotation: &'static str,
    /// `pod <ns>/<name>` or `namespace <ns>`.
    pub on: String,
    pub detail: String,
}

/// A pool as the annotations can name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPool {
    /// The IPPool object's name.
    pub name: String,
    pub cidr: IpNet,
    /// Enabled and selecting this node.
    pub usable: bool,
}

/// What a pod's annotations ask of IPAM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodIpam {
    /// The pools new addresses may come from (per family: only when it names one of the
    /// family); `None`: any.
    pub pools: Option<Vec<IpNet>>,
    /// Fixed addresses, at most one per family.
    pub addresses: Vec<IpAddr>,
}

/// The pod's IPAM from the annotations of pod `namespace/name` and of its namespace.
pub fn resolve(
    namespace: &str,
    name: &str,
    pod: &BTreeMap<String, String>,
    ns: &BTreeMap<String, String>,
    pools: &[NamedPool],
) -> Result<PodIpam, AnnotationError> {
    let on_pod = format!("pod {namespace}/{name}");
    let on_ns = format!("namespace {namespace}");
    let mut out = PodIpam::default();
    let mut pod_pools = false;
    for (annotation, v4) in [(IPV4_POOLS, true), (IPV6_POOLS, false)] {
        let (value, on) = match (pod.get(annotation), ns.get(annotation)) {
            (Some(v), _) => {
                pod_pools = true;
                (v, &on_pod)
            }
            (None, Some(v)) => (v, &on_ns),
            (None, None) => continue,
        };
        let err = |detail: String| AnnotationError {
            annotation,
            on: on.clone(),
            detail,
        };
        let mut chosen = Vec::new();
        for entry in list(value).map_err(err)? {
            let pool = pools
                .iter()
                .find(|p| p.name == entry)
                .or_else(|| {
                    let cidr: IpNet = entry.parse().ok()?;
                    pools.iter().find(|p| p.cidr == cidr.trunc())
                })
                .ok_or_else(|| err(format!("{entry:?} names no IPPool (by name or CIDR)")))?;
            if pool.cidr.addr().is_ipv4() != v4 {
                return Err(err(format!(
                    "IPPool {} ({}) is not an IPv{} pool",
                    pool.name,
                    pool.cidr,
                    if v4 { 4 } else { 6 }
                )));
            }
            if !pool.usable {
                return Err(err(format!(
                    "IPPool {} ({}) is disabled or does not select this node",
                    pool.name, pool.cidr
                )));
            }
            chosen.push(pool.cidr);
        }
        out.pools.get_or_insert_with(Vec::new).extend(chosen);
    }
    if let Some(value) = pod.get(IP_ADDRS) {
        let err = |detail: String| AnnotationError {
            annotation: IP_ADDRS,
            on: on_pod.clone(),
            detail,
        };
        if pod_pools {
            return Err(err(format!(
                "a fixed address and {IPV4_POOLS}/{IPV6_POOLS} on one pod: choose one"
            )));
        }
        for entry in list(value).map_err(err)? {
            let addr: IpAddr = entry
                .parse()
                .map_err(|_| err(format!("{entry:?} is not an IP address")))?;
            if out.addresses.iter().any(|a| a.is_ipv4() == addr.is_ipv4()) {
                return Err(err(format!(
                    "more than one IPv{} address",
                    if addr.is_ipv4() { 4 } else { 6 }
                )));
            }
            out.addresses.push(addr);
        }
        // A fixed address is taken from whichever pool holds it.
        out.pools = None;
    }
    Ok(out)
}

/// A JSON list of strings, not empty, at most [`MAX_ENTRIES`].
fn list(value: &str) -> Result<Vec<String>, String> {
    let v: Vec<String> = serde_json::from_str(value)
        .map_err(|e| format!("not a JSON list of strings (e.g. [\"10.244.0.0/16\"]): {e}"))?;
    if v.is_empty() {
        return Err("an empty list".into());
    }
    if v.len() > MAX_ENTRIES {
        return Err(format!("{} entries, at most {MAX_ENTRIES}", v.len()));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools() -> Vec<NamedPool> {
        [
            ("blue", "10.1.0.0/16", true),
            ("green", "10.2.0.0/16", true),
            ("off", "10.3.0.0/16", false),
            ("six", "fd00:1::/64", true),
        ]
        .iter()
        .map(|(n, c, u)| NamedPool {
            name: n.to_string(),
            cidr: c.parse().expect("cidr"),
            usable: *u,
        })
        .collect()
    }

    fn m(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn go(pod: &[(&str, &str)], ns: &[(&str, &str)]) -> Result<PodIpam, AnnotationError> {
        resolve("shop", "web", &m(pod), &m(ns), &pools())
    }

    #[test]
    fn pools_by_name_or_cidr_the_pods_own_over_its_namespaces() {
        let cidr = |s: &str| s.parse::<IpNet>().expect("cidr");
        assert_eq!(go(&[], &[]).expect("none"), PodIpam::default());
        let got = go(&[], &[(IPV4_POOLS, r#"["green"]"#)]).expect("namespace");
        assert_eq!(got.pools, Some(vec![cidr("10.2.0.0/16")]));
        let got = go(
            &[
                (IPV4_POOLS, r#"["10.1.0.0/16"]"#),
                (IPV6_POOLS, r#"["six"]"#),
            ],
            &[(IPV4_POOLS, r#"["green"]"#)],
        )
        .expect("pod");
        assert_eq!(
            got.pools,
            Some(vec![cidr("10.1.0.0/16"), cidr("fd00:1::/64")])
        );
        let got = go(
            &[(IP_ADDRS, r#"["10.1.0.7", "fd00:1::7"]"#)],
            &[(IPV4_POOLS, r#"["green"]"#)],
        )
        .expect("fixed");
        assert_eq!(got.addresses.len(), 2);
        assert_eq!(got.pools, None);
    }

    #[test]
    fn bad_annotations_are_errors_that_name_them() {
        type Annotations<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Annotations, Annotations, &str, &str, &str)] = &[
            (
                &[(IPV4_POOLS, "blue")],
                &[],
                IPV4_POOLS,
                "pod shop/web",
                "JSON list",
            ),
            (&[(IPV4_POOLS, "[]")], &[], IPV4_POOLS, "pod", "empty"),
            (
                &[(IPV4_POOLS, r#"["nope"]"#)],
                &[],
                IPV4_POOLS,
                "pod",
                "\"nope\" names no IPPool",
            ),
            (
                &[(IPV4_POOLS, r#"["six"]"#)],
                &[],
                IPV4_POOLS,
                "pod",
                "not an IPv4 pool",
            ),
            (
                &[(IPV4_POOLS, r#"["off"]"#)],
                &[],
                IPV4_POOLS,
                "pod",
                "disabled",
            ),
            (
                &[],
                &[(IPV6_POOLS, r#"[1]"#)],
                IPV6_POOLS,
                "namespace shop",
                "JSON list",
            ),
            (
                &[(IP_ADDRS, r#"["10.1.0.400"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "not an IP address",
            ),
            (
                &[(IP_ADDRS, r#"["10.1.0.1","10.1.0.2"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "more than one IPv4",
            ),
            (
                &[(IP_ADDRS, r#"["10.1.0.1"]"#), (IPV4_POOLS, r#"["blue"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "choose one",
            ),
        ];
        for (pod, ns, annotation, on, detail) in cases {
            let e = go(pod, ns).expect_err(detail);
            assert_eq!(e.annotation, *annotation, "{e}");
            assert!(e.on.starts_with(on), "{e}");
            assert!(e.to_string().contains(detail), "{e}");
            assert!(e.to_string().contains(annotation), "{e}");
        }
        let many = format!("[{}]", vec!["\"blue\""; 17].join(","));
        assert!(go(&[(IPV4_POOLS, &many)], &[]).is_err());
    }
}
