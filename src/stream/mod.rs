//! Streams: in-order queues of work on one device.
//!
//! Rules:
//! - Work queued on one stream runs in the order it was queued; work on different streams is
//!   unordered unless a stream waits on an [`Event`] recorded on another.
//! - [`Stream::wait_event`] orders everything queued afterwards on this stream after the event's
//!   most recent record at the time of the call, as `cudaStreamWaitEvent` does.
//! - A `Stream` is a cheap handle (`Clone` shares the same queue). Dropping the last handle
//!   with work pending does not block and does not cancel: the work still runs.
//! - On [`Device::Host`] one worker thread serves each stream; on [`Device::Cuda`] it is a
//!   non-blocking CUDA stream.
//! - Errors of asynchronous work (a host function that panicked) are reported once, by the
//!   next [`Stream::query`] or by the next [`Stream::synchronize`] that waited for the failed
//!   work (on the host backend, one called before it was queued leaves it for a later check;
//!   linop arrays also take a failed job's error, see [`crate::linop`]).
//! - [`Stream::wait_event`] on a host stream for a CUDA event waits, when the job runs, for
//!   the event's record at that time: never an earlier one, possibly a later one (a host
//!   thread can only synchronize an event's latest record).
//! - [`Stream::wait_cuda_stream`] and [`Stream::make_cuda_stream_wait`] order a CUDA stream
//!   with a `cudaStream_t` another library made on its device (PyTorch, CuPy, cudarc), one
//!   way each, by a new event recorded on one and waited for by the other; the host blocks
//!   for neither. NULL and `cudaStreamLegacy` name the device's legacy default stream,
//!   `cudaStreamPerThread` the calling thread's; a host stream has none to order with
//!   ([`Error::Unsupported`]). Buffers' trackers do not see the other library's work.
//!
//! # Examples
//!
//! Work on a stream runs in order, and `synchronize` waits for it:
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use cuferry::{Device, Stream};
//!
//! let stream = Stream::new(Device::Host)?;
//! let log = Arc::new(Mutex::new(Vec::new()));
//! for i in 0..4 {
//!     let log = Arc::clone(&log);
//!     stream.host_fn(move || log.lock().unwrap().push(i))?;
//! }
//! stream.synchronize()?;
//! assert_eq!(*log.lock().unwrap(), vec![0, 1, 2, 3]);
//! # Ok::<(), cuferry::Error>(())
//! ```

mod cuda;
mod errors;
mod foreign;
pub(crate) use errors::StreamErrors;
pub(crate) mod host;
#[cfg(test)]
pub(crate) mod test_gate;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::device::Device;
use crate::error::{take_drop_error, Error, Result};
use crate::event::{Event, EventBackend};
pub(crate) use cuda::CudaStream;
pub(crate) use host::HostQueue;

/// Source of stream ids (unique per process).
static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// An in-order queue of work on one device. See the [module docs](self) for its rules.
#[derive(Clone)]
pub struct Stream {
    shared: Arc<StreamShared>,
}

struct StreamShared {
    id: u64,
    device: Device,
    backend: StreamBackend,
}

/// The one place where the two backends differ.
pub(crate) enum StreamBackend {
    Host(HostQueue),
    Cuda(CudaStream),
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream").field("id", &self.shared.id).field("device", &self.shared.device).finish()
    }
}

impl Stream {
    /// How many handles to this stream exist (clones held by buffers' trackers included).
    #[cfg(test)]
    pub(crate) fn handle_count(&self) -> usize {
        Arc::strong_count(&self.shared)
    }

    /// A new stream on `device`.
    ///
    /// # Errors
    ///
    /// For CUDA devices: [`Error::Unsupported`] when CUDA is not built in, [`Error::NoDriver`],
    /// [`Error::NoDevice`], or the CUDA error of `cudaStreamCreate` (a bad ordinal gives
    /// `cudaErrorInvalidDevice`). For the host: failing to start the worker thread.
    pub fn new(device: Device) -> Result<Self> {
        let id = NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed);
        let backend = match device {
            Device::Host => StreamBackend::Host(HostQueue::new(id)?),
            Device::Cuda(i) => StreamBackend::Cuda(CudaStream::new(i)?),
        };
        Ok(Stream { shared: Arc::new(StreamShared { id, device, backend }) })
    }

    /// The device this stream runs on.
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// A process-unique id; clones of one stream share it.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub(crate) fn backend(&self) -> &StreamBackend {
        &self.shared.backend
    }

    /// [`Error::InvalidArgument`] when the calling thread runs a job of this host stream: a
    /// call that queues work here and then waits for it (`what` names the call) would wait for
    /// itself, and the work it queued would still run after it returned. CUDA streams pass.
    pub(crate) fn refuse_blocking_call_from_own_job(&self, what: &str) -> Result<()> {
        match &self.shared.backend {
            StreamBackend::Host(q) => q.id().refuse_wait_from_own_job(what),
            StreamBackend::Cuda(_) => Ok(()),
        }
    }

    /// Blocks until all work queued on this stream before the call has finished.
    ///
    /// # Errors
    ///
    /// The CUDA error of the stream, or the first error of its asynchronous work since the
    /// last check (a panicking host function); then [`Error::DropFailed`] when an earlier drop
    /// of any cuferry resource failed (see [`take_drop_error`]). On the host backend,
    /// [`Error::InvalidArgument`] at once when called from a job of this stream (a
    /// [`Stream::host_fn`] closure), which would otherwise wait for itself forever.
    pub fn synchronize(&self) -> Result<()> {
        match &self.shared.backend {
            StreamBackend::Host(q) => q.synchronize()?,
            StreamBackend::Cuda(s) => s.synchronize()?,
        }
        match take_drop_error() {
            Some(err) => Err(Error::DropFailed(Box::new(err))),
            None => Ok(()),
        }
    }

    /// Blocks until all work queued before the call has finished, without reporting: a job's
    /// error stays for the next [`Stream::synchronize`] or [`Stream::query`], and a drop
    /// failure for whoever checks next. For waits that keep memory safe on an error path,
    /// which must not swallow reports meant for the user.
    ///
    /// # Errors
    ///
    /// CUDA errors of the wait itself.
    pub(crate) fn wait_idle(&self) -> Result<()> {
        match &self.shared.backend {
            StreamBackend::Host(q) => {
                q.wait_idle();
                Ok(())
            }
            StreamBackend::Cuda(s) => s.wait_idle(),
        }
    }

    /// True when all queued work has finished; does not block.
    ///
    /// # Errors
    ///
    /// As [`Stream::synchronize`], without the drop report.
    pub fn query(&self) -> Result<bool> {
        match &self.shared.backend {
            StreamBackend::Host(q) => q.query(),
            StreamBackend::Cuda(s) => s.query(),
        }
    }

    /// Makes work queued on this stream after this call wait until `event`'s most recent
    /// record (at the time of this call) has completed. Waiting on an event never recorded
    /// waits for nothing.
    ///
    /// Across backends: a host stream waiting on a CUDA event queues a job that synchronizes
    /// the event (it may wait for a later record, never an earlier one); a CUDA stream waiting
    /// on a host event blocks the calling thread until that record has completed.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::sync::Arc;
    /// use cuferry::{Device, Event, Stream};
    ///
    /// let (a, b) = (Stream::new(Device::Host)?, Stream::new(Device::Host)?);
    /// let done = Arc::new(AtomicBool::new(false));
    /// let d = Arc::clone(&done);
    /// a.host_fn(move || {
    ///     std::thread::sleep(std::time::Duration::from_millis(20));
    ///     d.store(true, Ordering::SeqCst);
    /// })?;
    /// let ev = Event::new(Device::Host)?;
    /// ev.record(&a)?;
    /// b.wait_event(&ev)?;
    /// let seen = Arc::new(AtomicBool::new(false));
    /// let (d, s) = (Arc::clone(&done), Arc::clone(&seen));
    /// b.host_fn(move || s.store(d.load(Ordering::SeqCst), Ordering::SeqCst))?;
    /// b.synchronize()?;
    /// assert!(seen.load(Ordering::SeqCst));
    /// # Ok::<(), cuferry::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaStreamWaitEvent`/`cudaEventSynchronize`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        match (&self.shared.backend, event.backend()) {
            (StreamBackend::Host(q), EventBackend::Host(state)) => {
                let Some(generation) = state.pending_generation() else {
                    return Ok(());
                };
                let state = Arc::clone(state);
                q.submit(Box::new(move || state.wait(generation)))
            }
            (StreamBackend::Host(q), EventBackend::Cuda(ev)) => {
                let ev = Arc::clone(ev);
                let device = event.device();
                q.submit(Box::new(move || {
                    // The worker thread may have no current device: without this, the wait
                    // would create a context on device 0.
                    if let Device::Cuda(ordinal) = device {
                        crate::cuda::device::make_current(ordinal)?;
                    }
                    ev.synchronize()
                }))
            }
            (StreamBackend::Cuda(s), EventBackend::Cuda(ev)) => {
                crate::cuda::stream::wait_event(s.queue_handle(), ev.raw)
            }
            (StreamBackend::Cuda(_), EventBackend::Host(state)) => match state.pending_generation() {
                Some(generation) => state.wait(generation),
                None => Ok(()),
            },
        }
    }

    /// Queues `f` to run on the host after the work queued before it; later work waits for it.
    ///
    /// On CUDA streams `f` runs on a CUDA-owned thread and **must not call CUDA**, directly or
    /// by dropping cuferry buffers or streams (CUDA forbids it and may deadlock). On the host
    /// backend `f` may drop device and pinned buffers and linop arrays with work pending (their
    /// frees are deferred until that work has run). Calls in `f` that wait for work queued
    /// behind `f` on the same stream fail at once with [`Error::InvalidArgument`]: this stream's
    /// `synchronize`, the synchronous copies through it (`to_vec`, `copy_from_slice`, ...),
    /// and dropping a [`HostRegistration`](crate::HostRegistration) or a managed buffer with
    /// such work queued (the drop then leaks the memory and records the error for
    /// [`take_drop_error`]). A wait that reaches that work only through another stream (a copy
    /// on a second stream ordered after it) blocks forever. A panic in `f`
    /// is caught and reported by the next [`Stream::synchronize`]. If the work before `f` hit a
    /// device error, `f` is dropped without running (on the CUDA thread) and `synchronize`
    /// reports the error.
    ///
    /// # Errors
    ///
    /// The CUDA error of `cudaStreamAddCallback`; on the host, a dead worker thread.
    pub fn host_fn<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        match &self.shared.backend {
            StreamBackend::Host(q) => q.submit(Box::new(move || {
                f();
                Ok(())
            })),
            StreamBackend::Cuda(s) => s.host_fn(Box::new(f)),
        }
    }

    /// [`Stream::host_fn`] for short memory-only work: on a host stream with nothing pending,
    /// `f` runs at once on the calling thread (in queue order, see the host queue's rules);
    /// otherwise, and on CUDA streams, it is queued like `host_fn`. `f` must not block on other
    /// streams' work (the caller may hold locks while it runs).
    pub(crate) fn host_fn_short<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        match &self.shared.backend {
            StreamBackend::Host(q) => q.submit_or_run(Box::new(move || {
                f();
                Ok(())
            })),
            StreamBackend::Cuda(_) => self.host_fn(f),
        }
    }

    /// The CUDA handle of a CUDA stream, for the capability modules to queue work on; the
    /// stream's device is made current first on a thread with no context (so the runtime
    /// does not create one on device 0 for the call that follows).
    pub(crate) fn cuda_raw(&self) -> Result<crate::cuda::stream::RawStream> {
        match &self.shared.backend {
            StreamBackend::Cuda(s) => Ok(s.queue_handle()),
            StreamBackend::Host(_) => Err(Error::invalid("a CUDA operation was queued on a host stream")),
        }
    }
}
