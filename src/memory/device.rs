//! `DeviceBuffer<T>`: memory of one device.
//!
//! Rules: see the [memory module](crate::memory). On CUDA it is `cudaMalloc` memory, freed
//! after its queued uses; on the host backend it is page-aligned host memory.

use std::marker::PhantomData;

use super::allocation::{byte_len, TrackedAllocation};
use super::cache::Place;
use super::pageable::PageableSlice;
use super::sealed::{RawParts, Sealed};
use super::tracker::{Access, UseTracker};
use super::{Element, Memory, MemoryKind};
use crate::copy::copy_range;
use crate::cuda::memory as raw;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::stream::Stream;

/// A buffer of `len` elements of `T` in one device's memory.
///
/// # Examples
///
/// ```
/// use cuferry::{Device, DeviceBuffer, Stream};
/// let stream = Stream::new(Device::Host)?;
/// let buf = DeviceBuffer::from_slice(&stream, &[1.5f64, 2.5])?;
/// assert_eq!(buf.len(), 2);
/// assert_eq!(buf.to_vec(&stream)?, vec![1.5, 2.5]);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Debug)]
pub struct DeviceBuffer<T: Element> {
    alloc: TrackedAllocation,
    len: usize,
    device: Device,
    _element: PhantomData<T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// Drops the record of past uses, and the streams and events it holds, when every one has
    /// finished; keeps it otherwise (a later user must still wait for them). For memory set
    /// aside for reuse (the halo buffer pool): an idle buffer must not keep its past users'
    /// streams (a host stream's worker thread, a CUDA stream) alive.
    pub(crate) fn forget_finished_uses(&mut self) {
        if let Device::Cuda(ordinal) = self.device {
            // Querying CUDA events on a thread with no current device would create a context
            // on device 0 (see the allocation's drop). A failure leaves the query to report it.
            let _ = crate::cuda::device::make_current(ordinal);
        }
        if matches!(self.alloc.tracker.is_idle(), Ok(true)) {
            self.alloc.forget_uses();
        }
    }

    /// Leaks the memory (see [`TrackedAllocation::leak`]): MPI may still use it.
    #[cfg(feature = "mpi")]
    pub(crate) fn leak(self) {
        self.alloc.leak();
    }

    /// Allocates `len` elements on `device` without initialising them.
    ///
    /// # Safety
    ///
    /// 1. The contents are unspecified until written: do not read them (copy them out) before
    ///    writing every element.
    ///
    /// # Errors
    ///
    /// Size overflow; CUDA errors of `cudaMalloc` (out of memory, no device, ...).
    pub unsafe fn uninit(device: Device, len: usize) -> Result<Self> {
        let bytes = byte_len::<T>(len)?;
        let alloc = match device {
            Device::Host => TrackedAllocation::host_zeroed(bytes)?,
            Device::Cuda(i) => TrackedAllocation::cuda_device(i, bytes)?,
        };
        Ok(DeviceBuffer { alloc, len, device, _element: PhantomData })
    }

    /// The buffer, freed after its queued work by the reaper instead of waiting in `drop`
    /// (the reaper's tests; linop's arrays are [cached](DeviceBuffer::uninit_cached), which
    /// defers them too).
    #[cfg(test)]
    pub(crate) fn with_deferred_free(mut self) -> Self {
        self.alloc.defer_free();
        self
    }

    /// Allocates `len` elements on `device` from the allocation [cache](super::cache): memory
    /// an earlier cached buffer of the same device and size class gave up, or a fresh
    /// allocation. Dropped with work pending it goes to the reaper; once its work has finished
    /// it goes back to the cache (linop's arrays).
    ///
    /// # Safety
    ///
    /// 1. As [`DeviceBuffer::uninit`]: the contents (stale bytes of an earlier buffer, or
    ///    uninitialised device memory) are not to be read before every element is written.
    ///
    /// # Errors
    ///
    /// As [`DeviceBuffer::uninit`].
    pub(crate) unsafe fn uninit_cached(device: Device, len: usize) -> Result<Self> {
        let buf = Self::cached(device, len)?.0;
        #[cfg(debug_assertions)]
        buf.poison_host_bytes();
        Ok(buf)
    }

    /// Debug builds: fills host memory handed out uninitialised with 0xff bytes (NaN in every
    /// float type), so an element that the work meant to overwrite it missed shows in tests
    /// instead of reading as a fresh allocation's zero.
    #[cfg(debug_assertions)]
    fn poison_host_bytes(&self) {
        let (ptr, bytes) = (self.alloc.ptr(), self.alloc.bytes());
        if self.device == Device::Host && bytes > 0 {
            // SAFETY: host memory of `bytes` bytes, just allocated or taken idle from the cache
            // (no queued work uses it), and owned by this buffer alone.
            unsafe { std::ptr::write_bytes(ptr, 0xff, bytes) };
        }
    }

    /// A cached buffer (see [`DeviceBuffer::uninit_cached`]) and whether its memory was
    /// reused; a fresh host one comes zeroed, any other one's contents are unspecified.
    fn cached(device: Device, len: usize) -> Result<(Self, bool)> {
        let place = match device {
            Device::Host => Place::Host,
            Device::Cuda(i) => Place::CudaDevice(i),
        };
        let (alloc, reused) = TrackedAllocation::cached(place, byte_len::<T>(len)?)?;
        Ok((DeviceBuffer { alloc, len, device, _element: PhantomData }, reused))
    }

    /// [`DeviceBuffer::zeroed`] from the allocation cache (see
    /// [`DeviceBuffer::uninit_cached`]): reused memory is zeroed by a job queued on `stream`,
    /// on the host backend too.
    ///
    /// # Errors
    ///
    /// As [`DeviceBuffer::zeroed`].
    pub(crate) fn zeroed_cached(stream: &Stream, len: usize) -> Result<Self> {
        let (buf, reused) = Self::cached(stream.device(), len)?;
        if reused || buf.device != Device::Host {
            buf.queue_zeroing(stream)?;
        }
        Ok(buf)
    }

    /// [`DeviceBuffer::from_slice`] from the allocation cache (see
    /// [`DeviceBuffer::uninit_cached`]).
    ///
    /// # Errors
    ///
    /// As [`DeviceBuffer::from_slice`].
    pub(crate) fn from_slice_cached(stream: &Stream, data: &[T]) -> Result<Self> {
        let (mut buf, _) = Self::cached(stream.device(), data.len())?;
        buf.copy_from_slice(stream, data)?;
        Ok(buf)
    }

    /// Allocates `len` zeroed elements on `stream`'s device; on CUDA the zeroing is queued on
    /// `stream` (later uses on any stream are ordered after it).
    ///
    /// # Errors
    ///
    /// As [`DeviceBuffer::uninit`], and CUDA errors of `cudaMemsetAsync`.
    pub fn zeroed(stream: &Stream, len: usize) -> Result<Self> {
        // SAFETY: every byte is set to zero below before anyone can read it (host memory comes
        // zeroed; CUDA memory gets a memset ordered before every later use).
        let buf = unsafe { Self::uninit(stream.device(), len)? };
        if let Device::Cuda(_) = buf.device {
            buf.queue_zeroing(stream)?;
        }
        Ok(buf)
    }

    /// Queues on `stream` the zeroing of every byte (a memset on CUDA, a job on a host stream),
    /// ordered after every earlier use and before every later one.
    pub(crate) fn queue_zeroing(&self, stream: &Stream) -> Result<()> {
        let (ptr, bytes) = (self.alloc.ptr(), self.alloc.bytes());
        if bytes == 0 {
            return Ok(());
        }
        UseTracker::use_on(stream, &[(&self.alloc.tracker, Access::Write)], || match self.device {
            // SAFETY: the allocation is alive until its tracker is idle, which Drop awaits.
            Device::Cuda(_) => unsafe { raw::memset_async(ptr.cast(), 0, bytes, stream.cuda_raw()?) },
            Device::Host => {
                let target = HostBytes(ptr, bytes);
                // SAFETY: host memory, alive until the tracker is idle; this job is recorded
                // on it as a write, so nothing else touches it meanwhile.
                stream.host_fn_short(move || unsafe { target.zero() })
            }
        })
    }

    /// Allocates on `stream`'s device and copies `data` in. Returns once `data` has been read.
    ///
    /// # Errors
    ///
    /// As [`DeviceBuffer::uninit`] and [`crate::copy()`].
    pub fn from_slice(stream: &Stream, data: &[T]) -> Result<Self> {
        // SAFETY: every element is written by the copy below before the buffer is returned.
        let mut buf = unsafe { Self::uninit(stream.device(), data.len())? };
        buf.copy_from_slice(stream, data)?;
        Ok(buf)
    }

    /// Copies `data` (ordinary host memory) into the buffer through `stream`; returns once the
    /// copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the lengths differ, or when called from a job of
    /// `stream` (a host stream; the copy would wait for itself); errors of [`crate::copy()`].
    pub fn copy_from_slice(&mut self, stream: &Stream, data: &[T]) -> Result<()> {
        check_len(data.len(), self.len)?;
        self.copy_from_slice_at(stream, 0, data)
    }

    /// Copies `data` (ordinary host memory) into the buffer from element `offset` on, through
    /// `stream`; returns once the copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is out of bounds, or when called from a job of
    /// `stream` (a host stream; the copy would wait for itself); errors of [`crate::copy()`].
    pub fn copy_from_slice_at(&mut self, stream: &Stream, offset: usize, data: &[T]) -> Result<()> {
        let src = PageableSlice::new(stream, data)?;
        copy_range(stream, &src, 0, self, offset, data.len())?;
        src.wait()
    }

    /// Copies the buffer into `out` (ordinary host memory) through `stream`; returns once the
    /// copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the lengths differ, or when called from a job of
    /// `stream` (a host stream; the copy would wait for itself); errors of [`crate::copy()`].
    pub fn copy_to_slice(&self, stream: &Stream, out: &mut [T]) -> Result<()> {
        check_len(self.len, out.len())?;
        self.copy_to_slice_at(stream, 0, out)
    }

    /// Copies `out.len()` elements from element `offset` on into `out` (ordinary host memory)
    /// through `stream`; returns once the copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is out of bounds, or when called from a job of
    /// `stream` (a host stream; the copy would wait for itself); errors of [`crate::copy()`].
    pub fn copy_to_slice_at(&self, stream: &Stream, offset: usize, out: &mut [T]) -> Result<()> {
        let len = out.len();
        let mut dst = PageableSlice::new_mut(stream, out)?;
        copy_range(stream, self, offset, &mut dst, 0, len)?;
        dst.wait()
    }

    /// Copies the buffer into a new `Vec` through `stream`; returns once the copy finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when called from a job of `stream` (a host stream; the copy
    /// would wait for itself); errors of [`crate::copy()`].
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.copy_to_slice(stream, &mut out)?;
        Ok(out)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw device pointer, for passing to kernels or other libraries. Null when empty.
    /// Work queued through it is not tracked: order it yourself (or call
    /// [`DeviceBuffer::synchronize`] first).
    pub fn as_ptr(&self) -> *const T {
        self.alloc.ptr().cast()
    }

    /// The raw device pointer for writing; see [`DeviceBuffer::as_ptr`].
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.alloc.ptr().cast()
    }

    /// Blocks until every operation queued on this buffer has finished.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn synchronize(&self) -> Result<()> {
        self.alloc.tracker.wait_idle()
    }

    /// Frees the buffer now, after the operations queued on it (a cached allocation goes
    /// back to the cache), and returns what fails: dropping does the same but can only keep
    /// errors for [`take_drop_error`](crate::take_drop_error). Called from a host stream's
    /// job with work still pending, the free waits in the background as a drop's does.
    ///
    /// # Errors
    ///
    /// CUDA errors of the wait (the memory is then leaked: the queued work may still use it)
    /// or of the free.
    pub fn free(self) -> Result<()> {
        self.alloc.free()
    }

    /// True when no queued operation on this buffer is pending; does not block.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventQuery`.
    pub fn is_idle(&self) -> Result<bool> {
        self.alloc.tracker.is_idle()
    }
}

pub(crate) fn check_len(src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(Error::invalid(format!("length mismatch: source has {src} elements, destination {dst}")))
    }
}

/// Host memory handed to a zeroing job on a host stream's worker.
struct HostBytes(*mut u8, usize);

// SAFETY: the job writes the memory only while its tracker records the job (see
// `queue_zeroing`), which is what the tracker protocol exists for.
unsafe impl Send for HostBytes {}

impl HostBytes {
    /// Sets every byte to zero.
    ///
    /// # Safety
    ///
    /// 1. The bytes are host memory, writable, and nothing else accesses them during the call.
    unsafe fn zero(self) {
        // SAFETY: precondition 1.
        unsafe { std::ptr::write_bytes(self.0, 0, self.1) }
    }
}

impl<T: Element> Sealed for DeviceBuffer<T> {
    fn raw_parts(&self) -> RawParts<'_> {
        RawParts { ptr: self.alloc.ptr(), bytes: self.alloc.bytes(), tracker: &self.alloc.tracker }
    }
}

impl<T: Element> Memory<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Device(self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::test_gate::Gate;

    /// A buffer set aside for reuse keeps the record of a use still queued (a later user
    /// must wait for it) and drops it, with the stream it names, once the use finished.
    #[test]
    fn finished_uses_are_forgotten_and_pending_ones_kept() {
        let stream = Stream::new(Device::Host).unwrap();
        let mut buf = DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap();
        let gate = Gate::hold(&stream);
        buf.queue_zeroing(&stream).unwrap();
        buf.forget_finished_uses();
        assert_eq!(buf.alloc.tracker.remembered(), 1, "a pending use was forgotten");
        drop(gate); // opens it
        buf.synchronize().unwrap();
        buf.forget_finished_uses();
        assert_eq!(buf.alloc.tracker.remembered(), 0, "a finished use kept its stream");
    }
}
