//! Endpoint slots. Every endpoint the agent programs gets a slot, a small index below
//! `MAX_ENDPOINTS` that its entries in the per-endpoint arrays (counters, stack-flow marks)
//! live at; the programs find it in the endpoint's `EndpointInfo` (by host veth ifindex) and
//! `LocalEndpoint` (by address), so a packet reaches them with array lookups the verifier
//! inlines instead of more hash lookups. The slot is kept in the pinned endpoint map, so a
//! restarted agent rebuilds this table from there ([`Slots::restore`]) and the counters
//! carry on.
use std::collections::{BTreeSet, HashMap};

/// Every slot is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("every one of the {max} endpoint slots is taken")]
pub struct SlotsFull {
    pub max: u32,
}

/// Which slot each endpoint (by host veth ifindex) has; slots are handed out lowest first.
#[derive(Debug, Clone)]
pub struct Slots {
    max: u32,
    by_ifindex: HashMap<u32, u32>,
    /// Released slots below `next`.
    free: BTreeSet<u32>,
    /// Every slot from here on is free.
    next: u32,
}

impl Slots {
    /// No slot taken; slots are `0..max`.
    pub fn new(max: u32) -> Self {
        Self {
            max,
            by_ifindex: HashMap::new(),
            free: BTreeSet::new(),
            next: 0,
        }
    }

    /// The table `entries` (ifindex, slot) describe, as the endpoint map holds them. An entry
    /// whose slot is out of range or already another's is left out and returned: the caller
    /// removes it (its endpoint gets a slot again when it is programmed).
    pub fn restore(max: u32, entries: impl IntoIterator<Item = (u32, u32)>) -> (Self, Vec<u32>) {
        let mut s = Self::new(max);
        let mut taken = BTreeSet::new();
        let mut rejected = Vec::new();
        let mut entries: Vec<(u32, u32)> = entries.into_iter().collect();
        entries.sort_unstable();
        for (ifindex, slot) in entries {
            if slot >= max || !taken.insert(slot) || s.by_ifindex.contains_key(&ifindex) {
                rejected.push(ifindex);
                continue;
            }
            s.by_ifindex.insert(ifindex, slot);
        }
        s.next = taken.last().map_or(0, |l| l + 1);
        s.free = (0..s.next).filter(|i| !taken.contains(i)).collect();
        (s, rejected)
    }

    /// The slot of `ifindex`, if it has one.
    pub fn get(&self, ifindex: u32) -> Option<u32> {
        self.by_ifindex.get(&ifindex).copied()
    }

    /// The slot of `ifindex`: the one it has, or (`true`) a new one, the lowest free.
    pub fn assign(&mut self, ifindex: u32) -> Result<(u32, bool), SlotsFull> {
        if let Some(s) = self.get(ifindex) {
            return Ok((s, false));
        }
        let slot = match self.free.pop_first() {
            Some(s) => s,
            None if self.next < self.max => {
                self.next += 1;
                self.next - 1
            }
            None => return Err(SlotsFull { max: self.max }),
        };
        self.by_ifindex.insert(ifindex, slot);
        Ok((slot, true))
    }

    /// Frees the slot of `ifindex`; returns it.
    pub fn release(&mut self, ifindex: u32) -> Option<u32> {
        let slot = self.by_ifindex.remove(&ifindex)?;
        if slot + 1 == self.next {
            self.next -= 1;
            while self.next > 0 && self.free.remove(&(self.next - 1)) {
                self.next -= 1;
            }
        } else {
            self.free.insert(slot);
        }
        Some(slot)
    }

    /// The endpoints with a slot: (ifindex, slot).
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.by_ifindex.iter().map(|(i, s)| (*i, *s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_free_first_and_stable_per_endpoint() {
        let mut s = Slots::new(3);
        assert_eq!(s.assign(10), Ok((0, true)));
        assert_eq!(s.assign(11), Ok((1, true)));
        assert_eq!(s.assign(10), Ok((0, false)), "an endpoint keeps its slot");
        assert_eq!(s.release(10), Some(0));
        assert_eq!(s.release(10), None);
        assert_eq!(s.assign(12), Ok((0, true)), "the lowest free slot again");
        assert_eq!(s.assign(13), Ok((2, true)));
        assert_eq!(s.assign(14), Err(SlotsFull { max: 3 }));
        assert_eq!(s.release(13), Some(2));
        assert_eq!(s.release(11), Some(1));
        assert_eq!(s.assign(15), Ok((1, true)));
    }

    #[test]
    fn restored_from_the_endpoint_map() {
        // Slot 7 twice, slot 99 out of range.
        let (mut s, rejected) = Slots::restore(16, [(20, 7), (21, 2), (22, 7), (23, 99)]);
        assert_eq!(rejected, [22, 23]);
        assert_eq!((s.get(20), s.get(21), s.get(22)), (Some(7), Some(2), None));
        let new: Vec<u32> = (30..37).map(|i| s.assign(i).expect("free").0).collect();
        assert_eq!(
            new,
            [0, 1, 3, 4, 5, 6, 8],
            "the gaps first, then past the highest"
        );
    }
}
