//! `HostRegistration<T>`: caller memory page-locked in place with `cudaHostRegister`.
//!
//! Rules:
//! - The registration owns the `Vec` it registers, so the memory cannot be freed or moved
//!   while a copy is queued (a borrow could be ended early by `mem::forget`); `into_inner`
//!   waits for queued copies, unregisters and hands the `Vec` back.
//! - When the driver cannot register the memory (not supported, or its pages are already
//!   registered), the memory stays pageable: copies still work, at pageable speed, and
//!   [`HostRegistration::is_pinned`] says so. Other CUDA errors are returned. The driver locks
//!   whole pages, and CUDA does not document whether it refuses a second registration on a
//!   page another one holds (two `Vec`s side by side on the heap): check
//!   [`HostRegistration::is_pinned`]. The ring's caller-memory slots register such neighbours
//!   as one range when refused ([`TransferBackend::register_host_slots`](crate::ring::TransferBackend::register_host_slots)).
//! - On the host backend nothing is registered and the memory is pageable.
//! - `Drop` waits for queued copies, then unregisters.

use std::os::raw::c_void;

use super::allocation::byte_len;
use super::sealed::{RawParts, Sealed};
use super::tracker::UseTracker;
use super::{Element, Memory, MemoryKind};
use crate::cuda::memory as raw;
use crate::device::Device;
use crate::error::{record_drop_error, Result};

/// Host memory, owned, registered with CUDA for fast copies when the driver allows.
///
/// # Examples
///
/// ```
/// use cuferry::{Device, HostRegistration, Memory};
/// let reg = HostRegistration::new(Device::Host, vec![7u16; 8])?;
/// assert!(!reg.is_pinned()); // the host backend registers nothing
/// assert_eq!(reg.len(), 8);
/// assert_eq!(reg.into_inner()?, vec![7u16; 8]);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub struct HostRegistration<T: Element> {
    /// The memory; `None` only after `into_inner` took it.
    data: Option<Vec<T>>,
    /// Whether `cudaHostRegister` succeeded (so `cudaHostUnregister` is due).
    pinned: bool,
    device: Device,
    tracker: UseTracker,
}

/// Shows where the memory is, never its contents: a queued copy may be writing them (host
/// access waits first, through `as_slice`).
impl<T: Element> std::fmt::Debug for HostRegistration<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ptr, bytes) = self.ptr_bytes();
        f.debug_struct("HostRegistration")
            .field("ptr", &ptr)
            .field("len", &self.len())
            .field("bytes", &bytes)
            .field("pinned", &self.pinned)
            .field("device", &self.device)
            .field("tracker", &self.tracker)
            .finish()
    }
}

impl<T: Element> HostRegistration<T> {
    /// Registers `data` for fast copies with `device`.
    ///
    /// # Errors
    ///
    /// As [`Device::check_available`] for `device` (also for an empty `data`);
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a zero-sized or
    /// over-aligned element type (the module rules of [`crate::memory`]); CUDA errors of
    /// `cudaHostRegister` other than "not supported" and "already registered" (which fall
    /// back to pageable memory).
    pub fn new(device: Device, data: Vec<T>) -> Result<Self> {
        byte_len::<T>(data.len())?;
        device.check_available()?;
        let mut reg =
            HostRegistration { data: Some(data), pinned: false, device, tracker: UseTracker::default() };
        let (ptr, bytes) = reg.ptr_bytes();
        if let (Device::Cuda(i), true) = (device, bytes > 0) {
            // SAFETY: `ptr..ptr+bytes` is the Vec's heap buffer, owned by `reg` and neither
            // freed nor moved until `release` unregisters it.
            reg.pinned = unsafe { raw::host_register_if_allowed(i, ptr.cast::<c_void>(), bytes) }?;
        }
        Ok(reg)
    }

    fn ptr_bytes(&self) -> (*mut u8, usize) {
        match &self.data {
            Some(v) => (v.as_ptr().cast_mut().cast(), std::mem::size_of_val(v.as_slice())),
            None => (std::ptr::null_mut(), 0),
        }
    }

    /// Whether the memory is page-locked (false: pageable fallback or host backend).
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// The device the memory was registered for.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The contents, after waiting for every queued operation on them.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.tracker.wait_idle()?;
        Ok(self.data.as_deref().unwrap_or(&[]))
    }

    /// The contents for writing, after waiting for every queued operation on them.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.tracker.wait_idle()?;
        Ok(self.data.as_deref_mut().unwrap_or(&mut []))
    }

    /// Blocks until every operation queued on the memory has finished.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn synchronize(&self) -> Result<()> {
        self.tracker.wait_idle()
    }

    /// Waits for queued copies, unregisters, and returns the memory.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize` or `cudaHostUnregister`; on a failed wait the
    /// memory is leaked rather than handed back under a running copy, and on a failed
    /// unregister rather than freed while still registered.
    pub fn into_inner(mut self) -> Result<Vec<T>> {
        self.release()?;
        Ok(self.data.take().unwrap_or_default())
    }

    /// Waits for queued uses and unregisters (once).
    fn release(&mut self) -> Result<()> {
        if self.data.is_none() {
            // Handed back by `into_inner`, or leaked by a failed release that reported why.
            return Ok(());
        }
        if let (true, Some(ordinal)) = (self.pinned, self.device.cuda_ordinal()) {
            // The unregister below makes the device current anyway; first, so that the wait
            // on a thread with no current device (a host stream's worker) does not create a
            // context on device 0. A failure leaves the wait to report it.
            let _ = crate::cuda::device::make_current(ordinal);
        }
        if let Err(err) = self.tracker.wait_idle() {
            // A copy may still be running: never hand back or free the memory. Its
            // registration is leaked with it (a later `release`, from `Drop` after
            // `into_inner`, finds no data and reports nothing more).
            if let Some(v) = self.data.take() {
                std::mem::forget(v);
            }
            self.pinned = false;
            return Err(err);
        }
        if std::mem::take(&mut self.pinned) {
            let (ptr, _) = self.ptr_bytes();
            // Registered only for a CUDA device (see `new`).
            let ordinal = self.device.cuda_ordinal().unwrap_or(0);
            // SAFETY: the memory was registered in `new` and no queued work uses it any more.
            if let Err(err) = unsafe { raw::host_unregister(ordinal, ptr.cast::<c_void>()) } {
                // Still registered: freeing it would leave CUDA a registration over memory
                // the allocator hands out again. Leak it instead.
                if let Some(v) = self.data.take() {
                    std::mem::forget(v);
                }
                return Err(err);
            }
        }
        Ok(())
    }
}

impl<T: Element> Drop for HostRegistration<T> {
    fn drop(&mut self) {
        if let Err(err) = self.release() {
            record_drop_error(err);
        }
    }
}

impl<T: Element> Sealed for HostRegistration<T> {
    fn raw_parts(&self) -> RawParts<'_> {
        let (ptr, bytes) = self.ptr_bytes();
        RawParts { ptr, bytes, tracker: &self.tracker }
    }
}

impl<T: Element> Memory<T> for HostRegistration<T> {
    fn len(&self) -> usize {
        self.data.as_ref().map_or(0, Vec::len)
    }

    fn kind(&self) -> MemoryKind {
        if self.pinned {
            MemoryKind::Pinned
        } else {
            MemoryKind::Pageable
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::copy;
    use crate::error::Error;
    use crate::memory::DeviceBuffer;
    use crate::stream::test_gate::Gate;
    use crate::stream::Stream;

    /// `Debug` never reads the contents: here a copy into the registration is queued behind a
    /// closed gate, so reading them would race the copy (it printed every element).
    #[test]
    fn debug_shows_no_contents_while_a_copy_is_queued() {
        let stream = Stream::new(Device::Host).unwrap();
        let src = DeviceBuffer::from_slice(&stream, &[987_654_321u32; 4]).unwrap();
        let mut reg = HostRegistration::new(Device::Host, vec![123_456_789u32; 4]).unwrap();
        let gate = Gate::hold(&stream);
        copy(&stream, &src, &mut reg).unwrap();
        let shown = format!("{reg:?}");
        drop(gate); // lets the copy run
        assert!(!shown.contains("123456789") && !shown.contains("987654321"), "{shown}");
        assert!(shown.contains("len: 4"), "{shown}");
        assert_eq!(reg.as_slice().unwrap(), [987_654_321u32; 4]);
    }

    /// A failed `into_inner` (its wait refused: called from a job of the stream its copy is
    /// queued on) returns the error once and leaks the memory; the drop after it reports
    /// nothing more. It used to record the same error again for `take_drop_error`, so the
    /// next `synchronize` of any stream failed with a spurious `DropFailed`.
    #[test]
    fn a_failed_into_inner_reports_its_error_once() {
        let stream = Stream::new(Device::Host).unwrap();
        let (report, outcome) = std::sync::mpsc::channel();
        let own = stream.clone();
        let src = DeviceBuffer::from_slice(&stream, &[5u32; 16]).unwrap();
        stream
            .host_fn(move || {
                let result = (|| -> Result<Result<Vec<u32>>> {
                    let mut reg = HostRegistration::new(Device::Host, vec![0u32; 16])?;
                    // The failed into_inner leaks the Vec, on purpose.
                    crate::memory::leaked_on_purpose::keep(reg.raw_parts().ptr);
                    copy(&own, &src, &mut reg)?; // queued behind this job
                    Ok(reg.into_inner())
                })();
                let own_job_drop_error = crate::error::take_drop_error().is_some_and(
                    |e| matches!(&e, Error::InvalidArgument { what } if what.contains("wait forever")),
                );
                let _ = report.send((result.map(|r| r.is_err()), own_job_drop_error));
            })
            .unwrap();
        let (failed, drop_error) = outcome.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        stream.synchronize().unwrap();
        assert!(failed.unwrap(), "into_inner from a job of its copy's stream must fail");
        assert!(!drop_error, "the failed into_inner's drop reported its error a second time");
    }
}
