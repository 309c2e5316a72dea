//! `Array<T>`: an n-d view of a device buffer, placed on a [`DeviceSpec`].
//!
//! Rules:
//! - An array is immutable once made: operators write fresh buffers and never change their
//!   input. `Clone` and [`Array::slice`] / [`Array::permute`] share the buffer (no copy).
//! - Layout: an element offset, a shape and element strides (row-major by default). Views
//!   may be non-contiguous; [`Array::contiguous`] makes a row-major copy.
//! - Placement: an array remembers the [`DeviceSpec`] it lives on. Operators compute on the
//!   device of their input, on that spec's compute stream, and return an array with the same
//!   spec; only [`ToDevice`](super::ToDevice) changes it. Several specs may name the same
//!   device (e.g. several "host devices", each with its own streams). A spec whose streams
//!   are on another device than its `device` (its fields are public) is rejected wherever
//!   linop uses it: memory would be allocated on the stream's device but labelled with the
//!   spec's.
//! - Everything is queued asynchronously; only [`Array::from_slice`] (until the data has been
//!   read) and [`Array::to_vec`] block. Dropping an array does not wait: memory linop
//!   allocated (arrays from [`Array::from_slice`], [`Array::zeros`] and operators, transfer
//!   staging) comes from the allocation cache and goes back to it once the work queued on it
//!   has finished: at the drop when that work is done, otherwise from a background thread.
//!   Only when 1024 such releases (or 4 GiB) are already pending does a drop wait for its own
//!   work, so the host never runs unboundedly ahead. A buffer passed to [`Array::from_buffer`] keeps
//!   its own drop rule (waits). Ordering between operations on a buffer comes from the
//!   buffer's use tracking (see [`crate::memory`]), so any stream may consume an array.
//! - Errors of queued work (a kernel job that panicked) are kept by the stream it ran on;
//!   [`Array::to_vec`] and [`Array::synchronize`] report a pending one, as
//!   [`Stream::query`](crate::Stream::query) would, of the array's compute stream and of every
//!   other stream its data came through: an array remembers the streams upstream of it (the
//!   compute and transfer streams of other specs its inputs were made on, carried through
//!   every operator, a [`ToDevice`](super::ToDevice) and [`Array::with_spec`]; operators
//!   written outside cuferry use [`Array::computed_from`]). A tile's job that failed on another
//!   device's stream is therefore reported by the batched result. The error belongs to the
//!   stream, not to one array: it is reported once, to the first reader of any array
//!   downstream of that stream, so of two results sharing a stream either may report it.
//! - Arrays remember upstream streams by handles that keep no stream alive (no worker
//!   thread, no CUDA stream); a stream that is gone still reports a host job's error kept
//!   before it went, and handles with nothing left to report are dropped as arrays are
//!   computed from each other, so the list stays as short as the streams still of use.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::Array;
//! use cuferry::{Device, DeviceSpec};
//!
//! let spec = DeviceSpec::new(Device::Host)?;
//! let a = Array::from_slice(&spec, &[2, 3], &[0.0f64, 1.0, 2.0, 3.0, 4.0, 5.0])?;
//! assert_eq!(a.slice(1, 1..3)?.to_vec()?, vec![1.0, 2.0, 4.0, 5.0]);
//! assert_eq!(a.permute(&[1, 0])?.to_vec()?, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::compute;
use super::field::Field;
use super::layout::{extent, row_major};
use crate::copy::copy_range;
use crate::device::{Device, DeviceSpec};
use crate::error::{Error, Result};
use crate::memory::pageable::PageableSlice;
use crate::memory::DeviceBuffer;
use crate::stream::{Stream, StreamErrors};

/// An n-d array on a device: a shared buffer plus offset, shape and strides.
#[derive(Clone)]
pub struct Array<T: Field> {
    /// The memory; shared by views.
    buf: Arc<DeviceBuffer<T>>,
    /// Element offset of index (0, ..., 0).
    offset: usize,
    /// Size of each axis.
    shape: Vec<usize>,
    /// Element stride of each axis.
    strides: Vec<usize>,
    /// Where the array lives and which stream computes on it.
    spec: DeviceSpec,
    /// Streams other than the compute stream whose work produced the data, by handles that
    /// keep no stream alive (sorted by id, no duplicates, none spent when made).
    upstream: Option<Arc<[StreamErrors]>>,
}

impl<T: Field> fmt::Debug for Array<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Array")
            .field("type", &T::NAME)
            .field("device", &self.spec.device)
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("offset", &self.offset)
            .finish()
    }
}

impl<T: Field> Array<T> {
    /// A row-major array with a copy of `data` on `spec`'s device (copied through its compute
    /// stream; returns once `data` has been read).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `data.len()` is not the product of `shape` or `spec`'s
    /// streams are on another device than `spec.device`; errors of
    /// [`DeviceBuffer::from_slice`].
    pub fn from_slice(spec: &DeviceSpec, shape: &[usize], data: &[T]) -> Result<Self> {
        check_spec(spec)?;
        let n = numel(shape)?;
        if n != data.len() {
            return Err(Error::invalid(format!("shape {shape:?} needs {n} elements, got {}", data.len())));
        }
        let buf = DeviceBuffer::from_slice_cached(&spec.compute_stream, data)?;
        Ok(Self::from_parts(spec.clone(), Arc::new(buf), 0, shape.to_vec(), row_major(shape)))
    }

    /// A row-major array of zeros on `spec`'s device.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the shape's product overflows or `spec`'s streams are
    /// on another device than `spec.device`; errors of [`DeviceBuffer::zeroed`].
    pub fn zeros(spec: &DeviceSpec, shape: &[usize]) -> Result<Self> {
        check_spec(spec)?;
        let buf = DeviceBuffer::zeroed_cached(&spec.compute_stream, numel(shape)?)?;
        Ok(Self::from_parts(spec.clone(), Arc::new(buf), 0, shape.to_vec(), row_major(shape)))
    }

    /// An array over an existing buffer with the given layout.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the buffer is on another device than `spec`, `spec`'s
    /// streams are on another device than `spec.device`, the shape and strides differ in
    /// length, or the view reaches past the buffer.
    pub fn from_buffer(
        spec: &DeviceSpec,
        buf: Arc<DeviceBuffer<T>>,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Self> {
        check_spec(spec)?;
        if buf.device() != spec.device {
            return Err(Error::invalid(format!(
                "a buffer on {} cannot be an array on {}",
                buf.device(),
                spec.device
            )));
        }
        if shape.len() != strides.len() {
            return Err(Error::invalid(format!("shape {shape:?} and strides {strides:?} differ in length")));
        }
        let fits = numel(shape)? == 0 || extent(offset, shape, strides).is_some_and(|end| end <= buf.len());
        if !fits {
            return Err(Error::invalid(format!(
                "a view at offset {offset} with shape {shape:?} and strides {strides:?} reaches past a buffer of {} elements",
                buf.len()
            )));
        }
        Ok(Self::from_parts(spec.clone(), buf, offset, shape.to_vec(), strides.to_vec()))
    }

    pub(crate) fn from_parts(
        spec: DeviceSpec,
        buf: Arc<DeviceBuffer<T>>,
        offset: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
    ) -> Self {
        Array { buf, offset, shape, strides, spec, upstream: None }
    }

    /// A row-major array over a whole fresh buffer.
    pub(crate) fn from_owned(spec: &DeviceSpec, buf: DeviceBuffer<T>, shape: &[usize]) -> Self {
        Self::from_parts(spec.clone(), Arc::new(buf), 0, shape.to_vec(), row_major(shape))
    }

    /// `self`, made by work that read `inputs` (and ran on `extra`, a transfer stream): the
    /// streams upstream of the inputs, and the inputs' compute streams, become upstream of
    /// `self`, so their pending errors are reported by [`Array::to_vec`].
    pub(crate) fn produced_from<'a>(
        mut self,
        inputs: impl IntoIterator<Item = &'a Array<T>>,
        extra: Option<&Stream>,
    ) -> Self {
        let mut streams: Vec<StreamErrors> = self.upstream.as_deref().map(<[_]>::to_vec).unwrap_or_default();
        for x in inputs {
            streams.push(x.spec.compute_stream.errors());
            streams.extend(x.upstream.iter().flat_map(|u| u.iter()).cloned());
        }
        streams.extend(extra.map(Stream::errors));
        // Spent handles (streams gone, nothing left to report) are dropped, so a long chain of
        // operators built on ever new specs keeps only the streams still of use.
        let own = self.spec.compute_stream.id();
        streams.retain(|s| s.id() != own && !s.is_spent());
        streams.sort_unstable_by_key(StreamErrors::id);
        streams.dedup_by_key(|s| s.id());
        self.upstream = (!streams.is_empty()).then(|| streams.into());
        self
    }

    /// `self`, marked as computed from `inputs`: for operators written outside cuferry, which
    /// build their output with [`Array::from_buffer`]. The inputs' compute streams and the
    /// streams upstream of them become upstream of `self`, so [`Array::to_vec`] of the output
    /// (and of whatever is computed from it) reports an error pending there, a failed tile job
    /// of an earlier batched operator included. Without it that error stays on its stream.
    ///
    /// ```
    /// use cuferry::linop::Array;
    /// use cuferry::{Device, DeviceSpec};
    ///
    /// let (a, b) = (DeviceSpec::new(Device::Host)?, DeviceSpec::new(Device::Host)?);
    /// let x = Array::from_slice(&a, &[2], &[1.0f64, 2.0])?;
    /// // A user's operator that computes on `b` from `x`:
    /// let y = Array::<f64>::zeros(&b, &[2])?.computed_from(&[&x]);
    /// assert_eq!(y.to_vec()?, [0.0, 0.0]);
    /// # Ok::<(), cuferry::Error>(())
    /// ```
    #[must_use]
    pub fn computed_from(self, inputs: &[&Array<T>]) -> Self {
        self.produced_from(inputs.iter().copied(), None)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element strides.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The element offset of the first element in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of axes.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        // Checked when the array was made, and a view never grows: no overflow here.
        numel(&self.shape).unwrap_or(usize::MAX)
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the array lives on.
    pub fn device(&self) -> Device {
        self.spec.device
    }

    /// The spec (device and streams) the array lives on.
    pub fn spec(&self) -> &DeviceSpec {
        &self.spec
    }

    /// The underlying buffer (shared by views).
    pub fn buffer(&self) -> &Arc<DeviceBuffer<T>> {
        &self.buf
    }

    /// Whether the view is row-major contiguous (axes of size 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        // Saturating as `row_major` is: the product only overflows past an axis of size 0
        // (the array is empty), where it is compared with row-major strides made the same way.
        let mut expected = 1usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(n);
        }
        true
    }

    /// The same data labelled with another spec of the same device (no copy): later work on
    /// it is queued on `spec`'s compute stream.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `spec` names another device, or its streams are on
    /// another device than `spec.device`.
    pub fn with_spec(&self, spec: &DeviceSpec) -> Result<Self> {
        check_spec(spec)?;
        if spec.device != self.spec.device {
            return Err(Error::invalid(format!(
                "with_spec keeps the device: the array is on {}, the spec on {}",
                self.spec.device, spec.device
            )));
        }
        let mut out = self.clone();
        out.spec = spec.clone();
        Ok(out.produced_from([self], None))
    }

    /// A view of `range` along `axis` (no copy).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an axis or range out of bounds.
    pub fn slice(&self, axis: usize, range: Range<usize>) -> Result<Self> {
        let Some(&n) = self.shape.get(axis) else {
            return Err(Error::invalid(format!("axis {axis} of a {}-d array", self.ndim())));
        };
        if range.start > range.end {
            return Err(Error::invalid(format!(
                "range {range:?} along axis {axis} is reversed (start after end)"
            )));
        }
        if range.end > n {
            return Err(Error::invalid(format!(
                "range {range:?} along axis {axis} reaches past its size {n}"
            )));
        }
        let mut out = self.clone();
        out.shape[axis] = range.end - range.start;
        // An empty view keeps its offset: it is never read, and an empty array's strides are
        // not bounds-checked (`from_buffer`), so moving it could overflow.
        if numel(&out.shape)? > 0 {
            // In bounds: a non-empty view of a checked array.
            out.offset += range.start * self.strides[axis];
        }
        Ok(out)
    }

    /// A view with the axes reordered: axis `k` of the result is axis `axes[k]` of `self`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `axes` is not a permutation of `0..ndim`.
    pub fn permute(&self, axes: &[usize]) -> Result<Self> {
        let mut seen = vec![false; self.ndim()];
        for &a in axes {
            match seen.get_mut(a) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(Error::invalid(format!(
                        "{axes:?} is not a permutation of {} axes",
                        self.ndim()
                    )))
                }
            }
        }
        if axes.len() != self.ndim() {
            return Err(Error::invalid(format!("{axes:?} is not a permutation of {} axes", self.ndim())));
        }
        let mut out = self.clone();
        out.shape = axes.iter().map(|&a| self.shape[a]).collect();
        out.strides = axes.iter().map(|&a| self.strides[a]).collect();
        Ok(out)
    }

    /// A row-major copy (or `self` when already contiguous), queued on the compute stream.
    ///
    /// # Errors
    ///
    /// Errors of the copy.
    pub fn contiguous(&self) -> Result<Self> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        compute::contiguous(self)
    }

    /// The elements in row-major order, read back through the compute stream; blocks until
    /// they are here.
    ///
    /// # Errors
    ///
    /// Errors of the copies; [`Error::InvalidArgument`] when called from a job of the compute
    /// stream (a host stream; the copy would wait for itself); a pending error of queued work
    /// on the compute stream or a stream upstream of the array (a kernel job that panicked,
    /// [`Error::HostFnPanicked`]), reported once, as [`Stream::query`](crate::Stream::query)
    /// does.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let a = self.contiguous()?;
        let n = a.len();
        let mut out = vec![T::zero(); n];
        if n > 0 {
            let mut dst = PageableSlice::new_mut(&a.spec.compute_stream, &mut out)?;
            copy_range(&a.spec.compute_stream, &*a.buf, a.offset, &mut dst, 0, n)?;
            dst.wait()?;
        }
        a.pending_error()?;
        Ok(out)
    }

    /// Blocks until every operation queued on the array's buffer has finished.
    ///
    /// # Errors
    ///
    /// As [`DeviceBuffer::synchronize`]; then a pending error of queued work on the compute
    /// stream or a stream upstream, as for [`Array::to_vec`].
    pub fn synchronize(&self) -> Result<()> {
        self.buf.synchronize()?;
        self.pending_error()
    }

    /// A pending error of work queued on the compute stream or a stream upstream (taken:
    /// reported once; the first found, the others stay pending). Call it after waiting for
    /// the array's data.
    fn pending_error(&self) -> Result<()> {
        self.spec.compute_stream.query()?;
        for s in self.upstream.iter().flat_map(|u| u.iter()) {
            s.take()?;
        }
        Ok(())
    }
}

/// Checks that `spec`'s streams run on `spec.device`: linop allocates an array's memory on
/// its compute stream's device and labels it with `spec.device`, and launches kernels by the
/// label, so a mismatch would hand one device's memory to another's kernels.
pub(crate) fn check_spec(spec: &DeviceSpec) -> Result<()> {
    let streams = std::iter::once(("compute", &spec.compute_stream))
        .chain(spec.transfer_stream.as_ref().map(|s| ("transfer", s)));
    for (what, s) in streams {
        if s.device() != spec.device {
            return Err(Error::invalid(format!(
                "a DeviceSpec for {} has its {what} stream on {}; build specs with DeviceSpec::new or \
                 DeviceSpec::with_streams",
                spec.device,
                s.device()
            )));
        }
    }
    Ok(())
}

/// The product of `shape`, or an error on overflow (0 for a shape with an axis of 0, whatever
/// the order of the axes).
pub(crate) fn numel(shape: &[usize]) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .ok_or_else(|| Error::invalid(format!("shape {shape:?} overflows")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slicing an empty view with huge strides (accepted: an empty view is never read) keeps
    /// its offset instead of overflowing it; a non-empty slice moves it by the stride.
    #[test]
    fn slicing_an_empty_view_keeps_its_offset() {
        let spec = DeviceSpec::new(Device::Host).unwrap();
        let buf = Arc::new(DeviceBuffer::<f64>::zeroed(&spec.compute_stream, 8).unwrap());
        let empty = Array::from_buffer(&spec, Arc::clone(&buf), 3, &[0, 4], &[0, usize::MAX]).unwrap();
        let sliced = empty.slice(1, 2..4).unwrap();
        assert_eq!((sliced.offset(), sliced.shape()), (3, &[0, 2][..]));
        assert!(sliced.to_vec().unwrap().is_empty());
        let full = Array::from_buffer(&spec, buf, 1, &[2, 3], &[3, 1]).unwrap();
        let cols = full.slice(1, 1..3).unwrap();
        assert_eq!((cols.offset(), cols.shape()), (2, &[2, 2][..]));
        assert_eq!(full.slice(1, 3..3).unwrap().offset(), 1, "an empty slice moved the offset");
    }

    /// A kernel job that panics on a host stream: its output is never written, and reading the
    /// array back must say so instead of returning the zeroed buffer.
    fn panicked_array(spec: &DeviceSpec) -> Array<f64> {
        let mut out = DeviceBuffer::<f64>::zeroed(&spec.compute_stream, 4).unwrap();
        compute::host::launch(&spec.compute_stream, &[], &mut out, |_, _| panic!("a kernel bug")).unwrap();
        Array::from_owned(spec, out, &[4])
    }

    #[test]
    fn to_vec_reports_a_kernel_job_that_panicked() {
        let spec = DeviceSpec::new(Device::Host).unwrap();
        let r = panicked_array(&spec).to_vec();
        assert!(
            matches!(&r, Err(Error::HostFnPanicked { message }) if message.contains("a kernel bug")),
            "{r:?}"
        );
        // Reported once: the stream is clean afterwards.
        assert_eq!(Array::from_slice(&spec, &[2], &[1.0, 2.0]).unwrap().to_vec().unwrap(), [1.0, 2.0]);
    }

    /// A chain of operators over ever new specs (each dropped after its step) keeps only the
    /// streams still of use upstream: the list used to grow by one per step, each entry
    /// keeping a stream (a host worker thread, a CUDA stream) alive.
    #[test]
    fn upstream_keeps_only_streams_still_of_use() {
        let first = DeviceSpec::new(Device::Host).unwrap();
        let mut x = Array::from_slice(&first, &[4], &[1.0f64, 2.0, 3.0, 4.0]).unwrap();
        for _ in 0..200 {
            let spec = DeviceSpec::new(Device::Host).unwrap();
            let mut out = DeviceBuffer::<f64>::zeroed(&spec.compute_stream, 4).unwrap();
            let input = x.with_spec(&spec).unwrap();
            compute::host::launch(&spec.compute_stream, &[&**input.buffer()], &mut out, |ins, out| {
                out.iter_mut().zip(ins[0]).for_each(|(o, i)| *o = i + 1.0);
            })
            .unwrap();
            x = Array::from_owned(&spec, out, &[4]).produced_from([&input], None);
        }
        x.synchronize().unwrap();
        let kept = x.upstream.as_deref().map_or(0, <[_]>::len);
        assert!(kept <= 4, "{kept} streams upstream after 200 steps");
        assert_eq!(x.to_vec().unwrap(), [201.0, 202.0, 203.0, 204.0]);
    }

    /// A host job's error on a stream whose spec is gone is still reported downstream.
    #[test]
    fn an_error_outlives_the_spec_it_happened_on() {
        let tile = DeviceSpec::new(Device::Host).unwrap();
        let failed = panicked_array(&tile);
        let base = DeviceSpec::new(Device::Host).unwrap();
        let y = Array::<f64>::zeros(&base, &[4]).unwrap().computed_from(&[&failed]);
        failed.buffer().synchronize().unwrap();
        drop((failed, tile));
        let r = y.to_vec();
        assert!(
            matches!(&r, Err(Error::HostFnPanicked { message }) if message.contains("a kernel bug")),
            "{r:?}"
        );
        assert_eq!(y.to_vec().unwrap(), [0.0; 4], "reported twice");
    }

    #[test]
    fn synchronize_reports_a_kernel_job_that_panicked() {
        let spec = DeviceSpec::new(Device::Host).unwrap();
        let r = panicked_array(&spec).synchronize();
        assert!(matches!(&r, Err(Error::HostFnPanicked { .. })), "{r:?}");
        spec.compute_stream.synchronize().unwrap();
    }
}
