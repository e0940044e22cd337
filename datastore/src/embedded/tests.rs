//! The embedded store's unit tests: transactions, group commit, torn and failed appends,
//! compaction and its failures, relative paths, corruption.
use super::*;

fn put(k: &str, v: &str) -> Op {
    Op::Put(k.into(), v.as_bytes().to_vec())
}

#[tokio::test]
async fn cas_list_and_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sub/store");
    {
        let s = EmbeddedStore::open(&path).expect("open");
        assert_eq!(s.get("a").await.expect("get"), None);
        let r1 = s
            .txn(
                &[Compare::Absent("a".into())],
                &[put("a", "1"), put("b/x", "2")],
                Durability::Power,
            )
            .await
            .expect("txn")
            .expect("applied");
        // Absent no longer holds.
        assert_eq!(
            s.txn(
                &[Compare::Absent("a".into())],
                &[put("a", "9")],
                Durability::Power
            )
            .await
            .expect("txn"),
            None
        );
        // Wrong revision loses, right one wins.
        assert_eq!(
            s.txn(
                &[Compare::Revision("a".into(), r1 + 5)],
                &[put("a", "9")],
                Durability::Process
            )
            .await
            .expect("txn"),
            None
        );
        s.txn(
            &[Compare::Revision("a".into(), r1)],
            &[put("a", "3"), put("b/y", "4"), Op::Delete("b/x".into())],
            Durability::Process,
        )
        .await
        .expect("txn")
        .expect("applied");
        // A second process cannot open it while this one has it.
        assert!(EmbeddedStore::open(&path).is_err());
    }
    let s = EmbeddedStore::open(&path).expect("reopen");
    assert_eq!(s.get("a").await.expect("get").expect("a").value, b"3");
    let b: Vec<String> = s
        .list("b/")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(b, vec!["b/y".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_acknowledges_only_flushed_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let s = std::sync::Arc::new(EmbeddedStore::open(&path).expect("open"));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                let rev = s
                    .txn(&[], &[put(&format!("k{i:02}"), "1")], Durability::Power)
                    .await
                    .expect("txn")
                    .expect("applied");
                // Acknowledged: flushed up to its revision.
                assert!(s.synced.load(Ordering::Acquire) >= rev);
                rev
            })
        })
        .collect();
    let mut revs = Vec::new();
    for t in tasks {
        revs.push(t.await.expect("task"));
    }
    revs.sort_unstable();
    revs.dedup();
    assert_eq!(revs.len(), 32);
    // Appended now, flushed on request (what allocations do outside their lock).
    let rev = s
        .txn(&[], &[put("late", "2")], Durability::Process)
        .await
        .expect("txn")
        .expect("applied");
    s.sync(rev).await.expect("sync");
    assert!(s.synced.load(Ordering::Acquire) >= rev);
    drop(s);
    let s = EmbeddedStore::open(&path).expect("reopen");
    assert_eq!(s.list("k").await.expect("list").len(), 32);
    assert!(s.get("late").await.expect("get").is_some());
}

#[tokio::test]
async fn torn_last_line_is_cut_and_compaction_keeps_everything() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    {
        let s = EmbeddedStore::open(&path).expect("open");
        s.txn(&[], &[put("k1", "\"v1\"")], Durability::Power)
            .await
            .expect("txn");
    }
    // A crash mid-append.
    let jp = dir.path().join("store.journal");
    let mut f = OpenOptions::new().append(true).open(&jp).expect("journal");
    f.write_all(b"{\"rev\":2,\"put\":[[\"k2\"").expect("write");
    drop(f);
    let s = EmbeddedStore::open(&path).expect("reopen after torn write");
    assert!(s.get("k2").await.expect("get").is_none());
    let rev = s
        .txn(&[], &[put("k2", "2")], Durability::Power)
        .await
        .expect("txn")
        .expect("applied");
    assert_eq!(rev, 2);
    {
        let mut inner = s.lock();
        s.compact(&mut inner).expect("compact");
    }
    s.txn(&[], &[put("k3", "3")], Durability::Power)
        .await
        .expect("txn");
    drop(s);
    let s = EmbeddedStore::open(&path).expect("reopen after compaction");
    let keys: Vec<(String, i64)> = s
        .list("k")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| (kv.key, kv.revision))
        .collect();
    assert_eq!(
        keys,
        vec![("k1".into(), 1), ("k2".into(), 2), ("k3".into(), 3)]
    );
    // Creation stamps survive the snapshot: k2, created at 2 and rewritten at 4 after the
    // compaction, then folded into a second snapshot.
    s.txn(&[], &[put("k2", "again")], Durability::Power)
        .await
        .expect("txn");
    {
        let mut inner = s.lock();
        s.compact(&mut inner).expect("compact");
    }
    drop(s);
    let s = EmbeddedStore::open(&path).expect("reopen after the second compaction");
    let k2 = s.get("k2").await.expect("get").expect("k2");
    assert_eq!((k2.revision, k2.created), (4, 2));
}

/// Runs test `name` of this module again in a child process (this test binary, that test
/// only) with `cwd` as its working directory, for tests that change process-wide state
/// (the working directory, a resource limit). Returns true in the child, where the body
/// runs; in the parent it checks that the child's test ran and passed, and returns false.
fn in_child(name: &str, cwd: &Path) -> bool {
    const CHILD: &str = "CALIX_EMBEDDED_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    // The test's path in the binary: this module's, without the crate's name.
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let full = format!("{module}::{name}");
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([full.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .current_dir(cwd)
        .output()
        .expect("run the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child test {full} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// Limits the size of files this process writes (RLIMIT_FSIZE; `None`: no limit). A write
/// across the limit is cut short, as on a full disk, and the next one fails (EFBIG).
fn limit_file_size(bytes: Option<u64>) {
    // SAFETY: plain syscalls on a stack value; SIG_IGN for SIGXFSZ turns the signal a write
    // beyond the limit raises into an EFBIG error.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim), 0);
        lim.rlim_cur = bytes.unwrap_or(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
}

#[tokio::test]
async fn a_short_append_is_cut_back_and_the_next_write_survives() {
    let dir = tempfile::tempdir().expect("tempdir");
    if !in_child(
        "a_short_append_is_cut_back_and_the_next_write_survives",
        dir.path(),
    ) {
        return;
    }
    let here = std::env::current_dir().expect("cwd");
    let path = here.join("store");
    let journal = here.join("store.journal");
    let s = EmbeddedStore::open(&path).expect("open");
    s.txn(&[], &[put("k1", "1")], Durability::Power)
        .await
        .expect("txn")
        .expect("applied");
    let len = fs::metadata(&journal).expect("journal").len();
    // Room for a few bytes of the next line only: the disk fills up mid-append.
    limit_file_size(Some(len + 10));
    let err = s
        .txn(&[], &[put("k2", &"x".repeat(300))], Durability::Power)
        .await
        .expect_err("the append cannot fit");
    assert!(err.to_string().contains("append"), "{err}");
    assert!(s.get("k2").await.expect("get").is_none());
    // Space again: this write is acknowledged, so it must survive a restart.
    limit_file_size(None);
    s.txn(&[], &[put("k3", "3")], Durability::Power)
        .await
        .expect("txn")
        .expect("applied");
    drop(s);
    let s = EmbeddedStore::open(&path).expect("reopen");
    assert!(
        s.get("k3").await.expect("get").is_some(),
        "the acknowledged write k3 was lost: it landed behind the fragment of the failed append"
    );
    assert!(s.get("k1").await.expect("get").is_some());
    assert!(s.get("k2").await.expect("get").is_none());
}

/// Makes every later `ftruncate` of this thread (and of threads it starts) fail with EIO:
/// a seccomp filter, which needs no privileges once `no_new_privs` is set.
fn fail_ftruncate() {
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let filter = [
        // The syscall number: offset 0 of struct seccomp_data.
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_ftruncate as u32,
        },
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | (libc::EIO as u32 & libc::SECCOMP_RET_DATA),
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: prctl with a filter program that outlives the call (the kernel copies it).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            ),
            0,
            "seccomp: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[tokio::test]
async fn a_failed_append_that_cannot_be_cut_back_poisons_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let name = "a_failed_append_that_cannot_be_cut_back_poisons_the_store";
    if !in_child(name, dir.path()) {
        // The child left a journal ending in a fragment, nothing acknowledged behind it:
        // it opens, with the fragment cut off as a torn line.
        let s = EmbeddedStore::open(&dir.path().join("store")).expect("reopen");
        assert!(s.get("k1").await.expect("get").is_some());
        assert!(s.get("k2").await.expect("get").is_none());
        assert!(s.get("k3").await.expect("get").is_none());
        return;
    }
    let here = std::env::current_dir().expect("cwd");
    let s = EmbeddedStore::open(&here.join("store")).expect("open");
    s.txn(&[], &[put("k1", "1")], Durability::Power)
        .await
        .expect("txn")
        .expect("applied");
    let len = fs::metadata(here.join("store.journal"))
        .expect("journal")
        .len();
    limit_file_size(Some(len + 10));
    fail_ftruncate();
    let err = s
        .txn(&[], &[put("k2", &"x".repeat(300))], Durability::Power)
        .await
        .expect_err("the append cannot fit");
    assert!(err.to_string().contains("append"), "{err}");
    limit_file_size(None);
    // The journal ends in a fragment: nothing more may be acknowledged.
    let err = s
        .txn(&[], &[put("k3", "3")], Durability::Power)
        .await
        .expect_err("poisoned");
    assert!(
        matches!(err, DatastoreError::Poisoned { .. })
            && err.to_string().contains("could not be cut back"),
        "{err}"
    );
    assert!(s.sync(1).await.is_err(), "sync must fail too");
}

#[tokio::test]
async fn a_failing_compaction_backs_off_and_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    if !in_child(
        "a_failing_compaction_backs_off_and_loses_nothing",
        dir.path(),
    ) {
        return;
    }
    let here = std::env::current_dir().expect("cwd");
    let path = here.join("store");
    let mut s = EmbeddedStore::open(&path).expect("open");
    s.compact_after = 10;
    // A large state, folded into the snapshot: a snapshot is now larger than the limit
    // below, the journal's small lines are not.
    s.txn(
        &[],
        &[put("big", &"b".repeat(64 * 1024))],
        Durability::Power,
    )
    .await
    .expect("txn");
    {
        let mut inner = s.lock();
        s.compact(&mut inner).expect("compact");
    }
    let attempts0 = s.lock().compact_attempts;
    limit_file_size(Some(32 * 1024));
    for i in 0..100 {
        s.txn(&[], &[put(&format!("n{i:03}"), "1")], Durability::Power)
            .await
            .unwrap_or_else(|e| panic!("txn {i}: {e}"))
            .expect("applied");
    }
    let attempts = s.lock().compact_attempts - attempts0;
    eprintln!("{attempts} compactions tried in 100 transactions");
    assert!(attempts >= 1, "the compaction was never tried");
    assert!(
        attempts <= 4,
        "{attempts} compactions tried in 100 transactions: a failed compaction must back off"
    );
    let leftovers: Vec<_> = fs::read_dir(&here)
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "failed compaction left {leftovers:?}");
    limit_file_size(None);
    drop(s);
    let s = EmbeddedStore::open(&path).expect("reopen");
    assert_eq!(s.list("n").await.expect("list").len(), 100);
    assert_eq!(
        s.get("big").await.expect("get").expect("big").value.len(),
        64 * 1024
    );
}

#[tokio::test]
async fn a_relative_path_works_from_any_working_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    if !in_child(
        "a_relative_path_works_from_any_working_directory",
        dir.path(),
    ) {
        return;
    }
    // `--datastore-path store.json`: the parent directory is "".
    let rel = Path::new("store.json");
    let s = EmbeddedStore::open(rel).expect("open a relative path");
    s.txn(&[], &[put("a", "1")], Durability::Power)
        .await
        .expect("txn");
    {
        let mut inner = s.lock();
        s.compact(&mut inner)
            .expect("compact a store opened by a relative path");
    }
    s.txn(&[], &[put("b", "2")], Durability::Power)
        .await
        .expect("txn");
    drop(s);
    let s = EmbeddedStore::open(rel).expect("reopen");
    assert_eq!(s.list("").await.expect("list").len(), 2);
}

#[tokio::test]
async fn garbage_in_the_middle_is_corruption() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    fs::write(
        dir.path().join("store.journal"),
        b"{not json\n{\"rev\":1,\"put\":[[\"a\",\"1\"]]}\n",
    )
    .expect("write");
    let err = EmbeddedStore::open(&path).err().expect("corrupt");
    assert!(err.to_string().contains("corrupt"), "{err}");
}
