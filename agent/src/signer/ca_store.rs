//! The signer's CA in the Kubernetes API: a Secret (type `kubernetes.io/tls`: `tls.crt`,
//! `tls.key`) that only the signer may read, made at the first start when absent (a create,
//! so two signers starting at once end with one CA: the loser reads the winner's); and the
//! bundle the agents trust, the CA certificate alone, in a ConfigMap's `ca.crt`, written when
//! missing or different. Both outlive the signer (and `helm uninstall`, as CRDs do): a
//! reinstalled signer keeps the CA, and the agents' certificates stay valid.
use std::collections::BTreeMap;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams};

use super::{BadCaSecret, SignerConfig, SignerError};
use crate::kubernetes::certificates::BUNDLE_KEY;
use calix_pki::ca::Ca;

/// The CA's common name.
pub const CA_NAME: &str = "calix routes CA";

fn api_err(what: String) -> impl FnOnce(kube::Error) -> SignerError {
    move |e| SignerError::Api {
        what,
        detail: e.to_string(),
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

fn meta(cfg: &SignerConfig, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(cfg.namespace.clone()),
        labels: Some(
            [
                ("app.kubernetes.io/name".to_string(), "calix".to_string()),
                (
                    "app.kubernetes.io/component".to_string(),
                    "signer".to_string(),
                ),
            ]
            .into(),
        ),
        ..Default::default()
    }
}

/// The CA from its Secret, made (and stored) when there is none.
pub async fn ensure_ca(client: &kube::Client, cfg: &SignerConfig) -> Result<Ca, SignerError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let what = format!("Secret {}/{}", cfg.namespace, cfg.ca_secret);
    loop {
        if let Some(s) = api
            .get_opt(&cfg.ca_secret)
            .await
            .map_err(api_err(format!("read {what}")))?
        {
            return from_secret(&s).map_err(|detail| SignerError::BadCa {
                namespace: cfg.namespace.clone(),
                name: cfg.ca_secret.clone(),
                detail,
            });
        }
        let ca = Ca::generate(CA_NAME, SystemTime::now(), cfg.ca_validity)?;
        let secret = Secret {
            metadata: meta(cfg, &cfg.ca_secret),
            type_: Some("kubernetes.io/tls".into()),
            data: Some(BTreeMap::from([
                (
                    "tls.crt".to_string(),
                    ByteString(ca.cert_pem().as_bytes().to_vec()),
                ),
                ("tls.key".to_string(), ByteString(ca.key_pem().into_bytes())),
            ])),
            ..Default::default()
        };
        match api.create(&PostParams::default(), &secret).await {
            Ok(_) => {
                tracing::info!(secret = %what, "signer: made a new CA");
                return Ok(ca);
            }
            // Another signer made one first: use it.
            Err(e) if is_status(&e, 409) => continue,
            Err(e) => return Err(api_err(format!("create {what}"))(e)),
        }
    }
}

fn from_secret(s: &Secret) -> Result<Ca, BadCaSecret> {
    let field = |k: &'static str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .ok_or(BadCaSecret::Missing(k))
    };
    Ca::from_pem(&field("tls.crt")?, &field("tls.key")?).map_err(BadCaSecret::Pem)
}

/// The bundle ConfigMap's `ca.crt` is `ca`'s certificate: created, or replaced when it
/// differs (carrying the resourceVersion read). Returns whether it wrote.
pub async fn publish(
    client: &kube::Client,
    cfg: &SignerConfig,
    ca: &Ca,
) -> Result<bool, SignerError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &cfg.namespace);
    let what = format!("ConfigMap {}/{}", cfg.namespace, cfg.ca_config_map);
    let data = BTreeMap::from([(BUNDLE_KEY.to_string(), ca.cert_pem().to_string())]);
    match api
        .get_opt(&cfg.ca_config_map)
        .await
        .map_err(api_err(format!("read {what}")))?
    {
        None => {
            let cm = ConfigMap {
                metadata: meta(cfg, &cfg.ca_config_map),
                data: Some(data),
                ..Default::default()
            };
            match api.create(&PostParams::default(), &cm).await {
                Ok(_) => {}
                Err(e) if is_status(&e, 409) => return Ok(false),
                Err(e) => return Err(api_err(format!("create {what}"))(e)),
            }
        }
        Some(cm) if cm.data.as_ref().and_then(|d| d.get(BUNDLE_KEY)) == Some(&data[BUNDLE_KEY]) => {
            return Ok(false)
        }
        Some(mut cm) => {
            cm.data.get_or_insert_with(BTreeMap::new).extend(data);
            match api
                .replace(&cfg.ca_config_map, &PostParams::default(), &cm)
                .await
            {
                Ok(_) => {}
                Err(e) if is_status(&e, 409) => return Ok(false),
                Err(e) => return Err(api_err(format!("update {what}"))(e)),
            }
        }
    }
    tracing::info!(configmap = %what, key = BUNDLE_KEY, "signer: published the trust bundle");
    Ok(true)
}
