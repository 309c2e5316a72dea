//! Raw allocations behind the buffer types, freed only after their queued work.
//!
//! Rules:
//! - Host-backend memory is page-aligned (4096 bytes) ordinary memory; zero bytes allocate
//!   nothing.
//! - CUDA device memory comes from `cudaMalloc`, pinned memory from `cudaHostAlloc`.
//! - `Drop` waits for the tracker (every queued use) and then frees; failures are kept for
//!   [`take_drop_error`](crate::take_drop_error), never panicked on.

use std::alloc::{self, Layout};
use std::os::raw::c_void;
use std::ptr::NonNull;

use crate::cuda::memory as raw;
use crate::error::{record_drop_error, Error, Result};
use crate::memory::tracker::UseTracker;

/// Alignment of host-backend allocations.
pub(crate) const HOST_ALIGN: usize = 4096;

/// Where an allocation came from, and so how it is freed.
#[derive(Debug)]
pub(crate) enum Origin {
    /// `std::alloc` with this layout; `None` for zero bytes.
    Host(Option<(NonNull<u8>, Layout)>),
    /// `cudaMalloc` on this ordinal (null for zero bytes).
    CudaDevice(u32),
    /// `cudaHostAlloc` (null for zero bytes).
    CudaPinned,
}

/// An allocation plus the tracker of its queued uses.
#[derive(Debug)]
pub(crate) struct TrackedAllocation {
    ptr: *mut u8,
    bytes: usize,
    origin: Origin,
    pub(crate) tracker: UseTracker,
}

// SAFETY: the allocation is plain memory owned by this value; access is synchronised by the
// owning buffer's borrow rules and the tracker.
unsafe impl Send for TrackedAllocation {}
// SAFETY: as above; shared access only reads the pointer and uses the tracker's mutex.
unsafe impl Sync for TrackedAllocation {}

/// `len * size_of::<T>()`, or an error naming the overflow (or a zero-sized or over-aligned
/// element type).
pub(crate) fn byte_len<T>(len: usize) -> Result<usize> {
    // A zero-sized element would make a non-empty buffer of zero bytes, whose null pointer no
    // slice may be built on; no transfer needs one.
    if std::mem::size_of::<T>() == 0 {
        return Err(Error::invalid(format!("zero-sized element type {}", std::any::type_name::<T>())));
    }
    // Every allocator aligns to at least this much (CUDA device memory to 256, host and
    // pinned memory to a page): a more-aligned element type could get a misaligned slice.
    if std::mem::align_of::<T>() > super::MAX_ELEMENT_ALIGN {
        return Err(Error::invalid(format!(
            "element type {} is aligned to {} bytes, more than a buffer guarantees ({})",
            std::any::type_name::<T>(),
            std::mem::align_of::<T>(),
            super::MAX_ELEMENT_ALIGN
        )));
    }
    len.checked_mul(std::mem::size_of::<T>()).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
        Error::invalid(format!("{len} elements of {} bytes overflow", std::mem::size_of::<T>()))
    })
}

impl TrackedAllocation {
    /// Zeroed page-aligned host memory.
    pub(crate) fn host_zeroed(bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Ok(Self::new(std::ptr::null_mut(), 0, Origin::Host(None)));
        }
        let layout = Layout::from_size_align(bytes, HOST_ALIGN)
            .map_err(|e| Error::invalid(format!("host allocation of {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or_else(|| {
            Error::unsupported(format!("host allocation of {bytes} bytes failed (out of memory)"))
        })?;
        Ok(Self::new(ptr.as_ptr(), bytes, Origin::Host(Some((ptr, layout)))))
    }

    /// Uninitialised device memory.
    pub(crate) fn cuda_device(ordinal: u32, bytes: usize) -> Result<Self> {
        let ptr = raw::device_alloc(ordinal, bytes)?;
        Ok(Self::new(ptr.cast(), bytes, Origin::CudaDevice(ordinal)))
    }

    /// Pinned host memory (`CUFERRY_PINNED_*` flags), zeroed on the host.
    pub(crate) fn cuda_pinned_zeroed(ordinal: u32, bytes: usize, flags: u32) -> Result<Self> {
        let ptr = raw::pinned_alloc(ordinal, bytes, flags)?;
        if !ptr.is_null() {
            // SAFETY: `ptr` is a fresh host allocation of `bytes` bytes that nothing else uses.
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        }
        Ok(Self::new(ptr.cast(), bytes, Origin::CudaPinned))
    }

    fn new(ptr: *mut u8, bytes: usize, origin: Origin) -> Self {
        TrackedAllocation { ptr, bytes, origin, tracker: UseTracker::default() }
    }

    /// The start of the memory (null when `bytes == 0`).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for TrackedAllocation {
    fn drop(&mut self) {
        if let Err(err) = self.tracker.wait_idle() {
            // The queued work's fate is unknown: leaking is the only safe choice.
            record_drop_error(err);
            return;
        }
        let freed = match self.origin {
            Origin::Host(None) => Ok(()),
            Origin::Host(Some((ptr, layout))) => {
                // SAFETY: `ptr` came from `alloc_zeroed` with this very layout, and every
                // queued use has finished (wait_idle above).
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
                Ok(())
            }
            // SAFETY: the pointer came from `device_alloc` on `ordinal`; no queued work uses it.
            Origin::CudaDevice(ordinal) => unsafe { raw::device_free(ordinal, self.ptr.cast::<c_void>()) },
            // SAFETY: the pointer came from `pinned_alloc`; no queued work uses it.
            Origin::CudaPinned => unsafe { raw::pinned_free(self.ptr.cast::<c_void>()) },
        };
        if let Err(err) = freed {
            record_drop_error(err);
        }
    }
}
