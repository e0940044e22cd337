//! The signer's loop: every CertificateSigningRequest of its signerName listed, then watched
//! (relisted every [`RESYNC`], and after any watch error), each handled once by
//! [`handle`]: done ones (issued, denied, failed) are skipped; the rest go through the
//! policy; a refused one is Denied — or Failed, when somebody else already approved it: a
//! human's approval does not make calix sign another node's name —, a granted one is
//! Approved and signed. Writes carry the resourceVersion the decision was made on: a request
//! that changed meanwhile is read again and decided again.
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::json;

use super::policy::{self, Asked, Denial, NodeState};
use super::{ca_store, SignerConfig, SignerError};
use calix_pki::ca::{random_serial, Ca};

/// How often every request is listed again (and the bundle checked).
pub const RESYNC: Duration = Duration::from_secs(60);
/// How far back an issued certificate's validity starts (clocks behind the signer's).
pub const BACKDATE: Duration = Duration::from_secs(60);
/// The reason of the signer's approvals.
pub const APPROVED_REASON: &str = "CalixNodeIdentity";

/// A failed API call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The object changed since it was read (409), or is gone (404).
    #[error("the request changed meanwhile")]
    Conflict,
    #[error("{0}")]
    Other(String),
}

/// What [`handle`] needs of the API.
#[tonic::async_trait]
pub trait SignerApi: Send + Sync {
    async fn node(&self, name: &str) -> Result<NodeState, ApiError>;
    /// Adds condition `type_` (`Approved`, `Denied`: the approval subresource; `Failed`: the
    /// status) at `csr`'s resourceVersion; the request as it is after.
    async fn condition(
        &self,
        csr: &CertificateSigningRequest,
        type_: &str,
        reason: &str,
        message: &str,
    ) -> Result<CertificateSigningRequest, ApiError>;
    /// Sets `status.certificate` at `csr`'s resourceVersion.
    async fn certificate(&self, csr: &CertificateSigningRequest, pem: &str)
        -> Result<(), ApiError>;
}

/// What became of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    /// Another signer's.
    NotOurs,
    /// Already issued, denied or failed.
    Done,
    Denied(Denial),
    /// Somebody else approved it; the policy refuses it.
    Failed(Denial),
    Issued {
        node: String,
        serial: String,
    },
}

fn has(csr: &CertificateSigningRequest, type_: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

/// Handles `csr` as of `now` with `ca` for `policy` and `lifetime`.
pub async fn handle(
    api: &dyn SignerApi,
    policy: &policy::Policy,
    ca: &Ca,
    lifetime: Duration,
    csr: CertificateSigningRequest,
    now: SystemTime,
) -> Result<Handled, ApiError> {
    if csr.spec.signer_name != policy.signer_name {
        return Ok(Handled::NotOurs);
    }
    let issued = csr
        .status
        .as_ref()
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty());
    if issued || has(&csr, "Denied") || has(&csr, "Failed") {
        return Ok(Handled::Done);
    }
    let approved = has(&csr, "Approved");
    let empty = BTreeMap::new();
    let asked = Asked {
        username: csr.spec.username.as_deref().unwrap_or_default(),
        extra: csr.spec.extra.as_ref().unwrap_or(&empty),
        usages: csr.spec.usages.as_deref().unwrap_or_default(),
        request: &csr.spec.request.0,
    };
    let decision = match policy::check(policy, &asked) {
        Ok(g) => {
            let node = api.node(&g.node).await?;
            policy::check_node(&g, &node).map(|()| g)
        }
        Err(d) => Err(d),
    };
    let granted = match decision {
        Ok(g) => g,
        Err(d) if approved => {
            api.condition(&csr, "Failed", d.reason, &d.message).await?;
            return Ok(Handled::Failed(d));
        }
        Err(d) => {
            api.condition(&csr, "Denied", d.reason, &d.message).await?;
            return Ok(Handled::Denied(d));
        }
    };
    let csr = if approved {
        csr
    } else {
        let message = format!(
            "the agent of node {:?} asks for a certificate naming its node alone",
            granted.node
        );
        api.condition(&csr, "Approved", APPROVED_REASON, &message)
            .await?
    };
    // The request may ask for less time; never for more.
    let lifetime = csr
        .spec
        .expiration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map(Duration::from_secs)
        .map_or(lifetime, |asked| asked.min(lifetime));
    let serial = random_serial().map_err(|e| ApiError::Other(e.to_string()))?;
    let pem = ca
        .issue(
            &granted.node,
            &granted.key,
            now - BACKDATE,
            now + lifetime,
            &serial,
        )
        .map_err(|e| ApiError::Other(e.to_string()))?;
    api.certificate(&csr, &pem).await?;
    Ok(Handled::Issued {
        node: granted.node,
        serial: serial.iter().map(|b| format!("{b:02x}")).collect(),
    })
}

/// [`SignerApi`] over the Kubernetes API.
pub struct KubeSignerApi {
    client: kube::Client,
}

impl KubeSignerApi {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    fn csrs(&self) -> Api<CertificateSigningRequest> {
        Api::all(self.client.clone())
    }
}

fn call_err(e: kube::Error) -> ApiError {
    match &e {
        kube::Error::Api(s) if s.code == 409 || s.code == 404 => ApiError::Conflict,
        _ => ApiError::Other(e.to_string()),
    }
}

#[tonic::async_trait]
impl SignerApi for KubeSignerApi {
    async fn node(&self, name: &str) -> Result<NodeState, ApiError> {
        let api: Api<Node> = Api::all(self.client.clone());
        match api.get_opt(name).await {
            Ok(Some(n)) => Ok(NodeState::Present {
                uid: n.metadata.uid.unwrap_or_default(),
            }),
            Ok(None) => Ok(NodeState::Missing),
            Err(e) => Err(ApiError::Other(format!("read Node {name}: {e}"))),
        }
    }

    async fn condition(
        &self,
        csr: &CertificateSigningRequest,
        type_: &str,
        reason: &str,
        message: &str,
    ) -> Result<CertificateSigningRequest, ApiError> {
        let name = csr.metadata.name.clone().unwrap_or_default();
        let mut conditions: Vec<serde_json::Value> = csr
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .map(|cs| {
                cs.iter()
                    .filter_map(|c| serde_json::to_value(c).ok())
                    .collect()
            })
            .unwrap_or_default();
        conditions.push(json!({
            "type": type_, "status": "True", "reason": reason, "message": message,
        }));
        let patch = json!({
            "metadata": {"resourceVersion": csr.metadata.resource_version},
            "status": {"conditions": conditions},
        });
        let pp = PatchParams::default();
        let api = self.csrs();
        let r = if type_ == "Failed" {
            api.patch_status(&name, &pp, &Patch::Merge(&patch)).await
        } else {
            api.patch_approval(&name, &pp, &Patch::Merge(&patch)).await
        };
        r.map_err(call_err)
    }

    async fn certificate(
        &self,
        csr: &CertificateSigningRequest,
        pem: &str,
    ) -> Result<(), ApiError> {
        let name = csr.metadata.name.clone().unwrap_or_default();
        let patch = json!({
            "metadata": {"resourceVersion": csr.metadata.resource_version},
            "status": {"certificate": k8s_openapi::ByteString(pem.as_bytes().to_vec())},
        });
        self.csrs()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(call_err)
    }
}

/// The signer: its CA (made if absent) and bundle, then every request of its signerName,
/// forever. Returns only when the CA cannot be had (a Secret that holds no usable CA, or the
/// API refusing to show it).
pub async fn run(client: kube::Client, cfg: SignerConfig) -> Result<(), SignerError> {
    let ca = retry("the CA", || ca_store::ensure_ca(&client, &cfg)).await?;
    let api = KubeSignerApi::new(client.clone());
    let policy = cfg.policy();
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let fields = format!("spec.signerName={}", cfg.signer_name);
    tracing::info!(signer = %cfg.signer_name, agents = %policy.agent_user, lifetime = ?cfg.lifetime,
        "signer: answering CertificateSigningRequests");
    let mut backoff = Duration::from_secs(1);
    loop {
        let round = std::time::Instant::now();
        if let Err(e) = ca_store::publish(&client, &cfg, &ca).await {
            tracing::warn!(error = %e, "signer: cannot publish the trust bundle; retrying");
        }
        let list = match csrs.list(&ListParams::default().fields(&fields)).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "signer: cannot list CertificateSigningRequests; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        for csr in list.items {
            process(&api, &policy, &ca, &cfg, &csrs, csr).await;
        }
        let version = list.metadata.resource_version.unwrap_or_default();
        let wp = WatchParams::default()
            .fields(&fields)
            .timeout(u32::try_from(RESYNC.as_secs()).unwrap_or(60));
        let stream = match csrs.watch(&wp, &version).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "signer: cannot watch CertificateSigningRequests; relisting");
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let mut stream = std::pin::pin!(stream);
        loop {
            match stream.try_next().await {
                Ok(Some(WatchEvent::Added(csr) | WatchEvent::Modified(csr))) => {
                    process(&api, &policy, &ca, &cfg, &csrs, csr).await;
                }
                Ok(Some(WatchEvent::Deleted(_) | WatchEvent::Bookmark(_))) => {}
                Ok(Some(WatchEvent::Error(e))) => {
                    tracing::debug!(error = %e.message, "signer: watch ended; relisting");
                    break;
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "signer: watch failed; relisting");
                    break;
                }
            }
        }
        // A watch that ends at once is not relisted in a tight loop.
        if round.elapsed() < Duration::from_secs(1) {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        } else {
            backoff = Duration::from_secs(1);
        }
    }
}

/// Handles one request, reading it again after a conflict (twice at most), logging what
/// became of it.
async fn process(
    api: &KubeSignerApi,
    policy: &policy::Policy,
    ca: &Ca,
    cfg: &SignerConfig,
    csrs: &Api<CertificateSigningRequest>,
    mut csr: CertificateSigningRequest,
) {
    let name = csr.metadata.name.clone().unwrap_or_default();
    let requester = csr.spec.username.clone().unwrap_or_default();
    for _ in 0..3 {
        match handle(api, policy, ca, cfg.lifetime, csr, SystemTime::now()).await {
            Ok(Handled::Issued { node, serial }) => {
                tracing::info!(csr = %name, %node, %serial, "signer: approved and signed");
                return;
            }
            Ok(Handled::Denied(d)) => {
                tracing::warn!(csr = %name, %requester, reason = d.reason, message = %d.message, "signer: denied");
                return;
            }
            Ok(Handled::Failed(d)) => {
                tracing::warn!(csr = %name, %requester, reason = d.reason, message = %d.message,
                    "signer: approved by somebody else, refused by the policy: marked Failed, not signed");
                return;
            }
            Ok(Handled::NotOurs | Handled::Done) => return,
            Err(ApiError::Conflict) => match csrs.get_opt(&name).await {
                Ok(Some(fresh)) => csr = fresh,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(csr = %name, error = %e, "signer: cannot read it again; next resync");
                    return;
                }
            },
            Err(ApiError::Other(e)) => {
                tracing::warn!(csr = %name, error = %e, "signer: cannot handle it now; next resync");
                return;
            }
        }
    }
}

/// `f` until it works or fails for good: API errors are retried (1 s doubling to 10 s).
async fn retry<T, F, Fut>(what: &str, mut f: F) -> Result<T, SignerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, SignerError>>,
{
    let mut backoff = Duration::from_secs(1);
    loop {
        match f().await {
            Ok(t) => return Ok(t),
            Err(e @ SignerError::Api { .. }) => {
                tracing::warn!(error = %e, "signer: {what}: retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::certificates::v1::{
        CertificateSigningRequestCondition, CertificateSigningRequestSpec,
        CertificateSigningRequestStatus,
    };
    use std::sync::Mutex;

    const AGENT: &str = "system:serviceaccount:kube-system:calix";

    /// Records what the signer did; the API's answers are the request with the change.
    #[derive(Default)]
    struct Fake {
        nodes: BTreeMap<String, String>,
        conditions: Mutex<Vec<(String, String)>>,
        certificates: Mutex<Vec<String>>,
        conflict_once: Mutex<bool>,
    }

    #[tonic::async_trait]
    impl SignerApi for Fake {
        async fn node(&self, name: &str) -> Result<NodeState, ApiError> {
            Ok(match self.nodes.get(name) {
                Some(uid) => NodeState::Present { uid: uid.clone() },
                None => NodeState::Missing,
            })
        }

        async fn condition(
            &self,
            csr: &CertificateSigningRequest,
            type_: &str,
            reason: &str,
            _message: &str,
        ) -> Result<CertificateSigningRequest, ApiError> {
            if std::mem::take(&mut *self.conflict_once.lock().expect("lock")) {
                return Err(ApiError::Conflict);
            }
            self.conditions
                .lock()
                .expect("lock")
                .push((type_.into(), reason.into()));
            let mut c = csr.clone();
            c.status
                .get_or_insert_with(Default::default)
                .conditions
                .get_or_insert_with(Vec::new)
                .push(CertificateSigningRequestCondition {
                    type_: type_.into(),
                    status: "True".into(),
                    ..Default::default()
                });
            Ok(c)
        }

        async fn certificate(
            &self,
            _csr: &CertificateSigningRequest,
            pem: &str,
        ) -> Result<(), ApiError> {
            self.certificates.lock().expect("lock").push(pem.into());
            Ok(())
        }
    }

    fn policy() -> policy::Policy {
        policy::Policy {
            signer_name: "calix.dev/routes".into(),
            agent_user: AGENT.into(),
        }
    }

    fn csr(node_binding: &str, asks_for: &str, approved: bool) -> CertificateSigningRequest {
        let req = calix_pki::request::new_request(asks_for).expect("request");
        let mut extra = BTreeMap::new();
        extra.insert(
            policy::NODE_NAME_EXTRA.to_string(),
            vec![node_binding.to_string()],
        );
        CertificateSigningRequest {
            spec: CertificateSigningRequestSpec {
                signer_name: "calix.dev/routes".into(),
                request: k8s_openapi::ByteString(req.pem.into_bytes()),
                username: Some(AGENT.into()),
                extra: Some(extra),
                usages: Some(vec!["digital signature".into(), "server auth".into()]),
                ..Default::default()
            },
            status: approved.then(|| CertificateSigningRequestStatus {
                conditions: Some(vec![CertificateSigningRequestCondition {
                    type_: "Approved".into(),
                    status: "True".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn fake() -> Fake {
        Fake {
            nodes: [("node-a".to_string(), "uid-a".to_string())].into(),
            ..Default::default()
        }
    }

    fn ca() -> Ca {
        Ca::generate("t", SystemTime::now(), Duration::from_secs(3600)).expect("ca")
    }

    /// One request through the signer: this fake, the test policy, a lifetime of 30 s.
    async fn sign(
        f: &Fake,
        ca: &Ca,
        csr: CertificateSigningRequest,
        now: SystemTime,
    ) -> Result<Handled, ApiError> {
        handle(f, &policy(), ca, Duration::from_secs(30), csr, now).await
    }

    #[tokio::test]
    async fn its_own_nodes_request_is_approved_then_signed_for_the_lifetime() {
        let f = fake();
        let ca = ca();
        let now = SystemTime::now();
        let r = sign(&f, &ca, csr("node-a", "node-a", false), now)
            .await
            .expect("handled");
        assert!(
            matches!(r, Handled::Issued { ref node, .. } if node == "node-a"),
            "{r:?}"
        );
        assert_eq!(
            *f.conditions.lock().expect("lock"),
            [("Approved".to_string(), APPROVED_REASON.to_string())]
        );
        let first = f.certificates.lock().expect("lock")[0].clone();
        use rustls::pki_types::pem::PemObject;
        let der = rustls::pki_types::CertificateDer::from_pem_slice(first.as_bytes()).expect("pem");
        let facts = calix_pki::cert::facts(der.as_ref()).expect("facts");
        assert_eq!(facts.names, vec![calix_pki::Name::Dns("node-a".into())]);
        let lifetime = facts.not_after.duration_since(now).expect("after now");
        assert!(lifetime <= Duration::from_secs(30) && lifetime >= Duration::from_secs(29));
        // A request asking for less gets less; for more, the signer's lifetime.
        let mut short = csr("node-a", "node-a", false);
        short.spec.expiration_seconds = Some(10);
        sign(&f, &ca, short, now).await.expect("handled");
        let second = f.certificates.lock().expect("lock")[1].clone();
        let der =
            rustls::pki_types::CertificateDer::from_pem_slice(second.as_bytes()).expect("pem");
        let facts = calix_pki::cert::facts(der.as_ref()).expect("facts");
        assert_eq!(
            calix_pki::unix_secs(facts.not_after) - calix_pki::unix_secs(now),
            10
        );
    }

    #[tokio::test]
    async fn another_nodes_request_is_denied_and_one_somebody_approved_is_failed_unsigned() {
        let f = fake();
        let ca = ca();
        let now = SystemTime::now();
        let r = sign(&f, &ca, csr("node-a", "node-b", false), now)
            .await
            .expect("handled");
        assert!(
            matches!(r, Handled::Denied(ref d) if d.reason == "OtherNode"),
            "{r:?}"
        );
        // An administrator approved it anyway: calix does not sign it.
        let r = sign(&f, &ca, csr("node-a", "node-b", true), now)
            .await
            .expect("handled");
        assert!(
            matches!(r, Handled::Failed(ref d) if d.reason == "OtherNode"),
            "{r:?}"
        );
        // A node that does not exist.
        let r = sign(&f, &ca, csr("node-z", "node-z", false), now)
            .await
            .expect("handled");
        assert!(
            matches!(r, Handled::Denied(ref d) if d.reason == "NoSuchNode"),
            "{r:?}"
        );
        assert_eq!(
            *f.conditions.lock().expect("lock"),
            [
                ("Denied".to_string(), "OtherNode".to_string()),
                ("Failed".to_string(), "OtherNode".to_string()),
                ("Denied".to_string(), "NoSuchNode".to_string()),
            ]
        );
        assert!(f.certificates.lock().expect("lock").is_empty());
    }

    #[tokio::test]
    async fn done_requests_and_other_signers_are_left_alone_and_a_conflict_is_reported() {
        let f = fake();
        let ca = ca();
        let now = SystemTime::now();
        let mut other = csr("node-a", "node-a", false);
        other.spec.signer_name = "kubernetes.io/kube-apiserver-client".into();
        assert_eq!(
            sign(&f, &ca, other, now).await.expect("h"),
            Handled::NotOurs
        );
        let mut issued = csr("node-a", "node-a", true);
        issued.status.as_mut().expect("status").certificate =
            Some(k8s_openapi::ByteString(b"PEM".to_vec()));
        assert_eq!(sign(&f, &ca, issued, now).await.expect("h"), Handled::Done);
        let mut denied = csr("node-a", "node-a", false);
        denied.status = Some(CertificateSigningRequestStatus {
            conditions: Some(vec![CertificateSigningRequestCondition {
                type_: "Denied".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert_eq!(sign(&f, &ca, denied, now).await.expect("h"), Handled::Done);
        *f.conflict_once.lock().expect("lock") = true;
        assert!(matches!(
            sign(&f, &ca, csr("node-a", "node-a", false), now).await,
            Err(ApiError::Conflict)
        ));
        assert!(f.conditions.lock().expect("lock").is_empty());
        assert!(f.certificates.lock().expect("lock").is_empty());
    }
}
