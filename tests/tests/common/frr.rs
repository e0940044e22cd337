//! FRR as a test's router: zebra (the namespace's kernel routes) and bgpd, started in a
//! namespace with a given bgpd configuration, asked through vtysh, killed (kill -9) and
//! started again. Needs `frr` (cargo xtask setup); the host's FRR service is not used.
//!
//! Everything of theirs lives in a directory of its own: configuration, pid files, logs, the
//! vty sockets (for `vtysh --vty_socket`) and the zebra API socket, so they never meet the
//! host's FRR. bgpd runs as root (`-S`); zebra has no such option and will not run as a root
//! outside the `frrvty` group, so it is started by root and drops to the `frr` user with the
//! capabilities it needs, as the packaged service does: the directory is group `frr`'s.
//! Both are children of the test, killed on drop.
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use calix_testbed::{unique, wait_for, Guarded, Netns};
use serde_json::Value;

const DAEMONS: &str = "/usr/lib/frr";

pub struct Frr {
    bgpd: Option<Guarded>,
    zebra: Option<Guarded>,
    dir: PathBuf,
    ns: String,
}

impl Frr {
    /// zebra and bgpd in `ns`, bgpd with `conf`, until both answer vtysh.
    pub fn start(ns: &Netns, conf: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("frr"));
        std::fs::create_dir_all(&dir).expect("frr's directory");
        std::fs::write(dir.join("bgpd.conf"), conf).expect("bgpd.conf");
        std::fs::write(dir.join("zebra.conf"), "hostname router\n").expect("zebra.conf");
        std::os::unix::fs::chown(&dir, None, Some(frr_gid())).expect("frr's directory to frr");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770))
            .expect("frr's directory mode");
        wait_link_local(ns);
        let mut f = Self {
            bgpd: None,
            zebra: None,
            dir,
            ns: ns.name.clone(),
        };
        f.run();
        f
    }

    fn daemon(&self, name: &str, extra: &[&str]) -> Guarded {
        for file in [format!("{name}.vty"), format!("{name}.pid")] {
            let _ = std::fs::remove_file(self.dir.join(file));
        }
        let path = |file: &str| self.dir.join(file).display().to_string();
        let mut cmd = Netns::borrowed(&self.ns)
            .daemon(format!("{DAEMONS}/{name}"), None)
            .expect("frr in the router's namespace");
        cmd.args(extra)
            .args(["-f", &path(&format!("{name}.conf"))])
            .args(["-i", &path(&format!("{name}.pid"))])
            .args(["-z", &path("zserv.api")])
            .args(["--vty_socket", &path("")])
            // No vty on TCP.
            .args(["-P", "0"])
            .args(["--log", &format!("file:{}", path(&format!("{name}.log")))])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // What it says before its log is open (and a few notes after) to a file of its own.
        let err = std::fs::File::create(self.dir.join(format!("{name}.err"))).expect("stderr file");
        cmd.stderr(err);
        Guarded(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("{name} runs (cargo xtask setup installs frr): {e}")),
        )
    }

    fn run(&mut self) {
        let _ = std::fs::remove_file(self.dir.join("zserv.api"));
        self.zebra = Some(self.daemon("zebra", &["-u", "frr", "-g", "frr"]));
        let api = self.dir.join("zserv.api");
        wait_for(
            "zebra's API socket",
            Duration::from_secs(10),
            || api.exists().then_some(()),
            || self.log("zebra"),
        );
        self.bgpd = Some(self.daemon("bgpd", &["-S"]));
        wait_for(
            "bgpd answers vtysh",
            Duration::from_secs(10),
            || {
                self.vtysh("show bgp summary")
                    .contains("local AS number")
                    .then_some(())
            },
            || self.log("bgpd"),
        );
    }

    /// kill -9 of both, as a crash (zebra leaves its routes in the kernel; the next one
    /// sweeps them).
    pub fn kill(&mut self) {
        self.bgpd = None;
        self.zebra = None;
    }

    /// Started again after [`Frr::kill`].
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }

    /// `vtysh -c cmd` against these daemons.
    pub fn vtysh(&self, cmd: &str) -> String {
        let out = Command::new("vtysh")
            .arg("--vty_socket")
            .arg(&self.dir)
            .args(["-c", cmd])
            .output()
            .expect("vtysh");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A daemon's (`zebra`, `bgpd`) standard error and log.
    pub fn log(&self, daemon: &str) -> String {
        let read = |ext: &str| {
            std::fs::read_to_string(self.dir.join(format!("{daemon}.{ext}"))).unwrap_or_default()
        };
        read("err") + &read("log")
    }

    fn afi(prefix: &str) -> &'static str {
        if prefix.contains(':') {
            "ipv6"
        } else {
            "ipv4"
        }
    }

    /// bgpd's table entry for `prefix` (empty when it has none): its paths, each with its
    /// AS path (`64602`, no `AS`), next hop, and `stale` while graceful restart keeps it.
    pub fn route(&self, prefix: &str) -> String {
        let out = self.vtysh(&format!("show bgp {} unicast {prefix}", Self::afi(prefix)));
        if out.contains("Network not in table") || !out.contains("Paths:") {
            String::new()
        } else {
            out
        }
    }

    /// Whether its session with a neighbor whose address starts with `prefix` is Established.
    pub fn established_with(&self, prefix: &str) -> bool {
        let Ok(v) = serde_json::from_str::<Value>(&self.vtysh("show bgp summary json")) else {
            return false;
        };
        v.as_object().is_some_and(|afs| {
            afs.values().any(|af| {
                af["peers"].as_object().is_some_and(|peers| {
                    peers
                        .iter()
                        .any(|(a, p)| a.starts_with(prefix) && p["state"] == "Established")
                })
            })
        })
    }

    /// Whether a path of bgpd's for `prefix` carries `community` ("asn:value").
    pub fn has_community(&self, prefix: &str, community: &str) -> bool {
        let out = self.vtysh(&format!(
            "show bgp {} unicast {prefix} json",
            Self::afi(prefix)
        ));
        let Ok(v) = serde_json::from_str::<Value>(&out) else {
            return false;
        };
        v["paths"].as_array().is_some_and(|paths| {
            paths.iter().any(|p| {
                p["community"]["string"]
                    .as_str()
                    .is_some_and(|s| s.split_whitespace().any(|c| c == community))
            })
        })
    }

    /// Whether bgpd has a path for `prefix` that `asn` originated (the last AS of its path),
    /// stale or not.
    pub fn has_route_from(&self, prefix: &str, asn: u32) -> bool {
        let out = self.vtysh(&format!(
            "show bgp {} unicast {prefix} json",
            Self::afi(prefix)
        ));
        let Ok(v) = serde_json::from_str::<Value>(&out) else {
            return false;
        };
        v["paths"].as_array().is_some_and(|paths| {
            paths.iter().any(|p| {
                p["aspath"]["string"]
                    .as_str()
                    .and_then(|s| s.split_whitespace().last())
                    .is_some_and(|last| last == asn.to_string())
            })
        })
    }
}

/// bgpd resets an IPv6 session whose interface has no link-local address yet (no link-local
/// next hop to give, RFC 2545; notification 5/0): waits until every interface of `ns` with a
/// global IPv6 address has a link-local one past duplicate address detection. (A bridge
/// gets its link-local address only when its first port comes up.)
fn wait_link_local(ns: &Netns) {
    let missing = || {
        let out = ns.exec(&["ip", "-6", "-o", "addr", "show"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let interfaces = |scope: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.contains(scope) && !l.contains("tentative"))
                .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
                .collect()
        };
        let ready = interfaces("scope link");
        let missing: Vec<String> = interfaces("scope global")
            .into_iter()
            .filter(|i| !ready.contains(i))
            .collect();
        (missing, text)
    };
    wait_for(
        "link-local addresses on the router's interfaces",
        Duration::from_secs(10),
        || missing().0.is_empty().then_some(()),
        || missing().1,
    );
}

/// The `frr` group's id.
fn frr_gid() -> u32 {
    let out = Command::new("id")
        .args(["-g", "frr"])
        .output()
        .expect("id -g frr");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a user `frr` (cargo xtask setup installs frr)")
}

impl Drop for Frr {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "FRR's configuration and logs kept in {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
