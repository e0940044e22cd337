//! Logging for one plugin invocation: to `log_file_path` (appended) or stderr, at `log_level`
//! (default "warn"; `CALIX_LOG` overrides). Never stdout: that carries the CNI result. Control
//! characters (a newline in a pod name from CNI_ARGS) are escaped: one event, one line.
use std::fs::OpenOptions;
use std::sync::Mutex;

use calix_log::Escaping;

use crate::config::NetConf;

pub fn init(conf: &NetConf) {
    let level = std::env::var("CALIX_LOG")
        .ok()
        .or_else(|| conf.log_level.clone())
        .unwrap_or_else(|| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false);
    let file = conf.log_file_path.as_ref().and_then(|p| {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        OpenOptions::new().create(true).append(true).open(p).ok()
    });
    // try_init: a second call in one process (tests) keeps the first subscriber.
    let _ = match file {
        Some(f) => builder.with_writer(Escaping(Mutex::new(f))).try_init(),
        None => builder.with_writer(Escaping(std::io::stderr)).try_init(),
    };
}
