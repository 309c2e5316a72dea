//! [`Diagonal`]: elementwise weights over some named dims, broadcast over the others.
//!
//! Rules:
//! - Input and output dims are the same; the weight's axes name a subset of them (any order)
//!   and it is broadcast along the rest: `y[i] = w[i restricted to the weight dims] * x[i]`.
//! - The adjoint conjugates the weight (same buffer); the normal is `A^H A`.
//! - A split restricts the dim and slices the weight along it when the weight has it.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{Array, Diagonal, Dims, Linop};
//! use cuferry::{Device, DeviceSpec};
//!
//! let spec = DeviceSpec::new(Device::Host)?;
//! let w = Array::from_slice(&spec, &[2], &[10.0f64, 100.0])?;
//! let d = Diagonal::new(w, &["y"], Dims::new(&[("x", 2), ("y", 2)])?)?;
//! let x = Array::from_slice(&spec, &[2, 2], &[1.0, 2.0, 3.0, 4.0])?;
//! assert_eq!(d.apply(&x)?.to_vec()?, vec![10.0, 200.0, 30.0, 400.0]);
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
use crate::error::{Error, Result};

/// An elementwise (diagonal) operator. See the [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct Diagonal<T: Field> {
    weight: Weight<T>,
    dims: Dims,
}

impl<T: Field> Diagonal<T> {
    /// `x -> weight * x` on `dims`, the weight's axes named by `weight_dims` (a subset of
    /// `dims`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a weight dim is not in `dims`, a size disagrees or a
    /// name repeats.
    pub fn new(weight: Array<T>, weight_dims: &[&str], dims: Dims) -> Result<Self> {
        if let Some(d) = weight_dims.iter().find(|d| !dims.contains(d)) {
            return Err(Error::invalid(format!("Diagonal: weight dim {d:?} is not in {dims}")));
        }
        let weight = Weight::new("Diagonal", weight, weight_dims, &dims, &dims)?;
        Ok(Diagonal { weight, dims })
    }

    /// The weight array (shared, possibly a view).
    pub fn weight(&self) -> &Array<T> {
        &self.weight.array
    }
}

impl<T: Field> Linop<T> for Diagonal<T> {
    fn name(&self) -> &'static str {
        "Diagonal"
    }
    fn idims(&self) -> &Dims {
        &self.dims
    }
    fn odims(&self) -> &Dims {
        &self.dims
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        self.weight.apply(x, &self.dims, &self.dims)
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Diagonal { weight: self.weight.conjugated(), dims: self.dims.clone() })
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split(self, dim, &range)?;
        Ok(Arc::new(Diagonal {
            weight: self.weight.split(dim, &range)?,
            dims: restrict(&self.dims, dim, &range),
        }))
    }
    fn place_on(&self, spec: &DeviceSpec) -> Result<LinopRef<T>> {
        Ok(Arc::new(Diagonal { weight: self.weight.place_on(spec)?, dims: self.dims.clone() }))
    }
}
