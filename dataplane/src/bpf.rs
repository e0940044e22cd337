//! Helpers for aya objects and pinned maps that the dataplane's modules share: a leaf (it
//! imports no other dataplane module), so none of them imports another for these.
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray};
use aya::programs::ProgramError;
use aya::Ebpf;

use super::DataplaneError;

pub(super) fn prog_err(
    name: &'static str,
    op: &'static str,
) -> impl FnOnce(ProgramError) -> DataplaneError {
    move |e| DataplaneError::Program {
        name,
        op,
        source: Box::new(e),
    }
}

pub(super) fn map_err(
    name: &'static str,
    op: &'static str,
) -> impl FnOnce(MapError) -> DataplaneError {
    move |e| DataplaneError::Map {
        name,
        op,
        source: Box::new(e),
    }
}

pub(super) fn pin_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> DataplaneError + 'a {
    move |source| DataplaneError::Pin {
        path: path.to_path_buf(),
        op,
        source,
    }
}

pub(super) fn take<T>(
    bpf: &mut Ebpf,
    name: &'static str,
    f: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, DataplaneError> {
    let map = bpf.take_map(name).ok_or_else(|| DataplaneError::Map {
        name,
        op: "find",
        source: Box::new(MapError::InvalidName {
            name: name.to_string(),
        }),
    })?;
    f(map).map_err(map_err(name, "open"))
}

/// Opens the hash map pinned at `pin_dir/name`.
pub(super) fn open_hash<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, DataplaneError> {
    let path: PathBuf = pin_dir.join(name);
    let data = MapData::from_pin(&path).map_err(map_err(name, "open pin"))?;
    HashMap::try_from(Map::HashMap(data)).map_err(map_err(name, "open"))
}

/// Opens the array pinned at `pin_dir/name`.
pub(super) fn open_array<V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<Array<MapData, V>, DataplaneError> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(map_err(name, "open pin"))?;
    Array::try_from(Map::Array(data)).map_err(map_err(name, "open"))
}

/// Opens the per-CPU array pinned at `pin_dir/name`.
pub(super) fn open_per_cpu_array<V: aya::Pod>(
    pin_dir: &Path,
    name: &'static str,
) -> Result<PerCpuArray<MapData, V>, DataplaneError> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(map_err(name, "open pin"))?;
    PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(map_err(name, "open"))
}

/// `bpf(2)` commands (`enum bpf_cmd`, include/uapi/linux/bpf.h).
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `bpf(2)` with `attr` (a `union bpf_attr` prefix, zero-padded).
fn bpf_call<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a plain buffer of the size passed, whose pointers (if any) the caller
    // keeps valid for the call; the kernel reads (and may write) only that much.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

/// `BPF_LINK_CREATE`: program `prog` attached to `target` (a cgroup's descriptor) at
/// `attach_type` (`enum bpf_attach_type`); the link's descriptor. (aya 0.13 cannot pin a cgroup
/// program's link, and an unpinned link detaches when the agent exits.)
pub(super) fn link_create(
    prog: std::os::fd::BorrowedFd<'_>,
    target: std::os::fd::BorrowedFd<'_>,
    attach_type: u32,
) -> std::io::Result<OwnedFd> {
    // prog_fd, target_fd, attach_type, flags; then the per-type union, zero.
    let mut attr = [0u32; 12];
    attr[0] = u32::try_from(prog.as_raw_fd()).map_err(std::io::Error::other)?;
    attr[1] = u32::try_from(target.as_raw_fd()).map_err(std::io::Error::other)?;
    attr[2] = attach_type;
    let fd = bpf_call(BPF_LINK_CREATE, &mut attr)?;
    let raw = i32::try_from(fd).map_err(std::io::Error::other)?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// `BPF_OBJ_PIN` of `fd` at `pin` (on bpffs; no dot in the name).
pub(super) fn obj_pin(fd: std::os::fd::BorrowedFd<'_>, pin: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())?;
    // pathname, bpf_fd, file_flags.
    let mut attr = [0u64; 3];
    attr[0] = path.as_ptr() as u64;
    attr[1] = u64::try_from(fd.as_raw_fd()).map_err(std::io::Error::other)?;
    bpf_call(BPF_OBJ_PIN, &mut attr).map(|_| ())
}

/// `BPF_LINK_DETACH` of the link pinned at `pin`. (aya 0.13 only detaches a link by dropping
/// its last reference, and a pin's reference goes away after an RCU grace period, so an unpin
/// alone would leave the program attached for a moment after the caller returns.)
pub(super) fn link_detach(pin: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())?;
    // `union bpf_attr` for BPF_OBJ_GET: pathname, bpf_fd, file_flags, path_fd; zero-padded.
    let mut get = [0u64; 3];
    get[0] = path.as_ptr() as u64;
    // SAFETY: the attribute points at a NUL-terminated path that outlives the call, and its
    // size is passed; the kernel returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            get.as_mut_ptr(),
            std::mem::size_of_val(&get) as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let raw = i32::try_from(fd).map_err(std::io::Error::other)?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // `union bpf_attr` for BPF_LINK_DETACH: link_fd.
    let mut detach = [0u32; 2];
    detach[0] = u32::try_from(fd.as_raw_fd()).map_err(std::io::Error::other)?;
    // SAFETY: as above; the attribute names a descriptor that stays open during the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_DETACH,
            detach.as_mut_ptr(),
            std::mem::size_of_val(&detach) as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `<dir>/<ifname>@<what>`: the pin of an interface's bpf_link (XDP, tcx). bpffs refuses names
/// with a dot (reserved), which interface names may have (`eth0.100`, `vxlan.calix`): those
/// become colons, which interface names never have.
pub(super) fn link_pin(dir: &Path, ifname: &str, what: &str) -> PathBuf {
    dir.join(format!("{}@{what}", ifname.replace('.', ":")))
}

/// The interface a [`link_pin`] (its file name) is for.
pub(super) fn link_pin_ifname(pin_name: &str) -> String {
    let name = pin_name.rsplit_once('@').map_or(pin_name, |(i, _)| i);
    name.replace(':', ".")
}

/// CLOCK_MONOTONIC in nanoseconds: `bpf_ktime_get_ns`'s clock.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}
