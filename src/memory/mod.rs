//! Memory: device buffers, pinned host buffers and registered host memory.
//!
//! Rules:
//! - Every buffer tracks its queued uses (see `tracker`), each declared a read or a write. A
//!   read waits for the last write; a write waits for the last write and every read since it,
//!   whichever streams they were queued on. Reads of one buffer on different streams (the
//!   source of two copies, one input of two tiles) therefore run at once, while uses involving
//!   a write keep the order they were queued in. Host access and freeing wait for every use.
//!   Dropping a buffer with copies pending is therefore safe: the drop blocks until they finish.
//!   There are two exceptions, both freed after the queued work by a background thread (see
//!   the reaper's rules in `memory/reaper.rs`): the arrays of [`crate::linop`], so that
//!   dropping an intermediate does not block while fewer than 1024 frees (4 GiB) wait; and
//!   a [`DeviceBuffer`] or [`PinnedBuffer`] dropped (or `free`d, which then returns before
//!   the memory is freed) inside a host stream's job with work still pending, where waiting
//!   could be for work queued behind that job, which never runs. A [`HostRegistration`] or a
//!   managed buffer dropped there still waits (see [`Stream::host_fn`](crate::Stream::host_fn)
//!   for what that wait does). Once their work has finished, linop arrays' memory
//!   is kept in a cache for the next array of the same device and size class instead of
//!   being freed: see [`release_cached_memory`] and [`set_cache_limits`].
//! - Host access to pinned or registered memory goes through `as_slice`/`as_mut_slice`, which
//!   synchronise first; a queued write needs `&mut`, so the borrow checker rules out a host
//!   read racing a copy into the same buffer.
//! - Allocation that leaves memory uninitialised is `unsafe`; zeroed and copied-from
//!   allocations are safe. Element types are plain data ([`Element`]).
//! - Host-stream work (copies, kernel jobs) reaches every kind but CUDA device memory
//!   (`Error::InvalidArgument`), and managed memory only on devices with
//!   `concurrentManagedAccess` (elsewhere a host access while a kernel runs faults:
//!   `Error::Unsupported`).
//! - On [`Device::Host`] every buffer cuferry allocates is ordinary page-aligned host memory,
//!   so the same code runs without a GPU (registered memory is the caller's, aligned as its
//!   `Vec` is).
//! - Element types are aligned to at most [`MAX_ELEMENT_ALIGN`] bytes, the least alignment
//!   every allocator gives (CUDA device memory: 256): a buffer of a more-aligned type is
//!   refused, so no slice cuferry builds is ever misaligned.
//!
//! # Examples
//!
//! ```
//! use cuferry::{copy, Device, DeviceBuffer, PinnedBuffer, Stream};
//! let stream = Stream::new(Device::Host)?;
//! let host = PinnedBuffer::from_slice(Device::Host, &[1u32, 2, 3])?;
//! let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 3)?;
//! copy(&stream, &host, &mut dev)?;
//! drop(host); // waits for the copy before freeing
//! assert_eq!(dev.to_vec(&stream)?, vec![1, 2, 3]);
//! # Ok::<(), cuferry::Error>(())
//! ```

pub(crate) mod allocation;
pub(crate) mod cache;
mod device;
pub mod foreign;
pub(crate) mod pageable;
mod pinned;
pub(crate) mod reaper;
mod registered;
pub(crate) mod tracker;

use crate::device::Device;
use crate::error::{Error, Result};
pub use cache::{
    cache_limits, cache_stats, cached_memory_bytes, release_cached_memory, set_cache_limits, CacheLimits,
    CacheStats, MAX_CACHED, MAX_CACHED_BYTES,
};
pub use device::DeviceBuffer;
pub use foreign::ForeignBuffer;
pub use pinned::{PinnedBuffer, PinnedOptions};
pub use registered::HostRegistration;

/// The largest element alignment a cuferry buffer takes (see the module rules).
pub const MAX_ELEMENT_ALIGN: usize = 256;

/// Plain data that may be copied byte-for-byte between host and device: any
/// [`bytemuck::Pod`] type that can cross threads. Buffers take types aligned to at most
/// [`MAX_ELEMENT_ALIGN`] bytes.
pub trait Element: bytemuck::Pod + Send + Sync {}

impl<T: bytemuck::Pod + Send + Sync> Element for T {}

/// What kind of memory a buffer holds; copies pick their direction from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host memory (pageable): CUDA copies from it are staged by the driver.
    Pageable,
    /// Page-locked host memory (`cudaHostAlloc` or `cudaHostRegister`): DMA-able at link speed.
    Pinned,
    /// Memory of a device. For [`Device::Host`] this is ordinary host memory.
    Device(Device),
    /// Managed (unified) memory from a pool of this device: host and device can both reach
    /// it; the driver migrates pages (see [`crate::managed`]).
    Managed(Device),
}

impl MemoryKind {
    /// Whether host code can read the memory (everything but CUDA device memory).
    pub fn host_accessible(self) -> bool {
        !matches!(self, MemoryKind::Device(Device::Cuda(_)))
    }
}

/// Checks that host-stream work (a copy or kernel job on a host stream's worker, which runs
/// while the device may run kernels) may touch memory of `kind`: refuses CUDA device memory,
/// and managed memory of a device without `concurrentManagedAccess` (there, a host access
/// while any kernel runs faults the process; many VMs and vGPUs lack the capability).
pub(crate) fn check_host_stream_access(kind: MemoryKind) -> Result<()> {
    check_host_stream_access_with(kind, crate::cuda::device::concurrent_managed_access)
}

/// [`check_host_stream_access`] with the capability lookup given (tests).
fn check_host_stream_access_with(
    kind: MemoryKind,
    concurrent: impl FnOnce(u32) -> Result<bool>,
) -> Result<()> {
    match kind {
        MemoryKind::Device(Device::Cuda(_)) => Err(Error::invalid(format!(
            "a host stream cannot reach {kind:?} memory; queue the work on a stream of that device"
        ))),
        MemoryKind::Managed(Device::Cuda(i)) if !concurrent(i)? => Err(Error::unsupported(format!(
            "host-stream access to managed memory of cuda:{i} needs concurrentManagedAccess, which \
             cuda:{i} lacks (a host access while a kernel runs would fault); queue the work on a \
             CUDA stream"
        ))),
        _ => Ok(()),
    }
}

/// The host's page size (a power of two): the unit CUDA rounds prefetches, advice and host
/// registrations out to.
pub(crate) fn cpu_page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a system constant; it has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
    })
}

/// Memory that copies can read from or write to: [`DeviceBuffer`], [`PinnedBuffer`],
/// [`HostRegistration`], [`ManagedBuffer`](crate::managed::ManagedBuffer) and
/// [`ForeignBuffer`] (another owner's memory). Sealed: the copy engine relies on its
/// internals.
pub trait Memory<T: Element>: sealed::Sealed {
    /// Number of elements.
    fn len(&self) -> usize;

    /// Whether there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kind of memory.
    fn kind(&self) -> MemoryKind;
}

/// Memory safe code reaches only through tracked work (copies, `to_vec`, drops), never
/// through a host view borrowed from `&self`: what a queued write through a shared reference
/// may target, such as [`HaloPacker::unpack`](crate::halo::HaloPacker::unpack). A
/// [`DeviceBuffer`] is, and a [`ForeignBuffer`] (it has no host view; its owner's are held
/// off by the wrap's contract); pinned, registered and managed memory are not (their
/// `as_slice` takes `&self`).
///
/// # Examples
///
/// A slice of a pinned buffer could be held across its unpack, so `unpack` refuses it:
///
/// ```compile_fail
/// use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
/// use cuferry::{Device, PinnedBuffer};
/// let spec = HaloSpec::contiguous(ElementType::F64, &[4, 4], HorizontalDims::xy(0, 1))?;
/// let ex = HaloExchange::new(&spec, &[0..1, 0..4], 0, &[3..4, 0..4])?;
/// let mut packer = HaloPacker::new(Device::Host, &[ex], None)?;
/// let pinned = PinnedBuffer::<f64>::zeroed(Device::Host, 16)?;
/// let view = pinned.as_slice()?;
/// packer.unpack(&[&pinned], None)?; // would write under `view`
/// assert_eq!(view[12], 0.0);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub trait WriteShared<T: Element>: Memory<T> {}

impl<T: Element> WriteShared<T> for DeviceBuffer<T> {}

/// Test support for memory leaked on purpose.
#[cfg(test)]
pub(crate) mod leaked_on_purpose {
    use std::sync::Mutex;

    /// Addresses of memory a test leaks on purpose: kept reachable from a static, so that
    /// LeakSanitizer (`scripts/sanitize-host.sh address`) does not count it, while any other
    /// leak in the same test still fails the run.
    static KEPT: Mutex<Vec<usize>> = Mutex::new(Vec::new());

    /// Keeps `ptr` reachable for the rest of the process.
    pub(crate) fn keep(ptr: *const u8) {
        KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(ptr as usize);
    }
}

pub(crate) mod sealed {
    use super::tracker::UseTracker;

    /// The raw view the copy engine works on.
    #[doc(hidden)]
    #[derive(Debug)]
    pub struct RawParts<'a> {
        pub(crate) ptr: *mut u8,
        pub(crate) bytes: usize,
        pub(crate) tracker: &'a UseTracker,
    }

    /// Restricts [`Memory`](super::Memory) to this crate's types.
    pub trait Sealed {
        /// The pointer, size and tracker of the memory.
        #[doc(hidden)]
        fn raw_parts(&self) -> RawParts<'_>;

        /// Refuses memory cuferry must not write (a read-only
        /// [`ForeignBuffer`](super::ForeignBuffer)): every operation that writes memory asks
        /// before it queues anything.
        #[doc(hidden)]
        fn check_writable(&self) -> crate::error::Result<()> {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_streams_reach_managed_memory_only_with_concurrent_access() {
        let refused = |kind, concurrent: bool| check_host_stream_access_with(kind, |_| Ok(concurrent));
        for concurrent in [false, true] {
            for kind in [MemoryKind::Pageable, MemoryKind::Pinned, MemoryKind::Device(Device::Host)] {
                assert!(refused(kind, concurrent).is_ok(), "{kind:?}");
            }
            assert!(matches!(refused(MemoryKind::Managed(Device::Host), concurrent), Ok(())));
            assert!(matches!(
                refused(MemoryKind::Device(Device::Cuda(0)), concurrent),
                Err(Error::InvalidArgument { .. })
            ));
        }
        assert!(refused(MemoryKind::Managed(Device::Cuda(1)), true).is_ok());
        match refused(MemoryKind::Managed(Device::Cuda(1)), false) {
            Err(Error::Unsupported { what }) => assert!(what.contains("cuda:1"), "{what}"),
            other => panic!("expected Unsupported, got {other:?}"),
        }
        // A failed lookup is reported, not taken for either answer.
        let failed = check_host_stream_access_with(MemoryKind::Managed(Device::Cuda(0)), |_| {
            Err(Error::unsupported("no CUDA in this build"))
        });
        assert!(matches!(failed, Err(Error::Unsupported { .. })));
    }
}
