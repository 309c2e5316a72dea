//! [`Dense`]: a weight array mapping named input dims to named output dims (an einsum).
//!
//! Rules:
//! - `y[odims] = sum over the dims not in odims of W[wdims] * x[idims]`. Dims in both idims
//!   and odims are batch dims (the weight may vary along them or not); dims only in idims are
//!   contracted; dims only in odims are produced. Every weight dim is an input or output dim.
//! - The adjoint swaps input and output and conjugates the weight (sharing the buffer).
//! - A split restricts the dim where it appears (input, output, both) and slices the weight
//!   along it when the weight has it (a view).
//!
//! # Examples
//!
//! A 2x3 matrix applied to a batch of 2 vectors:
//!
//! ```
//! use cuferry::linop::{Array, Dense, Dims, Linop};
//! use cuferry::{Device, DeviceSpec};
//!
//! let spec = DeviceSpec::new(Device::Host)?;
//! let w = Array::from_slice(&spec, &[2, 3], &[1.0f64, 0.0, 2.0, 0.0, 1.0, 0.0])?;
//! let a = Dense::new(w, &["o", "i"], Dims::new(&[("b", 2), ("i", 3)])?, Dims::new(&[("b", 2), ("o", 2)])?)?;
//! let x = Array::from_slice(&spec, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! assert_eq!(a.apply(&x)?.to_vec()?, vec![7.0, 2.0, 16.0, 5.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::ops::Range;
use std::sync::Arc;

use super::array::Array;
use super::dims::Dims;
use super::field::Field;
use super::op::{check_input, check_split, restrict, Linop, LinopRef};
use super::weight::Weight;
use crate::device::DeviceSpec;
use crate::error::Result;

/// A dense operator given by a named weight array. See the [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct Dense<T: Field> {
    weight: Weight<T>,
    idims: Dims,
    odims: Dims,
}

impl<T: Field> Dense<T> {
    /// The operator `x -> einsum(weight[weight_dims], x[idims]) -> y[odims]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a weight dim is missing
    /// from both idims and odims, a size disagrees, a name repeats, or a dim in both idims and
    /// odims has two sizes.
    pub fn new(weight: Array<T>, weight_dims: &[&str], idims: Dims, odims: Dims) -> Result<Self> {
        let weight = Weight::new("Dense", weight, weight_dims, &idims, &odims)?;
        Ok(Dense { weight, idims, odims })
    }

    /// The weight array (shared, possibly a view).
    pub fn weight(&self) -> &Array<T> {
        &self.weight.array
    }
}

impl<T: Field> Linop<T> for Dense<T> {
    fn name(&self) -> &'static str {
        "Dense"
    }
    fn idims(&self) -> &Dims {
        &self.idims
    }
    fn odims(&self) -> &Dims {
        &self.odims
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        self.weight.apply(x, &self.idims, &self.odims)
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Dense {
            weight: self.weight.conjugated(),
            idims: self.odims.clone(),
            odims: self.idims.clone(),
        })
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split(self, dim, &range)?;
        Ok(Arc::new(Dense {
            weight: self.weight.split(dim, &range)?,
            idims: restrict(&self.idims, dim, &range),
            odims: restrict(&self.odims, dim, &range),
        }))
    }
    fn place_on(&self, spec: &DeviceSpec) -> Result<LinopRef<T>> {
        Ok(Arc::new(Dense {
            weight: self.weight.place_on(spec)?,
            idims: self.idims.clone(),
            odims: self.odims.clone(),
        }))
    }
}
