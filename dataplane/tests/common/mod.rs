//! What the program tests share (`programs.rs`: the tc programs; `xdp_programs.rs`: the XDP
//! prefilter): BPF_PROG_TEST_RUN, a network namespace and a bpffs pin directory per test, the
//! object loaded as the agent loads it, drop counters; and the test bed's packet builders
//! (`calix_testbed::packets`).
#![allow(dead_code)] // Each test file uses its own part of it.

use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use aya::maps::{Map, MapData, MapError, PerCpuHashMap};
use aya::programs::Program;
use aya::{Ebpf, EbpfLoader};
use calix_common::{DropCount, DropKey, DropReason, ALL_PROGRAMS};
use calix_dataplane::ebpf::OBJECT;

// The packet builders of the test bed: one copy for these tests and the namespace tests.
// Each test binary uses its own part of them (pins.rs none).
#[allow(unused_imports)]
pub use calix_testbed::packets::*;

// ---- BPF_PROG_TEST_RUN ----

/// `bpf(2)` command BPF_PROG_TEST_RUN (`enum bpf_cmd`, include/uapi/linux/bpf.h).
const BPF_PROG_TEST_RUN: libc::c_int = 10;

/// The `test` member of `union bpf_attr` (include/uapi/linux/bpf.h). The kernel wants the
/// bytes it does not know zeroed: the C struct's tail padding is a field here.
#[repr(C)]
#[derive(Default)]
#[allow(dead_code)] // Layout only: the kernel reads and writes these.
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}
const _: () = assert!(size_of::<TestRunAttr>() == 80);

/// A program's verdict, the frame it left, its context as it left it, and its run time as
/// the kernel measured it (ns, one run).
pub struct Run {
    pub verdict: u32,
    pub frame: Vec<u8>,
    pub ctx: Vec<u32>,
    pub duration_ns: u32,
}

/// Runs the program behind `prog` once on `frame`, with `ctx` (the program type's context
/// struct, `__sk_buff` or `xdp_md`, as `u32` words) as its context.
pub fn test_run(prog: BorrowedFd<'_>, frame: &[u8], ctx: &[u32]) -> std::io::Result<Run> {
    let mut out = vec![0u8; frame.len() + 256];
    // Room for the whole context struct (`__sk_buff` is 192 bytes): a shorter buffer fails
    // the run with ENOSPC.
    let mut ctx_out = vec![0u32; 64];
    let mut attr = TestRunAttr {
        prog_fd: u32::try_from(prog.as_raw_fd()).expect("fd"),
        data_size_in: u32::try_from(frame.len()).expect("frame size"),
        data_size_out: u32::try_from(out.len()).expect("buffer size"),
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: 1,
        ctx_size_in: u32::try_from(size_of_val(ctx)).expect("context size"),
        ctx_in: ctx.as_ptr() as u64,
        ctx_size_out: u32::try_from(size_of_val(ctx_out.as_slice())).expect("context size"),
        ctx_out: ctx_out.as_mut_ptr() as u64,
        ..TestRunAttr::default()
    };
    // SAFETY: `attr` is a BPF_PROG_TEST_RUN attribute of the size given; the frame, the output
    // buffer and the context it points to are valid for the sizes next to them until it returns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestRunAttr,
            size_of::<TestRunAttr>() as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    let verdict = attr.retval;
    Ok(Run {
        verdict,
        frame: out,
        ctx: ctx_out,
        duration_ns: attr.duration,
    })
}

// ---- Environment: root, network namespace, pins ----

pub fn assert_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests need root (bpffs, BPF_PROG_TEST_RUN, network namespaces): run them as root"
    );
}

/// Runs `test` on a thread of its own in a new network namespace, which goes away with the
/// thread (and the interfaces the test made in it). A panic in `test` fails the caller.
pub fn in_netns(test: impl FnOnce() + Send + 'static) {
    assert_root();
    let thread = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        test();
    });
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}

/// Runs `ip` (iproute2) in the calling thread's network namespace.
pub fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("run ip");
    assert!(status.success(), "ip {}: {status}", args.join(" "));
}

/// Creates the veth pair `name` / `<name>p` and returns the ifindex of `name`.
pub fn veth(name: &str) -> u32 {
    let peer = format!("{name}p");
    ip(&["link", "add", name, "type", "veth", "peer", "name", &peer]);
    nix::net::if_::if_nametoindex(name).expect("ifindex of the new veth")
}

/// A fresh directory on bpffs for the maps' pins, removed with them when dropped.
pub struct PinDir(pub PathBuf);

impl PinDir {
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        // A fresh machine may have no bpffs: mount it as the agent would.
        calix_kernel::bpffs::ensure_mounted().expect("mount bpffs at /sys/fs/bpf");
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = format!("/sys/fs/bpf/cxt-progtest-{}-{n}", std::process::id());
        std::fs::create_dir_all(&dir).expect("create the pin directory");
        PinDir(PathBuf::from(dir))
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Loads the object as the agent does (maps pinned under `pins`), every program through the
/// verifier as its own type (tc classifier or XDP).
pub fn load_object(pins: &PinDir) -> Ebpf {
    load_object_sized(pins, &[])
}

/// As [`load_object`], with the maps named in `sizes` given those `max_entries`.
pub fn load_object_sized(pins: &PinDir, sizes: &[(&str, u32)]) -> Ebpf {
    let mut loader = EbpfLoader::new();
    loader.map_pin_path(&pins.0);
    for (name, size) in sizes {
        loader.set_max_entries(name, *size);
    }
    let mut bpf = loader
        .load(OBJECT)
        .expect("load the object (maps created and pinned)");
    for name in ALL_PROGRAMS {
        let loaded = match bpf.program_mut(name).expect("a program of ALL_PROGRAMS") {
            Program::SchedClassifier(p) => p.load(),
            Program::Xdp(p) => p.load(),
            Program::CgroupSockAddr(p) => p.load(),
            other => panic!("{name}: unexpected program type {:?}", other.prog_type()),
        };
        if let Err(e) = loaded {
            panic!("the verifier rejects {name}: {e}");
        }
    }
    bpf
}

/// Every drop counter of `drops` (`CALIX_DROPS`), summed over the CPUs.
pub fn all_drops(drops: &PerCpuHashMap<MapData, DropKey, DropCount>) -> Vec<(DropKey, DropCount)> {
    let mut out = Vec::new();
    for item in drops.iter() {
        let (key, per_cpu) = item.expect("iterate the drop counters");
        let mut sum = DropCount::default();
        per_cpu.iter().for_each(|c| sum.accumulate(c));
        out.push((key, sum));
    }
    out
}

/// The drop counter (`ifindex`, `reason`) of `drops`; zero when absent.
pub fn dropped(
    drops: &PerCpuHashMap<MapData, DropKey, DropCount>,
    ifindex: u32,
    reason: DropReason,
) -> DropCount {
    let key = DropKey {
        ifindex,
        reason: reason as u32,
    };
    let found = all_drops(drops).into_iter().find(|(k, _)| *k == key);
    found.map(|(_, c)| c).unwrap_or_default()
}

pub fn map<T: TryFrom<Map, Error = MapError>>(bpf: &mut Ebpf, name: &str) -> T {
    let m = bpf.take_map(name).expect("a map of ALL_MAPS");
    T::try_from(m).unwrap_or_else(|e| panic!("map {name}: {e}"))
}
