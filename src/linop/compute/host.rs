//! The host backend of the linop kernels: each kernel is one job on the array's compute
//! stream (a worker thread), reading and writing buffers through their raw pointers.
//!
//! Rules:
//! - [`launch`] is the only place that turns buffers into slices. It registers the job as a
//!   use of every buffer it touches (the buffers' use trackers), so the job runs after all
//!   earlier work on those buffers, on any stream, and no buffer is freed or written by
//!   someone else before the job has finished.
//! - The output buffer is borrowed mutably while the job is queued and is distinct from every
//!   input; inputs are only read.
//! - Kernels walk strided views one innermost run at a time ([`walk`]); the per-element loops
//!   are plain slice loops.

use super::super::field::Field;
use super::super::layout::{collapse, walk};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::DeviceBuffer;
use crate::stream::Stream;

/// Raw views of a job's buffers, carried to the worker thread.
struct JobBuffers<T> {
    inputs: Vec<(*const T, usize)>,
    output: (*mut T, usize),
}

// SAFETY: the pointers name host-accessible buffers kept alive, and ordered against every
// other use, by their trackers until the job has run (see `launch`); carrying the addresses to
// the worker thread is the point of the protocol. `T: Send + Sync` (an `Element`).
unsafe impl<T: Send + Sync> Send for JobBuffers<T> {}

impl<T: Field> JobBuffers<T> {
    fn run(self, job: impl FnOnce(&[&[T]], &mut [T])) {
        let inputs: Vec<&[T]> = self
            .inputs
            .iter()
            .map(|&(ptr, len)| {
                if len == 0 {
                    &[][..]
                } else {
                    // SAFETY: `ptr` is the start of a live buffer of `len` elements (its tracker
                    // records this job, so it is not freed before the job ends); the buffer is
                    // only read while the job runs (writes to it are ordered by the tracker).
                    unsafe { std::slice::from_raw_parts(ptr, len) }
                }
            })
            .collect();
        let (ptr, len) = self.output;
        let output: &mut [T] = if len == 0 {
            &mut []
        } else {
            // SAFETY: as above, and the output buffer was borrowed mutably when the job was
            // queued and is not among the inputs, so this is the only access while the job runs.
            unsafe { std::slice::from_raw_parts_mut(ptr, len) }
        };
        job(&inputs, output);
    }
}

/// Queues `job(inputs, output)` on the host stream `stream` as a tracked use of every buffer.
pub(crate) fn launch<T: Field>(
    stream: &Stream,
    inputs: &[&DeviceBuffer<T>],
    output: &mut DeviceBuffer<T>,
    job: impl FnOnce(&[&[T]], &mut [T]) + Send + 'static,
) -> Result<()> {
    if stream.device() != Device::Host {
        return Err(Error::invalid("a host kernel was queued on a CUDA stream"));
    }
    if let Some(b) = inputs.iter().find(|b| b.device() != Device::Host) {
        return Err(Error::invalid(format!("a host kernel cannot read memory of {}", b.device())));
    }
    if output.device() != Device::Host {
        return Err(Error::invalid(format!("a host kernel cannot write memory of {}", output.device())));
    }
    let in_parts: Vec<_> = inputs.iter().map(|b| b.raw_parts()).collect();
    let out_parts = output.raw_parts();
    // The job writes the output and only reads the inputs (each listed once: named twice a
    // buffer would count as written), so tiles reading one input on several streams overlap.
    let mut trackers: Vec<(&UseTracker, Access)> = vec![(out_parts.tracker, Access::Write)];
    for p in &in_parts {
        if !trackers.iter().any(|(t, _)| std::ptr::eq(*t, p.tracker)) {
            trackers.push((p.tracker, Access::Read));
        }
    }
    let buffers = JobBuffers {
        inputs: inputs
            .iter()
            .zip(&in_parts)
            .map(|(b, p)| (p.ptr.cast_const().cast::<T>(), b.len()))
            .collect(),
        output: (out_parts.ptr.cast::<T>(), output.len()),
    };
    UseTracker::use_on(stream, &trackers, || stream.host_fn(move || buffers.run(job)))
}

/// A strided view passed to a kernel by value: offset, shape, strides.
#[derive(Clone, Debug)]
pub(crate) struct View {
    pub(crate) offset: usize,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
}

/// `dst[view] = src[view]` element by element (same shapes).
pub(crate) fn copy_view<T: Field>(
    stream: &Stream,
    src: &DeviceBuffer<T>,
    src_view: View,
    dst: &mut DeviceBuffer<T>,
    dst_view: View,
) -> Result<()> {
    launch(stream, &[src], dst, move |ins, out| {
        let s = ins[0];
        let (shape, [ss, ds]) = collapse(&src_view.shape, [&src_view.strides, &dst_view.strides]);
        walk(&shape, [&ss, &ds], [src_view.offset, dst_view.offset], |[so, d_o], n, [sst, dst_]| {
            if sst == 1 && dst_ == 1 {
                out[d_o..d_o + n].copy_from_slice(&s[so..so + n]);
            } else {
                for i in 0..n {
                    out[d_o + i * dst_] = s[so + i * sst];
                }
            }
        });
    })
}

/// `dst[view] += src[view]` element by element (same shapes).
pub(crate) fn add_view<T: Field>(
    stream: &Stream,
    src: &DeviceBuffer<T>,
    src_view: View,
    dst: &mut DeviceBuffer<T>,
    dst_view: View,
) -> Result<()> {
    launch(stream, &[src], dst, move |ins, out| {
        let s = ins[0];
        let (shape, [ss, ds]) = collapse(&src_view.shape, [&src_view.strides, &dst_view.strides]);
        walk(&shape, [&ss, &ds], [src_view.offset, dst_view.offset], |[so, d_o], n, [sst, dst_]| {
            if sst == 1 && dst_ == 1 {
                for (o, &v) in out[d_o..d_o + n].iter_mut().zip(&s[so..so + n]) {
                    *o += v;
                }
            } else {
                for i in 0..n {
                    out[d_o + i * dst_] += s[so + i * sst];
                }
            }
        });
    })
}

/// `dst[view] = alpha * src[view]`.
pub(crate) fn scale_view<T: Field>(
    stream: &Stream,
    alpha: T,
    src: &DeviceBuffer<T>,
    src_view: View,
    dst: &mut DeviceBuffer<T>,
    dst_view: View,
) -> Result<()> {
    launch(stream, &[src], dst, move |ins, out| {
        let s = ins[0];
        let (shape, [ss, ds]) = collapse(&src_view.shape, [&src_view.strides, &dst_view.strides]);
        walk(&shape, [&ss, &ds], [src_view.offset, dst_view.offset], |[so, d_o], n, [sst, dst_]| {
            for i in 0..n {
                out[d_o + i * dst_] = alpha * s[so + i * sst];
            }
        });
    })
}

/// An einsum over one index space: `out[o] += w'[w] * x[x]` for every index, where `w'` is
/// `w` or its conjugate. The three strides lists cover the whole loop space (0 where an
/// operand lacks the axis); `out` starts zeroed.
pub(crate) struct Contraction {
    pub(crate) shape: Vec<usize>,
    pub(crate) out_strides: Vec<usize>,
    pub(crate) x_strides: Vec<usize>,
    pub(crate) w_strides: Vec<usize>,
    pub(crate) x_offset: usize,
    pub(crate) w_offset: usize,
    pub(crate) conj: bool,
}

/// Queues the contraction reading `x` and `w`, accumulating into `out`.
pub(crate) fn contract<T: Field>(
    stream: &Stream,
    c: Contraction,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    out: &mut DeviceBuffer<T>,
) -> Result<()> {
    launch(stream, &[x, w], out, move |ins, out| {
        if c.conj {
            contract_job::<T, true>(&c, ins[0], ins[1], out);
        } else {
            contract_job::<T, false>(&c, ins[0], ins[1], out);
        }
    })
}

#[inline(always)]
fn cj<T: Field, const CONJ: bool>(v: T) -> T {
    if CONJ {
        v.conj()
    } else {
        v
    }
}

fn contract_job<T: Field, const CONJ: bool>(c: &Contraction, x: &[T], w: &[T], out: &mut [T]) {
    let (shape, [os, xs, ws]) = collapse(&c.shape, [&c.out_strides, &c.x_strides, &c.w_strides]);
    walk(&shape, [&os, &xs, &ws], [0, c.x_offset, c.w_offset], |[o, xo, wo], n, [so, sx, sw]| {
        match (so, sx, sw) {
            (0, 1, 1) => {
                // A dot product along a contracted axis.
                let mut acc = T::zero();
                for (&a, &b) in w[wo..wo + n].iter().zip(&x[xo..xo + n]) {
                    acc += cj::<T, CONJ>(a) * b;
                }
                out[o] += acc;
            }
            (0, _, _) => {
                let mut acc = T::zero();
                for i in 0..n {
                    acc += cj::<T, CONJ>(w[wo + i * sw]) * x[xo + i * sx];
                }
                out[o] += acc;
            }
            (1, 0, 1) => {
                // An axpy: one input value times a weight row.
                let xv = x[xo];
                for (r, &a) in out[o..o + n].iter_mut().zip(&w[wo..wo + n]) {
                    *r += cj::<T, CONJ>(a) * xv;
                }
            }
            (1, 1, 0) => {
                let wv = cj::<T, CONJ>(w[wo]);
                for (r, &b) in out[o..o + n].iter_mut().zip(&x[xo..xo + n]) {
                    *r += wv * b;
                }
            }
            (1, 1, 1) => {
                for ((r, &a), &b) in out[o..o + n].iter_mut().zip(&w[wo..wo + n]).zip(&x[xo..xo + n]) {
                    *r += cj::<T, CONJ>(a) * b;
                }
            }
            _ => {
                for i in 0..n {
                    out[o + i * so] += cj::<T, CONJ>(w[wo + i * sw]) * x[xo + i * sx];
                }
            }
        }
    });
}
