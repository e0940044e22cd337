//! Flag bits that two CPUs may set in the same map value at once (a connection's two
//! directions, or a delayed ACK and a FIN of one direction): set and cleared with BPF's
//! atomic OR and AND, never a plain read-modify-write, which loses the other CPU's bit (a
//! FIN lost that way kept a closed SNAT flow, and its NAT port, for the established
//! timeout). BPF's atomics before cpu v3 work on 8-byte words: a field is reached through
//! the aligned word that holds it.

use core::intrinsics::{atomic_and, atomic_or, AtomicOrdering};

/// A flag field of a map value: the byte offset of the aligned 8-byte word that holds it,
/// and the shift of the field's lowest bit in that word.
#[derive(Clone, Copy)]
pub struct FlagField {
    word: usize,
    shift: u32,
}

impl FlagField {
    /// The field at byte `offset` of its value, `size` bytes wide; the value must be 8-byte
    /// aligned (checked where the constant is defined: `align_of`).
    pub const fn at(offset: usize, size: usize) -> FlagField {
        let word = offset & !7;
        let within = offset - word;
        assert!(within + size <= 8, "a flag field within one 8-byte word");
        let shift = if cfg!(target_endian = "little") {
            within * 8
        } else {
            (8 - within - size) * 8
        };
        FlagField {
            word,
            shift: shift as u32,
        }
    }

    #[inline(always)]
    fn word<T>(self, value: *mut T) -> *mut u64 {
        // Byte arithmetic within the value (the word lies inside it: `at`).
        value.cast::<u8>().wrapping_add(self.word).cast::<u64>()
    }

    /// Sets `bits` in the field of `value`.
    ///
    /// # Safety
    /// `value` points at a live, 8-byte aligned value (a map value from a successful
    /// lookup) of the type this field was defined for.
    #[inline(always)]
    pub unsafe fn set<T>(self, value: *mut T, bits: u64) {
        // SAFETY: the caller's promise; the word is aligned and inside the value.
        unsafe {
            atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(self.word(value), bits << self.shift)
        };
    }

    /// Clears `bits` in the field of `value`.
    ///
    /// # Safety
    /// As [`FlagField::set`].
    #[inline(always)]
    pub unsafe fn clear<T>(self, value: *mut T, bits: u64) {
        // SAFETY: as in `set`.
        unsafe {
            atomic_and::<u64, u64, { AtomicOrdering::Relaxed }>(
                self.word(value),
                !(bits << self.shift),
            )
        };
    }
}
