//! Ordering a cuferry stream with another library's CUDA stream (`Stream::wait_cuda_stream`,
//! `Stream::make_cuda_stream_wait`, and their C ABI forms): on a GPU, a stream whose only work
//! is the wait stays busy while the other stream is held, and runs once it is released; the
//! refusals (host-backend streams, NULL cuferry handles); and the default streams' handles.

mod common;

use std::ffi::c_void;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuferry::ffi::{
    cuferry_cuda_stream_wait_stream, cuferry_stream_create, cuferry_stream_destroy,
    cuferry_stream_wait_cuda_stream, CuferryStatus, CUFERRY_HOST,
};
use cuferry::{Device, Error, Stream};

/// How long a held stream is held at most (a failing test then unwinds).
const HOLD: Duration = Duration::from_secs(10);

/// Queues on `stream` a host function that waits for the returned sender (or `HOLD`).
fn hold(stream: &Stream) -> mpsc::Sender<()> {
    let (release, held) = mpsc::channel::<()>();
    stream
        .host_fn(move || {
            let _ = held.recv_timeout(HOLD);
        })
        .unwrap();
    release
}

/// Polls `stream` until it is idle (or `HOLD` passed): whether it became idle.
fn becomes_idle(stream: &Stream) -> bool {
    let start = Instant::now();
    while start.elapsed() < HOLD {
        if stream.query().unwrap() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// `waiting` waits for `held`'s work so far through `order`: it stays busy (its only work is
/// that wait) while `held` is held, and becomes idle once released. Without the wait it would
/// be idle at once.
fn check_order(held: &Stream, waiting: &Stream, order: impl FnOnce()) {
    assert!(waiting.query().unwrap(), "the waiting stream has work of its own");
    let release = hold(held);
    order();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!waiting.query().unwrap(), "the stream did not wait for the other one's queued work");
    release.send(()).unwrap();
    assert!(becomes_idle(waiting), "the wait never ended");
    held.synchronize().unwrap();
}

#[test]
fn a_stream_waits_for_another_librarys_stream_and_the_reverse() {
    let Some(device) = common::cuda_device() else { return };
    let ours = Stream::new(device).unwrap();
    // Another cuferry stream stands in for another library's: its handle is all the call sees.
    let theirs = Stream::new(device).unwrap();
    let handle = theirs.cuda_handle().unwrap();
    // SAFETY: `theirs` is a live stream of the same device for the whole test.
    check_order(&theirs, &ours, || unsafe { ours.wait_cuda_stream(handle) }.unwrap());
    // SAFETY: as above.
    check_order(&ours, &theirs, || unsafe { ours.make_cuda_stream_wait(handle) }.unwrap());
    // The default streams (NULL, cudaStreamLegacy, cudaStreamPerThread), idle here.
    for default in [0usize, 1, 2] {
        let handle = default as *mut c_void;
        // SAFETY: each names a default stream of the current device.
        unsafe { ours.wait_cuda_stream(handle) }.unwrap();
        // SAFETY: as above.
        unsafe { ours.make_cuda_stream_wait(handle) }.unwrap();
    }
    ours.synchronize().unwrap();
}

/// The C ABI's two calls in a chain: a C stream waits for a held stream, and a probe stream
/// is made to wait for the C stream; the probe stays busy while the first is held (either
/// call failing to order leaves it idle).
#[test]
fn the_c_abi_orders_them_too() {
    let Some(device) = common::cuda_device() else { return };
    let Device::Cuda(ordinal) = device else { unreachable!() };
    let (held, probe) = (Stream::new(device).unwrap(), Stream::new(device).unwrap());
    let (held_handle, probe_handle) = (held.cuda_handle().unwrap(), probe.cuda_handle().unwrap());
    let mut ours = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuferry_stream_create(ordinal as i32, &mut ours) }, CuferryStatus::Ok);
    check_order(&held, &probe, || {
        // SAFETY: live handles of one device.
        unsafe {
            assert_eq!(cuferry_stream_wait_cuda_stream(ours, held_handle), CuferryStatus::Ok);
            assert_eq!(cuferry_cuda_stream_wait_stream(probe_handle, ours), CuferryStatus::Ok);
        }
    });
    // SAFETY: a live handle, not used again.
    assert_eq!(unsafe { cuferry_stream_destroy(ours) }, CuferryStatus::Ok);
}

#[test]
fn host_streams_are_refused() {
    let host = Stream::new(Device::Host).unwrap();
    assert_eq!(host.cuda_handle(), None);
    // SAFETY: refused before any handle is used.
    let refused = unsafe {
        (host.wait_cuda_stream(std::ptr::null_mut()), host.make_cuda_stream_wait(1 as *mut c_void))
    };
    assert!(
        matches!(refused, (Err(Error::Unsupported { .. }), Err(Error::Unsupported { .. }))),
        "{refused:?}"
    );
    let mut c_host = std::ptr::null_mut();
    // SAFETY: valid out-pointer; then a live handle, destroyed at the end.
    unsafe {
        assert_eq!(cuferry_stream_create(CUFERRY_HOST, &mut c_host), CuferryStatus::Ok);
        assert_eq!(cuferry_stream_wait_cuda_stream(c_host, std::ptr::null_mut()), CuferryStatus::Unsupported);
        assert_eq!(cuferry_cuda_stream_wait_stream(std::ptr::null_mut(), c_host), CuferryStatus::Unsupported);
        assert_eq!(
            cuferry_stream_wait_cuda_stream(std::ptr::null(), std::ptr::null_mut()),
            CuferryStatus::InvalidArgument
        );
        assert_eq!(cuferry_stream_destroy(c_host), CuferryStatus::Ok);
    }
}
