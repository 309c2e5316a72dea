//! Stream calls (streams.cu).

use std::os::raw::c_void;

use super::{check, check_ready, event::RawEvent, ordinal};
use crate::error::Result;
use crate::sys;

/// A `cudaStream_t`. Copyable; destroyed only by [`destroy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawStream(pub(crate) sys::cuferry_stream);

// SAFETY: a CUDA stream handle may be used from any thread; the runtime is thread-safe.
unsafe impl Send for RawStream {}
// SAFETY: as above; every operation on the handle goes through the thread-safe runtime.
unsafe impl Sync for RawStream {}

/// `cudaStreamCreateWithPriority` (non-blocking) on `device`.
pub(crate) fn create(device: u32, priority: i32) -> Result<RawStream> {
    let dev = ordinal(device)?;
    let mut s: sys::cuferry_stream = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-pointer for the duration of the call.
    check("cudaStreamCreateWithPriority", unsafe { sys::cuferry_cuda_stream_create(dev, priority, &mut s) })?;
    Ok(RawStream(s))
}

/// `cudaStreamDestroy`.
///
/// # Safety
///
/// 1. `s` came from [`create`] and is not used again.
pub(crate) unsafe fn destroy(s: RawStream) -> Result<()> {
    // SAFETY: precondition 1.
    check("cudaStreamDestroy", unsafe { sys::cuferry_cuda_stream_destroy(s.0) })
}

/// `cudaStreamSynchronize`.
pub(crate) fn synchronize(s: RawStream) -> Result<()> {
    // SAFETY: `s` is a live handle (owners keep it alive while they call this).
    check("cudaStreamSynchronize", unsafe { sys::cuferry_cuda_stream_synchronize(s.0) })
}

/// `cudaStreamQuery`: true when all queued work is done.
pub(crate) fn query(s: RawStream) -> Result<bool> {
    // SAFETY: `s` is a live handle.
    check_ready("cudaStreamQuery", unsafe { sys::cuferry_cuda_stream_query(s.0) })
}

/// `cudaStreamWaitEvent`.
pub(crate) fn wait_event(s: RawStream, e: RawEvent) -> Result<()> {
    // SAFETY: both handles are live.
    check("cudaStreamWaitEvent", unsafe { sys::cuferry_cuda_stream_wait_event(s.0, e.0) })
}

/// `cudaStreamAddCallback`: CUDA calls `f(status, user_data)` exactly once, after the work
/// queued before it, with `status` 0 or the persistent error the stream hit (then the work
/// before it did not complete).
///
/// # Safety
///
/// 1. `f(status, user_data)` is sound to call once, from a CUDA-owned thread, at any later
///    time, and does not call CUDA.
/// 2. If this returns an error, `f` will not be called and the caller still owns `user_data`.
pub(crate) unsafe fn launch_host_fn(
    s: RawStream,
    f: unsafe extern "C" fn(sys::cuferry_status, *mut c_void),
    user_data: *mut c_void,
) -> Result<()> {
    // SAFETY: precondition 1; `s` is live.
    check("cudaStreamAddCallback", unsafe {
        sys::cuferry_cuda_stream_launch_host_fn(s.0, Some(f), user_data)
    })
}
