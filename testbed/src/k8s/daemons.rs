//! The daemons: etcd, kube-apiserver (its credentials, readiness and CA), and
//! kube-controller-manager with kube-scheduler.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kube::api::Api;

use super::{k8s_binary, kill, kube_apiserver, lock, KubeApi, ADMIN_TOKEN, NS_ADVERTISE};
use super::{NS_API_PORT, TLS_NAME};
use crate::process::{checked, command_in, spawn_logged};
use crate::{Error, Result};

/// The API server's Service ranges: IPv4, then IPv6.
pub const SERVICE_RANGES: &str = "10.96.0.0/16,fd00:10:96::/108";

impl KubeApi {
    /// Stops the API server (SIGKILL: a crash); etcd keeps running.
    pub fn kill_apiserver(&self) {
        kill(&self.apiserver);
    }

    /// (Re)starts the API server and waits until it is ready.
    pub fn start_apiserver(&self) -> Result<()> {
        let log = self.dir.join("apiserver.log");
        let mut cmd = command_in(self.ns_path().as_deref(), kube_apiserver()?, None, true)?;
        let (bind, advertise) = match self.ns {
            Some(_) => ("0.0.0.0", NS_ADVERTISE),
            None => ("127.0.0.1", "127.0.0.1"),
        };
        let d = |f: &str| self.dir.join(f).display().to_string();
        cmd.arg(format!("--etcd-servers={}", self.etcd_url()))
            .arg(format!("--bind-address={bind}"))
            .arg(format!("--advertise-address={advertise}"))
            .arg(format!("--secure-port={}", self.api_port))
            .arg(format!("--cert-dir={}", d("certs")))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", d("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                d("sa.key")
            ))
            .arg(format!("--token-auth-file={}", d("tokens.csv")))
            .arg("--authorization-mode=Node,RBAC")
            // What kubeadm and every CNI's DaemonSet need: privileged containers.
            .arg("--allow-privileged=true")
            // Dual stack: a Service asks for an IPv6 cluster IP (`ipFamilies`); single-stack IPv4 is
            // every Service's default.
            .arg(format!("--service-cluster-ip-range={SERVICE_RANGES}"))
            // No `kubernetes` Service endpoints (its address may be loopback here).
            .arg("--endpoint-reconciler-type=none")
            .arg(format!("--watch-cache={}", self.watch_cache))
            // Exec, logs and port-forward through the API: the API server dials each kubelet at
            // its Node's InternalIP (it cannot resolve the names) as a client the kubelets trust
            // (their `authentication.x509.clientCAFile`, [`KubeApi::kubelet_client_ca`]).
            .arg("--kubelet-preferred-address-types=InternalIP")
            .arg(format!(
                "--kubelet-client-certificate={}",
                d("kubelet-client.crt")
            ))
            .arg(format!("--kubelet-client-key={}", d("kubelet-client.key")));
        // Appended to across restarts.
        let prior = std::fs::read_to_string(&log).unwrap_or_default();
        let child = spawn_logged(&mut cmd, &log)?;
        let _ = std::fs::write(self.dir.join("apiserver.previous.log"), prior);
        *lock(&self.apiserver) = Some(child);
        self.wait_ready(&log)?;
        self.write_kubeconfig(&self.kubeconfig(), "127.0.0.1", ADMIN_TOKEN)
    }

    /// Starts kube-controller-manager (ServiceAccounts and their tokens, EndpointSlices,
    /// ReplicaSets, DaemonSets, the node lifecycle that lifts the not-ready taint; no node
    /// CIDRs) and kube-scheduler beside the API server, both with the admin's kubeconfig and
    /// no leader election, serving only on 127.0.0.1 of the API server's namespace. Returns
    /// once the controller-manager made the `default` ServiceAccount of `default`.
    pub fn start_controllers(&self) -> Result<()> {
        let kubeconfig = self.kubeconfig();
        let kc = kubeconfig.display().to_string();
        let d = |f: &str| self.dir.join(f).display().to_string();
        let mut kcm = command_in(
            self.ns_path().as_deref(),
            k8s_binary("kube-controller-manager")?,
            None,
            true,
        )?;
        kcm.arg(format!("--kubeconfig={kc}"))
            .arg(format!("--authentication-kubeconfig={kc}"))
            .arg(format!("--authorization-kubeconfig={kc}"))
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--cert-dir={}", d("kcm-certs")))
            .arg(format!(
                "--service-account-private-key-file={}",
                d("sa.key")
            ))
            .arg(format!("--root-ca-file={}", d("ca.crt")))
            .arg("--use-service-account-credentials=false")
            .arg("--allocate-node-cidrs=false")
            // Dual stack: a Service asks for an IPv6 cluster IP (`ipFamilies`); single-stack IPv4 is
            // every Service's default.
            .arg(format!("--service-cluster-ip-range={SERVICE_RANGES}"))
            .arg("--node-monitor-grace-period=20s")
            .arg("--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route");
        let mut sched = command_in(
            self.ns_path().as_deref(),
            k8s_binary("kube-scheduler")?,
            None,
            true,
        )?;
        sched
            .arg(format!("--kubeconfig={kc}"))
            .arg(format!("--authentication-kubeconfig={kc}"))
            .arg(format!("--authorization-kubeconfig={kc}"))
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1");
        {
            let mut children = self.controllers.lock().unwrap_or_else(|p| p.into_inner());
            children.push(spawn_logged(
                &mut kcm,
                &self.dir.join("controller-manager.log"),
            )?);
            children.push(spawn_logged(&mut sched, &self.dir.join("scheduler.log"))?);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let made = self.with_client(|c| async move {
                let api: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                    Api::namespaced(c, "default");
                api.get_opt("default").await.ok().flatten().is_some()
            });
            if made {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "kube-controller-manager (the default ServiceAccount)".into(),
                    exited: None,
                    log: std::fs::read_to_string(self.dir.join("controller-manager.log"))
                        .unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// The `kubernetes` Service's endpoint (the API server runs with
    /// `--endpoint-reconciler-type=none`): an EndpointSlice to the advertised address, so that
    /// in-cluster clients (a DaemonSet's agent, through kube-proxy) reach the API server from
    /// nodes [`KubeApi::wire`]d to it. Needs [`KubeApi::in_namespace`].
    pub fn serve_in_cluster(&self) -> Result<()> {
        self.apply(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "namespace": "default", "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "calix-testbed",
            }},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [NS_ADVERTISE], "conditions": {"ready": true}}],
            "ports": [{"name": "https", "port": NS_API_PORT, "protocol": "TCP"}],
        }))
        .map(|_| ())
    }

    /// Restarts the API server (SIGKILL, then start); etcd and its data stay.
    pub fn restart_apiserver(&self) {
        self.kill_apiserver();
        self.start_apiserver().unwrap_or_else(|e| panic!("{e}"));
    }

    pub fn apiserver_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("apiserver.log")).unwrap_or_default()
    }

    fn ns_path(&self) -> Option<PathBuf> {
        self.ns.as_ref().map(|n| PathBuf::from(n.path()))
    }

    /// The service-account key pair and the token file.
    pub(super) fn write_credentials(&self) -> Result<()> {
        let key = self.dir.join("sa.key");
        checked(
            std::process::Command::new("openssl")
                .args([
                    "ecparam",
                    "-name",
                    "prime256v1",
                    "-genkey",
                    "-noout",
                    "-out",
                ])
                .arg(&key),
        )?;
        checked(
            std::process::Command::new("openssl")
                .args(["ec", "-pubout", "-in"])
                .arg(&key)
                .arg("-out")
                .arg(self.dir.join("sa.pub")),
        )?;
        self.write_kubelet_client()?;
        let tokens = self.dir.join("tokens.csv");
        std::fs::write(
            &tokens,
            format!("{ADMIN_TOKEN},calix-testbed-admin,calix-testbed-admin,\"system:masters\"\n"),
        )
        .map_err(Error::io(format!("write {}", tokens.display())))
    }

    /// The API server's client certificate for the kubelets (`kubelet-client.crt`, the
    /// `system:masters` group), signed by a CA of its own (`kubelet-client-ca.crt`) that the
    /// kubelets are given.
    fn write_kubelet_client(&self) -> Result<()> {
        let d = |f: &str| self.dir.join(f);
        let openssl = |args: &[&str]| {
            let mut cmd = std::process::Command::new("openssl");
            cmd.args(args).current_dir(&self.dir);
            checked(&mut cmd)
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "kubelet-client-ca.key",
            "-out",
            "kubelet-client-ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=calix-testbed-kubelet-client-ca",
        ])?;
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "kubelet-client.key",
            "-out",
            "kubelet-client.csr",
            "-subj",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
        ])?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            "kubelet-client.csr",
            "-CA",
            "kubelet-client-ca.crt",
            "-CAkey",
            "kubelet-client-ca.key",
            "-CAcreateserial",
            "-out",
            "kubelet-client.crt",
            "-days",
            "3650",
        ])?;
        for f in [
            "kubelet-client-ca.crt",
            "kubelet-client.crt",
            "kubelet-client.key",
        ] {
            if !d(f).exists() {
                return Err(Error::Unexpected {
                    what: "openssl".into(),
                    found: format!("no {}", d(f).display()),
                    expected: "the kubelet client credentials".into(),
                });
            }
        }
        Ok(())
    }

    pub(super) fn start_etcd(&self) -> Result<()> {
        let log = self.dir.join("etcd.log");
        let client = self.etcd_url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = command_in(self.ns_path().as_deref(), "etcd", None, true)?;
        cmd.arg("--name=default")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=default={peer}"));
        let child = spawn_logged(&mut cmd, &log)?;
        *lock(&self.etcd) = Some(child);
        Ok(())
    }

    /// Until `/readyz` says `ok` (etcd answering, the API server's own bootstrap done).
    fn wait_ready(&self, log: &Path) -> Result<()> {
        // The serving certificate appears once the server started: its CA goes in the
        // kubeconfigs.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = self.extract_ca().is_ok()
                && self
                    .write_kubeconfig(&self.kubeconfig(), "127.0.0.1", ADMIN_TOKEN)
                    .is_ok()
                && self.with_client(|c| async move {
                    let req = http::Request::get("/readyz")
                        .body(Vec::new())
                        .expect("request");
                    matches!(
                        tokio::time::timeout(Duration::from_secs(2), c.request_text(req)).await,
                        Ok(Ok(body)) if body.trim() == "ok"
                    )
                });
            if ready {
                return Ok(());
            }
            let exited = lock(&self.apiserver)
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "kube-apiserver".into(),
                    exited,
                    log: std::fs::read_to_string(log).unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The CA of the API server's self-made certificate (the second certificate of its
    /// `apiserver.crt`), as `ca.crt`.
    fn extract_ca(&self) -> Result<()> {
        let bundle = self.dir.join("certs").join("apiserver.crt");
        let text = std::fs::read_to_string(&bundle)
            .map_err(Error::io(format!("read {}", bundle.display())))?;
        const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
        let ca = text
            .match_indices(BEGIN)
            .nth(1)
            .map(|(i, _)| &text[i..])
            .ok_or_else(|| Error::Missing {
                field: "the CA certificate".into(),
                value: bundle.display().to_string(),
            })?;
        let path = self.dir.join("ca.crt");
        std::fs::write(&path, ca).map_err(Error::io(format!("write {}", path.display())))
    }

    pub(super) fn write_kubeconfig(&self, path: &Path, host: &str, token: &str) -> Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: calix-test\n  cluster:\n    server: https://{host}:{port}\n    certificate-authority: {ca}\n    tls-server-name: {TLS_NAME}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: calix-test\n  context:\n    cluster: calix-test\n    user: admin\ncurrent-context: calix-test\n",
            port = self.api_port,
            ca = self.dir.join("ca.crt").display(),
        );
        std::fs::write(path, text).map_err(Error::io(format!("write {}", path.display())))
    }
}
