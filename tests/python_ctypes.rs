//! cuferry's C ABI from Python via ctypes (tests/python/ctypes_roundtrip.py), on the host
//! backend and, when present, on CUDA. SKIP without python3.

mod common;

use std::process::Command;

fn run(device: i32) {
    let lib = common::cdylib_dir().join("libcuferry.so");
    let script = common::c_sources().join("tests/python/ctypes_roundtrip.py");
    if !lib.exists() || !script.exists() {
        println!("SKIP: {} or {} missing", lib.display(), script.display());
        return;
    }
    let out = match Command::new("python3").arg(&script).arg(&lib).arg(device.to_string()).output() {
        Ok(o) => o,
        Err(e) => {
            println!("SKIP: no python3 ({e})");
            return;
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("round trip passed"), "python on device {device}:\n{text}");
}

#[test]
fn python_ctypes_on_host() {
    run(-1);
}

#[test]
fn python_ctypes_on_cuda() {
    if common::cuda_device().is_some() {
        run(0);
    }
}
