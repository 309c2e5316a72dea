//! Ordering a cuferry stream with a CUDA stream another library made (cudarc, PyTorch, CuPy,
//! a C code's own), without blocking the host.
//!
//! Rules:
//! - [`Stream::wait_cuda_stream`] orders the work queued on the cuferry stream afterwards
//!   after everything queued on the other stream before the call; [`Stream::make_cuda_stream_wait`]
//!   orders the other stream's later work after the cuferry stream's work so far. Each
//!   records a new event on one stream and makes the other wait for it (`cudaEventRecord`,
//!   `cudaStreamWaitEvent`). The event is destroyed at once: CUDA keeps what the queued wait
//!   needs.
//! - The other stream belongs to the cuferry stream's device and its primary context (the
//!   runtime's, which PyTorch and CuPy use; a `cuCtxCreate` context's streams are not
//!   supported). That device is current for the call; the caller's current device is
//!   restored afterwards (a thread that had no context keeps it current). NULL and
//!   `cudaStreamLegacy` (1) name that device's legacy default stream (PyTorch's default
//!   stream, `cuda_stream == 0`); `cudaStreamPerThread` (2) the calling thread's per-thread
//!   default stream of it.
//! - A host-backend stream has no CUDA stream to order with: [`Error::Unsupported`].
//! - The ordering is between streams: the trackers of cuferry buffers do not see the other
//!   library's work. Memory both use (a [`ForeignBuffer`](crate::ForeignBuffer) of a tensor)
//!   is ordered by these calls around the cuferry work on it, or by host waits.

use std::os::raw::c_void;

use super::{Stream, StreamBackend};
use crate::cuda::device::DeviceScope;
use crate::cuda::event as raw_event;
use crate::cuda::stream::{self as raw_stream, RawStream};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::{Event, EventBackend};

impl Stream {
    /// The `cudaStream_t` of a CUDA stream, for queuing another library's work on it (a
    /// cudarc kernel, a cuBLAS call) or for [`Stream::wait_cuda_stream`] between two cuferry
    /// streams; `None` for a host-backend stream. The handle stays owned by this stream (and
    /// its clones): valid while one of them lives, never to be destroyed by the caller. Work
    /// queued through it is ordered on the stream but not seen by cuferry buffers' trackers.
    pub fn cuda_handle(&self) -> Option<*mut c_void> {
        match self.backend() {
            StreamBackend::Cuda(s) => Some(s.queue_handle().0.cast()),
            StreamBackend::Host(_) => None,
        }
    }

    /// Orders the work queued on this stream from now on after everything queued so far on
    /// `cuda_stream`, a CUDA stream of this stream's device that another library made (for
    /// example `torch.cuda.current_stream().cuda_stream`): call it before queuing cuferry work
    /// on memory that library's queued work writes. Neither stream blocks the host. See the
    /// [stream rules](crate::stream).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a host-backend stream; CUDA errors of `cudaEventCreate`,
    /// `cudaEventRecord` (a stream of another device or context gives an invalid-handle
    /// error) and `cudaStreamWaitEvent`.
    ///
    /// # Safety
    ///
    /// 1. `cuda_stream` is NULL, `cudaStreamLegacy`, `cudaStreamPerThread` or a live
    ///    `cudaStream_t` of this stream's device (of its primary context), not destroyed
    ///    during the call.
    pub unsafe fn wait_cuda_stream(&self, cuda_stream: *mut c_void) -> Result<()> {
        self.order_with(cuda_stream, Waiting::Ours)
    }

    /// Orders the work queued on `cuda_stream` from now on after everything queued so far on
    /// this stream: call it before that library's work reads memory cuferry's queued work
    /// writes (a copy into a wrapped tensor, a halo unpack). Neither stream blocks the host.
    /// See the [stream rules](crate::stream).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a host-backend stream; CUDA errors of `cudaEventCreate`,
    /// `cudaEventRecord` and `cudaStreamWaitEvent`.
    ///
    /// # Safety
    ///
    /// As [`Stream::wait_cuda_stream`] (CUDA does not refuse a stream of another device
    /// here; that is still outside this call's contract).
    pub unsafe fn make_cuda_stream_wait(&self, cuda_stream: *mut c_void) -> Result<()> {
        self.order_with(cuda_stream, Waiting::Theirs)
    }

    /// Records a new event on one of the two streams and makes the other wait for it, with
    /// this stream's device current for the calls.
    fn order_with(&self, cuda_stream: *mut c_void, waiting: Waiting) -> Result<()> {
        let StreamBackend::Cuda(ours) = self.backend() else {
            return Err(Error::unsupported(
                "a host-backend stream has no CUDA stream to order with another library's",
            ));
        };
        let Device::Cuda(ordinal) = self.device() else {
            return Err(Error::invalid("a CUDA stream of the host device"));
        };
        let _scope = DeviceScope::enter(ordinal)?;
        let theirs = their_stream(cuda_stream);
        let (recorded, waits) = match waiting {
            Waiting::Ours => (theirs, ours.queue_handle()),
            Waiting::Theirs => (ours.queue_handle(), theirs),
        };
        let event = Event::new(self.device())?;
        let raw = cuda_event(&event)?;
        raw_event::record(raw, recorded)?;
        raw_stream::wait_event(waits, raw)
    }
}

/// `cudaStreamLegacy`: the device's legacy default stream, which NULL also names.
const CUDA_STREAM_LEGACY: usize = 1;

/// The other library's stream as cuferry's C calls take it: NULL is the legacy default
/// stream in this runtime (built without per-thread default streams), but those calls refuse
/// a NULL stream, so it is named explicitly.
fn their_stream(cuda_stream: *mut c_void) -> RawStream {
    let handle = if cuda_stream.is_null() { CUDA_STREAM_LEGACY as *mut c_void } else { cuda_stream };
    RawStream(handle.cast())
}

/// Which stream of [`Stream::order_with`] waits for the other.
#[derive(Clone, Copy)]
enum Waiting {
    /// The cuferry stream waits for the other library's.
    Ours,
    /// The other library's stream waits for the cuferry stream.
    Theirs,
}

/// The CUDA handle of an event made for a CUDA device.
fn cuda_event(event: &Event) -> Result<raw_event::RawEvent> {
    match event.backend() {
        EventBackend::Cuda(e) => Ok(e.raw),
        EventBackend::Host(_) => Err(Error::invalid("a host event has no CUDA handle")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NULL (PyTorch's default stream) reaches CUDA as `cudaStreamLegacy`, which cuferry's C
    /// calls take (they refuse a NULL stream); other handles pass unchanged.
    #[test]
    fn null_is_named_as_the_legacy_stream() {
        assert_eq!(their_stream(std::ptr::null_mut()).0 as usize, CUDA_STREAM_LEGACY);
        for handle in [1usize, 2, 0x7f00_1000] {
            assert_eq!(their_stream(handle as *mut c_void).0 as usize, handle);
        }
    }
}
