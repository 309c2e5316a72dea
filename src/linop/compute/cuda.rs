//! The CUDA backend of the linop kernels: one launch per operation on the array's compute
//! stream, ordered with every buffer it touches by their use trackers.
//!
//! Rules: descriptors hold at most `CUFERRY_LINOP_MAX_DIMS` loop dims (an error otherwise);
//! every buffer is memory of the stream's device (an error otherwise); the output buffer is
//! borrowed mutably and distinct from the inputs. The linop tests and compute-sanitizer ran
//! them on an H100 (2026-11-23).

use std::os::raw::c_void;

use super::super::field::Field;
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
    let n = src_view.shape.len();
    dims_ok(n)?;
    same_device(stream, &[src, &*dst])?;
    let mut m = sys::cuferry_linop_map {
        shape: [1; MAX_DIMS],
        src_strides: [0; MAX_DIMS],
        dst_strides: [0; MAX_DIMS],
        src_offset: src_view.offset as i64,
        dst_offset: dst_view.offset as i64,
        ndim: n as i32,
        accumulate: i32::from(accumulate),
    };
    fill(&mut m.shape, &src_view.shape);
    fill(&mut m.src_strides, &src_view.strides);
    fill(&mut m.dst_strides, &dst_view.strides);
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
    let n = c.shape.len();
    dims_ok(n)?;
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
    fill(&mut k.shape, &c.shape);
    fill(&mut k.out_strides, &c.out_strides);
    fill(&mut k.x_strides, &c.x_strides);
    fill(&mut k.w_strides, &c.w_strides);
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
