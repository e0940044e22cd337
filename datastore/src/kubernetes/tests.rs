//! The kubernetes backend's unit tests, against a scripted API server.
use std::sync::{Arc, Mutex};

use super::*;

/// A store over a scripted API server: each request's path is recorded and answered by
/// `answer` (status, body).
fn scripted(
    answer: impl Fn(&str, usize) -> (u16, String) + Send + Sync + 'static,
) -> (KubeStore, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let answer = Arc::new(answer);
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let path = req.uri().path().to_string();
        let n = {
            let mut log = log.lock().expect("lock");
            log.push(path.clone());
            log.iter().filter(|p| **p == path).count()
        };
        let (status, body) = answer(&path, n);
        async move {
            http::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(kube::client::Body::from(body.into_bytes()))
        }
    });
    let client = kube::Client::new(service, "default");
    (KubeStore::new(client, Duration::from_secs(2), 5), seen)
}

fn forbidden() -> (u16, String) {
    (
        403,
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Forbidden", "code": 403,
            "message": "calixnodes.calix.dev \"n1\" is forbidden: User \"system:serviceaccount:kube-system:calix\" cannot get resource \"calixnodes\""})
        .to_string(),
    )
}

fn node_object() -> String {
    serde_json::json!({"apiVersion": "calix.dev/v1", "kind": "CalixNode",
        "metadata": {"name": "n1", "resourceVersion": "7",
            "annotations": {"calix.dev/key": "nodes/n1"}},
        "spec": {"name": "n1"}})
    .to_string()
}

/// An API server just (re)started serves requests before its authorizer has loaded the
/// RBAC objects, refusing every ServiceAccount meanwhile (seen in kubernetes.rs's API server
/// restart, once agents no longer ran as system:masters): a 403 while /readyz is not ok is
/// retried; from a ready server it is the answer, at once.
#[tokio::test]
async fn a_403_is_retried_only_while_the_api_server_is_not_ready() {
    let (store, seen) = scripted(|path, n| match path {
        "/readyz" => (500, "[-]informer-sync failed".into()),
        _ if n == 1 => forbidden(),
        _ => (200, node_object()),
    });
    let got = store
        .get("nodes/n1")
        .await
        .expect("the node record, once ready");
    assert_eq!(got.expect("present").revision, 7);
    assert!(seen.lock().expect("lock").contains(&"/readyz".to_string()));
    let (store, seen) = scripted(|path, _| match path {
        "/readyz" => (200, "ok".into()),
        _ => forbidden(),
    });
    let e = store.get("nodes/n1").await.expect_err("refused");
    assert!(
        matches!(&e, DatastoreError::Rejected { code: 403, .. }),
        "{e}"
    );
    let gets = seen
        .lock()
        .expect("lock")
        .iter()
        .filter(|p| p.ends_with("/n1"))
        .count();
    assert_eq!(gets, 1, "a refusal from a ready server is not retried");
}
