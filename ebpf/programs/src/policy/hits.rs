//! The rules' hit counts (`CALIX_POL_HITS`, per CPU): what `calixctl policy <pod>` shows.

use calix_common::{PolicyHitKey, PolicyScratch};

use crate::maps::CALIX_POL_HITS;

const BPF_NOEXIST: u64 = 1;

/// A hit count's key and first value, built in the scratch's `value` (a flow's value, not in
/// use until the flow is remembered, after the rules decided): the stack has no room for
/// them.
#[repr(C)]
struct HitEntry {
    key: PolicyHitKey,
    count: u64,
}
const _: () = assert!(
    core::mem::size_of::<HitEntry>() == core::mem::size_of::<calix_common::PolicyFlow>()
        && core::mem::align_of::<HitEntry>() <= core::mem::align_of::<calix_common::PolicyFlow>()
);

/// Counts a decision of rule `rule` for the endpoint in `slot`.
#[inline(always)]
pub(super) fn hit(s: &mut PolicyScratch, slot: u32, rule: u32) {
    // SAFETY: `HitEntry` has `PolicyFlow`'s size and no stricter alignment (checked above);
    // both are plain data.
    let h = unsafe { &mut *(&mut s.value as *mut calix_common::PolicyFlow as *mut HitEntry) };
    h.key = PolicyHitKey { slot, rule };
    h.count = 1;
    match CALIX_POL_HITS.get_ptr_mut(&h.key) {
        // SAFETY: this CPU's value, from a successful lookup, valid until the program returns.
        Some(c) => unsafe { *c = (*c).wrapping_add(1) },
        None => {
            // A full map leaves the pair uncounted; the verdict stands.
            let _ = CALIX_POL_HITS.insert(&h.key, &h.count, BPF_NOEXIST);
        }
    }
}
