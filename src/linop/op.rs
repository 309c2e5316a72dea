//! The [`Linop`] trait: a linear operator between arrays with named dimensions.
//!
//! Rules:
//! - An operator maps arrays shaped like its input dims ([`Linop::idims`]) to arrays shaped
//!   like its output dims ([`Linop::odims`]); axis `k` of the input is input dim `k`.
//! - A name in both input and output dims is a batch dim (same size, acted on index by index).
//!   A name an operator knows but that is in neither (a composite's inner dim, such as the
//!   dim between two chained operators) is internal; [`Linop::dim_size`] reports it too.
//! - [`Linop::apply`] computes on the input's device, on the input's spec's compute stream,
//!   queued asynchronously; the result lives on the same spec (only
//!   [`ToDevice`](super::ToDevice) moves data). Parameters (weights) must be on the input's
//!   device: [`Linop::place_on`] copies them there. An operator implemented outside cuferry
//!   that builds its result with [`Array::from_buffer`] marks it with
//!   [`Array::computed_from`], so errors of the work upstream of its input stay reported.
//! - [`Linop::adjoint`] is the conjugate transpose; [`Linop::normal`] is `A^H A`.
//! - [`Linop::split`] restricts one dim to a range: the input, the output or both, as the
//!   dim's role requires. Tiles reassembled per the crate's rules give back the operator
//!   (see [`create_batched_linop`](super::create_batched_linop)).
//! - Operators are shared as [`LinopRef`] (`Arc<dyn Linop<T>>`); parameters are shared, not
//!   copied, between an operator, its adjoint and its clones.

use std::fmt::Debug;
use std::ops::Range;
use std::sync::Arc;

use super::array::Array;
use super::chain::Chain;
use super::dims::Dims;
use super::field::Field;
use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// A shared linear operator.
pub type LinopRef<T> = Arc<dyn Linop<T>>;

/// Clones an operator into a [`LinopRef`]; implemented for every `Clone` operator.
pub trait LinopClone<T: Field> {
    /// A shared copy of the operator (parameters are shared, not copied).
    fn clone_ref(&self) -> LinopRef<T>;
}

impl<T: Field, L: Linop<T> + Clone + 'static> LinopClone<T> for L {
    fn clone_ref(&self) -> LinopRef<T> {
        Arc::new(self.clone())
    }
}

/// A linear operator over named dimensions. See the [module docs](crate::linop) for the rules.
pub trait Linop<T: Field>: LinopClone<T> + Debug + Send + Sync {
    /// A short name for messages ("Dense", "Chain", ...).
    fn name(&self) -> &'static str;

    /// The input dims (names and sizes, in axis order).
    fn idims(&self) -> &Dims;

    /// The output dims (names and sizes, in axis order).
    fn odims(&self) -> &Dims;

    /// The input dim names.
    fn ishape(&self) -> &[String] {
        self.idims().names()
    }

    /// The output dim names.
    fn oshape(&self) -> &[String] {
        self.odims().names()
    }

    /// The size of a dim the operator knows: input, output or internal.
    fn dim_size(&self, name: &str) -> Option<usize> {
        self.idims().size_of(name).or_else(|| self.odims().size_of(name))
    }

    /// `A x`, queued on `x`'s compute stream.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `x`'s shape is not [`Linop::idims`] or the parameters
    /// are on another device; [`Error::Unsupported`] for arithmetic on CUDA arrays in a build
    /// without nvcc, or for a CUDA kernel over more than 8 loop dims that do not merge (the
    /// dims of an operand and its parameters together; the host backend has no limit); errors
    /// of the queued work.
    fn apply(&self, x: &Array<T>) -> Result<Array<T>>;

    /// The adjoint `A^H` (conjugate transpose).
    fn adjoint(&self) -> LinopRef<T>;

    /// The normal operator `A^H A`.
    fn normal(&self) -> LinopRef<T> {
        Arc::new(Chain::unchecked(vec![self.clone_ref(), self.adjoint()]))
    }

    /// The operator restricted to `range` of dim `dim`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an unknown dim, a range outside it, or a split the
    /// operator's structure cannot express (see each operator).
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>>;

    /// The same operator with its parameters copied to `spec`'s device (queued on the transfer
    /// streams, see [`ToDevice`](super::ToDevice)); operators without parameters return a
    /// clone. Data transfers inside the operator ([`ToDevice`](super::ToDevice)) keep their
    /// devices.
    ///
    /// # Errors
    ///
    /// Errors of the copies.
    fn place_on(&self, spec: &DeviceSpec) -> Result<LinopRef<T>>;
}

/// How a dim appears in an operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DimRole {
    /// In the input and output dims (a batch dim).
    Both,
    /// In the input dims only (contracted or summed).
    Input,
    /// In the output dims only (produced).
    Output,
    /// Known but in neither (internal to a composite).
    Internal,
    /// Not known at all.
    Unknown,
}

/// The role of `dim` in `op`.
pub fn dim_role<T: Field>(op: &dyn Linop<T>, dim: &str) -> DimRole {
    match (op.idims().contains(dim), op.odims().contains(dim)) {
        (true, true) => DimRole::Both,
        (true, false) => DimRole::Input,
        (false, true) => DimRole::Output,
        (false, false) if op.dim_size(dim).is_some() => DimRole::Internal,
        (false, false) => DimRole::Unknown,
    }
}

/// Checks that `x` is shaped like `op`'s input dims.
pub(crate) fn check_input<T: Field>(op: &dyn Linop<T>, x: &Array<T>) -> Result<()> {
    if x.shape() == op.idims().sizes() {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{} expects an input of dims {}, got an array of shape {:?}",
            op.name(),
            op.idims(),
            x.shape()
        )))
    }
}

/// Checks that every dim in both `idims` and `odims` (a batch dim) has one size.
pub(crate) fn check_batch_dims(what: &str, idims: &Dims, odims: &Dims) -> Result<()> {
    for (n, &s) in idims.names().iter().zip(idims.sizes()) {
        match odims.size_of(n) {
            Some(o) if o != s => {
                return Err(Error::invalid(format!(
                    "{what}: dim {n:?} is {s} in the input and {o} in the output; a dim on both sides \
                     is one dim with one size"
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Restricts `dims` to `range` of `dim` when it has that dim.
pub(crate) fn restrict(dims: &Dims, dim: &str, range: &Range<usize>) -> Dims {
    dims.with_size(dim, range.end - range.start)
}

/// Checks `range` against `dim` in `op` (known, inside its size).
pub(crate) fn check_split<T: Field>(op: &dyn Linop<T>, dim: &str, range: &Range<usize>) -> Result<()> {
    let Some(size) = op.dim_size(dim) else {
        return Err(super::dims::unknown_dim(op.name(), dim));
    };
    if range.start > range.end {
        Err(Error::invalid(format!("{}: range {range:?} of dim {dim:?} is reversed", op.name())))
    } else if range.end <= size {
        Ok(())
    } else {
        Err(Error::invalid(format!("{}: range {range:?} is outside dim {dim:?} of size {size}", op.name())))
    }
}
