//! Linear-operator kernel calls (linop.cu).

use std::os::raw::c_void;

use super::{check, stream::RawStream};
#[cfg(test)]
use crate::error::Error;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty map or contraction returns at once, touching no pointer and no device (an
    /// empty buffer's address is NULL): no GPU is needed to call it. An empty reduction with
    /// outputs would launch (a GPU test covers it); a NULL pointer where elements exist and a
    /// bad element type are argument errors, not CUDA failures.
    #[test]
    fn empty_kernels_return_without_touching_anything() {
        if !crate::device::cuda_built() {
            return;
        }
        let stream = RawStream(std::ptr::dangling_mut());
        let mut m = sys::cuferry_linop_map {
            shape: [1; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            src_strides: [0; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            dst_strides: [0; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            src_offset: 0,
            dst_offset: 0,
            ndim: 2,
            accumulate: 0,
        };
        m.shape[1] = 0;
        let null = std::ptr::null_mut::<c_void>();
        // SAFETY: an empty shape: the kernel call reads and writes nothing.
        let got = unsafe { map(sys::CUFERRY_LINOP_F64, &m, null, null, (1.0, 0.0), stream) };
        assert_eq!(got, Ok(()));
        let mut c = sys::cuferry_linop_contraction {
            shape: [1; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            out_strides: [0; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            x_strides: [0; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            w_strides: [0; sys::CUFERRY_LINOP_MAX_DIMS as usize],
            x_offset: 0,
            w_offset: 0,
            ndim: 2,
            conj: 0,
        };
        // No outputs.
        (c.shape[0], c.out_strides[0]) = (0, 1);
        // SAFETY: no outputs: the kernel call reads and writes nothing.
        let got = unsafe { contract(sys::CUFERRY_LINOP_F64, &c, null, null, null, stream) };
        assert_eq!(got, Ok(()));
        m.shape[1] = 3;
        // SAFETY: refused before any pointer is read (NULL where elements exist).
        let got = unsafe { map(sys::CUFERRY_LINOP_F64, &m, null, null, (1.0, 0.0), stream) };
        assert!(
            matches!(&got, Err(Error::InvalidArgument { what }) if what.contains("NULL_ARGUMENT")),
            "{got:?}"
        );
        // SAFETY: refused before anything is read (an unknown element type).
        let got = unsafe { map(99, &m, null, null, (1.0, 0.0), stream) };
        assert!(matches!(&got, Err(Error::InvalidArgument { what }) if what.contains("BAD_ENUM")), "{got:?}");
    }
}
