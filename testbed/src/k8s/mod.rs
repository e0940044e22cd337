//! A real Kubernetes API server (upstream kube-apiserver v1.36.2 from `../shared/k8s/bin`,
//! decompressed on demand into `target/k8s/` after checking its SHA-256) on a real etcd
//! (Debian's), with calix's CRDs (`charts/calix/crds/`) applied.
//!
//! Two places: [`KubeApi::on_loopback`] runs both in the caller's namespace on 127.0.0.1 and
//! free ports (for a client in the test process); [`KubeApi::in_namespace`] runs them in a
//! namespace of their own (named [`crate::unique`]`("k")`, the API server on 6443 of every
//! address there), and [`KubeApi::wire`] connects a node namespace to it by a veth pair
//! (10.97.<i>.1 ↔ 10.97.<i>.2/30) and writes that node a kubeconfig.
//!
//! Authentication is a static token file (an admin in `system:masters`) and ServiceAccount
//! tokens from the TokenRequest API, bound to no object or to a node ([`KubeApi::node_token`]:
//! a pod on the node, as a DaemonSet pod's, or the Node; the agents' own, with the chart's
//! ClusterRole and node authority, in [`crate::authority`]); authorization stays `Node,RBAC`. The API server makes its own serving certificate (`--cert-dir`, for the names
//! `kubernetes*` and 127.0.0.1): kubeconfigs trust its CA and verify the name `kubernetes`
//! whatever address they dial. Everything is killed and removed on drop, even when a test
//! fails; each daemon also dies with the thread that started it.
//!
//! Here: where it runs and how clients reach it. `daemons.rs` starts etcd, the API server and
//! the controllers; `objects.rs` applies, reads and deletes objects; `nodes.rs` makes calix
//! nodes of it and the Node, Namespace, IPPool and Pod objects they serve; `tokens.rs` makes
//! ServiceAccounts and their tokens; `binaries.rs` finds the Kubernetes binaries; [`dns`] is
//! a cluster DNS from the API's Services (no CoreDNS can be had here; not yet wired into the
//! e2e cluster: the upstream Services suite needs it); [`KubeProxy`] runs kube-proxy in a node's
//! namespace.
mod binaries;
mod daemons;
pub mod dns;
mod kube_proxy;
mod nodes;
mod objects;
mod tokens;

pub use binaries::{crds_dir, k8s_binary, kube_apiserver};
pub use kube_proxy::{KubeProxy, ProxyMode};
pub use nodes::{ippool, wait_pools};

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use crate::netns::{veth, Netns};
use crate::process::checked;
use crate::{unique, Error, Result};

/// The token of the test bed's cluster admin (group `system:masters`).
pub const ADMIN_TOKEN: &str = "calix-testbed-admin";
/// The API server's port in a namespace of its own.
const NS_API_PORT: u16 = 6443;
/// The address the API server advertises in a namespace of its own (on its loopback).
const NS_ADVERTISE: &str = "10.97.0.1";
/// The name every kubeconfig verifies the serving certificate against.
const TLS_NAME: &str = "kubernetes";

/// An API server and its etcd. See the module doc.
pub struct KubeApi {
    /// The namespace both run in; `None`: the caller's, on 127.0.0.1.
    pub ns: Option<Netns>,
    pub dir: PathBuf,
    api_port: u16,
    etcd_port: u16,
    peer_port: u16,
    watch_cache: bool,
    etcd: Mutex<Option<Child>>,
    apiserver: Mutex<Option<Child>>,
    /// kube-controller-manager and kube-scheduler, once [`KubeApi::start_controllers`] ran.
    controllers: Mutex<Vec<Child>>,
    links: AtomicU32,
    /// Each wired node namespace's link number ([`KubeApi::wire`]).
    wired: Mutex<std::collections::BTreeMap<String, u32>>,
    /// Whether the agents' ServiceAccount and the chart's node authority are installed
    /// ([`KubeApi::calix_agent`]).
    pub(crate) agent_account: Mutex<bool>,
}

/// What a node's token is bound to ([`KubeApi::node_token`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundTo {
    /// A Pod on the node, as a DaemonSet pod's projected token is.
    Pod,
    /// The Node object.
    Node,
}

impl KubeApi {
    /// On 127.0.0.1 of the caller's namespace; panics on failure. `watch_cache: false` serves
    /// every watch from etcd (its compaction then shows as 410 Gone).
    /// Its ports are picked free, then bound by etcd and the API server: another test may
    /// take one in between ("address already in use"), so a failed start is tried again, on
    /// new ports (a failed launch stops what it started).
    pub fn on_loopback(watch_cache: bool) -> Self {
        crate::require_root();
        let mut tries = 3;
        loop {
            match Self::launch(None, unique("k"), watch_cache) {
                Ok(api) => return api,
                Err(e) if tries > 1 => {
                    tries -= 1;
                    eprintln!("kube-apiserver on loopback did not start ({e}); again on new ports");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// One API server in a namespace of its own for the whole test binary: started by the
    /// first caller, on a thread that lives until the process exits (its daemons die with the
    /// thread that started them), stopped and removed when the process exits. Tests sharing it
    /// keep to objects of their own (unique names, pools of their own) and never restart it.
    pub fn shared() -> std::sync::Arc<Self> {
        static SHARED: Mutex<Option<std::sync::Arc<KubeApi>>> = Mutex::new(None);
        extern "C" fn stop_shared() {
            let api = SHARED.lock().unwrap_or_else(|p| p.into_inner()).take();
            drop(api);
        }
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(api) = shared.as_ref() {
            return api.clone();
        }
        crate::require_root();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let name = unique("k");
            let launched =
                Netns::create(name.clone()).and_then(|ns| Self::launch(Some(ns), name, true));
            let _ = tx.send(launched);
            loop {
                std::thread::park();
            }
        });
        let api = std::sync::Arc::new(
            rx.recv()
                .expect("the API server's thread")
                .unwrap_or_else(|e| panic!("{e}")),
        );
        // SAFETY: atexit takes a plain function; it runs once, after the tests, at exit.
        unsafe { libc::atexit(stop_shared) };
        *shared = Some(api.clone());
        api
    }

    /// In a namespace of its own; panics on failure.
    pub fn in_namespace() -> Self {
        crate::require_root();
        let name = unique("k");
        let ns = Netns::create(name.clone()).unwrap_or_else(|e| panic!("{e}"));
        Self::launch(Some(ns), name, true).unwrap_or_else(|e| panic!("{e}"))
    }

    /// etcd and the API server (in `ns` when given), up, with calix's CRDs established; files
    /// in `$TMPDIR/<name>`.
    pub fn launch(ns: Option<Netns>, name: String, watch_cache: bool) -> Result<Self> {
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
        let (api_port, etcd_port, peer_port) = match &ns {
            Some(ns) => {
                ns.ip(&format!("addr add {NS_ADVERTISE}/32 dev lo"))?;
                (NS_API_PORT, 2379, 2380)
            }
            None => (free_port()?, free_port()?, free_port()?),
        };
        let api = Self {
            ns,
            dir,
            api_port,
            etcd_port,
            peer_port,
            watch_cache,
            etcd: Mutex::new(None),
            apiserver: Mutex::new(None),
            controllers: Mutex::new(Vec::new()),
            links: AtomicU32::new(0),
            wired: Mutex::new(Default::default()),
            agent_account: Mutex::new(false),
        };
        api.write_credentials()?;
        api.start_etcd()?;
        api.start_apiserver()?;
        let crds = crds_dir();
        api.apply_crds(&crds)?;
        Ok(api)
    }

    /// The admin kubeconfig for a client where the API server listens (the test process on
    /// loopback, or a thread inside [`KubeApi::ns`]).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// etcd's client URL (loopback only: inside a namespace it is that namespace's).
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.etcd_port)
    }

    /// Connects `node` to the API server's namespace by a veth pair and returns a kubeconfig
    /// for clients in `node` (the admin's credentials). Needs [`KubeApi::in_namespace`].
    pub fn wire(&self, node: &Netns) -> Result<PathBuf> {
        self.wire_as(node, ADMIN_TOKEN)
    }

    /// As [`KubeApi::wire`], the kubeconfig authenticating with `token` (e.g. a
    /// ServiceAccount's, [`KubeApi::service_account_token`]).
    pub fn wire_as(&self, node: &Netns, token: &str) -> Result<PathBuf> {
        let Some(ns) = &self.ns else {
            return Err(Error::Unexpected {
                what: "KubeApi::wire".into(),
                found: "an API server on the caller's loopback".into(),
                expected: "one in a namespace of its own (KubeApi::in_namespace)".into(),
            });
        };
        let i = self.links.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.wired).insert(node.name.clone(), i);
        let host = format!("k{i}");
        veth(ns, &host, node, "kube0")?;
        ns.ip(&format!("addr add 10.97.{i}.1/30 dev {host}"))?;
        ns.ip(&format!("link set {host} up"))?;
        node.ip(&format!("addr add 10.97.{i}.2/30 dev kube0"))?;
        node.ip("link set kube0 up")?;
        // The address the API server advertises (the `kubernetes` Service's endpoint, see
        // [`KubeApi::serve_in_cluster`]) through this link, pods' traffic masqueraded as the
        // node's: the API server's namespace has no routes to the pools.
        node.ip(&format!(
            "route add {NS_ADVERTISE}/32 via 10.97.{i}.1 dev kube0"
        ))?;
        masquerade(node, &["-o", "kube0"])?;
        let path = self.dir.join(format!("node{i}.kubeconfig"));
        self.write_kubeconfig(&path, &format!("10.97.{i}.1"), token)?;
        Ok(path)
    }

    /// A kubeconfig for clients in `node` (wired: [`KubeApi::wire_as`]) with the admin's
    /// credentials, beside the one its agent has: for kube-proxy on a calix node.
    pub fn admin_kubeconfig_at(&self, node: &Netns) -> Result<PathBuf> {
        let (_, i) = self.link_of(node, "KubeApi::admin_kubeconfig_at")?;
        let path = self.dir.join(format!("node{i}-admin.kubeconfig"));
        self.write_kubeconfig(&path, &format!("10.97.{i}.1"), ADMIN_TOKEN)?;
        Ok(path)
    }

    /// The API server's namespace and the number of `node`'s link to it ([`KubeApi::wire`]).
    fn link_of(&self, node: &Netns, what: &str) -> Result<(&Netns, u32)> {
        match (&self.ns, lock(&self.wired).get(&node.name).copied()) {
            (Some(ns), Some(i)) => Ok((ns, i)),
            _ => Err(Error::Unexpected {
                what: what.into(),
                found: format!("{} not wired", node.name),
                expected: "a node namespace KubeApi::wire connected".into(),
            }),
        }
    }

    /// Routes the API server's namespace to `node_ip` (the kubelet's `--node-ip`, its Node's
    /// InternalIP) through `node`'s link ([`KubeApi::wire`] first): the API server reaches
    /// that kubelet for exec, logs and port-forward.
    pub fn reach_kubelet(&self, node: &Netns, node_ip: &str) -> Result<()> {
        let (ns, i) = self.link_of(node, "KubeApi::reach_kubelet")?;
        ns.ip(&format!(
            "route replace {node_ip}/32 via 10.97.{i}.2 dev k{i}"
        ))
    }

    /// Routes the API server's namespace to `cidr` (the pods' pool) through `node`'s link
    /// ([`KubeApi::wire`] first), masqueraded there as `node`'s own address: the API server's
    /// proxy to pods and Services (`.../pods/NAME:PORT/proxy`) reaches a pod on any node, as
    /// from a control-plane host that routes to the pods. The pods see `node` as the client,
    /// which they already know how to answer.
    pub fn reach_pods(&self, node: &Netns, cidr: &str) -> Result<()> {
        let (ns, i) = self.link_of(node, "KubeApi::reach_pods")?;
        ns.ip(&format!("route replace {cidr} via 10.97.{i}.2 dev k{i}"))?;
        masquerade(
            node,
            &["-s", &format!("10.97.{i}.1/32"), "!", "-o", "kube0"],
        )
    }

    /// The CA of the API server's client certificate for the kubelets: a kubelet that trusts
    /// it (`authentication.x509.clientCAFile`) serves exec, logs and port-forward to the API
    /// server.
    pub fn kubelet_client_ca(&self) -> PathBuf {
        self.dir.join("kubelet-client-ca.crt")
    }

    /// Writes to `path` the kubeconfig `wired` (one [`KubeApi::wire`] wrote, the admin's)
    /// authenticating with `token` instead: a second identity on a node already wired (its
    /// kubelet as the admin, its agent as the agents' ServiceAccount).
    pub fn kubeconfig_as(&self, wired: &Path, token: &str, path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(wired)
            .map_err(Error::io(format!("read {}", wired.display())))?;
        let admin = format!("token: {ADMIN_TOKEN}\n");
        if !text.contains(&admin) {
            return Err(Error::Unexpected {
                what: wired.display().to_string(),
                found: "another token".into(),
                expected: "the admin's kubeconfig (KubeApi::wire)".into(),
            });
        }
        std::fs::write(path, text.replace(&admin, &format!("token: {token}\n")))
            .map_err(Error::io(format!("write {}", path.display())))
    }

    /// Runs `f` with an admin client on a thread where the API server is reachable (inside its
    /// namespace, or here), on a runtime of its own.
    pub fn with_client<T, F, Fut>(&self, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(kube::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        self.with_kubeconfig(self.kubeconfig(), f)
    }

    /// [`KubeApi::with_client`] with a client that authenticates with `token`.
    pub fn with_token<T, F, Fut>(&self, token: &str, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(kube::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let path = self.dir.join(format!("{}.kubeconfig", unique("t")));
        self.write_kubeconfig(&path, "127.0.0.1", token)
            .unwrap_or_else(|e| panic!("{e}"));
        self.with_kubeconfig(path, f)
    }

    fn with_kubeconfig<T, F, Fut>(&self, kubeconfig: PathBuf, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(kube::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let run = move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let client = client(&kubeconfig).await.unwrap_or_else(|e| panic!("{e}"));
                f(client).await
            })
        };
        match &self.ns {
            Some(ns) => ns.run(run),
            None => std::thread::spawn(run)
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p)),
        }
    }

    /// A kubeconfig authenticating with `token` for a client where the API server listens
    /// (inside [`KubeApi::ns`], or here on loopback).
    /// The address and port the API server advertises (the `kubernetes` Service's endpoint),
    /// reachable from the nodes [`KubeApi::wire`]d to it; `None` without a namespace of its
    /// own.
    pub fn advertised(&self) -> Option<(&'static str, u16)> {
        self.ns.as_ref().map(|_| (NS_ADVERTISE, NS_API_PORT))
    }

    /// A kubeconfig (the admin's) for a client inside the API server's own namespace
    /// ([`KubeApi::in_namespace`]) that does not honour `tls-server-name` (the upstream e2e
    /// framework): the server named by an address its certificate carries.
    pub fn kubeconfig_advertised(&self) -> Result<PathBuf> {
        let path = self.dir.join("advertised.kubeconfig");
        self.write_kubeconfig(&path, NS_ADVERTISE, ADMIN_TOKEN)?;
        Ok(path)
    }

    pub fn kubeconfig_for(&self, token: &str) -> Result<PathBuf> {
        let path = self.dir.join(format!("{}.kubeconfig", unique("t")));
        self.write_kubeconfig(&path, "127.0.0.1", token)?;
        Ok(path)
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        for mut c in
            std::mem::take(&mut *self.controllers.lock().unwrap_or_else(|p| p.into_inner()))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
        kill(&self.apiserver);
        kill(&self.etcd);
        if std::thread::panicking() {
            let log = self.apiserver_log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!(
                "--- last lines of kube-apiserver's log ({}) ---",
                self.dir.display()
            );
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An iptables rule in `node`: what `matches` matches leaves masqueraded as `node`'s address.
fn masquerade(node: &Netns, matches: &[&str]) -> Result<()> {
    let mut argv = vec!["iptables", "-t", "nat", "-A", "POSTROUTING"];
    argv.extend_from_slice(matches);
    argv.extend_from_slice(&["-j", "MASQUERADE"]);
    checked(&mut node.cmd(&argv)).map(drop)
}

/// A client from a kubeconfig file.
pub async fn client(kubeconfig: &Path) -> Result<kube::Client> {
    let err = |e: String| Error::Kube {
        what: format!("kubeconfig {}", kubeconfig.display()),
        detail: e,
    };
    let file = kube::config::Kubeconfig::read_from(kubeconfig).map_err(|e| err(e.to_string()))?;
    let cfg = kube::Config::from_custom_kubeconfig(file, &Default::default())
        .await
        .map_err(|e| err(e.to_string()))?;
    kube::Client::try_from(cfg).map_err(|e| err(e.to_string()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn kill(m: &Mutex<Option<Child>>) {
    if let Some(mut c) = lock(m).take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(Error::io("bind 127.0.0.1:0"))?;
    Ok(l.local_addr().map_err(Error::io("local addr"))?.port())
}
