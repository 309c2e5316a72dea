//! [`Add`]: the sum of operators with the same input and output dims.
//!
//! Rules:
//! - Every term has the same input dims and the same output dims (names and sizes);
//!   otherwise it is an error. The terms' outputs are summed on the input's spec.
//! - The adjoint is the sum of the adjoints.
//! - A split along an input or output dim splits every term. Along an internal dim, the terms
//!   that know it are split (terms may know it with different sizes: the range is clipped to
//!   each term's); a term without it stays whole in the tile starting at 0 and is
//!   [`Zero`](super::Zero) in the others, so summing the tiles counts it once.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{Add, Array, Dims, Identity, Linop, LinopRef, Scalar};
//! use cuferry::{Device, DeviceSpec};
//! use std::sync::Arc;
//!
//! let d = Dims::new(&[("x", 2)])?;
//! let a: LinopRef<f64> = Arc::new(Identity::new(d.clone()));
//! let b: LinopRef<f64> = Arc::new(Scalar::new(0.5, d));
//! let s = Add::new(vec![a, b])?;
//! let spec = DeviceSpec::new(Device::Host)?;
//! let x = Array::from_slice(&spec, &[2], &[2.0, 4.0])?;
//! assert_eq!(s.apply(&x)?.to_vec()?, vec![3.0, 6.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::ops::Range;
use std::sync::Arc;

use super::array::Array;
use super::compute;
use super::dims::Dims;
use super::field::Field;
use super::identity::split_internal;
use super::op::{check_input, check_split, Linop, LinopRef};
use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// The sum of operators. See the [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct Add<T: Field> {
    terms: Vec<LinopRef<T>>,
}

impl<T: Field> Add<T> {
    /// `sum_k terms[k]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no terms or terms with different dims.
    pub fn new(terms: Vec<LinopRef<T>>) -> Result<Self> {
        let Some(first) = terms.first() else {
            return Err(Error::invalid("an Add of no operators"));
        };
        for (k, t) in terms.iter().enumerate() {
            if t.idims() != first.idims() || t.odims() != first.odims() {
                return Err(Error::invalid(format!(
                    "Add: term {k} ({}) maps {} -> {} but term 0 ({}) maps {} -> {}",
                    t.name(),
                    t.idims(),
                    t.odims(),
                    first.name(),
                    first.idims(),
                    first.odims()
                )));
            }
        }
        Ok(Add { terms })
    }

    /// The terms.
    pub fn terms(&self) -> &[LinopRef<T>] {
        &self.terms
    }
}

impl<T: Field> Linop<T> for Add<T> {
    fn name(&self) -> &'static str {
        "Add"
    }
    fn idims(&self) -> &Dims {
        self.terms[0].idims()
    }
    fn odims(&self) -> &Dims {
        self.terms[0].odims()
    }
    fn dim_size(&self, name: &str) -> Option<usize> {
        // Terms may know an internal dim with different sizes: the sum spans the largest.
        self.terms.iter().filter_map(|t| t.dim_size(name)).max()
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        let outs = self.terms.iter().map(|t| t.apply(x)).collect::<Result<Vec<_>>>()?;
        compute::sum(&outs)
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Add { terms: self.terms.iter().map(|t| t.adjoint()).collect() })
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split(self, dim, &range)?;
        let internal = !self.idims().contains(dim) && !self.odims().contains(dim);
        let terms = self
            .terms
            .iter()
            .map(|t| if internal { split_internal(t, dim, &range) } else { t.split(dim, range.clone()) })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Add::new(terms)?))
    }
    fn place_on(&self, spec: &DeviceSpec) -> Result<LinopRef<T>> {
        let terms = self.terms.iter().map(|t| t.place_on(spec)).collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Add { terms }))
    }
}
