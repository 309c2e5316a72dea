//! `PinnedBuffer<T>`: page-locked host memory, the fast end of host <-> device copies.
//!
//! Rules: see the [memory module](crate::memory). On CUDA it is `cudaHostAlloc` memory
//! (portable: usable with every device); write-combining and mapping are explicit options,
//! never defaults (write-combined memory is ~70x slower for the CPU to read). On the host
//! backend it is ordinary page-aligned memory.

use std::marker::PhantomData;

use super::allocation::{byte_len, TrackedAllocation};
use super::cache::Place;
use super::sealed::{RawParts, Sealed};
use super::{Element, Memory, MemoryKind};
use crate::device::Device;
use crate::error::Result;
use crate::sys;

/// How pinned memory is allocated (`cudaHostAlloc` flags). The default is plain portable
/// pinned memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedOptions {
    /// Write-combined: faster for the device to read over PCIe, very slow for the CPU to read.
    pub write_combined: bool,
    /// Mapped into the device address space (zero-copy access from kernels).
    pub mapped: bool,
}

impl PinnedOptions {
    fn flags(self) -> u32 {
        let mut flags = sys::CUFERRY_PINNED_PORTABLE;
        if self.write_combined {
            flags |= sys::CUFERRY_PINNED_WRITE_COMBINED;
        }
        if self.mapped {
            flags |= sys::CUFERRY_PINNED_MAPPED;
        }
        flags as u32
    }
}

/// A buffer of page-locked host memory.
///
/// # Examples
///
/// ```
/// use cuferry::{Device, PinnedBuffer};
/// let mut buf = PinnedBuffer::<u8>::zeroed(Device::Host, 4)?;
/// buf.as_mut_slice()?.copy_from_slice(&[1, 2, 3, 4]);
/// assert_eq!(buf.as_slice()?, &[1, 2, 3, 4]);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Debug)]
pub struct PinnedBuffer<T: Element> {
    alloc: TrackedAllocation,
    len: usize,
    device: Device,
    _element: PhantomData<T>,
}

impl<T: Element> PinnedBuffer<T> {
    /// Leaks the memory (see [`TrackedAllocation::leak`]): MPI may still use it.
    #[cfg(feature = "mpi")]
    pub(crate) fn leak(self) {
        self.alloc.leak();
    }

    /// `len` zeroed elements of pinned memory for use with `device`.
    ///
    /// # Errors
    ///
    /// Size overflow; CUDA errors of `cudaHostAlloc`.
    pub fn zeroed(device: Device, len: usize) -> Result<Self> {
        Self::with_options(device, len, PinnedOptions::default())
    }

    /// `len` elements of portable pinned memory for use with `device`, from the allocation
    /// [cache](super::cache) (linop's transfer staging): memory an earlier staging buffer of
    /// the same device and size class gave up, or a fresh zeroed allocation. Dropped with work
    /// pending it goes to the reaper; once its work has finished it goes back to the cache.
    /// The contents are unspecified: stale elements of an earlier buffer, or zeros.
    ///
    /// # Errors
    ///
    /// As [`PinnedBuffer::zeroed`].
    pub(crate) fn staging(device: Device, len: usize) -> Result<Self> {
        let place = match device {
            Device::Host => Place::Host,
            Device::Cuda(i) => Place::CudaPinned(i),
        };
        let (alloc, _) = TrackedAllocation::cached(place, byte_len::<T>(len)?)?;
        Ok(PinnedBuffer { alloc, len, device, _element: PhantomData })
    }

    /// Like [`PinnedBuffer::zeroed`] with explicit allocation options (ignored on the host
    /// backend).
    ///
    /// # Errors
    ///
    /// As [`PinnedBuffer::zeroed`].
    pub fn with_options(device: Device, len: usize, options: PinnedOptions) -> Result<Self> {
        let bytes = byte_len::<T>(len)?;
        let alloc = match device {
            Device::Host => TrackedAllocation::host_zeroed(bytes)?,
            Device::Cuda(i) => TrackedAllocation::cuda_pinned_zeroed(i, bytes, options.flags())?,
        };
        Ok(PinnedBuffer { alloc, len, device, _element: PhantomData })
    }

    /// Pinned memory holding a copy of `data`.
    ///
    /// # Errors
    ///
    /// As [`PinnedBuffer::zeroed`].
    pub fn from_slice(device: Device, data: &[T]) -> Result<Self> {
        let mut buf = Self::zeroed(device, data.len())?;
        buf.as_mut_slice()?.copy_from_slice(data);
        Ok(buf)
    }

    /// The contents, after waiting for every queued operation on the buffer.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.alloc.tracker.wait_idle()?;
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: the memory holds `len` initialised `T` (zeroed or written since; `T: Pod`),
        // is aligned (page-aligned allocation), lives as long as `self`, and no queued
        // operation writes it (we waited, and queueing a write needs `&mut self`).
        Ok(unsafe { std::slice::from_raw_parts(self.alloc.ptr().cast::<T>(), self.len) })
    }

    /// The contents for writing, after waiting for every queued operation on the buffer.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.alloc.tracker.wait_idle()?;
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.alloc.ptr().cast::<T>(), self.len) })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory was allocated for.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw host pointer (null when empty). Accesses through it are not ordered with queued
    /// copies: call [`PinnedBuffer::synchronize`] first.
    pub fn as_ptr(&self) -> *const T {
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
}

impl<T: Element> Sealed for PinnedBuffer<T> {
    fn raw_parts(&self) -> RawParts<'_> {
        RawParts { ptr: self.alloc.ptr(), bytes: self.alloc.bytes(), tracker: &self.alloc.tracker }
    }
}

impl<T: Element> Memory<T> for PinnedBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        match self.device {
            Device::Host => MemoryKind::Pageable,
            Device::Cuda(_) => MemoryKind::Pinned,
        }
    }
}
