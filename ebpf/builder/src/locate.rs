//! Finding the object the nested cargo produced.
//!
//! cargo names it in its `compiler-artifact` message (`executable`, normally
//! `target/bpfel-unknown-none/release/calix`, a hard link of `release/deps/calix-<hash>`). That
//! is what is used; only when the message names nothing usable are `release/` and
//! `release/deps/` searched, taking the newest BPF ELF named after the binary.

use std::{
    fs::{self, File},
    io::Read,
    path::{Path, PathBuf},
    time::SystemTime,
};

/// `EM_BPF` in an ELF header's `e_machine`.
const EM_BPF: u16 = 247;
/// `ET_REL`: a relocatable object, which is what bpf-linker emits.
const ET_REL: u16 = 1;

/// The paths one line of `cargo --message-format json` reports for the binary `bin`: its
/// `executable` first, then its `filenames`. Empty for any other line.
pub(crate) fn artifact_paths(line: &str, bin: &str) -> Vec<PathBuf> {
    let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
        return Vec::new();
    };
    let target = &msg["target"];
    let is_our_bin = msg["reason"] == "compiler-artifact"
        && target["name"] == bin
        && target["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == "bin"));
    if !is_our_bin {
        return Vec::new();
    }
    let executable = msg["executable"].as_str().into_iter();
    let filenames = msg["filenames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f.as_str());
    executable.chain(filenames).map(PathBuf::from).collect()
}

/// The object to use: the first reported path that is a BPF object, else the newest BPF object
/// named `bin` or `bin-<hash>` in `release_dir` or `release_dir/deps`.
pub(crate) fn find_object(reported: &[PathBuf], release_dir: &Path, bin: &str) -> Option<PathBuf> {
    if let Some(path) = reported.iter().find(|p| is_bpf_object(p)) {
        return Some(path.clone());
    }
    let hashed_prefix = format!("{bin}-");
    [release_dir.to_path_buf(), release_dir.join("deps")]
        .iter()
        .filter_map(|dir| fs::read_dir(dir).ok())
        .flatten()
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // `calix` or `calix-<hash>`, not `calix.d` / `calix-<hash>.d`.
            name == bin || (name.starts_with(&hashed_prefix) && !name.contains('.'))
        })
        .map(|entry| entry.path())
        .filter(|path| is_bpf_object(path))
        .max_by_key(|path| modified(path))
}

fn modified(path: &Path) -> SystemTime {
    fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Whether `path` is a 64-bit relocatable ELF for the BPF machine (either byte order).
pub(crate) fn is_bpf_object(path: &Path) -> bool {
    let mut header = [0u8; 20];
    let Ok(mut file) = File::open(path) else {
        return false;
    };
    if file.read_exact(&mut header).is_err() {
        return false;
    }
    let half = |at: usize| match header[5] {
        1 => Some(u16::from_le_bytes([header[at], header[at + 1]])),
        2 => Some(u16::from_be_bytes([header[at], header[at + 1]])),
        _ => None,
    };
    header[..4] == *b"\x7fELF"
        && header[4] == 2 // ELFCLASS64
        && half(16) == Some(ET_REL)
        && half(18) == Some(EM_BPF)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{thread::sleep, time::Duration};

    fn bpf_header() -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[16..18].copy_from_slice(&ET_REL.to_le_bytes());
        h[18..20].copy_from_slice(&EM_BPF.to_le_bytes());
        h
    }

    #[test]
    fn reads_the_artifact_message_of_our_bin_only() {
        let ours = r#"{"reason":"compiler-artifact","target":{"name":"calix","kind":["bin"]},
            "filenames":["/t/release/calix"],"executable":"/t/release/calix","fresh":true}"#
            .replace('\n', "");
        assert_eq!(
            artifact_paths(&ours, "calix"),
            [
                PathBuf::from("/t/release/calix"),
                PathBuf::from("/t/release/calix")
            ]
        );
        let lib = r#"{"reason":"compiler-artifact","target":{"name":"calix","kind":["lib"]},"filenames":["/t/libcalix.rlib"],"executable":null}"#;
        assert!(artifact_paths(lib, "calix").is_empty());
        let other = r#"{"reason":"compiler-artifact","target":{"name":"core","kind":["lib"]},"filenames":[]}"#;
        assert!(artifact_paths(other, "calix").is_empty());
        assert!(
            artifact_paths(r#"{"reason":"build-finished","success":true}"#, "calix").is_empty()
        );
        assert!(artifact_paths("   Compiling core", "calix").is_empty());
    }

    #[test]
    fn recognises_bpf_objects_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bpf = dir.path().join("bpf");
        fs::write(&bpf, bpf_header()).expect("write");
        assert!(is_bpf_object(&bpf));

        let mut x86 = bpf_header();
        x86[18..20].copy_from_slice(&62u16.to_le_bytes());
        fs::write(dir.path().join("x86"), x86).expect("write");
        assert!(!is_bpf_object(&dir.path().join("x86")));

        fs::write(dir.path().join("short"), b"\x7fELF").expect("write");
        assert!(!is_bpf_object(&dir.path().join("short")));
        assert!(!is_bpf_object(&dir.path().join("missing")));
    }

    #[test]
    fn prefers_what_cargo_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let release = dir.path().join("release");
        fs::create_dir_all(release.join("deps")).expect("mkdir");
        let reported = release.join("calix");
        fs::write(&reported, bpf_header()).expect("write");
        sleep(Duration::from_millis(20));
        fs::write(release.join("deps/calix-newer"), bpf_header()).expect("write");
        let missing = dir.path().join("gone");
        assert_eq!(
            find_object(&[missing, reported.clone()], &release, "calix"),
            Some(reported)
        );
    }

    #[test]
    fn falls_back_to_the_newest_object_named_after_the_bin() {
        let dir = tempfile::tempdir().expect("tempdir");
        let release = dir.path().join("release");
        let deps = release.join("deps");
        fs::create_dir_all(&deps).expect("mkdir");
        fs::write(deps.join("calix-old"), bpf_header()).expect("write");
        sleep(Duration::from_millis(20));
        fs::write(deps.join("calix-new"), bpf_header()).expect("write");
        sleep(Duration::from_millis(20));
        // Newer, but not a BPF object / not our binary / a dep-info file.
        fs::write(deps.join("calix-new.d"), bpf_header()).expect("write");
        fs::write(deps.join("other-zzz"), bpf_header()).expect("write");
        fs::write(release.join("calix"), b"not elf").expect("write");
        assert_eq!(
            find_object(&[], &release, "calix"),
            Some(deps.join("calix-new"))
        );
        assert_eq!(find_object(&[], &dir.path().join("nothing"), "calix"), None);
    }
}
