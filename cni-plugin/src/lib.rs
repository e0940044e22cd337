//! The calix CNI plugin as a library: the binary (`calix`) only dispatches to [`run`].
pub mod args;
pub mod client;
pub mod commands;
pub mod config;
pub mod error;
pub mod netns;
pub mod result;
pub mod veth;

use std::io::Read;

use args::{CniEnv, Command, Env};
use config::NetConf;
use error::CniError;

/// What the binary prints and how it exits.
pub struct Outcome {
    pub stdout: String,
    pub exit_code: i32,
}

fn version_info() -> String {
    serde_json::json!({
        "cniVersion": result::LATEST_VERSION,
        "supportedVersions": result::SUPPORTED_VERSIONS,
    })
    .to_string()
}

/// Runs one invocation: reads the environment and stdin, performs the verb.
pub async fn run(env: &dyn Env, stdin: &mut dyn Read) -> Outcome {
    match run_inner(env, stdin).await {
        Ok(out) => Outcome {
            stdout: out,
            exit_code: 0,
        },
        Err(e) => {
            tracing::error!(code = e.code, msg = %e.msg, details = %e.details, "CNI call failed");
            Outcome {
                stdout: e.to_json(),
                exit_code: 1,
            }
        }
    }
}

async fn run_inner(env: &dyn Env, stdin: &mut dyn Read) -> Result<String, CniError> {
    let cni = CniEnv::from_env(env)?;
    let mut input = Vec::new();
    stdin.read_to_end(&mut input).map_err(|e| {
        CniError::new(
            error::code::IO_FAILURE,
            format!("cannot read stdin: {e}"),
            "",
        )
    })?;
    if cni.command == Command::Version {
        return Ok(version_info());
    }
    let conf = NetConf::parse(&input)?;
    result::check_version(&conf.cni_version).map_err(|e| e.with_version(&conf.cni_version))?;
    let with_v = |e: CniError| e.with_version(&conf.cni_version);
    match cni.command {
        Command::Add => commands::add(&cni, &conf)
            .await
            .map(|v| v.to_string())
            .map_err(with_v),
        Command::Del => commands::del(&cni, &conf)
            .await
            .map(|()| String::new())
            .map_err(with_v),
        Command::Version => Ok(version_info()),
        Command::Check | Command::Gc | Command::Status => Err(with_v(CniError::new(
            error::code::UNSUPPORTED_FIELD,
            format!("{:?} is not implemented yet", cni.command),
            "calix implements ADD, DEL and VERSION so far",
        ))),
    }
}
