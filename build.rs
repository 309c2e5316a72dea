//! Build script: compiles csrc/*.cu with nvcc into the static library `cuferry_cuda`, or, when
//! no nvcc is found, compiles csrc/cuferry_absent.c (every CUDA entry point reports
//! "not built") so the crate still builds and runs its host backend.
//!
//! Rules:
//! - nvcc is looked for in this order: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, the
//!   project's PyPI toolkit (`$CUFERRY_TOOLKIT_DIR`, default `<crate>/.toolkit`, filled by
//!   scripts/install-cuda-toolkit.sh), then `nvcc` on `PATH`. The GPU is never probed.
//! - Architectures come from `CUFERRY_CUDA_ARCH` (comma-separated compute capabilities such as
//!   `90` or `90,100`; default `90`; 80 or newer, as the kernels use `cp.async`): SASS for
//!   each plus PTX for the last.
//! - Without nvcc the build prints a cargo warning; with `CUFERRY_REQUIRE_CUDA=1` it fails.
//! - Only OUT_DIR is written. Every file in csrc/ and every variable read is a rerun trigger.
//! - The cfg `cuferry_cuda` is set when the CUDA library was compiled.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const PY_VERSION: &str = "3.11";
const DEFAULT_ARCH: &str = "90";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cuferry_cuda)");
    let Some(manifest_dir) = env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from) else {
        fail("CARGO_MANIFEST_DIR is not set: run the build through cargo");
    };
    let csrc = manifest_dir.join("csrc");
    watch_dir(&csrc);
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUFERRY_TOOLKIT_DIR",
        "CUFERRY_CUDA_ARCH",
        "CUFERRY_REQUIRE_CUDA",
        "PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    match find_nvcc(&manifest_dir) {
        Some(nvcc) => build_cuda(&csrc, &nvcc),
        None => {
            let reason = "nvcc was not found (looked in $NVCC, $CUDA_HOME, $CUDA_PATH, the project \
                          toolkit folder and PATH)";
            if env::var("CUFERRY_REQUIRE_CUDA").as_deref() == Ok("1") {
                fail(&format!(
                    "CUFERRY_REQUIRE_CUDA=1 but {reason}. Run scripts/install-cuda-toolkit.sh, or \
                     set NVCC or CUDA_HOME to an existing CUDA 13 toolkit."
                ));
            }
            println!(
                "cargo:warning=cuferry: building the host backend only: {reason}. Run \
                 scripts/install-cuda-toolkit.sh (which makes the next build look again) or set \
                 NVCC/CUDA_HOME for the CUDA backend; after installing a toolkit another way, run \
                 `cargo clean -p cuferry`."
            );
            build_absent(&csrc, reason);
        }
    }
}

/// Prints every file under `dir` as a rerun trigger, headers included.
fn watch_dir(dir: &Path) {
    println!("cargo:rerun-if-changed={}", dir.display());
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

fn executable(path: PathBuf) -> Option<PathBuf> {
    path.is_file().then_some(path)
}

fn find_nvcc(manifest_dir: &Path) -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC").map(PathBuf::from) {
        if let Some(p) = executable(p.clone()) {
            return Some(p);
        }
        println!("cargo:warning=cuferry: NVCC={} does not exist; looking elsewhere", p.display());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            if let Some(p) = executable(PathBuf::from(home).join("bin/nvcc")) {
                return Some(p);
            }
        }
    }
    let toolkit = env::var_os("CUFERRY_TOOLKIT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir.join(".toolkit"));
    let pypi_home =
        toolkit.join("venv/lib").join(format!("python{PY_VERSION}")).join("site-packages/nvidia/cu13");
    if let Some(p) = executable(pypi_home.join("bin/nvcc")) {
        return Some(p);
    }
    let path = env::var_os("PATH")?;
    env::split_paths(&path).find_map(|dir| executable(dir.join("nvcc")))
}

/// The toolkit root of an nvcc at `<root>/bin/nvcc`.
fn cuda_home_of(nvcc: &Path) -> Option<PathBuf> {
    nvcc.parent()?.parent().map(Path::to_path_buf)
}

fn gencode_flags() -> Vec<String> {
    let spec = env::var("CUFERRY_CUDA_ARCH").unwrap_or_else(|_| DEFAULT_ARCH.to_string());
    let archs: Vec<&str> = spec.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if archs.is_empty() || archs.iter().any(|a| !a.chars().all(|c| c.is_ascii_alphanumeric())) {
        fail(&format!(
            "CUFERRY_CUDA_ARCH={spec:?} is not a comma-separated list of compute capabilities \
             such as \"90\" or \"90,100\""
        ));
    }
    // The halo kernel stages rows with cp.async, which needs compute capability 8.0 (Ampere).
    if let Some(old) = archs.iter().find(|a| a.parse::<u32>().is_ok_and(|n| n < 80)) {
        fail(&format!(
            "CUFERRY_CUDA_ARCH={spec:?} names compute capability {old}; cuferry's kernels need 80 \
             or newer (Ampere, Hopper, Blackwell: cp.async)"
        ));
    }
    let mut flags: Vec<String> =
        archs.iter().map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}")).collect();
    let last = archs[archs.len() - 1];
    flags.push(format!("-gencode=arch=compute_{last},code=compute_{last}"));
    flags
}

fn build_cuda(csrc: &Path, nvcc: &Path) {
    let Some(cuda_home) = cuda_home_of(nvcc) else {
        fail(&format!("cannot tell the toolkit root of nvcc at {}", nvcc.display()));
    };
    // cc finds nvcc through the NVCC variable; passing it with `.compiler()` would make cc hand
    // gcc flags to nvcc.
    // Build scripts run single-threaded, so setting a variable here races nothing.
    env::set_var("NVCC", nvcc);
    let mut sources: Vec<PathBuf> = std::fs::read_dir(csrc)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    sources.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    sources.sort();
    if sources.is_empty() {
        fail("csrc/ holds no .cu file");
    }

    let mut build = cc::Build::new();
    build
        .cuda(true)
        .cudart("static")
        .debug(false)
        .include(csrc)
        .flag("-std=c++17")
        .flag("-Xcompiler=-fPIC")
        .warnings(false);
    for flag in gencode_flags() {
        build.flag(&flag);
    }
    for src in &sources {
        build.file(src);
    }
    if let Err(err) = build.try_compile("cuferry_cuda") {
        fail(&format!(
            "nvcc ({}) failed to compile csrc: {err}\nSet NVCC or CUDA_HOME to another toolkit, \
             or CUFERRY_CUDA_ARCH to other architectures.",
            nvcc.display()
        ));
    }
    // The PyPI toolkit keeps libcudart_static.a in lib/, not targets/x86_64-linux/lib.
    for dir in ["lib", "lib64", "targets/x86_64-linux/lib"] {
        let d = cuda_home.join(dir);
        if d.is_dir() {
            println!("cargo:rustc-link-search=native={}", d.display());
        }
    }
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["rt", "dl", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-cfg=cuferry_cuda");
    let version = nvcc_version(nvcc).unwrap_or_else(|| "unknown version".to_string());
    println!("cargo:rustc-env=CUFERRY_BUILD_CUDA_NOTE=compiled with nvcc {version} ({})", nvcc.display());
}

fn nvcc_version(nvcc: &Path) -> Option<String> {
    let out = Command::new(nvcc).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("release"))?;
    Some(line.split("release").nth(1)?.trim().trim_start_matches(' ').to_string())
}

fn build_absent(csrc: &Path, reason: &str) {
    let mut build = cc::Build::new();
    build.file(csrc.join("cuferry_absent.c")).include(csrc);
    if let Err(err) = build.try_compile("cuferry_cuda") {
        fail(&format!("the C compiler failed on csrc/cuferry_absent.c: {err}"));
    }
    println!("cargo:rustc-env=CUFERRY_BUILD_CUDA_NOTE=built without CUDA: {reason}");
}

/// Stops the build with a message cargo shows in full.
fn fail(message: &str) -> ! {
    eprintln!("error: cuferry build: {message}");
    for line in message.lines() {
        println!("cargo:warning={line}");
    }
    std::process::exit(1);
}
