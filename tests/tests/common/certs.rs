//! Route-distribution certificates through the Kubernetes API, as tests ask for them: a
//! test's own signer setup and the agents' rules for it, CertificateSigningRequests made as a
//! token and their decisions, PKCS#10 requests, and a Routes watch made with a certificate of
//! the test's choosing (an impostor's attempt).
use std::path::Path;
use std::time::Duration;

use calix_testbed::signer::{self, SignerSetup};
use calix_testbed::{wait_for, Cluster, KubeApi};
use serde_json::{json, Value};

/// Where the agents' ServiceAccount and the signers' objects live.
pub const NS: &str = "kube-system";
pub const AGENT_SA: &str = "calix-agent";

pub fn setup(u: &str, lifetime_secs: u64) -> SignerSetup {
    SignerSetup {
        signer_name: format!("calix.dev/{u}"),
        namespace: NS.into(),
        ca_secret: format!("{u}-ca"),
        ca_config_map: format!("{u}-bundle"),
        service_account: format!("{u}-signer"),
        agents: format!("{NS}/{AGENT_SA}"),
        lifetime_secs,
    }
}

/// The agents' ServiceAccount with the chart's rules and nothing else: the agent's, the
/// kubernetes datastore's, and (for `s`) the certificate requests and the bundle.
pub fn agent_rules(api: &KubeApi, s: &SignerSetup) {
    api.service_account(NS, AGENT_SA)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = Vec::new();
    for f in ["agent.yaml", "kubernetes-datastore.yaml"] {
        cluster.extend(signer::chart_rules(f, &[]).unwrap_or_else(|e| panic!("{e}")));
    }
    let (certs, bundle) = signer::agent_certificate_rules(s).unwrap_or_else(|e| panic!("{e}"));
    cluster.extend(certs);
    api.grant(AGENT_SA, None, NS, AGENT_SA, cluster)
        .unwrap_or_else(|e| panic!("{e}"));
    api.grant(
        &format!("{AGENT_SA}-{}", s.ca_config_map),
        Some(NS),
        NS,
        AGENT_SA,
        bundle,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// A CertificateSigningRequest for `s`'s signer with `request` (PEM), made as `token`;
/// the request as the API has it once the signer decided (at most 60 s).
pub fn ask(api: &KubeApi, token: &str, s: &SignerSetup, request: &str) -> Value {
    let csr = json!({
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
        "metadata": {"generateName": "cxt-test-"},
        "spec": {"request": base64(request.as_bytes()), "signerName": s.signer_name,
            "usages": ["digital signature", "server auth", "client auth"]},
    });
    let created = api.with_token(token, move |c| async move {
        use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
        let api: kube::Api<CertificateSigningRequest> = kube::Api::all(c);
        let obj: CertificateSigningRequest = serde_json::from_value(csr).expect("a CSR");
        api.create(&Default::default(), &obj)
            .await
            .map(|o| o.metadata.name.unwrap_or_default())
    });
    let name = created.unwrap_or_else(|e| panic!("create the CSR as the token's user: {e}"));
    decided(api, &name)
}

/// CertificateSigningRequest `name` once decided (issued, denied or failed), at most 60 s.
pub fn decided(api: &KubeApi, name: &str) -> Value {
    wait_for(
        &format!("the signer decides {name}"),
        Duration::from_secs(60),
        || {
            let csr = api
                .get(
                    "certificates.k8s.io/v1",
                    "CertificateSigningRequest",
                    None,
                    name,
                )
                .ok()
                .flatten()?;
            let done = csr["status"]["certificate"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
                || condition(&csr, "Denied").is_some()
                || condition(&csr, "Failed").is_some();
            done.then_some(csr)
        },
        String::new,
    )
}

/// The condition `type_` of a request, if true.
pub fn condition(csr: &Value, type_: &str) -> Option<Value> {
    csr["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_ && c["status"] == "True")
        .cloned()
}

pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                A[((n >> (18 - 6 * i)) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

pub fn decode_base64(text: &str) -> Vec<u8> {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text
        .bytes()
        .filter(|c| *c != b'=' && !c.is_ascii_whitespace())
    {
        let v = A.iter().position(|a| *a == c).expect("base64") as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// A request with subject CN `cn` and DNS names `sans`, with a fresh key; (request, key).
pub fn request(cn: &str, sans: &[&str]) -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    p.subject_alt_names = sans
        .iter()
        .map(|n| rcgen::SanType::DnsName(n.to_string().try_into().expect("ia5")))
        .collect();
    let pem = p
        .serialize_request(&key)
        .expect("request")
        .pem()
        .expect("pem");
    (pem, key.serialize_pem())
}

/// From node `from`'s namespace: watch node `to` as node `as_node` presenting `cert`/`key`
/// (trusting `bundle`); `Ok` once the first update arrived, else why not.
pub fn try_watch(
    c: &Cluster,
    from: usize,
    to: usize,
    as_node: &str,
    bundle: &str,
    cert: &str,
    key: &str,
) -> Result<(), String> {
    let p = Path::new("(test)");
    let tls = calix_agent::distribution::tls::TlsMaterial::from_pem(
        (p, bundle.as_bytes()),
        (p, cert.as_bytes()),
        (p, key.as_bytes()),
    )
    .and_then(|m| m.client_config())
    .expect("TLS material");
    try_watch_with(c, from, to, as_node, Some(tls))
}

/// From node `from`'s namespace: watch node `to` as node `as_node`, with `tls` (`None`:
/// plain text); `Ok` once the first update arrived (within 5 s), else why not.
pub fn try_watch_with(
    c: &Cluster,
    from: usize,
    to: usize,
    as_node: &str,
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
) -> Result<(), String> {
    use calix_agent::distribution::client::{connect, Dialer};
    use calix_proto::v1 as pb;
    let dialer = Dialer {
        me: as_node.to_string(),
        tls,
        live: None,
        connect_timeout: Duration::from_secs(3),
        source: Default::default(),
    };
    let peer = c.name(to).to_string();
    let endpoint = format!("{}:5474", c.address(to));
    c.nodes[from].ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let channel = connect(&peer, &endpoint, &dialer)
                .await
                .map_err(|e| calix_log::error_chain(&e))?;
            let mut stream = pb::routes_client::RoutesClient::new(channel)
                .watch(pb::WatchRequest {
                    node: dialer.me.clone(),
                    relayed: false,
                })
                .await
                .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
                .into_inner();
            match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
                Ok(Ok(Some(_))) => Ok(()),
                Ok(Ok(None)) => Err("stream ended".into()),
                Ok(Err(s)) => Err(format!("{:?}: {}", s.code(), s.message())),
                Err(_) => Err("no update within 5 s".into()),
            }
        })
    })
}
