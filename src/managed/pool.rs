//! `ManagedPool`: stream-ordered managed allocations from a CUDA 13 managed memory pool.
//!
//! Rules:
//! - On CUDA the pool is a `cudaMemPoolCreate` pool with allocation type managed (preferred
//!   location: the device, or none). Where the driver refuses managed pools (or reports no
//!   memory-pool support) the pool falls back to `cudaMallocManaged`/`cudaFree`, once, and
//!   [`ManagedPool::kind`] says which is in use. No managed memory at all is
//!   [`Error::Unsupported`] naming `managedMemory`.
//! - On the host backend the pool hands out ordinary page-aligned host memory.
//! - The pool is `Send + Sync`; buffers keep it alive, so it may be dropped before them.
//! - CUDA managed pools are never destroyed: the H100's driver 580.159 crashed (SIGSEGV in
//!   `cuMemPoolDestroy`) destroying one while other threads used the device, with or without
//!   frees queued. When the last handle and buffer of a pool go, cuferry waits for the device
//!   (`cudaDeviceSynchronize`: the last frees have run), trims the pool to nothing, resets its
//!   high-water marks and keeps it; a later pool with the same device and options takes it.
//! - Statistics: reserved and used bytes, current and high-water (driver counters for CUDA
//!   pools; cuferry's own counters for the fallback and the host).

use std::alloc::{self, Layout};
use std::os::raw::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::cuda::managed::{self as raw, RawPool};
use crate::cuda::memory as raw_memory;
use crate::cuda::stream::RawStream;
use crate::device::Device;
use crate::error::{record_drop_error, Error, Result};
use crate::memory::allocation::{
    retry_after_deferred_frees, retry_after_deferred_frees_unless, DrawsOn, HOST_ALIGN,
};

/// `cudaErrorNotSupported`.
pub(crate) const NOT_SUPPORTED: i32 = 801;
/// `cudaErrorInvalidValue` (drivers without managed pools answer pool creation with it).
const INVALID_VALUE: i32 = 1;

/// How a [`ManagedPool`] is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManagedPoolOptions {
    /// Make the device the pool's preferred location (false: no preferred location). A
    /// property of CUDA managed pools: `cudaMallocManaged` memory (`use_malloc_managed`, or the
    /// fallback where managed pools are unsupported) has no preferred location unless advised
    /// ([`ManagedBuffer::advise`](super::ManagedBuffer::advise)).
    pub prefer_device: bool,
    /// Most bytes the pool may reserve; 0 leaves the driver's default (no limit). A CUDA
    /// managed pool's driver keeps it; with `use_malloc_managed` and on the host backend
    /// cuferry keeps it, counting the bytes of live allocations. An allocation past it fails
    /// as one out of memory does, but at once: freeing cuferry's cached memory first, as a
    /// failure for lack of device memory does, could not help.
    pub max_size: usize,
    /// Bytes the pool keeps reserved across synchronizations (`u64::MAX`: keep everything,
    /// the fastest for reuse).
    pub release_threshold: u64,
    /// Use `cudaMallocManaged`/`cudaFree` even where managed pools work (to compare, or for
    /// memory that takes `cudaMemAdvise`: drivers may refuse advice on managed-pool memory,
    /// as the H100's driver 580.159 does).
    pub use_malloc_managed: bool,
}

impl Default for ManagedPoolOptions {
    fn default() -> Self {
        ManagedPoolOptions {
            prefer_device: true,
            max_size: 0,
            release_threshold: u64::MAX,
            use_malloc_managed: false,
        }
    }
}

/// Which allocator a pool uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Host backend: ordinary host memory.
    Host,
    /// A CUDA 13 managed memory pool (`cudaMallocFromPoolAsync` / `cudaFreeAsync`).
    ManagedPool,
    /// The fallback: `cudaMallocManaged` / `cudaFree` (the driver refused managed pools).
    MallocManaged,
}

/// Byte counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes reserved from the system now.
    pub reserved_current: u64,
    /// Most bytes ever reserved.
    pub reserved_high: u64,
    /// Bytes in live allocations now.
    pub used_current: u64,
    /// Most bytes ever in live allocations.
    pub used_high: u64,
}

/// Managed-memory capabilities of a device (probed, never assumed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagedCapabilities {
    /// `cudaDevAttrManagedMemory`.
    pub managed_memory: bool,
    /// `cudaDevAttrConcurrentManagedAccess`: prefetch and advise need it.
    pub concurrent_managed_access: bool,
    /// `cudaDevAttrPageableMemoryAccess`.
    pub pageable_memory_access: bool,
    /// `cudaDevAttrMemoryPoolsSupported`.
    pub memory_pools_supported: bool,
}

impl ManagedCapabilities {
    /// Probes `device` (the host backend has none of the CUDA capabilities).
    ///
    /// # Errors
    ///
    /// As [`Device::properties`] for CUDA devices.
    pub fn probe(device: Device) -> Result<Self> {
        match device {
            Device::Host => Ok(ManagedCapabilities::default()),
            Device::Cuda(_) => {
                let p = device.properties()?;
                Ok(ManagedCapabilities {
                    managed_memory: p.managed_memory,
                    concurrent_managed_access: p.concurrent_managed_access,
                    pageable_memory_access: p.pageable_memory_access,
                    memory_pools_supported: p.memory_pools_supported,
                })
            }
        }
    }
}

/// What buffers share with their pool.
#[derive(Debug)]
pub(crate) struct PoolInner {
    pub(crate) device: Device,
    pub(crate) kind: PoolKind,
    pub(crate) caps: ManagedCapabilities,
    raw: Option<RawPool>,
    key: PoolKey,
    used: AtomicU64,
    used_high: AtomicU64,
}

impl PoolInner {
    /// Allocates `bytes > 0` bytes; stream-ordered on `stream` for CUDA pools. Host memory is
    /// zeroed when `zero_host` (CUDA memory never is here).
    pub(crate) fn alloc_raw(
        &self,
        bytes: usize,
        stream: Option<RawStream>,
        zero_host: bool,
    ) -> Result<*mut u8> {
        if bytes == 0 {
            return Err(Error::invalid("a managed allocation of 0 bytes"));
        }
        // Where cuferry keeps the limit, the bytes are counted before allocating (so threads
        // allocating at once never pass it together) and given back if the allocation fails.
        let counted = self.count_within_limit(bytes)?;
        let allocated = self.allocate(bytes, stream, zero_host);
        let ptr = match allocated {
            Ok(ptr) => ptr,
            Err(e) => {
                if counted.is_some() {
                    self.used.fetch_sub(bytes as u64, Ordering::AcqRel);
                }
                return Err(e);
            }
        };
        let now =
            counted.unwrap_or_else(|| self.used.fetch_add(bytes as u64, Ordering::AcqRel) + bytes as u64);
        self.used_high.fetch_max(now, Ordering::AcqRel);
        Ok(ptr)
    }

    /// The limit cuferry keeps itself (`max_size`, for the host and `cudaMallocManaged`
    /// kinds; a CUDA managed pool's driver keeps its own), if any.
    fn own_limit(&self) -> Option<u64> {
        let max_size = self.key.2 as u64;
        (self.kind != PoolKind::ManagedPool && max_size != 0).then_some(max_size)
    }

    /// For a CUDA managed pool with a `max_size` (which the driver keeps): whether `bytes` more
    /// would pass it given the bytes in use now, so that an allocation failing for lack of
    /// memory failed at the pool's own limit. False when the statistics cannot be read.
    fn at_cuda_limit(&self, pool: RawPool, bytes: usize) -> bool {
        let max_size = self.key.2 as u64;
        max_size != 0
            && raw::pool_stats(pool).is_ok_and(|s| s.used_current.saturating_add(bytes as u64) > max_size)
    }

    /// With a limit of cuferry's own: counts `bytes` as used and returns the count after, or
    /// fails as out of memory when they do not fit. Without one: `None`, nothing counted.
    fn count_within_limit(&self, bytes: usize) -> Result<Option<u64>> {
        let Some(limit) = self.own_limit() else { return Ok(None) };
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let after = used.saturating_add(bytes as u64);
            if after > limit {
                return Err(Error::out_of_memory(format!(
                    "a managed pool of at most {limit} bytes has {used} in use: {bytes} more do not fit"
                )));
            }
            match self.used.compare_exchange_weak(used, after, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(Some(after)),
                Err(now) => used = now,
            }
        }
    }

    /// Allocates `bytes > 0` bytes from the pool's allocator, uncounted.
    fn allocate(&self, bytes: usize, stream: Option<RawStream>, zero_host: bool) -> Result<*mut u8> {
        let ptr = match (self.kind, self.raw, self.device) {
            (PoolKind::ManagedPool, Some(pool), device) => {
                let s =
                    stream.ok_or_else(|| Error::invalid("a managed pool allocation needs a CUDA stream"))?;
                let mut retry = false;
                // At the pool's own limit (the driver keeps it), freeing cuferry's caches on
                // every device cannot help: fail at once, as the pool's user expects.
                let hopeless = || self.at_cuda_limit(pool, bytes);
                retry_after_deferred_frees_unless(DrawsOn::Any, hopeless, || {
                    if let Device::Cuda(i) = device {
                        if retry {
                            // The frees before a retry make other devices current, and a NULL
                            // stream (the C ABI's legacy default stream) is the current
                            // device's: the pool's device again, so the allocation stays on
                            // the stream its user named.
                            crate::cuda::device::make_current(i)?;
                        } else {
                            // A thread with no current device (a host stream's worker).
                            let _ = crate::cuda::device::ensure_context(i);
                        }
                    }
                    retry = true;
                    raw::pool_alloc_async(pool, bytes, s)
                })?
                .cast::<u8>()
            }
            (PoolKind::MallocManaged, _, Device::Cuda(i)) => {
                retry_after_deferred_frees(DrawsOn::Any, || raw::malloc_managed(i, bytes))?.cast::<u8>()
            }
            _ => {
                let layout = host_layout(bytes)?;
                // Host memory the allocation cache holds is freed and the allocation tried
                // again, as for the host backend's buffers.
                retry_after_deferred_frees(DrawsOn::Host, || {
                    // SAFETY: the layout has a non-zero size.
                    let p = unsafe {
                        if zero_host {
                            alloc::alloc_zeroed(layout)
                        } else {
                            alloc::alloc(layout)
                        }
                    };
                    if p.is_null() {
                        return Err(Error::out_of_memory(format!(
                            "a host allocation of {bytes} bytes failed"
                        )));
                    }
                    Ok(p)
                })?
            }
        };
        Ok(ptr)
    }

    /// Frees an allocation of `bytes` bytes.
    ///
    /// # Safety
    ///
    /// 1. `ptr` came from [`PoolInner::alloc_raw`] on this pool with `bytes`, and is freed once.
    /// 2. For CUDA pools every use is queued on `stream` before this point or has finished;
    ///    for the other kinds every use has finished.
    pub(crate) unsafe fn free_raw(
        &self,
        ptr: *mut u8,
        bytes: usize,
        stream: Option<RawStream>,
    ) -> Result<()> {
        // Uncounted before the memory is returned: an allocation that reuses it at once is not
        // counted on top of it (the high-water mark would overstate the peak).
        self.used.fetch_sub(bytes as u64, Ordering::AcqRel);
        let freed = match (self.kind, self.device) {
            // Not returned early: the count below is given back on every failure.
            (PoolKind::ManagedPool, _) => match stream {
                // SAFETY: preconditions 1 and 2.
                Some(s) => unsafe { raw::free_async(ptr.cast::<c_void>(), s) },
                None => Err(Error::invalid("a managed pool free needs a CUDA stream")),
            },
            // SAFETY: preconditions 1 and 2 (cudaFree serves cudaMallocManaged memory).
            (PoolKind::MallocManaged, Device::Cuda(i)) => unsafe {
                raw_memory::device_free(i, ptr.cast::<c_void>())
            },
            _ => host_layout(bytes).map(|layout| {
                // SAFETY: preconditions 1 and 2; the layout is the one used to allocate.
                unsafe { alloc::dealloc(ptr, layout) }
            }),
        };
        // Memory a failed free leaves allocated stays counted as used.
        if freed.is_err() {
            self.used.fetch_add(bytes as u64, Ordering::AcqRel);
        }
        freed
    }

    fn stats(&self) -> Result<PoolStats> {
        if let (PoolKind::ManagedPool, Some(pool)) = (self.kind, self.raw) {
            if let Device::Cuda(i) = self.device {
                // On a thread that chose no device: the pool's, not a new context on device 0.
                let _ = crate::cuda::device::ensure_context(i);
            }
            let s = raw::pool_stats(pool)?;
            // Four driver reads, not one snapshot: a frees-and-trim between them could still
            // show less reserved than used, or a mark below its current value.
            let reserved_current = s.reserved_current.max(s.used_current);
            return Ok(PoolStats {
                reserved_current,
                reserved_high: s.reserved_high.max(reserved_current),
                used_current: s.used_current,
                used_high: s.used_high.max(s.used_current),
            });
        }
        // Read apart, the two may straddle an allocation that raised `used` but not yet the
        // mark: a snapshot never shows more in use than its high-water mark.
        let used = self.used.load(Ordering::Acquire);
        let high = self.used_high.load(Ordering::Acquire).max(used);
        Ok(PoolStats { reserved_current: used, reserved_high: high, used_current: used, used_high: high })
    }
}

fn host_layout(bytes: usize) -> Result<Layout> {
    Layout::from_size_align(bytes, HOST_ALIGN).map_err(|e| Error::invalid(format!("{bytes} bytes: {e}")))
}

/// The device and options a CUDA managed pool was made with: pools are recycled by it.
type PoolKey = (u32, bool, usize, u64);

/// Idle CUDA managed pools, ready for a new owner with the same key.
fn idle_pools() -> MutexGuard<'static, Vec<(PoolKey, RawPool)>> {
    static IDLE: OnceLock<Mutex<Vec<(PoolKey, RawPool)>>> = OnceLock::new();
    IDLE.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// An idle pool for `key`, or a new one.
fn take_or_create_pool(key: PoolKey) -> Result<RawPool> {
    let mut idle = idle_pools();
    if let Some(at) = idle.iter().position(|(k, _)| *k == key) {
        return Ok(idle.swap_remove(at).1);
    }
    drop(idle);
    let (device, prefer_device, max_size, release_threshold) = key;
    raw::managed_pool_create(device, prefer_device, max_size, release_threshold)
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let (Some(pool), Device::Cuda(i)) = (self.raw.take(), self.device) else { return };
        // The last buffers' frees may still be queued: let them run, then recycle the pool
        // (see the module rules). A pool that cannot be readied is left alone, never reused.
        let readied = crate::cuda::device::synchronize(i)
            // SAFETY: the last buffer is gone and every queued free has run.
            .and_then(|()| unsafe { raw::pool_recycle(pool) });
        match readied {
            Ok(()) => idle_pools().push((self.key, pool)),
            Err(e) => record_drop_error(e),
        }
    }
}

/// A thread-safe pool of managed memory for one device. See the [module docs](crate::managed).
///
/// # Examples
///
/// ```
/// use cuferry::managed::{ManagedPool, ManagedPoolOptions, PoolKind};
/// use cuferry::{Device, Stream};
///
/// let pool = ManagedPool::new(Device::Host, ManagedPoolOptions::default())?;
/// assert_eq!(pool.kind(), PoolKind::Host);
/// let stream = Stream::new(Device::Host)?;
/// let buf = pool.alloc::<f32>(1024, &stream)?;
/// assert_eq!(pool.stats()?.used_current, 4096);
/// drop(buf);
/// assert_eq!(pool.stats()?.used_current, 0);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct ManagedPool {
    pub(crate) inner: Arc<PoolInner>,
}

impl ManagedPool {
    /// A pool for `device`.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] naming `managedMemory` when the device has no managed memory, or
    /// when the device or its driver refuses managed pools while `options.max_size` is set
    /// (without a limit the pool falls back to `cudaMallocManaged`; a limit asked of a managed
    /// pool is not silently turned into cuferry's count of live bytes); errors of probing the
    /// device or creating the pool.
    pub fn new(device: Device, options: ManagedPoolOptions) -> Result<Self> {
        let caps = ManagedCapabilities::probe(device)?;
        let ordinal = match device {
            Device::Cuda(i) => i,
            Device::Host => 0,
        };
        let key = (ordinal, options.prefer_device, options.max_size, options.release_threshold);
        let (kind, raw) = match device {
            Device::Host => (PoolKind::Host, None),
            Device::Cuda(_) => {
                if !caps.managed_memory {
                    return Err(Error::unsupported(format!("{device} lacks managedMemory")));
                }
                if !caps.memory_pools_supported && !options.use_malloc_managed && options.max_size != 0 {
                    return Err(Error::unsupported(format!(
                        "{device} lacks memory pools, and cudaMallocManaged cannot keep to a limit of {} \
                         bytes",
                        options.max_size
                    )));
                }
                if !caps.memory_pools_supported || options.use_malloc_managed {
                    (PoolKind::MallocManaged, None)
                } else {
                    match take_or_create_pool(key) {
                        Ok(pool) => (PoolKind::ManagedPool, Some(pool)),
                        // `cudaMallocManaged` could not keep to a size limit: refusing beats
                        // an unbounded allocator.
                        Err(e @ Error::Cuda { code: NOT_SUPPORTED | INVALID_VALUE, .. })
                            if options.max_size != 0 =>
                        {
                            return Err(Error::unsupported(format!(
                                "{device}: the driver refused a managed pool of at most {} bytes, and \
                                 cudaMallocManaged cannot keep to a limit ({e})",
                                options.max_size
                            )));
                        }
                        Err(Error::Cuda { code: NOT_SUPPORTED | INVALID_VALUE, .. }) => {
                            (PoolKind::MallocManaged, None)
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        };
        Ok(ManagedPool {
            inner: Arc::new(PoolInner {
                device,
                kind,
                caps,
                raw,
                key,
                used: AtomicU64::new(0),
                used_high: AtomicU64::new(0),
            }),
        })
    }

    /// The device the pool serves.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// Which allocator is in use.
    pub fn kind(&self) -> PoolKind {
        self.inner.kind
    }

    /// The device's managed-memory capabilities, probed when the pool was made.
    pub fn capabilities(&self) -> ManagedCapabilities {
        self.inner.caps
    }

    /// Reserved and used bytes, current and high-water.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaMemPoolGetAttribute`.
    pub fn stats(&self) -> Result<PoolStats> {
        self.inner.stats()
    }
}
