//! `calix`: the CNI plugin binary. Results and errors go to stdout as the CNI spec says; logs go
//! to stderr or to `log_file_path`, never to stdout.
use std::io::Write;

use calix_cni::args::ProcessEnv;

fn init_logging() {
    // The level and file come from the network config, which we haven't read yet; peek at
    // the environment override only. The config's log settings apply from the lib.
    let filter = std::env::var("CALIX_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

fn main() {
    init_logging();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let err = calix_cni::error::CniError::new(
                calix_cni::error::code::IO_FAILURE,
                format!("cannot start the runtime: {e}"),
                "",
            );
            println!("{}", err.to_json());
            std::process::exit(1);
        }
    };
    let outcome = rt.block_on(calix_cni::run(&ProcessEnv, &mut std::io::stdin()));
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(outcome.stdout.as_bytes());
    let _ = out.flush();
    drop(out);
    std::process::exit(outcome.exit_code);
}
