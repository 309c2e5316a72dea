//! cuferry with PyTorch: its managed pool as PyTorch's pluggable allocator
//! (tests/python/torch_allocator.py), and PyTorch tensors wrapped for cuferry's copies,
//! ordered with PyTorch's streams without host waits (tests/python/torch_interop.py). Runs
//! where python3 has torch with CUDA (the GPU machine); prints SKIP elsewhere, and fails under
//! CUFERRY_REQUIRE_GPU=1 when python3 or torch is missing or torch sees no device.

mod common;

use std::process::Command;

#[test]
fn torch_mem_pool_on_cuferry_allocator() {
    run_torch_script("torch_allocator.py", "torch allocator passed");
}

#[test]
fn torch_tensors_wrapped_and_ordered_with_torch_streams() {
    run_torch_script("torch_interop.py", "torch interop passed");
}

/// Runs `script` with the cdylib; its output must contain `passed` unless torch is missing.
fn run_torch_script(script: &str, passed: &str) {
    let Some(_) = common::cuda_device() else { return };
    let lib = common::cdylib_dir().join("libcuferry.so");
    let script = common::c_sources().join("tests/python").join(script);
    let out = match Command::new("python3").arg(&script).arg(&lib).output() {
        Ok(o) => o,
        Err(e) => {
            common::skip_missing(&format!("no python3 ({e})"));
            return;
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    if text.contains("SKIP: torch is not installed") {
        common::skip_missing(&format!("torch is not installed: {text}"));
        return;
    }
    assert!(text.contains(passed), "{text}");
}
