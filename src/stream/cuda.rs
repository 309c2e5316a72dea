//! The CUDA backend's stream: a non-blocking `cudaStream_t` owned by this value.
//!
//! Rules:
//! - Destroying the stream with work pending is legal: CUDA finishes the work first.
//! - Host functions run on a CUDA thread; a panic in one is caught (unwinding into CUDA would be
//!   undefined behaviour) and reported by the next `synchronize` or `query`.

use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use super::host::panic_message;
use crate::cuda::stream::{self as raw, RawStream};
use crate::error::{record_drop_error, Error, Result};

/// The first unreported failure of a host function queued on the stream.
type ErrorSlot = Arc<Mutex<Option<Error>>>;

/// An owned CUDA stream.
pub(crate) struct CudaStream {
    pub(crate) raw: RawStream,
    errors: ErrorSlot,
}

impl CudaStream {
    pub(crate) fn new(ordinal: u32) -> Result<Self> {
        Ok(CudaStream { raw: raw::create(ordinal, 0)?, errors: ErrorSlot::default() })
    }

    fn take_error(&self) -> Result<()> {
        match self.errors.lock() {
            Ok(mut slot) => slot.take().map_or(Ok(()), Err),
            Err(_) => Ok(()),
        }
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        raw::synchronize(self.raw)?;
        self.take_error()
    }

    /// Waits for the queued work, leaving a host function's error for the next
    /// `synchronize` or `query`.
    pub(crate) fn wait_idle(&self) -> Result<()> {
        raw::synchronize(self.raw)
    }

    pub(crate) fn query(&self) -> Result<bool> {
        self.take_error()?;
        raw::query(self.raw)
    }

    /// Queues `f` with `cudaLaunchHostFunc`.
    pub(crate) fn host_fn(&self, f: Box<dyn FnOnce() + Send + 'static>) -> Result<()> {
        let payload = Box::new(HostFnPayload { f, errors: Arc::clone(&self.errors) });
        let data = Box::into_raw(payload).cast::<c_void>();
        // SAFETY: `run_host_fn` takes back the box exactly once and never calls CUDA (launch
        // precondition 1); on failure CUDA will not call it, so we reclaim the box below.
        let launched = unsafe { raw::launch_host_fn(self.raw, run_host_fn, data) };
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

/// Runs one queued host function; called once by CUDA.
///
/// # Safety
///
/// 1. `data` came from `Box::into_raw` of a `HostFnPayload` in `CudaStream::host_fn`, and this
///    is the only call made with it.
unsafe extern "C" fn run_host_fn(data: *mut c_void) {
    // SAFETY: `data` came from `Box::into_raw` in `CudaStream::host_fn` and CUDA calls this
    // function exactly once per successful launch.
    let payload = unsafe { Box::from_raw(data.cast::<HostFnPayload>()) };
    let HostFnPayload { f, errors } = *payload;
    if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
        if let Ok(mut slot) = errors.lock() {
            slot.get_or_insert(Error::HostFnPanicked { message: panic_message(panic.as_ref()) });
        }
    }
}
