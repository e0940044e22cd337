//! Maglev hashing (Eisenbud et al., NSDI 2016): a lookup table of `M` slots (a prime) filled
//! from each backend's own permutation of the slots, taking turns, so that every node that
//! knows the same backends builds the same table (external traffic may reach any node and must
//! meet the same backend), each backend holds ⌊M/N⌋ or ⌈M/N⌉ slots, and a change of backends
//! moves few slots beyond those it must. A flow's hash picks its slot.
//!
//! The hashes are calix's own, fixed (FNV-1a 64 with a finalizer), never the process's
//! randomized ones: nodes and agent versions must agree.

fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64's finalizer: FNV's low bits alone spread poorly.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The lookup table for `backends` (each named by stable bytes, e.g. its address and port):
/// slot → index into `backends`. Empty for no backends. `m` must be a prime. The backends take
/// turns in the order of their names, so the order they are given in does not matter.
pub fn table(backends: &[Vec<u8>], m: usize) -> Vec<u32> {
    let n = backends.len();
    if n == 0 || m == 0 {
        return Vec::new();
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|a, b| backends[*a].cmp(&backends[*b]));
    let m64 = m as u64;
    let perm: Vec<(u64, u64)> = order
        .iter()
        .map(|i| &backends[*i])
        .map(|b| {
            let offset = fnv1a(0x6d61_676c_6576_3031, b) % m64;
            let skip = fnv1a(0x6d61_676c_6576_3032, b) % (m64 - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; n];
    let mut entry = vec![u32::MAX; m];
    let mut filled = 0;
    'fill: loop {
        for i in 0..n {
            let (offset, skip) = perm[i];
            let mut c = (offset + next[i] * skip) % m64;
            while entry[c as usize] != u32::MAX {
                next[i] += 1;
                c = (offset + next[i] * skip) % m64;
            }
            entry[c as usize] = order[i] as u32;
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    entry
}

/// The slot of a flow: its hash (of whatever names the flow, e.g. the client's address and
/// port) modulo the table's size.
pub fn slot(flow: &[u8], m: usize) -> usize {
    if m == 0 {
        return 0;
    }
    (fnv1a(0x6d61_676c_6576_666c, flow) % m as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eBPF dataplane's (`calix_common::SVC_MAGLEV_SLOTS`).
    const TABLE_SIZE: usize = 1021;

    fn names(n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| format!("10.244.{}.{}:8080", i / 250, i % 250).into_bytes())
            .collect()
    }

    fn counts(t: &[u32], n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for e in t {
            c[*e as usize] += 1;
        }
        c
    }

    #[test]
    fn every_backend_holds_its_share_within_one_slot() {
        for n in [1, 2, 3, 7, 100, 1000] {
            let t = table(&names(n), TABLE_SIZE);
            assert_eq!(t.len(), TABLE_SIZE);
            let c = counts(&t, n);
            let (min, max) = (
                c.iter().min().copied().unwrap_or(0),
                c.iter().max().copied().unwrap_or(0),
            );
            assert!(max - min <= 1, "{n} backends: {min}..{max}");
        }
        assert!(table(&[], TABLE_SIZE).is_empty());
    }

    #[test]
    fn the_same_backends_give_the_same_table_whatever_their_order() {
        let a = names(10);
        let t1 = table(&a, TABLE_SIZE);
        assert_eq!(t1, table(&a, TABLE_SIZE), "deterministic");
        // Another order: the same backend in each slot.
        let mut b = a.clone();
        b.reverse();
        let t2 = table(&b, TABLE_SIZE);
        let same = t1
            .iter()
            .zip(&t2)
            .filter(|(x, y)| a[**x as usize] == b[**y as usize])
            .count();
        assert_eq!(same, TABLE_SIZE);
    }

    #[test]
    fn removing_a_backend_moves_few_other_slots() {
        let a = names(10);
        let before = table(&a, TABLE_SIZE);
        let b: Vec<Vec<u8>> = a[..9].to_vec();
        let after = table(&b, TABLE_SIZE);
        let mut moved_needlessly = 0;
        for (x, y) in before.iter().zip(&after) {
            let was = &a[*x as usize];
            let now = &b[*y as usize];
            if *x as usize != 9 && was != now {
                moved_needlessly += 1;
            }
        }
        // The removed backend's tenth must move; of the rest, only a few percent.
        assert!(
            moved_needlessly * 100 < TABLE_SIZE * 5,
            "{moved_needlessly} of {TABLE_SIZE} slots moved needlessly"
        );
    }

    #[test]
    fn flows_spread_over_slots() {
        let mut hits = vec![0usize; 16];
        for port in 0..16_000u32 {
            let flow = [&[10, 0, 0, 1][..], &port.to_be_bytes()].concat();
            hits[slot(&flow, 16_381) % 16] += 1;
        }
        assert!(hits.iter().all(|h| (800..1200).contains(h)), "{hits:?}");
    }
}
