//! Just enough ELF reading to list the programs in a BPF object, the way aya finds them: global
//! functions in an executable section other than `.text` (which holds subprograms and
//! `memcpy`-style helpers).

/// One program in a BPF object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// The ELF section, which tells the program type (`classifier`, `xdp`, …).
    pub section: String,
    /// The program's name: its symbol, which is the entry function's name.
    pub name: String,
}

const SHT_SYMTAB: u32 = 2;
const SHF_EXECINSTR: u64 = 0x4;
const STT_FUNC: u8 = 2;
const STB_GLOBAL: u8 = 1;
const SECTION_HEADER_SIZE: usize = 64;
const SYMBOL_SIZE: usize = 24;

/// The programs in the ELF64 object `elf`, in symbol-table order; `None` when `elf` is not an
/// ELF64 object or its tables point outside it.
pub fn programs(elf: &[u8]) -> Option<Vec<Program>> {
    let r = Reader::new(elf)?;
    let shoff = usize::try_from(r.u64(0x28)?).ok()?;
    let shnum = usize::from(r.u16(0x3c)?);
    let shstrndx = usize::from(r.u16(0x3e)?);
    let sections = (0..shnum)
        .map(|i| Section::read(&r, shoff.checked_add(i.checked_mul(SECTION_HEADER_SIZE)?)?))
        .collect::<Option<Vec<_>>>()?;
    let shstrtab = sections.get(shstrndx)?;

    let mut found = Vec::new();
    for symtab in sections.iter().filter(|s| s.kind == SHT_SYMTAB) {
        let strtab = sections.get(usize::try_from(symtab.link).ok()?)?;
        let count = symtab.size / SYMBOL_SIZE;
        for i in 0..count {
            let at = symtab.offset.checked_add(i.checked_mul(SYMBOL_SIZE)?)?;
            // The whole entry is in bounds, so the field offsets below cannot overflow.
            r.data.get(at..at.checked_add(SYMBOL_SIZE)?)?;
            let info = r.u8(at + 4)?;
            if info & 0xf != STT_FUNC || info >> 4 != STB_GLOBAL {
                continue;
            }
            let Some(section) = sections.get(usize::from(r.u16(at + 6)?)) else {
                continue;
            };
            let section_name = r.str_at(shstrtab, section.name)?;
            if section.flags & SHF_EXECINSTR == 0 || section_name == ".text" {
                continue;
            }
            found.push(Program {
                section: section_name.to_owned(),
                name: r.str_at(strtab, r.u32(at)?)?.to_owned(),
            });
        }
    }
    Some(found)
}

struct Section {
    name: u32,
    kind: u32,
    flags: u64,
    offset: usize,
    size: usize,
    link: u32,
}

impl Section {
    fn read(r: &Reader<'_>, at: usize) -> Option<Self> {
        // The whole header is in bounds, so the field offsets below cannot overflow.
        r.data.get(at..at.checked_add(SECTION_HEADER_SIZE)?)?;
        Some(Self {
            name: r.u32(at)?,
            kind: r.u32(at + 4)?,
            flags: r.u64(at + 8)?,
            offset: usize::try_from(r.u64(at + 24)?).ok()?,
            size: usize::try_from(r.u64(at + 32)?).ok()?,
            link: r.u32(at + 40)?,
        })
    }
}

/// Bounds-checked reads in the object's byte order.
struct Reader<'a> {
    data: &'a [u8],
    little: bool,
}

impl<'a> Reader<'a> {
    fn new(data: &'a [u8]) -> Option<Self> {
        if data.get(..5)? != b"\x7fELF\x02" {
            return None;
        }
        let little = match data.get(5)? {
            1 => true,
            2 => false,
            _ => return None,
        };
        Some(Self { data, little })
    }

    fn bytes<const N: usize>(&self, at: usize) -> Option<[u8; N]> {
        self.data.get(at..at.checked_add(N)?)?.try_into().ok()
    }

    fn u8(&self, at: usize) -> Option<u8> {
        self.data.get(at).copied()
    }

    fn u16(&self, at: usize) -> Option<u16> {
        let b = self.bytes(at)?;
        Some(if self.little {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        })
    }

    fn u32(&self, at: usize) -> Option<u32> {
        let b = self.bytes(at)?;
        Some(if self.little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    }

    fn u64(&self, at: usize) -> Option<u64> {
        let b = self.bytes(at)?;
        Some(if self.little {
            u64::from_le_bytes(b)
        } else {
            u64::from_be_bytes(b)
        })
    }

    /// The NUL-terminated string at `offset` in string table `table`.
    fn str_at(&self, table: &Section, offset: u32) -> Option<&'a str> {
        let start = table.offset.checked_add(usize::try_from(offset).ok()?)?;
        let end = table.offset.checked_add(table.size)?;
        let bytes = self.data.get(start..end)?;
        let len = bytes.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&bytes[..len]).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little-endian ELF64 with sections: null, .text (exec), classifier (exec), maps (data),
    /// .strtab (section and symbol names), .symtab.
    fn object() -> Vec<u8> {
        let strtab = b"\0.text\0classifier\0maps\0.strtab\0.symtab\0from_pod\0to_pod\0memcpy\0CALIX_COUNTERS\0";
        let name = |s: &str| {
            let needle = format!("\0{s}\0");
            let pos = strtab
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
                .expect("name in strtab");
            u32::try_from(pos + 1).expect("small")
        };
        let global = |kind: u8| (STB_GLOBAL << 4) | kind;
        // (name, info, section index)
        let symbols = [
            (0, 0, 0),
            (name("memcpy"), global(STT_FUNC), 1),
            (name("from_pod"), global(STT_FUNC), 2),
            (name("CALIX_COUNTERS"), global(1), 3),
            (name("to_pod"), global(STT_FUNC), 2),
            (name("to_pod"), STT_FUNC, 2), // local: not a program
        ];
        let mut out = vec![0u8; 64];
        let strtab_off = out.len();
        out.extend_from_slice(strtab);
        while !out.len().is_multiple_of(8) {
            out.push(0);
        }
        let symtab_off = out.len();
        for (n, info, shndx) in symbols {
            out.extend_from_slice(&n.to_le_bytes());
            out.push(info);
            out.push(0);
            out.extend_from_slice(&u16::to_le_bytes(shndx));
            out.extend_from_slice(&[0u8; 16]);
        }
        let shoff = out.len();
        // (name, type, flags, offset, size, link)
        let sections = [
            (0, 0, 0, 0, 0, 0),
            (name(".text"), 1, 0x6, 0, 0, 0),
            (name("classifier"), 1, 0x6, 0, 0, 0),
            (name("maps"), 1, 0x3, 0, 0, 0),
            (name(".strtab"), 3, 0, strtab_off, strtab.len(), 0),
            (
                name(".symtab"),
                SHT_SYMTAB,
                0,
                symtab_off,
                symbols.len() * SYMBOL_SIZE,
                4,
            ),
        ];
        for (n, kind, flags, offset, size, link) in sections {
            out.extend_from_slice(&u32::to_le_bytes(n));
            out.extend_from_slice(&u32::to_le_bytes(kind));
            out.extend_from_slice(&u64::to_le_bytes(flags));
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            out.extend_from_slice(&(size as u64).to_le_bytes());
            out.extend_from_slice(&u32::to_le_bytes(link));
            out.extend_from_slice(&[0u8; 20]);
        }
        out[..6].copy_from_slice(b"\x7fELF\x02\x01");
        out[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        out[0x3c..0x3e].copy_from_slice(&6u16.to_le_bytes());
        out[0x3e..0x40].copy_from_slice(&4u16.to_le_bytes());
        out
    }

    #[test]
    fn lists_global_functions_outside_text() {
        let program = |name: &str| Program {
            section: "classifier".into(),
            name: name.into(),
        };
        assert_eq!(
            programs(&object()),
            Some(vec![program("from_pod"), program("to_pod")])
        );
    }

    #[test]
    fn rejects_what_is_not_an_elf64_object() {
        assert_eq!(programs(b""), None);
        assert_eq!(programs(b"\x7fELF\x01\x01"), None);
        assert_eq!(programs(b"not an elf object at all"), None);
        // Every truncation of a valid object fails cleanly instead of panicking.
        let full = object();
        for len in 0..full.len() {
            let _ = programs(&full[..len]);
        }
    }
}
