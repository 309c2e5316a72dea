//! The allocation cache under concurrent use, through the public linop API, on the host
//! backend and (with a GPU) on CUDA: threads run chains of operators whose intermediates are
//! dropped with their work still queued (so their memory waits in the reaper and is
//! reclaimed, or cached, and reused by the next allocations), keep several results
//! outstanding, and read every result back against a scalar loop, while another thread keeps
//! releasing the cache. Memory handed to two owners at once, or reused while a queued kernel
//! still reads or writes it, shows as a wrong value (and, under compute-sanitizer memcheck in
//! the GPU bundle, as an access to freed memory).

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{cuda_device, two_cuda_devices, Rng};
use cuferry::linop::{Array, Chain, Dims, LinopRef, Scalar};
use cuferry::memory::{cache_stats, release_cached_memory};
use cuferry::{Device, DeviceSpec, Stream};

/// Elements per array: one size class for every thread.
const LEN: usize = 3000;

/// Results each thread keeps unread at once.
const OUTSTANDING: usize = 4;

/// `x` scaled by 2, 3 and -0.5 in a chain (two intermediates dropped inside `apply`).
fn chain(dims: &Dims) -> LinopRef<f64> {
    let ops: Vec<LinopRef<f64>> = [2.0, 3.0, -0.5]
        .into_iter()
        .map(|alpha| Arc::new(Scalar::new(alpha, dims.clone())) as LinopRef<f64>)
        .collect();
    Arc::new(Chain::new(ops).unwrap())
}

/// `threads` threads, each on its own compute stream of `device`, run `rounds` applies of a
/// chain and check every result; another thread releases the cache every 300 us meanwhile.
fn concurrent_chains_read_back_exactly(device: Device, threads: u64, rounds: usize) {
    let dims = Dims::new(&[("x", LEN)]).unwrap();
    let op = chain(&dims);
    let before = cache_stats();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                release_cached_memory();
                std::thread::sleep(Duration::from_micros(300));
            }
        });
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let op = Arc::clone(&op);
                scope.spawn(move || {
                    let spec = DeviceSpec::with_streams(device, Stream::new(device).unwrap(), None).unwrap();
                    let mut rng = Rng::new(0x5eed + t);
                    let mut unread: VecDeque<(usize, Vec<f64>, Array<f64>)> = VecDeque::new();
                    for round in 0..rounds {
                        let data: Vec<f64> = (0..LEN).map(|_| (rng.next_u64() % 1000) as f64).collect();
                        let x = Array::from_slice(&spec, &[LEN], &data).unwrap();
                        let y = op.apply(&x).unwrap();
                        drop(x); // its scaling is likely still queued
                        unread.push_back((round, data, y));
                        // Every fifth result is dropped unread (its memory deferred, then reused).
                        if round % 5 == 4 {
                            unread.pop_back();
                        }
                        if unread.len() > OUTSTANDING {
                            let (k, data, y) = unread.pop_front().unwrap();
                            check(t, k, &data, &y);
                        }
                    }
                    for (k, data, y) in unread {
                        check(t, k, &data, &y);
                    }
                })
            })
            .collect();
        let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        stop.store(true, Ordering::Relaxed);
        for r in results {
            if let Err(panic) = r {
                std::panic::resume_unwind(panic);
            }
        }
    });
    let after = cache_stats();
    let (reused, allocated) = (after.reused - before.reused, after.allocated - before.allocated);
    println!(
        "{device:?}: reused {reused} (reclaimed {}), allocated {allocated}",
        after.reclaimed - before.reclaimed
    );
    assert!(reused > 0, "{device:?}: no allocation reused cached memory ({allocated} made fresh)");
}

/// Asserts that `y` is the chain applied to `data` (exact: every product is representable).
fn check(thread: u64, round: usize, data: &[f64], y: &Array<f64>) {
    let got = y.to_vec().unwrap();
    assert_eq!(got.len(), data.len());
    for (i, (&g, &x)) in got.iter().zip(data).enumerate() {
        let want = x * 2.0 * 3.0 * -0.5;
        assert_eq!(g, want, "thread {thread} round {round} element {i}: {g} != {want}");
    }
}

#[test]
fn concurrent_chains_reusing_memory_read_back_exactly_on_the_host() {
    concurrent_chains_read_back_exactly(Device::Host, 4, 150);
}

#[test]
fn concurrent_chains_reusing_memory_read_back_exactly_on_cuda() {
    let Some(device) = cuda_device() else { return };
    concurrent_chains_read_back_exactly(device, 4, 400);
}

/// Memory reused on one GPU right after work on another: the reused array's zeroing is queued
/// while the thread last made the other GPU current (CUDA promises copies on a non-current
/// device's stream, not memsets), and must still succeed and read back zero. Needs two GPUs.
#[test]
fn cached_zeros_on_one_gpu_after_work_on_another() {
    let Some((a, b)) = two_cuda_devices() else { return };
    let (on_a, on_b) = (DeviceSpec::new(a).unwrap(), DeviceSpec::new(b).unwrap());
    let dims = Dims::new(&[("x", LEN)]).unwrap();
    let op = chain(&dims);
    let ones = vec![1.0f64; LEN];
    for round in 0..20 {
        // Filled, then dropped idle: cached for the next zeros on `a`.
        let filled = Array::from_slice(&on_a, &[LEN], &ones).unwrap();
        filled.synchronize().unwrap();
        drop(filled);
        // A kernel on `b` leaves `b` current on this thread.
        let y = op.apply(&Array::from_slice(&on_b, &[LEN], &ones).unwrap()).unwrap();
        let zeros = Array::<f64>::zeros(&on_a, &[LEN]).unwrap();
        assert!(zeros.to_vec().unwrap().iter().all(|&v| v == 0.0), "round {round}: reused memory not zeroed");
        assert!(y.to_vec().unwrap().iter().all(|&v| v == -3.0), "round {round}: the chain on the other GPU");
    }
}
