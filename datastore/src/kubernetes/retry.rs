//! One request to the API server, retried: what its answers mean (done, missing, a lost
//! compare), which failures may go away by themselves (and a 403 from a server not ready yet),
//! and the errors the others become.
use std::future::Future;
use std::time::Duration;

use kube::core::Status;

use super::kinds::{self, Kind};
use super::{KubeStore, BACKEND};
use crate::DatastoreError;

/// First pause between attempts; it doubles after each failed attempt, up to [`MAX_BACKOFF`].
pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(50);
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What one try of a request came to, before the store decides (a lost compare is an
/// answer, not a failure).
pub(super) enum Answer<T> {
    Done(T),
    /// 404 Not Found.
    Missing(Box<Status>),
    /// 409: AlreadyExists or Conflict.
    Lost,
}

impl KubeStore {
    /// Runs `call` with retries on transient failures, a timeout per try.
    pub(super) async fn retry<T, F, Fut>(
        &self,
        what: &str,
        call: F,
    ) -> Result<Answer<T>, DatastoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let mut backoff = FIRST_BACKOFF;
        let mut detail = String::new();
        for attempt in 1..=self.attempts {
            match tokio::time::timeout(self.timeout, call()).await {
                Ok(Ok(v)) => return Ok(Answer::Done(v)),
                Ok(Err(kube::Error::Api(s))) if s.code == 404 => return Ok(Answer::Missing(s)),
                Ok(Err(kube::Error::Api(s))) if s.code == 409 => return Ok(Answer::Lost),
                // A server just (re)started answers before its authorizer has loaded the RBAC
                // objects, refusing every ServiceAccount meanwhile: retried while it says it
                // is not ready; from a ready one, a 403 is the answer.
                Ok(Err(e @ kube::Error::Api(_))) if forbidden(&e) => {
                    if self.ready().await {
                        return Err(rejected(what, &e));
                    }
                    detail = format!("{what}: {e} (the API server is not ready yet)");
                }
                Ok(Err(e)) if !transient(&e) => return Err(rejected(what, &e)),
                Ok(Err(e)) => detail = format!("{what}: {e}"),
                Err(_) => detail = format!("{what}: no answer within {:?}", self.timeout),
            }
            if attempt < self.attempts {
                tracing::warn!(
                    attempt,
                    attempts = self.attempts,
                    ?backoff,
                    "kubernetes {detail}; retrying"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
        Err(DatastoreError::Unavailable {
            backend: BACKEND,
            attempts: self.attempts,
            detail,
        })
    }

    /// Whether the API server says it is ready (`/readyz` answers `ok`).
    async fn ready(&self) -> bool {
        let Ok(req) = http::Request::get("/readyz").body(Vec::new()) else {
            return false;
        };
        matches!(
            tokio::time::timeout(self.timeout, self.client.request_text(req)).await,
            Ok(Ok(body)) if body.trim() == "ok"
        )
    }
}

/// A 403 Forbidden.
fn forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403)
}

/// Whether a failure may go away by itself.
pub(super) fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => {
            matches!(s.code, 429 | 500 | 502 | 503 | 504) || admission_not_ready(s)
        }
        kube::Error::HyperError(_)
        | kube::Error::Service(_)
        | kube::Error::ReadEvents(_)
        | kube::Error::SerdeError(_) => true,
        _ => false,
    }
}

/// A ValidatingAdmissionPolicy the server cannot apply yet: a (re)started API server answers
/// 422 "failed to configure policy: failed to find resource referenced by paramKind" until it
/// has discovered the parameters' CustomResourceDefinition (seen in CI right after a restart).
/// It goes away by itself; a policy that stays broken still ends the retries.
fn admission_not_ready(s: &Status) -> bool {
    s.code == 422 && s.message.contains("failed to configure policy")
}

fn rejected(what: &str, e: &kube::Error) -> DatastoreError {
    match e {
        kube::Error::Api(s) => DatastoreError::Rejected {
            backend: BACKEND,
            what: what.into(),
            code: s.code,
            detail: format!("{}: {}", s.reason, s.message),
        },
        other => DatastoreError::Rejected {
            backend: BACKEND,
            what: what.into(),
            code: 0,
            detail: other.to_string(),
        },
    }
}

pub(super) fn crd_missing(kind: &Kind, s: &Status) -> DatastoreError {
    DatastoreError::Rejected {
        backend: BACKEND,
        what: format!("{}.{}", kind.plural, kinds::GROUP),
        code: s.code,
        detail: format!(
            "{}: the CustomResourceDefinition is not installed (apply charts/calix/crds)",
            s.message
        ),
    }
}

pub(super) fn unexpected_conflict(what: &str) -> DatastoreError {
    DatastoreError::Rejected {
        backend: BACKEND,
        what: what.into(),
        code: 409,
        detail: "conflict on a read".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(Status {
            code,
            message: message.into(),
            ..Status::default()
        }))
    }

    #[test]
    fn an_admission_policy_not_configured_yet_is_retried_an_invalid_object_is_not() {
        assert!(transient(&api(503, "unavailable")));
        assert!(transient(&api(
            422,
            "ipamblocks.calix.dev \"10.61.2.0-26\" is forbidden: ValidatingAdmissionPolicy \
             'calix-agent-ipamblocks-pools' denied request: failed to configure policy: failed \
             to find resource referenced by paramKind: 'calix.dev/v1, Kind=IPPool'"
        )));
        assert!(!transient(&api(
            422,
            "ipamblocks.calix.dev \"x\" is invalid: spec.cidr: Invalid value"
        )));
        assert!(!transient(&api(400, "bad request")));
    }
}
