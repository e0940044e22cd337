//! This node's route-distribution certificate through the Kubernetes API
//! (`routes.tls.source = "kubernetes"`, issue 20):
//!
//! ```text
//!  new key (P-256, in memory) ─► CertificateSigningRequest ─────────────► calix-signer
//!   ▲   (signerName, CN = the one DNS SAN = this node)                    │ Approved, status.certificate
//!   │                                                                     ▼
//!   └── at 60–70 % of its validity, or at once when     ◄── LiveTls::set_identity (checked: this node
//!       the bundle no longer trusts it                       alone, the key's, chains to the bundle)
//!
//!  ConfigMap <routes.tls.ca_config_map>["ca.crt"] ──get, then watch──► LiveTls::set_roots
//! ```
//!
//! The private key is made here and never leaves the process: not in the request, not on
//! disk. A restarted agent makes a new key and asks again (the signer answers in
//! milliseconds; until then its peers keep its routes for their grace period). The API server
//! records who asks — this agent's ServiceAccount and the node its pod-bound token names
//! (`authentication.kubernetes.io/node-name`) — in the request, where no requester can write
//! it: that is what the signer decides on. A request the signer denies, or that stays
//! undecided for [`WAIT`], is retried with a new key after 1 s doubling to 30 s (at most a
//! tenth of the validity left), each failure logged and counted (`calixctl nodes`,
//! `/metrics`). The pure parts — when to renew, how long to back off, what a request's status
//! says — are functions below, unit-tested; the rest is exercised against a real API server
//! (tests/tests/routes_certificates.rs).
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams, WatchEvent, WatchParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::distribution::tls::{self, LiveTls};
use calix_pki::cert::CertFacts;

/// The usages every request asks for (and the signer issues).
pub const USAGES: [&str; 3] = ["digital signature", "server auth", "client auth"];
/// The key of the bundle in the CA ConfigMap.
pub const BUNDLE_KEY: &str = "ca.crt";
/// How long one request may stay undecided before a new one is made.
pub const WAIT: Duration = Duration::from_secs(300);
/// Each API call's time limit (watches excepted).
const CALL: Duration = Duration::from_secs(15);
/// The longest pause between two attempts.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// What the agent asks for, and where the bundle is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub node: String,
    pub signer: String,
    pub ca_namespace: String,
    pub ca_name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{what}: {detail}")]
    Api { what: String, detail: String },
    #[error("CertificateSigningRequest {name} denied by the signer: {reason}: {message}")]
    Denied {
        name: String,
        reason: String,
        message: String,
    },
    #[error("CertificateSigningRequest {name} failed: {reason}: {message}")]
    Failed {
        name: String,
        reason: String,
        message: String,
    },
    #[error(
        "CertificateSigningRequest {name} undecided after {waited:?} (is calix-signer running?)"
    )]
    Undecided { name: String, waited: Duration },
    #[error("CertificateSigningRequest {name} was deleted before it was decided")]
    Gone { name: String },
    #[error("the certificate issued for CertificateSigningRequest {name} is not usable: {source}")]
    Unusable {
        name: String,
        #[source]
        source: tls::TlsError,
    },
    #[error("making the key and request")]
    Request(#[from] calix_pki::PkiError),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> CertError {
    let what = what.into();
    move |e| CertError::Api {
        what,
        detail: e.to_string(),
    }
}

/// What a request's status says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Not decided, or approved and not yet signed.
    Pending,
    /// The certificate, PEM.
    Issued(Vec<u8>),
    Denied {
        reason: String,
        message: String,
    },
    Failed {
        reason: String,
        message: String,
    },
}

/// The outcome of `csr` (a denial or failure wins over a certificate).
pub fn outcome_of(csr: &CertificateSigningRequest) -> Outcome {
    let status = csr.status.as_ref();
    for c in status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
    {
        if c.status != "True" {
            continue;
        }
        let (reason, message) = (
            c.reason.clone().unwrap_or_default(),
            c.message.clone().unwrap_or_default(),
        );
        match c.type_.as_str() {
            "Denied" => return Outcome::Denied { reason, message },
            "Failed" => return Outcome::Failed { reason, message },
            _ => {}
        }
    }
    match status.and_then(|s| s.certificate.as_ref()) {
        Some(c) if !c.0.is_empty() => Outcome::Issued(c.0.clone()),
        _ => Outcome::Pending,
    }
}

/// When to renew a certificate received at `now` and valid until `not_after`: after
/// 60 % + `r` × 10 % (`r` in [0, 1)) of the validity left, so a cluster's agents do not all
/// renew at once and two thirds of the lifetime's last third is left for retries.
pub fn renew_after(now: SystemTime, not_after: SystemTime, r: f64) -> Duration {
    let left = not_after.duration_since(now).unwrap_or_default();
    left.mul_f64(0.6 + 0.1 * r.clamp(0.0, 1.0))
}

/// The pause before attempt `attempt + 1` (the first failure is attempt 1): 1 s doubling, at
/// most 30 s and at most a tenth of the validity left (`left`, at least 1 s), ±20 % with `r`.
pub fn retry_after(attempt: u32, left: Option<Duration>, r: f64) -> Duration {
    let exp = Duration::from_secs(1u64 << attempt.saturating_sub(1).min(5));
    let cap = left
        .map(|l| (l / 10).max(Duration::from_secs(1)))
        .unwrap_or(MAX_RETRY)
        .min(MAX_RETRY);
    exp.min(cap).mul_f64(0.8 + 0.4 * r.clamp(0.0, 1.0))
}

/// A number in [0, 1) from the system's random source (0.5 if it fails).
fn random() -> f64 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 4];
    match ring::rand::SystemRandom::new().fill(&mut b) {
        Ok(()) => f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0),
        Err(_) => 0.5,
    }
}

/// Starts following the bundle and keeping this node's certificate in `live`, until the
/// process ends.
pub fn spawn(client: kube::Client, s: Settings, live: Arc<LiveTls>) {
    tokio::spawn(follow_bundle(client.clone(), s.clone(), live.clone()));
    tokio::spawn(keep_certificate(client, s, live));
}

/// Gets a certificate, puts it in place, sleeps until it is due, again; failures back off.
async fn keep_certificate(client: kube::Client, s: Settings, live: Arc<LiveTls>) {
    let mut bundles = live.bundle_changes();
    let mut attempt = 0u32;
    loop {
        let started = Instant::now();
        match obtain(&client, &s, &live).await {
            Ok(f) => {
                attempt = 0;
                let now = SystemTime::now();
                let renew = renew_after(now, f.not_after, random());
                tracing::info!(serial = %f.serial, valid_for = ?f.not_after.duration_since(now).unwrap_or_default(),
                    renew_in = ?renew, took = ?started.elapsed(), "routes: certificate from the Kubernetes API in place");
                let due = tokio::time::sleep(renew);
                tokio::pin!(due);
                loop {
                    tokio::select! {
                        () = &mut due => break,
                        changed = bundles.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            if !live.identity_trusted() {
                                tracing::warn!("routes: the new trust bundle does not trust this node's certificate: renewing now");
                                break;
                            }
                        }
                    }
                }
            }
            Err(e) => {
                attempt += 1;
                let left = live
                    .facts()
                    .and_then(|f| f.not_after.duration_since(SystemTime::now()).ok());
                let pause = retry_after(attempt, left, random());
                live.record_failure(e.to_string());
                match left {
                    Some(left) => {
                        tracing::warn!(error = %e, attempt, retry_in = ?pause, expires_in = ?left,
                        "routes: cannot renew this node's certificate; retrying")
                    }
                    None if live.facts().is_some() => {
                        tracing::error!(error = %e, attempt, retry_in = ?pause,
                        "routes: this node's certificate EXPIRED and cannot be renewed: peers refuse new connections; retrying")
                    }
                    None => tracing::warn!(error = %e, attempt, retry_in = ?pause,
                        "routes: cannot get this node's certificate yet; retrying"),
                }
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// One round: a new key and request, the signer's answer, the certificate checked and put
/// in place.
async fn obtain(
    client: &kube::Client,
    s: &Settings,
    live: &LiveTls,
) -> Result<CertFacts, CertError> {
    let req = calix_pki::request::new_request(&s.node)?;
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta {
            generate_name: Some(format!("calix-routes-{}-", s.node)),
            labels: Some([("app.kubernetes.io/name".to_string(), "calix".to_string())].into()),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(req.pem.clone().into_bytes()),
            signer_name: s.signer.clone(),
            usages: Some(USAGES.iter().map(|u| u.to_string()).collect()),
            ..Default::default()
        },
        status: None,
    };
    let created = call("create a CertificateSigningRequest", async {
        api.create(&PostParams::default(), &csr).await
    })
    .await?;
    let name = created.metadata.name.clone().unwrap_or_default();
    tracing::debug!(csr = %name, signer = %s.signer, "routes: asked for a certificate");
    let deadline = Instant::now() + WAIT;
    let pem = watch_one(&api, &name, deadline, |csr| match csr {
        None => ControlFlow::Break(Err(CertError::Gone { name: name.clone() })),
        Some(csr) => match outcome_of(&csr) {
            Outcome::Pending => ControlFlow::Continue(()),
            Outcome::Issued(pem) => ControlFlow::Break(Ok(pem)),
            Outcome::Denied { reason, message } => ControlFlow::Break(Err(CertError::Denied {
                name: name.clone(),
                reason,
                message,
            })),
            Outcome::Failed { reason, message } => ControlFlow::Break(Err(CertError::Failed {
                name: name.clone(),
                reason,
                message,
            })),
        },
    })
    .await
    .unwrap_or(Err(CertError::Undecided {
        name: name.clone(),
        waited: WAIT,
    }))?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(req.key.serialize_der()));
    live.set_identity(chain, key)
        .map_err(|source| CertError::Unusable { name, source })
}

/// Keeps `live`'s bundle the ConfigMap's `ca.crt`: read, then watched; a bundle that does not
/// parse, or a ConfigMap deleted, leaves the last good one in place (logged).
async fn follow_bundle(client: kube::Client, s: Settings, live: Arc<LiveTls>) {
    let api: Api<ConfigMap> = Api::namespaced(client, &s.ca_namespace);
    let origin = format!("ConfigMap {}/{}", s.ca_namespace, s.ca_name);
    let mut current: Option<String> = None;
    let mut missing_logged = false;
    let never = Instant::now() + Duration::from_secs(100 * 365 * 86400);
    let _: Option<()> = watch_one(&api, &s.ca_name, never, |cm| {
        let pem = cm
            .as_ref()
            .and_then(|c| c.data.as_ref())
            .and_then(|d| d.get(BUNDLE_KEY))
            .cloned();
        match pem {
            None if !missing_logged => {
                missing_logged = true;
                tracing::warn!(configmap = %origin, key = BUNDLE_KEY, have_one = current.is_some(),
                    "routes: no trust bundle in the CA ConfigMap (yet): calix-signer publishes it");
            }
            None => {}
            Some(pem) if current.as_ref() != Some(&pem) => {
                missing_logged = false;
                match tls::bundle(Path::new(&origin), pem.as_bytes()) {
                    Ok(roots) => match live.set_roots(roots) {
                        Ok(()) => {
                            tracing::info!(configmap = %origin, "routes: trust bundle in place");
                            current = Some(pem);
                        }
                        Err(e) => tracing::error!(configmap = %origin, error = %e, "routes: the trust bundle cannot be used; keeping the last one"),
                    },
                    Err(e) => tracing::error!(configmap = %origin, error = %e, "routes: the trust bundle does not parse; keeping the last one"),
                }
            }
            Some(_) => {}
        }
        ControlFlow::Continue(())
    })
    .await;
}

/// `f` on object `name` (`None`: it does not exist) as it is now, then on every change, until
/// it breaks or `deadline` passes (`None`). A failed read or watch is retried after 1 s
/// doubling to 10 s; a watch ends every few minutes and the object is read again.
async fn watch_one<K, T>(
    api: &Api<K>,
    name: &str,
    deadline: Instant,
    mut f: impl FnMut(Option<K>) -> ControlFlow<T>,
) -> Option<T>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut backoff = Duration::from_secs(1);
    let fields = format!("metadata.name={name}");
    while Instant::now() < deadline {
        let got = call(format!("read {name}"), async { api.get_opt(name).await }).await;
        let obj = match got {
            Ok(o) => o,
            Err(e) => {
                tracing::debug!(%name, error = %e, "routes: cannot read; retrying");
                tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())))
                    .await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        let version = obj
            .as_ref()
            .and_then(|o| o.meta().resource_version.clone())
            .unwrap_or_else(|| "0".into());
        if let ControlFlow::Break(t) = f(obj) {
            return Some(t);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let secs = u32::try_from(left.as_secs().clamp(1, 290)).unwrap_or(290);
        let wp = WatchParams::default().fields(&fields).timeout(secs);
        let stream = match api.watch(&wp, &version).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%name, error = %e, "routes: cannot watch; retrying");
                tokio::time::sleep(backoff.min(left)).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        let opened = Instant::now();
        let mut stream = std::pin::pin!(stream);
        let stopped = tokio::time::timeout(left, async {
            loop {
                match stream.try_next().await {
                    Ok(Some(WatchEvent::Added(o) | WatchEvent::Modified(o))) => {
                        if let ControlFlow::Break(t) = f(Some(o)) {
                            return Some(t);
                        }
                    }
                    Ok(Some(WatchEvent::Deleted(_))) => {
                        if let ControlFlow::Break(t) = f(None) {
                            return Some(t);
                        }
                    }
                    Ok(Some(WatchEvent::Bookmark(_))) => {}
                    // 410 Gone and the like: read it again.
                    Ok(Some(WatchEvent::Error(_))) | Ok(None) | Err(_) => return None,
                }
            }
        })
        .await;
        if let Ok(Some(t)) = stopped {
            return Some(t);
        }
        // A watch that ends at once (an error event, a server that closes it) is not retried
        // in a tight loop.
        if opened.elapsed() < Duration::from_secs(1) {
            tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())))
                .await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        } else {
            backoff = Duration::from_secs(1);
        }
    }
    None
}

/// One API call within [`CALL`].
async fn call<T>(
    what: impl Into<String>,
    fut: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, CertError> {
    let what = what.into();
    match tokio::time::timeout(CALL, fut).await {
        Ok(r) => r.map_err(api_err(what)),
        Err(_) => Err(CertError::Api {
            what,
            detail: format!("no answer within {CALL:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::certificates::v1::{
        CertificateSigningRequestCondition, CertificateSigningRequestStatus,
    };

    fn csr(conditions: &[(&str, &str)], cert: Option<&[u8]>) -> CertificateSigningRequest {
        CertificateSigningRequest {
            status: Some(CertificateSigningRequestStatus {
                certificate: cert.map(|c| ByteString(c.to_vec())),
                conditions: Some(
                    conditions
                        .iter()
                        .map(|(t, s)| CertificateSigningRequestCondition {
                            type_: t.to_string(),
                            status: s.to_string(),
                            reason: Some(format!("R{t}")),
                            message: Some(format!("m {t}")),
                            ..Default::default()
                        })
                        .collect(),
                ),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_requests_status_is_read_denial_and_failure_first() {
        assert_eq!(
            outcome_of(&CertificateSigningRequest::default()),
            Outcome::Pending
        );
        assert_eq!(
            outcome_of(&csr(&[("Approved", "True")], None)),
            Outcome::Pending
        );
        assert_eq!(
            outcome_of(&csr(&[("Approved", "True")], Some(b""))),
            Outcome::Pending
        );
        assert_eq!(
            outcome_of(&csr(&[("Approved", "True")], Some(b"PEM"))),
            Outcome::Issued(b"PEM".to_vec())
        );
        assert_eq!(
            outcome_of(&csr(&[("Denied", "True")], None)),
            Outcome::Denied {
                reason: "RDenied".into(),
                message: "m Denied".into()
            }
        );
        assert!(matches!(
            outcome_of(&csr(
                &[("Approved", "True"), ("Failed", "True")],
                Some(b"PEM")
            )),
            Outcome::Failed { .. }
        ));
        // A condition that is not true says nothing.
        assert_eq!(
            outcome_of(&csr(&[("Denied", "False")], None)),
            Outcome::Pending
        );
    }

    #[test]
    fn renewal_comes_at_60_to_70_percent_of_the_validity_left() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let day = Duration::from_secs(86_400);
        assert_eq!(renew_after(now, now + day, 0.0), day.mul_f64(0.6));
        assert_eq!(
            renew_after(now, now + day, 0.999_999),
            day.mul_f64(0.699_999_9)
        );
        let short = renew_after(now, now + Duration::from_secs(30), 0.5);
        assert!(
            short >= Duration::from_secs(18) && short <= Duration::from_secs(21),
            "{short:?}"
        );
        // Already expired: at once.
        assert_eq!(renew_after(now, now - day, 0.5), Duration::ZERO);
    }

    #[test]
    fn retries_back_off_to_30_s_and_never_past_a_tenth_of_the_validity_left() {
        let mid = |a, left| retry_after(a, left, 0.5);
        assert_eq!(mid(1, None), Duration::from_secs(1));
        assert_eq!(mid(2, None), Duration::from_secs(2));
        assert_eq!(mid(5, None), Duration::from_secs(16));
        assert_eq!(mid(6, None), Duration::from_secs(30));
        assert_eq!(mid(60, None), Duration::from_secs(30));
        // 50 s left: every 5 s at most; 3 s left: every second.
        assert_eq!(
            mid(6, Some(Duration::from_secs(50))),
            Duration::from_secs(5)
        );
        assert_eq!(mid(6, Some(Duration::from_secs(3))), Duration::from_secs(1));
        assert_eq!(retry_after(1, None, 0.0), Duration::from_millis(800));
        assert_eq!(retry_after(1, None, 1.0), Duration::from_millis(1200));
        let r = random();
        assert!((0.0..1.0).contains(&r));
    }
}
