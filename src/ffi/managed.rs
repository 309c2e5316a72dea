//! The managed-memory part of the C ABI: PyTorch's `CUDAPluggableAllocator` pair, prefetch
//! (single and batched), advice and pool statistics on raw pointers.
//!
//! Rules:
//! - `cuferry_managed_malloc` / `cuferry_managed_free` have exactly the signatures PyTorch's
//!   pluggable allocator loads; they allocate from one managed pool per device (made on first
//!   use), stream-ordered on the given stream. A failed allocation returns NULL, leaves no CUDA
//!   error pending, and sets the thread's last error message.
//! - Pointers handed out are registered: freeing an unknown pointer, or twice, is reported (as
//!   the last error message) and does nothing. Prefetch and advice check that every range lies
//!   inside one live cuferry allocation, or is managed memory from elsewhere (probed: both
//!   ends managed, on one device). The probe cannot tell memory cuferry freed, still mapped in
//!   its CUDA pool, from foreign managed memory: a stale pointer into a CUDA pool is accepted
//!   there (on the host pool it is refused). Batched calls take at most
//!   `CUFERRY_MANAGED_MAX_BATCH` ranges.
//! - Device -1 is the host backend's pool (plain host memory; prefetch to the host and advice
//!   are no-ops there).
//! - A device's pool is made on its first managed call with flags 0 (on CUDA a managed memory
//!   pool, stream-ordered; the `cudaMallocManaged` fallback where the driver refuses those) and
//!   no size limit, or before that by [`cuferry_managed_pool_configure`] with other options
//!   (`CUFERRY_MANAGED_POOL_MALLOC_MANAGED` for memory that takes advice where the driver
//!   refuses advice on managed-pool memory, as the H100's driver 580.159 does). It is never
//!   replaced: configuring it again with other options is refused.
//! - The allocator pair runs with `device` current (a NULL stream is the legacy stream of the
//!   current device) and makes the caller's current device current again before returning.
//!   Prefetches on the legacy stream likewise run with the memory's device current.
//! - No call creates a context on a device the caller did not name: on a thread with no
//!   context, prefetches on other streams and advice first make the memory's device current,
//!   and the probe of foreign memory (which needs a context before it knows the device) uses
//!   a device whose context is already active.
//! - PyTorch: use the pair through `torch.cuda.MemPool` (PyTorch's caching allocator sits in
//!   front and honours `Tensor.record_stream`). Installed with `change_current_allocator`,
//!   `record_stream` has no effect (PyTorch calls no hook of ours): memory freed while another
//!   stream still uses it can be reused on the allocation's stream.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::{device_of, guard, set_last_error, write_out, CuferryStatus};
use crate::cuda::device::DeviceScope;
use crate::cuda::managed::{self as raw, Batch};
use crate::cuda::memory::{pointer_type, PointerType};
use crate::cuda::stream::RawStream;
use crate::error::{Error, Result};
use crate::managed::{advice_refused, device_lacking_concurrent_access};
use crate::managed::{Advice, Location, ManagedPool, ManagedPoolOptions, PoolKind};

/// Location kind: a CUDA device (`id` is its ordinal).
pub const CUFERRY_LOCATION_DEVICE: i32 = 1;
/// Location kind: host memory.
pub const CUFERRY_LOCATION_HOST: i32 = 2;
/// Location kind: host memory of NUMA node `id`.
pub const CUFERRY_LOCATION_HOST_NUMA: i32 = 3;
/// Location kind: host memory of the calling thread's NUMA node.
pub const CUFERRY_LOCATION_HOST_NUMA_CURRENT: i32 = 4;

/// Advice: read-mostly (set).
pub const CUFERRY_ADVISE_SET_READ_MOSTLY: i32 = 1;
/// Advice: read-mostly (unset).
pub const CUFERRY_ADVISE_UNSET_READ_MOSTLY: i32 = 2;
/// Advice: preferred location (set; uses the location).
pub const CUFERRY_ADVISE_SET_PREFERRED_LOCATION: i32 = 3;
/// Advice: preferred location (unset).
pub const CUFERRY_ADVISE_UNSET_PREFERRED_LOCATION: i32 = 4;
/// Advice: accessed by the location's device (set).
pub const CUFERRY_ADVISE_SET_ACCESSED_BY: i32 = 5;
/// Advice: accessed by the location's device (unset).
pub const CUFERRY_ADVISE_UNSET_ACCESSED_BY: i32 = 6;

/// Where managed pages should go: a `CUFERRY_LOCATION_*` kind and an id.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CuferryLocation {
    /// `CUFERRY_LOCATION_*`.
    pub kind: i32,
    /// Device ordinal or NUMA node, per `kind`.
    pub id: i32,
}

/// Byte counters of a device's managed pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CuferryPoolStats {
    /// Bytes reserved now.
    pub reserved_current: u64,
    /// Most bytes ever reserved.
    pub reserved_high: u64,
    /// Bytes in live allocations now.
    pub used_current: u64,
    /// Most bytes ever in live allocations.
    pub used_high: u64,
}

fn location_of(l: CuferryLocation) -> Result<Location> {
    match l.kind {
        CUFERRY_LOCATION_DEVICE if l.id >= 0 => Ok(Location::Device(l.id as u32)),
        CUFERRY_LOCATION_HOST => Ok(Location::Host),
        CUFERRY_LOCATION_HOST_NUMA => {
            let location = Location::HostNuma(l.id);
            location.check("location")?;
            Ok(location)
        }
        CUFERRY_LOCATION_HOST_NUMA_CURRENT => Ok(Location::HostNumaCurrent),
        k => Err(Error::invalid(format!("location kind {k} (id {})", l.id))),
    }
}

fn advice_of(advice: i32, location: CuferryLocation) -> Result<Advice> {
    let advice = match advice {
        CUFERRY_ADVISE_SET_READ_MOSTLY => Advice::SetReadMostly,
        CUFERRY_ADVISE_UNSET_READ_MOSTLY => Advice::UnsetReadMostly,
        CUFERRY_ADVISE_SET_PREFERRED_LOCATION => Advice::SetPreferredLocation(location_of(location)?),
        CUFERRY_ADVISE_UNSET_PREFERRED_LOCATION => Advice::UnsetPreferredLocation,
        CUFERRY_ADVISE_SET_ACCESSED_BY => Advice::SetAccessedBy(location_of(location)?),
        CUFERRY_ADVISE_UNSET_ACCESSED_BY => Advice::UnsetAccessedBy(location_of(location)?),
        a => return Err(Error::invalid(format!("advice {a}"))),
    };
    advice.check()?;
    Ok(advice)
}

/// A device's pool and the options it was made with (those of first use, or of
/// [`cuferry_managed_pool_configure`]).
struct DevicePool {
    pool: ManagedPool,
    options: ManagedPoolOptions,
}

/// One pool per device number, made on first use or by [`cuferry_managed_pool_configure`].
fn pools() -> MutexGuard<'static, HashMap<i32, DevicePool>> {
    static POOLS: OnceLock<Mutex<HashMap<i32, DevicePool>>> = OnceLock::new();
    POOLS.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn pool_for(device: i32) -> Result<ManagedPool> {
    let mut pools = pools();
    if let Some(p) = pools.get(&device) {
        return Ok(p.pool.clone());
    }
    let options = ManagedPoolOptions::default();
    let pool = make_pool(device, options)?;
    pools.insert(device, DevicePool { pool: pool.clone(), options });
    Ok(pool)
}

/// A new pool for `device`. Checked first: a device past the last is INVALID_ARGUMENT, as
/// everywhere in the C ABI, not the CUDA error of making it current. Making a CUDA pool sets
/// its device current: the caller's current device is restored.
fn make_pool(device: i32, options: ManagedPoolOptions) -> Result<ManagedPool> {
    let checked = device_of(device)?;
    let _scope = device_scope(device)?;
    ManagedPool::new(checked, options)
}

/// Live allocations handed out through the C ABI: address -> (device, bytes).
fn allocations() -> MutexGuard<'static, BTreeMap<usize, (i32, usize)>> {
    static ALLOCS: OnceLock<Mutex<BTreeMap<usize, (i32, usize)>>> = OnceLock::new();
    ALLOCS.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn raw_stream(stream: *mut c_void) -> RawStream {
    RawStream(stream.cast())
}

/// For a CUDA `device` (not the host pool, -1): the device current for the call, and the
/// caller's current device restored after it. A NULL stream is the legacy default stream of
/// the *current* device, and the out-of-memory retry or the `cudaMallocManaged` fallback may
/// make other devices current: PyTorch calls the pair implicitly and relies on its device.
fn device_scope(device: c_int) -> Result<Option<DeviceScope>> {
    match u32::try_from(device) {
        Ok(ordinal) => DeviceScope::enter(ordinal).map(Some),
        Err(_) => Ok(None),
    }
}

/// Allocates `size` bytes of managed memory for `device`, in order on `stream`
/// (`CUDAPluggableAllocator`'s alloc). NULL on failure (see `cuferry_last_error_message`, and
/// `cuferry_last_error_status` for its status).
///
/// # Safety
///
/// `stream` is a live `cudaStream_t` of `device` (or NULL, the legacy default stream).
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_malloc(
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let mut out: *mut c_void = std::ptr::null_mut();
    let status = guard(|| {
        let bytes = usize::try_from(size)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::invalid(format!("size {size}")))?;
        // The device checked (INVALID_ARGUMENT past the last), then the scope: creating the
        // device's pool makes that device current.
        device_of(device)?;
        let _scope = device_scope(device)?;
        let pool = pool_for(device)?;
        let s = (pool.kind() == PoolKind::ManagedPool).then(|| raw_stream(stream));
        let ptr = pool.inner.alloc_raw(bytes, s, false)?;
        allocations().insert(ptr as usize, (device, bytes));
        out = ptr.cast();
        Ok(())
    });
    if status == CuferryStatus::Ok {
        out
    } else {
        std::ptr::null_mut()
    }
}

/// Frees memory from [`cuferry_managed_malloc`] in order on `stream`
/// (`CUDAPluggableAllocator`'s free); NULL is a no-op. Unknown pointers and size or device
/// mismatches are reported through `cuferry_last_error_message` (and
/// `cuferry_last_error_status`) and ignored. When the free
/// itself fails (a stale stream), the allocation stays live and may be freed again.
///
/// # Safety
///
/// `stream` is a live `cudaStream_t` (or NULL); every use of `ptr` is queued on it before this
/// call or has finished. A stream other than the allocation's must be ordered after the
/// allocation (as CUDA requires of `cudaFreeAsync`); PyTorch passes the allocation's stream.
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_free(
    ptr: *mut c_void,
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = guard(|| {
        if ptr.is_null() {
            // A no-op, as every `_free` call's NULL is (a 0-byte malloc's NULL freed back).
            return Ok(());
        }
        let Some((dev, bytes)) = allocations().remove(&(ptr as usize)) else {
            return Err(Error::invalid(format!(
                "{ptr:?} is not a live cuferry managed allocation (double free?)"
            )));
        };
        if dev != device || usize::try_from(size).ok() != Some(bytes) {
            set_last_error(
                CuferryStatus::InvalidArgument,
                format!("free of {ptr:?}: given size {size} on device {device}, allocated {bytes} on {dev}"),
            );
        }
        let freed = device_scope(dev).and_then(|_scope| {
            let pool = pool_for(dev)?;
            let s = (pool.kind() == PoolKind::ManagedPool).then(|| raw_stream(stream));
            // SAFETY: the registry proves `ptr` came from this pool with `bytes` and frees it
            // once. Every use is finished or queued on `stream` (the caller's contract): a
            // CUDA pool frees in order on it; the `cudaMallocManaged` fallback's `cudaFree`
            // synchronizes the device first; the host pool (device -1) gets no queued work
            // through the C ABI, so its uses are the caller's host accesses, finished.
            unsafe { pool.inner.free_raw(ptr.cast(), bytes, s) }
        });
        if freed.is_err() {
            // Still allocated: keep it live, so a later free (on a good stream) can succeed.
            allocations().insert(ptr as usize, (dev, bytes));
        }
        freed
    });
}

/// The device of the live allocation holding `ptr..ptr+bytes`, or of foreign managed memory.
fn owner(ptr: *const c_void, bytes: usize) -> Result<i32> {
    let addr = ptr as usize;
    if let Some((&start, &(device, len))) = allocations().range(..=addr).next_back() {
        if addr < start + len {
            if bytes > start + len - addr {
                return Err(Error::invalid(format!(
                    "{ptr:?}..+{bytes} runs past the end of its allocation ({len} bytes at {start:#x})"
                )));
            }
            return Ok(device);
        }
    }
    // Foreign managed memory: both ends must be managed (CUDA checks the rest).
    let last = addr.checked_add(bytes - 1).ok_or_else(|| Error::invalid("range wraps the address space"))?;
    // The probe needs a context, and on a thread with none would create device 0's: an
    // active device's is used instead (where none is active, the probe creates it as before).
    let _ = crate::cuda::device::ensure_some_context();
    match (pointer_type(ptr), pointer_type(last as *const c_void)) {
        (Ok((PointerType::Managed, device)), Ok((PointerType::Managed, last_device)))
            if device == last_device =>
        {
            Ok(device)
        }
        _ => Err(Error::invalid(format!("{ptr:?}..+{bytes} is not inside managed memory"))),
    }
}

/// Whether `ptr` lies in a cuferry allocation from a CUDA managed memory pool.
fn from_managed_pool(ptr: *const c_void) -> bool {
    let addr = ptr as usize;
    let device = match allocations().range(..=addr).next_back() {
        Some((&start, &(device, len))) if addr < start + len => device,
        _ => return false,
    };
    device >= 0 && pool_for(device).is_ok_and(|p| p.kind() == PoolKind::ManagedPool)
}

/// Checks the ranges and the device's capabilities: the device of each range for CUDA
/// memory, `None` for host-pool memory.
fn check_ranges(ranges: &[(*const c_void, usize)], what: &str) -> Result<Option<Vec<u32>>> {
    let mut cuda = None;
    let mut devices = Vec::with_capacity(ranges.len());
    for &(p, n) in ranges {
        if p.is_null() || n == 0 {
            return Err(Error::invalid(format!("{what}: empty or NULL range")));
        }
        let device = owner(p, n)?;
        let is_cuda = device >= 0;
        if *cuda.get_or_insert(is_cuda) != is_cuda {
            return Err(Error::invalid(format!("{what}: host and CUDA memory in one call")));
        }
        if is_cuda && !pool_for(device)?.capabilities().concurrent_managed_access {
            return Err(Error::unsupported(format!(
                "{what} needs concurrentManagedAccess, which cuda:{device} lacks"
            )));
        }
        devices.extend(u32::try_from(device).ok());
    }
    Ok(cuda.unwrap_or(false).then_some(devices))
}

/// Prefetches one range to `location`, queued on `stream`. A NULL stream (or
/// `cudaStreamLegacy`) is the legacy default stream of the memory's device (the caller's
/// current device is restored), where `cuferry_managed_malloc` with a NULL stream allocated.
///
/// # Safety
///
/// `stream` is a live `cudaStream_t` (or NULL); the memory stays allocated until it ran.
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_prefetch(
    ptr: *const c_void,
    bytes: usize,
    location: CuferryLocation,
    stream: *mut c_void,
) -> CuferryStatus {
    guard(|| {
        let loc = location_of(location)?;
        let Some(devices) = check_ranges(&[(ptr, bytes)], "prefetch")? else {
            return host_only(loc, "prefetch");
        };
        let _scope = memory_device_scope(stream, devices[0])?;
        // SAFETY: the range is managed memory (checked) kept allocated by the caller.
        unsafe { raw::prefetch_async(ptr, bytes, loc.raw()?, raw_stream(stream)) }
    })
}

fn host_only(location: Location, what: &str) -> Result<()> {
    match location {
        Location::Device(i) => {
            Err(Error::unsupported(format!("{what}: host-pool memory cannot move to cuda:{i}")))
        }
        _ => Ok(()),
    }
}

/// The most ranges one batched call takes (2^24: far past any real batch; a larger count is
/// taken for garbage).
pub const CUFERRY_MANAGED_MAX_BATCH: usize = 16_777_216;
const MAX_BATCH_RANGES: usize = CUFERRY_MANAGED_MAX_BATCH;

/// Reads `count` ranges from two C arrays.
///
/// # Safety
///
/// Both arrays are NULL or hold `count` readable elements.
unsafe fn ranges_of(
    ptrs: *const *const c_void,
    sizes: *const usize,
    count: usize,
) -> Result<Vec<(*const c_void, usize)>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if ptrs.is_null() || sizes.is_null() {
        return Err(Error::invalid("ptrs or sizes is NULL"));
    }
    // No two arrays of more elements fit in memory: a garbage count is refused before the
    // copy below tries to allocate for it (which would abort the process).
    if count > MAX_BATCH_RANGES {
        return Err(Error::invalid(format!(
            "{count} ranges exceed the most one batch takes ({MAX_BATCH_RANGES})"
        )));
    }
    let mut ranges = Vec::new();
    ranges
        .try_reserve_exact(count)
        .map_err(|e| Error::out_of_memory(format!("no memory for {count} ranges: {e}")))?;
    // SAFETY: the caller's contract: `count` readable elements each.
    let (p, s) =
        unsafe { (std::slice::from_raw_parts(ptrs, count), std::slice::from_raw_parts(sizes, count)) };
    ranges.extend(p.iter().copied().zip(s.iter().copied()));
    Ok(ranges)
}

/// For the legacy default stream (NULL or `cudaStreamLegacy`), which is the *current* device's:
/// `device` (the memory's) current for the call (the caller's restored after), so that the
/// prefetch is queued on that device's legacy stream, where `cuferry_managed_malloc` with a
/// NULL stream ordered the allocation, and no other device's context is made. `None` for
/// another stream (it names its own device), after making `device` current on a thread with
/// no context, which would otherwise get one on device 0.
fn memory_device_scope(stream: *mut c_void, device: u32) -> Result<Option<DeviceScope>> {
    if !is_legacy_stream(stream) {
        let _ = crate::cuda::device::ensure_context(device);
        return Ok(None);
    }
    DeviceScope::enter(device).map(Some)
}

/// Whether `stream` names the legacy default stream: NULL, or the runtime's
/// `cudaStreamLegacy` handle (`(cudaStream_t)0x1`).
fn is_legacy_stream(stream: *mut c_void) -> bool {
    stream.is_null() || stream as usize == 1
}

/// Prefetches `count` ranges to `location` in ONE batched call, queued on `stream`. CUDA allows
/// no batch on the legacy default stream (NULL or `cudaStreamLegacy`) or on a machine where
/// any device lacks `concurrentManagedAccess`: there it is one call per range, in order.
/// `count` is at most `CUFERRY_MANAGED_MAX_BATCH` (`CUFERRY_STATUS_INVALID_ARGUMENT` beyond).
///
/// # Safety
///
/// `ptrs` and `sizes` hold `count` elements; `stream` is live (or NULL); the memory stays
/// allocated until the batch ran.
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_prefetch_batch(
    ptrs: *const *const c_void,
    sizes: *const usize,
    count: usize,
    location: CuferryLocation,
    stream: *mut c_void,
) -> CuferryStatus {
    guard(|| {
        let loc = location_of(location)?;
        // SAFETY: the caller's contract on the arrays.
        let ranges = unsafe { ranges_of(ptrs, sizes, count) }?;
        if ranges.is_empty() {
            return Ok(());
        }
        let Some(devices) = check_ranges(&ranges, "prefetch")? else {
            return host_only(loc, "prefetch");
        };
        let location = loc.raw()?;
        if is_legacy_stream(stream) || device_lacking_concurrent_access()?.is_some() {
            // CUDA refuses batched prefetches on the legacy default stream, and on a machine
            // where any device lacks concurrentManagedAccess: one call per range keeps the
            // caller's ordering there.
            for (&(p, n), &device) in ranges.iter().zip(&devices) {
                let _scope = memory_device_scope(stream, device)?;
                // SAFETY: every range is managed memory (checked) kept allocated by the caller.
                unsafe { raw::prefetch_async(p, n, location, raw_stream(stream)) }?;
            }
            return Ok(());
        }
        let _ = crate::cuda::device::ensure_context(devices[0]);
        let mut batch = Batch {
            ptrs: ranges.iter().map(|(p, _)| p.cast_mut()).collect(),
            sizes: ranges.iter().map(|(_, n)| *n).collect(),
            locations: vec![location],
            starts: vec![0],
        };
        // SAFETY: every range is managed memory (checked) kept allocated by the caller.
        unsafe { raw::prefetch_batch_async(&mut batch, false, raw_stream(stream)) }
    })
}

/// Gives advice (`CUFERRY_ADVISE_*`, with `location` where the advice names one) for a range.
///
/// # Safety
///
/// The memory is live.
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_advise(
    ptr: *const c_void,
    bytes: usize,
    advice: i32,
    location: CuferryLocation,
) -> CuferryStatus {
    guard(|| {
        let advice = advice_of(advice, location)?;
        let Some(devices) = check_ranges(&[(ptr, bytes)], "advise")? else {
            return advice.location_host_only();
        };
        let (value, loc) = advice.raw()?;
        // Advice takes no stream: on a thread with no context, the memory's device.
        let _ = crate::cuda::device::ensure_context(devices[0]);
        let mut batch = Batch {
            ptrs: vec![ptr.cast_mut()],
            sizes: vec![bytes],
            locations: Vec::new(),
            starts: Vec::new(),
        };
        // SAFETY: the range is live managed memory (checked).
        unsafe { raw::advise_ranges(&mut batch, value, loc) }.map_err(|e| {
            let pool_memory = from_managed_pool(ptr);
            match advice_refused(e, pool_memory) {
                // The Rust remedy it names, then the C ABI's.
                Error::Unsupported { what } if pool_memory => Error::unsupported(format!(
                    "{what}; from C, call cuferry_managed_pool_configure(device, \
                     CUFERRY_MANAGED_POOL_MALLOC_MANAGED, 0) (Python: \
                     lib.managed_pool_configure(device, use_malloc_managed=True)) before the \
                     device's first managed call"
                )),
                other => other,
            }
        })
    })
}

impl Advice {
    /// Advice on host-pool memory is a no-op, but not towards a CUDA device.
    fn location_host_only(self) -> Result<()> {
        match self.location() {
            Some(l) => host_only(l, "advise"),
            None => Ok(()),
        }
    }
}

/// Byte counters of `device`'s managed pool (made on first use).
///
/// # Safety
///
/// `out` is NULL or valid for writing a `CuferryPoolStats`.
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_pool_stats(
    device: i32,
    out: *mut CuferryPoolStats,
) -> CuferryStatus {
    guard(|| {
        let s = pool_for(device)?.stats()?;
        let stats = CuferryPoolStats {
            reserved_current: s.reserved_current,
            reserved_high: s.reserved_high,
            used_current: s.used_current,
            used_high: s.used_high,
        };
        // SAFETY: the caller's contract on `out`.
        unsafe { write_out(out, stats) }
    })
}

/// Which allocator backs `device`'s pool in `*kind`: 0 host, 1 managed pool, 2
/// `cudaMallocManaged` fallback.
///
/// # Safety
///
/// `kind` is NULL or valid for writing an `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn cuferry_managed_pool_kind(device: i32, kind: *mut i32) -> CuferryStatus {
    guard(|| {
        let k = match pool_for(device)?.kind() {
            PoolKind::Host => 0,
            PoolKind::ManagedPool => 1,
            PoolKind::MallocManaged => 2,
        };
        // SAFETY: the caller's contract on `kind`.
        unsafe { write_out(kind, k) }
    })
}

/// [`cuferry_managed_pool_configure`] flag: allocate with `cudaMallocManaged` even where CUDA
/// managed memory pools work. Such memory takes `cuferry_managed_advise` on drivers that
/// refuse advice on managed-pool memory (the H100's driver 580.159 does); allocations are not
/// stream-ordered (`cudaFree` waits for the device).
pub const CUFERRY_MANAGED_POOL_MALLOC_MANAGED: u32 = 1;
/// [`cuferry_managed_pool_configure`] flag: a CUDA managed memory pool with no preferred
/// location (default: the device). `cudaMallocManaged` memory has none anyway.
pub const CUFERRY_MANAGED_POOL_NO_PREFERRED_LOCATION: u32 = 2;

const POOL_FLAGS: u32 = CUFERRY_MANAGED_POOL_MALLOC_MANAGED | CUFERRY_MANAGED_POOL_NO_PREFERRED_LOCATION;

/// The options `cuferry_managed_pool_configure` asks for. On the host backend the flags have no
/// meaning: they are dropped, so that a host pool's options differ only in `max_size`.
fn configured_options(device: i32, flags: u32, max_size: u64) -> Result<ManagedPoolOptions> {
    if flags & !POOL_FLAGS != 0 {
        return Err(Error::invalid(format!(
            "pool flags {flags:#x}: use CUFERRY_MANAGED_POOL_* bits ({POOL_FLAGS:#x})"
        )));
    }
    let max_size = usize::try_from(max_size)
        .map_err(|_| Error::invalid(format!("max_size {max_size} is larger than any pool")))?;
    let cuda = device != super::CUFERRY_HOST;
    Ok(ManagedPoolOptions {
        use_malloc_managed: cuda && flags & CUFERRY_MANAGED_POOL_MALLOC_MANAGED != 0,
        prefer_device: !cuda || flags & CUFERRY_MANAGED_POOL_NO_PREFERRED_LOCATION == 0,
        max_size,
        ..ManagedPoolOptions::default()
    })
}

/// What a pool is, for messages: its kind and the options it was made with.
fn describe(pool: &DevicePool) -> String {
    let kind = match pool.pool.kind() {
        PoolKind::Host => "host memory (the host backend's pool)",
        PoolKind::ManagedPool => "a CUDA managed memory pool",
        PoolKind::MallocManaged => "cudaMallocManaged allocations",
    };
    let o = &pool.options;
    format!(
        "{kind}, made with use_malloc_managed {}, prefer_device {}, max_size {}",
        o.use_malloc_managed, o.prefer_device, o.max_size
    )
}

/// Makes `device`'s managed pool (the one every `cuferry_managed_*` call on that device uses)
/// with these options, before its first use: `flags` is 0 or an OR of
/// `CUFERRY_MANAGED_POOL_*` bits, `max_size` the most bytes the pool may reserve (0: no limit;
/// past it an allocation fails as one out of memory does). Without this call the pool is made
/// on the device's first managed call (`cuferry_managed_malloc`, `_pool_stats`, `_pool_kind`,
/// prefetch or advice of managed memory on the device, cuferry's or not) with flags 0 and no
/// limit.
///
/// Called again with the same options it does nothing and succeeds. Once the pool exists with
/// other options, it fails with `CUFERRY_STATUS_INVALID_ARGUMENT`, and the message names the
/// existing pool's kind and options: a pool is never replaced (allocations may live in it).
/// The options compared are those asked for, not the outcome: a pool asked with flags 0 that
/// fell back to `cudaMallocManaged` still refuses `CUFERRY_MANAGED_POOL_MALLOC_MANAGED`.
///
/// On the host backend (`CUFERRY_HOST`) the pool is plain host memory: the flags are accepted
/// and ignored (code written for a GPU runs there unchanged), only `max_size` counts. On CUDA,
/// a limit with flags 0 where the driver refuses managed pools is `CUFERRY_STATUS_UNSUPPORTED`
/// (`cudaMallocManaged` could not keep to it: pass `CUFERRY_MANAGED_POOL_MALLOC_MANAGED`,
/// with which cuferry counts live bytes against it). A pool that could not be made is not
/// kept: the call may be retried. Unknown flag bits, a device past the last or below -1 are
/// `CUFERRY_STATUS_INVALID_ARGUMENT`. The caller's current device is restored.
#[no_mangle]
pub extern "C" fn cuferry_managed_pool_configure(device: i32, flags: u32, max_size: u64) -> CuferryStatus {
    guard(|| {
        device_of(device)?;
        let options = configured_options(device, flags, max_size)?;
        let mut pools = pools();
        if let Some(existing) = pools.get(&device) {
            if existing.options == options {
                return Ok(());
            }
            return Err(Error::invalid(format!(
                "device {device}'s managed pool already exists: {}. It cannot be made again with \
                 use_malloc_managed {}, prefer_device {}, max_size {}: configure a device's pool \
                 before its first managed call",
                describe(existing),
                options.use_malloc_managed,
                options.prefer_device,
                options.max_size
            )));
        }
        let pool = make_pool(device, options)?;
        pools.insert(device, DevicePool { pool, options });
        Ok(())
    })
}
