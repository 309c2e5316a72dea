//! Writes src/sys/bindings.rs from csrc/cuferry_cuda.h. Usage: cuferry-gen-bindings REPO_ROOT.
//! A separate crate so that it builds even while the main crate's bindings are stale.

mod config;

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    let header = root.join("csrc/cuferry_cuda.h");
    match config::generate(&header.to_string_lossy()) {
        Ok(text) => match std::fs::write(root.join("src/sys/bindings.rs"), text) {
            Ok(()) => {
                println!("wrote {}", root.join("src/sys/bindings.rs").display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cannot write the bindings: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("bindgen failed on {}: {e}", header.display());
            ExitCode::FAILURE
        }
    }
}
