//! Managed memory calls (managed.cu).

use std::os::raw::c_void;

use super::{check, ordinal, stream::RawStream};
use crate::error::Result;
use crate::sys;

/// A `cudaMemPool_t`. Copyable; never destroyed (see `managed::pool`): idle pools are recycled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawPool(pub(crate) sys::cuferry_mem_pool);

// SAFETY: a memory pool handle may be used from any thread; the runtime is thread-safe.
unsafe impl Send for RawPool {}
// SAFETY: as above.
unsafe impl Sync for RawPool {}

/// `cudaMemPoolCreate` with allocType managed, then the release threshold.
pub(crate) fn managed_pool_create(
    device: u32,
    prefer_device: bool,
    max_size: usize,
    release_threshold: u64,
) -> Result<RawPool> {
    let dev = ordinal(device)?;
    let mut p: sys::cuferry_mem_pool = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the duration of the call.
    check("cudaMemPoolCreate", unsafe {
        sys::cuferry_cuda_managed_pool_create(
            dev,
            i32::from(prefer_device),
            max_size,
            release_threshold,
            &mut p,
        )
    })?;
    Ok(RawPool(p))
}

/// Readies an idle pool for a new owner: trimmed to nothing, high-water marks reset.
///
/// # Safety
///
/// 1. `pool` came from [`managed_pool_create`]; no allocation of it is live and no free of it
///    is still queued.
pub(crate) unsafe fn pool_recycle(pool: RawPool) -> Result<()> {
    // SAFETY: precondition 1.
    check("cudaMemPoolTrimTo", unsafe { sys::cuferry_cuda_mem_pool_recycle(pool.0) })
}

/// `cudaMallocFromPoolAsync` (`bytes > 0`).
pub(crate) fn pool_alloc_async(pool: RawPool, bytes: usize, stream: RawStream) -> Result<*mut c_void> {
    let mut p = std::ptr::null_mut();
    // SAFETY: live handles; `p` is a valid out-pointer.
    check("cudaMallocFromPoolAsync", unsafe {
        sys::cuferry_cuda_mem_pool_alloc_async(pool.0, bytes, stream.0, &mut p)
    })?;
    Ok(p)
}

/// `cudaFreeAsync`.
///
/// # Safety
///
/// 1. `ptr` came from [`pool_alloc_async`] and every use of it is queued before this point
///    on `stream` (or finished).
pub(crate) unsafe fn free_async(ptr: *mut c_void, stream: RawStream) -> Result<()> {
    // SAFETY: precondition 1.
    check("cudaFreeAsync", unsafe { sys::cuferry_cuda_free_async(ptr, stream.0) })
}

/// The pool's byte counters.
pub(crate) fn pool_stats(pool: RawPool) -> Result<sys::cuferry_pool_stats> {
    let mut s =
        sys::cuferry_pool_stats { reserved_current: 0, reserved_high: 0, used_current: 0, used_high: 0 };
    // SAFETY: live handle; `s` is a valid out-pointer.
    check("cudaMemPoolGetAttribute", unsafe { sys::cuferry_cuda_mem_pool_stats(pool.0, &mut s) })?;
    Ok(s)
}

/// `cudaMallocManaged` (the fallback where pools are refused).
pub(crate) fn malloc_managed(device: u32, bytes: usize) -> Result<*mut c_void> {
    let dev = ordinal(device)?;
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    check("cudaMallocManaged", unsafe { sys::cuferry_cuda_malloc_managed(dev, bytes, &mut p) })?;
    Ok(p)
}

/// `cudaMemPrefetchAsync`.
///
/// # Safety
///
/// 1. `ptr..ptr+bytes` is managed memory that **stays allocated until the stream ran it**.
pub(crate) unsafe fn prefetch_async(
    ptr: *const c_void,
    bytes: usize,
    location: sys::cuferry_location,
    stream: RawStream,
) -> Result<()> {
    // SAFETY: precondition 1.
    check("cudaMemPrefetchAsync", unsafe {
        sys::cuferry_cuda_mem_prefetch_async(ptr, bytes, location, stream.0)
    })
}

/// Ranges of a batched call, with the location groups (`starts[0] == 0`, increasing).
pub(crate) struct Batch {
    pub(crate) ptrs: Vec<*mut c_void>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) locations: Vec<sys::cuferry_location>,
    pub(crate) starts: Vec<usize>,
}

/// `cudaMemPrefetchBatchAsync`, or with `discard` `cudaMemDiscardAndPrefetchBatchAsync`.
///
/// # Safety
///
/// 1. Every range is managed memory that **stays allocated until the stream ran the batch**.
pub(crate) unsafe fn prefetch_batch_async(batch: &mut Batch, discard: bool, stream: RawStream) -> Result<()> {
    let (p, s, l, st) = (
        batch.ptrs.as_mut_ptr(),
        batch.sizes.as_mut_ptr(),
        batch.locations.as_mut_ptr(),
        batch.starts.as_mut_ptr(),
    );
    let (count, n_loc) = (batch.ptrs.len(), batch.locations.len());
    // SAFETY: precondition 1; the arrays are live for the call and of the lengths passed.
    unsafe {
        if discard {
            check(
                "cudaMemDiscardAndPrefetchBatchAsync",
                sys::cuferry_cuda_mem_discard_and_prefetch_batch_async(p, s, count, l, st, n_loc, stream.0),
            )
        } else {
            check(
                "cudaMemPrefetchBatchAsync",
                sys::cuferry_cuda_mem_prefetch_batch_async(p, s, count, l, st, n_loc, stream.0),
            )
        }
    }
}

/// `cudaMemDiscardBatchAsync`.
///
/// # Safety
///
/// 1. Every range is managed memory that **stays allocated until the stream ran the batch**.
pub(crate) unsafe fn discard_batch_async(batch: &mut Batch, stream: RawStream) -> Result<()> {
    let count = batch.ptrs.len();
    // SAFETY: precondition 1; the arrays are live for the call and `count` long.
    check("cudaMemDiscardBatchAsync", unsafe {
        sys::cuferry_cuda_mem_discard_batch_async(
            batch.ptrs.as_mut_ptr(),
            batch.sizes.as_mut_ptr(),
            count,
            stream.0,
        )
    })
}

/// `cudaMemAdvise` over every range of `batch` (one C call).
///
/// # Safety
///
/// 1. Every range is live managed memory.
pub(crate) unsafe fn advise_ranges(
    batch: &mut Batch,
    advice: i32,
    location: sys::cuferry_location,
) -> Result<()> {
    let count = batch.ptrs.len();
    // SAFETY: precondition 1; the arrays are live for the call and `count` long.
    check("cudaMemAdvise", unsafe {
        sys::cuferry_cuda_mem_advise_ranges(
            batch.ptrs.as_mut_ptr(),
            batch.sizes.as_mut_ptr(),
            count,
            advice,
            location,
        )
    })
}

/// The pattern kernel: `data[i] = seed * 2654435761 + i`.
///
/// # Safety
///
/// 1. `data..data+n` is device-accessible memory that **stays allocated until the stream ran it**.
pub(crate) unsafe fn fill_pattern_u32(data: *mut u32, n: usize, seed: u32, stream: RawStream) -> Result<()> {
    // SAFETY: precondition 1.
    check("cf_fill_pattern_u32<<<>>>", unsafe { sys::cuferry_cuda_fill_pattern_u32(data, n, seed, stream.0) })
}

/// The sum kernel into the device-accessible word `sum`.
///
/// # Safety
///
/// 1. Both ranges are device-accessible and **stay allocated until the stream ran it**.
pub(crate) unsafe fn sum_u32(data: *const u32, n: usize, sum: *mut u64, stream: RawStream) -> Result<()> {
    // SAFETY: precondition 1 (`u64` and `unsigned long long` have the same layout).
    check("cf_sum_u32<<<>>>", unsafe { sys::cuferry_cuda_sum_u32(data, n, sum.cast(), stream.0) })
}
