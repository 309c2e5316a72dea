//! The C ABI from C: compiles tests/c/consumer.c with the system C compiler against
//! include/cuferry.h and the cdylib, runs it on the host backend and (when present) on CUDA.
//! `CUFERRY_CDYLIB_DIR` and `CUFERRY_C_SOURCES` point it at the GPU bundle's copies.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// Builds the consumer into a file of its own for `tag` (tests run in parallel: one shared
/// path would be rewritten while another test executes it); `None` (with SKIP) without a C
/// compiler or sources.
fn build_consumer(tag: &str) -> Option<PathBuf> {
    let (lib, src) = (common::cdylib_dir(), common::c_sources());
    let program = src.join("tests/c/consumer.c");
    if !program.exists() || !lib.join("libcuferry.so").exists() {
        common::skip_missing(&format!(
            "{} or {} is missing",
            program.display(),
            lib.join("libcuferry.so").display()
        ));
        return None;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::env::temp_dir().join(format!("cuferry-c-consumer-{}-{tag}", std::process::id()));
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(src.join("include"))
        .arg(&program)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lcuferry")
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        Ok(s) => panic!("{cc} failed to build the C consumer ({s})"),
        Err(e) => {
            common::skip_missing(&format!("no C compiler ({cc}: {e})"));
            None
        }
    }
}

fn run_consumer(device: i32) {
    let Some(exe) = build_consumer(&device.to_string()) else { return };
    // The rpath is a RUNPATH, which LD_LIBRARY_PATH overrides, and `cargo test` puts
    // target/debug there, where a stale libcuferry.so from an earlier `cargo build` may lie:
    // put the fresh one first.
    let lib = common::cdylib_dir();
    let search = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(rest) => std::env::join_paths(std::iter::once(lib).chain(std::env::split_paths(&rest))),
        None => Ok(lib.into_os_string()),
    }
    .expect("a library path");
    let out = Command::new(&exe)
        .arg(device.to_string())
        .env("LD_LIBRARY_PATH", search)
        .output()
        .expect("run the C consumer");
    let _ = std::fs::remove_file(&exe);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "C consumer on device {device} failed:\n{text}");
    assert!(text.contains("all C ABI checks passed"), "{text}");
}

#[test]
fn c_consumer_on_host() {
    run_consumer(-1);
}

#[test]
fn c_consumer_on_cuda() {
    if common::cuda_device().is_some() {
        run_consumer(0);
    }
}
