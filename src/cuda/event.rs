//! Event calls (streams.cu).

use super::{check, check_ready, ordinal, stream::RawStream};
use crate::error::Result;
use crate::sys;

/// A `cudaEvent_t`. Copyable; destroyed only by [`destroy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawEvent(pub(crate) sys::cuferry_event);

// SAFETY: a CUDA event handle may be used from any thread; the runtime is thread-safe.
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Sync for RawEvent {}

/// `cudaEventCreateWithFlags` on `device`, with timing or `cudaEventDisableTiming`.
pub(crate) fn create(device: u32, timing: bool) -> Result<RawEvent> {
    let dev = ordinal(device)?;
    let mut e: sys::cuferry_event = std::ptr::null_mut();
    // SAFETY: `e` is a valid out-pointer for the duration of the call.
    check("cudaEventCreateWithFlags", unsafe {
        sys::cuferry_cuda_event_create(dev, i32::from(timing), &mut e)
    })?;
    Ok(RawEvent(e))
}

/// `cudaEventDestroy`.
///
/// # Safety
///
/// 1. `e` came from [`create`] and is not used again.
pub(crate) unsafe fn destroy(e: RawEvent) -> Result<()> {
    // SAFETY: precondition 1.
    check("cudaEventDestroy", unsafe { sys::cuferry_cuda_event_destroy(e.0) })
}

/// `cudaEventRecord`.
pub(crate) fn record(e: RawEvent, s: RawStream) -> Result<()> {
    // SAFETY: both handles are live.
    check("cudaEventRecord", unsafe { sys::cuferry_cuda_event_record(e.0, s.0) })
}

/// `cudaEventQuery`: true when the last record completed.
pub(crate) fn query(e: RawEvent) -> Result<bool> {
    // SAFETY: `e` is live.
    check_ready("cudaEventQuery", unsafe { sys::cuferry_cuda_event_query(e.0) })
}

/// `cudaEventSynchronize`.
pub(crate) fn synchronize(e: RawEvent) -> Result<()> {
    // SAFETY: `e` is live.
    check("cudaEventSynchronize", unsafe { sys::cuferry_cuda_event_synchronize(e.0) })
}

/// `cudaEventElapsedTime` in milliseconds.
pub(crate) fn elapsed_ms(start: RawEvent, end: RawEvent) -> Result<f32> {
    let mut ms = 0.0f32;
    // SAFETY: both handles are live and `ms` is a valid out-pointer.
    check("cudaEventElapsedTime", unsafe { sys::cuferry_cuda_event_elapsed_ms(start.0, end.0, &mut ms) })?;
    Ok(ms)
}
