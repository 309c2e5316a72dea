//! Small kernels for tests and benchmarks: fill a `u32` buffer with a known pattern, and sum
//! one, on the stream's device (a host job on the host backend).
//!
//! Rules: both are queued like any cuferry operation (ordered with the buffer's other uses);
//! `sum_u32` returns once the sum is known. On a CUDA stream the memory must be that device's
//! memory or managed memory (another device's memory is refused, not read through a missing
//! peer mapping); on a host stream it must be host-accessible (managed memory only with
//! `concurrentManagedAccess`, see [`crate::memory`]).
//!
//! # Examples
//!
//! ```
//! use cuferry::kernels::{fill_pattern_u32, pattern_value, sum_u32};
//! use cuferry::{Device, DeviceBuffer, Stream};
//! let stream = Stream::new(Device::Host)?;
//! let mut buf = DeviceBuffer::<u32>::zeroed(&stream, 1000)?;
//! fill_pattern_u32(&stream, &mut buf, 7)?;
//! let expected: u64 = (0..1000).map(|i| u64::from(pattern_value(7, i))).sum();
//! assert_eq!(sum_u32(&stream, &buf)?, expected);
//! # Ok::<(), cuferry::Error>(())
//! ```

use crate::cuda::managed as raw;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{check_host_stream_access, DeviceBuffer, Memory, MemoryKind};
use crate::stream::{Stream, StreamBackend};

/// Element `i` of the pattern of `seed`.
pub fn pattern_value(seed: u32, i: usize) -> u32 {
    seed.wrapping_mul(2_654_435_761).wrapping_add(i as u32)
}

fn check_reachable(stream: &Stream, kind: MemoryKind) -> Result<()> {
    match stream.device() {
        Device::Host => check_host_stream_access(kind),
        device => check_kernel_reach(device, kind),
    }
}

/// Whether a kernel launched on a CUDA stream of `device` may touch memory of `kind`: that
/// device's own memory, or managed memory (which migrates). Another device's memory would be
/// dereferenced without peer mapping: an illegal address, which poisons the whole context.
fn check_kernel_reach(device: Device, kind: MemoryKind) -> Result<()> {
    let ok = match kind {
        MemoryKind::Device(d) => d == device,
        MemoryKind::Managed(d) => !d.is_host(),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!("a kernel on {device} cannot reach {kind:?} memory")))
    }
}

/// A raw pointer carried to a host job.
struct SendPtr(*mut u32, usize);

// SAFETY: the memory is kept alive and ordered by its tracker until the job has run.
unsafe impl Send for SendPtr {}

/// Writes `pattern_value(seed, i)` into element `i` of `dst`, queued on `stream`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the stream cannot reach the memory or it is a read-only
/// [`ForeignBuffer`](crate::ForeignBuffer); [`Error::Unsupported`] on a host stream for
/// managed memory of a device without `concurrentManagedAccess`; CUDA launch errors.
pub fn fill_pattern_u32<M: Memory<u32> + ?Sized>(stream: &Stream, dst: &mut M, seed: u32) -> Result<()> {
    dst.check_writable()?;
    check_reachable(stream, dst.kind())?;
    let parts = dst.raw_parts();
    let (ptr, n) = (parts.ptr.cast::<u32>(), dst.len());
    UseTracker::use_on(stream, &[(parts.tracker, Access::Write)], || match stream.backend() {
        StreamBackend::Host(q) => {
            let target = SendPtr(ptr, n);
            q.submit(Box::new(move || {
                let target = target;
                for i in 0..target.1 {
                    // SAFETY: in bounds of a live buffer, exclusively ours while queued (`&mut`).
                    unsafe { target.0.add(i).write(pattern_value(seed, i)) };
                }
                Ok(())
            }))
        }
        StreamBackend::Cuda(s) => {
            let s = s.queue_handle();
            // SAFETY: device-reachable memory (checked) kept alive by its tracker.
            unsafe { raw::fill_pattern_u32(ptr, n, seed, s) }
        }
    })
}

/// The sum of `src`'s elements as `u64`, computed where the memory is; blocks until known.
///
/// # Errors
///
/// As [`fill_pattern_u32`] (a read-only source is read); [`Error::InvalidArgument`] when
/// called from a job of `stream` (a host stream: the sum would wait for itself), before
/// anything is queued.
pub fn sum_u32<M: Memory<u32> + ?Sized>(stream: &Stream, src: &M) -> Result<u64> {
    check_reachable(stream, src.kind())?;
    stream.refuse_blocking_call_from_own_job("sum_u32, which waits for its result,")?;
    let parts = src.raw_parts();
    let (ptr, n) = (parts.ptr.cast::<u32>(), src.len());
    match stream.device() {
        Device::Host => {
            let result = std::sync::Arc::new(std::sync::Mutex::new(0u64));
            let out = std::sync::Arc::clone(&result);
            let source = SendPtr(ptr, n);
            let done = crate::Event::new(Device::Host)?;
            UseTracker::use_on(stream, &[(parts.tracker, Access::Read)], || {
                stream.host_fn(move || {
                    let source = source;
                    let mut acc = 0u64;
                    for i in 0..source.1 {
                        // SAFETY: in bounds of a live buffer whose tracker orders this read.
                        acc += u64::from(unsafe { source.0.add(i).read() });
                    }
                    if let Ok(mut o) = out.lock() {
                        *o = acc;
                    }
                })
            })?;
            done.record(stream)?;
            done.synchronize()?;
            let value = *result.lock().map_err(|_| Error::invalid("sum result lock poisoned"))?;
            Ok(value)
        }
        Device::Cuda(_) => {
            let sum = DeviceBuffer::<u64>::zeroed(stream, 1)?;
            let sum_parts = sum.raw_parts();
            let sum_ptr = sum_parts.ptr.cast::<u64>();
            UseTracker::use_on(
                stream,
                &[(parts.tracker, Access::Read), (sum_parts.tracker, Access::Write)],
                || {
                    // SAFETY: both are device-reachable (checked / device memory) and kept alive by
                    // their trackers until the stream ran the kernel.
                    unsafe { raw::sum_u32(ptr, n, sum_ptr, stream.cuda_raw()?) }
                },
            )?;
            let mut out = [0u64];
            sum.copy_to_slice(stream, &mut out)?;
            Ok(out[0])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel on one device reaches that device's memory and managed memory of any device,
    /// and is refused another device's memory (which needs a peer mapping it may not have)
    /// and host memory.
    #[test]
    fn kernels_reach_only_their_own_device_memory() {
        let here = Device::Cuda(0);
        check_kernel_reach(here, MemoryKind::Device(here)).unwrap();
        check_kernel_reach(here, MemoryKind::Managed(Device::Cuda(1))).unwrap();
        for kind in [
            MemoryKind::Device(Device::Cuda(1)),
            MemoryKind::Device(Device::Host),
            MemoryKind::Managed(Device::Host),
            MemoryKind::Pinned,
            MemoryKind::Pageable,
        ] {
            let refused = check_kernel_reach(here, kind);
            assert!(matches!(refused, Err(Error::InvalidArgument { .. })), "{kind:?}: {refused:?}");
        }
    }

    /// `sum_u32` waits for its result: called from a job of its own host stream it would wait
    /// for itself, so it is refused before anything is queued, and the stream goes on.
    #[test]
    fn sum_u32_from_a_job_of_its_own_stream_is_refused() {
        let stream = Stream::new(Device::Host).unwrap();
        let buf = std::sync::Arc::new(DeviceBuffer::from_slice(&stream, &[1u32, 2, 3]).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let (own, inner) = (stream.clone(), std::sync::Arc::clone(&buf));
        stream
            .host_fn(move || {
                let _ = tx.send(sum_u32(&own, &*inner));
            })
            .unwrap();
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("sum_u32 hung in its own stream's job");
        assert!(
            matches!(&got, Err(Error::InvalidArgument { what }) if what.contains("wait forever")),
            "{got:?}"
        );
        assert_eq!(sum_u32(&stream, &*buf).unwrap(), 6);
    }
}
