//! The parameter-free operators: [`Identity`], [`Scalar`] (`alpha * I`) and [`Zero`].
//!
//! Rules:
//! - `Identity` and `Scalar` map dims to the same dims (every dim is a batch dim), so a split
//!   restricts input and output alike. `Zero` maps any dims to any dims, except that a name
//!   on both sides is a batch dim and has one size.
//! - `Identity` returns its input (the array is immutable, so no copy is made) and works on
//!   every device; `Scalar` is arithmetic and needs a kernel for the input's device.
//! - Adjoints: `I^H = I`, `(alpha I)^H = conj(alpha) I`; normals: `I`, `|alpha|^2 I`.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{Array, Dims, Linop, Scalar};
//! use cuferry::{Device, DeviceSpec};
//!
//! let spec = DeviceSpec::new(Device::Host)?;
//! let op = Scalar::new(2.0f64, Dims::new(&[("x", 3)])?);
//! let x = Array::from_slice(&spec, &[3], &[1.0, 2.0, 3.0])?;
//! assert_eq!(op.apply(&x)?.to_vec()?, vec![2.0, 4.0, 6.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::ops::Range;
use std::sync::Arc;

use super::array::Array;
use super::compute;
use super::dims::Dims;
use super::field::Field;
use super::op::{check_batch_dims, check_input, check_split, restrict, Linop, LinopRef};
use crate::device::DeviceSpec;
use crate::error::Result;

/// The identity on `dims`.
#[derive(Clone, Debug)]
pub struct Identity {
    dims: Dims,
}

impl Identity {
    /// The identity on `dims`.
    pub fn new(dims: Dims) -> Self {
        Identity { dims }
    }
}

impl<T: Field> Linop<T> for Identity {
    fn name(&self) -> &'static str {
        "Identity"
    }
    fn idims(&self) -> &Dims {
        &self.dims
    }
    fn odims(&self) -> &Dims {
        &self.dims
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        Ok(x.clone())
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(self.clone())
    }
    fn normal(&self) -> LinopRef<T> {
        Arc::new(self.clone())
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split::<T>(self, dim, &range)?;
        Ok(Arc::new(Identity { dims: restrict(&self.dims, dim, &range) }))
    }
    fn place_on(&self, _spec: &DeviceSpec) -> Result<LinopRef<T>> {
        Ok(Arc::new(self.clone()))
    }
}

/// `alpha` times the identity on `dims`.
#[derive(Clone, Debug)]
pub struct Scalar<T: Field> {
    alpha: T,
    dims: Dims,
}

impl<T: Field> Scalar<T> {
    /// `alpha * I` on `dims`.
    pub fn new(alpha: T, dims: Dims) -> Self {
        Scalar { alpha, dims }
    }

    /// The factor.
    pub fn alpha(&self) -> T {
        self.alpha
    }
}

impl<T: Field> Linop<T> for Scalar<T> {
    fn name(&self) -> &'static str {
        "Scalar"
    }
    fn idims(&self) -> &Dims {
        &self.dims
    }
    fn odims(&self) -> &Dims {
        &self.dims
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        compute::scale(x, self.alpha)
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Scalar { alpha: self.alpha.conj(), dims: self.dims.clone() })
    }
    fn normal(&self) -> LinopRef<T> {
        Arc::new(Scalar { alpha: T::from_f64(self.alpha.norm_sqr()), dims: self.dims.clone() })
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split(self, dim, &range)?;
        Ok(Arc::new(Scalar { alpha: self.alpha, dims: restrict(&self.dims, dim, &range) }))
    }
    fn place_on(&self, _spec: &DeviceSpec) -> Result<LinopRef<T>> {
        Ok(Arc::new(self.clone()))
    }
}

/// The zero operator from `idims` to `odims`. Splitting a sum along a dim internal to some
/// terms only keeps the other terms in the first tile and puts this in the others.
#[derive(Clone, Debug)]
pub struct Zero {
    idims: Dims,
    odims: Dims,
}

impl Zero {
    /// The zero map from `idims` to `odims`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a dim in both `idims`
    /// and `odims` (a batch dim) has two sizes.
    pub fn new(idims: Dims, odims: Dims) -> Result<Self> {
        check_batch_dims("Zero", &idims, &odims)?;
        Ok(Zero { idims, odims })
    }

    /// The zero map with the dims of `op` (consistent already).
    fn like<T: Field>(op: &LinopRef<T>) -> Self {
        Zero { idims: op.idims().clone(), odims: op.odims().clone() }
    }
}

impl<T: Field> Linop<T> for Zero {
    fn name(&self) -> &'static str {
        "Zero"
    }
    fn idims(&self) -> &Dims {
        &self.idims
    }
    fn odims(&self) -> &Dims {
        &self.odims
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        Ok(Array::zeros(x.spec(), self.odims.sizes())?.produced_from([x], None))
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Zero { idims: self.odims.clone(), odims: self.idims.clone() })
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split::<T>(self, dim, &range)?;
        Ok(Arc::new(Zero {
            idims: restrict(&self.idims, dim, &range),
            odims: restrict(&self.odims, dim, &range),
        }))
    }
    fn place_on(&self, _spec: &DeviceSpec) -> Result<LinopRef<T>> {
        Ok(Arc::new(self.clone()))
    }
}

/// `op` restricted along a dim it does not know, inside a sum over tiles along an internal
/// dim: the whole `op` in the tile starting at 0, zero in the others (so it counts once).
/// (Used for a part lacking the dim; see [`split_internal`] for a part that has it.)
fn once_in_first_tile<T: Field>(op: &LinopRef<T>, range: &Range<usize>) -> LinopRef<T> {
    if range.start == 0 {
        Arc::clone(op)
    } else {
        Arc::new(Zero::like(op))
    }
}

/// A part of a sum (an `Add` term, a `Concat` block) restricted to `range` of an internal dim
/// `dim`, where parts may know the dim with different sizes (the sum's size is the largest):
/// the range is clipped to the part's extent, a part without the dim counts once.
pub(crate) fn split_internal<T: Field>(
    op: &LinopRef<T>,
    dim: &str,
    range: &Range<usize>,
) -> Result<LinopRef<T>> {
    match op.dim_size(dim) {
        None => Ok(once_in_first_tile(op, range)),
        // Past the part's extent it is zero, except in the tile starting at 0: a part of size
        // 0 has no extent, yet its own parts lacking the dim must still count once (split to
        // `0..0` in that tile only, not in every tile).
        Some(n) if range.start > 0 && range.start >= n => Ok(Arc::new(Zero::like(op))),
        Some(n) => op.split(dim, range.start.min(n)..range.end.min(n)),
    }
}
