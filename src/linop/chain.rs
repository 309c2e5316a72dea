//! [`Chain`]: the composition of operators, in the order they are applied.
//!
//! Rules:
//! - `Chain::new(vec![a, b, c])` computes `c(b(a(x)))`: each operator's output dims (names
//!   and sizes, in order) must equal the next one's input dims; otherwise it is an error. A
//!   dim in both the chain's input and output is a batch dim and must have one size.
//! - The adjoint is the chain of adjoints in reverse order.
//! - Dims between operators are the chain's internal dims ([`Linop::dim_size`] reports them).
//! - A split along `d` splits every operator that knows `d`. It is exact only when `d` is
//!   summed over at one place at most, so a split is refused when `d` is consumed and later
//!   produced again, or is internal to two operators (the tiles would miss cross terms).
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{Array, Chain, Dims, Linop, LinopRef, Scalar};
//! use cuferry::{Device, DeviceSpec};
//! use std::sync::Arc;
//!
//! let d = Dims::new(&[("x", 2)])?;
//! let a: LinopRef<f64> = Arc::new(Scalar::new(2.0, d.clone()));
//! let b: LinopRef<f64> = Arc::new(Scalar::new(3.0, d));
//! let c = Chain::new(vec![a, b])?;
//! let spec = DeviceSpec::new(Device::Host)?;
//! let x = Array::from_slice(&spec, &[2], &[1.0, -1.0])?;
//! assert_eq!(c.apply(&x)?.to_vec()?, vec![6.0, -6.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::ops::Range;
use std::sync::Arc;

use super::array::Array;
use super::dims::Dims;
use super::field::Field;
use super::op::{check_batch_dims, check_input, check_split, dim_role, DimRole, Linop, LinopRef};
use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// The composition of operators in application order. See the [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct Chain<T: Field> {
    ops: Vec<LinopRef<T>>,
    idims: Dims,
    odims: Dims,
}

impl<T: Field> Chain<T> {
    /// `ops[n-1] ∘ ... ∘ ops[0]`: `ops[0]` is applied first.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no operators, when an operator's output dims differ
    /// from the next one's input dims, or when a dim in both the chain's input and output dims
    /// has two sizes.
    pub fn new(ops: Vec<LinopRef<T>>) -> Result<Self> {
        if ops.is_empty() {
            return Err(Error::invalid("a Chain of no operators"));
        }
        for (k, pair) in ops.windows(2).enumerate() {
            if pair[0].odims() != pair[1].idims() {
                return Err(Error::invalid(format!(
                    "Chain: operator {k} ({}) outputs {} but operator {} ({}) takes {}",
                    pair[0].name(),
                    pair[0].odims(),
                    k + 1,
                    pair[1].name(),
                    pair[1].idims()
                )));
            }
        }
        let chain = Self::unchecked(ops);
        // A name entering and leaving the chain is a batch dim: one size (the chain may
        // consume it and produce it again, but not with another size).
        check_batch_dims("Chain", &chain.idims, &chain.odims)?;
        Ok(chain)
    }

    /// A chain whose dims are known to match (built by the crate). `ops` must not be empty.
    pub(crate) fn unchecked(ops: Vec<LinopRef<T>>) -> Self {
        let idims = ops.first().map(|o| o.idims().clone()).unwrap_or_default();
        let odims = ops.last().map(|o| o.odims().clone()).unwrap_or_default();
        Chain { ops, idims, odims }
    }

    /// The operators in application order.
    pub fn ops(&self) -> &[LinopRef<T>] {
        &self.ops
    }
}

impl<T: Field> Linop<T> for Chain<T> {
    fn name(&self) -> &'static str {
        "Chain"
    }
    fn idims(&self) -> &Dims {
        &self.idims
    }
    fn odims(&self) -> &Dims {
        &self.odims
    }
    fn dim_size(&self, name: &str) -> Option<usize> {
        self.idims
            .size_of(name)
            .or_else(|| self.odims.size_of(name))
            .or_else(|| self.ops.iter().find_map(|o| o.dim_size(name)))
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        let mut y = x.clone();
        for op in &self.ops {
            y = op.apply(&y)?;
        }
        Ok(y)
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Chain::unchecked(self.ops.iter().rev().map(|o| o.adjoint()).collect()))
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split(self, dim, &range)?;
        // Count the places where `dim` is summed over: entering the chain with it, producing
        // it, or an operator keeping it internal. More than one cannot be split exactly.
        let roles: Vec<DimRole> = self.ops.iter().map(|o| dim_role(o.as_ref(), dim)).collect();
        let sites = usize::from(self.idims.contains(dim))
            + roles.iter().filter(|r| matches!(r, DimRole::Output | DimRole::Internal)).count();
        if sites > 1 {
            return Err(Error::invalid(format!(
                "Chain: dim {dim:?} is summed over at {sites} places; splitting it would drop cross terms"
            )));
        }
        let ops = self
            .ops
            .iter()
            .zip(&roles)
            .map(
                |(o, r)| if *r == DimRole::Unknown { Ok(Arc::clone(o)) } else { o.split(dim, range.clone()) },
            )
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Chain::new(ops)?))
    }
    fn place_on(&self, spec: &DeviceSpec) -> Result<LinopRef<T>> {
        let ops = self.ops.iter().map(|o| o.place_on(spec)).collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Chain::unchecked(ops)))
    }
}
