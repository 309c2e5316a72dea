//! Halo calls (halo.cu): the one-launch pack/unpack kernel and the seed-strategy baseline.
//!
//! Rules: one function per C call, each returning [`Result`]; the kernels are asynchronous, so
//! every pointer they get must stay alive until the stream has run them (the halo module keeps
//! that promise with use trackers).

use std::os::raw::c_void;

use super::{check, ordinal, stream::RawStream};
use crate::error::{Error, Result};
use crate::sys;

/// Direction of [`launch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HaloDirection {
    /// Arrays -> packed buffer.
    Pack,
    /// Packed buffer -> arrays.
    Unpack,
}

impl HaloDirection {
    /// The C ABI's `CUFERRY_HALO_*` code.
    fn code(self) -> i32 {
        match self {
            HaloDirection::Pack => sys::CUFERRY_HALO_PACK,
            HaloDirection::Unpack => sys::CUFERRY_HALO_UNPACK,
        }
    }
}

/// The C types of a launch's device, unit count and direction.
fn launch_args(device: u32, total_units: u64, direction: HaloDirection) -> Result<(i32, i64, i32)> {
    let units = i64::try_from(total_units)
        .map_err(|_| Error::invalid(format!("{total_units} halo units are too many")))?;
    Ok((ordinal(device)?, units, direction.code()))
}

/// `cuferry_cuda_halo_launch`: runs every descriptor of `table` in one kernel launch.
///
/// # Safety
///
/// 1. `table` is device memory of `device` holding `n_desc` descriptors laid out as the header's
///    rules say (unit numbering without gaps, `total_units` in all).
/// 2. Every address the descriptors name, and `packed` plus every slot, is device memory of
///    `device` that **stays alive and is not used by other unordered work until the stream has
///    run the kernel** (it is asynchronous).
pub(crate) unsafe fn launch(
    device: u32,
    table: *const sys::cuferry_halo_desc,
    n_desc: usize,
    total_units: u64,
    packed: *mut c_void,
    direction: HaloDirection,
    stream: RawStream,
) -> Result<()> {
    let (dev, units, dir) = launch_args(device, total_units, direction)?;
    let n = i32::try_from(n_desc)
        .map_err(|_| Error::invalid(format!("{n_desc} halo descriptors are too many")))?;
    // SAFETY: preconditions 1 and 2; the stream handle is live.
    check("cuferry_cuda_halo_launch", unsafe {
        sys::cuferry_cuda_halo_launch(dev, table, n, units, packed, dir, stream.0)
    })
}

/// `cuferry_cuda_halo_launch_inline`: as [`launch`], with the descriptors taken from host
/// memory and passed in the launch's parameters (at most [`INLINE_MAX_DESC`]); `table` is free
/// again when this returns.
///
/// # Safety
///
/// 1. `table` is laid out as the header's rules say (unit numbering without gaps,
///    `total_units` in all) and names device memory of `device`.
/// 2. As precondition 2 of [`launch`].
pub(crate) unsafe fn launch_inline(
    device: u32,
    table: &[sys::cuferry_halo_desc],
    total_units: u64,
    packed: *mut c_void,
    direction: HaloDirection,
    stream: RawStream,
) -> Result<()> {
    let (dev, units, dir) = launch_args(device, total_units, direction)?;
    if table.len() > INLINE_MAX_DESC {
        return Err(Error::invalid(format!(
            "{} halo descriptors do not fit the launch's parameters (at most {INLINE_MAX_DESC})",
            table.len()
        )));
    }
    let n = table.len() as i32; // at most INLINE_MAX_DESC
                                // SAFETY: preconditions 1 and 2; `table` holds `n` descriptors for the call's duration;
                                // the stream handle is live.
    check("cuferry_cuda_halo_launch_inline", unsafe {
        sys::cuferry_cuda_halo_launch_inline(dev, table.as_ptr(), n, units, packed, dir, stream.0)
    })
}

/// Most descriptors [`launch_inline`] takes.
pub(crate) const INLINE_MAX_DESC: usize = sys::CUFERRY_HALO_INLINE_MAX_DESC as usize;

/// What the seed-strategy gather moves: element size, kind and negation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeedElement {
    pub(crate) size: i32,
    pub(crate) kind: i32,
    pub(crate) negate: bool,
}

/// `cuferry_cuda_halo_seed_pack_launch`: `dst[i] = src[indices[i]]` for `i < n`, one launch.
///
/// # Safety
///
/// 1. `indices` holds `n` indices into `src`, and `dst` room for `n` elements, all device memory
///    of `device` that **stays alive until the stream has run the kernel**.
pub(crate) unsafe fn seed_pack_launch(
    device: u32,
    src: *const c_void,
    indices: *const i32,
    n: usize,
    dst: *mut c_void,
    element: SeedElement,
    stream: RawStream,
) -> Result<()> {
    let dev = ordinal(device)?;
    let n = i64::try_from(n).map_err(|_| Error::invalid(format!("{n} elements are too many")))?;
    // SAFETY: precondition 1; the stream handle is live.
    check("cuferry_cuda_halo_seed_pack_launch", unsafe {
        sys::cuferry_cuda_halo_seed_pack_launch(
            dev,
            src,
            indices,
            n,
            dst,
            element.size,
            element.kind,
            i32::from(element.negate),
            stream.0,
        )
    })
}

/// `cuferry_cuda_halo_emulate`: runs the kernel's per-thread program for every block and
/// thread of a grid of at most `max_blocks` blocks on the calling CPU thread, over host memory,
/// with `in_flight` (1, 2, 4 or 8) loads per thread in flight (tests of the kernel's
/// arithmetic).
///
/// # Safety
///
/// 1. `table` describes host memory: every array address it names, and `packed` plus every
///    slot, is a live host allocation that nothing else touches during the call.
#[cfg(test)]
pub(crate) unsafe fn emulate(
    table: &[sys::cuferry_halo_desc],
    total_units: u64,
    packed: *mut c_void,
    direction: HaloDirection,
    in_flight: i32,
    max_blocks: i32,
) -> Result<()> {
    let n = i32::try_from(table.len())
        .map_err(|_| Error::invalid(format!("{} halo descriptors are too many", table.len())))?;
    let units = i64::try_from(total_units)
        .map_err(|_| Error::invalid(format!("{total_units} halo units are too many")))?;
    let dir = direction.code();
    // SAFETY: the table is a live slice of `n` descriptors; precondition 1 covers the rest.
    check("cuferry_cuda_halo_emulate", unsafe {
        sys::cuferry_cuda_halo_emulate(table.as_ptr(), n, units, packed, dir, in_flight, max_blocks)
    })
}
