//! `calix`: the CNI plugin binary. Results and errors go to stdout as the CNI spec says; logs go
//! to stderr or to `log_file_path`, never to stdout.
use std::io::Write;

use calix_cni::args::ProcessEnv;
use calix_cni::error::{code, CniError};

fn main() {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let err = CniError::new(
                code::IO_FAILURE,
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
