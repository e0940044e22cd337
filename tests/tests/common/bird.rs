//! BIRD 2 as a test's router: started in a namespace with a given configuration, asked
//! through birdc, killed (kill -9) and started again. Needs `bird` (cargo xtask setup).
use std::path::PathBuf;
use std::time::Duration;

use calix_testbed::{unique, wait_for, Guarded, Netns};

pub struct Bird {
    daemon: Option<Guarded>,
    dir: PathBuf,
    ns: String,
}

impl Bird {
    /// BIRD in `ns` with `conf`, until its control socket answers.
    pub fn start(ns: &Netns, conf: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("bird"));
        std::fs::create_dir_all(&dir).expect("bird's directory");
        std::fs::write(dir.join("bird.conf"), conf).expect("bird.conf");
        let mut b = Self {
            daemon: None,
            dir,
            ns: ns.name.clone(),
        };
        b.run();
        b
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("bird.ctl")
    }

    fn run(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        let mut cmd = Netns::borrowed(&self.ns)
            .daemon("bird", None)
            .expect("bird in the router's namespace");
        cmd.args(["-f", "-c"])
            .arg(self.dir.join("bird.conf"))
            .arg("-s")
            .arg(self.socket());
        let child = cmd
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("bird runs (cargo xtask setup installs bird2)");
        self.daemon = Some(Guarded(child));
        let sock = self.socket();
        wait_for(
            "bird's control socket",
            Duration::from_secs(10),
            || (sock.exists() && !self.birdc("show status").is_empty()).then_some(()),
            String::new,
        );
    }

    /// kill -9, as a crash.
    pub fn kill(&mut self) {
        self.daemon = None;
    }

    /// Started again after [`Bird::kill`].
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }

    pub fn birdc(&self, cmd: &str) -> String {
        let out = std::process::Command::new("birdc")
            .arg("-s")
            .arg(self.socket())
            .args(cmd.split(' '))
            .output()
            .expect("birdc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `show route` of `prefix` (empty when BIRD has none).
    pub fn route(&self, prefix: &str) -> String {
        let out = self.birdc(&format!("show route {prefix} all"));
        if out.contains("Network not found") {
            String::new()
        } else {
            out
        }
    }

    /// Whether BIRD's route for `prefix` carries `community` ("asn:value"; BIRD shows it
    /// as `BGP.community: (asn,value)`).
    pub fn has_community(&self, prefix: &str, community: &str) -> bool {
        let shown = format!("({})", community.replace(':', ","));
        self.route(prefix).lines().any(|l| {
            l.trim()
                .strip_prefix("BGP.community:")
                .is_some_and(|c| c.split_whitespace().any(|c| c == shown))
        })
    }

    /// Whether BIRD has a route for `prefix` that `asn` originated (the last AS of its
    /// `BGP.as_path`), stale or not.
    pub fn has_route_from(&self, prefix: &str, asn: u32) -> bool {
        self.route(prefix).lines().any(|l| {
            l.trim()
                .strip_prefix("BGP.as_path:")
                .and_then(|p| p.split_whitespace().last())
                .is_some_and(|last| last == asn.to_string())
        })
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        self.daemon = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
