//! A packet flood: one frame written over and over from a thread pinned to one CPU, timed by
//! that thread's own CPU clock.
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::cpu::thread_cpu_ns;
use crate::netns::{Netns, PacketSocket};
use crate::{Error, Result};

/// Frames per `sendmmsg`.
pub const BATCH: usize = 64;

/// What the flood thread reports.
pub struct Flooded {
    pub sent: u64,
    /// The thread's CPU time over the flood (ns), the receive softirqs it ran included.
    pub cpu_ns: f64,
    pub secs: f64,
}

/// Writes `frame` out of `ifname` in `ns` for `secs` from a thread pinned to `cpu`: `sendmmsg`
/// batches of [`BATCH`] on an `AF_PACKET` socket that bypasses the qdisc.
pub fn flood(ns: &Netns, ifname: &str, cpu: usize, frame: Vec<u8>, secs: f64) -> Result<Flooded> {
    let what = format!("flooding out of {ifname} in {}", ns.name);
    let ifname = ifname.to_string();
    let thread = ns.spawn(Some(cpu), move || -> std::io::Result<Flooded> {
        let mut socket = PacketSocket::open(&ifname, libc::ETH_P_IP as u16, true)?;
        socket.address(&frame);
        let mut iov = libc::iovec {
            iov_base: frame.as_ptr() as *mut libc::c_void,
            iov_len: frame.len(),
        };
        // SAFETY: mmsghdr is plain data; every entry points at the same address and frame,
        // which outlive the sendmmsg calls below.
        let mut msgs: Vec<libc::mmsghdr> = (0..BATCH)
            .map(|_| {
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_name = (&mut socket.to as *mut libc::sockaddr_ll).cast();
                m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                m.msg_hdr.msg_iov = &mut iov;
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        let fd = socket.fd.as_raw_fd();
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs_f64(secs);
        let c0 = thread_cpu_ns();
        let mut sent = 0u64;
        while Instant::now() < end {
            // SAFETY: BATCH valid mmsghdrs (see above).
            let n = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), BATCH as libc::c_uint, 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(e.raw_os_error(), Some(libc::ENOBUFS) | Some(libc::EAGAIN)) {
                    continue;
                }
                return Err(e);
            }
            sent += n as u64;
        }
        Ok(Flooded {
            sent,
            cpu_ns: thread_cpu_ns() - c0,
            secs: t0.elapsed().as_secs_f64(),
        })
    })?;
    thread
        .join()
        .map_err(|_| Error::Panicked { what: what.clone() })?
        .map_err(Error::io(what))
}
