//! What can go wrong while building a test bed or measuring on it. The tests' constructors
//! panic with these; the benches carry them up as errors.
use std::process::ExitStatus;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot run {cmd}: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{cmd} failed ({status}): {stdout}\n{stderr}")]
    Failed {
        cmd: String,
        status: ExitStatus,
        stdout: String,
        stderr: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A daemon that exited or never answered; `log` is what it wrote.
    #[error("{what} did not come up{}:\n{log}", exited.map(|s| format!(" (exited: {s})")).unwrap_or_default())]
    NotReady {
        what: String,
        exited: Option<ExitStatus>,
        log: String,
    },
    #[error("{what} printed no JSON: {text}")]
    NotJson { what: String, text: String },
    #[error("no {field} in {value}")]
    Missing { field: String, value: String },
    #[error("{what}: {found}, expected {expected}")]
    Unexpected {
        what: String,
        found: String,
        expected: String,
    },
    /// `call`: which plugin, verb and container.
    #[error("{call} failed ({status}): {stdout}\n{stderr}")]
    Cni {
        call: String,
        status: ExitStatus,
        stdout: String,
        stderr: String,
    },
    #[error("Kubernetes API: {what}: {detail}")]
    Kube { what: String, detail: String },
    #[error("a thread of the test bed panicked: {what}")]
    Panicked { what: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error with what was being done.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}
