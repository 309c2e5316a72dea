//! `ManagedBuffer<T>`: one managed allocation, freed in stream order.
//!
//! Rules:
//! - A buffer is allocated on a stream (stream-ordered for CUDA pools); its first use on another
//!   stream waits for the allocation. Later uses are ordered by its use tracker, like every
//!   cuferry buffer (reads on several streams at once, a write after every earlier use).
//! - Dropping the buffer frees it in stream order on the stream of one of its remembered uses
//!   (the last write or a read since), made to wait for the others, without a host wait for
//!   CUDA pools (`cudaFreeAsync` after every use); when a use is on a host stream or another
//!   device's, and for the fallback and host kinds, the host waits first.
//! - Host access goes through `as_slice`/`as_mut_slice`, which wait for queued uses first.
//! - `prefetch` and `advise_*` need `concurrentManagedAccess` on CUDA (else
//!   [`Error::Unsupported`] naming it); on the host backend, prefetch to the host and advice
//!   are no-ops that still validate their range; prefetch to a device is unsupported there.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::bulk::{self, ManagedRange};
use super::location::{Advice, Location};
use super::pool::{ManagedPool, PoolInner, PoolKind};
use crate::cuda::memory as raw_memory;
use crate::device::Device;
use crate::error::{record_drop_error, Error, Result};
use crate::memory::allocation::byte_len;
use crate::memory::sealed::{RawParts, Sealed};
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{Element, Memory, MemoryKind};
use crate::stream::Stream;

/// Source of allocation ids (unique per process): bulk calls count an allocation once by it.
static NEXT_ALLOCATION: AtomicU64 = AtomicU64::new(1);

/// A managed allocation of `len` elements of `T`. See the [module docs](crate::managed).
#[derive(Debug)]
pub struct ManagedBuffer<T: Element> {
    pool: Arc<PoolInner>,
    ptr: *mut u8,
    len: usize,
    id: u64,
    tracker: UseTracker,
    _element: PhantomData<T>,
}

// SAFETY: the memory is owned by this value; shared access only reads the pointer and goes
// through the tracker's mutex, and host access is borrow-checked.
unsafe impl<T: Element> Send for ManagedBuffer<T> {}
// SAFETY: as above.
unsafe impl<T: Element> Sync for ManagedBuffer<T> {}

impl ManagedPool {
    /// `len` zeroed elements, allocated (and zeroed) in order on `stream`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0`, a size overflow or a stream of another
    /// device; allocation errors (out of memory, ...).
    pub fn alloc<T: Element>(&self, len: usize, stream: &Stream) -> Result<ManagedBuffer<T>> {
        let buf = self.allocate::<T>(len, stream, true)?;
        if let PoolKind::ManagedPool | PoolKind::MallocManaged = self.inner.kind {
            let (ptr, bytes) = (buf.ptr, buf.bytes());
            UseTracker::use_on(stream, &[(&buf.tracker, Access::Write)], || {
                // SAFETY: the allocation lives until every use its tracker remembers has run
                // (Drop frees in stream order after them).
                unsafe { raw_memory::memset_async(ptr.cast(), 0, bytes, stream.cuda_raw()?) }
            })?;
        }
        Ok(buf)
    }

    /// `len` elements without initialising them, allocated in order on `stream`.
    ///
    /// # Safety
    ///
    /// 1. The contents are unspecified until written: do not read them before writing.
    ///
    /// # Errors
    ///
    /// As [`ManagedPool::alloc`].
    pub unsafe fn alloc_uninit<T: Element>(&self, len: usize, stream: &Stream) -> Result<ManagedBuffer<T>> {
        self.allocate(len, stream, false)
    }

    /// Allocates; host memory is zeroed when `zero_host` (CUDA memory is zeroed, if wanted, by
    /// the caller's memset).
    fn allocate<T: Element>(&self, len: usize, stream: &Stream, zero_host: bool) -> Result<ManagedBuffer<T>> {
        if stream.device() != self.inner.device {
            return Err(Error::invalid(format!(
                "a pool of {} allocates on its own device's streams, not one of {}",
                self.inner.device,
                stream.device()
            )));
        }
        let bytes = byte_len::<T>(len)?;
        let raw_stream = match self.inner.kind {
            PoolKind::ManagedPool => Some(stream.cuda_raw()?),
            _ => None,
        };
        let ptr = self.inner.alloc_raw(bytes, raw_stream, zero_host)?;
        Ok(ManagedBuffer {
            pool: Arc::clone(&self.inner),
            ptr,
            len,
            id: NEXT_ALLOCATION.fetch_add(1, Ordering::Relaxed),
            // Only the stream-ordered pool's memory becomes usable at a point of `stream`; the
            // host pool's and cudaMallocManaged's are usable at once (their zeroing, if any, is
            // a tracked write). An origin there made a host read wait for the stream, which
            // from a job of that stream failed and leaked the buffer.
            tracker: match self.inner.kind {
                PoolKind::ManagedPool => UseTracker::with_origin(stream.clone()),
                _ => UseTracker::default(),
            },
            _element: PhantomData,
        })
    }
}

impl<T: Element> ManagedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements (never, pools refuse empty allocations).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device of the pool it came from.
    pub fn device(&self) -> Device {
        self.pool.device
    }

    /// The unified address, valid on the host and on devices (for kernels and other
    /// libraries; work queued through it is not tracked).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.cast()
    }

    /// The unified address for writing; see [`ManagedBuffer::as_ptr`].
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.cast()
    }

    /// Host access is safe only where the CPU may touch managed memory while the device runs
    /// kernels (`concurrentManagedAccess`); elsewhere any kernel running on the device, this
    /// buffer's or not, makes a CPU access fault.
    fn check_host_access(&self) -> Result<()> {
        if self.pool.kind == PoolKind::Host || self.pool.caps.concurrent_managed_access {
            return Ok(());
        }
        Err(Error::unsupported(format!(
            "host access to managed memory needs concurrentManagedAccess, which {} lacks; copy it out instead",
            self.pool.device
        )))
    }

    /// The contents on the host, after waiting for every queued use.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] on a device without `concurrentManagedAccess`; CUDA errors of the
    /// wait.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.check_host_access()?;
        self.tracker.wait_idle()?;
        // SAFETY: `len` initialised `T` (zeroed or written, `T: Pod`) at a host-accessible,
        // suitably aligned address; no queued use is pending and a queued write needs `&mut`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.cast::<T>(), self.len) })
    }

    /// The contents on the host for writing, after waiting for every queued use.
    ///
    /// # Errors
    ///
    /// As [`ManagedBuffer::as_slice`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.check_host_access()?;
        self.tracker.wait_idle()?;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<T>(), self.len) })
    }

    /// Blocks until every queued use has finished.
    ///
    /// # Errors
    ///
    /// CUDA errors of the wait.
    pub fn synchronize(&self) -> Result<()> {
        self.tracker.wait_idle()
    }

    /// The whole buffer as a range for the bulk functions.
    pub fn range(&self) -> ManagedRange<'_> {
        ManagedRange::new(self.id, self.ptr, 0, self.bytes(), &self.pool, &self.tracker)
    }

    /// Elements `elements` as a range for the bulk functions.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is empty or out of bounds.
    pub fn subrange(&self, elements: Range<usize>) -> Result<ManagedRange<'_>> {
        let why = if elements.start >= elements.end {
            "is empty or reversed"
        } else if elements.end > self.len {
            "reaches past the end"
        } else {
            ""
        };
        if !why.is_empty() {
            return Err(Error::invalid(format!(
                "range {elements:?} {why} (a buffer of {} elements)",
                self.len
            )));
        }
        let size = std::mem::size_of::<T>();
        Ok(ManagedRange::new(
            self.id,
            self.ptr,
            elements.start * size,
            elements.end * size,
            &self.pool,
            &self.tracker,
        ))
    }

    /// Migrates the pages to `location`, queued on `stream`; returns the bytes prefetched.
    ///
    /// # Errors
    ///
    /// See the module rules; CUDA errors of `cudaMemPrefetchAsync`.
    pub fn prefetch(&self, location: Location, stream: &Stream) -> Result<usize> {
        bulk::prefetch_all(&[self.range()], location, stream)
    }

    /// Gives `advice` for the whole buffer.
    ///
    /// # Errors
    ///
    /// See the module rules; [`Error::Unsupported`] where the driver refuses advice on
    /// managed-pool memory (see [`advise_all`](super::advise_all)); CUDA errors of
    /// `cudaMemAdvise`.
    pub fn advise(&self, advice: Advice) -> Result<usize> {
        bulk::advise_all(&[self.range()], advice)
    }

    /// Prefers `location` for the pages (`cudaMemAdviseSetPreferredLocation`).
    ///
    /// # Errors
    ///
    /// As [`ManagedBuffer::advise`].
    pub fn advise_preferred_location(&self, location: Location) -> Result<usize> {
        self.advise(Advice::SetPreferredLocation(location))
    }

    /// Maps the pages for `location`'s device (`cudaMemAdviseSetAccessedBy`).
    ///
    /// # Errors
    ///
    /// As [`ManagedBuffer::advise`].
    pub fn advise_accessed_by(&self, location: Location) -> Result<usize> {
        self.advise(Advice::SetAccessedBy(location))
    }

    /// Marks the pages read-mostly (`cudaMemAdviseSetReadMostly`).
    ///
    /// # Errors
    ///
    /// As [`ManagedBuffer::advise`].
    pub fn advise_read_mostly(&self) -> Result<usize> {
        self.advise(Advice::SetReadMostly)
    }

    /// Discards the contents (no migration of stale pages), queued on `stream`. On the host
    /// backend the bytes become [`DISCARDED_BYTE`](super::DISCARDED_BYTE); on CUDA only the
    /// whole CPU pages inside the buffer are discarded (the partial pages at its ends, which
    /// other allocations may share, keep their bytes).
    ///
    /// # Safety
    ///
    /// 1. The contents are indeterminate afterwards: write (or prefetch-and-write) before
    ///    reading them.
    /// 2. No slice from [`ManagedBuffer::as_slice`] is alive: the discard changes the bytes
    ///    under it.
    ///
    /// # Errors
    ///
    /// As [`discard_all`](super::discard_all).
    pub unsafe fn discard(&self, stream: &Stream) -> Result<usize> {
        // SAFETY: the caller's preconditions 1 and 2.
        unsafe { bulk::discard_all(&[self.range()], stream) }
    }
}

impl<T: Element> Drop for ManagedBuffer<T> {
    fn drop(&mut self) {
        let bytes = self.bytes();
        if let Device::Cuda(i) = self.pool.device {
            // Dropped on a thread with no current device (a host stream's worker, a user's new
            // thread), the stream waits and the free below would create a context on device 0.
            let _ = crate::cuda::device::ensure_context(i);
        }
        let freed = match self.pool.kind {
            PoolKind::ManagedPool => match self
                .tracker
                .join_uses_on(|s| s.device() == self.pool.device && s.cuda_raw().is_ok())
                .and_then(|joined| joined.map(|s| s.cuda_raw()).transpose())
            {
                // Free in stream order after every remembered use (the last write and each
                // reader's stream, joined on one of their streams): no host wait.
                // SAFETY: every use is queued on (or ordered before) the joined stream.
                Ok(Some(stream)) => unsafe { self.pool.free_raw(self.ptr, bytes, Some(stream)) },
                // A use on a host stream (managed memory is host-accessible) or on another
                // device's stream (whose queued free the pool's recycling, which synchronizes
                // only the pool's device, would not wait for), or a failed join: wait for every
                // use, then free in order on the CUDA stream it was allocated on.
                _ => self.tracker.wait_idle().and_then(|()| {
                    let origin = self.tracker.origin().map(Stream::cuda_raw).transpose()?;
                    // SAFETY: every use has finished; the free needs a CUDA stream (else an error).
                    unsafe { self.pool.free_raw(self.ptr, bytes, origin) }
                }),
            },
            _ => match self.tracker.wait_idle() {
                // SAFETY: every use has finished.
                Ok(()) => unsafe { self.pool.free_raw(self.ptr, bytes, None) },
                // The queued work's fate is unknown: leak rather than free under it.
                Err(e) => Err(e),
            },
        };
        if let Err(e) = freed {
            record_drop_error(e);
        }
    }
}

impl<T: Element> Sealed for ManagedBuffer<T> {
    fn raw_parts(&self) -> RawParts<'_> {
        RawParts { ptr: self.ptr, bytes: self.bytes(), tracker: &self.tracker }
    }
}

impl<T: Element> Memory<T> for ManagedBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        match self.pool.kind {
            PoolKind::Host => MemoryKind::Pageable,
            _ => MemoryKind::Managed(self.pool.device),
        }
    }
}
