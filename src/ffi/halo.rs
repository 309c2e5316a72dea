//! The halo part of the C ABI: a packer built from C descriptions of exchanges, packing and
//! unpacking `CuferryBuffer` arrays into one buffer.
//!
//! Rules:
//! - Exchanges are scalar quantities: elements of `element_size` bytes moved as they are
//!   (rotations included). Vector quantities, which negate components, are for the Rust API.
//!   The exchanges of one packer share one `element_size`; arrays of several element sizes
//!   take one packer each.
//! - Arrays are buffers the packer reaches, one per exchange, in exchange order: on a CUDA
//!   device its device buffers (`cuferry_device_alloc`) and wrapped device or managed memory
//!   of it (`cuferry_buffer_wrap`: a code's own fields, no copy first); on the host backend
//!   any buffer. Their size must cover the exchange's strided extent, and their addresses
//!   suit the element size (the kernel moves whole elements). A read-only wrapper is packed
//!   from, never unpacked into.
//! - Packing and unpacking are queued on the packer's stream; `cuferry_halo_pack_buffer` and
//!   `cuferry_halo_unpack_buffer` wait for it and return the buffer's address and size.
//! - The packer's stream is ordered after cuferry's own work on the arrays through the same
//!   handles (copies through `cuferry_copy`), not after work cuferry did not queue (nor
//!   through another handle of the memory, such as the buffer a wrapper points into): your kernels or copies writing the
//!   arrays, or the received bytes in the unpack buffer (CUDA-aware MPI), must have finished
//!   before `cuferry_halo_pack` / `cuferry_halo_unpack` is called.
//! - The addresses from `cuferry_halo_pack_buffer` / `cuferry_halo_unpack_buffer` stay valid
//!   until the packer is destroyed (its memory then goes back to a pool, and may serve
//!   another packer, zeroed first: a new packer's buffers hold zeros). The pack buffer's
//!   bytes are rewritten by the next `cuferry_halo_pack`: wait for sends from it (`MPI_Wait`)
//!   first. The unpack buffer is read by a queued `cuferry_halo_unpack` until it has run:
//!   refill it (or post a receive into it) only after `cuferry_halo_synchronize` or the next
//!   `cuferry_halo_unpack_buffer` returned.
//! - A packer is used by one thread at a time.

use std::ffi::c_void;
use std::ops::Range;

use super::{device_of, guard, handle, slice_of, write_out, CuferryBuffer, CuferryStatus};
use crate::error::{Error, Result};
use crate::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use crate::memory::Memory;

/// Most dimensions of an array in the C ABI.
pub const CUFERRY_HALO_MAX_DIMS: usize = 6;

/// One exchange of one array: its layout, the region packed (turned `rotation` quarter turns
/// clockwise) and the region unpacked into. Unused trailing entries of the arrays are ignored.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CuferryHaloExchange {
    /// Bytes per element (1 to 64).
    pub element_size: u32,
    /// Number of dimensions (1 to `CUFERRY_HALO_MAX_DIMS`).
    pub ndim: u32,
    /// Extent of each dimension, outermost first.
    pub shape: [usize; CUFERRY_HALO_MAX_DIMS],
    /// Stride of each dimension in elements; all zero means contiguous row-major.
    pub strides: [usize; CUFERRY_HALO_MAX_DIMS],
    /// The horizontal x dimension, or -1 for none.
    pub x_dim: i32,
    /// The horizontal y dimension, or -1 for none.
    pub y_dim: i32,
    /// First index of the packed region in each dimension.
    pub pack_start: [usize; CUFERRY_HALO_MAX_DIMS],
    /// One past the last index of the packed region in each dimension.
    pub pack_end: [usize; CUFERRY_HALO_MAX_DIMS],
    /// Clockwise quarter turns applied when packing (0 to 3).
    pub rotation: u32,
    /// First index of the unpacked region in each dimension.
    pub unpack_start: [usize; CUFERRY_HALO_MAX_DIMS],
    /// One past the last index of the unpacked region in each dimension.
    pub unpack_end: [usize; CUFERRY_HALO_MAX_DIMS],
}

/// A halo packer (opaque).
pub struct CuferryHaloPacker {
    packer: HaloPacker,
}

fn exchange_of(e: &CuferryHaloExchange) -> Result<HaloExchange> {
    let n = e.ndim as usize;
    if n == 0 || n > CUFERRY_HALO_MAX_DIMS {
        return Err(Error::invalid(format!("ndim {n}: use 1 to {CUFERRY_HALO_MAX_DIMS}")));
    }
    if e.element_size == 0 || e.element_size > 64 {
        return Err(Error::invalid(format!("element_size {}: use 1 to 64 bytes", e.element_size)));
    }
    let dim = |d: i32| -> Result<Option<usize>> {
        match d {
            -1 => Ok(None),
            d if d >= 0 && (d as usize) < n => Ok(Some(d as usize)),
            d => Err(Error::invalid(format!("horizontal dim {d} of a {n}-d array"))),
        }
    };
    let dims = HorizontalDims { x: dim(e.x_dim)?, y: dim(e.y_dim)? };
    let element = ElementType::Raw { size: e.element_size as usize };
    let spec = if e.strides[..n].iter().all(|&s| s == 0) {
        HaloSpec::contiguous(element, &e.shape[..n], dims)?
    } else {
        HaloSpec::new(element, &e.shape[..n], &e.strides[..n], dims)?
    };
    let region = |start: &[usize], end: &[usize]| -> Vec<Range<usize>> {
        start[..n].iter().zip(&end[..n]).map(|(&s, &t)| s..t).collect()
    };
    HaloExchange::new(
        &spec,
        &region(&e.pack_start, &e.pack_end),
        e.rotation,
        &region(&e.unpack_start, &e.unpack_end),
    )
}

/// Creates a packer for `n` exchanges on `device` in `*out`.
///
/// # Safety
///
/// `exchanges` holds `n` elements; `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_packer_create(
    device: i32,
    exchanges: *const CuferryHaloExchange,
    n: usize,
    out: *mut *mut CuferryHaloPacker,
) -> CuferryStatus {
    guard(|| {
        if out.is_null() {
            return Err(Error::invalid("out is NULL"));
        }
        // SAFETY: the caller's contract on `exchanges`.
        let list = unsafe { slice_of(exchanges, n, "exchanges") }?;
        let exchanges = list.iter().map(exchange_of).collect::<Result<Vec<_>>>()?;
        let packer = HaloPacker::new(device_of(device)?, &exchanges, None)?;
        // SAFETY: `out` is non-NULL and valid for writing (caller's contract).
        unsafe { write_out(out, Box::into_raw(Box::new(CuferryHaloPacker { packer }))) }
    })
}

/// Destroys a packer (NULL is a no-op); queued work still completes. On a CUDA device this
/// blocks until the packer's queued launches have run (they read its descriptor tables), and
/// errors of that work are not reported: call `cuferry_halo_synchronize` first to see them.
///
/// # Safety
///
/// `packer` is NULL or a live packer, not used again.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_packer_destroy(packer: *mut CuferryHaloPacker) -> CuferryStatus {
    guard(|| {
        if !packer.is_null() {
            // SAFETY: a live handle from `cuferry_halo_packer_create`, given up by the caller.
            drop(unsafe { Box::from_raw(packer) });
        }
        Ok(())
    })
}

/// The memory behind `n` handles, as the packer reads it (`writes` false: pack) or writes it
/// (`writes` true: unpack, which refuses read-only wrappers).
///
/// # Safety
///
/// `arrays` holds `n` handles, each NULL or live.
unsafe fn array_memory<'a>(
    arrays: *const *const CuferryBuffer,
    n: usize,
    writes: bool,
) -> Result<Vec<&'a dyn Memory<u8>>> {
    // SAFETY: the caller's contract on `arrays`.
    let handles = unsafe { slice_of(arrays, n, "arrays") }?;
    handles
        .iter()
        .map(|&h| {
            // SAFETY: the caller's contract: each handle is NULL or live.
            let memory = &unsafe { handle(h, "array") }?.memory;
            if writes {
                memory.destination()
            } else {
                Ok(memory.source())
            }
        })
        .collect()
}

/// Runs `op` on a packer and the memory behind `n` handles (`writes`: as `array_memory`).
///
/// # Safety
///
/// `packer` is NULL or live; `arrays` holds `n` handles, each NULL or live.
unsafe fn with_arrays(
    packer: *mut CuferryHaloPacker,
    arrays: *const *const CuferryBuffer,
    n: usize,
    writes: bool,
    op: impl FnOnce(&mut HaloPacker, &[&dyn Memory<u8>]) -> Result<()>,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract on the handles.
        let (p, list) = unsafe {
            (
                packer.as_mut().ok_or_else(|| Error::invalid("packer is NULL"))?,
                array_memory(arrays, n, writes)?,
            )
        };
        op(&mut p.packer, &list)
    })
}

/// Queues packing every exchange's region of `arrays[i]` (one per exchange) into the pack
/// buffer.
///
/// # Safety
///
/// `packer` is NULL or live; `arrays` holds `n` live buffer handles, untouched by C until the
/// pack finished.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_pack(
    packer: *mut CuferryHaloPacker,
    arrays: *const *const CuferryBuffer,
    n: usize,
) -> CuferryStatus {
    // SAFETY: the caller's contract, passed on.
    unsafe { with_arrays(packer, arrays, n, false, |p, list| p.pack(list, None)) }
}

/// Queues unpacking the unpack buffer into every exchange's unpack region of `arrays[i]`.
///
/// # Safety
///
/// As `cuferry_halo_pack`.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_unpack(
    packer: *mut CuferryHaloPacker,
    arrays: *const *const CuferryBuffer,
    n: usize,
) -> CuferryStatus {
    // SAFETY: the caller's contract, passed on; and for `unpack_unchecked`: C reads a buffer's memory only after
    // `cuferry_buffer_synchronize` or `cuferry_halo_synchronize` (the header's rules), and
    // Rust holds no host view of a C buffer.
    unsafe { with_arrays(packer, arrays, n, true, |p, list| p.unpack_unchecked(list, None)) }
}

/// Waits for the packer's queued work.
///
/// # Safety
///
/// `packer` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_synchronize(packer: *const CuferryHaloPacker) -> CuferryStatus {
    // SAFETY: the caller's contract on `packer`.
    guard(|| unsafe { handle(packer, "packer") }?.packer.synchronize())
}

/// Waits, then gives the pack buffer's device address and size in bytes.
///
/// # Safety
///
/// `packer` is NULL or live; `ptr` and `bytes` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_pack_buffer(
    packer: *const CuferryHaloPacker,
    ptr: *mut *mut c_void,
    bytes: *mut usize,
) -> CuferryStatus {
    guard(|| {
        // Both checked before either is written, and before the wait.
        if ptr.is_null() || bytes.is_null() {
            return Err(Error::invalid("an out-parameter is NULL"));
        }
        // SAFETY: the caller's contract on `packer`.
        let buf = unsafe { handle(packer, "packer") }?.packer.pack_buffer()?;
        // SAFETY: the caller's contract on the out-parameters.
        unsafe {
            write_out(ptr, buf.as_ptr().cast_mut().cast())?;
            write_out(bytes, buf.len())
        }
    })
}

/// Copies the pack buffer into the unpack buffer (a loopback exchange, for tests and single
/// processes) on the packer's stream.
///
/// # Safety
///
/// `packer` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_loopback(packer: *mut CuferryHaloPacker) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract on `packer`.
        let p = unsafe { packer.as_mut() }.ok_or_else(|| Error::invalid("packer is NULL"))?;
        p.packer.copy_pack_to_unpack()
    })
}

/// Waits, then gives the unpack buffer's device address and size, for the caller to fill
/// (e.g. received over MPI) before `cuferry_halo_unpack`.
///
/// # Safety
///
/// `packer` is NULL or live; `ptr` and `bytes` are NULL or writable; the caller writes the
/// buffer only before queueing the unpack, and again only after this call or
/// `cuferry_halo_synchronize` returned (a queued unpack reads it until then).
#[no_mangle]
pub unsafe extern "C" fn cuferry_halo_unpack_buffer(
    packer: *mut CuferryHaloPacker,
    ptr: *mut *mut c_void,
    bytes: *mut usize,
) -> CuferryStatus {
    guard(|| {
        // Both checked before either is written, and before the wait.
        if ptr.is_null() || bytes.is_null() {
            return Err(Error::invalid("an out-parameter is NULL"));
        }
        // SAFETY: the caller's contract on `packer`.
        let p = unsafe { packer.as_mut() }.ok_or_else(|| Error::invalid("packer is NULL"))?;
        let buf = p.packer.unpack_buffer_mut()?;
        // SAFETY: the caller's contract on the out-parameters.
        unsafe {
            write_out(ptr, buf.as_mut_ptr().cast())?;
            write_out(bytes, buf.len())
        }
    })
}
