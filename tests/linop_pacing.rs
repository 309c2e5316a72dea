//! A loop of composite `apply`s without read-backs is paced by its work: with the stream
//! held, the host runs a bounded number of iterations ahead (the frees it defers are capped),
//! then waits; once the stream goes on, every result is right. With the caps reached, an
//! array dropped inside a host stream's job is still handed over (waiting there would be for
//! work queued behind the job).
//!
//! Its own test binary: the cap is process-wide, and a test filling it would make the drops
//! of other tests running beside it wait.

#[path = "linop_common/mod.rs"]
mod util;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use cuferry::linop::{Array, Chain, Dims, Linop, LinopRef, Scalar};
use cuferry::{Device, DeviceSpec};
use util::Gate;

/// Far more iterations than the cap (1024 pending frees, two per iteration) lets run ahead.
const ITERATIONS: usize = 4096;

#[test]
fn a_loop_of_applies_without_read_backs_is_paced_by_its_work() {
    let spec = DeviceSpec::new(Device::Host).unwrap();
    let d = Dims::new(&[("x", 4)]).unwrap();
    let chain: LinopRef<f64> = Arc::new(
        Chain::new(vec![Arc::new(Scalar::new(2.0, d.clone())), Arc::new(Scalar::new(3.0, d))]).unwrap(),
    );
    let x = Array::from_slice(&spec, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    x.synchronize().unwrap();
    let gate = Gate::hold(&spec.compute_stream);
    let done = Arc::new(AtomicUsize::new(0));
    let worker = {
        let done = Arc::clone(&done);
        thread::spawn(move || {
            for _ in 0..ITERATIONS {
                // Dropped at once: the chain's intermediate and its output are deferred frees.
                drop(chain.apply(&x).unwrap());
                done.fetch_add(1, Ordering::SeqCst);
            }
            chain.apply(&x).unwrap()
        })
    };
    // Until the loop makes no progress for 100 ms, or ends.
    let mut last = usize::MAX;
    for _ in 0..50 {
        thread::sleep(Duration::from_millis(100));
        let now = done.load(Ordering::SeqCst);
        if now == last || now == ITERATIONS {
            break;
        }
        last = now;
    }
    let ahead = done.load(Ordering::SeqCst);
    assert!(!gate.passed(), "the gate opened before the test let it (10 s timeout)");
    assert!(ahead < ITERATIONS, "the loop ran {ahead} iterations ahead of held work");
    gate.open();
    let y = worker.join().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![6.0, 12.0, 18.0, 24.0]);
    println!("the loop ran {ahead} iterations ahead of its held work");
}

/// Fills the process's deferred frees up to their cap from another thread (drops of outputs
/// whose computation waits behind a gate); returns once that thread stalls, with the gate.
fn fill_deferred_frees() -> (Gate, thread::JoinHandle<()>) {
    let held = DeviceSpec::new(Device::Host).unwrap();
    let twice = Scalar::new(2.0, Dims::new(&[("x", 4)]).unwrap());
    let x = Array::from_slice(&held, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    x.synchronize().unwrap();
    let gate = Gate::hold(&held.compute_stream);
    let dropped = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&dropped);
    let filler = thread::spawn(move || {
        for _ in 0..2 * ITERATIONS {
            drop(twice.apply(&x).unwrap());
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    let mut last = usize::MAX;
    for _ in 0..50 {
        thread::sleep(Duration::from_millis(100));
        let now = dropped.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        last = now;
    }
    assert!(dropped.load(Ordering::SeqCst) < 2 * ITERATIONS, "the cap on deferred frees was never reached");
    (gate, filler)
}

#[test]
fn an_array_dropped_inside_a_host_job_past_the_cap_does_not_hang_its_stream() {
    let (filled, filler) = fill_deferred_frees();
    let spec = DeviceSpec::new(Device::Host).unwrap();
    let d = Dims::new(&[("x", 4)]).unwrap();
    let twice = Scalar::new(2.0, d);
    let x = Array::from_slice(&spec, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    x.synchronize().unwrap();
    let last_handle = x.clone();
    let gate = Gate::hold(&spec.compute_stream);
    // The job holds the last handle; the apply queued after it still reads the array.
    spec.compute_stream.host_fn(move || drop(last_handle)).unwrap();
    let y = twice.apply(&x).unwrap();
    drop(x);
    gate.open();
    let (done, finished) = std::sync::mpsc::channel();
    let stream = spec.compute_stream.clone();
    thread::spawn(move || {
        let _ = done.send(stream.synchronize());
    });
    let outcome = finished.recv_timeout(Duration::from_secs(20));
    filled.open();
    filler.join().unwrap();
    assert!(outcome.is_ok(), "the stream hung: the drop inside its job waited for work behind it");
    assert_eq!(y.to_vec().unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
}
