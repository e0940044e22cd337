//! host-local's side: a process per allocation, as a runtime runs it.
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use calix_testbed::{Call, Plugin, CNI_DIR};
use serde_json::json;
use tokio::runtime::Runtime;

use super::calix::in_flight;
use super::samples::{Ids, Measured};
use super::{HOST_LOCAL_SUBNET, NETWORK};

/// Address files host-local holds in `data_dir` (it also keeps `lock` and `last_reserved_ip.*`).
fn host_local_held(data_dir: &Path) -> Result<usize> {
    let dir = data_dir.join(NETWORK);
    Ok(std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name != "lock" && !name.starts_with("last_reserved_ip")
        })
        .count())
}

/// `calls` with IN_FLIGHT processes running at a time: the wall time (s).
fn processes_in_flight(rt: &Runtime, p: &Arc<Plugin>, calls: Vec<Call<'static>>) -> Result<f64> {
    let (n, calls) = (calls.len(), Arc::new(calls));
    let call = move |p: Arc<Plugin>, i: usize| {
        let calls = calls.clone();
        async move { Ok(tokio::task::spawn_blocking(move || p.timed(&calls[i])).await??) }
    };
    Ok(rt.block_on(in_flight(p, n, call))?.0)
}

/// One repetition of host-local, a process per call, in a fresh `data_dir`.
pub(super) fn run_host_local(rt: &Runtime, data_dir: &Path, ids: &Ids) -> Result<Measured> {
    let conf = json!({
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "type": "host-local",
        "ipam": {
            "type": "host-local",
            "ranges": [[{ "subnet": HOST_LOCAL_SUBNET }]],
            "dataDir": data_dir.display().to_string(),
        },
    });
    let p = Arc::new(Plugin::new(
        "host-local",
        Path::new(CNI_DIR).join("host-local"),
        None,
        &conf,
    ));
    // host-local never opens the namespace, but its ADD refuses to run without CNI_NETNS.
    let netns = format!("/proc/{}/ns/net", std::process::id());
    let calls = |command: &'static str, phase: &str, n: usize| -> Vec<Call<'static>> {
        (0..n)
            .map(|i| Call::new(command, ids.id(phase, i), netns.clone(), String::new()))
            .collect()
    };
    let timed_all = |calls: &[Call]| -> Result<(f64, Vec<f64>)> {
        let t0 = Instant::now();
        let lat = calls.iter().map(|c| p.timed(c)).collect::<Result<_, _>>()?;
        Ok((t0.elapsed().as_secs_f64(), lat))
    };
    timed_all(&calls("ADD", "w", 1))?;
    timed_all(&calls("DEL", "w", 1))?;
    let (seq_wall, alloc_lat) = timed_all(&calls("ADD", "s", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != ids.n {
        bail!("host-local holds {held} addresses after {} ADDs", ids.n);
    }
    let (rel_wall, rel_lat) = timed_all(&calls("DEL", "s", ids.n))?;
    let conc_wall = processes_in_flight(rt, &p, calls("ADD", "c", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != ids.n {
        bail!(
            "host-local holds {held} addresses after {} concurrent ADDs",
            ids.n
        );
    }
    processes_in_flight(rt, &p, calls("DEL", "c", ids.n))?;
    let held = host_local_held(data_dir)?;
    if held != 0 {
        bail!("host-local still holds {held} addresses after every DEL");
    }
    Ok(Measured {
        seq_wall,
        conc_wall,
        rel_wall,
        alloc_lat,
        rel_lat,
        rpc_lat: Vec::new(),
        journal: None,
    })
}
