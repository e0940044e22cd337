//! calix's side: an agent per variant and repetition, driven over its gRPC API.
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use calix_proto::v1 as pb;
use calix_testbed::{Agent, AgentSpec, Dataplane, Netns};
use tokio::runtime::Runtime;

use super::samples::{Ids, Measured};
use super::{Client, BLOCK_SIZE, CALIX_POOL, IN_FLIGHT, NETWORK, RPC_TIMEOUT};
use crate::bench::harness::Bench;

/// The agent's free IPv4 addresses (its Status).
async fn free_v4(c: &Client) -> Result<u64> {
    Ok(c.clone()
        .status(pb::StatusRequest {})
        .await?
        .into_inner()
        .free_v4)
}

/// A fresh calix-agent in `ns` with `datastore` as its `[datastore]` section, answering; a
/// gRPC client of it.
fn start_agent(
    b: &Bench,
    rt: &Runtime,
    ns: &Netns,
    tag: &str,
    datastore: &str,
) -> Result<(Agent, Client)> {
    // Housekeeping (leak GC, empty-block release) every hour: no pass during a measurement.
    // (With the kubernetes datastore the pool is an IPPool object.)
    let pools = if datastore.contains("kubernetes") {
        String::new()
    } else {
        format!("[[pools]]\ncidr = \"{CALIX_POOL}\"\nblockSize = {BLOCK_SIZE}\n")
    };
    let config =
        format!("[datastore]\n{datastore}\n\n[ipam]\nleakCheckIntervalSecs = 3600\n\n{pools}");
    let spec = AgentSpec {
        config: Some(config),
        log_level: "warn",
        ..b.spec(Dataplane::Kernel)
    };
    let agent = Agent::new(&b.name(tag), b.dir.join(tag), Some(ns), spec)?;
    agent.start(&[])?;
    let ch = rt.block_on(calix_proto::connect_unix(&agent.socket, RPC_TIMEOUT))?;
    Ok((agent, Client::new(ch)))
}

/// One IPv4 allocation for `handle`; its address.
async fn allocate(mut c: Client, handle: String) -> Result<String> {
    let r = c
        .allocate(pb::AllocateRequest {
            handle: handle.clone(),
            ifname: "eth0".into(),
            ipv4: true,
            ..Default::default()
        })
        .await
        .with_context(|| format!("Allocate {handle}"))?
        .into_inner();
    match r.addresses.as_slice() {
        [a] if a.pool == CALIX_POOL && !r.already_allocated => Ok(a.address.clone()),
        _ => bail!("Allocate {handle} returned {r:?}"),
    }
}

async fn release(mut c: Client, handle: String) -> Result<()> {
    let r = c
        .release(pb::ReleaseRequest {
            handle: handle.clone(),
            ifname: "eth0".into(),
        })
        .await
        .with_context(|| format!("Release {handle}"))?
        .into_inner();
    if r.released != 1 {
        bail!("Release {handle} released {} addresses", r.released);
    }
    Ok(())
}

/// `op(client, i)` for every i in 0..n, one after another: the wall time (s), every call's
/// latency (ms) and the results.
async fn sequential<T, F, Fut>(c: &Client, n: usize, op: &F) -> Result<(f64, Vec<f64>, Vec<T>)>
where
    F: Fn(Client, usize) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut lat = Vec::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        out.push(op(c.clone(), i).await?);
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((t0.elapsed().as_secs_f64(), lat, out))
}

/// `op(ctx, i)` for every i in 0..n with IN_FLIGHT calls in flight (for calix, on the one
/// connection `ctx`): the wall time (s) and the results (unordered).
pub(super) async fn in_flight<C, T, F, Fut>(c: &C, n: usize, op: F) -> Result<(f64, Vec<T>)>
where
    C: Clone + Send + 'static,
    F: Fn(C, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let t0 = Instant::now();
    for _ in 0..IN_FLIGHT.min(n) {
        let (op, next, c) = (op.clone(), next.clone(), c.clone());
        tasks.spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, anyhow::Error>(out);
                }
                match op(c.clone(), i).await {
                    Ok(v) => out.push(v),
                    Err(e) => {
                        // The other tasks stop after their current call.
                        next.store(n, Ordering::Relaxed);
                        return Err(e);
                    }
                }
            }
        });
    }
    let mut all = Vec::with_capacity(n);
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(v)) => all.extend(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(e.into());
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    match first_err {
        Some(e) => Err(e),
        None => Ok((wall, all)),
    }
}

/// Fails unless the `n` addresses are `n` distinct ones.
fn distinct(what: &str, addrs: &[String], n: usize) -> Result<()> {
    let set: std::collections::HashSet<&String> = addrs.iter().collect();
    if addrs.len() != n || set.len() != n {
        bail!(
            "{what}: {} distinct addresses for {n} allocations",
            set.len()
        );
    }
    Ok(())
}

/// One repetition of one calix variant.
pub(super) fn run_calix(
    b: &Bench,
    rt: &Runtime,
    ns: &Netns,
    datastore: &str,
    ids: &Ids,
) -> Result<Measured> {
    let (agent, client) = start_agent(b, rt, ns, &format!("r{}{}", ids.rep, ids.tag), datastore)?;
    let handles = |phase: &str| -> Arc<Vec<String>> {
        Arc::new(
            (0..ids.n)
                .map(|i| calix_proto::handle::encode(NETWORK, &ids.id(phase, i)))
                .collect(),
        )
    };
    let alloc_op = |h: Arc<Vec<String>>| move |c: Client, i: usize| allocate(c, h[i].clone());
    let release_op = |h: Arc<Vec<String>>| move |c: Client, i: usize| release(c, h[i].clone());
    let (seq, conc, warm) = (handles("s"), handles("c"), handles("w"));
    let m = rt.block_on(async {
        // Warm-up (the connection, the agent's first allocation path): untimed.
        allocate(client.clone(), warm[0].clone()).await?;
        release(client.clone(), warm[0].clone()).await?;
        let free = free_v4(&client).await?;
        // The gRPC round trip with no datastore access: the floor of every call.
        let (_, rpc_lat, _) =
            sequential(
                &client,
                ids.n,
                &|c: Client, _| async move { free_v4(&c).await },
            )
            .await?;
        let (seq_wall, alloc_lat, addrs) =
            sequential(&client, ids.n, &alloc_op(seq.clone())).await?;
        distinct("sequential allocations", &addrs, ids.n)?;
        let journal = std::fs::metadata(agent.dir.join("store.json.journal"))
            .map(|m| m.len())
            .ok();
        let (rel_wall, rel_lat, _) = sequential(&client, ids.n, &release_op(seq)).await?;
        let (conc_wall, addrs) = in_flight(&client, ids.n, alloc_op(conc.clone())).await?;
        distinct("concurrent allocations", &addrs, ids.n)?;
        in_flight(&client, ids.n, release_op(conc)).await?;
        let after = free_v4(&client).await?;
        if after != free {
            bail!("{free} free addresses before the allocations, {after} after releasing them all");
        }
        Ok::<_, anyhow::Error>(Measured {
            seq_wall,
            conc_wall,
            rel_wall,
            alloc_lat,
            rel_lat,
            rpc_lat,
            journal,
        })
    });
    // The agent stops (SIGTERM) and its files go when it drops, at the end of this function:
    // it does not run during other variants.
    m.map_err(|e| match agent.exited() {
        Some(status) => e.context(format!(
            "calix-agent exited ({status}); its log:\n{}",
            agent.log()
        )),
        None => e,
    })
}
