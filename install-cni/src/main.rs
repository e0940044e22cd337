//! `calix-install-cni`: installs the calix CNI plugin and its conflist on the node (the
//! DaemonSet's init container), or removes the conflist (`--uninstall`). Flags, or the
//! environment variables named in `--help`.
use std::path::PathBuf;

use anyhow::{Context, Result};
use calix_install_cni::{conflist, install, uninstall, Conflist, Install, Outcome, Removal};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "calix-install-cni", version, about)]
struct Flags {
    /// The node's CNI bin dir, as mounted in this container.
    #[arg(long, env = "CNI_BIN_DIR", default_value = "/host/opt/cni/bin")]
    bin_dir: PathBuf,
    /// The node's CNI conf dir, as mounted in this container.
    #[arg(long, env = "CNI_NET_DIR", default_value = "/host/etc/cni/net.d")]
    net_dir: PathBuf,
    /// A binary to install into the bin dir (repeatable); default: `calix` beside this program.
    #[arg(long = "plugin")]
    plugins: Vec<PathBuf>,
    /// The conflist's file name.
    #[arg(long, env = "CNI_CONF_NAME", default_value = conflist::DEFAULT_FILE_NAME)]
    conf_name: String,
    /// The CNI network name.
    #[arg(long, env = "CNI_NETWORK_NAME", default_value = conflist::DEFAULT_NETWORK)]
    network_name: String,
    /// The pods' MTU (68–65535); 0 or unset: the agent's answer.
    #[arg(long, env = "CNI_MTU")]
    mtu: Option<u32>,
    /// The agent's socket, as a path on the node (what the plugin, run by the runtime, opens).
    #[arg(long, env = "CALIX_AGENT_SOCKET", default_value = calix_proto::DEFAULT_AGENT_SOCKET)]
    agent_socket: PathBuf,
    /// The plugin's log level (error, warn, info, debug, trace).
    #[arg(long, env = "CNI_LOG_LEVEL")]
    log_level: Option<String>,
    /// The plugin's log file, as a path on the node; unset: the runtime's log (stderr).
    #[arg(long, env = "CNI_LOG_FILE")]
    log_file: Option<PathBuf>,
    /// Leave `portmap` out of the chain (no hostPort support).
    #[arg(long)]
    no_portmap: bool,
    /// Remove the conflist (if it is calix's) instead of installing. The binary stays: pods
    /// that still exist need it for their DEL.
    #[arg(long)]
    uninstall: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let flags = Flags::parse();
    if flags.uninstall {
        let path = flags.net_dir.join(&flags.conf_name);
        match uninstall(&flags.net_dir, &flags.conf_name)? {
            Removal::Removed => println!("removed {}", path.display()),
            Removal::Absent => println!("{} is not there: nothing to remove", path.display()),
            Removal::NotOurs => println!(
                "{} is not calix's (its first plugin is not calix): left as it is",
                path.display()
            ),
        }
        return Ok(());
    }
    let plugins = if flags.plugins.is_empty() {
        let me = std::env::current_exe().context("cannot find this program's own path")?;
        vec![me.with_file_name("calix")]
    } else {
        flags.plugins
    };
    let spec = Install {
        bin_dir: flags.bin_dir,
        net_dir: flags.net_dir,
        plugins,
        file_name: flags.conf_name,
        conflist: Conflist {
            network: flags.network_name,
            mtu: flags.mtu.filter(|m| *m != 0),
            agent_socket: flags.agent_socket,
            log_level: flags.log_level.filter(|l| !l.is_empty()),
            log_file: flags.log_file.filter(|f| !f.as_os_str().is_empty()),
            portmap: !flags.no_portmap,
        },
    };
    let report = install(&spec)?;
    for path in &report.stale_removed {
        println!("removed a crashed run's temporary file {}", path.display());
    }
    for (path, outcome) in &report.files {
        match outcome {
            Outcome::Written => println!("installed {}", path.display()),
            Outcome::Unchanged => println!("{} is up to date", path.display()),
        }
    }
    for path in &report.shadowed_by {
        tracing::warn!(
            "{} sorts before {}: a runtime that uses the first config file (containerd, CRI-O) \
             will use it instead of calix's; remove it",
            path.display(),
            spec.file_name
        );
    }
    Ok(())
}
