//! cuferry's C ABI from Python via ctypes, on the host backend and, when present, on CUDA:
//! a buffer round trip (tests/python/ctypes_roundtrip.py), batches streamed through the slot
//! ring by a producer thread (tests/python/ring_ctypes.py), and halo packing and managed memory
//! (tests/python/halo_managed_ctypes.py). SKIP without python3.

mod common;

use std::process::Command;

/// Runs `script` on `device`; its output must contain `passed`, and on a CUDA device under
/// `CUFERRY_REQUIRE_GPU=1` no `SKIP:` line (a script that could not read device memory back,
/// for want of CuPy, would otherwise pass without checking a byte).
fn run(script: &str, device: i32, passed: &str) {
    let lib = common::cdylib_dir().join("libcuferry.so");
    let script = common::c_sources().join("tests/python").join(script);
    if !lib.exists() || !script.exists() {
        common::skip_missing(&format!("{} or {} is missing", lib.display(), script.display()));
        return;
    }
    let out = match Command::new("python3").arg(&script).arg(&lib).arg(device.to_string()).output() {
        Ok(o) => o,
        Err(e) => {
            common::skip_missing(&format!("no python3 ({e})"));
            return;
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains(passed),
        "{} on device {device}:\n{text}",
        script.display()
    );
    println!("{text}");
    assert!(
        device < 0 || !common::gpu_required() || !text.contains("SKIP:"),
        "{} on device {device} skipped checks under CUFERRY_REQUIRE_GPU=1:\n{text}",
        script.display()
    );
}

#[test]
fn python_ctypes_on_host() {
    run("ctypes_roundtrip.py", -1, "round trip passed");
}

#[test]
fn python_ctypes_on_cuda() {
    if common::cuda_device().is_some() {
        run("ctypes_roundtrip.py", 0, "round trip passed");
    }
}

#[test]
fn python_ring_on_host() {
    run("ring_ctypes.py", -1, "python ring passed");
}

#[test]
fn python_ring_on_cuda() {
    if common::cuda_device().is_some() {
        run("ring_ctypes.py", 0, "python ring passed");
    }
}

#[test]
fn python_halo_and_managed_on_host() {
    run("halo_managed_ctypes.py", -1, "python halo and managed passed");
}

#[test]
fn python_halo_and_managed_on_cuda() {
    if common::cuda_device().is_some() {
        run("halo_managed_ctypes.py", 0, "python halo and managed passed");
    }
}
