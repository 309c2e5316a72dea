//! Raw allocations behind the buffer types, freed only after their queued work.
//!
//! Rules:
//! - Host-backend memory is page-aligned (4096 bytes) ordinary memory; zero bytes allocate
//!   nothing.
//! - CUDA device memory comes from `cudaMalloc`, pinned memory from `cudaHostAlloc`.
//! - `Drop` waits for the tracker (every queued use) and then frees; failures are kept for
//!   [`take_drop_error`](crate::take_drop_error), never panicked on;
//!   [`TrackedAllocation::free`] does the same and returns them instead. An allocation marked
//!   for deferred freeing (a cached one, or in tests `defer_free`) is handed to the
//!   [reaper](super::reaper) instead of waiting, when its work has not finished and the
//!   reaper's caps on pending frees allow. A dropped CUDA allocation makes its device current
//!   before querying its tracker, as the reaper does: on a thread with no current device (a
//!   host stream's worker, a new thread) the query would create a context on device 0.
//! - An allocation made through the [cache](super::cache) ([`TrackedAllocation::cached`]) is
//!   deferred as above and, once its work has finished, goes back to the cache instead of
//!   being freed (freed when the cache is full). It is made at its size class, or at the exact
//!   size asked for when the class does not fit in memory (and then never cached).
//! - An allocation that fails for lack of memory frees the memory of the kind it draws on
//!   ([`DrawsOn`]: host and pinned memory, its device's, or for managed memory all of it)
//!   that the cache holds, that is leaving the cache, or that waits in the reaper for its
//!   work ([`reaper::drain_where`](super::reaper::drain_where)), and is tried once more.

use std::alloc::{self, Layout};
use std::os::raw::c_void;
use std::ptr::NonNull;

use super::cache::{self, Cache, Place, ServedBy};
use crate::cuda::memory as raw;
use crate::error::{record_drop_error, Error, Result};
use crate::memory::reaper::{self, Capped};
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
    /// `cudaHostAlloc` with this ordinal current (null for zero bytes).
    CudaPinned(u32),
}

/// An allocation plus the tracker of its queued uses.
#[derive(Debug)]
pub(crate) struct TrackedAllocation {
    ptr: *mut u8,
    /// The bytes asked for (what buffers and copies see).
    bytes: usize,
    /// The bytes allocated: `bytes`, or its size class for a cached allocation.
    capacity: usize,
    origin: Origin,
    pub(crate) tracker: UseTracker,
    /// Freed by the reaper after the queued work instead of waiting for it in `drop`.
    deferred: bool,
    /// Given back to the cache once idle instead of being freed.
    recycle: bool,
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

/// The memory an allocation draws on, and so the cached memory whose release can help it
/// when it fails for lack of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DrawsOn {
    /// Host memory: the host backend's buffers and pinned memory of every ordinal.
    Host,
    /// The memory of one CUDA device.
    Device(u32),
    /// Either (managed memory lives on the host or a device).
    Any,
}

impl DrawsOn {
    /// Whether releasing memory cached at `place` frees memory this allocation draws on.
    pub(crate) fn covers(self, place: Place) -> bool {
        match (self, place) {
            (DrawsOn::Any, _) => true,
            (DrawsOn::Host, Place::Host | Place::CudaPinned(_)) => true,
            (DrawsOn::Device(i), Place::CudaDevice(j)) => i == j,
            _ => false,
        }
    }
}

/// Runs `alloc`; when it fails for lack of memory, frees what the memory it `draws_on` is
/// held by and runs it once more: cached memory, memory on its way out of the cache, and
/// deferred frees (waiting for their work; not for another device's). Other places' cached
/// memory stays. Every allocation cuferry makes on a device or in pinned memory goes through
/// here (buffers and managed pools).
pub(crate) fn retry_after_deferred_frees<R>(
    draws_on: DrawsOn,
    alloc: impl FnMut() -> Result<R>,
) -> Result<R> {
    retry_after_frees_in(cache::global(), draws_on, || false, alloc)
}

/// [`retry_after_deferred_frees`], except that no memory is freed (and `alloc` does not run
/// again) when `hopeless()` says, once `alloc` failed for lack of memory, that nothing freed
/// could help (an allocator at a limit of its own).
pub(crate) fn retry_after_deferred_frees_unless<R>(
    draws_on: DrawsOn,
    hopeless: impl FnOnce() -> bool,
    alloc: impl FnMut() -> Result<R>,
) -> Result<R> {
    retry_after_frees_in(cache::global(), draws_on, hopeless, alloc)
}

/// [`retry_after_deferred_frees`] with `cache` for the process's cache.
///
/// Memory moves from the cache to [`Leaving`](cache::Leaving) to the reaper's pending frees
/// (evictions), and from the pending frees to the cache (their work done). Memory in any of
/// the three when `alloc` failed is freed before it runs again, by following those moves:
/// release the cache; wait for what is leaving (now pending); drain the pending frees (now
/// freed or cached); release the cache again. Inside a host stream's job only the releases
/// run: the waits could be for work queued behind that job. The second try runs whatever
/// was found, since the three cannot be read at one instant.
fn retry_after_frees_in<R>(
    cache: &Cache,
    draws_on: DrawsOn,
    hopeless: impl FnOnce() -> bool,
    mut alloc: impl FnMut() -> Result<R>,
) -> Result<R> {
    let covers = |p| draws_on.covers(p);
    match alloc() {
        Err(err) if err.is_out_of_memory() && hopeless() => Err(err),
        Err(err) if err.is_out_of_memory() => {
            cache.release_where(covers);
            if !crate::stream::host::in_job() {
                cache.wait_for_leaving(covers);
                super::reaper::drain_where(covers);
                cache.release_where(covers);
            }
            alloc()
        }
        other => other,
    }
}

/// `allocate(capacity)`, or, when that fails for lack of memory and `capacity` (a size class)
/// is larger than the `bytes` asked for, `allocate(bytes)`: a class is up to a quarter
/// larger, and memory the exact size would fit in must not be refused. (The first call
/// already freed what the cache and the pending frees held, before its own retry.)
fn class_or_exact(
    capacity: usize,
    bytes: usize,
    mut allocate: impl FnMut(usize) -> Result<TrackedAllocation>,
) -> Result<TrackedAllocation> {
    match allocate(capacity) {
        Err(err) if capacity > bytes && err.is_out_of_memory() => allocate(bytes),
        other => other,
    }
}

impl TrackedAllocation {
    /// Leaks the memory (never freed, never cached): for memory another party (MPI) may still
    /// read or write. The tracker's uses are dropped, so the streams they name are not kept
    /// alive with it.
    #[cfg(feature = "mpi")]
    pub(crate) fn leak(mut self) {
        self.forget_uses();
        std::mem::forget(self);
    }

    /// Zeroed page-aligned host memory.
    pub(crate) fn host_zeroed(bytes: usize) -> Result<Self> {
        retry_after_deferred_frees(DrawsOn::Host, || Self::try_host_zeroed(bytes))
    }

    fn try_host_zeroed(bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Ok(Self::new(std::ptr::null_mut(), 0, Origin::Host(None)));
        }
        // The only refusal: a size that, rounded up to the alignment, passes isize::MAX.
        let layout = Layout::from_size_align(bytes, HOST_ALIGN).map_err(|_| {
            Error::invalid(format!("host allocation of {bytes} bytes: larger than any allocation can be"))
        })?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| Error::out_of_memory(format!("a host allocation of {bytes} bytes failed")))?;
        Ok(Self::new(ptr.as_ptr(), bytes, Origin::Host(Some((ptr, layout)))))
    }

    /// Uninitialised device memory.
    pub(crate) fn cuda_device(ordinal: u32, bytes: usize) -> Result<Self> {
        let ptr = retry_after_deferred_frees(DrawsOn::Device(ordinal), || raw::device_alloc(ordinal, bytes))?;
        Ok(Self::new(ptr.cast(), bytes, Origin::CudaDevice(ordinal)))
    }

    /// Pinned host memory (`CUFERRY_PINNED_*` flags), zeroed on the host.
    pub(crate) fn cuda_pinned_zeroed(ordinal: u32, bytes: usize, flags: u32) -> Result<Self> {
        let ptr = retry_after_deferred_frees(DrawsOn::Host, || raw::pinned_alloc(ordinal, bytes, flags))?;
        if !ptr.is_null() {
            // SAFETY: `ptr` is a fresh host allocation of `bytes` bytes that nothing else uses.
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        }
        Ok(Self::new(ptr.cast(), bytes, Origin::CudaPinned(ordinal)))
    }

    /// At least `bytes` bytes at `place` from the process's [cache](super::cache), or a fresh
    /// allocation of its size class; marked to be deferred when dropped with work pending and
    /// to go back to the cache once idle. Also says whether the memory was reused: then it
    /// holds stale bytes of its former user (fresh host and pinned memory comes zeroed, fresh
    /// device memory uninitialised).
    pub(crate) fn cached(place: Place, bytes: usize) -> Result<(Self, bool)> {
        Self::cached_in(cache::global(), place, bytes)
    }

    /// [`TrackedAllocation::cached`] from `cache` (the allocation still goes back to the
    /// process's cache when dropped).
    pub(crate) fn cached_in(cache: &Cache, place: Place, bytes: usize) -> Result<(Self, bool)> {
        if let Some(alloc) = cache.take(place, bytes) {
            cache.count(ServedBy::Cache);
            return Ok((alloc, true));
        }
        // An allocation the cache could never keep is made exactly as large as asked.
        let class = cache::size_class(bytes);
        let cacheable = cache.admits(class);
        // Memory whose work finished after its drop may still wait for the reaper's poll.
        if let Some((mut alloc, pending)) = cacheable.then(|| reaper::reclaim(cache, place, class)).flatten()
        {
            alloc.reuse_for(bytes);
            cache.count(if pending { ServedBy::PendingFree } else { ServedBy::Cache });
            return Ok((alloc, true));
        }
        let capacity = if cacheable { class } else { bytes };
        let mut alloc = class_or_exact(capacity, bytes, |n| match place {
            Place::Host => Self::host_zeroed(n),
            Place::CudaDevice(ordinal) => Self::cuda_device(ordinal, n),
            Place::CudaPinned(ordinal) => {
                Self::cuda_pinned_zeroed(ordinal, n, crate::sys::CUFERRY_PINNED_PORTABLE as u32)
            }
        })?;
        // Only a block of its class's size can serve later requests of that class.
        let recycle = alloc.capacity == capacity && cacheable;
        alloc.bytes = bytes;
        alloc.deferred = true;
        alloc.recycle = recycle;
        cache.count(ServedBy::Fresh);
        Ok((alloc, false))
    }

    fn new(ptr: *mut u8, bytes: usize, origin: Origin) -> Self {
        TrackedAllocation {
            ptr,
            bytes,
            capacity: bytes,
            origin,
            tracker: UseTracker::default(),
            deferred: false,
            recycle: false,
        }
    }

    /// The CUDA device of the memory (device memory, or pinned memory allocated with it
    /// current); `None` for host memory.
    pub(super) fn cuda_ordinal(&self) -> Option<u32> {
        match self.origin {
            Origin::CudaDevice(ordinal) | Origin::CudaPinned(ordinal) => Some(ordinal),
            Origin::Host(_) => None,
        }
    }

    /// Where the memory lives, for the cache (`None` for zero bytes).
    pub(super) fn place(&self) -> Option<Place> {
        match self.origin {
            _ if self.ptr.is_null() => None,
            Origin::Host(None) => None,
            Origin::Host(Some(_)) => Some(Place::Host),
            Origin::CudaDevice(ordinal) => Some(Place::CudaDevice(ordinal)),
            Origin::CudaPinned(ordinal) => Some(Place::CudaPinned(ordinal)),
        }
    }

    /// Marks the allocation to be freed by the [reaper](super::reaper) once its queued work
    /// has finished, so that dropping it never waits.
    #[cfg(test)]
    pub(crate) fn defer_free(&mut self) {
        self.deferred = true;
    }

    /// Moves the memory and its tracker out, leaving an empty allocation that frees nothing;
    /// the result is not deferred (its drop waits) but still goes back to the cache when it
    /// came from there.
    fn take(&mut self) -> TrackedAllocation {
        let empty = Self::new(std::ptr::null_mut(), 0, Origin::Host(None));
        let mut out = std::mem::replace(self, empty);
        out.deferred = false;
        out
    }

    /// Gives the memory up without freeing or caching it (its queued work's fate is unknown),
    /// while releasing the tracker's streams and events.
    pub(crate) fn leak_memory(mut self) {
        self.forget_memory();
    }

    /// Leaves `self` an empty allocation that frees nothing (the memory is freed or leaked),
    /// releasing the tracker's streams and events.
    fn forget_memory(&mut self) {
        self.tracker = UseTracker::default();
        self.origin = Origin::Host(None);
        self.ptr = std::ptr::null_mut();
        self.bytes = 0;
        self.capacity = 0;
        self.deferred = false;
        self.recycle = false;
    }

    /// The allocation, freed when dropped instead of going back to the cache.
    pub(super) fn uncached(mut self) -> Self {
        self.recycle = false;
        self
    }

    /// Whether the allocation was made through the cache (and goes back to it).
    pub(super) fn is_recycled(&self) -> bool {
        self.recycle
    }

    /// Bytes allocated (the size class of a cached allocation).
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Makes a cached allocation `bytes` long (at most its capacity), marked as when made.
    pub(super) fn reuse_for(&mut self, bytes: usize) {
        debug_assert!(bytes <= self.capacity);
        self.bytes = bytes.min(self.capacity);
        self.deferred = true;
        self.recycle = true;
    }

    /// Drops the record of past uses (all finished: the caller checked the tracker is idle),
    /// and with it the streams and events they hold.
    pub(super) fn forget_uses(&mut self) {
        self.tracker = UseTracker::default();
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

impl TrackedAllocation {
    /// Waits for the queued work and frees the memory now (or gives it back to the cache),
    /// returning what fails instead of keeping it for
    /// [`take_drop_error`](crate::take_drop_error). From a host stream's job with work still
    /// pending, the free is handed to the reaper as a drop would. A failed wait leaks the
    /// memory, as a drop does.
    pub(crate) fn free(mut self) -> Result<()> {
        self.deferred = false;
        self.release()
    }

    /// The body of `drop`, with its first failure returned; leaves `self` empty (nothing to
    /// free) on every path.
    fn release(&mut self) -> Result<()> {
        // Inside a host stream's job, waiting could be for work queued behind that job, which
        // never runs: every allocation dropped there with work pending goes to the reaper.
        let in_job = crate::stream::host::in_job();
        if let Some(ordinal) = self.cuda_ordinal() {
            // The dropping thread may have no current device (a host stream's worker, a
            // user's new thread): querying the tracker's CUDA events there would create a
            // context on device 0, which a process using only other GPUs never asked for (the
            // reaper does the same; the free below makes the device current anyway). A
            // failure leaves the query to report it.
            let _ = crate::cuda::device::make_current(ordinal);
        }
        if (self.deferred || in_job) && !matches!(self.tracker.is_idle(), Ok(true)) {
            let capped = if in_job { Capped::No } else { Capped::Yes };
            match super::reaper::defer(self.take(), capped) {
                Ok(()) => return Ok(()),
                // No reaper, or its caps reached: wait and free here, as an unmarked one.
                Err(mut back) => std::mem::swap(self, &mut back),
            }
        }
        if let Err(err) = self.tracker.wait_idle() {
            // The queued work's fate is unknown: leaking is the only safe choice.
            self.forget_memory();
            return Err(err);
        }
        if self.recycle {
            match cache::global().give(self.take()) {
                Ok(()) => return Ok(()),
                // The cache is full: free it here.
                Err(mut back) => {
                    back.recycle = false;
                    std::mem::swap(self, &mut back);
                }
            }
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
            Origin::CudaPinned(ordinal) => unsafe { raw::pinned_free(ordinal, self.ptr.cast::<c_void>()) },
        };
        // Freed (or, when the free failed, in an unknown state): never touched again.
        self.forget_memory();
        freed
    }
}

impl Drop for TrackedAllocation {
    fn drop(&mut self) {
        if let Err(err) = self.release() {
            record_drop_error(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::{retry_after_deferred_frees, retry_after_frees_in, DrawsOn, Error, TrackedAllocation};
    use crate::copy::copy;
    use crate::device::Device;
    use crate::memory::cache::{self, Cache, Caps, Leaving, Place, Then};
    use crate::memory::DeviceBuffer;
    use crate::stream::test_gate::Gate;
    use crate::stream::Stream;

    /// A buffer marked for deferred freeing (256 sevens), copied into the returned one on the
    /// returned stream behind the returned (closed) gate.
    fn copy_behind_a_gate() -> (DeviceBuffer<u16>, DeviceBuffer<u16>, Stream, Gate) {
        let fresh = Stream::new(Device::Host).unwrap();
        let src = DeviceBuffer::from_slice(&fresh, &[7u16; 256]).unwrap().with_deferred_free();
        let mut dst = DeviceBuffer::<u16>::zeroed(&fresh, 256).unwrap();
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        copy(&stream, &src, &mut dst).unwrap();
        (src, dst, stream, gate)
    }

    fn out_of_memory() -> Error {
        Error::Cuda {
            call: "cudaMalloc",
            code: 2,
            name: "cudaErrorMemoryAllocation",
            description: "out of memory",
        }
    }

    /// A size class that does not fit is tried at the exact size asked for, once, and only
    /// for lack of memory; an exact-size request is not tried twice.
    #[test]
    fn a_class_that_does_not_fit_falls_back_to_the_exact_size() {
        let sizes = std::sync::Mutex::new(Vec::new());
        let fits_up_to = |limit: usize| {
            let sizes = &sizes;
            move |n: usize| {
                sizes.lock().unwrap().push(n);
                if n > limit {
                    Err(out_of_memory())
                } else {
                    TrackedAllocation::host_zeroed(n)
                }
            }
        };
        let (class, bytes) = (5 << 10, 4100);
        let alloc = super::class_or_exact(class, bytes, fits_up_to(bytes)).unwrap();
        assert_eq!((alloc.capacity(), sizes.lock().unwrap().clone()), (bytes, vec![class, bytes]));
        sizes.lock().unwrap().clear();
        let refused = super::class_or_exact(bytes, bytes, fits_up_to(bytes - 1));
        assert!(refused.is_err());
        assert_eq!(sizes.lock().unwrap().clone(), vec![bytes], "an exact request was tried twice");
        sizes.lock().unwrap().clear();
        let other = super::class_or_exact(class, bytes, |n| {
            sizes.lock().unwrap().push(n);
            Err(Error::invalid("not a lack of memory"))
        });
        assert!(matches!(other, Err(Error::InvalidArgument { .. })));
        assert_eq!(sizes.lock().unwrap().clone(), vec![class], "another error was retried");
    }

    /// An allocation failing for lack of memory while a deferred free waits for its work is
    /// tried again after that work (and the free); other failures are returned at once.
    #[test]
    fn out_of_memory_waits_for_deferred_frees_then_retries() {
        let _serial = crate::memory::cache::tests::global_cache_lock();
        let (src, _dst, _stream, gate) = copy_behind_a_gate();
        drop(src); // deferred: its copy waits behind the gate
        let calls = AtomicUsize::new(0);
        let opener = gate.open_after(Duration::from_millis(20));
        let got = retry_after_deferred_frees(DrawsOn::Any, || match calls.fetch_add(1, Ordering::SeqCst) {
            0 => Err(out_of_memory()),
            _ => Ok(gate.passed()),
        });
        opener.join().unwrap();
        assert_eq!(got, Ok(true), "the retry ran before the deferred free's work");
        assert_eq!(calls.load(Ordering::SeqCst), 2);

        let calls = AtomicUsize::new(0);
        let got: Result<(), Error> = retry_after_deferred_frees(DrawsOn::Any, || {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(Error::invalid("not a lack of memory"))
        });
        assert!(matches!(got, Err(Error::InvalidArgument { .. })));
        // The host allocator's own failure is recognised as a lack of memory.
        let host = super::TrackedAllocation::host_zeroed(isize::MAX as usize - 4095).map(drop);
        assert!(matches!(host, Err(Error::OutOfMemory { .. })), "{host:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "a failure other than out-of-memory was retried");
    }

    /// `free` waits for the queued work, even for an allocation whose drop would leave that
    /// to the reaper, and returns a failure to its caller instead of keeping it as a drop
    /// error (`cuferry_buffer_free` reported such a failure twice).
    #[test]
    fn free_waits_and_returns_its_errors() {
        let (src, dst, stream, gate) = copy_behind_a_gate();
        let opener = gate.open_after(Duration::from_millis(20));
        src.free().unwrap();
        assert!(gate.passed(), "free returned before the copy queued on the buffer ran");
        opener.join().unwrap();
        assert_eq!(dst.to_vec(&stream).unwrap(), vec![7u16; 256]);

        // An allocation no CUDA device can own: its free fails without calling CUDA.
        let bogus = TrackedAllocation::new(0x1000 as *mut u8, 16, super::Origin::CudaDevice(u32::MAX));
        let err = bogus.free().unwrap_err();
        assert!(err.to_string().contains("4294967295"), "{err}");
        let kept = crate::take_drop_error();
        assert!(
            !kept.as_ref().is_some_and(|e| e.to_string().contains("4294967295")),
            "the failure was also kept as a drop error: {kept:?}"
        );
    }

    /// Memory evicted from the cache by another thread but not yet handed to the reaper is
    /// neither cached nor pending: an allocation failing for lack of memory meanwhile waits
    /// until it has been handed on (and then for the reaper to free it) before trying again.
    /// It used to fail at once, having seen nothing to free.
    #[test]
    fn out_of_memory_waits_for_memory_leaving_the_cache() {
        let cache = Cache::new(Caps { count: 8, bytes: 1 << 20 });
        let (alloc, _) = TrackedAllocation::cached_in(&cache, Place::Host, 4096).unwrap();
        assert!(cache.give(alloc).is_ok());
        let mut leaving = Leaving::new(&cache, Then::Reap);
        cache.set_caps(Caps { count: 0, bytes: 0 }, &mut leaving); // evicts it, held here
        assert_eq!((cache.held_bytes(), cache.leaving_where(|_| true)), (0, 1));
        let calls = AtomicUsize::new(0);
        let got = std::thread::scope(|scope| {
            scope.spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                drop(leaving); // hands it to the reaper
            });
            retry_after_frees_in(
                &cache,
                DrawsOn::Host,
                || false,
                || match calls.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(out_of_memory()),
                    _ => Ok(cache.leaving_where(|_| true)),
                },
            )
        });
        assert_eq!(got, Ok(0), "the retry ran while evicted memory was on its way to be freed");
        // A device's failure does not wait for host memory leaving.
        cache.set_caps(Caps { count: 8, bytes: 1 << 20 }, &mut Leaving::new(&cache, Then::Free));
        let (alloc, _) = TrackedAllocation::cached_in(&cache, Place::Host, 4096).unwrap();
        assert!(cache.give(alloc).is_ok());
        let mut leaving = Leaving::new(&cache, Then::Free);
        cache.set_caps(Caps { count: 0, bytes: 0 }, &mut leaving);
        let failing = || -> crate::Result<()> { Err(out_of_memory()) };
        assert!(retry_after_frees_in(&cache, DrawsOn::Device(0), || false, failing).is_err());
        assert_eq!(cache.leaving_where(|_| true), 1);
        drop(leaving);
    }

    /// A failure the allocator calls hopeless (a pool at its own limit) frees nothing and does
    /// not try again: the cache keeps its memory, and `alloc` runs once. Otherwise the same
    /// failure releases the cache and tries again.
    #[test]
    fn a_hopeless_out_of_memory_frees_nothing() {
        let cache = Cache::new(Caps { count: 8, bytes: 1 << 20 });
        let (alloc, _) = TrackedAllocation::cached_in(&cache, Place::Host, 4096).unwrap();
        assert!(cache.give(alloc).is_ok());
        let calls = AtomicUsize::new(0);
        let failing = || -> crate::Result<()> {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(out_of_memory())
        };
        assert!(retry_after_frees_in(&cache, DrawsOn::Host, || true, failing).is_err());
        assert_eq!((calls.load(Ordering::SeqCst), cache.held_bytes()), (1, 4096));
        assert!(retry_after_frees_in(&cache, DrawsOn::Host, || false, failing).is_err());
        assert_eq!((calls.load(Ordering::SeqCst), cache.held_bytes()), (3, 0));
    }

    /// An allocation failing for lack of memory inside a host stream's job does not wait for
    /// deferred frees: one of them may wait for work queued behind that very job (it used to
    /// deadlock). It still releases the cache and returns its error.
    #[test]
    fn out_of_memory_inside_a_host_job_never_waits_for_work_behind_it() {
        let _serial = crate::memory::cache::tests::global_cache_lock();
        let stream = Stream::new(Device::Host).unwrap();
        let (go, wait_for_go) = std::sync::mpsc::channel::<()>();
        let (report, outcome) = std::sync::mpsc::channel();
        stream
            .host_fn(move || {
                let _ = wait_for_go.recv();
                // A petabyte: the host allocator refuses it for lack of memory.
                let _ = report.send(TrackedAllocation::host_zeroed(1 << 50).map(drop));
            })
            .unwrap();
        let mut behind = DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap().with_deferred_free();
        let src = DeviceBuffer::from_slice(&Stream::new(Device::Host).unwrap(), &[1u8; 64]).unwrap();
        copy(&stream, &src, &mut behind).unwrap(); // queued behind the job
        drop(behind); // deferred: pending in the reaper until the job has run
        go.send(()).unwrap();
        let got = outcome.recv_timeout(Duration::from_secs(5));
        if got.is_err() {
            // Deadlocked: dropping what waits for the stream would hang the test, not fail it.
            std::mem::forget((stream, src));
            panic!("the job's allocation waited for work queued behind its job");
        }
        assert!(
            matches!(got, Ok(Err(Error::OutOfMemory { .. }))),
            "the job's allocation did not fail at once: {got:?}"
        );
        stream.synchronize().unwrap();
    }

    /// Memory that an allocation failing for lack of memory cannot have drawn on stays
    /// cached: one device's failure keeps host and pinned memory (and other devices'), a
    /// host failure releases both host places, managed memory's releases everything.
    #[test]
    fn out_of_memory_releases_only_the_memory_it_draws_on() {
        use Place::{CudaDevice, CudaPinned, Host};
        let cases = [
            (DrawsOn::Host, [true, true, false, false]),
            (DrawsOn::Device(1), [false, false, false, true]),
            (DrawsOn::Any, [true, true, true, true]),
        ];
        for (draws_on, covered) in cases {
            let places = [Host, CudaPinned(0), CudaDevice(0), CudaDevice(1)];
            let got: Vec<bool> = places.iter().map(|&p| draws_on.covers(p)).collect();
            assert_eq!(got, covered, "{draws_on:?}");
        }
        let _serial = crate::memory::cache::tests::global_cache_lock();
        let bytes = 5 << 20;
        let (alloc, _) = TrackedAllocation::cached(Place::Host, bytes).unwrap();
        let class = alloc.capacity();
        drop(alloc); // idle: cached at once
        let held = || cache::global().held_bytes_where(|p| p == Place::Host);
        assert!(held() >= class);
        let failing = || -> crate::Result<()> { Err(out_of_memory()) };
        assert!(retry_after_deferred_frees(DrawsOn::Device(0), failing).is_err());
        assert!(held() >= class, "a device's failure released host memory");
        let calls = AtomicUsize::new(0);
        let retried =
            retry_after_deferred_frees(DrawsOn::Host, || match calls.fetch_add(1, Ordering::SeqCst) {
                0 => Err(out_of_memory()),
                _ => Ok(()),
            });
        assert_eq!((retried, calls.load(Ordering::SeqCst)), (Ok(()), 2));
        assert_eq!(held(), 0, "a host failure kept cached host memory");
    }
}
