//! The drop events of NetworkPolicy: the pinned ring buffer the programs write a
//! [`PolicyDropEvent`] into for each packet a verdict denied (rate-limited per CPU), read by
//! one consumer (the agent, which hands them to `calixctl monitor --drops`).
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

use aya::maps::{Map, MapData, RingBuf};
use calix_common::{PolicyDropEvent, POLICY_EVENTS_MAP};

use crate::bpf::map_err;
use crate::DataplaneError;

/// The ring buffer's consumer.
pub struct PolicyEvents {
    ring: RingBuf<MapData>,
}

impl PolicyEvents {
    /// The ring pinned in `pin_dir`.
    pub fn open(pin_dir: &Path) -> Result<Self, DataplaneError> {
        let data = MapData::from_pin(pin_dir.join(POLICY_EVENTS_MAP))
            .map_err(map_err(POLICY_EVENTS_MAP, "open pin"))?;
        let ring =
            RingBuf::try_from(Map::RingBuf(data)).map_err(map_err(POLICY_EVENTS_MAP, "open"))?;
        Ok(Self { ring })
    }

    /// The next event, if one is waiting. A record of another size (a build of other
    /// programs) is skipped.
    pub fn next_event(&mut self) -> Option<PolicyDropEvent> {
        loop {
            let item = self.ring.next()?;
            if let Some(e) = decode(&item) {
                return Some(e);
            }
        }
    }
}

/// The event in `bytes`, if it is one.
pub fn decode(bytes: &[u8]) -> Option<PolicyDropEvent> {
    if bytes.len() != std::mem::size_of::<PolicyDropEvent>() {
        return None;
    }
    // SAFETY: the length is checked; `PolicyDropEvent` is plain data, every bit pattern
    // valid; the read is unaligned.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<PolicyDropEvent>()) })
}

impl AsRawFd for PolicyEvents {
    /// Readable (epoll) when events are waiting.
    fn as_raw_fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }
}
