//! The kernel's view of BPF objects through bpftool: a process's maps, a hash map's keys, a
//! program's run time, the programs attached to a namespace's devices.
use std::path::PathBuf;
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

/// The entries (key bytes, value bytes) of a BPF map that is not per-CPU, via bpftool.
pub fn bpf_map_dump(id: u64) -> Vec<(Vec<u8>, Vec<u8>)> {
    let out = run_ok(Command::new("bpftool").args(["-j", "map", "dump", "id", &id.to_string()]));
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool dump json");
    let bytes = |v: &Value| -> Option<Vec<u8>> {
        v.as_array()?
            .iter()
            .map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
            .collect()
    };
    v.as_array()
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| Some((bytes(&e["key"])?, bytes(&e["value"])?)))
                .collect()
        })
        .unwrap_or_default()
}

/// The keys (u32, little-endian) of a BPF hash map, via bpftool.
pub fn bpf_map_u32_keys(id: u64) -> Vec<u32> {
    bpf_map_dump(id)
        .into_iter()
        .filter_map(|(k, _)| Some(u32::from_le_bytes(k.get(..4)?.try_into().ok()?)))
        .collect()
}

/// `bpf(2)` command BPF_PROG_QUERY and the tcx attach types (include/uapi/linux/bpf.h).
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// The `query` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct ProgQuery {
    target_ifindex: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    count: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// The tcx attachments on interface `ifname` of the calling thread's network namespace, in
/// direction `dir` (`ingress` or `egress`), in order: (program id, link id; 0 for a program
/// attached without a link).
pub fn tcx_attachments(ifname: &str, dir: &str) -> std::io::Result<Vec<(u32, u32)>> {
    let name = std::ffi::CString::new(ifname).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated name, looked up in this thread's namespace.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut progs = [0u32; 64];
    let mut links = [0u32; 64];
    let mut q = ProgQuery {
        target_ifindex: index,
        attach_type: if dir == "ingress" {
            BPF_TCX_INGRESS
        } else {
            BPF_TCX_EGRESS
        },
        prog_ids: progs.as_mut_ptr() as u64,
        count: progs.len() as u32,
        link_ids: links.as_mut_ptr() as u64,
        ..ProgQuery::default()
    };
    // SAFETY: `q` is a valid BPF_PROG_QUERY attribute of the size passed, whose `prog_ids` and
    // `link_ids` point at `count` writable u32s each that outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &mut q as *mut ProgQuery,
            std::mem::size_of::<ProgQuery>() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = (q.count as usize).min(progs.len());
    Ok(progs[..n]
        .iter()
        .copied()
        .zip(links[..n].iter().copied())
        .collect())
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

/// (run_time_ns, run_cnt) of the one program `bpftool prog show <how> <what>` prints.
fn one_prog_stats(how: &str, what: impl AsRef<std::ffi::OsStr>) -> Result<(u64, u64)> {
    let p = json(
        Command::new("bpftool")
            .args(["-j", "prog", "show", how])
            .arg(what),
    )?;
    let field = |k: &str| p[k].as_u64().unwrap_or(0);
    Ok((field("run_time_ns"), field("run_cnt")))
}

/// Runs `load` with the kernel's BPF run-time statistics on (they cost two clock reads per run,
/// so never during a timed measurement) and returns how `read`'s (run_time_ns, run_cnt) moved
/// meanwhile, one per program it reads.
fn with_stats<E: From<Error>>(
    read: impl Fn() -> Result<Vec<(u64, u64)>>,
    load: impl FnOnce() -> Result<(), E>,
) -> Result<Vec<(u64, u64)>, E> {
    let sysctl = |v: &str| std::fs::write(BPF_STATS_SYSCTL, v).map_err(Error::io(BPF_STATS_SYSCTL));
    let before = std::fs::read_to_string(BPF_STATS_SYSCTL).map_err(Error::io(BPF_STATS_SYSCTL))?;
    sysctl("1")?;
    let measured = (|| {
        let s0 = read()?;
        load()?;
        let s1 = read()?;
        Ok::<_, E>(
            s0.iter()
                .zip(s1)
                .map(|((t0, n0), (t1, n1))| (t1.saturating_sub(*t0), n1.saturating_sub(*n0)))
                .collect(),
        )
    })();
    sysctl(before.trim())?;
    measured
}

/// A program's average run time per run (ns) over `runs` runs; `None` when it did not run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunTime {
    pub ns_per_run: Option<f64>,
    pub runs: u64,
}

impl RunTime {
    fn of((ns, runs): (u64, u64)) -> Self {
        Self {
            ns_per_run: (runs > 0).then(|| ns as f64 / runs as f64),
            runs,
        }
    }
}

/// Runs `load` with the kernel's BPF run-time statistics on and returns the run time of each
/// program pinned at `pins` (by pin, so programs of the same name elsewhere on the machine do
/// not count).
pub fn pinned_run_time<E: From<Error>>(
    pins: &[PathBuf],
    load: impl FnOnce() -> Result<(), E>,
) -> Result<Vec<RunTime>, E> {
    let read = || pins.iter().map(|p| one_prog_stats("pinned", p)).collect();
    Ok(with_stats(read, load)?
        .into_iter()
        .map(RunTime::of)
        .collect())
}

/// Runs `load` with the kernel's BPF run-time statistics on and returns program `name`'s
/// average run time per run (ns) and how many runs that is over. Only the loaded programs the
/// load reaches should run meanwhile: the statistics of every program of that name are summed.
pub fn program_run_time<E: From<Error>>(
    name: &str,
    load: impl FnOnce() -> Result<(), E>,
) -> Result<(f64, u64), E> {
    let read = || prog_stats(name).map(|s| vec![s]);
    let (ns, runs) = with_stats(read, load)?[0];
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

/// The tc (cls_bpf and tcx) and XDP programs attached to the devices of `ns` (`bpftool net
/// show`, run inside it; tcx hooks also from the kernel: bpftool before 7.3, Debian 12's 7.1,
/// does not list them).
pub fn attached(ns: &crate::Netns) -> Result<Vec<Attached>> {
    let v = json(ns.command("bpftool")?.args(["-j", "net", "show"]))?;
    let mut out = attached_from(&v);
    let links = json(ns.command("ip")?.args(["-j", "link", "show"]))?;
    let devs: Vec<String> = links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| Some(l["ifname"].as_str()?.to_string()))
        .collect();
    let tcx = ns
        .spawn(None, move || {
            let mut found = Vec::new();
            for dev in devs {
                for hook in ["ingress", "egress"] {
                    match tcx_attachments(&dev, hook) {
                        Ok(a) => found.extend(a.into_iter().map(|(id, _)| (dev.clone(), hook, id))),
                        // A kernel without tcx; a device gone meanwhile.
                        Err(e)
                            if matches!(
                                e.raw_os_error(),
                                Some(libc::EINVAL | libc::ENODEV | libc::ENXIO)
                            ) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(found)
        })?
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
        .map_err(Error::io("BPF_PROG_QUERY (tcx)"))?;
    for (dev, hook, id) in tcx {
        let id = u64::from(id);
        if out
            .iter()
            .any(|a| a.dev == dev && a.hook == hook && a.id == id)
        {
            continue;
        }
        let p = json(Command::new("bpftool").args(["-j", "prog", "show", "id", &id.to_string()]))?;
        out.push(Attached {
            dev,
            hook: hook.to_string(),
            name: p["name"].as_str().unwrap_or("?").to_string(),
            id,
        });
    }
    Ok(out)
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
    let read = || {
        ids.iter()
            .map(|id| one_prog_stats("id", id.to_string()))
            .collect()
    };
    with_stats(read, load)
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
