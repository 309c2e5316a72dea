//! Helpers shared by the ring tests (included with `#[path]`): a backend that misbehaves on
//! purpose (failed submissions, panics, an overstated slot size or count), as a custom backend
//! may.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;

use cuferry::ring::{StreamTransferBackend, TransferBackend, TransferCapabilities};
use cuferry::{Device, DeviceBuffer, Error, Stream};

/// A backend whose every `fail_every`-th submission fails, wrapping the real one; optionally
/// it fails or panics in `wait_stream_for_ready`, panics once in `release`, overstates its
/// slot size or count, or takes its time over submissions.
pub struct FlakyBackend {
    inner: StreamTransferBackend,
    calls: AtomicUsize,
    fail_every: usize,
    panic_in_wait: AtomicBool,
    failing_waits: AtomicUsize,
    held_wait: Mutex<Option<(Sender<()>, Receiver<()>)>>,
    panic_in_release: AtomicBool,
    claimed_slot_bytes: Option<usize>,
    claimed_slot_count: Option<usize>,
    slow_submissions: Option<SlowSubmissions>,
}

/// Submissions from the `from`-th on (counting from 1) take `delay` more, then say so on
/// `done`.
struct SlowSubmissions {
    from: usize,
    delay: Duration,
    done: Mutex<Sender<()>>,
}

impl FlakyBackend {
    /// Wraps `inner`; its `fail_every`-th, `2 * fail_every`-th, ... submissions fail
    /// (`usize::MAX`: none does in practice).
    pub fn new(inner: StreamTransferBackend, fail_every: usize) -> Self {
        FlakyBackend {
            inner,
            calls: AtomicUsize::new(0),
            fail_every,
            panic_in_wait: AtomicBool::new(false),
            failing_waits: AtomicUsize::new(0),
            held_wait: Mutex::new(None),
            panic_in_release: AtomicBool::new(false),
            claimed_slot_bytes: None,
            claimed_slot_count: None,
            slow_submissions: None,
        }
    }

    /// The next `wait_stream_for_ready` panics (user code in a custom backend).
    pub fn panic_once_in_wait(self) -> Self {
        self.panic_in_wait.store(true, Ordering::SeqCst);
        self
    }

    /// The next `count` calls of `wait_stream_for_ready` fail (a consumer's stream that
    /// cannot be ordered), without ordering anything.
    pub fn failing_waits(self, count: usize) -> Self {
        self.failing_waits.store(count, Ordering::SeqCst);
        self
    }

    /// The next `wait_stream_for_ready` says so on `entered`, waits for a message on
    /// `release` (or its sender's drop), and then fails without ordering anything.
    pub fn held_failing_wait(self, entered: Sender<()>, release: Receiver<()>) -> Self {
        *self.held_wait.lock().unwrap() = Some((entered, release));
        self
    }

    /// The next `release` panics before recording anything.
    pub fn panic_once_in_release(self) -> Self {
        self.panic_in_release.store(true, Ordering::SeqCst);
        self
    }

    /// `slot_bytes` says `bytes`, and submissions longer than the real slots "succeed"
    /// without copying: a wrong backend written in safe code.
    pub fn overstating_slot_bytes(mut self, bytes: usize) -> Self {
        self.claimed_slot_bytes = Some(bytes);
        self
    }
}

impl FlakyBackend {
    /// `host_slot_count` and `device_slot_count` say `count` (a garbage count from a custom
    /// backend).
    pub fn overstating_slot_counts(mut self, count: usize) -> Self {
        self.claimed_slot_count = Some(count);
        self
    }
}

impl FlakyBackend {
    /// The `from`-th submission (counting from 1) and every later one sleep `delay` before
    /// submitting (a custom backend that logs or throttles), and send on `done` once
    /// submitted.
    pub fn slow_submissions(mut self, from: usize, delay: Duration, done: Sender<()>) -> Self {
        self.slow_submissions = Some(SlowSubmissions { from, delay, done: Mutex::new(done) });
        self
    }
}

impl TransferBackend for FlakyBackend {
    fn capabilities(&self) -> TransferCapabilities {
        self.inner.capabilities()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn allocate_host_slots(&mut self, count: usize, bytes: usize) -> cuferry::Result<()> {
        self.inner.allocate_host_slots(count, bytes)
    }
    fn register_host_slots(&mut self, slots: Vec<Vec<u8>>) -> cuferry::Result<()> {
        self.inner.register_host_slots(slots)
    }
    fn allocate_device_slots(&mut self, count: usize, bytes: usize) -> cuferry::Result<()> {
        self.inner.allocate_device_slots(count, bytes)
    }
    fn host_slot_count(&self) -> usize {
        self.claimed_slot_count.unwrap_or_else(|| self.inner.host_slot_count())
    }
    fn device_slot_count(&self) -> usize {
        self.claimed_slot_count.unwrap_or_else(|| self.inner.device_slot_count())
    }
    fn slot_bytes(&self) -> usize {
        self.claimed_slot_bytes.unwrap_or_else(|| self.inner.slot_bytes())
    }
    unsafe fn host_slot_mut(&self, host: usize) -> cuferry::Result<&mut [u8]> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.host_slot_mut(host) }
    }
    fn wait_host_slot(&self, host: usize) -> cuferry::Result<()> {
        self.inner.wait_host_slot(host)
    }
    fn host_slot_idle(&self, host: usize) -> cuferry::Result<bool> {
        self.inner.host_slot_idle(host)
    }
    unsafe fn submit_upload(&self, host: usize, device: usize, bytes: usize) -> cuferry::Result<Duration> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        if call % self.fail_every == self.fail_every - 1 {
            return Err(Error::Unsupported { what: "injected submit failure".into() });
        }
        if self.claimed_slot_bytes.is_some() && bytes > self.inner.slot_bytes() {
            return Ok(Duration::ZERO);
        }
        let slow = self.slow_submissions.as_ref().filter(|slow| call + 1 >= slow.from);
        if let Some(slow) = slow {
            std::thread::sleep(slow.delay);
        }
        // SAFETY: forwarded with the caller's guarantees.
        let submitted = unsafe { self.inner.submit_upload(host, device, bytes) };
        if let Some(slow) = slow {
            let _ = slow.done.lock().unwrap().send(());
        }
        submitted
    }
    fn upload_device_ms(&self, device: usize) -> cuferry::Result<Option<f32>> {
        self.inner.upload_device_ms(device)
    }
    fn ready_query(&self, device: usize) -> cuferry::Result<bool> {
        self.inner.ready_query(device)
    }
    fn synchronize_ready(&self, device: usize) -> cuferry::Result<()> {
        self.inner.synchronize_ready(device)
    }
    fn wait_stream_for_ready(&self, device: usize, stream: &Stream) -> cuferry::Result<()> {
        if self.panic_in_wait.swap(false, Ordering::SeqCst) {
            panic!("injected panic in wait_stream_for_ready");
        }
        let held = self.held_wait.lock().unwrap().take();
        if let Some((entered, release)) = held {
            let _ = entered.send(());
            let _ = release.recv();
            return Err(Error::Unsupported { what: "injected wait failure".into() });
        }
        if self.failing_waits.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(Error::Unsupported { what: "injected wait failure".into() });
        }
        self.inner.wait_stream_for_ready(device, stream)
    }
    fn release(&self, device: usize, stream: &Stream) -> cuferry::Result<()> {
        if self.panic_in_release.swap(false, Ordering::SeqCst) {
            panic!("injected panic in release");
        }
        self.inner.release(device, stream)
    }
    fn device_slot(&self, device: usize) -> cuferry::Result<&DeviceBuffer<u8>> {
        self.inner.device_slot(device)
    }
    fn close(&self) -> cuferry::Result<()> {
        self.inner.close()
    }
}
