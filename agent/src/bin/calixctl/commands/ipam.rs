//! `ipam show`, `ipam check`, `ipam release`: through the agent or on the cluster's records.
use std::path::PathBuf;

use anyhow::{Context, Result};
use calix_agent::ipam::service::{CheckReport, IpamReport};
use calix_proto::v1 as pb;
use clap::Subcommand;

use crate::render::ipam as render;
use crate::Output;

#[derive(Subcommand)]
pub(crate) enum IpamCmd {
    /// Pools, blocks (with their node) and per-node use.
    Show,
    /// Look for leaks, duplicates and orphans; exits 1 if any is found. `-o json` gives a
    /// report `ipam release --from-report` takes.
    Check,
    /// Release addresses: one (`--ip`) or every leak of a `check -o json` report. A report's
    /// entries are released only if each address is still that very allocation.
    Release {
        #[arg(
            long,
            conflicts_with = "from_report",
            required_unless_present = "from_report"
        )]
        ip: Option<std::net::IpAddr>,
        #[arg(long)]
        from_report: Option<PathBuf>,
    },
}

/// Where `ipam` works: through the agent, or on the cluster's records.
pub(crate) enum Ipam {
    Agent(pb::ipam_client::IpamClient<tonic::transport::Channel>),
    Cluster(calix_datastore::KubeStore),
}

impl Ipam {
    async fn show(&mut self) -> Result<IpamReport> {
        match self {
            Ipam::Agent(client) => {
                let json = client
                    .show(pb::ShowRequest {})
                    .await
                    .context("ipam show")?
                    .into_inner()
                    .json;
                serde_json::from_str(&json).context("agent sent a bad report")
            }
            Ipam::Cluster(store) => calix_agent::ipam::admin::show(store)
                .await
                .context("ipam show on the cluster"),
        }
    }

    async fn check(&mut self) -> Result<CheckReport> {
        match self {
            Ipam::Agent(client) => {
                let json = client
                    .check(pb::CheckRequest {})
                    .await
                    .context("ipam check")?
                    .into_inner()
                    .json;
                serde_json::from_str(&json).context("agent sent a bad report")
            }
            Ipam::Cluster(store) => calix_agent::ipam::admin::check(store)
                .await
                .context("ipam check on the cluster"),
        }
    }

    async fn release(&mut self, addr: std::net::IpAddr, seq: u64, reason: String) -> Result<bool> {
        match self {
            Ipam::Agent(client) => Ok(client
                .release_address(pb::ReleaseAddressRequest {
                    address: addr.to_string(),
                    seq,
                    reason,
                })
                .await
                .with_context(|| format!("releasing {addr}"))?
                .into_inner()
                .released),
            Ipam::Cluster(store) => {
                calix_agent::ipam::admin::release(store, addr, (seq > 0).then_some(seq), &reason)
                    .await
                    .with_context(|| format!("releasing {addr} on the cluster"))
            }
        }
    }
}

pub(crate) async fn run(mut backend: Ipam, cmd: &IpamCmd, output: Output) -> Result<()> {
    match cmd {
        IpamCmd::Show => {
            let r = backend.show().await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
                Output::Table => println!("{}", render::ipam_show_table(&r)),
            }
        }
        IpamCmd::Check => {
            let r = backend.check().await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&r)?),
                Output::Table => println!("{}", render::ipam_check_table(&r)),
            }
            if !r.findings.is_empty() {
                std::process::exit(1);
            }
        }
        IpamCmd::Release { ip, from_report } => {
            let targets: Vec<(std::net::IpAddr, u64, String)> = match (ip, from_report) {
                (Some(ip), _) => vec![(*ip, 0, "released by calixctl ipam release --ip".into())],
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    let r: CheckReport = serde_json::from_str(&text).with_context(|| {
                        format!(
                            "{} is not a `calixctl ipam check -o json` report",
                            path.display()
                        )
                    })?;
                    r.findings
                        .iter()
                        .filter(|f| f.kind == "leak")
                        .filter_map(|f| {
                            Some((
                                f.address?,
                                f.seq?,
                                format!("released from report {}: {}", path.display(), f.detail),
                            ))
                        })
                        .collect()
                }
                (None, None) => anyhow::bail!("give --ip or --from-report"),
            };
            let mut rows = Vec::new();
            for (addr, seq, reason) in targets {
                let released = backend.release(addr, seq, reason).await?;
                rows.push((addr, released));
            }
            match output {
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "released": rows.iter().filter(|r| r.1).map(|r| r.0.to_string()).collect::<Vec<_>>(),
                        "unchanged": rows.iter().filter(|r| !r.1).map(|r| r.0.to_string()).collect::<Vec<_>>(),
                    }))?
                ),
                Output::Table => {
                    let t: Vec<Vec<String>> = rows
                        .iter()
                        .map(|(a, r)| {
                            vec![
                                a.to_string(),
                                if *r {
                                    "released"
                                } else {
                                    "unchanged (not allocated, or reallocated since the report)"
                                }
                                .into(),
                            ]
                        })
                        .collect();
                    println!("{}", crate::render::table(&["ADDRESS", "RESULT"], &t));
                }
            }
        }
    }
    Ok(())
}
