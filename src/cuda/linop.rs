//! Linear-operator kernel calls (linop.cu).

use std::os::raw::c_void;

use super::{check, stream::RawStream};
use crate::error::Result;
use crate::sys;

/// The strided map kernel.
///
/// # Safety
///
/// 1. Every element the map reads or writes is inside live device memory of element type
///    `dtype` that **stays allocated until the stream ran the kernel**, and nothing else writes
///    the destination elements meanwhile.
pub(crate) unsafe fn map(
    dtype: i32,
    m: &sys::cuferry_linop_map,
    src: *const c_void,
    dst: *mut c_void,
    alpha: (f64, f64),
    stream: RawStream,
) -> Result<()> {
    // SAFETY: precondition 1; `m` is a valid descriptor for the call's duration.
    check("linop map<<<>>>", unsafe {
        sys::cuferry_cuda_linop_map(dtype, m, src, dst, alpha.0, alpha.1, stream.0)
    })
}

/// The contraction kernel.
///
/// # Safety
///
/// As [`map`], for `x`, `w` (read) and `out` (written).
pub(crate) unsafe fn contract(
    dtype: i32,
    c: &sys::cuferry_linop_contraction,
    x: *const c_void,
    w: *const c_void,
    out: *mut c_void,
    stream: RawStream,
) -> Result<()> {
    // SAFETY: precondition 1; `c` is a valid descriptor for the call's duration.
    check("linop contract<<<>>>", unsafe { sys::cuferry_cuda_linop_contract(dtype, c, x, w, out, stream.0) })
}
