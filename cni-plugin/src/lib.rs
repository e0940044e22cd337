//! The calix CNI plugin as a library: the binary (`calix`) only dispatches to [`run`].
pub mod args;
pub mod client;
pub mod commands;
pub mod config;
pub mod error;
pub mod ipam;
pub mod kernel;
pub mod logging;
pub mod result;
pub mod version;

use std::io::Read;

use args::{CniEnv, Command, Env};
use commands::Invocation;
use config::NetConf;
use error::CniError;

/// What the binary prints and how it exits.
pub struct Outcome {
    pub stdout: String,
    pub exit_code: i32,
}

fn version_info() -> String {
    serde_json::json!({
        "cniVersion": version::LATEST,
        "supportedVersions": version::SUPPORTED,
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
    let mut raw = Vec::new();
    stdin.read_to_end(&mut raw).map_err(|e| {
        CniError::new(
            error::code::IO_FAILURE,
            format!("cannot read stdin: {e}"),
            "",
        )
    })?;
    if cni.command == Command::Version {
        return Ok(version_info());
    }
    let conf = NetConf::parse(&raw)?;
    logging::init(&conf);
    if !version::is_supported(&conf.cni_version) {
        return Err(CniError::unsupported_version(&conf.cni_version));
    }
    tracing::info!(command = ?cni.command, container = %cni.container_id, ifname = %cni.ifname, netns = %cni.netns, "CNI call");
    let inv = Invocation {
        env: &cni,
        conf: &conf,
        raw: &raw,
    };
    let out = match cni.command {
        Command::Add => commands::add::run(&inv).await.map(|v| v.to_string()),
        Command::Del => commands::del::run(&inv).await.map(|()| String::new()),
        Command::Check => commands::check::run(&inv).await.map(|()| String::new()),
        Command::Gc => commands::gc::run(&inv).await.map(|()| String::new()),
        Command::Status => commands::status::run(&inv).await.map(|()| String::new()),
        Command::Version => Ok(version_info()),
    };
    out.map_err(|e| e.with_version(&conf.cni_version))
}
