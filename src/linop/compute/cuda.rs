//! The CUDA backend of the linop kernels: one launch per operation on the array's compute
//! stream, ordered with every buffer it touches by their use trackers.
//!
//! Rules: descriptors hold at most `CUFERRY_LINOP_MAX_DIMS` loop dims. Past that, adjacent
//! axes every operand walks as one are merged and size-1 axes dropped ([`fit_dims`]: the
//! same elements in the same order); still too many is [`Error::Unsupported`];
//! every buffer is memory of the stream's device (an error otherwise); the output buffer is
//! borrowed mutably and distinct from the inputs. The linop tests and compute-sanitizer ran
//! them on an H100 (2026-11-23).

use std::os::raw::c_void;

use super::super::field::Field;
use super::super::layout::collapse;
use super::host::{Contraction, View};
use crate::cuda::linop as raw;
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::DeviceBuffer;
use crate::stream::Stream;
use crate::sys;

const MAX_DIMS: usize = sys::CUFERRY_LINOP_MAX_DIMS as usize;

fn dims_ok(n: usize) -> Result<()> {
    if n > MAX_DIMS {
        return Err(Error::unsupported(format!("linop kernels take at most {MAX_DIMS} dims, not {n}")));
    }
    Ok(())
}

/// Checks that every buffer a launch on `stream` touches is memory of `stream`'s device.
fn same_device<T: Field>(stream: &Stream, buffers: &[&DeviceBuffer<T>]) -> Result<()> {
    match buffers.iter().find(|b| b.device() != stream.device()) {
        Some(b) => Err(Error::invalid(format!(
            "a linop kernel on a stream of {} cannot touch memory of {}",
            stream.device(),
            b.device()
        ))),
        None => Ok(()),
    }
}

/// The loop dims of a descriptor: as given when they fit in `MAX_DIMS` (the layouts the H100
/// runs exercised), else merged by [`collapse`] (adjacent axes every operand walks as one,
/// size-1 axes dropped: the same element visits in the same order; a contraction's reduced
/// axes, of output stride 0, never merge with output axes, whose stride is not). An empty
/// space past the limit is not merged (a contraction over an empty axis must still zero its
/// outputs): [`Error::Unsupported`], as is a layout still over the limit.
fn fit_dims<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
) -> Result<(Vec<usize>, [Vec<usize>; N])> {
    if shape.len() <= MAX_DIMS || shape.contains(&0) {
        dims_ok(shape.len())?;
        return Ok((shape.to_vec(), strides.map(<[usize]>::to_vec)));
    }
    let (mut merged, mut merged_strides) = collapse(shape, strides);
    if merged.is_empty() {
        // Every axis had size 1: one element, as one axis of size 1.
        merged.push(1);
        for s in &mut merged_strides {
            s.push(0);
        }
    }
    dims_ok(merged.len())?;
    Ok((merged, merged_strides))
}

fn fill(dst: &mut [i64; MAX_DIMS], src: &[usize]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s as i64;
    }
}

/// `dst[dst_view] (= or +=) alpha * src[src_view]` (same shapes).
pub(crate) fn map<T: Field>(
    stream: &Stream,
    alpha: T,
    src: &DeviceBuffer<T>,
    src_view: &View,
    dst: &mut DeviceBuffer<T>,
    dst_view: &View,
    accumulate: bool,
) -> Result<()> {
    same_device(stream, &[src, &*dst])?;
    if src_view.shape.contains(&0) {
        // Nothing to copy, whatever the rank (an empty map of 9 dims is not `Unsupported`).
        return Ok(());
    }
    let (shape, [src_strides, dst_strides]) =
        fit_dims(&src_view.shape, [&src_view.strides, &dst_view.strides])?;
    let n = shape.len();
    let mut m = sys::cuferry_linop_map {
        shape: [1; MAX_DIMS],
        src_strides: [0; MAX_DIMS],
        dst_strides: [0; MAX_DIMS],
        src_offset: src_view.offset as i64,
        dst_offset: dst_view.offset as i64,
        ndim: n as i32,
        accumulate: i32::from(accumulate),
    };
    fill(&mut m.shape, &shape);
    fill(&mut m.src_strides, &src_strides);
    fill(&mut m.dst_strides, &dst_strides);
    let (s, d) = (src.raw_parts(), dst.raw_parts());
    let (sp, dp) = (s.ptr.cast::<c_void>().cast_const(), d.ptr.cast::<c_void>());
    // `accumulate` reads `dst` too: still a write, which orders it after every earlier use.
    UseTracker::use_on(stream, &[(s.tracker, Access::Read), (d.tracker, Access::Write)], || {
        // SAFETY: the views lie inside the buffers (the operators' shape checks), both are kept
        // alive and ordered by their trackers, and `dst` is borrowed mutably.
        unsafe { raw::map(T::KERNEL_CODE, &m, sp, dp, (alpha.re(), alpha.im()), stream.cuda_raw()?) }
    })
}

/// The contraction `out = sum w' * x` (out written whole).
pub(crate) fn contract<T: Field>(
    stream: &Stream,
    c: &Contraction,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    out: &mut DeviceBuffer<T>,
) -> Result<()> {
    let (shape, [out_strides, x_strides, w_strides]) =
        fit_dims(&c.shape, [&c.out_strides, &c.x_strides, &c.w_strides])?;
    let n = shape.len();
    same_device(stream, &[x, w, &*out])?;
    let mut k = sys::cuferry_linop_contraction {
        shape: [1; MAX_DIMS],
        out_strides: [0; MAX_DIMS],
        x_strides: [0; MAX_DIMS],
        w_strides: [0; MAX_DIMS],
        x_offset: c.x_offset as i64,
        w_offset: c.w_offset as i64,
        ndim: n as i32,
        conj: i32::from(c.conj),
    };
    fill(&mut k.shape, &shape);
    fill(&mut k.out_strides, &out_strides);
    fill(&mut k.x_strides, &x_strides);
    fill(&mut k.w_strides, &w_strides);
    let (xp, wp, op) = (x.raw_parts(), w.raw_parts(), out.raw_parts());
    // `x` and `w` are only read (and listed once when they share a buffer: named twice it
    // would count as written); `out` is written.
    let mut trackers = vec![(op.tracker, Access::Write), (xp.tracker, Access::Read)];
    if !std::ptr::eq(xp.tracker, wp.tracker) {
        trackers.push((wp.tracker, Access::Read));
    }
    let (xr, wr, or) =
        (xp.ptr.cast::<c_void>().cast_const(), wp.ptr.cast::<c_void>().cast_const(), op.ptr.cast::<c_void>());
    UseTracker::use_on(stream, &trackers, || {
        // SAFETY: as in `map`; `out` is distinct from `x` and `w` (borrowed mutably).
        unsafe { raw::contract(T::KERNEL_CODE, &k, xr, wr, or, stream.cuda_raw()?) }
    })
}

#[cfg(test)]
mod tests {
    use super::super::super::layout::row_major;
    use super::*;

    /// Every operand's offset at each index of `shape`, in row-major order.
    fn visits<const N: usize>(shape: &[usize], strides: [&[usize]; N]) -> Vec<[usize; N]> {
        let total: usize = shape.iter().product();
        (0..total)
            .map(|mut flat| {
                let mut at = [0usize; N];
                for d in (0..shape.len()).rev() {
                    let i = flat % shape[d];
                    flat /= shape[d];
                    for k in 0..N {
                        at[k] += i * strides[k][d];
                    }
                }
                at
            })
            .collect()
    }

    /// Past 8 dims, merged layouts visit the same offsets in the same order, and a reduced axis
    /// (output stride 0) stays apart from output axes; within 8 they are left alone; layouts
    /// that do not merge enough, and empty ones past the limit, are refused.
    #[test]
    fn layouts_past_the_limit_merge_without_changing_the_visits() {
        // Input and output row-major with two permuted (non-mergeable) pairs and size-1 axes.
        let shape = [2, 1, 3, 2, 1, 1, 2, 3, 1, 2];
        let src = row_major(&shape);
        let mut dst = src.clone();
        dst.swap(2, 3); // strides of axes 2 and 3 exchanged: not mergeable across them
        let (merged, [ms, md]) = fit_dims(&shape, [&src, &dst]).unwrap();
        assert!(merged.len() <= MAX_DIMS, "{merged:?}");
        assert_eq!(visits(&merged, [&ms, &md]), visits(&shape, [&src, &dst]));
        // A contraction: output axes 0, 2, 4..; reduced axes (stride 0) 1, 3, 5 between them.
        let shape = [2, 3, 2, 2, 1, 2, 2, 2, 3, 1];
        let out = [24, 0, 12, 0, 0, 0, 6, 3, 1, 1];
        let x = row_major(&shape);
        let w: Vec<usize> = x.iter().zip(&out).map(|(&a, &o)| if o == 0 { a } else { 0 }).collect();
        let (merged, [mo, mx, mw]) = fit_dims(&shape, [&out, &x, &w]).unwrap();
        assert!(merged.len() <= MAX_DIMS);
        assert_eq!(visits(&merged, [&mo, &mx, &mw]), visits(&shape, [&out, &x, &w]));
        let reduced = |o: &[usize], sh: &[usize]| -> usize {
            o.iter().zip(sh).filter(|(&s, &n)| s == 0 && n > 1).map(|(_, &n)| n).product()
        };
        assert_eq!(reduced(&mo, &merged), reduced(&out, &shape), "reduced extent changed");
        // Within the limit: untouched, size-1 axes included.
        let small = [1, 4, 1];
        let (kept, [ks]) = fit_dims(&small, [&row_major(&small)]).unwrap();
        assert_eq!((kept, ks), (small.to_vec(), row_major(&small)));
        // Nine size-1 axes: one element.
        let ones = [1; 9];
        let (one, [os]) = fit_dims(&ones, [&[5; 9]]).unwrap();
        assert_eq!((one, os), (vec![1], vec![0]));
        // Nine axes that no operand walks as one; and an empty space past the limit.
        let shape = [2; 9];
        let scattered: Vec<usize> = (0..9).map(|d| 1 << (2 * d)).collect();
        assert!(matches!(fit_dims(&shape, [&scattered]), Err(Error::Unsupported { .. })));
        let mut empty = [2; 9];
        empty[4] = 0;
        assert!(matches!(fit_dims(&empty, [&row_major(&empty)]), Err(Error::Unsupported { .. })));
    }
}
