//! Buffers in the C ABI: pinned and device allocations, wrappers of the caller's own memory,
//! their queries, and copies between them (one range, or a batch).
//!
//! Rules:
//! - A buffer handle is borrowed shared by every call but `cuferry_buffer_free`: C may pass one
//!   buffer to calls on several threads at once, or as both source and destination (the
//!   copies refuse overlapping ranges before queueing anything).
//! - C writes a buffer only through cuferry calls, which its tracker orders, or through its
//!   pointer after `cuferry_buffer_synchronize`, so nothing else writes a destination while a
//!   copy into it is queued.
//! - A wrapper (`cuferry_buffer_wrap`) is the caller's memory: cuferry never frees it, and the
//!   owner may free or reuse it once `cuferry_buffer_free` of the wrapper returned OK, which
//!   waits for its copies first. What the memory is (device, managed, page-locked or pageable
//!   host memory) comes from CUDA, not from the caller. A read-only wrapper is never written
//!   (a copy's destination, an unpacked halo array). Live wrappers never share a byte.

use std::ffi::c_void;

use super::{device_of, guard, handle, slice_of, write_out, CuferryStatus, CuferryStream};
use crate::copy::{copy_range_tracked, CopyBatch, CopyRange};
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::{DeviceBuffer, ForeignBuffer, Memory, PinnedBuffer};

/// A cuferry buffer: pinned host memory, device memory, or memory the caller owns and
/// wrapped (opaque).
pub struct CuferryBuffer {
    pub(crate) memory: BufferMemory,
}

pub(crate) enum BufferMemory {
    Pinned(PinnedBuffer<u8>),
    Device(DeviceBuffer<u8>),
    Wrapped(ForeignBuffer<u8>),
}

impl BufferMemory {
    /// The memory, as copies read it.
    pub(crate) fn source(&self) -> &dyn Memory<u8> {
        match self {
            BufferMemory::Pinned(p) => p,
            BufferMemory::Device(d) => d,
            BufferMemory::Wrapped(w) => w,
        }
    }

    /// The memory, as copies write it: a read-only wrapper is refused.
    pub(crate) fn destination(&self) -> Result<&dyn Memory<u8>> {
        match self {
            BufferMemory::Wrapped(w) => w.check_writable().map(|()| w as &dyn Memory<u8>),
            other => Ok(other.source()),
        }
    }

    /// The first byte (NULL for an empty allocation).
    fn as_ptr(&self) -> *mut c_void {
        match self {
            BufferMemory::Pinned(p) => p.as_ptr().cast_mut().cast(),
            BufferMemory::Device(d) => d.as_ptr().cast_mut().cast(),
            BufferMemory::Wrapped(w) => w.as_ptr().cast(),
        }
    }

    /// Waits for every use queued on the memory.
    fn synchronize(&self) -> Result<()> {
        match self {
            BufferMemory::Pinned(p) => p.synchronize(),
            BufferMemory::Device(d) => d.synchronize(),
            BufferMemory::Wrapped(w) => w.synchronize(),
        }
    }

    /// Waits for the queued uses, then frees the allocation (a wrapper: unregisters what it
    /// registered, and leaves the memory to its owner).
    fn free(self) -> Result<()> {
        match self {
            BufferMemory::Pinned(p) => p.free(),
            BufferMemory::Device(d) => d.free(),
            BufferMemory::Wrapped(w) => w.release(),
        }
    }
}

/// [`cuferry_buffer_wrap`] flag: the memory is only read by cuferry. A copy into it, or a halo
/// unpack, is `CUFERRY_STATUS_INVALID_ARGUMENT`, so read-only memory (a Python `bytes`, a
/// constant table) can be a copy's source.
pub const CUFERRY_WRAP_READ_ONLY: u32 = 1;

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

/// Wraps `bytes` bytes of memory the caller owns at `ptr` as a buffer in `*out`, for copies
/// with `device` (`CUFERRY_HOST` or a CUDA ordinal): a NumPy array, a PyTorch or CuPy tensor,
/// a C code's own `malloc` or `cudaMalloc`. The memory is never freed by cuferry, and may be
/// a source or (unless `flags` has [`CUFERRY_WRAP_READ_ONLY`]) a destination of
/// [`cuferry_copy`] and [`cuferry_copy_batch`], and a halo array (`cuferry_halo_pack`, and
/// unless read-only `cuferry_halo_unpack`).
///
/// CUDA says what the memory is, from its first and last byte, which must agree:
/// - device or managed memory must be `device`'s (`CUFERRY_HOST` takes neither);
/// - page-locked host memory is used as it is;
/// - pageable host memory is page-locked for the wrapper's life when the driver allows
///   (`cudaHostRegister`, portable), and copied at pageable speed otherwise.
///
/// One memory has one live wrapper at a time: a wrap touching bytes another live wrapper
/// holds is refused (two wrappers would not order their copies with each other). Use one
/// wrapper for every copy of the memory; a writable wrapper is a source too.
///
/// `ptr` may be NULL only when `bytes` is 0. `flags` is 0 or [`CUFERRY_WRAP_READ_ONLY`];
/// other bits are `CUFERRY_STATUS_INVALID_ARGUMENT`, as are a range past the end of the
/// address space, bytes of a live wrapper, ends in two kinds of memory or two devices, and
/// device memory of another device. CUDA cannot tell unmapped addresses from pageable
/// memory: the range must lie in one allocation.
///
/// [`cuferry_buffer_free`] waits for the copies queued on the wrapper and undoes its
/// registration; only then may the owner free or reuse the memory. When that wait fails, a
/// copy may still use the memory: keep it for good.
///
/// # Safety
///
/// `ptr..ptr+bytes` is memory of one allocation that stays allocated, in place and
/// page-locked if it was (registered by its owner), until the wrapper is freed; it is
/// writable unless `flags` has [`CUFERRY_WRAP_READ_ONLY`]; while a use through the wrapper (a
/// copy, a halo pack or unpack) is queued or running, nothing else writes the memory (nor
/// reads it while the use writes it); `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_wrap(
    device: i32,
    ptr: *mut c_void,
    bytes: usize,
    flags: u32,
    out: *mut *mut CuferryBuffer,
) -> CuferryStatus {
    guard(|| {
        if out.is_null() {
            return Err(Error::invalid("out is NULL"));
        }
        if flags & !CUFERRY_WRAP_READ_ONLY != 0 {
            return Err(Error::invalid(format!(
                "flags {flags:#x}: only CUFERRY_WRAP_READ_ONLY (1) is defined"
            )));
        }
        let read_only = flags & CUFERRY_WRAP_READ_ONLY != 0;
        // SAFETY: the caller's contract on the memory, which is `wrap`'s.
        let wrapped =
            unsafe { ForeignBuffer::wrap_with(device_of(device)?, ptr.cast::<u8>(), bytes, read_only) }?;
        let memory = BufferMemory::Wrapped(wrapped);
        // SAFETY: `out` is non-NULL and valid for writing (caller's contract).
        unsafe { write_out(out, Box::into_raw(Box::new(CuferryBuffer { memory }))) }
    })
}

/// Frees a buffer after the copies queued on it (NULL is a no-op; a wrapper leaves the memory
/// to its owner, see [`cuferry_buffer_wrap`]). The handle is freed whatever the status: an
/// error reports a failed wait for those copies (the memory is then leaked, since they may
/// still use it) or a failed free, and must not be answered by freeing it again.
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
        b.memory.free()
    })
}

/// The buffer's memory: a host pointer for pinned buffers, a device pointer for device
/// buffers, the wrapped pointer for a wrapper (NULL for a NULL handle or an empty buffer).
///
/// # Safety
///
/// `buffer` is NULL or a live buffer handle.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_ptr(buffer: *const CuferryBuffer) -> *mut c_void {
    // SAFETY: the caller's contract on `buffer`.
    unsafe { buffer.as_ref() }.map_or(std::ptr::null_mut(), |b| b.memory.as_ptr())
}

/// The buffer's size in bytes (0 for NULL).
///
/// # Safety
///
/// `buffer` is NULL or a live buffer handle.
#[no_mangle]
pub unsafe extern "C" fn cuferry_buffer_size(buffer: *const CuferryBuffer) -> usize {
    // SAFETY: the caller's contract on `buffer`.
    unsafe { buffer.as_ref() }.map_or(0, |b| b.memory.source().len())
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
        unsafe { handle(buffer, "buffer") }?.memory.synchronize()
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
        let (from, to) = (src.memory.source(), dst.memory.destination()?);
        // SAFETY: C writes a buffer only through cuferry calls, which its tracker orders, or
        // through its pointer after `cuferry_buffer_synchronize` (the header's rule), so
        // nothing else writes the destination while the copy is queued.
        unsafe { copy_range_tracked(&stream.stream, from, src_offset, to, dst_offset, bytes) }.map(drop)
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
        let (from, to) = (src.memory.source(), dst.memory.destination()?);
        let mut batch = CopyBatch::new(&stream.stream);
        // SAFETY: as for `cuferry_copy`, C writes a buffer only through cuferry calls, which
        // its tracker orders, or through its pointer after `cuferry_buffer_synchronize`.
        unsafe { batch.add_tracked(from, to, &listed) }?;
        batch.submit()
    })
}
