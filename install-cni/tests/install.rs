//! calix-install-cni on real directories: what it writes, that a reader never sees half a
//! file, that a running plugin can be replaced, that bad input is refused before anything is
//! written, uninstall, and the binary itself.
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use calix_install_cni::atomic::TEMP_PREFIX;
use calix_install_cni::{install, uninstall, Conflist, Install, InstallError, Outcome, Removal};

/// A node's CNI dirs and a directory with the binaries to install.
struct Node {
    _tmp: tempfile::TempDir,
    bin: PathBuf,
    net: PathBuf,
    src: PathBuf,
}

impl Node {
    /// With `portmap` already in the bin dir (as the node's reference plugins put it there).
    fn new() -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (bin, net, src) = (
            tmp.path().join("bin"),
            tmp.path().join("net.d"),
            tmp.path().join("src"),
        );
        for d in [&bin, &net, &src] {
            fs::create_dir(d).expect("mkdir");
        }
        write_exe(&bin.join("portmap"), b"#!/bin/sh\nexit 0\n");
        write_exe(&src.join("calix"), b"\x7fELF pretend plugin, version 1\n");
        Self {
            _tmp: tmp,
            bin,
            net,
            src,
        }
    }

    fn spec(&self) -> Install {
        Install {
            bin_dir: self.bin.clone(),
            net_dir: self.net.clone(),
            plugins: vec![self.src.join("calix")],
            file_name: "10-calix.conflist".into(),
            conflist: Conflist::default(),
        }
    }

    fn conflist(&self) -> PathBuf {
        self.net.join("10-calix.conflist")
    }

    /// Every file name in both dirs, sorted.
    fn listing(&self) -> Vec<String> {
        let mut names = Vec::new();
        for d in [&self.bin, &self.net] {
            for e in fs::read_dir(d).expect("read_dir").flatten() {
                names.push(e.path().display().to_string());
            }
        }
        names.sort();
        names
    }
}

fn write_exe(path: &Path, content: &[u8]) {
    fs::write(path, content).expect("write");
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn installs_the_plugin_and_the_conflist_and_a_rerun_writes_nothing() {
    let node = Node::new();
    let report = install(&node.spec()).expect("install");
    assert_eq!(
        report.files,
        vec![
            (node.bin.join("calix"), Outcome::Written),
            (node.conflist(), Outcome::Written)
        ]
    );
    assert_eq!(
        fs::read(node.bin.join("calix")).expect("plugin"),
        fs::read(node.src.join("calix")).expect("source")
    );
    let mode = fs::metadata(node.bin.join("calix"))
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
    let text = fs::read_to_string(node.conflist()).expect("conflist");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let types: Vec<&str> = v["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .filter_map(|p| p["type"].as_str())
        .collect();
    assert_eq!(types, ["calix", "portmap"]);
    let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).expect("meta"));
    let before = (inode(&node.bin.join("calix")), inode(&node.conflist()));
    // Again with the same inputs: nothing rewritten (same inodes), nothing left over.
    let again = install(&node.spec()).expect("install again");
    assert!(
        again.files.iter().all(|(_, o)| *o == Outcome::Unchanged),
        "{again:?}"
    );
    assert_eq!(
        before,
        (inode(&node.bin.join("calix")), inode(&node.conflist()))
    );
    // A new plugin build and another MTU: both replaced.
    write_exe(
        &node.src.join("calix"),
        b"\x7fELF pretend plugin, version 2\n",
    );
    let mut spec = node.spec();
    spec.conflist.mtu = Some(1400);
    let third = install(&spec).expect("install new version");
    assert!(
        third.files.iter().all(|(_, o)| *o == Outcome::Written),
        "{third:?}"
    );
    assert!(fs::read_to_string(node.conflist())
        .expect("conflist")
        .contains("1400"));
    assert!(!node.listing().iter().any(|n| n.contains(TEMP_PREFIX)));
}

#[test]
fn a_reader_never_sees_a_partial_conflist() {
    let node = Node::new();
    // Two valid configs of different lengths; the writer flips between them.
    let long_log = format!("/var/log/{}/cni.log", "x".repeat(3000));
    let specs: Vec<Install> = [(Some(1400), None), (Some(9000), Some(long_log))]
        .into_iter()
        .map(|(mtu, log)| {
            let mut s = node.spec();
            s.conflist.mtu = mtu;
            s.conflist.log_file = log.map(PathBuf::from);
            s
        })
        .collect();
    let texts: Vec<String> = specs
        .iter()
        .map(|s| s.conflist.render().expect("render"))
        .collect();
    install(&specs[0]).expect("first install");
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, path, texts) = (stop.clone(), node.conflist(), texts.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let text = fs::read_to_string(&path).expect("the conflist is always there");
                assert!(
                    texts.contains(&text),
                    "read {} bytes that are neither config: {:?}",
                    text.len(),
                    &text[..text.len().min(80)]
                );
                reads += 1;
            }
            reads
        })
    };
    for i in 0..400 {
        install(&specs[i % 2]).expect("install");
    }
    stop.store(true, Ordering::Relaxed);
    let reads = reader.join().expect("the reader saw only whole files");
    assert!(reads > 100, "the reader ran only {reads} times");
    assert!(!node.listing().iter().any(|n| n.contains(TEMP_PREFIX)));
}

#[test]
fn a_running_plugin_is_replaced_without_text_file_busy() {
    let node = Node::new();
    // The installed "plugin" is a copy of sleep, running (as a runtime's ADD would be).
    fs::copy("/bin/sleep", node.bin.join("calix")).expect("copy sleep");
    let mut running = Command::new(node.bin.join("calix"))
        .arg("30")
        .spawn()
        .expect("run the old plugin");
    std::thread::sleep(Duration::from_millis(100));
    let result = install(&node.spec());
    let still_running = running.try_wait().expect("wait").is_none();
    let _ = running.kill();
    let _ = running.wait();
    let report = result.expect("a busy plugin binary is replaced");
    assert_eq!(report.files[0], (node.bin.join("calix"), Outcome::Written));
    assert!(still_running, "the old plugin process was disturbed");
    assert_eq!(
        fs::read(node.bin.join("calix")).expect("plugin"),
        fs::read(node.src.join("calix")).expect("source")
    );
}

#[test]
fn bad_input_is_refused_naming_it_and_nothing_is_written() {
    let node = Node::new();
    let before = node.listing();
    type Change = Box<dyn Fn(&mut Install)>;
    let cases: Vec<(Change, &str)> = vec![
        (
            Box::new(|s| s.bin_dir = "/nonexistent/cni/bin".into()),
            "bin dir /nonexistent/cni/bin",
        ),
        (
            Box::new(|s| s.net_dir = "/nonexistent/net.d".into()),
            "conf dir /nonexistent/net.d",
        ),
        (
            Box::new(|s| s.plugins = vec!["/nonexistent/calix".into()]),
            "/nonexistent/calix",
        ),
        (
            Box::new(|s| s.file_name = "../escape.conflist".into()),
            "../escape.conflist",
        ),
        (
            Box::new(|s| s.file_name = "10-calix.json".into()),
            "10-calix.json",
        ),
        (Box::new(|s| s.conflist.mtu = Some(40)), "mtu 40"),
        (
            Box::new(|s| s.conflist.network = "has space".into()),
            "has space",
        ),
        (
            Box::new(|s| s.conflist.agent_socket = "relative.sock".into()),
            "relative.sock",
        ),
    ];
    for (change, named) in cases {
        let mut spec = node.spec();
        change(&mut spec);
        let e = install(&spec).expect_err("refused").to_string();
        assert!(e.contains(named), "{e:?} should name {named:?}");
        assert_eq!(node.listing(), before, "something was written for {named}");
    }
    // A plugin that is not executable.
    fs::set_permissions(node.src.join("calix"), fs::Permissions::from_mode(0o644)).expect("chmod");
    let e = install(&node.spec()).expect_err("not executable");
    assert!(matches!(e, InstallError::NotExecutable { .. }), "{e}");
    fs::set_permissions(node.src.join("calix"), fs::Permissions::from_mode(0o755)).expect("chmod");
    // portmap is chained but not on the node.
    fs::remove_file(node.bin.join("portmap")).expect("rm portmap");
    let before = node.listing();
    let e = install(&node.spec()).expect_err("no portmap").to_string();
    assert!(
        e.contains("portmap") && e.contains(&node.bin.display().to_string()),
        "{e}"
    );
    assert_eq!(node.listing(), before);
    // ... unless it is installed with the plugins, or left out of the chain.
    let mut spec = node.spec();
    spec.conflist.portmap = false;
    install(&spec).expect("without portmap");
}

#[test]
fn uninstall_removes_only_calix_s_conflist_and_is_idempotent() {
    let node = Node::new();
    install(&node.spec()).expect("install");
    assert_eq!(
        uninstall(&node.net, "10-calix.conflist").expect("uninstall"),
        Removal::Removed
    );
    assert!(!node.conflist().exists());
    // The plugin stays: pods still there need it for their DEL.
    assert!(node.bin.join("calix").exists());
    assert_eq!(
        uninstall(&node.net, "10-calix.conflist").expect("again"),
        Removal::Absent
    );
    let foreign = r#"{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"bridge"}]}"#;
    fs::write(node.conflist(), foreign).expect("write foreign");
    assert_eq!(
        uninstall(&node.net, "10-calix.conflist").expect("foreign"),
        Removal::NotOurs
    );
    assert_eq!(fs::read_to_string(node.conflist()).expect("kept"), foreign);
    assert!(uninstall(&node.net, "../x.conflist").is_err());
}

#[test]
fn configs_that_sort_first_are_reported_and_stale_temporaries_removed() {
    let node = Node::new();
    fs::write(node.net.join("05-bridge.conflist"), "{}").expect("write");
    fs::write(node.net.join("99-late.conf"), "{}").expect("write");
    fs::write(node.net.join("00-readme.txt"), "not a config").expect("write");
    let old = node.bin.join(format!("{TEMP_PREFIX}4242.0"));
    let fresh = node.net.join(format!("{TEMP_PREFIX}4243.0"));
    fs::write(&old, "half").expect("write");
    fs::write(&fresh, "being written right now").expect("write");
    fs::File::options()
        .write(true)
        .open(&old)
        .and_then(|f| f.set_modified(SystemTime::now() - Duration::from_secs(3600)))
        .expect("age it");
    let report = install(&node.spec()).expect("install");
    assert_eq!(
        report.shadowed_by,
        vec![node.net.join("05-bridge.conflist")]
    );
    assert_eq!(report.stale_removed, vec![old.clone()]);
    assert!(!old.exists());
    assert!(
        fresh.exists(),
        "a young temporary file may be another installer's"
    );
}

#[test]
fn the_binary_installs_from_its_environment_and_explains_failures() {
    let node = Node::new();
    let exe = env!("CARGO_BIN_EXE_calix-install-cni");
    let run = |extra: &[&str]| {
        Command::new(exe)
            .env("CNI_BIN_DIR", &node.bin)
            .env("CNI_NET_DIR", &node.net)
            .env("CNI_MTU", "1450")
            .env("CALIX_AGENT_SOCKET", "/var/run/calix/node-a/agent.sock")
            .arg("--plugin")
            .arg(node.src.join("calix"))
            .args(extra)
            .output()
            .expect("run calix-install-cni")
    };
    let out = run(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("installed"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(node.conflist()).expect("conflist"))
            .expect("json");
    assert_eq!(v["plugins"][0]["mtu"], 1450);
    assert_eq!(
        v["plugins"][0]["agent_socket"],
        "/var/run/calix/node-a/agent.sock"
    );
    let again = run(&[]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("up to date"));
    let out = run(&["--uninstall"]);
    assert!(out.status.success());
    assert!(!node.conflist().exists());
    // Bad input: non-zero exit, and stderr says what is wrong.
    let out = run(&["--network-name", "no/slash"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no/slash"), "{stderr}");
    assert!(!node.conflist().exists());
}
