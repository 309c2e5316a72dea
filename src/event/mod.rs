//! Events: markers recorded on a stream, to wait for, query, or time.
//!
//! Rules:
//! - [`Event::record`] captures the work queued on the stream so far; the event completes when
//!   that work has finished. Recording again replaces the previous record (CUDA semantics).
//! - An event never recorded counts as complete: `query` is true and waiting returns at once.
//! - An event is recorded only on a stream of its own device.
//! - Timing ([`Event::elapsed_ms`]) needs both events made with [`Event::with_timing`] and both
//!   records complete. On the host backend the time is taken when the worker reaches the record
//!   or, recorded on an idle stream, at the call (the stream has nothing before it to run).
//! - Dropping an event with a record pending is legal; waits already queued on it still work.
//!
//! # Examples
//!
//! ```
//! use cuferry::{Device, Event, Stream};
//! let stream = Stream::new(Device::Host)?;
//! let (start, end) = (Event::with_timing(Device::Host)?, Event::with_timing(Device::Host)?);
//! start.record(&stream)?;
//! stream.host_fn(|| std::thread::sleep(std::time::Duration::from_millis(5)))?;
//! end.record(&stream)?;
//! end.synchronize()?;
//! assert!(start.query()? && end.query()?);
//! assert!(start.elapsed_ms(&end)? >= 4.0);
//! # Ok::<(), cuferry::Error>(())
//! ```

pub(crate) mod host;

use std::sync::Arc;

use crate::cuda::event::{self as raw, RawEvent};
use crate::device::Device;
use crate::error::{record_drop_error, Error, Result};
use crate::stream::{Stream, StreamBackend};
use host::HostEventState;

/// A marker in a stream's work. See the [module docs](self) for its rules.
#[derive(Debug)]
pub struct Event {
    device: Device,
    timing: bool,
    backend: EventBackend,
}

/// The one place where the two backends differ. Shared so that queued waits keep it alive.
pub(crate) enum EventBackend {
    Host(Arc<HostEventState>),
    Cuda(Arc<CudaEvent>),
}

impl std::fmt::Debug for EventBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventBackend::Host(_) => f.write_str("Host"),
            EventBackend::Cuda(e) => write!(f, "Cuda({:?})", e.raw),
        }
    }
}

/// An owned `cudaEvent_t` of device `device`. Its query, wait and destroy may run on threads
/// that never chose a device (host stream workers, the reaper, a user's thread dropping host
/// memory that a CUDA stream used): each first makes `device` current where no context is
/// (`ensure_context`), so that none is created on device 0.
pub(crate) struct CudaEvent {
    pub(crate) raw: RawEvent,
    device: u32,
}

impl CudaEvent {
    /// `cudaEventSynchronize`.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.ensure_context();
        raw::synchronize(self.raw)
    }

    /// `cudaEventQuery`: true when the last record completed.
    fn query(&self) -> Result<bool> {
        self.ensure_context();
        raw::query(self.raw)
    }

    fn ensure_context(&self) {
        // A failure leaves the CUDA call that follows to report its own error.
        let _ = crate::cuda::device::ensure_context(self.device);
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        self.ensure_context();
        // SAFETY: the handle is owned here and never used after this point; CUDA allows
        // destroying an event whose record is pending.
        if let Err(err) = unsafe { raw::destroy(self.raw) } {
            record_drop_error(err);
        }
    }
}

impl Event {
    /// An event without timing (cheaper to record on CUDA).
    ///
    /// # Errors
    ///
    /// For CUDA devices: as [`Stream::new`].
    pub fn new(device: Device) -> Result<Self> {
        Self::create(device, false)
    }

    /// An event that can be used with [`Event::elapsed_ms`].
    ///
    /// # Errors
    ///
    /// For CUDA devices: as [`Stream::new`].
    pub fn with_timing(device: Device) -> Result<Self> {
        Self::create(device, true)
    }

    fn create(device: Device, timing: bool) -> Result<Self> {
        let backend = match device {
            Device::Host => EventBackend::Host(Arc::default()),
            Device::Cuda(i) => {
                EventBackend::Cuda(Arc::new(CudaEvent { raw: raw::create(i, timing)?, device: i }))
            }
        };
        Ok(Event { device, timing, backend })
    }

    /// The device the event belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the event records time.
    pub fn has_timing(&self) -> bool {
        self.timing
    }

    pub(crate) fn backend(&self) -> &EventBackend {
        &self.backend
    }

    /// Records the event at the current end of `stream`'s queue.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `stream` belongs to another device; CUDA errors of
    /// `cudaEventRecord`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device {
            return Err(Error::invalid(format!(
                "an event of {} cannot be recorded on a stream of {}",
                self.device,
                stream.device()
            )));
        }
        match (&self.backend, stream.backend()) {
            (EventBackend::Host(state), StreamBackend::Host(q)) => state.record_on(q),
            (EventBackend::Cuda(ev), StreamBackend::Cuda(s)) => raw::record(ev.raw, s.queue_handle()),
            _ => Err(Error::invalid("event and stream belong to different backends")),
        }
    }

    /// True when the latest record has completed (or there was none); does not block.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventQuery`.
    pub fn query(&self) -> Result<bool> {
        match &self.backend {
            EventBackend::Host(state) => Ok(state.pending_generation().is_none()),
            EventBackend::Cuda(ev) => ev.query(),
        }
    }

    /// Blocks until the latest record (at the time of the call) has completed.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`. On the host backend, [`Error::InvalidArgument`]
    /// at once when called from a job of the stream the pending record is on (a
    /// [`Stream::host_fn`](crate::Stream::host_fn) closure): the record completes after that
    /// job, so the wait would never end.
    pub fn synchronize(&self) -> Result<()> {
        match &self.backend {
            EventBackend::Host(state) => match state.pending_generation() {
                Some(generation) => state.wait(generation),
                None => Ok(()),
            },
            EventBackend::Cuda(ev) => ev.synchronize(),
        }
    }

    /// Milliseconds from this event's latest record to `end`'s latest record.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when either event lacks timing or the two are of different
    /// backends; on the host backend also when one was never recorded or has not completed.
    /// On CUDA those cases are CUDA's errors of `cudaEventElapsedTime` (`cudaErrorNotReady`
    /// before completion, `cudaErrorInvalidResourceHandle` for a never-recorded event or
    /// events of two devices).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::invalid("elapsed_ms needs two events made with Event::with_timing"));
        }
        match (&self.backend, &end.backend) {
            (EventBackend::Host(a), EventBackend::Host(b)) => {
                let ((rec_a, at_a), (rec_b, at_b)) = (a.timing(), b.timing());
                if !rec_a || !rec_b {
                    return Err(Error::invalid("elapsed_ms on an event that was never recorded"));
                }
                match (at_a, at_b) {
                    (Some(t0), Some(t1)) => Ok(if t1 >= t0 {
                        t1.duration_since(t0).as_secs_f32() * 1e3
                    } else {
                        -(t0.duration_since(t1).as_secs_f32() * 1e3)
                    }),
                    _ => Err(Error::invalid("elapsed_ms before both records completed")),
                }
            }
            (EventBackend::Cuda(a), EventBackend::Cuda(b)) => {
                a.ensure_context();
                raw::elapsed_ms(a.raw, b.raw)
            }
            _ => Err(Error::invalid("elapsed_ms between events of different backends")),
        }
    }
}
