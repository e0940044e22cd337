//! What the agent's memory is made of, in one place: the allocator's settings and the buffers of
//! the connections route distribution keeps to its peers (one per peer in a full mesh).
//!
//! Measured with `cargo xtask bench routes` (one agent, 100 simulated peers × 100 blocks;
//! docs/decisions.md, "The agent's memory"): a full mesh cost ~100 KiB of anonymous memory per
//! peer connection, of which a heap profile (heaptrack) found ~75 KiB live — h2's write buffer
//! (16 KiB) and read buffers (~12 KiB), tonic's decode buffer (16 KiB), tonic's channel (a
//! `tower` buffer of 1024 requests and its worker task, ~12 KiB), rustls (~4 KiB), the tasks —
//! and the rest glibc's per-thread arenas keeping freed memory apart.

use std::time::Duration;

/// glibc malloc arenas. By default glibc gives threads that contend for the allocator arenas
/// of their own (up to 8 per CPU) and memory freed in one is not reused by another: the
/// agent's tokio workers, blocking threads and the reconciler's thread each kept a few MiB.
/// One arena took 4–6 MiB off the agent's RSS with 100 peers (mesh and reflector, joining and
/// restarting) at no measurable cost in time or CPU: the agent's allocation rate is low (it is
/// not on the packet path). musl's allocator has no arenas (nothing to set: the image's static
/// build).
pub const MALLOC_ARENAS: i32 = 1;

/// Sets the process's allocator up ([`MALLOC_ARENAS`]). Call first in `main`, before any thread
/// starts (arenas already handed out stay).
pub fn configure_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes malloc's parameters; called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
}

/// HTTP/2 flow-control windows of a follower's connection (one stream: the watch). A peer may
/// send this much that the agent has not read yet; hyper's defaults (2 MiB per stream, 5 MiB
/// per connection) would let 100 peers park 500 MiB in the agent while its engine is busy.
/// The windows pace a stream, they do not cap a message: a 4 MiB message
/// ([`crate::distribution::wire::MAX_MESSAGE_BYTES`]) still arrives, in window-sized steps (tested:
/// `a_snapshot_larger_than_the_window_arrives`). 256 KiB is ~2.5 messages of 2048 routes, and
/// on a LAN (RTT ≤ 1 ms) still ≥ 256 MB/s.
pub const STREAM_WINDOW: u32 = 256 * 1024;
pub const CONNECTION_WINDOW: u32 = 256 * 1024;

/// tonic's decode buffer per stream starts at this size and grows to the largest message
/// received (a snapshot), then stays: tonic's default (8 KiB) doubled to 16 KiB for a
/// 100-route snapshot; starting small, it grows to about the message's size. The encode
/// buffer (a follower sends one small request) starts at this size too.
pub const CODEC_BUFFER: usize = 1024;

/// tonic's default: a stream's encoder yields to the runtime after this many bytes.
const CODEC_YIELD: usize = 32 * 1024;

/// The codec buffers of a follower's stream ([`CODEC_BUFFER`]).
pub fn codec_buffers() -> tonic::codec::BufferSettings {
    tonic::codec::BufferSettings::new(CODEC_BUFFER, CODEC_YIELD)
}

/// HTTP/2 pings on a follower's connection, idle or not, and the time to answer one: a peer
/// that stops answering is dropped within 15 s.
pub const PEER_KEEPALIVE: Duration = Duration::from_secs(10);
pub const PEER_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
