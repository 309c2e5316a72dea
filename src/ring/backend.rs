//! Transfer backends: the slots and the copy engine under a [`SlotRing`](super::SlotRing).
//!
//! Rules:
//! - A backend owns host slots (pinned by `cudaHostAlloc`, or caller memory registered with
//!   `cudaHostRegister`, slot by slot or, when the driver refuses neighbours on one page, as
//!   one range; pageable where the driver refuses even that: see `caller_slots`) and device
//!   slots, and one copy stream on which every upload is queued.
//! - "Upload done" for a host slot is the slot's own use tracker: the host waits on it before
//!   the slot is rewritten ([`TransferBackend::wait_host_slot`]).
//! - "Ready" for a device slot is an event recorded right after its upload.
//! - "Consumed" for a device slot is recorded on the consumer's stream at release; the next
//!   upload into that slot is queued behind it on the device (no host wait), so a device slot
//!   is overwritten only after everything the consumer queued before releasing it. The copy
//!   stream waits for it before the upload's timing starts and before `ready` is recorded,
//!   whether or not there are bytes to copy.
//! - [`StreamTransferBackend`] runs on both devices: on CUDA with a CUDA copy stream and pinned
//!   slots; on the host with a worker-thread stream and ordinary memory, the same protocol.

use std::time::{Duration, Instant};

use crate::copy::copy_bytes_marked;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::memory::sealed::Sealed;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{DeviceBuffer, Memory, MemoryKind, PinnedBuffer};
use crate::stream::Stream;

use super::caller_slots::{CallerSlot, CallerSlots};
use super::MAX_RING_DEPTH;

/// Which kind of device a backend serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceFamily {
    /// The host backend.
    Host,
    /// A CUDA device.
    Cuda,
}

/// What a backend can do (the seed's capability flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferCapabilities {
    /// The device family.
    pub device_family: DeviceFamily,
    /// The kind of memory of the host slots (pageable when none were registered or pinned).
    pub host_memory_kind: MemoryKind,
    /// Whether every host slot is page-locked.
    pub host_pinned: bool,
    /// Whether `submit_upload` returns before the copy has run (on CUDA, only when every host
    /// slot is page-locked: an upload from pageable memory waits for the copy stream).
    pub supports_async_submit: bool,
    /// Whether uploads can be timed on the device.
    pub supports_timing_events: bool,
}

/// The operations a [`SlotRing`](super::SlotRing) needs from a transfer backend. Slot indices
/// are `0..host_slot_count()` and `0..device_slot_count()`.
pub trait TransferBackend: Send + Sync {
    /// What the backend can do.
    fn capabilities(&self) -> TransferCapabilities;

    /// The device uploads go to.
    fn device(&self) -> Device;

    /// Allocates `count` host slots of `bytes` each (pinned where the backend can), replacing
    /// any earlier host slots.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for more than [`MAX_RING_DEPTH`] slots; allocation failures.
    fn allocate_host_slots(&mut self, count: usize, bytes: usize) -> Result<()>;

    /// Uses caller memory as host slots, one slot per `Vec`, each registered (page-locked)
    /// where the driver allows and pageable otherwise; replaces any earlier host slots, which
    /// are released first (after a failure there are none). The memory is not handed back.
    /// [`StreamTransferBackend`] registers heap neighbours sharing a page as one range when
    /// the driver refuses them one by one, so they are all page-locked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for more than [`MAX_RING_DEPTH`] slots; as
    /// [`Device::check_available`]; CUDA errors of `cudaHostRegister` other than
    /// "unsupported"/"already registered".
    fn register_host_slots(&mut self, slots: Vec<Vec<u8>>) -> Result<()>;

    /// Allocates `count` device slots of `bytes` each, replacing any earlier device slots.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for more than [`MAX_RING_DEPTH`] slots; allocation failures.
    fn allocate_device_slots(&mut self, count: usize, bytes: usize) -> Result<()>;

    /// Number of host slots.
    fn host_slot_count(&self) -> usize;

    /// Number of device slots.
    fn device_slot_count(&self) -> usize;

    /// Bytes of the smallest slot, host and device alike: the most one upload can carry.
    fn slot_bytes(&self) -> usize;

    /// The bytes of a host slot, for the producer to fill.
    ///
    /// # Safety
    ///
    /// 1. The caller has exclusive use of host slot `host` (no other slice of it exists and no
    ///    other thread fills it) until the returned slice is dropped.
    /// 2. The slot's last upload has finished ([`TransferBackend::wait_host_slot`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an index out of range.
    #[allow(clippy::mut_from_ref)] // exclusivity is the caller's contract (Safety, 1)
    unsafe fn host_slot_mut(&self, host: usize) -> Result<&mut [u8]>;

    /// Blocks until the last upload from host slot `host` has finished.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the wait.
    fn wait_host_slot(&self, host: usize) -> Result<()>;

    /// True when the last upload from host slot `host` has finished; must not block: the
    /// ring's bounded waits ([`SlotRing::try_acquire`](super::SlotRing::try_acquire),
    /// `acquire_timeout`, `produce_timeout`) poll it and keep their deadline only if it
    /// returns at once.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the query.
    fn host_slot_idle(&self, host: usize) -> Result<bool>;

    /// Queues the upload of the first `bytes` bytes of host slot `host` into device slot
    /// `device`, ordered after the device slot's consumed point, and records the ready event.
    /// Returns the host time the submission took.
    ///
    /// # Safety
    ///
    /// 1. The caller has exclusive use of both slots: nothing fills `host` until
    ///    [`TransferBackend::wait_host_slot`] says the upload finished, and no consumer holds
    ///    `device` (it was released, or never handed out).
    ///
    /// # Errors
    ///
    /// Indices or size out of range; CUDA errors of the copy or event record.
    unsafe fn submit_upload(&self, host: usize, device: usize, bytes: usize) -> Result<Duration>;

    /// Device milliseconds of the last upload into `device`, when timing is on and it finished.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the timing query.
    fn upload_device_ms(&self, device: usize) -> Result<Option<f32>>;

    /// True when the last upload into `device` has finished; does not block.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the query.
    fn ready_query(&self, device: usize) -> Result<bool>;

    /// Blocks until the last upload into `device` has finished.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the wait.
    fn synchronize_ready(&self, device: usize) -> Result<()>;

    /// Makes work queued on `stream` after this call wait for the last upload into `device`.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the wait.
    fn wait_stream_for_ready(&self, device: usize, stream: &Stream) -> Result<()>;

    /// Records that the consumer is done with `device` once `stream` reaches this point (the
    /// consumed event); the next upload into it waits for that on the device.
    ///
    /// # Errors
    ///
    /// Index out of range; CUDA errors of the record.
    fn release(&self, device: usize, stream: &Stream) -> Result<()>;

    /// The memory of device slot `device`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an index out of range.
    fn device_slot(&self, device: usize) -> Result<&DeviceBuffer<u8>>;

    /// Waits for every queued upload; the backend stays usable.
    ///
    /// # Errors
    ///
    /// CUDA errors of the wait.
    fn close(&self) -> Result<()>;
}

/// The host slots: allocated pinned buffers, or caller memory.
#[derive(Debug)]
enum HostSlots {
    Allocated(Vec<PinnedBuffer<u8>>),
    Caller(CallerSlots),
}

impl HostSlots {
    fn count(&self) -> usize {
        match self {
            HostSlots::Allocated(v) => v.len(),
            HostSlots::Caller(c) => c.slots().len(),
        }
    }

    fn get(&self, i: usize) -> Option<HostSlot<'_>> {
        match self {
            HostSlots::Allocated(v) => v.get(i).map(HostSlot::Pinned),
            HostSlots::Caller(c) => c.slots().get(i).map(HostSlot::Caller),
        }
    }

    fn iter(&self) -> impl Iterator<Item = HostSlot<'_>> {
        (0..self.count()).filter_map(|i| self.get(i))
    }
}

/// One host slot's memory.
#[derive(Clone, Copy, Debug)]
enum HostSlot<'a> {
    Pinned(&'a PinnedBuffer<u8>),
    Caller(&'a CallerSlot),
}

impl<'a> HostSlot<'a> {
    fn len(self) -> usize {
        match self {
            HostSlot::Pinned(b) => b.len(),
            HostSlot::Caller(c) => c.len(),
        }
    }

    fn kind(self) -> MemoryKind {
        match self {
            HostSlot::Pinned(b) => b.kind(),
            HostSlot::Caller(c) => c.kind(),
        }
    }

    fn synchronize(self) -> Result<()> {
        self.parts().tracker.wait_idle()
    }

    fn is_idle(self) -> Result<bool> {
        self.parts().tracker.is_idle()
    }

    fn parts(self) -> crate::memory::sealed::RawParts<'a> {
        match self {
            HostSlot::Pinned(b) => b.raw_parts(),
            HostSlot::Caller(c) => c.raw_parts(),
        }
    }
}

/// One device slot: its memory, the event recorded after its last upload, and optional timing.
#[derive(Debug)]
struct DeviceSlot {
    buffer: DeviceBuffer<u8>,
    ready: Event,
    timing: Option<(Event, Event)>,
}

/// The transfer backend for both devices, built on cuferry's streams, events and copies. See
/// the [module docs](crate::ring).
///
/// # Examples
///
/// ```
/// use cuferry::ring::{DeviceFamily, StreamTransferBackend, TransferBackend};
/// use cuferry::{Device, Stream};
///
/// let mut backend = StreamTransferBackend::new(Device::Host, false)?;
/// backend.allocate_host_slots(2, 1024)?;
/// backend.allocate_device_slots(2, 1024)?;
/// assert_eq!(backend.capabilities().device_family, DeviceFamily::Host);
/// // SAFETY: nothing else uses the slots in this example.
/// unsafe {
///     backend.host_slot_mut(0)?.fill(9);
///     backend.submit_upload(0, 1, 1024)?;
/// }
/// backend.synchronize_ready(1)?;
/// let stream = Stream::new(Device::Host)?;
/// assert_eq!(backend.device_slot(1)?.to_vec(&stream)?, vec![9u8; 1024]);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Debug)]
pub struct StreamTransferBackend {
    device: Device,
    copy_stream: Stream,
    timing: bool,
    host_slots: HostSlots,
    device_slots: Vec<DeviceSlot>,
}

impl StreamTransferBackend {
    /// A backend for `device` with its own copy stream and no slots yet; `timing` adds a pair
    /// of timing events per device slot.
    ///
    /// # Errors
    ///
    /// As [`Stream::new`].
    pub fn new(device: Device, timing: bool) -> Result<Self> {
        Ok(StreamTransferBackend {
            device,
            copy_stream: Stream::new(device)?,
            timing,
            host_slots: HostSlots::Allocated(Vec::new()),
            device_slots: Vec::new(),
        })
    }

    /// The stream uploads are queued on.
    pub fn copy_stream(&self) -> &Stream {
        &self.copy_stream
    }

    fn host(&self, i: usize) -> Result<HostSlot<'_>> {
        self.host_slots
            .get(i)
            .ok_or_else(|| Error::invalid(format!("host slot {i} of {}", self.host_slots.count())))
    }

    fn dev(&self, i: usize) -> Result<&DeviceSlot> {
        self.device_slots
            .get(i)
            .ok_or_else(|| Error::invalid(format!("device slot {i} of {}", self.device_slots.len())))
    }
}

impl TransferBackend for StreamTransferBackend {
    fn capabilities(&self) -> TransferCapabilities {
        let host_memory_kind = self.host_slots.get(0).map_or(MemoryKind::Pageable, HostSlot::kind);
        let host_pinned =
            self.host_slots.count() > 0 && self.host_slots.iter().all(|s| s.kind() == MemoryKind::Pinned);
        TransferCapabilities {
            device_family: if self.device.is_host() { DeviceFamily::Host } else { DeviceFamily::Cuda },
            host_memory_kind,
            host_pinned,
            // From pageable memory `cudaMemcpyAsync` waits for the copy stream's earlier work
            // (CUDA's API synchronization rules): a registration the driver refused makes
            // every submission of the ring synchronous.
            supports_async_submit: self.device.is_host() || host_pinned,
            supports_timing_events: self.timing,
        }
    }

    fn device(&self) -> Device {
        self.device
    }

    fn allocate_host_slots(&mut self, count: usize, bytes: usize) -> Result<()> {
        check_slot_count(count)?;
        let slots =
            (0..count).map(|_| PinnedBuffer::zeroed(self.device, bytes)).collect::<Result<Vec<_>>>()?;
        self.host_slots = HostSlots::Allocated(slots);
        Ok(())
    }

    fn register_host_slots(&mut self, slots: Vec<Vec<u8>>) -> Result<()> {
        check_slot_count(slots.len())?;
        // The earlier slots are unregistered first: a new slot on a page (or bytes) one of
        // them still held would be refused and stay pageable for the ring's whole life.
        self.host_slots = HostSlots::Allocated(Vec::new());
        self.host_slots = HostSlots::Caller(CallerSlots::new(self.device, slots)?);
        Ok(())
    }

    fn allocate_device_slots(&mut self, count: usize, bytes: usize) -> Result<()> {
        check_slot_count(count)?;
        let mut slots = Vec::with_capacity(count);
        for _ in 0..count {
            let timing = if self.timing {
                Some((Event::with_timing(self.device)?, Event::with_timing(self.device)?))
            } else {
                None
            };
            slots.push(DeviceSlot {
                buffer: DeviceBuffer::zeroed(&self.copy_stream, bytes)?,
                ready: Event::new(self.device)?,
                timing,
            });
        }
        self.device_slots = slots;
        Ok(())
    }

    fn host_slot_count(&self) -> usize {
        self.host_slots.count()
    }

    fn device_slot_count(&self) -> usize {
        self.device_slots.len()
    }

    fn slot_bytes(&self) -> usize {
        let host = self.host_slots.iter().map(HostSlot::len).min().unwrap_or(0);
        let dev = self.device_slots.iter().map(|s| s.buffer.len()).min().unwrap_or(0);
        host.min(dev)
    }

    unsafe fn host_slot_mut(&self, host: usize) -> Result<&mut [u8]> {
        let parts = self.host(host)?.parts();
        if parts.bytes == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the slot's memory is a live allocation of `parts.bytes` bytes owned by this
        // backend; the caller has exclusive use of it and its upload finished (Safety 1, 2).
        Ok(unsafe { std::slice::from_raw_parts_mut(parts.ptr, parts.bytes) })
    }

    fn wait_host_slot(&self, host: usize) -> Result<()> {
        self.host(host)?.synchronize()
    }

    fn host_slot_idle(&self, host: usize) -> Result<bool> {
        self.host(host)?.is_idle()
    }

    unsafe fn submit_upload(&self, host: usize, device: usize, bytes: usize) -> Result<Duration> {
        let started = Instant::now();
        let (h, d) = (self.host(host)?, self.dev(device)?);
        if bytes > h.len() || bytes > d.buffer.len() {
            return Err(Error::invalid(format!(
                "upload of {bytes} bytes from a {}-byte host slot into a {}-byte device slot",
                h.len(),
                d.buffer.len()
            )));
        }
        let (hp, dp) = (h.parts(), d.buffer.raw_parts());
        let marks = d.timing.as_ref().map(|(start, end)| (start, end));
        // SAFETY: both ranges are inside their slots (checked above); the caller guarantees
        // nothing else writes the device slot (Safety 1). The copy (and its timing) is queued
        // after the copy stream waited for the slot's consumed point; with 0 bytes the wait is
        // still queued, so `ready` below never comes before the consumer's release.
        unsafe {
            copy_bytes_marked(
                &self.copy_stream,
                (h.kind(), &hp, 0),
                (d.buffer.kind(), &dp, 0),
                bytes,
                marks,
            )?;
        }
        d.ready.record(&self.copy_stream)?;
        Ok(started.elapsed())
    }

    fn upload_device_ms(&self, device: usize) -> Result<Option<f32>> {
        match &self.dev(device)?.timing {
            Some((start, end)) if end.query()? => start.elapsed_ms(end).map(Some),
            _ => Ok(None),
        }
    }

    fn ready_query(&self, device: usize) -> Result<bool> {
        self.dev(device)?.ready.query()
    }

    fn synchronize_ready(&self, device: usize) -> Result<()> {
        self.dev(device)?.ready.synchronize()
    }

    fn wait_stream_for_ready(&self, device: usize, stream: &Stream) -> Result<()> {
        stream.wait_event(&self.dev(device)?.ready)
    }

    fn release(&self, device: usize, stream: &Stream) -> Result<()> {
        let d = self.dev(device)?;
        let tracker: &UseTracker = d.buffer.raw_parts().tracker;
        // An empty use on the consumer's stream: the slot's next upload is ordered after it.
        // Declared a write: the consumer's untracked work on the slot may have written it, and
        // a write orders every later use (the next upload included) after this point, as the
        // rule before shared reads did.
        UseTracker::use_on(stream, &[(tracker, Access::Write)], || Ok(()))
    }

    fn device_slot(&self, device: usize) -> Result<&DeviceBuffer<u8>> {
        Ok(&self.dev(device)?.buffer)
    }

    fn close(&self) -> Result<()> {
        self.copy_stream.synchronize()
    }
}

/// Refuses more slots than a ring has ([`MAX_RING_DEPTH`]) before anything is allocated.
pub(super) fn check_slot_count(count: usize) -> Result<()> {
    if count > MAX_RING_DEPTH {
        return Err(Error::invalid(format!("{count} slots exceed the most a ring has ({MAX_RING_DEPTH})")));
    }
    Ok(())
}

/// The transfer backend for `device` with `ring_depth` host and device slots still to be
/// allocated (the ring does it with its slot size): [`StreamTransferBackend`] without timing.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a depth of 0 or over [`MAX_RING_DEPTH`] (checked before the
/// device is touched); as [`Stream::new`].
pub fn build_transfer_backend(device: Device, ring_depth: usize) -> Result<Box<dyn TransferBackend>> {
    if ring_depth == 0 {
        return Err(Error::invalid("ring depth must be at least 1"));
    }
    check_slot_count(ring_depth)?;
    Ok(Box::new(StreamTransferBackend::new(device, false)?))
}
