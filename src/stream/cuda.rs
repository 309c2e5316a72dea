//! The CUDA backend's stream: a non-blocking `cudaStream_t` owned by this value.
//!
//! Rules:
//! - Destroying the stream with work pending is legal: CUDA finishes the work first.
//! - Host functions run on a CUDA thread; a panic in one is caught (unwinding into CUDA would be
//!   undefined behaviour) and reported by the next `synchronize` or `query`.
//! - CUDA calls each queued host function exactly once (`cudaStreamAddCallback`). After a
//!   device error the closure is dropped there without running, so what it owns is freed; the
//!   error itself is CUDA's and every later `synchronize` reports it.
//! - Any call on the stream may run on a thread that chose no device (a host stream's
//!   worker, the reaper dropping a tracker's record of this stream, a user's new thread given
//!   a stream made elsewhere): waits, queries, the destroy, and the work queued on it (copies,
//!   records, event waits, host functions, launches: all through `CudaStream::queue_handle`) each
//!   first make the stream's device current where no context is (`ensure_context`), so that
//!   the runtime creates none on device 0. A thread with a context keeps its device.

use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use super::host::take_panic_message;
use crate::cuda::stream::{self as raw, RawStream};
use crate::error::{record_drop_error, Error, Result};

/// The first unreported failure of a host function queued on the stream.
type ErrorSlot = Arc<Mutex<Option<Error>>>;

/// An owned CUDA stream.
pub(crate) struct CudaStream {
    /// Private: work is queued through [`CudaStream::queue_handle`], which makes the device
    /// current first where the thread has no context.
    raw: RawStream,
    errors: ErrorSlot,
    device: u32,
}

impl CudaStream {
    pub(crate) fn new(ordinal: u32) -> Result<Self> {
        Ok(CudaStream { raw: raw::create(ordinal, 0)?, errors: ErrorSlot::default(), device: ordinal })
    }

    /// The handle, for queuing work on the stream: the stream's device is made current first
    /// on a thread with no context (see the module rules).
    pub(crate) fn queue_handle(&self) -> RawStream {
        self.ensure_context();
        self.raw
    }

    /// Makes the stream's device current on a thread with no context (see the module rules).
    fn ensure_context(&self) {
        // A failure leaves the CUDA call that follows to report its own error.
        let _ = crate::cuda::device::ensure_context(self.device);
    }

    fn take_error(&self) -> Result<()> {
        match self.errors.lock() {
            Ok(mut slot) => slot.take().map_or(Ok(()), Err),
            Err(_) => Ok(()),
        }
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.ensure_context();
        raw::synchronize(self.raw)?;
        self.take_error()
    }

    /// Waits for the queued work, leaving a host function's error for the next
    /// `synchronize` or `query`.
    pub(crate) fn wait_idle(&self) -> Result<()> {
        self.ensure_context();
        raw::synchronize(self.raw)
    }

    /// Whether the queued work has finished, reporting a host function's error as
    /// `synchronize` does. The error slot is read after CUDA's answer: a host function that
    /// fails just before the stream goes idle has stored its error by then, so "done" never
    /// hides it (read first, the slot could be empty and the stream idle a moment later).
    pub(crate) fn query(&self) -> Result<bool> {
        self.ensure_context();
        let done = raw::query(self.raw)?;
        self.take_error()?;
        Ok(done)
    }

    /// Queues `f` with `cudaStreamAddCallback`.
    pub(crate) fn host_fn(&self, f: Box<dyn FnOnce() + Send + 'static>) -> Result<()> {
        let payload = Box::new(HostFnPayload { f, errors: Arc::clone(&self.errors) });
        let data = Box::into_raw(payload).cast::<c_void>();
        // SAFETY: `run_host_fn` takes back the box exactly once and never calls CUDA (launch
        // precondition 1; `f` must not either, as `Stream::host_fn` requires); on failure CUDA
        // will not call it, so we reclaim the box below.
        let launched = unsafe { raw::launch_host_fn(self.queue_handle(), run_host_fn, data) };
        if launched.is_err() {
            // SAFETY: the launch failed, so `data` is still ours (precondition 2) and came from
            // `Box::into_raw` above.
            drop(unsafe { Box::from_raw(data.cast::<HostFnPayload>()) });
        }
        launched
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        self.ensure_context();
        // SAFETY: the handle is owned by this value and not used after this point.
        if let Err(err) = unsafe { raw::destroy(self.raw) } {
            record_drop_error(err);
        }
    }
}

/// What a queued host function carries.
struct HostFnPayload {
    f: Box<dyn FnOnce() + Send + 'static>,
    errors: ErrorSlot,
}

/// Runs one queued host function, or drops it unrun when the stream hit a device error
/// (`status` != 0: the work it was queued behind did not complete); called once by CUDA.
///
/// # Safety
///
/// 1. `data` came from `Box::into_raw` of a `HostFnPayload` in `CudaStream::host_fn`, and this
///    is the only call made with it.
unsafe extern "C" fn run_host_fn(status: crate::sys::cuferry_status, data: *mut c_void) {
    // SAFETY: `data` came from `Box::into_raw` in `CudaStream::host_fn` and CUDA calls this
    // function exactly once per successful launch.
    let payload = unsafe { Box::from_raw(data.cast::<HostFnPayload>()) };
    let HostFnPayload { f, errors } = *payload;
    // Dropping `f` runs user code too: catch its panics as well.
    let ran = catch_unwind(AssertUnwindSafe(move || if status == 0 { f() } else { drop(f) }));
    if let Err(panic) = ran {
        // The payload's own drop may panic too: dropped inside `take_panic_message`, it cannot
        // unwind out of this `extern "C"` function (which would abort).
        let message = take_panic_message(panic);
        if let Ok(mut slot) = errors.lock() {
            slot.get_or_insert(Error::HostFnPanicked { message });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Counts drops of the value a host function captured.
    struct DropCount(Arc<AtomicUsize>);

    impl Drop for DropCount {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Calls `run_host_fn` as CUDA would, with `status`; returns (runs, drops, recorded error).
    fn call_with_status(status: crate::sys::cuferry_status) -> (usize, usize, Option<Error>) {
        let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let errors = ErrorSlot::default();
        let (r, guard) = (Arc::clone(&runs), DropCount(Arc::clone(&drops)));
        let f: Box<dyn FnOnce() + Send> = Box::new(move || {
            let _guard = guard;
            r.fetch_add(1, Ordering::SeqCst);
        });
        let data = Box::into_raw(Box::new(HostFnPayload { f, errors: Arc::clone(&errors) })).cast::<c_void>();
        // SAFETY: `data` came from `Box::into_raw` of a payload and is passed exactly once.
        unsafe { run_host_fn(status, data) };
        let recorded = errors.lock().unwrap().take();
        (runs.load(Ordering::SeqCst), drops.load(Ordering::SeqCst), recorded)
    }

    #[test]
    fn host_fn_runs_when_the_stream_is_healthy() {
        assert_eq!(call_with_status(0), (1, 1, None));
    }

    /// After a device error CUDA still calls back, with the error: the closure is dropped
    /// without running and nothing is recorded (the stream reports CUDA's own error).
    #[test]
    fn host_fn_after_a_device_error_is_dropped_unrun() {
        const CUDA_ERROR_ILLEGAL_ADDRESS: i32 = 700;
        assert_eq!(call_with_status(CUDA_ERROR_ILLEGAL_ADDRESS), (0, 1, None));
    }

    #[test]
    fn a_panic_while_dropping_an_unrun_host_fn_is_reported() {
        struct PanicOnDrop;
        impl Drop for PanicOnDrop {
            fn drop(&mut self) {
                panic!("drop boom");
            }
        }
        let errors = ErrorSlot::default();
        let guard = PanicOnDrop;
        let f: Box<dyn FnOnce() + Send> = Box::new(move || drop(guard));
        let data = Box::into_raw(Box::new(HostFnPayload { f, errors: Arc::clone(&errors) })).cast::<c_void>();
        // SAFETY: as in `call_with_status`.
        unsafe { run_host_fn(700, data) };
        let recorded = errors.lock().unwrap().take();
        match recorded {
            Some(Error::HostFnPanicked { message }) => assert!(message.contains("drop boom")),
            other => panic!("expected the drop's panic, got {other:?}"),
        }
    }
}
