//! `DeviceBuffer<T>`: memory of one device.
//!
//! Rules: see the [memory module](crate::memory). On CUDA it is `cudaMalloc` memory, freed
//! after its queued uses; on the host backend it is page-aligned host memory.

use std::marker::PhantomData;

use super::allocation::{byte_len, TrackedAllocation};
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
    /// (linop's arrays).
    pub(crate) fn with_deferred_free(mut self) -> Self {
        self.alloc.defer_free();
        self
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
            let (ptr, bytes) = (buf.alloc.ptr(), buf.alloc.bytes());
            UseTracker::use_on(stream, &[(&buf.alloc.tracker, Access::Write)], || {
                // SAFETY: the allocation is alive until its tracker is idle, which Drop awaits.
                unsafe { raw::memset_async(ptr.cast(), 0, bytes, stream.cuda_raw()?) }
            })?;
        }
        Ok(buf)
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
    /// [`Error::InvalidArgument`] when the lengths differ; errors of [`crate::copy()`].
    pub fn copy_from_slice(&mut self, stream: &Stream, data: &[T]) -> Result<()> {
        check_len(data.len(), self.len)?;
        self.copy_from_slice_at(stream, 0, data)
    }

    /// Copies `data` (ordinary host memory) into the buffer from element `offset` on, through
    /// `stream`; returns once the copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is out of bounds; errors of [`crate::copy()`].
    pub fn copy_from_slice_at(&mut self, stream: &Stream, offset: usize, data: &[T]) -> Result<()> {
        let src = PageableSlice::new(data);
        copy_range(stream, &src, 0, self, offset, data.len())?;
        src.wait()
    }

    /// Copies the buffer into `out` (ordinary host memory) through `stream`; returns once the
    /// copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the lengths differ; errors of [`crate::copy()`].
    pub fn copy_to_slice(&self, stream: &Stream, out: &mut [T]) -> Result<()> {
        check_len(self.len, out.len())?;
        self.copy_to_slice_at(stream, 0, out)
    }

    /// Copies `out.len()` elements from element `offset` on into `out` (ordinary host memory)
    /// through `stream`; returns once the copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is out of bounds; errors of [`crate::copy()`].
    pub fn copy_to_slice_at(&self, stream: &Stream, offset: usize, out: &mut [T]) -> Result<()> {
        let len = out.len();
        let mut dst = PageableSlice::new_mut(out);
        copy_range(stream, self, offset, &mut dst, 0, len)?;
        dst.wait()
    }

    /// Copies the buffer into a new `Vec` through `stream`; returns once the copy finished.
    ///
    /// # Errors
    ///
    /// Errors of [`crate::copy()`].
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
