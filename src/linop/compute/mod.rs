//! Kernel dispatch: the one place that decides how each array operation runs on each device.
//!
//! Rules:
//! - Operators never touch memory themselves; they call the functions here, which pick the
//!   backend from the input's device ([`backend`]) and queue the work on the input's compute
//!   stream. The output lives on the input's spec. Every launch checks that the spec's
//!   streams and every buffer it touches are on the spec's device.
//! - [`Device::Host`]: kernels in [`host`], one job on the stream per call.
//! - [`Device::Cuda`]: kernels in `cuda` (csrc/linop.cu: a strided map for copies, scaling,
//!   sums and concatenation, and a strided contraction for Dense and Diagonal): one launch
//!   per copy, scaling or contraction, one per term of a sum and per part of a
//!   concatenation. They take at most `CUFERRY_LINOP_MAX_DIMS` (8) loop dims, where the host
//!   has no limit: more are merged where every operand walks adjacent axes as one, and what
//!   still does not fit is [`Error::Unsupported`]. Run on an H100 (2026-11-23: the linop tests
//!   and compute-sanitizer; the merging since is compiled with nvcc, not run on a GPU). In a build without nvcc, arithmetic on CUDA arrays returns
//!   [`Error::Unsupported`] with [`NO_CUDA_KERNELS`].

mod cuda;
pub(crate) mod host;

use super::array::Array;
use super::dims::Dims;
use super::field::Field;
use super::layout::row_major;
use crate::device::{Device, DeviceSpec};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use host::{Contraction, View};

/// What [`Error::Unsupported`] says for arithmetic on CUDA arrays.
pub const NO_CUDA_KERNELS: &str =
    "linop compute on CUDA devices: this build has no CUDA kernels (nvcc was not found)";

/// The backends that can run linop arithmetic.
enum Backend {
    /// Jobs on host streams.
    Host,
    /// Kernels on CUDA streams (linop.cu).
    Cuda,
}

/// The backend for arithmetic on `device`.
fn backend(device: Device) -> Result<Backend> {
    match device {
        Device::Host => Ok(Backend::Host),
        Device::Cuda(_) if crate::cuda::is_built() => Ok(Backend::Cuda),
        Device::Cuda(_) => Err(Error::unsupported(NO_CUDA_KERNELS)),
    }
}

fn view<T: Field>(a: &Array<T>) -> View {
    View { offset: a.offset(), shape: a.shape().to_vec(), strides: a.strides().to_vec() }
}

fn contiguous_view(shape: &[usize]) -> View {
    View { offset: 0, shape: shape.to_vec(), strides: row_major(shape) }
}

/// A zeroed row-major buffer for an output of `shape` on `spec` (whose streams must be on its
/// device: the buffer is allocated on the compute stream's device), from the allocation cache
/// and given back to it after its queued work without blocking the drop (an intermediate of a
/// composite operator).
fn output<T: Field>(spec: &DeviceSpec, shape: &[usize]) -> Result<DeviceBuffer<T>> {
    super::array::check_spec(spec)?;
    DeviceBuffer::zeroed_cached(&spec.compute_stream, super::array::numel(shape)?)
}

/// Like [`output`], not zeroed, for work that writes every element (on CUDA the zeroing is a
/// memset of the whole output: as many bytes written again as the kernel writes).
///
/// # Safety
///
/// 1. Every element is written by work queued on the buffer (ordered by its tracker) before
///    anything reads it.
unsafe fn output_overwritten<T: Field>(spec: &DeviceSpec, shape: &[usize]) -> Result<DeviceBuffer<T>> {
    super::array::check_spec(spec)?;
    // SAFETY: the caller's precondition 1.
    unsafe { DeviceBuffer::uninit_cached(spec.compute_stream.device(), super::array::numel(shape)?) }
}

/// A row-major copy of `x` on its spec.
pub(crate) fn contiguous<T: Field>(x: &Array<T>) -> Result<Array<T>> {
    let spec = x.spec();
    match x.device() {
        Device::Host => {
            // SAFETY: the copy below writes the whole row-major output.
            let mut out = unsafe { output_overwritten::<T>(spec, x.shape())? };
            host::copy_view(&spec.compute_stream, x.buffer(), view(x), &mut out, contiguous_view(x.shape()))?;
            Ok(Array::from_owned(spec, out, x.shape()).produced_from([x], None))
        }
        // The map kernel copies bit-exactly when its factor is 1.
        Device::Cuda(_) => scale(x, T::one()),
    }
}

/// `alpha * x`.
pub(crate) fn scale<T: Field>(x: &Array<T>, alpha: T) -> Result<Array<T>> {
    match backend(x.device())? {
        Backend::Host => {
            let spec = x.spec();
            // SAFETY: the scaling below writes the whole row-major output.
            let mut out = unsafe { output_overwritten::<T>(spec, x.shape())? };
            host::scale_view(
                &spec.compute_stream,
                alpha,
                x.buffer(),
                view(x),
                &mut out,
                contiguous_view(x.shape()),
            )?;
            Ok(Array::from_owned(spec, out, x.shape()).produced_from([x], None))
        }
        Backend::Cuda => {
            let spec = x.spec();
            // SAFETY: the map below (not accumulating) writes the whole row-major output.
            let mut out = unsafe { output_overwritten::<T>(spec, x.shape())? };
            let dst = contiguous_view(x.shape());
            cuda::map(&spec.compute_stream, alpha, x.buffer(), &view(x), &mut out, &dst, false)?;
            Ok(Array::from_owned(spec, out, x.shape()).produced_from([x], None))
        }
    }
}

/// The sum of `terms` (same shapes, same device), on the first term's spec.
pub(crate) fn sum<T: Field>(terms: &[Array<T>]) -> Result<Array<T>> {
    let Some(first) = terms.first() else {
        return Err(Error::invalid("a sum of no arrays"));
    };
    for t in terms {
        if t.shape() != first.shape() || t.device() != first.device() {
            return Err(Error::invalid(format!(
                "cannot add an array of shape {:?} on {} to one of shape {:?} on {}",
                t.shape(),
                t.device(),
                first.shape(),
                first.device()
            )));
        }
    }
    if terms.len() == 1 {
        return Ok(first.clone());
    }
    match backend(first.device())? {
        Backend::Host => {
            let spec = first.spec();
            // SAFETY: the first term is copied over the whole row-major output, the others
            // added to it.
            let mut out = unsafe { output_overwritten::<T>(spec, first.shape())? };
            let dst = contiguous_view(first.shape());
            host::copy_view(&spec.compute_stream, first.buffer(), view(first), &mut out, dst.clone())?;
            for t in &terms[1..] {
                host::add_view(&spec.compute_stream, t.buffer(), view(t), &mut out, dst.clone())?;
            }
            Ok(Array::from_owned(spec, out, first.shape()).produced_from(terms, None))
        }
        Backend::Cuda => {
            let spec = first.spec();
            // SAFETY: the first map (not accumulating) writes the whole row-major output; the
            // others add to it.
            let mut out = unsafe { output_overwritten::<T>(spec, first.shape())? };
            let dst = contiguous_view(first.shape());
            for (k, t) in terms.iter().enumerate() {
                cuda::map(&spec.compute_stream, T::one(), t.buffer(), &view(t), &mut out, &dst, k > 0)?;
            }
            Ok(Array::from_owned(spec, out, first.shape()).produced_from(terms, None))
        }
    }
}

/// The arrays joined along `axis` (same device, equal other axes), on the first one's spec.
pub(crate) fn concat<T: Field>(parts: &[Array<T>], axis: usize) -> Result<Array<T>> {
    let Some(first) = parts.first() else {
        return Err(Error::invalid("a concatenation of no arrays"));
    };
    if axis >= first.ndim() {
        return Err(Error::invalid(format!("concatenation along axis {axis} of {}-d arrays", first.ndim())));
    }
    let mut shape = first.shape().to_vec();
    shape[axis] = 0;
    for p in parts {
        let same_rest = p.ndim() == first.ndim()
            && p.shape().iter().zip(first.shape()).enumerate().all(|(k, (a, b))| k == axis || a == b);
        if !same_rest || p.device() != first.device() {
            return Err(Error::invalid(format!(
                "cannot join an array of shape {:?} on {} with one of shape {:?} on {} along axis {axis}",
                p.shape(),
                p.device(),
                first.shape(),
                first.device()
            )));
        }
        shape[axis] += p.shape()[axis];
    }
    if parts.len() == 1 {
        return Ok(first.clone());
    }
    match backend(first.device())? {
        Backend::Host => {
            let spec = first.spec();
            // SAFETY: the parts, copied side by side along `axis`, cover the whole output.
            let mut out = unsafe { output_overwritten::<T>(spec, &shape)? };
            let strides = row_major(&shape);
            let mut start = 0;
            for p in parts {
                if p.is_empty() {
                    // Nothing to copy, and its offset may not fit: an empty output's strides
                    // (of huge other axes) overflow when multiplied.
                    start += p.shape()[axis];
                    continue;
                }
                let dst = View {
                    offset: start * strides[axis],
                    shape: p.shape().to_vec(),
                    strides: strides.clone(),
                };
                host::copy_view(&spec.compute_stream, p.buffer(), view(p), &mut out, dst)?;
                start += p.shape()[axis];
            }
            Ok(Array::from_owned(spec, out, &shape).produced_from(parts, None))
        }
        Backend::Cuda => {
            let spec = first.spec();
            // SAFETY: the parts, copied side by side along `axis`, cover the whole output.
            let mut out = unsafe { output_overwritten::<T>(spec, &shape)? };
            let strides = row_major(&shape);
            let mut start = 0;
            for p in parts {
                if p.is_empty() {
                    // Nothing to copy, and its offset may not fit: an empty output's strides
                    // (of huge other axes) overflow when multiplied.
                    start += p.shape()[axis];
                    continue;
                }
                let dst = View {
                    offset: start * strides[axis],
                    shape: p.shape().to_vec(),
                    strides: strides.clone(),
                };
                cuda::map(&spec.compute_stream, T::one(), p.buffer(), &view(p), &mut out, &dst, false)?;
                start += p.shape()[axis];
            }
            Ok(Array::from_owned(spec, out, &shape).produced_from(parts, None))
        }
    }
}

/// An einsum `out[odims] = sum over the rest of w'[wdims] * x[xdims]` (`w'` = `w` or its
/// conjugate), on `x`'s spec. Sizes are taken as consistent (checked by the operator).
pub(crate) fn einsum<T: Field>(
    x: &Array<T>,
    xdims: &[String],
    w: &Array<T>,
    wdims: &[String],
    conj: bool,
    odims: &Dims,
) -> Result<Array<T>> {
    if w.device() != x.device() {
        return Err(Error::invalid(format!(
            "the operator's parameters are on {} but its input is on {}; place the operator with place_on",
            w.device(),
            x.device()
        )));
    }
    let backend = backend(x.device())?;
    // Loop order: dims without a weight first, then the weight's dims in its own order, so the
    // innermost loop walks the weight's last (contiguous) axis.
    let mut order: Vec<&str> = Vec::new();
    for n in odims.names().iter().chain(xdims) {
        if !wdims.contains(n) && !order.contains(&n.as_str()) {
            order.push(n);
        }
    }
    order.extend(wdims.iter().map(String::as_str));
    let out_strides_own = row_major(odims.sizes());
    let pick = |names: &[String], shape: &[usize], strides: &[usize], d: &str| {
        names.iter().position(|n| n == d).map(|k| (shape[k], strides[k]))
    };
    let mut c = Contraction {
        shape: Vec::with_capacity(order.len()),
        out_strides: Vec::with_capacity(order.len()),
        x_strides: Vec::with_capacity(order.len()),
        w_strides: Vec::with_capacity(order.len()),
        x_offset: x.offset(),
        w_offset: w.offset(),
        conj,
    };
    for d in &order {
        let o = pick(odims.names(), odims.sizes(), &out_strides_own, d);
        let xi = pick(xdims, x.shape(), x.strides(), d);
        let wi = pick(wdims, w.shape(), w.strides(), d);
        let size = o.or(xi).or(wi).map(|p| p.0).unwrap_or(1);
        c.shape.push(size);
        c.out_strides.push(o.map_or(0, |p| p.1));
        c.x_strides.push(xi.map_or(0, |p| p.1));
        c.w_strides.push(wi.map_or(0, |p| p.1));
    }
    let spec = x.spec();
    let out = match backend {
        Backend::Host => {
            // The host's contraction accumulates into the output.
            let mut out = output::<T>(spec, odims.sizes())?;
            host::contract(&spec.compute_stream, c, x.buffer(), w.buffer(), &mut out)?;
            out
        }
        Backend::Cuda => {
            // SAFETY: the kernel writes every output element once (its sum, zero for an empty
            // reduction).
            let mut out = unsafe { output_overwritten::<T>(spec, odims.sizes())? };
            cuda::contract(&spec.compute_stream, &c, x.buffer(), w.buffer(), &mut out)?;
            out
        }
    };
    Ok(Array::from_owned(spec, out, odims.sizes()).produced_from([x, w], None))
}
