//! Helpers shared by the integration tests.
//!
//! GPU gating (the project's rule, README "Set up on a fresh machine"): a test that needs a
//! CUDA device prints `SKIP: no CUDA device` and returns when none is present; with
//! `CUFERRY_REQUIRE_GPU=1` it fails instead.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use cuferry::Device;

pub mod stress;

/// The folder of an up-to-date libcuferry.so: `$CUFERRY_CDYLIB_DIR` (the GPU bundle), else
/// built here by `cargo build --lib` in its own target dir (`cdylib/` under `$CARGO_TARGET_DIR`
/// when set, else under `target/`): `cargo test` builds the library only as an rlib, and a
/// nested build into the tests' own target dir could replace artifacts that later test steps
/// (doctests) link against.
pub fn cdylib_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CUFERRY_CDYLIB_DIR") {
        return PathBuf::from(dir);
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|dir| manifest.join(dir).join("cdylib"))
        .unwrap_or_else(|| manifest.join("target/cdylib"));
    let status = Command::new(env!("CARGO"))
        .args(["build", "--lib", "--quiet", "--manifest-path"])
        .arg(manifest.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("run cargo build --lib");
    assert!(status.success(), "cargo build --lib failed ({status})");
    target.join("debug")
}

/// The folder holding include/ and tests/ (`$CUFERRY_C_SOURCES` in the GPU bundle).
pub fn c_sources() -> PathBuf {
    std::env::var_os("CUFERRY_C_SOURCES")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The first CUDA device, or `None` after printing SKIP (panics under CUFERRY_REQUIRE_GPU=1).
pub fn cuda_device() -> Option<Device> {
    if Device::cuda_count() > 0 {
        return Some(Device::Cuda(0));
    }
    if gpu_required() {
        panic!("CUFERRY_REQUIRE_GPU=1 but no CUDA device is usable: {:?}", Device::try_cuda_count());
    }
    println!("SKIP: no CUDA device");
    None
}

/// Whether the run requires a GPU (`CUFERRY_REQUIRE_GPU=1`: the GPU bundle on the GPU machine).
pub fn gpu_required() -> bool {
    std::env::var("CUFERRY_REQUIRE_GPU").as_deref() == Ok("1")
}

/// A test cannot run because `what` is missing (a device capability, a tool): prints SKIP, or
/// panics under `CUFERRY_REQUIRE_GPU=1`, where the GPU machine (an H100 with the bundle's
/// tools) has everything the tests need, so a skip there would hide lost coverage.
pub fn skip_missing(what: &str) {
    if gpu_required() {
        panic!("CUFERRY_REQUIRE_GPU=1 but {what}");
    }
    println!("SKIP: {what}");
}

/// Two distinct CUDA devices, or `None` after printing SKIP (never fails: one-GPU machines are
/// a normal configuration).
pub fn two_cuda_devices() -> Option<(Device, Device)> {
    if Device::cuda_count() >= 2 {
        return Some((Device::Cuda(0), Device::Cuda(1)));
    }
    println!("SKIP: fewer than two CUDA devices");
    None
}

/// A C ABI halo exchange of eight `f32` in one dim: pack elements 0..2, unpack into 6..8.
pub fn exchange_1d() -> cuferry::ffi::CuferryHaloExchange {
    let zeros = [0usize; cuferry::ffi::CUFERRY_HALO_MAX_DIMS];
    let mut e = cuferry::ffi::CuferryHaloExchange {
        element_size: 4,
        ndim: 1,
        shape: zeros,
        strides: zeros,
        x_dim: -1,
        y_dim: -1,
        pack_start: zeros,
        pack_end: zeros,
        rotation: 0,
        unpack_start: zeros,
        unpack_end: zeros,
    };
    e.shape[0] = 8;
    e.pack_end[0] = 2;
    e.unpack_start[0] = 6;
    e.unpack_end[0] = 8;
    e
}

/// A small deterministic generator (xorshift64*) so failures reproduce without extra crates.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Defines `host_<name>` and `cuda_<name>` tests that run `body(device)` on each backend.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident => $body:ident;)*) => {
        mod host_backend {
            $(#[test] fn $name() { super::$body(cuferry::Device::Host); })*
        }
        mod cuda_backend {
            $(#[test] fn $name() {
                if let Some(device) = $crate::common::cuda_device() { super::$body(device); }
            })*
        }
    };
}

/// Sets a CUDA device's L2 fetch granularity for the life of the guard and puts the old value
/// back on drop, panics included (the setting is process-wide, and other tests of the binary
/// run on other threads).
pub struct L2FetchSetting {
    device: Device,
    old: usize,
    /// The value read back after the request.
    pub applied: usize,
}

impl L2FetchSetting {
    /// Asks for `bytes`; `None` (after printing why) where the device refuses the limit.
    pub fn set(device: Device, bytes: usize) -> Option<L2FetchSetting> {
        let old = device.l2_fetch_granularity().expect("reading the L2 fetch granularity");
        match device.set_l2_fetch_granularity(bytes) {
            Ok(applied) => Some(L2FetchSetting { device, old, applied }),
            Err(e) => {
                println!("the device refused an L2 fetch granularity of {bytes} bytes: {e}");
                None
            }
        }
    }
}

impl Drop for L2FetchSetting {
    fn drop(&mut self) {
        if let Err(e) = self.device.set_l2_fetch_granularity(self.old) {
            eprintln!("could not restore the L2 fetch granularity of {}: {e}", self.device);
        }
    }
}

/// A host function that holds a stream until the test lets it through: work queued later on
/// the stream waits behind it. It opens on [`Gate::open`], when dropped, or after 10 s at
/// most (so a failing test does not hang); [`Gate::passed`] turns true once it has run.
pub struct Gate {
    open: std::sync::mpsc::Sender<()>,
    passed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Gate {
    /// Queues the gate on `stream`.
    pub fn hold(stream: &cuferry::Stream) -> Self {
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let passed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&passed);
        stream
            .host_fn(move || {
                let _ = gate.recv_timeout(std::time::Duration::from_secs(10));
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            })
            .expect("queue the gate");
        Gate { open, passed }
    }

    /// Lets the stream through.
    pub fn open(&self) {
        let _ = self.open.send(());
    }

    /// Lets the stream through from another thread after `delay`, for a test that blocks on
    /// the held work meanwhile (a drop or an accessor that must wait for it); join the handle.
    pub fn open_after(&self, delay: std::time::Duration) -> std::thread::JoinHandle<()> {
        let open = self.open.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            let _ = open.send(());
        })
    }

    /// Whether the gate's job has run (the stream went past it).
    pub fn passed(&self) -> bool {
        self.passed.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Polls `done` every millisecond for up to 10 s; false if it never held (for a test to
/// wait for another thread to reach a state it can observe, instead of sleeping).
pub fn wait_until(mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}
