//! The weight array shared by [`Dense`](super::Dense) and [`Diagonal`](super::Diagonal): an
//! array with a name per axis, applied as an einsum.
//!
//! Rules:
//! - Every weight axis names a dim of the operator's input or output, with the same size.
//! - `apply` computes `y[odims] = sum over the other dims of w'[wdims] * x[idims]`, where `w'`
//!   is the weight or (for an adjoint) its conjugate; the adjoint shares the weight buffer.
//! - Splitting along a weight dim takes a view of the weight (no copy); placing copies it.

use std::ops::Range;

use super::array::Array;
use super::compute;
use super::dims::Dims;
use super::field::Field;
use super::op::check_batch_dims;
use super::transfer::transfer;
use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// A named weight array, possibly to be conjugated.
#[derive(Clone, Debug)]
pub(crate) struct Weight<T: Field> {
    pub(crate) array: Array<T>,
    pub(crate) dims: Vec<String>,
    pub(crate) conj: bool,
}

impl<T: Field> Weight<T> {
    /// Checks `array` with axis names `dims` against the operator's dims.
    pub(crate) fn new(
        what: &str,
        array: Array<T>,
        dims: &[&str],
        idims: &Dims,
        odims: &Dims,
    ) -> Result<Self> {
        if array.ndim() != dims.len() {
            return Err(Error::invalid(format!(
                "{what}: a {}-d weight needs {} names, got {dims:?}",
                array.ndim(),
                array.ndim()
            )));
        }
        for (k, d) in dims.iter().enumerate() {
            if dims[..k].contains(d) {
                return Err(Error::invalid(format!("{what}: weight dim {d:?} appears twice")));
            }
            let size = idims.size_of(d).or_else(|| odims.size_of(d)).ok_or_else(|| {
                Error::invalid(format!("{what}: weight dim {d:?} is in neither {idims} nor {odims}"))
            })?;
            if size != array.shape()[k] {
                return Err(Error::invalid(format!(
                    "{what}: weight dim {d:?} has size {} but the operator's has {size}",
                    array.shape()[k]
                )));
            }
        }
        check_batch_dims(what, idims, odims)?;
        Ok(Weight { array, dims: dims.iter().map(|d| d.to_string()).collect(), conj: false })
    }

    /// The einsum from `x` (dims `idims`) to `odims`.
    pub(crate) fn apply(&self, x: &Array<T>, idims: &Dims, odims: &Dims) -> Result<Array<T>> {
        compute::einsum(x, idims.names(), &self.array, &self.dims, self.conj, odims)
    }

    /// The conjugated weight (same buffer).
    pub(crate) fn conjugated(&self) -> Self {
        Weight { array: self.array.clone(), dims: self.dims.clone(), conj: !self.conj }
    }

    /// The weight restricted along `dim` (a view; unchanged when it lacks `dim`).
    pub(crate) fn split(&self, dim: &str, range: &Range<usize>) -> Result<Self> {
        match self.dims.iter().position(|d| d == dim) {
            Some(axis) => Ok(Weight {
                array: self.array.slice(axis, range.clone())?,
                dims: self.dims.clone(),
                conj: self.conj,
            }),
            None => Ok(self.clone()),
        }
    }

    /// The weight copied to `spec`.
    pub(crate) fn place_on(&self, spec: &DeviceSpec) -> Result<Self> {
        let array = transfer(&self.array, spec)?;
        Ok(Weight { array, dims: self.dims.clone(), conj: self.conj })
    }
}
