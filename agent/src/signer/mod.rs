//! calix-signer: the signer of route-distribution certificates (`calix.dev/routes`), issue 20.
//!
//! ```text
//!  Secret <ca_secret> (tls.crt, tls.key; made at first start) ──► ca_store ──► ConfigMap <ca_config_map>["ca.crt"]
//!                                                                    │           (the agents' trust bundle)
//!  CertificateSigningRequests (spec.signerName = ours) ──list, watch──► controller::handle
//!        policy::check (pure: who asks, for what) + policy::check_node (the Node exists)
//!          ├─ refused → Denied (or Failed, when somebody else approved it), with a reason
//!          └─ granted → Approved, then status.certificate: pki::ca::Ca::issue (one SAN, the node;
//!                        server and client auth; the configured lifetime)
//! ```
//!
//! - [`policy`]: which requests are signed, pure;
//! - [`ca_store`]: the CA in its Secret, made if absent; the bundle published;
//! - [`controller`]: one request handled ([`controller::handle`], over the narrow
//!   [`controller::SignerApi`]), and the loop over every request of the signer.
//!
//! One replica is enough and two are harmless: the CA Secret is created once (a second
//! signer reads the first's), and every status write carries the resourceVersion it decided
//! on, so a request is signed once.
pub mod ca_store;
pub mod controller;
pub mod policy;

use std::time::Duration;

/// What the signer is told (calix-signer's flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignerConfig {
    /// The signerName it answers for.
    pub signer_name: String,
    /// The agents' ServiceAccount, `<namespace>/<name>`: the only requester it signs for.
    pub agent_service_account: (String, String),
    /// Where the CA's Secret and the bundle's ConfigMap live.
    pub namespace: String,
    pub ca_secret: String,
    pub ca_config_map: String,
    /// The issued certificates' lifetime.
    pub lifetime: Duration,
    /// The CA's own lifetime (when made).
    pub ca_validity: Duration,
}

impl SignerConfig {
    /// The agents' user name.
    pub fn agent_user(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.agent_service_account.0, self.agent_service_account.1
        )
    }

    pub fn policy(&self) -> policy::Policy {
        policy::Policy {
            signer_name: self.signer_name.clone(),
            agent_user: self.agent_user(),
        }
    }
}

/// Why the CA Secret holds no usable CA.
#[derive(Debug, thiserror::Error)]
pub enum BadCaSecret {
    #[error("no {0}")]
    Missing(&'static str),
    /// Shown whole, not chained: [`SignerError::BadCa`] shows it as its detail.
    #[error("{}", calix_log::error_chain(.0))]
    Pem(calix_pki::PkiError),
}

/// Why the signer cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum SignerError {
    #[error("{what}: {detail}")]
    Api { what: String, detail: String },
    #[error(
        "Secret {namespace}/{name} holds no usable CA ({detail}): delete it to have calix-signer make a new one (every node then renews)"
    )]
    BadCa {
        namespace: String,
        name: String,
        detail: BadCaSecret,
    },
    #[error("making the CA")]
    Make(#[from] calix_pki::PkiError),
}
