//! `ForeignBuffer`: memory another owner allocated (a `cudaMalloc` of another library, a
//! cudarc or PyTorch allocation, a NumPy array, a C code's `malloc`), wrapped for cuferry's
//! copies, batches and halo packs without taking ownership. The C ABI's `cuferry_buffer_wrap`
//! is built on it (as `ForeignBuffer<u8>`).
//!
//! Rules:
//! - The wrapper never frees the memory. Its owner keeps it allocated, in place, until the
//!   wrapper is released ([`ForeignBuffer::release`] or drop), which first waits for every
//!   use queued through the wrapper. When that wait fails, a queued copy may still use the
//!   memory, and the owner must never free it (a registration made here stays with it).
//! - A wrapper of `T` holds `len` elements at a pointer aligned for `T` (a misaligned pointer
//!   is refused, as is a `T` aligned to more than [`MAX_ELEMENT_ALIGN`](super::MAX_ELEMENT_ALIGN)).
//! - Live wrappers never overlap: a wrap touching bytes another live wrapper holds is refused.
//!   Each wrapper has its own tracker, so two over the same bytes would not order their
//!   copies, and the first one's release could unregister pages the other's copies still
//!   use. A wrapper whose release failed keeps its bytes for good.
//! - What the memory is comes from CUDA (`cudaPointerGetAttributes` of its first and last
//!   byte), not from the caller. Ends of two kinds or devices are refused. CUDA cannot tell
//!   unmapped addresses from pageable memory, nor two adjacent allocations of one kind apart:
//!   a range must lie in one allocation (the caller's contract).
//! - For a CUDA device: device memory must be that device's; managed memory too; page-locked
//!   host memory is used as it is; pageable host memory is page-locked with `cudaHostRegister`
//!   (portable; for a read-only wrapper, a refusal is retried read-only, as memory mapped
//!   read-only needs) for the wrapper's life. Page-locking is an optimisation here: memory the
//!   driver will not lock (already registered elsewhere, too large, not supported) stays
//!   pageable and copies run at pageable speed.
//! - For the host backend the memory is host memory, pageable or (when CUDA says so)
//!   page-locked; device and managed memory are refused. CUDA is asked only when its driver
//!   is already loaded in the process and a context is current or active (without them no
//!   CUDA allocation can exist, and asking would load and initialise the driver).
//! - A read-only wrapper ([`ForeignBuffer::wrap_read_only`]) is never written: every
//!   operation that writes memory (a copy's or a batch's destination, an unpacked halo array,
//!   a fill) refuses it with [`Error::InvalidArgument`] before queueing anything.
//! - The wrapper gives no host view of the memory: uses through it are ordered by its
//!   tracker, as for every cuferry buffer, and the owner's own access is governed by the
//!   wrap's safety contract. Uses the tracker does not see (the owner's kernels and copies,
//!   its reads and writes through its own pointers) are the caller's to order against them:
//!   [`ForeignBuffer::synchronize`] waits for the wrapper's uses on the host, and
//!   [`Stream::wait_cuda_stream`](crate::Stream::wait_cuda_stream) /
//!   [`Stream::make_cuda_stream_wait`](crate::Stream::make_cuda_stream_wait) order a cuferry
//!   stream with the owner's CUDA stream without blocking.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::allocation::byte_len;
use super::sealed::{RawParts, Sealed};
use super::tracker::UseTracker;
use super::{Element, Memory, MemoryKind, WriteShared};
use crate::cuda::device::{active_device, ensure_context, make_current, thread_has_context};
use crate::cuda::memory::{self as raw, PointerType};
use crate::device::Device;
use crate::error::{record_drop_error, Error, Result};
use crate::sys;

/// `len` elements of memory another owner allocated, used by cuferry's copies, batches and
/// halo packs as any cuferry buffer is. See the [module docs](self) for the rules.
///
/// # Examples
///
/// Copying a vector the program keeps (say, a replay store another library owns) to a
/// device buffer, and the result back into it, without staging copies:
///
/// ```
/// use cuferry::{copy, Device, DeviceBuffer, ForeignBuffer, Stream};
/// let stream = Stream::new(Device::Host)?;
/// let mut store: Vec<f64> = (0..1024).map(f64::from).collect();
/// // SAFETY: `store` outlives the wrapper and is not touched until it is released.
/// let mut wrapped = unsafe { ForeignBuffer::wrap(Device::Host, store.as_mut_ptr(), store.len()) }?;
/// let mut on_device = DeviceBuffer::<f64>::zeroed(&stream, store.len())?;
/// copy(&stream, &wrapped, &mut on_device)?;
/// copy(&stream, &on_device, &mut wrapped)?;
/// wrapped.release()?; // waits for both copies
/// assert_eq!(store[1000], 1000.0);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub struct ForeignBuffer<T: Element> {
    ptr: *mut u8,
    len: usize,
    bytes: usize,
    kind: MemoryKind,
    read_only: bool,
    /// The device the wrapper registered the memory with, until it unregisters it.
    registered: Option<u32>,
    /// Set by the first release: the memory is no longer the wrapper's to wait for.
    released: bool,
    /// Whether the range is in `live_wrappers` (removed by a successful release).
    listed: bool,
    tracker: UseTracker,
    _element: PhantomData<T>,
}

// SAFETY: the memory is the caller's, valid until the wrapper is released (the contract of
// `wrap`); every access through the wrapper is ordered by its tracker, which is thread-safe,
// and `T` is plain data that crosses threads (`Element`).
unsafe impl<T: Element> Send for ForeignBuffer<T> {}
// SAFETY: as above; shared access reads the fields and uses the tracker's mutex.
unsafe impl<T: Element> Sync for ForeignBuffer<T> {}

impl<T: Element> fmt::Debug for ForeignBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignBuffer")
            .field("element", &std::any::type_name::<T>())
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("read_only", &self.read_only)
            .field("registered", &self.registered)
            .finish()
    }
}

impl<T: Element> ForeignBuffer<T> {
    /// Wraps `len` elements at `ptr` for copies with `device`, as a source or a destination
    /// (a NULL `ptr` only with 0 elements). See the [module docs](self) for what CUDA is asked
    /// and what is page-locked.
    ///
    /// # Errors
    ///
    /// As [`Device::check_available`]; [`Error::InvalidArgument`] for a NULL `ptr` with
    /// elements, a `ptr` not aligned for `T`, a zero-sized or over-aligned `T`, a range past
    /// the end of the address space or larger than `isize::MAX` bytes, bytes a live wrapper
    /// holds, ends of two kinds or devices, device or managed memory of another device (or
    /// for the host backend); CUDA errors of the probe.
    ///
    /// # Safety
    ///
    /// 1. `ptr..ptr+len` is memory of the kind CUDA reports, of one allocation, that stays
    ///    allocated, in place and of that kind (page-locked memory stays registered) until
    ///    the wrapper is released. After a failed release, a drop's included, a use may still
    ///    run: keep the memory for good (call [`ForeignBuffer::release`] to see the failure
    ///    before freeing it).
    /// 2. The memory is valid for reads and writes of `len` elements (not memory mapped
    ///    read-only, not reached through a shared reference: wrap those with
    ///    [`ForeignBuffer::wrap_read_only`]).
    /// 3. While a use queued through the wrapper runs, nothing outside its tracker writes the
    ///    memory, nor reads it while that use writes it, and no Rust reference to it is used
    ///    across a use that writes it: the owner's own access waits for
    ///    [`ForeignBuffer::synchronize`] (or the release).
    pub unsafe fn wrap(device: Device, ptr: *mut T, len: usize) -> Result<Self> {
        // SAFETY: the caller's contract, unchanged.
        unsafe { Self::wrap_with(device, ptr, len, false) }
    }

    /// [`ForeignBuffer::wrap`] for memory cuferry only reads (a weight store, memory mapped
    /// read-only): every operation that would write it refuses the wrapper.
    ///
    /// # Errors
    ///
    /// As [`ForeignBuffer::wrap`].
    ///
    /// # Safety
    ///
    /// As [`ForeignBuffer::wrap`], except that the memory need only be valid for reads (2),
    /// and the owner may read it while uses through the wrapper run (they only read it).
    pub unsafe fn wrap_read_only(device: Device, ptr: *const T, len: usize) -> Result<Self> {
        // SAFETY: the caller's contract, unchanged; a read-only wrapper is never written.
        unsafe { Self::wrap_with(device, ptr.cast_mut(), len, true) }
    }

    /// The wrap of both constructors, and of the C ABI.
    ///
    /// # Safety
    ///
    /// As [`ForeignBuffer::wrap`] (or, with `read_only`, [`ForeignBuffer::wrap_read_only`]).
    pub(crate) unsafe fn wrap_with(device: Device, ptr: *mut T, len: usize, read_only: bool) -> Result<Self> {
        device.check_available()?;
        // Bytes for the C ABI's `u8` wrappers, whose callers count in bytes.
        let bytewise = std::mem::size_of::<T>() == 1;
        if ptr.is_null() && len > 0 {
            let unit = if bytewise { "bytes" } else { "elements" };
            return Err(Error::invalid(format!("a NULL pointer with {len} {unit}")));
        }
        let bytes = byte_len::<T>(len).map_err(|e| {
            if bytewise && len > isize::MAX as usize {
                Error::invalid(format!("{ptr:p}..+{len} runs past the end of the address space"))
            } else {
                e
            }
        })?;
        if !ptr.is_null() && !ptr.is_aligned() {
            return Err(Error::invalid(format!(
                "{ptr:p} is not aligned for {} ({} bytes)",
                std::any::type_name::<T>(),
                std::mem::align_of::<T>()
            )));
        }
        let ptr = ptr.cast::<u8>();
        if (ptr as usize).checked_add(bytes).is_none() {
            return Err(Error::invalid(format!("{ptr:p}..+{bytes} runs past the end of the address space")));
        }
        let mut memory = ForeignBuffer {
            ptr,
            len,
            bytes,
            kind: MemoryKind::Pageable,
            read_only,
            registered: None,
            released: false,
            listed: false,
            tracker: UseTracker::default(),
            _element: PhantomData,
        };
        if bytes == 0 {
            return Ok(memory);
        }
        // The range is listed before CUDA is asked: two wraps of one range at once cannot both
        // pass, and the lock is not held across the probe and the registration (which takes
        // about 0.06 s per GiB), so other wraps and releases do not wait for them. From here
        // on, a refusal drops `memory`, whose release unlists the range again.
        {
            let mut live = live_wrappers();
            let start = ptr as usize;
            if let Some((&other, &other_end)) = live.range(..start + bytes).next_back() {
                if other_end > start {
                    return Err(Error::invalid(format!(
                        "{ptr:p}..+{bytes} overlaps the live wrapper of {other:#x}..{other_end:#x}: \
                         use that one, or free it first"
                    )));
                }
            }
            live.insert(start, start + bytes);
            memory.listed = true;
        }
        let (found, owner) = probe(device, ptr, bytes)?;
        memory.kind = match (device, found) {
            (Device::Cuda(i), PointerType::Unregistered) => {
                // SAFETY: precondition 1: the range stays allocated and in place until
                // `release` unregisters it.
                if unsafe { register(i, ptr.cast::<c_void>(), bytes, read_only) } {
                    memory.registered = Some(i);
                    MemoryKind::Pinned
                } else {
                    MemoryKind::Pageable
                }
            }
            (Device::Host, PointerType::Unregistered) => MemoryKind::Pageable,
            (_, PointerType::Host) => MemoryKind::Pinned,
            (Device::Cuda(i), PointerType::Device | PointerType::Managed) if owner == i as i32 => {
                if found == PointerType::Device {
                    MemoryKind::Device(device)
                } else {
                    MemoryKind::Managed(device)
                }
            }
            (_, PointerType::Device | PointerType::Managed) => {
                return Err(Error::invalid(format!(
                    "{ptr:p}..+{bytes} is {found:?} memory of cuda:{owner}: wrap it for that device, not {device}"
                )))
            }
        };
        Ok(memory)
    }

    /// The first element (NULL when empty, as for every empty buffer).
    pub fn as_ptr(&self) -> *mut T {
        if self.bytes == 0 {
            return std::ptr::null_mut();
        }
        self.ptr.cast()
    }

    /// Whether the wrapper refuses every write ([`ForeignBuffer::wrap_read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Whether the wrapper page-locked the memory itself (and unregisters it on release).
    #[cfg(test)]
    pub(crate) fn is_registered(&self) -> bool {
        self.registered.is_some()
    }

    /// Blocks until every use queued through the wrapper has finished: then the owner may
    /// touch the memory again (until it queues another use).
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventSynchronize`.
    pub fn synchronize(&self) -> Result<()> {
        self.tracker.wait_idle()
    }

    /// Waits for the queued uses and unregisters what the wrapper registered; the memory
    /// stays the owner's, who may free or reuse it once this returned `Ok`. Dropping the
    /// wrapper does the same, and records a failure for [`crate::take_drop_error`].
    ///
    /// # Errors
    ///
    /// CUDA errors of the wait (the memory must then be kept for good: a use may still run)
    /// or of `cudaHostUnregister`.
    pub fn release(mut self) -> Result<()> {
        self.release_once()
    }

    fn release_once(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) {
            return Ok(());
        }
        if let Some(i) = self.registered {
            // The unregister makes the device current anyway; first, so that the wait on a
            // thread with no current device does not create a context on device 0.
            let _ = ensure_context(i);
        }
        // A failed wait keeps the registration: the memory stays the owner's, and a copy may
        // still read or write it through the registered pages.
        self.tracker.wait_idle()?;
        if let Some(i) = self.registered.take() {
            // SAFETY: registered in `wrap`; no queued use is left.
            unsafe { raw::host_unregister(i, self.ptr.cast::<c_void>()) }?;
        }
        // Only now are the bytes free for another wrapper (after a failure: never).
        if std::mem::take(&mut self.listed) {
            live_wrappers().remove(&(self.ptr as usize));
        }
        Ok(())
    }
}

/// The byte ranges of the live wrappers (start -> end), which never overlap.
fn live_wrappers() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    static LIVE: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Page-locks pageable memory for `device` when the driver allows (see the module rules):
/// whether it did.
///
/// # Safety
///
/// As [`raw::host_register`].
unsafe fn register(device: u32, ptr: *mut c_void, bytes: usize, read_only: bool) -> bool {
    // SAFETY: the caller's contract, unchanged.
    if let Ok(pinned) = unsafe { raw::host_register_if_allowed(device, ptr, bytes) } {
        return pinned;
    }
    // Memory mapped read-only needs the read-only flag (where the device supports it).
    let flags = (sys::CUFERRY_REGISTER_PORTABLE | sys::CUFERRY_REGISTER_READ_ONLY) as u32;
    // SAFETY: as above.
    read_only && unsafe { raw::host_register(device, ptr, bytes, flags) }.is_ok()
}

/// What CUDA says `ptr..ptr+bytes` is (`bytes` > 0), and its device: both ends must agree.
fn probe(device: Device, ptr: *mut u8, bytes: usize) -> Result<(PointerType, i32)> {
    match device {
        Device::Cuda(i) => make_current(i)?,
        // Without the driver loaded no CUDA allocation exists; asking would load it.
        Device::Host if !driver_loaded() => return Ok((PointerType::Unregistered, -1)),
        Device::Host => match (thread_has_context(), active_device()) {
            (Ok(true), _) => {}
            (_, Ok(Some(i))) => ensure_context(i)?,
            // No context current or active (or no CUDA in the build): nothing to ask.
            _ => return Ok((PointerType::Unregistered, -1)),
        },
    }
    let last = ptr.wrapping_add(bytes - 1);
    let (first, at_end) = (raw::pointer_type(ptr.cast())?, raw::pointer_type(last.cast())?);
    if first != at_end {
        return Err(Error::invalid(format!(
            "{ptr:p}..+{bytes} starts in {:?} memory of device {} but ends in {:?} memory of device {}: \
             one wrapper covers one allocation",
            first.0, first.1, at_end.0, at_end.1
        )));
    }
    Ok(first)
}

/// Whether the CUDA driver library is loaded in the process (asking loads nothing).
fn driver_loaded() -> bool {
    // SAFETY: RTLD_NOLOAD only looks the library up; a handle found is closed again at once.
    unsafe {
        let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}

impl<T: Element> Drop for ForeignBuffer<T> {
    fn drop(&mut self) {
        if let Err(err) = self.release_once() {
            record_drop_error(err);
        }
    }
}

impl<T: Element> Sealed for ForeignBuffer<T> {
    fn raw_parts(&self) -> RawParts<'_> {
        RawParts { ptr: self.ptr, bytes: self.bytes, tracker: &self.tracker }
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::invalid(format!(
                "the {} bytes at {:p} were wrapped read-only: cuferry never writes them",
                self.bytes, self.ptr
            )));
        }
        Ok(())
    }
}

impl<T: Element> Memory<T> for ForeignBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        self.kind
    }
}

/// The wrapper gives no host view through `&self`; the owner's own views of the memory are
/// held off queued writes by the wrap's safety contract.
impl<T: Element> WriteShared<T> for ForeignBuffer<T> {}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::copy::{copy, copy_range};
    use crate::cuda::device::devices_or_skip;
    use crate::memory::{DeviceBuffer, PinnedBuffer};
    use crate::stream::test_gate::Gate;
    use crate::stream::Stream;

    /// Wraps `data` (kept alive by the caller) for `device`.
    fn wrap_vec(device: Device, data: &mut [u8], read_only: bool) -> Result<ForeignBuffer<u8>> {
        // SAFETY: the tests keep `data` alive and untouched until the wrapper is released.
        unsafe { ForeignBuffer::wrap_with(device, data.as_mut_ptr(), data.len(), read_only) }
    }

    /// Releasing the wrapper waits for a copy into the memory that is queued behind a closed
    /// gate: after `release` the copy has run and the bytes are there. Without the wait the
    /// owner would be handed its memory while a copy still writes it.
    #[test]
    fn release_waits_for_a_queued_copy_into_the_memory() {
        let stream = Stream::new(Device::Host).unwrap();
        let src = DeviceBuffer::from_slice(&stream, &[7u8; 4096]).unwrap();
        let mut data = vec![0u8; 4096];
        let mut wrapped = wrap_vec(Device::Host, &mut data, false).unwrap();
        assert_eq!(wrapped.kind(), MemoryKind::Pageable);
        let gate = Gate::hold(&stream);
        copy(&stream, &src, &mut wrapped).unwrap();
        let opener = gate.open_after(Duration::from_millis(50));
        wrapped.release().unwrap();
        assert!(gate.passed(), "release returned before the queued copy ran");
        opener.join().unwrap();
        assert!(data.iter().all(|&b| b == 7));
    }

    /// The same wait when the wrapper is dropped instead of released.
    #[test]
    fn drop_waits_for_a_queued_copy_from_the_memory() {
        let stream = Stream::new(Device::Host).unwrap();
        let mut data: Vec<u8> = (0..=255).collect();
        let mut dst = DeviceBuffer::<u8>::zeroed(&stream, 256).unwrap();
        let wrapped = wrap_vec(Device::Host, &mut data, true).unwrap();
        let gate = Gate::hold(&stream);
        copy(&stream, &wrapped, &mut dst).unwrap();
        let opener = gate.open_after(Duration::from_millis(50));
        drop(wrapped);
        assert!(gate.passed(), "drop returned before the queued copy ran");
        opener.join().unwrap();
        assert_eq!(dst.to_vec(&stream).unwrap(), data);
    }

    #[test]
    fn bad_ranges_are_refused_before_anything_is_asked() {
        let refused = |ptr: *mut u8, bytes| {
            // SAFETY: each is refused before the memory is touched or registered.
            match unsafe { ForeignBuffer::wrap(Device::Host, ptr, bytes) } {
                Err(Error::InvalidArgument { what }) => what,
                other => panic!("{ptr:p}+{bytes}: expected InvalidArgument, got {other:?}"),
            }
        };
        assert!(refused(std::ptr::null_mut(), 1).contains("NULL"));
        assert!(refused(usize::MAX as *mut u8, 2).contains("address space"));
        assert!(refused(8 as *mut u8, isize::MAX as usize + 1).contains("address space"));
        // SAFETY: nothing to keep alive: no bytes.
        let empty = unsafe { ForeignBuffer::<u8>::wrap(Device::Host, std::ptr::null_mut(), 0) }.unwrap();
        assert_eq!((empty.len(), empty.kind()), (0, MemoryKind::Pageable));
        empty.release().unwrap();
    }

    /// A wrap touching bytes a live wrapper holds is refused (their copies would not be
    /// ordered); adjacent ranges are fine, and the bytes are free again once released.
    #[test]
    fn overlapping_wrappers_are_refused_until_the_first_is_released() {
        let mut data = vec![0u8; 64];
        let base = data.as_mut_ptr();
        let first = wrap_vec(Device::Host, &mut data[16..32], false).unwrap();
        for (offset, len) in [(16, 16), (0, 17), (31, 1), (20, 4), (0, 64)] {
            // SAFETY: refused before the memory is used.
            let again =
                unsafe { ForeignBuffer::wrap_read_only(Device::Host, base.wrapping_add(offset), len) };
            assert!(
                matches!(&again, Err(Error::InvalidArgument { what }) if what.contains("live wrapper")),
                "{offset}+{len}: {again:?}"
            );
        }
        // SAFETY: `data` outlives both wrappers; no copy runs.
        let (before, after) = unsafe {
            (
                ForeignBuffer::wrap_read_only(Device::Host, base, 16).unwrap(),
                ForeignBuffer::wrap_read_only(Device::Host, base.wrapping_add(32), 32).unwrap(),
            )
        };
        first.release().unwrap();
        // SAFETY: as above.
        let whole_middle = unsafe { ForeignBuffer::wrap(Device::Host, base.wrapping_add(16), 16) }.unwrap();
        for w in [before, after, whole_middle] {
            w.release().unwrap();
        }
    }

    #[test]
    fn a_read_only_wrapper_is_no_destination() {
        let mut data = vec![1u8; 8];
        let wrapped = wrap_vec(Device::Host, &mut data, true).unwrap();
        assert!(
            matches!(wrapped.check_writable(), Err(Error::InvalidArgument { what }) if what.contains("read-only"))
        );
        drop(wrapped);
        let wrapped = wrap_vec(Device::Host, &mut data, false).unwrap();
        assert!(wrapped.check_writable().is_ok());
    }

    /// On CUDA: pageable memory is registered for the wrapper's life (and unregistered by
    /// its release), pinned memory is taken as it is, device memory as the device's, and the
    /// host backend refuses device memory. Copies through each kind carry the bytes.
    #[test]
    fn cuda_says_what_the_memory_is() {
        if devices_or_skip().is_none() {
            return;
        }
        let device = Device::Cuda(0);
        let stream = Stream::new(device).unwrap();
        let pattern: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 + 3) as u8).collect();

        let mut pageable = pattern.clone();
        let wrapped = wrap_vec(device, &mut pageable, true).unwrap();
        assert_eq!(wrapped.kind(), MemoryKind::Pinned);
        assert!(wrapped.is_registered());
        let mut on_device = DeviceBuffer::<u8>::zeroed(&stream, pattern.len()).unwrap();
        copy(&stream, &wrapped, &mut on_device).unwrap();
        wrapped.release().unwrap();
        assert_eq!(raw::pointer_type(pageable.as_ptr().cast()).unwrap().0, PointerType::Unregistered);

        let pinned = PinnedBuffer::<u8>::zeroed(device, pattern.len()).unwrap();
        // SAFETY: `pinned` outlives the wrapper, and nothing else uses it meanwhile.
        let mut wrapped_pinned =
            unsafe { ForeignBuffer::wrap(device, pinned.as_ptr().cast_mut(), pattern.len()) }.unwrap();
        assert_eq!(wrapped_pinned.kind(), MemoryKind::Pinned);
        assert!(!wrapped_pinned.is_registered());
        // SAFETY: `on_device` outlives the wrapper; it is only read meanwhile.
        let wrapped_device =
            unsafe { ForeignBuffer::wrap_read_only(device, on_device.as_ptr(), pattern.len()) }.unwrap();
        assert_eq!(wrapped_device.kind(), MemoryKind::Device(device));
        on_device.synchronize().unwrap(); // the wrapper's tracker does not see the copy above
        copy_range(&stream, &wrapped_device, 0, &mut wrapped_pinned, 0, pattern.len()).unwrap();
        wrapped_pinned.release().unwrap();
        wrapped_device.release().unwrap();
        assert_eq!(pinned.as_slice().unwrap(), &pattern[..]);

        // SAFETY: refused before anything uses the memory.
        let host = unsafe { ForeignBuffer::wrap(Device::Host, on_device.as_ptr().cast_mut(), 16) };
        assert!(matches!(&host, Err(Error::InvalidArgument { what }) if what.contains("cuda:0")), "{host:?}");
        // Refused after its range was listed: the range is free again.
        // SAFETY: `on_device` outlives the wrapper, which no operation uses.
        unsafe { ForeignBuffer::wrap(device, on_device.as_ptr().cast_mut(), 16) }.unwrap().release().unwrap();
        // A range from pinned memory into what follows it is two kinds of memory.
        let end = pinned.as_ptr().wrapping_add(pattern.len() - 1).cast_mut();
        // SAFETY: refused before anything uses the memory.
        let spanning = unsafe { ForeignBuffer::wrap(device, end, 1 << 30) };
        assert!(
            matches!(&spanning, Err(Error::InvalidArgument { what }) if what.contains("ends in")),
            "{spanning:?}"
        );
    }
}
