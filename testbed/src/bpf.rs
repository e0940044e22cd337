//! The kernel's view of BPF objects through bpftool: a process's maps, a hash map's keys, a
//! program's run time, the programs attached to a namespace's devices.
use std::process::Command;

use serde_json::Value;

use crate::process::{json, run, run_ok};
use crate::{Error, Result};

/// The ids of the BPF maps named `name` that process `pid` holds: its `bpf-map` fds'
/// `map_id` from /proc/<pid>/fdinfo, matched by name through bpftool.
pub fn bpf_maps_of(pid: u32, name: &str) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut ids: Vec<u64> = fds
        .filter_map(Result::ok)
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy() == "anon_inode:bpf-map")
        })
        .filter_map(|fd| {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .ok()?;
            info.lines()
                .find_map(|l| l.strip_prefix("map_id:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .filter(|id: &u64| {
            let out =
                run(Command::new("bpftool").args(["-j", "map", "show", "id", &id.to_string()]));
            serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|m| m["name"] == name)
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The keys (u32, little-endian) of a BPF hash map, via bpftool.
pub fn bpf_map_u32_keys(id: u64) -> Vec<u32> {
    let out = run_ok(Command::new("bpftool").args(["-j", "map", "dump", "id", &id.to_string()]));
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool dump json");
    v.as_array()
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| {
                    let key = e["key"].as_array()?;
                    let bytes: Vec<u8> = key
                        .iter()
                        .filter_map(|b| {
                            b.as_str().and_then(|s| {
                                u8::from_str_radix(s.trim_start_matches("0x"), 16).ok()
                            })
                        })
                        .collect();
                    let arr: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
                    Some(u32::from_le_bytes(arr))
                })
                .collect()
        })
        .unwrap_or_default()
}

const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// (run_time_ns, run_cnt) summed over every loaded BPF program named `name`, as the kernel
/// counts them with `bpf_stats_enabled`.
fn prog_stats(name: &str) -> Result<(u64, u64)> {
    // One program prints an object, several an array.
    let progs = match json(Command::new("bpftool").args(["-j", "prog", "show", "name", name]))? {
        Value::Array(a) => a,
        other => vec![other],
    };
    let field = |p: &Value, k: &str| p[k].as_u64().unwrap_or(0);
    Ok(progs.iter().fold((0, 0), |(t, n), p| {
        (t + field(p, "run_time_ns"), n + field(p, "run_cnt"))
    }))
}

/// Runs `load` with the kernel's BPF run-time statistics on (they cost two clock reads per run,
/// so never during a timed measurement), the sysctl put back after.
fn with_bpf_stats<T, E: From<Error>>(load: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let sysctl = |v: &str| std::fs::write(BPF_STATS_SYSCTL, v).map_err(Error::io(BPF_STATS_SYSCTL));
    let before = std::fs::read_to_string(BPF_STATS_SYSCTL).map_err(Error::io(BPF_STATS_SYSCTL))?;
    sysctl("1")?;
    let out = load();
    sysctl(before.trim())?;
    out
}

/// Runs `load` with the kernel's BPF run-time statistics on and returns program `name`'s
/// average run time per run (ns) and how many runs that is over. Only the loaded programs the
/// load reaches should run meanwhile: the statistics of every program of that name are summed.
pub fn program_run_time<E: From<Error>>(
    name: &str,
    load: impl FnOnce() -> Result<(), E>,
) -> Result<(f64, u64), E> {
    let (ns, runs) = with_bpf_stats(|| {
        let (t0, n0) = prog_stats(name)?;
        load()?;
        let (t1, n1) = prog_stats(name)?;
        Ok::<_, E>((t1.saturating_sub(t0), n1.saturating_sub(n0)))
    })?;
    if runs == 0 {
        return Err(Error::Unexpected {
            what: format!("{name} during the load"),
            found: "no run".into(),
            expected: "its program attached and reached".into(),
        }
        .into());
    }
    Ok((ns as f64 / runs as f64, runs))
}

/// A BPF program attached to a device of a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub dev: String,
    /// `xdp`, or tc's `ingress` / `egress`.
    pub hook: String,
    pub name: String,
    pub id: u64,
}

/// The tc and XDP programs attached to the devices of `ns` (`bpftool net show`, run inside it).
pub fn attached(ns: &crate::Netns) -> Result<Vec<Attached>> {
    let v = json(ns.command("bpftool")?.args(["-j", "net", "show"]))?;
    Ok(attached_from(&v))
}

fn attached_from(v: &Value) -> Vec<Attached> {
    let mut out = Vec::new();
    for section in v.as_array().into_iter().flatten() {
        for (kind, hook) in [("xdp", None), ("tc", Some(()))] {
            for p in section[kind].as_array().into_iter().flatten() {
                let (Some(dev), Some(id)) = (
                    p["devname"].as_str(),
                    p["id"].as_u64().or(p["prog_id"].as_u64()),
                ) else {
                    continue;
                };
                let hook = match hook {
                    None => "xdp".to_string(),
                    // "clsact/ingress", "tcx/egress", ...
                    Some(()) => p["kind"]
                        .as_str()
                        .and_then(|k| k.rsplit('/').next())
                        .unwrap_or("tc")
                        .to_string(),
                };
                out.push(Attached {
                    dev: dev.to_string(),
                    hook,
                    name: p["name"].as_str().unwrap_or("?").to_string(),
                    id,
                });
            }
        }
    }
    out
}

/// Runs `load` with the kernel's BPF run-time statistics on; for each of `ids`, its
/// (run_time_ns, run_cnt) during the load.
pub fn run_time_by_id<E: From<Error>>(
    ids: &[u64],
    load: impl FnOnce() -> Result<(), E>,
) -> Result<Vec<(u64, u64)>, E> {
    let read = || -> Result<Vec<(u64, u64)>> {
        ids.iter()
            .map(|id| {
                let p = json(Command::new("bpftool").args([
                    "-j",
                    "prog",
                    "show",
                    "id",
                    &id.to_string(),
                ]))?;
                let field = |k: &str| p[k].as_u64().unwrap_or(0);
                Ok((field("run_time_ns"), field("run_cnt")))
            })
            .collect()
    };
    with_bpf_stats(|| {
        let before = read()?;
        load()?;
        let after = read()?;
        Ok(before
            .iter()
            .zip(after)
            .map(|(b, a)| (a.0.saturating_sub(b.0), a.1.saturating_sub(b.1)))
            .collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attached_programs_are_read_from_bpftool_net() {
        let v: Value = serde_json::from_str(
            r#"[{"xdp":[{"devname":"eth0","ifindex":2,"mode":"driver","id":41}],
                 "tc":[{"devname":"eth0","ifindex":2,"kind":"clsact/ingress","name":"from_host_dev","id":42},
                       {"devname":"cali1234","ifindex":5,"kind":"tcx/egress","name":"to_pod","prog_id":43}],
                 "flow_dissector":[],"netfilter":[]}]"#,
        )
        .expect("json");
        let a = attached_from(&v);
        assert_eq!(a.len(), 3);
        assert_eq!((a[0].hook.as_str(), a[0].id), ("xdp", 41));
        assert_eq!(
            (a[1].dev.as_str(), a[1].hook.as_str(), a[1].name.as_str()),
            ("eth0", "ingress", "from_host_dev")
        );
        assert_eq!((a[2].hook.as_str(), a[2].id), ("egress", 43));
    }
}
