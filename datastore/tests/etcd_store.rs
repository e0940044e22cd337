//! `EtcdStore` against a real etcd (`/usr/bin/etcd`) on 127.0.0.1, one server per test: the
//! datastore conformance suite (tests/conformance), then what is etcd's own (several stores on
//! one cluster, etcd down or restarting under requests, a watch on an etcd that stops
//! answering). A missing etcd binary is a failure (`cargo xtask setup` installs it).
#[macro_use]
mod conformance;

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use calix_datastore::{Compare, Datastore, DatastoreError, Durability, EtcdConfig, EtcdStore, Op};
use calix_proto::etcd::etcdserverpb::{kv_client::KvClient, CompactionRequest};
use futures::StreamExt;

const ETCD: &str = "/usr/bin/etcd";

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// A single-member etcd on 127.0.0.1; killed when dropped, even if the test fails.
struct Etcd {
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Mutex<Option<Child>>,
}

impl Etcd {
    /// Starts etcd; a missing etcd is a failure (`cargo xtask setup` installs etcd-server).
    fn start() -> Option<Arc<Etcd>> {
        assert!(
            Path::new(ETCD).exists(),
            "{ETCD} not installed: run `cargo xtask setup`"
        );
        let etcd = Etcd {
            dir: tempfile::tempdir().expect("tempdir"),
            client_port: free_port(),
            peer_port: free_port(),
            child: Mutex::new(None),
        };
        etcd.spawn();
        Some(Arc::new(etcd))
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Starts etcd on the data dir and ports and waits until its client port accepts.
    fn spawn(&self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let child = Command::new(ETCD)
            .arg("--name=default")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=default={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        *self.child.lock().unwrap() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.client_port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "etcd did not listen: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> i32 {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let id = child.as_ref().expect("etcd runs").id();
        i32::try_from(id).expect("pid")
    }

    fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

fn config(endpoint: String, prefix: &str, timeout_ms: u64, attempts: u32) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.into(),
        timeout: Duration::from_millis(timeout_ms),
        attempts,
    }
}

async fn store(etcd: &Etcd, prefix: &str) -> EtcdStore {
    // Generous attempts: the first requests may race etcd's election.
    EtcdStore::connect(config(etcd.url(), prefix, 2000, 10))
        .await
        .expect("connect")
}

const P: Durability = Durability::Power;

fn put(key: &str, value: &str) -> Op {
    Op::Put(key.into(), value.as_bytes().to_vec())
}

/// The suite's backend: an etcd of its own per test; a restart kills it and starts it again on
/// the same data directory, under the same store (which reconnects by itself).
struct EtcdBackend {
    etcd: Arc<Etcd>,
}

impl EtcdBackend {
    fn start() -> Self {
        Self {
            etcd: Etcd::start().expect("etcd"),
        }
    }
}

#[tonic::async_trait]
impl conformance::Backend for EtcdBackend {
    type Store = EtcdStore;

    async fn open(&self) -> EtcdStore {
        store(&self.etcd, "/calix/").await
    }

    async fn compact(&self, _store: &EtcdStore, revision: i64) {
        let channel = tonic::transport::Endpoint::from_shared(self.etcd.url())
            .expect("url")
            .connect()
            .await
            .expect("connect to etcd");
        KvClient::new(channel)
            .compact(CompactionRequest {
                revision,
                physical: true,
            })
            .await
            .expect("compact");
    }

    async fn restart(&self, store: EtcdStore) -> EtcdStore {
        let etcd = self.etcd.clone();
        tokio::task::spawn_blocking(move || {
            etcd.kill();
            etcd.spawn();
        })
        .await
        .expect("restart etcd");
        store
    }
}

datastore_conformance!(EtcdBackend::start());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_with_other_prefixes_never_see_each_other() {
    let Some(etcd) = Etcd::start() else { return };
    let db = store(&etcd, "/calix/").await;
    let other = store(&etcd, "/other/").await;
    let (_, from) = other.list_with_revision("").await.unwrap();
    let mut watch = other.watch("", from).await.expect("watch");
    db.txn(&[], &[put("pool/a", "a")], P)
        .await
        .unwrap()
        .unwrap();
    let rev = other
        .txn(&[], &[put("pool/z", "other")], P)
        .await
        .unwrap()
        .unwrap();
    let theirs = other.list("").await.unwrap();
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0].key, "pool/z");
    assert_eq!(db.list("").await.unwrap().len(), 1);
    // Keys come back without the prefix, in watches too; the other store's write is not seen.
    let event = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("an event")
        .expect("the stream goes on")
        .expect("no error");
    assert_eq!((event.key(), event.revision()), ("pool/z", rev));
}

/// An etcd that stops answering without closing its connection (hung, or the network gone
/// without a reset): the watch's keepalive pings go unanswered and the watch ends, rather than
/// waiting for events forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_an_etcd_that_stops_answering_ends() {
    let Some(etcd) = Etcd::start() else { return };
    let db = store(&etcd, "/calix/").await;
    let (_, from) = db.list_with_revision("").await.unwrap();
    let mut watch = db.watch("", from).await.expect("watch");
    let rev = db.txn(&[], &[put("a", "1")], P).await.unwrap().unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), watch.next()).await;
    assert!(
        matches!(&first, Ok(Some(Ok(e))) if e.revision() == rev),
        "{first:?}"
    );
    let pid = etcd.pid();
    // SAFETY: kill(2) on the etcd this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let started = Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(40), watch.next()).await;
    let waited = started.elapsed();
    // SAFETY: as above; the drop of `etcd` kills it either way.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    match end {
        Ok(Some(Err(DatastoreError::WatchEnded { detail, .. }))) => {
            eprintln!("watch ended {waited:?} after etcd stopped: {detail}")
        }
        other => panic!("expected the watch to end, got {other:?} after {waited:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_key_txn_is_atomic() {
    let Some(etcd) = Etcd::start() else { return };
    let db = store(&etcd, "/calix/").await;
    db.txn(&[], &[put("b", "taken")], P).await.unwrap().unwrap();

    // b exists, so neither write happens.
    let both = [Compare::Absent("a".into()), Compare::Absent("b".into())];
    let ops = [put("a", "1"), put("b", "1")];
    assert_eq!(db.txn(&both, &ops, P).await.unwrap(), None);
    assert_eq!(db.get("a").await.unwrap(), None);
    assert_eq!(db.get("b").await.unwrap().unwrap().value, b"taken");

    // Two fresh keys: both written at one revision.
    let fresh = [Compare::Absent("c".into()), Compare::Absent("d".into())];
    let rev = db.txn(&fresh, &[put("c", "1"), put("d", "1")], P).await;
    let rev = rev.unwrap().expect("applies");
    assert_eq!(db.get("c").await.unwrap().unwrap().revision, rev);
    assert_eq!(db.get("d").await.unwrap().unwrap().revision, rev);
    // A put and a delete together.
    let b = db.get("b").await.unwrap().unwrap();
    let swap = [Compare::Revision("b".into(), b.revision)];
    let ops = [Op::Delete("b".into()), put("e", "1")];
    assert!(db.txn(&swap, &ops, P).await.unwrap().is_some());
    assert_eq!(db.get("b").await.unwrap(), None);
    assert!(db.get("e").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_etcd_fails_bounded_then_recovers() {
    assert!(
        Path::new(ETCD).exists(),
        "{ETCD} not installed: run `cargo xtask setup`"
    );
    // Nothing listens yet: connect is lazy, requests fail with Unavailable, within bounds.
    let etcd = Etcd {
        dir: tempfile::tempdir().unwrap(),
        client_port: free_port(),
        peer_port: free_port(),
        child: Mutex::new(None),
    };
    let started = Instant::now();
    let db = EtcdStore::connect(config(etcd.url(), "/calix/", 300, 3))
        .await
        .expect("connect is lazy");
    assert!(started.elapsed() < Duration::from_millis(300));
    let started = Instant::now();
    match db.get("a").await {
        Err(calix_datastore::DatastoreError::Unavailable {
            backend, attempts, ..
        }) => assert_eq!((backend, attempts), ("etcd", 3)),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // 3 tries of at most 300 ms, plus 50 + 100 ms of backoff.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A watch cannot start either, and says so within the same bounds.
    let started = Instant::now();
    match db.watch("", 0).await {
        Err(DatastoreError::Unavailable {
            backend, attempts, ..
        }) => assert_eq!((backend, attempts), ("etcd", 3)),
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("a watch started without etcd"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    // etcd comes up: the same store now works.
    etcd.spawn();
    let mut ok = false;
    for _ in 0..20 {
        if db.txn(&[], &[put("a", "1")], P).await.is_ok() {
            ok = true;
            break;
        }
    }
    assert!(ok, "store never recovered: {}", etcd.log());
    assert_eq!(db.get("a").await.unwrap().unwrap().value, b"1");

    assert!(matches!(
        EtcdStore::connect(config("not a url".into(), "/calix/", 300, 3)).await,
        Err(calix_datastore::DatastoreError::Unavailable { attempts: 0, .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txns_survive_an_etcd_restart() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let Some(etcd) = Etcd::start() else { return };
    let db = store(&etcd, "/calix/").await;
    let done = Arc::new(AtomicUsize::new(0));
    let restarter = {
        let (etcd, done) = (etcd.clone(), done.clone());
        std::thread::spawn(move || {
            while done.load(Ordering::SeqCst) < 10 {
                std::thread::sleep(Duration::from_millis(5));
            }
            etcd.kill();
            std::thread::sleep(Duration::from_secs(1));
            etcd.spawn();
        })
    };

    // Collect outcomes first, assert after joining the restarter (so etcd is never orphaned).
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..100 {
        let key = format!("restart/{i:03}");
        let value = format!("v{i}");
        let started = Instant::now();
        if let Err(e) = put_new(&db, &key, &value).await {
            failures.push(e);
        }
        slowest = slowest.max(started.elapsed());
        done.store(i + 1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let restarted = restarter.join();

    assert!(restarted.is_ok(), "restarting etcd failed: {}", etcd.log());
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(
        slowest > Duration::from_millis(900),
        "no txn saw the outage: {slowest:?}"
    );
    let keys: Vec<String> = db
        .list("restart/")
        .await
        .unwrap()
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    let want: Vec<String> = (0..100).map(|i| format!("restart/{i:03}")).collect();
    assert_eq!(keys, want);
    eprintln!("slowest txn across the restart: {slowest:?}");
}

/// Puts `key` under an Absent compare; a conflict counts as success when the key holds our
/// value (the txn was applied, its answer lost, and the retry saw our own write).
async fn put_new(db: &EtcdStore, key: &str, value: &str) -> Result<(), String> {
    match db
        .txn(&[Compare::Absent(key.into())], &[put(key, value)], P)
        .await
    {
        Ok(Some(_)) => Ok(()),
        Ok(None) => match db.get(key).await {
            Ok(Some(kv)) if kv.value == value.as_bytes() => Ok(()),
            other => Err(format!("{key}: conflict, then {other:?}")),
        },
        Err(e) => Err(format!("{key}: {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_txns_survive_a_kill_mid_flight() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let Some(etcd) = Etcd::start() else { return };
    let db = Arc::new(store(&etcd, "/calix/").await);
    let restarter = {
        let etcd = etcd.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            etcd.kill();
            std::thread::sleep(Duration::from_secs(1));
            etcd.spawn();
        })
    };
    // Back-to-back txns from 8 tasks: the kill lands on requests in flight.
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let db = db.clone();
            tokio::spawn(async move {
                let mut failures = Vec::new();
                for i in 0..150 {
                    let key = format!("mid/{t}/{i:03}");
                    if let Err(e) = put_new(&db, &key, "v").await {
                        failures.push(e);
                    }
                }
                failures
            })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        match task.await {
            Ok(f) => failures.extend(f),
            Err(e) => failures.push(format!("task: {e}")),
        }
    }
    let restarted = restarter.join();

    assert!(restarted.is_ok(), "restarting etcd failed: {}", etcd.log());
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(db.list("mid/").await.unwrap().len(), 8 * 150);
}
