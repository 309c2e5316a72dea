//! Allocation, registration and copy calls (memory.cu).

use std::os::raw::c_void;

use super::{check, ordinal, stream::RawStream};
use crate::error::{Error, Result};
use crate::sys;

/// Direction of a CUDA copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
    HostToHost,
    /// Inferred from the pointers (unified addressing): used for managed memory.
    Default,
}

impl CopyKind {
    fn raw(self) -> sys::cuferry_copy_kind {
        match self {
            CopyKind::HostToDevice => sys::cuferry_copy_kind_CUFERRY_COPY_HOST_TO_DEVICE,
            CopyKind::DeviceToHost => sys::cuferry_copy_kind_CUFERRY_COPY_DEVICE_TO_HOST,
            CopyKind::DeviceToDevice => sys::cuferry_copy_kind_CUFERRY_COPY_DEVICE_TO_DEVICE,
            CopyKind::HostToHost => sys::cuferry_copy_kind_CUFERRY_COPY_HOST_TO_HOST,
            CopyKind::Default => sys::cuferry_copy_kind_CUFERRY_COPY_DEFAULT,
        }
    }
}

/// `cudaMalloc`; `bytes == 0` gives a null pointer.
pub(crate) fn device_alloc(device: u32, bytes: usize) -> Result<*mut c_void> {
    let dev = ordinal(device)?;
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the duration of the call.
    check("cudaMalloc", unsafe { sys::cuferry_cuda_device_alloc(dev, bytes, &mut p) })?;
    Ok(p)
}

/// `cudaFree`.
///
/// # Safety
///
/// 1. `ptr` came from [`device_alloc`] on `device` (or is null) and no queued work uses it.
pub(crate) unsafe fn device_free(device: u32, ptr: *mut c_void) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: precondition 1.
    check("cudaFree", unsafe { sys::cuferry_cuda_device_free(dev, ptr) })
}

/// `cudaHostAlloc` with `CUFERRY_PINNED_*` flags; `bytes == 0` gives a null pointer.
pub(crate) fn pinned_alloc(device: u32, bytes: usize, flags: u32) -> Result<*mut c_void> {
    let dev = ordinal(device)?;
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the duration of the call.
    check("cudaHostAlloc", unsafe { sys::cuferry_cuda_pinned_alloc(dev, bytes, flags, &mut p) })?;
    Ok(p)
}

/// `cudaFreeHost` with `device` (the allocating device) made current first: on a thread with
/// no current device the runtime would create device 0's context for the call.
///
/// # Safety
///
/// 1. `ptr` came from [`pinned_alloc`] (or is null) and no queued work uses it.
pub(crate) unsafe fn pinned_free(device: u32, ptr: *mut c_void) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: precondition 1.
    check("cudaFreeHost", unsafe { sys::cuferry_cuda_pinned_free(dev, ptr) })
}

/// `cudaHostRegister` with `CUFERRY_REGISTER_*` flags.
///
/// # Safety
///
/// 1. `ptr..ptr+bytes` is one live host allocation that stays alive until [`host_unregister`].
pub(crate) unsafe fn host_register(device: u32, ptr: *mut c_void, bytes: usize, flags: u32) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: precondition 1.
    check("cudaHostRegister", unsafe { sys::cuferry_cuda_host_register(dev, ptr, bytes, flags) })
}

/// `cudaErrorHostMemoryAlreadyRegistered`.
const ALREADY_REGISTERED: i32 = 712;
/// `cudaErrorNotSupported`.
const NOT_SUPPORTED: i32 = 801;

/// [`host_register`] with the portable flag, where a refusal is an answer: `false` when the
/// driver will not page-lock the range ("already registered": some of its pages are another
/// registration's; "not supported"), so the memory stays pageable. Other errors are returned.
///
/// # Safety
///
/// As [`host_register`].
pub(crate) unsafe fn host_register_if_allowed(device: u32, ptr: *mut c_void, bytes: usize) -> Result<bool> {
    let flags = sys::CUFERRY_REGISTER_PORTABLE as u32;
    // SAFETY: the caller's contract, unchanged.
    match unsafe { host_register(device, ptr, bytes, flags) } {
        Ok(()) => Ok(true),
        Err(Error::Cuda { code: ALREADY_REGISTERED | NOT_SUPPORTED, .. }) => Ok(false),
        Err(err) => Err(err),
    }
}

/// `cudaHostUnregister` with `device` (the registering device) made current first, as
/// [`pinned_free`].
///
/// # Safety
///
/// 1. `ptr` was registered by [`host_register`] and no queued work uses it.
pub(crate) unsafe fn host_unregister(device: u32, ptr: *mut c_void) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: precondition 1.
    check("cudaHostUnregister", unsafe { sys::cuferry_cuda_host_unregister(dev, ptr) })
}

/// What memory an address lies in (`cudaPointerGetAttributes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PointerType {
    /// Host memory CUDA does not know: pageable, or no memory at all.
    Unregistered,
    /// Page-locked host memory (`cudaHostAlloc`, `cudaHostRegister`).
    Host,
    /// Device memory.
    Device,
    /// Managed memory.
    Managed,
}

/// The memory `ptr` lies in and its device (-1 for unregistered memory). Asking needs a
/// context: on a thread without one the runtime makes the current device's (see
/// `device::ensure_some_context`).
pub(crate) fn pointer_type(ptr: *const c_void) -> Result<(PointerType, i32)> {
    let (mut kind, mut device) = (sys::cuferry_pointer_type_CUFERRY_POINTER_UNREGISTERED, -1);
    // SAFETY: the call only inspects the address; the out-pointers are valid.
    check("cudaPointerGetAttributes", unsafe {
        sys::cuferry_cuda_pointer_type(ptr, &mut kind, &mut device)
    })?;
    let kind = match kind {
        sys::cuferry_pointer_type_CUFERRY_POINTER_HOST => PointerType::Host,
        sys::cuferry_pointer_type_CUFERRY_POINTER_DEVICE => PointerType::Device,
        sys::cuferry_pointer_type_CUFERRY_POINTER_MANAGED => PointerType::Managed,
        _ => PointerType::Unregistered,
    };
    Ok((kind, device))
}

/// `cudaMemcpyAsync`.
///
/// # Safety
///
/// 1. `src..src+bytes` and `dst..dst+bytes` are valid for `kind` and **stay alive and
///    untouched by others until the stream has run the copy** (it is asynchronous).
pub(crate) unsafe fn memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: CopyKind,
    stream: RawStream,
) -> Result<()> {
    // SAFETY: precondition 1; the stream handle is live.
    check("cudaMemcpyAsync", unsafe { sys::cuferry_cuda_memcpy_async(dst, src, bytes, kind.raw(), stream.0) })
}

/// `cudaMemcpyPeerAsync`.
///
/// # Safety
///
/// 1. Both ranges are device memory of the named devices and **stay alive until the stream has
///    run the copy** (it is asynchronous).
pub(crate) unsafe fn memcpy_peer_async(
    dst: *mut c_void,
    dst_device: u32,
    src: *const c_void,
    src_device: u32,
    bytes: usize,
    stream: RawStream,
) -> Result<()> {
    let (dd, sd) = (ordinal(dst_device)?, ordinal(src_device)?);
    // SAFETY: precondition 1; the stream handle is live.
    check("cudaMemcpyPeerAsync", unsafe {
        sys::cuferry_cuda_memcpy_peer_async(dst, dd, src, sd, bytes, stream.0)
    })
}

/// `cudaMemcpyBatchAsync`: copy `k` moves `sizes[k]` bytes from `srcs[k]` to `dsts[k]`, in no
/// set order among the copies, after the work queued on the stream before it.
///
/// # Errors
///
/// [`crate::Error::InvalidArgument`] when the three slices' lengths differ; CUDA errors of the
/// call.
///
/// # Safety
///
/// 1. Every range is valid memory under unified addressing and **stays alive and untouched
///    by others until the stream has run the batch** (it is asynchronous).
/// 2. No destination range overlaps another copy's source or destination range.
pub(crate) unsafe fn memcpy_batch_async(
    dsts: &[*mut c_void],
    srcs: &[*const c_void],
    sizes: &[usize],
    stream: RawStream,
) -> Result<()> {
    if dsts.len() != srcs.len() || dsts.len() != sizes.len() {
        return Err(crate::Error::invalid(format!(
            "a copy batch of {} destinations, {} sources and {} sizes",
            dsts.len(),
            srcs.len(),
            sizes.len()
        )));
    }
    // SAFETY: the three arrays have `dsts.len()` entries each (checked); preconditions 1 and
    // 2; the stream handle is live. CUDA only reads the arrays during the call.
    check("cudaMemcpyBatchAsync", unsafe {
        sys::cuferry_cuda_memcpy_batch_async(
            dsts.as_ptr(),
            srcs.as_ptr(),
            sizes.as_ptr(),
            dsts.len(),
            stream.0,
        )
    })
}

/// `cudaMemsetAsync`.
///
/// # Safety
///
/// 1. `dst..dst+bytes` is device memory that **stays alive until the stream has run the set**.
pub(crate) unsafe fn memset_async(
    dst: *mut c_void,
    value: u8,
    bytes: usize,
    stream: RawStream,
) -> Result<()> {
    // SAFETY: precondition 1; the stream handle is live.
    check("cudaMemsetAsync", unsafe {
        sys::cuferry_cuda_memset_async(dst, i32::from(value), bytes, stream.0)
    })
}
