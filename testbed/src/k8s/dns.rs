//! A cluster DNS for the test bed's Kubernetes clusters, since no CoreDNS can be had here: the
//! upstream Services suite dials Services by name (`nc -v -t -w 2 <service> 80`). It answers
//! as CoreDNS's `kubernetes` plugin does for what those tests ask:
//! - `<service>.<namespace>.svc.<domain>`: the cluster IPs (A, AAAA); a headless Service's
//!   ready endpoints instead, and `<hostname>.<service>.<namespace>.svc.<domain>` for those
//!   with a hostname; an `ExternalName` Service, a CNAME to its name;
//! - any other name in the domain: NXDOMAIN; a name outside it: REFUSED (nothing is forwarded:
//!   there is nowhere to forward to).
//!
//! [`Records::from_api`] reads the API's objects; [`answer`] is the protocol (RFC 1035, one
//! question, no compression in it); [`DnsServer`] serves UDP in a network namespace.
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{Error, Netns, Result};

/// The records of a cluster: each name (lower case, no trailing dot) and its answers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Records {
    /// The cluster's domain (`cluster.local`): the zone answered.
    pub domain: String,
    pub addresses: BTreeMap<String, Vec<IpAddr>>,
    pub cnames: BTreeMap<String, String>,
}

impl Records {
    /// The records of `services` and `slices` (the API's objects, as listed).
    pub fn from_api(domain: &str, services: &[Value], slices: &[Value]) -> Self {
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        let mut r = Records {
            domain: domain.clone(),
            ..Records::default()
        };
        for s in services {
            let (Some(ns), Some(name)) = (
                s["metadata"]["namespace"].as_str(),
                s["metadata"]["name"].as_str(),
            ) else {
                continue;
            };
            let fqdn = format!("{name}.{ns}.svc.{domain}").to_ascii_lowercase();
            if s["spec"]["type"] == "ExternalName" {
                if let Some(to) = s["spec"]["externalName"].as_str() {
                    r.cnames
                        .insert(fqdn, to.trim_end_matches('.').to_ascii_lowercase());
                }
                continue;
            }
            let ips: Vec<IpAddr> = s["spec"]["clusterIPs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str()?.parse().ok())
                .collect();
            if s["spec"]["clusterIP"] != "None" {
                r.addresses.insert(fqdn, ips);
                continue;
            }
            // Headless: the ready endpoints of its slices.
            let mut all = Vec::new();
            for sl in slices.iter().filter(|sl| {
                sl["metadata"]["namespace"].as_str() == Some(ns)
                    && sl["metadata"]["labels"]["kubernetes.io/service-name"].as_str() == Some(name)
            }) {
                for e in sl["endpoints"].as_array().into_iter().flatten() {
                    if e["conditions"]["ready"] == false {
                        continue;
                    }
                    let addrs: Vec<IpAddr> = e["addresses"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_str()?.parse().ok())
                        .collect();
                    if let Some(h) = e["hostname"].as_str() {
                        r.addresses
                            .entry(format!("{h}.{fqdn}").to_ascii_lowercase())
                            .or_default()
                            .extend(&addrs);
                    }
                    all.extend(addrs);
                }
            }
            r.addresses.insert(fqdn, all);
        }
        r
    }
}

const TYPE_A: u16 = 1;
const TYPE_CNAME: u16 = 5;
const TYPE_AAAA: u16 = 28;
const TYPE_ANY: u16 = 255;
const RCODE_FORMERR: u16 = 1;
const RCODE_NXDOMAIN: u16 = 3;
const RCODE_REFUSED: u16 = 5;
/// Seconds a client may keep an answer: short, Services come and go within a spec.
const TTL: u32 = 5;

/// The name starting at `q[at..]` (labels, no compression) in lower case, and where the
/// question's type follows.
fn name_at(q: &[u8], mut at: usize) -> Option<(String, usize)> {
    let mut labels = Vec::new();
    loop {
        let len = *q.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None; // a compression pointer or an extended label: not in a question
        }
        labels.push(
            std::str::from_utf8(q.get(at..at + len)?)
                .ok()?
                .to_ascii_lowercase(),
        );
        at += len;
    }
    let name = labels.join(".");
    (name.len() <= 253).then_some((name, at))
}

/// `name` in wire format.
fn encode(name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for l in name.split('.').filter(|l| !l.is_empty()) {
        out.push(l.len().min(63) as u8);
        out.extend(&l.as_bytes()[..l.len().min(63)]);
    }
    out.push(0);
    out
}

/// The response to the DNS query `q` from `records`; `None` for what is no query (too short,
/// a response).
pub fn answer(q: &[u8], records: &Records) -> Option<Vec<u8>> {
    if q.len() < 12 || q[2] & 0x80 != 0 {
        return None;
    }
    let rd = u16::from(q[2] & 0x01) << 8;
    let header = |rcode: u16, questions: u16, answers: u16| {
        let flags = 0x8000 | 0x0400 | rd | rcode;
        let mut h = vec![q[0], q[1]];
        for v in [flags, questions, answers, 0, 0] {
            h.extend(v.to_be_bytes());
        }
        h
    };
    let parsed = (u16::from_be_bytes([q[4], q[5]]) == 1)
        .then(|| name_at(q, 12))
        .flatten()
        .filter(|(_, at)| q.len() >= at + 4);
    let Some((name, at)) = parsed else {
        return Some(header(RCODE_FORMERR, 0, 0));
    };
    let qtype = u16::from_be_bytes([q[at], q[at + 1]]);
    let question = &q[12..at + 4];
    let domain = &records.domain;
    if name != *domain && !name.ends_with(&format!(".{domain}")) {
        let mut out = header(RCODE_REFUSED, 1, 0);
        out.extend(question);
        return Some(out);
    }
    let mut answers: Vec<(u16, Vec<u8>)> = Vec::new();
    let known = if let Some(to) = records.cnames.get(&name) {
        answers.push((TYPE_CNAME, encode(to)));
        true
    } else if let Some(ips) = records.addresses.get(&name) {
        for ip in ips {
            match ip {
                IpAddr::V4(v4) if matches!(qtype, TYPE_A | TYPE_ANY) => {
                    answers.push((TYPE_A, v4.octets().to_vec()))
                }
                IpAddr::V6(v6) if matches!(qtype, TYPE_AAAA | TYPE_ANY) => {
                    answers.push((TYPE_AAAA, v6.octets().to_vec()))
                }
                _ => {}
            }
        }
        true
    } else {
        false
    };
    let rcode = if known { 0 } else { RCODE_NXDOMAIN };
    let mut out = header(rcode, 1, answers.len() as u16);
    out.extend(question);
    for (t, data) in answers {
        out.extend([0xc0, 12]); // the question's name
        out.extend(t.to_be_bytes());
        out.extend(1u16.to_be_bytes()); // IN
        out.extend(TTL.to_be_bytes());
        out.extend((data.len() as u16).to_be_bytes());
        out.extend(data);
    }
    Some(out)
}

/// A cluster DNS on UDP, in a network namespace, until dropped.
pub struct DnsServer {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DnsServer {
    /// Serves on UDP `addr` (port 0: any) in the network namespace `netns` (`None`: this
    /// one) what `records` returns, asked again when what it gave is older than half a second
    /// (`None` keeps the last).
    pub fn start(
        netns: Option<&Netns>,
        addr: SocketAddr,
        records: impl Fn() -> Option<Records> + Send + 'static,
    ) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let done = stop.clone();
        let serve = move || {
            let bound = UdpSocket::bind(addr).and_then(|s| {
                s.set_read_timeout(Some(Duration::from_millis(200)))?;
                Ok(s)
            });
            let sock = match bound {
                Ok(s) => {
                    let _ = tx.send(s.local_addr());
                    s
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut held = Records::default();
            let mut at: Option<Instant> = None;
            let mut buf = [0u8; 1500];
            while !done.load(Ordering::Relaxed) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                if at.is_none_or(|t| t.elapsed() > Duration::from_millis(500)) {
                    if let Some(r) = records() {
                        held = r;
                    }
                    at = Some(Instant::now());
                }
                if let Some(out) = answer(&buf[..n], &held) {
                    let _ = sock.send_to(&out, from);
                }
            }
        };
        let thread = match netns {
            Some(ns) => ns.spawn(None, serve)?,
            None => std::thread::spawn(serve),
        };
        let addr = rx
            .recv()
            .map_err(|_| Error::Panicked {
                what: "the DNS server".into(),
            })?
            .map_err(Error::io(format!("bind the cluster DNS to {addr}")))?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The cluster domain the test bed's kubelets are given ([`crate::KubeNode::start`]).
pub const CLUSTER_DOMAIN: &str = "cluster.local";

impl crate::KubeApi {
    /// The cluster's DNS, on UDP port 53 of the address the API server advertises, in its
    /// namespace ([`crate::KubeApi::in_namespace`]: reached from the nodes it is wired to and
    /// from their pods): [`CLUSTER_DOMAIN`] answered from the Services and EndpointSlices of
    /// every namespace, listed again at most twice a second while asked.
    pub fn cluster_dns(&self) -> Result<DnsServer> {
        let (Some(ns), Some((host, _))) = (self.ns.as_ref(), self.advertised()) else {
            return Err(Error::Kube {
                what: "the cluster DNS".into(),
                detail: "needs an API server in a namespace of its own".into(),
            });
        };
        let addr = SocketAddr::new(
            host.parse().map_err(|_| Error::Kube {
                what: "the cluster DNS".into(),
                detail: format!("advertised address {host}"),
            })?,
            53,
        );
        let kubeconfig = self.kubeconfig();
        // Built on first use, in the server's thread (inside the namespace).
        let lister: std::sync::OnceLock<Option<(tokio::runtime::Runtime, kube::Client)>> =
            std::sync::OnceLock::new();
        DnsServer::start(Some(ns), addr, move || {
            let (rt, client) = lister
                .get_or_init(|| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .ok()?;
                    let client = rt.block_on(super::client(&kubeconfig)).ok()?;
                    Some((rt, client))
                })
                .as_ref()?;
            rt.block_on(list_records(client.clone()))
        })
    }
}

/// The records of every Service and EndpointSlice in the cluster; `None` if the API does not
/// answer.
async fn list_records(client: kube::Client) -> Option<Records> {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let lp = kube::api::ListParams::default();
    let services = kube::Api::<Service>::all(client.clone())
        .list(&lp)
        .await
        .ok()?;
    let slices = kube::Api::<EndpointSlice>::all(client)
        .list(&lp)
        .await
        .ok()?;
    Some(Records::from_api(
        CLUSTER_DOMAIN,
        &values(services.items),
        &values(slices.items),
    ))
}

fn values<T: serde::Serialize>(items: Vec<T>) -> Vec<Value> {
    items
        .into_iter()
        .filter_map(|o| serde_json::to_value(o).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        q.extend(encode(name));
        q.extend(qtype.to_be_bytes());
        q.extend(1u16.to_be_bytes());
        q
    }

    /// The rcode and each answer's (type, data) of response `r`.
    fn read(r: &[u8]) -> (u16, Vec<(u16, Vec<u8>)>) {
        let rcode = u16::from(r[3] & 0x0f);
        let count = u16::from_be_bytes([r[6], r[7]]);
        let (_, mut at) = name_at(r, 12).expect("the question");
        at += 4;
        let mut out = Vec::new();
        for _ in 0..count {
            assert_eq!(&r[at..at + 2], &[0xc0, 12], "the question's name");
            let t = u16::from_be_bytes([r[at + 2], r[at + 3]]);
            let len = u16::from_be_bytes([r[at + 10], r[at + 11]]) as usize;
            out.push((t, r[at + 12..at + 12 + len].to_vec()));
            at += 12 + len;
        }
        (rcode, out)
    }

    fn cluster() -> Records {
        let services = [
            json!({"metadata": {"namespace": "shop", "name": "web"},
                "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"]}}),
            json!({"metadata": {"namespace": "shop", "name": "db"},
                "spec": {"clusterIP": "None", "clusterIPs": ["None"]}}),
            json!({"metadata": {"namespace": "shop", "name": "out"},
                "spec": {"type": "ExternalName", "externalName": "Example.org."}}),
        ];
        let slices = [json!({
            "metadata": {"namespace": "shop", "name": "db-1",
                "labels": {"kubernetes.io/service-name": "db"}},
            "endpoints": [
                {"addresses": ["10.244.1.5"], "conditions": {"ready": true}, "hostname": "db-0"},
                {"addresses": ["10.244.1.6"], "conditions": {"ready": false}},
                {"addresses": ["10.244.2.7"]},
            ],
        })];
        Records::from_api("cluster.local.", &services, &slices)
    }

    #[test]
    fn services_answer_by_name_as_the_kubernetes_plugin_does() {
        let r = cluster();
        let (rcode, a) =
            read(&answer(&query("WEB.shop.svc.cluster.local", TYPE_A), &r).expect("a"));
        assert_eq!((rcode, a), (0, vec![(TYPE_A, vec![10, 96, 0, 10])]));
        let (_, a) = read(&answer(&query("web.shop.svc.cluster.local", TYPE_AAAA), &r).expect("a"));
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].1.len(), 16);
        // Headless: the ready endpoints (absent condition: ready), and a hostname's record.
        let (_, a) = read(&answer(&query("db.shop.svc.cluster.local", TYPE_A), &r).expect("a"));
        let ips: Vec<Vec<u8>> = a.into_iter().map(|(_, d)| d).collect();
        assert_eq!(ips, [vec![10, 244, 1, 5], vec![10, 244, 2, 7]]);
        let (_, a) =
            read(&answer(&query("db-0.db.shop.svc.cluster.local", TYPE_A), &r).expect("a"));
        assert_eq!(a, [(TYPE_A, vec![10, 244, 1, 5])]);
        let (_, a) = read(&answer(&query("out.shop.svc.cluster.local", TYPE_A), &r).expect("a"));
        assert_eq!(a, [(TYPE_CNAME, encode("example.org"))]);
        // A search list's tries: NXDOMAIN in the domain, REFUSED outside it.
        let (rcode, a) = read(
            &answer(
                &query("web.shop.svc.cluster.local.svc.cluster.local", TYPE_A),
                &r,
            )
            .expect("a"),
        );
        assert_eq!((rcode, a.len()), (RCODE_NXDOMAIN, 0));
        let (rcode, _) = read(&answer(&query("example.org", TYPE_A), &r).expect("a"));
        assert_eq!(rcode, RCODE_REFUSED);
    }

    #[test]
    fn what_is_no_query_gets_no_answer_or_formerr() {
        let r = cluster();
        assert_eq!(answer(&[1, 2, 3], &r), None, "too short");
        let mut response = query("web.shop.svc.cluster.local", TYPE_A);
        response[2] |= 0x80;
        assert_eq!(answer(&response, &r), None, "a response");
        let mut pointer = query("web.shop.svc.cluster.local", TYPE_A);
        pointer[12] = 0xc0;
        assert_eq!(read_rcode(&answer(&pointer, &r).expect("a")), RCODE_FORMERR);
        let truncated = &query("web.shop.svc.cluster.local", TYPE_A)[..20];
        assert_eq!(
            read_rcode(&answer(truncated, &r).expect("a")),
            RCODE_FORMERR
        );
    }

    fn read_rcode(r: &[u8]) -> u16 {
        u16::from(r[3] & 0x0f)
    }

    /// A real query over UDP, on loopback.
    #[test]
    fn the_server_answers_over_udp_and_follows_the_records() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = calls.clone();
        let server = DnsServer::start(None, "127.0.0.1:0".parse().expect("addr"), move || {
            seen.fetch_add(1, Ordering::Relaxed);
            Some(cluster())
        })
        .expect("start");
        let c = UdpSocket::bind("127.0.0.1:0").expect("bind");
        c.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        c.send_to(&query("web.shop.svc.cluster.local", TYPE_A), server.addr)
            .expect("send");
        let mut buf = [0u8; 512];
        let n = c.recv(&mut buf).expect("an answer");
        assert_eq!(&buf[..2], &[0x12, 0x34], "the query's id");
        assert_eq!(read(&buf[..n]).1, [(TYPE_A, vec![10, 96, 0, 10])]);
        assert_eq!(
            calls.load(Ordering::Relaxed),
            1,
            "the records asked for once"
        );
        drop(server);
    }
}
