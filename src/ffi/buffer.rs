//! Buffers in the C ABI: pinned and device allocations, their queries, and copies between
//! them (one range, or a batch).
//!
//! Rules:
//! - A buffer handle is borrowed shared by every call but `cuferry_buffer_free`: C may pass one
//!   buffer to calls on several threads at once, or as both source and destination (the
//!   copies refuse overlapping ranges before queueing anything).
//! - C writes a buffer only through cuferry calls, which its tracker orders, or through its
//!   pointer after `cuferry_buffer_synchronize` (the header's rule), so nothing else writes a
//!   destination while a copy into it is queued.

use std::ffi::c_void;

use super::{device_of, guard, handle, slice_of, write_out, CuferryStatus, CuferryStream};
use crate::copy::{copy_range_tracked, CopyBatch, CopyRange};
use crate::error::Error;
use crate::memory::{DeviceBuffer, PinnedBuffer};

/// A cuferry buffer: pinned host memory or device memory (opaque).
pub struct CuferryBuffer {
    pub(crate) memory: BufferMemory,
}

pub(crate) enum BufferMemory {
    Pinned(PinnedBuffer<u8>),
    Device(DeviceBuffer<u8>),
}

/// Allocates `bytes` of zeroed pinned host memory for `device` in `*out`.
///
/// # Safety
///
/// `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_pinned_alloc(
    device: i32,
    bytes: usize,
    out: *mut *mut CuferryBuffer,
) -> CuferryStatus {
    guard(|| {
        if out.is_null() {
            return Err(Error::invalid("out is NULL"));
        }
        let memory = BufferMemory::Pinned(PinnedBuffer::zeroed(device_of(device)?, bytes)?);
        // SAFETY: `out` is non-NULL and valid for writing (caller's contract).
        unsafe { write_out(out, Box::into_raw(Box::new(CuferryBuffer { memory }))) }
    })
}

/// Allocates `bytes` of device memory on `stream`'s device, zeroed on `stream`, in `*out`.
///
/// # Safety
///
/// `stream` is NULL or a live stream handle; `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_device_alloc(
    stream: *const CuferryStream,
    bytes: usize,
    out: *mut *mut CuferryBuffer,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract on `stream`.
        let stream = unsafe { handle(stream, "stream") }?;
        if out.is_null() {
            return Err(Error::invalid("out is NULL"));
        }
        let memory = BufferMemory::Device(DeviceBuffer::zeroed(&stream.stream, bytes)?);
        // SAFETY: `out` is non-NULL and valid for writing (caller's contract).
        unsafe { write_out(out, Box::into_raw(Box::new(CuferryBuffer { memory }))) }
    })
}

/// Frees a buffer after the copies queued on it (NULL is a no-op). The handle is freed
/// whatever the status: an error reports a failed wait for those copies (the memory is then
/// leaked, since they may still use it) or a failed free, and must not be answered by freeing
/// it again.
///
/// # Safety
///
/// `buffer` is NULL or a live buffer handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_free(buffer: *mut CuferryBuffer) -> CuferryStatus {
    guard(|| {
        if buffer.is_null() {
            return Ok(());
        }
        // SAFETY: a live handle from an allocation function, given up by the caller.
        let b = unsafe { Box::from_raw(buffer) };
        // Errors are returned, not also kept as drop errors.
        match b.memory {
            BufferMemory::Pinned(p) => p.free(),
            BufferMemory::Device(d) => d.free(),
        }
    })
}

/// The buffer's memory: a host pointer for pinned buffers, a device pointer for device
/// buffers (NULL for a NULL handle or an empty buffer).
///
/// # Safety
///
/// `buffer` is NULL or a live buffer handle.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_ptr(buffer: *const CuferryBuffer) -> *mut c_void {
    // SAFETY: the caller's contract on `buffer`.
    match unsafe { buffer.as_ref() } {
        Some(CuferryBuffer { memory: BufferMemory::Pinned(p) }) => p.as_ptr().cast_mut().cast(),
        Some(CuferryBuffer { memory: BufferMemory::Device(d) }) => d.as_ptr().cast_mut().cast(),
        None => std::ptr::null_mut(),
    }
}

/// The buffer's size in bytes (0 for NULL).
///
/// # Safety
///
/// `buffer` is NULL or a live buffer handle.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_size(buffer: *const CuferryBuffer) -> usize {
    // SAFETY: the caller's contract on `buffer`.
    match unsafe { buffer.as_ref() } {
        Some(CuferryBuffer { memory: BufferMemory::Pinned(p) }) => p.len(),
        Some(CuferryBuffer { memory: BufferMemory::Device(d) }) => d.len(),
        None => 0,
    }
}

/// Blocks until every copy queued on the buffer has finished.
///
/// # Safety
///
/// `buffer` is NULL or a live buffer handle.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_synchronize(buffer: *const CuferryBuffer) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract on `buffer`.
        match &unsafe { handle(buffer, "buffer") }?.memory {
            BufferMemory::Pinned(p) => p.synchronize(),
            BufferMemory::Device(d) => d.synchronize(),
        }
    })
}

/// Queues a copy of `bytes` bytes from `src` at `src_offset` to `dst` at `dst_offset` on
/// `stream`, in whichever direction the two buffers need. `src` and `dst` may be one buffer
/// when the two ranges do not overlap (overlapping ranges: `CUFERRY_STATUS_INVALID_ARGUMENT`).
///
/// # Safety
///
/// Every handle is NULL or live; C code does not touch `dst`'s memory until the copy finished.
#[no_mangle]
pub unsafe extern "C" fn cuferry_copy(
    stream: *const CuferryStream,
    src: *const CuferryBuffer,
    src_offset: usize,
    dst: *mut CuferryBuffer,
    dst_offset: usize,
    bytes: usize,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract on the handles. They are borrowed shared: C may pass
        // one buffer to calls on several threads at once, or as both `src` and `dst` (the copy
        // refuses overlapping ranges before queueing anything).
        let (stream, src, dst) =
            unsafe { (handle(stream, "stream")?, handle(src, "source")?, handle(dst, "destination")?) };
        let s = &stream.stream;
        // SAFETY (each arm): C writes a buffer only through cuferry calls, which its tracker
        // orders, or through its pointer after `cuferry_buffer_synchronize` (the header's rule),
        // so nothing else writes the destination while the copy is queued.
        match (&src.memory, &dst.memory) {
            (BufferMemory::Pinned(a), BufferMemory::Pinned(b)) => unsafe {
                copy_range_tracked(s, a, src_offset, b, dst_offset, bytes)
            },
            (BufferMemory::Pinned(a), BufferMemory::Device(b)) => unsafe {
                copy_range_tracked(s, a, src_offset, b, dst_offset, bytes)
            },
            (BufferMemory::Device(a), BufferMemory::Pinned(b)) => unsafe {
                copy_range_tracked(s, a, src_offset, b, dst_offset, bytes)
            },
            (BufferMemory::Device(a), BufferMemory::Device(b)) => unsafe {
                copy_range_tracked(s, a, src_offset, b, dst_offset, bytes)
            },
        }
        .map(drop)
    })
}

/// One copy of a [`cuferry_copy_batch`]: `bytes` bytes from `src_offset` in the source to
/// `dst_offset` in the destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CuferryCopyRange {
    /// First byte read from the source.
    pub src_offset: usize,
    /// First byte written in the destination.
    pub dst_offset: usize,
    /// Bytes to copy (0: the range is skipped).
    pub bytes: usize,
}

/// Queues `count` copies from `src` to `dst` on `stream` as one batch (on CUDA one
/// `cudaMemcpyBatchAsync`, cheaper than `count` calls of [`cuferry_copy`]): a paged cache's
/// blocks, a gather of items. The copies run in no set order among themselves, so no byte may
/// be written by two of them, or written by one and read by another (`src` and `dst` may be
/// one buffer under that rule); such a batch, or a range outside either buffer, is
/// `CUFERRY_STATUS_INVALID_ARGUMENT` and nothing is queued. The batch is ordered after both
/// buffers' earlier uses, as a copy is. `ranges` may be NULL when `count` is 0.
///
/// # Safety
///
/// Every handle is NULL or live; `ranges` holds `count` readable elements (or is NULL); C
/// code does not touch `dst`'s memory until the batch finished.
#[no_mangle]
pub unsafe extern "C" fn cuferry_copy_batch(
    stream: *const CuferryStream,
    src: *const CuferryBuffer,
    dst: *mut CuferryBuffer,
    ranges: *const CuferryCopyRange,
    count: usize,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract on the handles and `ranges`. The buffers are borrowed
        // shared, as for `cuferry_copy`.
        let (stream, src, dst, ranges) = unsafe {
            (
                handle(stream, "stream")?,
                handle(src, "source")?,
                handle(dst, "destination")?,
                slice_of(ranges, count, "ranges")?,
            )
        };
        let mut listed: Vec<CopyRange> = Vec::new();
        listed
            .try_reserve_exact(ranges.len())
            .map_err(|e| Error::out_of_memory(format!("no memory for {count} ranges: {e}")))?;
        listed.extend(ranges.iter().map(|r| CopyRange::new(r.src_offset, r.dst_offset, r.bytes)));
        let mut batch = CopyBatch::new(&stream.stream);
        // SAFETY (each arm): as for `cuferry_copy`, C writes a buffer only through cuferry
        // calls, which its tracker orders, or through its pointer after
        // `cuferry_buffer_synchronize`.
        match (&src.memory, &dst.memory) {
            (BufferMemory::Pinned(a), BufferMemory::Pinned(b)) => unsafe { batch.add_tracked(a, b, &listed) },
            (BufferMemory::Pinned(a), BufferMemory::Device(b)) => unsafe { batch.add_tracked(a, b, &listed) },
            (BufferMemory::Device(a), BufferMemory::Pinned(b)) => unsafe { batch.add_tracked(a, b, &listed) },
            (BufferMemory::Device(a), BufferMemory::Device(b)) => unsafe { batch.add_tracked(a, b, &listed) },
        }?;
        batch.submit()
    })
}
