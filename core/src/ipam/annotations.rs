//! Which pools a pod's addresses may come from: its namespace's (the pools whose
//! `namespaceSelector` matches the Namespace's labels, and those without one), narrowed by the
//! IPAM annotations, as Calico has them: `calix.dev/ipv4pools` and `calix.dev/ipv6pools` (a
//! JSON list of IPPool names or CIDRs: the pod's address of that family comes only from those
//! pools) and `calix.dev/ipAddrs` (a JSON list of at most one address per family: the pod gets
//! exactly that address). The pool annotations of the pod's namespace are the fallback for a
//! pod without its own; a fixed address is the pod's alone (a namespace-wide fixed address
//! would be every pod's).
//!
//! Annotations only choose among the pools the namespace may use: a pool that does not serve
//! the namespace is refused whether it is named by a pool annotation or holds a fixed address,
//! and a fixed address of one family leaves the other family to the namespace's pools.
//! Everything here is what a user who may create pods wrote: anything malformed or not allowed
//! is an error that names the annotation, where it is, the pool and the rule; nothing is
//! guessed.
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::PoolChoice;
use crate::selector::LabelSelector;

pub const IPV4_POOLS: &str = "calix.dev/ipv4pools";
pub const IPV6_POOLS: &str = "calix.dev/ipv6pools";
pub const IP_ADDRS: &str = "calix.dev/ipAddrs";
/// Most entries one annotation may list.
const MAX_ENTRIES: usize = 16;
/// Most characters of an entry a message repeats.
const SHOWN: usize = 64;

/// A bad annotation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation} on {on}: {detail}")]
pub struct AnnotationError {
    pub annotation: &'static str,
    /// `pod <ns>/<name>` or `namespace <ns>`.
    pub on: String,
    pub detail: String,
}

/// Why a pod gets no address: a bad annotation, or no pool of a family it needs serves its
/// namespace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodIpamError {
    #[error(transparent)]
    Annotation(#[from] AnnotationError),
    #[error(
        "pod {namespace}/{pod}: no {family} pool of this node serves namespace {namespace}: {why}"
    )]
    NoPool {
        namespace: String,
        pod: String,
        family: &'static str,
        /// Each pool of the family this node uses, and the rule that leaves it out.
        why: String,
    },
}

/// A pool as the annotations can name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPool {
    /// The IPPool object's name.
    pub name: String,
    pub cidr: IpNet,
    /// Enabled and selecting this node.
    pub usable: bool,
    pub namespace_selector: Option<LabelSelector>,
}

/// The pod's namespace: its name, labels and annotations. `labels` is `None` when the
/// Namespace could not be found: no namespaceSelector matches it.
#[derive(Debug, Clone, Copy)]
pub struct Namespace<'a> {
    pub name: &'a str,
    pub labels: Option<&'a BTreeMap<String, String>>,
    pub annotations: &'a BTreeMap<String, String>,
}

/// What a pod's namespace and annotations allow of IPAM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodIpam {
    /// The pools each family may use (always both: a pod never uses a pool its namespace may
    /// not).
    pub pools: PoolChoice,
    /// Fixed addresses, at most one per family, each in a pool of `pools`.
    pub addresses: Vec<IpAddr>,
}

impl NamedPool {
    fn is_v4(&self) -> bool {
        self.cidr.addr().is_ipv4()
    }

    /// `Err(rule)` when the pod's namespace may not use this pool here.
    fn serves(&self, ns: &Namespace<'_>) -> Result<(), PoolRefusal> {
        if !self.usable {
            return Err(PoolRefusal::NotHere);
        }
        match (&self.namespace_selector, ns.labels) {
            (None, _) => Ok(()),
            (Some(sel), Some(labels)) if sel.matches(labels) => Ok(()),
            (Some(sel), Some(_)) => Err(PoolRefusal::OtherNamespaces {
                namespace: ns.name.to_string(),
                selector: sel.to_string(),
            }),
            (Some(sel), None) => Err(PoolRefusal::NamespaceNotFound {
                namespace: ns.name.to_string(),
                selector: sel.to_string(),
            }),
        }
    }

    fn describe(&self) -> String {
        format!("pool {} ({})", self.name, self.cidr)
    }
}

/// Why a pool does not serve a pod's namespace here: the rule, read after the pool's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolRefusal {
    #[error("is disabled or does not select this node (nodeSelector)")]
    NotHere,
    #[error("does not serve namespace {namespace} (namespaceSelector {selector})")]
    OtherNamespaces { namespace: String, selector: String },
    #[error(
        "serves only namespaces its namespaceSelector ({selector}) matches, and namespace {namespace} was not found"
    )]
    NamespaceNotFound { namespace: String, selector: String },
}

fn family_name(v4: bool) -> &'static str {
    if v4 {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// `entry` as a message repeats it: quoted, cut after [`SHOWN`] characters.
fn shown(entry: &str) -> String {
    if entry.chars().count() > SHOWN {
        let cut: String = entry.chars().take(SHOWN).collect();
        format!("{cut:?}…")
    } else {
        format!("{entry:?}")
    }
}

/// The pools pod `pod` of namespace `ns` may use and its fixed addresses, for an allocation of
/// the families `v4` / `v6` the network assigns, from the pod's `annotations` and its
/// namespace's.
pub fn resolve(
    ns: &Namespace<'_>,
    pod: &str,
    annotations: &BTreeMap<String, String>,
    pools: &[NamedPool],
    (v4, v6): (bool, bool),
) -> Result<PodIpam, PodIpamError> {
    let on_pod = format!("pod {}/{pod}", ns.name);
    let on_ns = format!("namespace {}", ns.name);
    let addresses = fixed_addresses(ns, &on_pod, annotations, pools, (v4, v6))?;
    let mut out = PodIpam {
        addresses,
        ..PodIpam::default()
    };
    for (annotation, fam) in [(IPV4_POOLS, true), (IPV6_POOLS, false)] {
        let fixed = out.addresses.iter().any(|a| a.is_ipv4() == fam);
        let asked = match (annotations.get(annotation), ns.annotations.get(annotation)) {
            _ if fixed => None,
            (Some(v), _) => Some((v, &on_pod)),
            (None, Some(v)) => Some((v, &on_ns)),
            (None, None) => None,
        };
        let chosen = match asked {
            Some((value, on)) => named(annotation, on, value, fam, ns, pools)?,
            None => {
                let serving: Vec<IpNet> = pools
                    .iter()
                    .filter(|p| p.is_v4() == fam && p.serves(ns).is_ok())
                    .map(|p| p.cidr)
                    .collect();
                let needed = if fam { v4 } else { v6 };
                let here: Vec<&NamedPool> = pools
                    .iter()
                    .filter(|p| p.is_v4() == fam && p.usable)
                    .collect();
                if needed && serving.is_empty() && !here.is_empty() {
                    return Err(PodIpamError::NoPool {
                        namespace: ns.name.to_string(),
                        pod: pod.to_string(),
                        family: family_name(fam),
                        why: here
                            .iter()
                            .map(|p| {
                                format!(
                                    "{} {}",
                                    p.describe(),
                                    p.serves(ns)
                                        .err()
                                        .map(|r| r.to_string())
                                        .unwrap_or_default()
                                )
                            })
                            .collect::<Vec<_>>()
                            .join("; "),
                    });
                }
                serving
            }
        };
        if fam {
            out.pools.v4 = Some(chosen);
        } else {
            out.pools.v6 = Some(chosen);
        }
    }
    Ok(out)
}

/// The pools a pool annotation (`annotation` on `on`, of family `v4`) names, each one the
/// namespace may use.
fn named(
    annotation: &'static str,
    on: &str,
    value: &str,
    v4: bool,
    ns: &Namespace<'_>,
    pools: &[NamedPool],
) -> Result<Vec<IpNet>, AnnotationError> {
    let err = |detail: String| AnnotationError {
        annotation,
        on: on.to_string(),
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
            .ok_or_else(|| {
                err(format!(
                    "{} names no IPPool (by name or CIDR)",
                    shown(&entry)
                ))
            })?;
        if pool.is_v4() != v4 {
            return Err(err(format!(
                "IPPool {} ({}) is not an {} pool",
                pool.name,
                pool.cidr,
                family_name(v4)
            )));
        }
        if chosen.contains(&pool.cidr) {
            return Err(err(format!("{} is listed twice", pool.describe())));
        }
        pool.serves(ns)
            .map_err(|rule| err(format!("{} {rule}", pool.describe())))?;
        chosen.push(pool.cidr);
    }
    Ok(chosen)
}

/// The pod's `calix.dev/ipAddrs`: at most one address per family, of a family the network
/// assigns, each in a pool the namespace may use.
fn fixed_addresses(
    ns: &Namespace<'_>,
    on_pod: &str,
    annotations: &BTreeMap<String, String>,
    pools: &[NamedPool],
    (v4, v6): (bool, bool),
) -> Result<Vec<IpAddr>, AnnotationError> {
    let Some(value) = annotations.get(IP_ADDRS) else {
        return Ok(Vec::new());
    };
    let err = |detail: String| AnnotationError {
        annotation: IP_ADDRS,
        on: on_pod.to_string(),
        detail,
    };
    if annotations.contains_key(IPV4_POOLS) || annotations.contains_key(IPV6_POOLS) {
        return Err(err(format!(
            "a fixed address and {IPV4_POOLS}/{IPV6_POOLS} on one pod: choose one"
        )));
    }
    let mut out: Vec<IpAddr> = Vec::new();
    for entry in list(value).map_err(err)? {
        let addr: IpAddr = entry
            .parse()
            .map_err(|_| err(format!("{} is not an IP address", shown(&entry))))?;
        let fam = family_name(addr.is_ipv4());
        if out.iter().any(|a| a.is_ipv4() == addr.is_ipv4()) {
            return Err(err(format!("more than one {fam} address")));
        }
        if !(if addr.is_ipv4() { v4 } else { v6 }) {
            return Err(err(format!(
                "{addr} is an {fam} address, and this network assigns no {fam} addresses \
                 (its ipam.assign_ipv4 / assign_ipv6)"
            )));
        }
        let pool = pools
            .iter()
            .find(|p| p.cidr.contains(&addr))
            .ok_or_else(|| err(format!("{addr} is not in any IPPool")))?;
        pool.serves(ns)
            .map_err(|rule| err(format!("{addr} is in {}, which {rule}", pool.describe())))?;
        out.push(addr);
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

    fn selector(json: &str) -> Option<LabelSelector> {
        Some(serde_json::from_str(json).expect("a selector"))
    }

    /// blue, green (and six, v6) serve every namespace; off is disabled; tenant serves
    /// `tenant: a` only, and tenant6 (v6) too; other6 serves `tenant: b`.
    fn pools() -> Vec<NamedPool> {
        let a = r#"{"matchLabels": {"tenant": "a"}}"#;
        [
            ("blue", "10.1.0.0/16", true, None),
            ("green", "10.2.0.0/16", true, None),
            ("off", "10.3.0.0/16", false, None),
            ("tenant", "10.4.0.0/16", true, selector(a)),
            ("six", "fd00:1::/64", true, None),
            ("tenant6", "fd00:4::/64", true, selector(a)),
            (
                "other6",
                "fd00:5::/64",
                true,
                selector(r#"{"matchExpressions": [{"key": "tenant", "operator": "In", "values": ["b"]}]}"#),
            ),
        ]
        .into_iter()
        .map(|(n, c, u, s)| NamedPool {
            name: n.to_string(),
            cidr: c.parse().expect("cidr"),
            usable: u,
            namespace_selector: s,
        })
        .collect()
    }

    fn m(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn cidrs(list: &[&str]) -> Option<Vec<IpNet>> {
        Some(list.iter().map(|s| s.parse().expect("cidr")).collect())
    }

    /// Pod shop/web with annotations `pod` in a namespace with `ns` annotations and `labels`
    /// (`None`: no such Namespace), dual stack.
    fn go_in(
        pod: &[(&str, &str)],
        ns: &[(&str, &str)],
        labels: Option<&[(&str, &str)]>,
        pools: &[NamedPool],
    ) -> Result<PodIpam, PodIpamError> {
        let labels = labels.map(m);
        let ns_annotations = m(ns);
        let namespace = Namespace {
            name: "shop",
            labels: labels.as_ref(),
            annotations: &ns_annotations,
        };
        resolve(&namespace, "web", &m(pod), pools, (true, true))
    }

    fn go(pod: &[(&str, &str)], ns: &[(&str, &str)]) -> Result<PodIpam, PodIpamError> {
        go_in(pod, ns, Some(&[]), &pools())
    }

    #[test]
    fn pools_by_name_or_cidr_the_pods_own_over_its_namespaces() {
        let got = go(&[], &[]).expect("none");
        assert_eq!(got.pools.v4, cidrs(&["10.1.0.0/16", "10.2.0.0/16"]));
        assert_eq!(got.pools.v6, cidrs(&["fd00:1::/64"]));
        let got = go(&[], &[(IPV4_POOLS, r#"["green"]"#)]).expect("namespace");
        assert_eq!(got.pools.v4, cidrs(&["10.2.0.0/16"]));
        let got = go(
            &[
                (IPV4_POOLS, r#"["10.1.0.0/16"]"#),
                (IPV6_POOLS, r#"["six"]"#),
            ],
            &[(IPV4_POOLS, r#"["green"]"#)],
        )
        .expect("pod");
        assert_eq!(got.pools.v4, cidrs(&["10.1.0.0/16"]));
        assert_eq!(got.pools.v6, cidrs(&["fd00:1::/64"]));
        let got = go(
            &[(IP_ADDRS, r#"["10.1.0.7", "fd00:1::7"]"#)],
            &[(IPV4_POOLS, r#"["green"]"#)],
        )
        .expect("fixed");
        assert_eq!(got.addresses.len(), 2);
    }

    #[test]
    fn a_namespace_selector_decides_which_pools_a_namespace_may_use() {
        let a = [("tenant", "a")];
        // Tenant a: its pools and the shared ones, never other6.
        let got = go_in(&[], &[], Some(&a), &pools()).expect("tenant a");
        assert_eq!(
            got.pools.v4,
            cidrs(&["10.1.0.0/16", "10.2.0.0/16", "10.4.0.0/16"])
        );
        assert_eq!(got.pools.v6, cidrs(&["fd00:1::/64", "fd00:4::/64"]));
        let got = go_in(&[(IPV4_POOLS, r#"["tenant"]"#)], &[], Some(&a), &pools())
            .expect("its own pool by annotation");
        assert_eq!(got.pools.v4, cidrs(&["10.4.0.0/16"]));
        let got = go_in(&[(IP_ADDRS, r#"["10.4.0.9"]"#)], &[], Some(&a), &pools())
            .expect("a fixed address in its pool");
        assert_eq!(got.addresses, ["10.4.0.9".parse::<IpAddr>().expect("ip")]);
        // A fixed IPv4 address leaves IPv6 to the namespace's pools, and to the namespace's
        // pool annotation.
        assert_eq!(got.pools.v6, cidrs(&["fd00:1::/64", "fd00:4::/64"]));
        let got = go_in(
            &[(IP_ADDRS, r#"["10.4.0.9"]"#)],
            &[(IPV6_POOLS, r#"["tenant6"]"#)],
            Some(&a),
            &pools(),
        )
        .expect("fixed v4, namespace's v6 pool");
        assert_eq!(got.pools.v6, cidrs(&["fd00:4::/64"]));
        // Another namespace, or one that cannot be read: never the tenant's pools.
        for labels in [Some(&[("tenant", "c")][..]), Some(&[][..]), None] {
            let got = go_in(&[], &[], labels, &pools()).expect("shared only");
            assert_eq!(got.pools.v4, cidrs(&["10.1.0.0/16", "10.2.0.0/16"]));
            assert_eq!(got.pools.v6, cidrs(&["fd00:1::/64"]));
            for (pod, ns, annotation, on, says) in [
                (
                    vec![(IPV4_POOLS, r#"["tenant"]"#)],
                    vec![],
                    IPV4_POOLS,
                    "pod shop/web",
                    "pool tenant (10.4.0.0/16)",
                ),
                (
                    vec![],
                    vec![(IPV4_POOLS, r#"["10.4.0.0/16"]"#)],
                    IPV4_POOLS,
                    "namespace shop",
                    "pool tenant (10.4.0.0/16)",
                ),
                (
                    vec![(IP_ADDRS, r#"["10.4.0.9"]"#)],
                    vec![],
                    IP_ADDRS,
                    "pod shop/web",
                    "10.4.0.9 is in pool tenant (10.4.0.0/16), which",
                ),
            ] {
                let e = go_in(&pod, &ns, labels, &pools()).expect_err(says);
                let PodIpamError::Annotation(a) = &e else {
                    panic!("{e}")
                };
                assert_eq!((a.annotation, a.on.as_str()), (annotation, on), "{e}");
                let msg = e.to_string();
                assert!(msg.contains(says), "{msg}");
                let rule = if labels.is_some() {
                    "does not serve namespace shop (namespaceSelector tenant=a)"
                } else {
                    "namespace shop was not found"
                };
                assert!(msg.contains(rule), "{msg}");
            }
        }
        // No IPv6 pool serves the namespace: refused, each pool and its rule named.
        let only_restricted6: Vec<NamedPool> =
            pools().into_iter().filter(|p| p.name != "six").collect();
        let e = go_in(&[], &[], Some(&[("tenant", "c")]), &only_restricted6).expect_err("no v6");
        let msg = e.to_string();
        assert!(
            matches!(e, PodIpamError::NoPool { family: "IPv6", .. })
                && msg.contains("pool tenant6 (fd00:4::/64) does not serve namespace shop (namespaceSelector tenant=a)")
                && msg.contains("pool other6 (fd00:5::/64) does not serve namespace shop (namespaceSelector tenant in (b))"),
            "{msg}"
        );
        // Also with a fixed IPv4 address: it does not lift the restriction for IPv6.
        let e = go_in(
            &[(IP_ADDRS, r#"["10.1.0.9"]"#)],
            &[],
            Some(&[("tenant", "c")]),
            &only_restricted6,
        )
        .expect_err("no v6 for the fixed v4 pod either");
        assert!(
            matches!(e, PodIpamError::NoPool { family: "IPv6", .. }),
            "{e}"
        );
        // An IPv4-only network does not need one.
        let ns = m(&[]);
        let labels = m(&[("tenant", "c")]);
        let namespace = Namespace {
            name: "shop",
            labels: Some(&labels),
            annotations: &ns,
        };
        let got = resolve(&namespace, "web", &m(&[]), &only_restricted6, (true, false))
            .expect("IPv4 only");
        assert_eq!(got.pools.v6, Some(vec![]));
    }

    #[test]
    fn bad_annotations_are_errors_that_name_them() {
        type Annotations<'a> = &'a [(&'a str, &'a str)];
        let long = format!("[\"{}\"]", "x".repeat(100_000));
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
                "pool off (10.3.0.0/16) is disabled",
            ),
            (
                &[(IPV4_POOLS, r#"["blue", "10.1.0.0/16"]"#)],
                &[],
                IPV4_POOLS,
                "pod",
                "pool blue (10.1.0.0/16) is listed twice",
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
                &[(IP_ADDRS, r#"["10.1.0.1/32"]"#)],
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
                &[(IP_ADDRS, r#"["10.1.0.1","10.1.0.1"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "more than one IPv4",
            ),
            (
                &[(IP_ADDRS, r#"["10.9.0.1"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "10.9.0.1 is not in any IPPool",
            ),
            (
                &[(IP_ADDRS, r#"["10.3.0.1"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "10.3.0.1 is in pool off (10.3.0.0/16), which is disabled",
            ),
            (
                &[(IP_ADDRS, r#"["10.1.0.1"]"#), (IPV4_POOLS, r#"["blue"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "choose one",
            ),
            (
                &[(IP_ADDRS, r#"["10.1.0.1"]"#), (IPV6_POOLS, r#"["six"]"#)],
                &[],
                IP_ADDRS,
                "pod",
                "choose one",
            ),
            (
                &[(IPV4_POOLS, &long)],
                &[],
                IPV4_POOLS,
                "pod",
                "names no IPPool",
            ),
        ];
        for (pod, ns, annotation, on, detail) in cases {
            let e = match go(pod, ns).expect_err(detail) {
                PodIpamError::Annotation(a) => a,
                other => panic!("{detail}: {other}"),
            };
            assert_eq!(e.annotation, *annotation, "{e}");
            assert!(e.on.starts_with(on), "{e}");
            assert!(e.to_string().contains(detail), "{e}");
            assert!(e.to_string().contains(annotation), "{e}");
            assert!(e.to_string().len() < 400, "a short message: {e}");
        }
        let many = format!("[{}]", vec!["\"blue\""; 17].join(","));
        let e = go(&[(IPV4_POOLS, &many)], &[]).expect_err("17 entries");
        assert!(e.to_string().contains("17 entries, at most 16"), "{e}");
        // A fixed address of a family the network does not assign.
        let (ns, labels) = (m(&[]), m(&[]));
        let namespace = Namespace {
            name: "shop",
            labels: Some(&labels),
            annotations: &ns,
        };
        let e = resolve(
            &namespace,
            "web",
            &m(&[(IP_ADDRS, r#"["fd00:1::7"]"#)]),
            &pools(),
            (true, false),
        )
        .expect_err("IPv6 on an IPv4 network");
        assert!(
            e.to_string().contains(IP_ADDRS) && e.to_string().contains("assigns no IPv6"),
            "{e}"
        );
    }
}
