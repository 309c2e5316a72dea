//! Asynchronous copies between any two kinds of memory, in every direction.
//!
//! Rules:
//! - A copy is queued on a stream and returns at once; it runs after the work queued on that
//!   stream before it, after the last write to the source, and after every earlier operation
//!   on the destination (buffers track their uses, see [`crate::memory`]). It reads the source
//!   shared: copies out of one buffer on several streams run at once, and a later write to the
//!   source waits for all of them.
//! - The direction comes from the two buffers' [`MemoryKind`]s and the stream's device:
//!   - a host stream copies between host-accessible memory only (`memcpy` on its worker, or
//!     on the calling thread for a small copy on an idle stream, which is the same order), and
//!     managed memory only on devices with `concurrentManagedAccess` (`Error::Unsupported`
//!     elsewhere: a host access while a kernel runs would fault);
//!   - a CUDA stream copies host <-> its device, within its device, between its device and
//!     another (peer: `cudaMemcpyPeerAsync`, staged by the driver when P2P is off), host to
//!     host, and to or from managed memory (`cudaMemcpyDefault`).
//! - Ranges are checked before anything is queued; a copy of zero elements queues nothing.
//! - Many ranges at once go in a [`CopyBatch`] (one `cudaMemcpyBatchAsync` on CUDA), under
//!   the same rules; see [`batch`].
//!
//! # Examples
//!
//! ```
//! use cuferry::{copy_range, CopyDirection, Device, DeviceBuffer, Stream};
//! let stream = Stream::new(Device::Host)?;
//! let src = DeviceBuffer::from_slice(&stream, &[1u8, 2, 3, 4])?;
//! let mut dst = DeviceBuffer::<u8>::zeroed(&stream, 4)?;
//! let dir = copy_range(&stream, &src, 1, &mut dst, 0, 3)?;
//! assert_eq!(dir, CopyDirection::DeviceToDevice);
//! assert_eq!(dst.to_vec(&stream)?, vec![2, 3, 4, 0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

pub mod batch;

pub use batch::{copy_ranges, copy_ranges_one_by_one, CopyBatch, CopyRange};

use crate::cuda::memory::{self as raw, CopyKind};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::memory::sealed::RawParts;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{check_host_stream_access, Element, Memory, MemoryKind};
use crate::stream::host::Job;
use crate::stream::{Stream, StreamBackend};

/// Which way a copy went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Host memory to host memory.
    HostToHost,
    /// Host memory to a CUDA device.
    HostToDevice,
    /// A CUDA device to host memory.
    DeviceToHost,
    /// Within one device's memory (on the host backend: between two host-backend buffers).
    DeviceToDevice,
    /// From one CUDA device to another.
    Peer,
    /// To or from managed memory on a CUDA stream: the driver picks the path
    /// (`cudaMemcpyDefault`).
    Managed,
}

/// Copies all of `src` into `dst` on `stream`. See the [module docs](self) for the rules.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the lengths differ, the stream cannot reach one of the
/// buffers, or `dst` is a read-only [`ForeignBuffer`](crate::ForeignBuffer);
/// [`Error::Unsupported`] on a host stream for managed memory of a device without
/// `concurrentManagedAccess`; CUDA errors of the copy.
pub fn copy<T, S, D>(stream: &Stream, src: &S, dst: &mut D) -> Result<CopyDirection>
where
    T: Element,
    S: Memory<T> + ?Sized,
    D: Memory<T> + ?Sized,
{
    if src.len() != dst.len() {
        return Err(Error::invalid(format!(
            "copy length mismatch: source has {} elements, destination {}",
            src.len(),
            dst.len()
        )));
    }
    copy_range(stream, src, 0, dst, 0, src.len())
}

/// Copies `len` elements from `src[src_offset..]` into `dst[dst_offset..]` on `stream`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when a range is out of bounds, the stream cannot reach one of
/// the buffers, or `dst` is read-only (as for [`copy`]); [`Error::Unsupported`] as for
/// [`copy`]; CUDA errors of the copy.
pub fn copy_range<T, S, D>(
    stream: &Stream,
    src: &S,
    src_offset: usize,
    dst: &mut D,
    dst_offset: usize,
    len: usize,
) -> Result<CopyDirection>
where
    T: Element,
    S: Memory<T> + ?Sized,
    D: Memory<T> + ?Sized,
{
    // SAFETY: `dst` is borrowed mutably, so no one else writes it.
    unsafe { copy_range_tracked(stream, src, src_offset, &*dst, dst_offset, len) }
}

/// [`copy_range`] into a destination borrowed shared, for callers whose protocol orders every
/// write to it through its tracker: the C ABI's buffer handles, which C may pass from several
/// threads at once.
///
/// # Safety
///
/// 1. While the copy is queued or running, nothing writes `dst`'s memory except operations
///    ordered by its tracker (cuferry copies and kernels; no host write through a pointer).
pub(crate) unsafe fn copy_range_tracked<T, S, D>(
    stream: &Stream,
    src: &S,
    src_offset: usize,
    dst: &D,
    dst_offset: usize,
    len: usize,
) -> Result<CopyDirection>
where
    T: Element,
    S: Memory<T> + ?Sized,
    D: Memory<T> + ?Sized,
{
    dst.check_writable()?;
    let size = std::mem::size_of::<T>();
    check_range(|| "source".into(), src_offset, len, src.len(), size)?;
    check_range(|| "destination".into(), dst_offset, len, dst.len(), size)?;
    let (s, d) = (src.raw_parts(), dst.raw_parts());
    debug_assert!((src_offset + len) * size <= s.bytes && (dst_offset + len) * size <= d.bytes);
    // SAFETY: the ranges were checked; precondition 1 is `copy_bytes`'s second.
    unsafe {
        copy_bytes(
            stream,
            (src.kind(), &s, src_offset * size),
            (dst.kind(), &d, dst_offset * size),
            len * size,
        )
    }
}

/// Queues a copy of `bytes` bytes between two tracked memories (offsets in bytes) and records
/// the use on both; the crate-internal core of [`copy_range`]. Overlapping source and
/// destination ranges (possible within one memory) are refused with
/// [`Error::InvalidArgument`].
///
/// # Safety
///
/// 1. Both byte ranges are inside their memories.
/// 2. Nothing else writes the destination range while the copy is queued or running, except
///    through operations ordered by its tracker (the caller holds exclusive access, as
///    `&mut` does for [`copy_range`], or a protocol such as the slot ring's guarantees it).
pub(crate) unsafe fn copy_bytes(
    stream: &Stream,
    (src_kind, s, src_offset): (MemoryKind, &RawParts<'_>, usize),
    (dst_kind, d, dst_offset): (MemoryKind, &RawParts<'_>, usize),
    bytes: usize,
) -> Result<CopyDirection> {
    if bytes == 0 {
        return direction(stream.device(), src_kind, dst_kind);
    }
    // SAFETY: the caller's contract, unchanged.
    unsafe { copy_bytes_marked(stream, (src_kind, s, src_offset), (dst_kind, d, dst_offset), bytes, None) }
}

/// Like [`copy_bytes`], with a pair of events recorded on `stream` right before and right
/// after the copy, inside the same tracked use: after the stream waited for the earlier uses
/// of both memories, so the pair times the copy alone. A copy of 0 bytes still queues the
/// waits, the events and the use (the destination's next use is ordered after its last one).
///
/// # Safety
///
/// As [`copy_bytes`].
pub(crate) unsafe fn copy_bytes_marked(
    stream: &Stream,
    (src_kind, s, src_offset): (MemoryKind, &RawParts<'_>, usize),
    (dst_kind, d, dst_offset): (MemoryKind, &RawParts<'_>, usize),
    bytes: usize,
    marks: Option<(&Event, &Event)>,
) -> Result<CopyDirection> {
    let direction = direction(stream.device(), src_kind, dst_kind)?;
    let src_ptr = s.ptr.wrapping_add(src_offset);
    let dst_ptr = d.ptr.wrapping_add(dst_offset);
    if ranges_overlap(src_ptr as usize, dst_ptr as usize, bytes) {
        // `cudaMemcpyAsync` and the host copy both need disjoint ranges (unified addressing
        // gives every allocation, host or device, its own addresses).
        return Err(Error::invalid(format!(
            "a copy of {bytes} bytes from {src_ptr:p} to {dst_ptr:p}: the ranges overlap"
        )));
    }
    UseTracker::use_on(stream, &[(s.tracker, Access::Read), (d.tracker, Access::Write)], || {
        if let Some((before, _)) = marks {
            before.record(stream)?;
        }
        if bytes > 0 {
            enqueue(stream, direction, (src_kind, src_ptr), (dst_kind, dst_ptr), bytes)?;
        }
        match marks {
            Some((_, after)) => after.record(stream),
            None => Ok(()),
        }
    })?;
    Ok(direction)
}

/// Whether `[a, a + bytes)` and `[b, b + bytes)` share a byte (never for 0 bytes).
fn ranges_overlap(a: usize, b: usize, bytes: usize) -> bool {
    bytes > 0 && a.abs_diff(b) < bytes
}

/// Checks `[offset, offset + len)` against a memory of `total` elements of `size` bytes;
/// `what` names the range, called only for the error.
fn check_range(
    what: impl FnOnce() -> String,
    offset: usize,
    len: usize,
    total: usize,
    size: usize,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => {
            let unit = if size == 1 { "bytes".to_string() } else { format!("elements of {size} bytes") };
            Err(Error::invalid(format!(
                "{} range {offset}..{offset}+{len} is out of bounds for {total} {unit}",
                what()
            )))
        }
    }
}

/// Picks the direction of a copy, or says why the stream cannot do it.
fn direction(stream_device: Device, src: MemoryKind, dst: MemoryKind) -> Result<CopyDirection> {
    let cuda_of = |k: MemoryKind| match k {
        MemoryKind::Device(Device::Cuda(i)) => Some(i),
        _ => None,
    };
    match stream_device {
        Device::Host => {
            for k in [src, dst] {
                check_host_stream_access(k)?;
            }
            let both_device = matches!((src, dst), (MemoryKind::Device(_), MemoryKind::Device(_)));
            Ok(if both_device { CopyDirection::DeviceToDevice } else { CopyDirection::HostToHost })
        }
        Device::Cuda(_) if matches!(src, MemoryKind::Managed(_)) || matches!(dst, MemoryKind::Managed(_)) => {
            Ok(CopyDirection::Managed)
        }
        Device::Cuda(s) => {
            let dir = match (cuda_of(src), cuda_of(dst)) {
                (None, None) => return Ok(CopyDirection::HostToHost),
                (None, Some(_)) => CopyDirection::HostToDevice,
                (Some(_), None) => CopyDirection::DeviceToHost,
                (Some(a), Some(b)) if a == b => CopyDirection::DeviceToDevice,
                (Some(_), Some(_)) => CopyDirection::Peer,
            };
            let involved = [cuda_of(src), cuda_of(dst)];
            if !involved.contains(&Some(s)) {
                return Err(Error::invalid(format!(
                    "a stream of cuda:{s} cannot copy between {src:?} and {dst:?}; use a stream of a device involved"
                )));
            }
            Ok(dir)
        }
    }
}

/// Host-backend copies up to this size run on the calling thread when the stream is idle.
const HOST_INLINE_COPY_BYTES: usize = 256 << 10;

/// Queues the bytes on the stream's backend.
fn enqueue(
    stream: &Stream,
    direction: CopyDirection,
    (src_kind, src): (MemoryKind, *mut u8),
    (dst_kind, dst): (MemoryKind, *mut u8),
    bytes: usize,
) -> Result<()> {
    match stream.backend() {
        StreamBackend::Host(q) => {
            let job = HostCopy { src, dst, bytes };
            let job: Job = Box::new(move || {
                job.run();
                Ok(())
            });
            // Short copies on an idle stream run at once: the hand-offs to the worker and back
            // would cost more than the copy.
            if bytes <= HOST_INLINE_COPY_BYTES {
                q.submit_or_run(job)
            } else {
                q.submit(job)
            }
        }
        StreamBackend::Cuda(s) => {
            let s = s.queue_handle();
            let kind = match direction {
                CopyDirection::HostToHost => CopyKind::HostToHost,
                CopyDirection::HostToDevice => CopyKind::HostToDevice,
                CopyDirection::DeviceToHost => CopyKind::DeviceToHost,
                CopyDirection::DeviceToDevice => CopyKind::DeviceToDevice,
                CopyDirection::Managed => CopyKind::Default,
                CopyDirection::Peer => {
                    let (MemoryKind::Device(Device::Cuda(sd)), MemoryKind::Device(Device::Cuda(dd))) =
                        (src_kind, dst_kind)
                    else {
                        return Err(Error::invalid("peer copy between non-CUDA memory"));
                    };
                    // SAFETY: both ranges are in bounds of live device buffers whose trackers
                    // record this copy, so they are not freed before it runs.
                    return unsafe { raw::memcpy_peer_async(dst.cast(), dd, src.cast(), sd, bytes, s) };
                }
            };
            // SAFETY: both ranges are in bounds of live buffers whose trackers record this
            // copy, so they are neither freed nor touched by the host before it runs.
            unsafe { raw::memcpy_async(dst.cast(), src.cast(), bytes, kind, s) }
        }
    }
}

/// A host-backend copy, carried to the worker thread.
#[derive(Clone, Copy)]
struct HostCopy {
    src: *const u8,
    dst: *mut u8,
    bytes: usize,
}

// SAFETY: the pointers name buffers kept alive (and unaliased by the host) by their trackers
// until the job has run; moving the addresses to the worker thread is what the protocol is for.
unsafe impl Send for HostCopy {}

impl HostCopy {
    fn run(self) {
        // SAFETY: both ranges are in bounds of live host-accessible buffers whose trackers
        // record this copy (so they outlive it), and they do not overlap (`copy_bytes_marked`
        // refuses overlapping ranges).
        unsafe { std::ptr::copy_nonoverlapping(self.src, self.dst, self.bytes) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::sealed::Sealed;
    use crate::memory::{DeviceBuffer, Memory};

    #[test]
    fn overlap_is_any_shared_byte() {
        assert!(ranges_overlap(100, 100, 1));
        assert!(ranges_overlap(100, 103, 4) && ranges_overlap(103, 100, 4));
        assert!(!ranges_overlap(100, 104, 4) && !ranges_overlap(104, 100, 4));
        assert!(!ranges_overlap(100, 100, 0));
        assert!(!ranges_overlap(0, usize::MAX, usize::MAX));
        assert!(ranges_overlap(usize::MAX - 1, usize::MAX, 2));
    }

    /// A copy within one buffer: disjoint ranges copy, overlapping ones are refused before
    /// anything is queued (both CUDA and the host copy require disjoint ranges).
    #[test]
    fn copies_within_one_buffer_must_not_overlap() {
        let stream = Stream::new(Device::Host).unwrap();
        let data: Vec<u8> = (0..64).collect();
        let buf = DeviceBuffer::from_slice(&stream, &data).unwrap();
        let parts = buf.raw_parts();
        let kind = buf.kind();
        // SAFETY: both ranges are inside the buffer; nothing else uses it meanwhile.
        let overlapping = unsafe { copy_bytes(&stream, (kind, &parts, 0), (kind, &parts, 8), 16) };
        assert!(matches!(overlapping, Err(Error::InvalidArgument { .. })), "{overlapping:?}");
        // SAFETY: as above.
        unsafe { copy_bytes(&stream, (kind, &parts, 0), (kind, &parts, 32), 16) }.unwrap();
        let got = buf.to_vec(&stream).unwrap();
        assert_eq!(&got[32..48], &data[0..16]);
        assert_eq!(&got[..32], &data[..32]);
        assert_eq!(&got[48..], &data[48..]);
    }
}
