//! The eBPF object's code, as the kernel gets it: no program calls compiler-builtins' byte
//! loops. On the BPF target a struct zeroed (`Default`, `mem::zeroed`, a loop) or copied
//! (`*a = *b`) can compile to a call of `memset`, `memcpy` or `memmove`: a BPF function of its
//! own running one store (and load) per byte. One such zeroing of the FIB parameters cost every
//! packet to another node ~25 ns (`docs/benchmarks.md`, cross-node rerun of 2026-12-06); the
//! programs build their keys and zero their structs in words instead (`packet::zero_words`,
//! `copy_words`, `addr16`). No root needed: the object is read, not loaded.

use calix_dataplane::ebpf::OBJECT;
use std::collections::BTreeMap;

use object::{
    Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex, SectionKind, SymbolKind,
};

/// compiler-builtins' byte loops.
const BYTE_LOOPS: [&str; 3] = ["memset", "memcpy", "memmove"];

/// The function of `section` (by index) that covers `offset`.
fn function_at(file: &object::File, section: SectionIndex, offset: u64) -> Option<String> {
    file.symbols()
        .find(|s| {
            s.section_index() == Some(section)
                && s.kind() == SymbolKind::Text
                && s.address() <= offset
                && offset < s.address() + s.size()
        })
        .and_then(|s| s.name().ok().map(str::to_string))
}

/// Every BPF-to-BPF call in the object, as (caller, callee). A call instruction (`0x85`, source
/// register 1: a pseudo call) names its callee by an offset in instructions from the next one:
/// within its own section as it stands; into another section through a relocation against
/// that section's symbol (or a function's), where the offset counts from the symbol.
fn calls(file: &object::File) -> Vec<(String, String)> {
    const INSN: u64 = 8;
    let mut out = Vec::new();
    for section in file.sections() {
        if section.kind() != SectionKind::Text {
            continue;
        }
        let Ok(code) = section.data() else {
            continue;
        };
        let relocs: BTreeMap<u64, RelocationTarget> = section
            .relocations()
            .map(|(offset, r)| (offset, r.target()))
            .collect();
        for (n, insn) in code.chunks_exact(INSN as usize).enumerate() {
            let offset = n as u64 * INSN;
            if insn[0] != 0x85 || insn[1] >> 4 != 1 {
                continue;
            }
            let imm = i64::from(i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]));
            let (target_section, base) = match relocs.get(&offset) {
                Some(RelocationTarget::Symbol(i)) => match file.symbol_by_index(*i) {
                    Ok(sym) => match sym.section_index() {
                        Some(sec) => (sec, sym.address() as i64),
                        None => continue,
                    },
                    Err(_) => continue,
                },
                Some(_) => continue,
                None => (section.index(), offset as i64),
            };
            let target = (base + (imm + 1) * INSN as i64) as u64;
            let name = |sec, at| {
                function_at(file, sec, at)
                    .unwrap_or_else(|| format!("{}+{at:#x}", section.name().unwrap_or("?")))
            };
            out.push((name(section.index(), offset), name(target_section, target)));
        }
    }
    out
}

#[test]
fn no_program_calls_a_byte_loop() {
    let file = object::File::parse(OBJECT).expect("parse the eBPF object");
    let calls = calls(&file);
    // The scan sees calls at all: `from_pod` calls the policy verdicts, functions of their own.
    assert!(
        calls
            .iter()
            .any(|(_, callee)| callee.contains("policy") && callee.contains("egress")),
        "no call of the egress verdict found among {} calls: the scan is broken",
        calls.len()
    );
    let loops: Vec<String> = calls
        .iter()
        .filter(|(_, callee)| BYTE_LOOPS.contains(&callee.as_str()))
        .map(|(caller, callee)| format!("{caller} calls {callee}"))
        .collect();
    assert!(
        loops.is_empty(),
        "the programs call compiler-builtins' byte loops (zero or copy in words instead: \
         packet::zero_words, copy_words, addr16):\n{}",
        loops.join("\n")
    );
}
