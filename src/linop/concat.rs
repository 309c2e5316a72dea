//! [`Concat`]: operators stacked along an input dim, an output dim, or both (block diagonal).
//!
//! Rules (`A_k` the operators, `n_k` their sizes along the concatenated dim):
//! - Output dim `o` only: `y = [A_1 x; A_2 x; ...]` along `o`; every `A_k` takes the same
//!   input dims and has the same output dims apart from the size of `o`.
//! - Input dim `i` only: `y = sum_k A_k x_k`, `x_k` the `k`-th block of `x` along `i`; the
//!   outputs are summed.
//! - Both (`i` and `o`, the same name or two names): block diagonal, `y_k = A_k x_k`.
//! - A concatenated dim may not appear on the other side of the operators unless it is the
//!   block-diagonal pair (that would make the blocks disagree in size).
//! - The adjoint swaps the roles: a concatenation over the output becomes one over the input.
//! - A split along the concatenated dim keeps the operators overlapping the range (splitting
//!   the ones at the edges); along any other dim it splits every operator, which must all know
//!   the dim in the same role, except that an internal dim may be missing from some operators
//!   (those stay whole in the tile starting at 0 and are [`Zero`](super::Zero) in the others)
//!   or have different sizes in them (the range is clipped to each one's).
//!   A block-diagonal pair with two different names cannot be split along one of them alone.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{Array, Concat, Dims, Linop, LinopRef, Scalar};
//! use cuferry::{Device, DeviceSpec};
//! use std::sync::Arc;
//!
//! let a: LinopRef<f64> = Arc::new(Scalar::new(2.0, Dims::new(&[("x", 1)])?));
//! let b: LinopRef<f64> = Arc::new(Scalar::new(3.0, Dims::new(&[("x", 2)])?));
//! let blocks = Concat::new(vec![a, b], Some("x"), Some("x"))?;
//! let spec = DeviceSpec::new(Device::Host)?;
//! let x = Array::from_slice(&spec, &[3], &[1.0, 1.0, 1.0])?;
//! assert_eq!(blocks.apply(&x)?.to_vec()?, vec![2.0, 3.0, 3.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::ops::Range;
use std::sync::Arc;

use super::array::Array;
use super::compute;
use super::dims::Dims;
use super::field::Field;
use super::identity::split_internal;
use super::op::{check_batch_dims, check_input, check_split, dim_role, DimRole, Linop, LinopRef};
use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// Operators concatenated along an input dim, an output dim or both. See the
/// [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct Concat<T: Field> {
    ops: Vec<LinopRef<T>>,
    idim: Option<String>,
    odim: Option<String>,
    idims: Dims,
    odims: Dims,
}

/// Checks that every operator's `dims` equal the first one's, apart from `cat`'s size, and
/// returns the joined dims.
fn joined<T: Field>(
    ops: &[LinopRef<T>],
    cat: Option<&str>,
    side: &str,
    dims_of: impl Fn(&dyn Linop<T>) -> &Dims,
) -> Result<Dims> {
    let first = dims_of(ops[0].as_ref());
    let mut total = 0usize;
    for (k, op) in ops.iter().enumerate() {
        let d = dims_of(op.as_ref());
        if let Some(c) = cat {
            let size = d.size_of(c).ok_or_else(|| {
                Error::invalid(format!("Concat: operator {k} ({}) has no {side} dim {c:?}", op.name()))
            })?;
            total = total.checked_add(size).ok_or_else(|| {
                Error::invalid(format!("Concat: the {side} dim {c:?} of the operators overflows usize"))
            })?;
        }
        let same = match cat {
            Some(c) => d.names() == first.names() && d.with_size(c, 0) == first.with_size(c, 0),
            None => d == first,
        };
        if !same {
            return Err(Error::invalid(format!(
                "Concat: operator {k} ({}) has {side} dims {d} but operator 0 has {first}",
                op.name()
            )));
        }
    }
    Ok(match cat {
        Some(c) => first.with_size(c, total),
        None => first.clone(),
    })
}

impl<T: Field> Concat<T> {
    /// Concatenates `ops` along input dim `idim` and/or output dim `odim` (see the
    /// [module docs](crate::linop)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no operators, neither dim given, a missing dim, dims
    /// that disagree between operators, a concatenated dim that also appears on the other
    /// side outside a block-diagonal pair, a concatenated size that overflows `usize`, or a
    /// dim in both the joined input and output dims with two sizes.
    pub fn new(ops: Vec<LinopRef<T>>, idim: Option<&str>, odim: Option<&str>) -> Result<Self> {
        if ops.is_empty() {
            return Err(Error::invalid("a Concat of no operators"));
        }
        if idim.is_none() && odim.is_none() {
            return Err(Error::invalid(
                "Concat needs an input dim, an output dim or both (use Add for neither)",
            ));
        }
        for op in &ops {
            if let Some(i) = idim {
                if op.odims().contains(i) && odim != Some(i) {
                    return Err(Error::invalid(format!(
                        "Concat: input dim {i:?} is also an output dim of {}; concatenate over both",
                        op.name()
                    )));
                }
            }
            if let Some(o) = odim {
                if op.idims().contains(o) && idim != Some(o) {
                    return Err(Error::invalid(format!(
                        "Concat: output dim {o:?} is also an input dim of {}; concatenate over both",
                        op.name()
                    )));
                }
            }
        }
        // One name on both sides: each block maps its own stretch of the dim, so its input and
        // output sizes must agree (the joined totals alone could match across blocks). Every
        // operator of the crate keeps this; an operator written outside it might not.
        if let (Some(i), Some(o)) = (idim, odim) {
            if i == o {
                for (k, op) in ops.iter().enumerate() {
                    let (n_in, n_out) = (op.idims().size_of(i), op.odims().size_of(o));
                    if n_in != n_out {
                        return Err(Error::invalid(format!(
                            "Concat: operator {k} ({}) has {i:?} of size {n_in:?} in and {n_out:?} out; \
                             a block-diagonal block maps its stretch of the dim onto itself",
                            op.name()
                        )));
                    }
                }
            }
        }
        let idims = joined(&ops, idim, "input", |o| o.idims())?;
        let odims = joined(&ops, odim, "output", |o| o.odims())?;
        check_batch_dims("Concat", &idims, &odims)?;
        Ok(Concat { ops, idim: idim.map(str::to_owned), odim: odim.map(str::to_owned), idims, odims })
    }

    /// The operators.
    pub fn ops(&self) -> &[LinopRef<T>] {
        &self.ops
    }

    /// Sizes of the operators along `dim`, with their start offsets.
    fn blocks(&self, dim: &str) -> Vec<(usize, usize)> {
        let mut start = 0;
        self.ops
            .iter()
            .map(|o| {
                let n = o.dim_size(dim).unwrap_or(0);
                let b = (start, n);
                start += n;
                b
            })
            .collect()
    }

    fn split_concat_dim(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        if let (Some(i), Some(o)) = (&self.idim, &self.odim) {
            if i != o {
                return Err(Error::invalid(format!(
                    "Concat: a block-diagonal pair ({i:?}, {o:?}) cannot be split along {dim:?} alone"
                )));
            }
        }
        let mut pieces = Vec::new();
        let blocks = self.blocks(dim);
        for (op, &(start, n)) in self.ops.iter().zip(&blocks) {
            let (lo, hi) = (range.start.max(start), range.end.min(start + n));
            if lo >= hi {
                continue;
            }
            if lo == start && hi == start + n {
                pieces.push(Arc::clone(op));
            } else {
                pieces.push(op.split(dim, lo - start..hi - start)?);
            }
        }
        if pieces.is_empty() {
            // An empty range: an empty piece of the block it starts in.
            let k = blocks.iter().position(|&(s, n)| range.start <= s + n).unwrap_or(0);
            let at = range.start.saturating_sub(blocks[k].0);
            pieces.push(self.ops[k].split(dim, at..at)?);
        }
        if pieces.len() == 1 {
            return Ok(pieces.remove(0));
        }
        Ok(Arc::new(Concat::new(pieces, self.idim.as_deref(), self.odim.as_deref())?))
    }
}

impl<T: Field> Linop<T> for Concat<T> {
    fn name(&self) -> &'static str {
        "Concat"
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
            .or_else(|| self.ops.iter().filter_map(|o| o.dim_size(name)).max())
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input(self, x)?;
        let outs = match &self.idim {
            Some(i) => {
                let axis =
                    self.idims.position(i).ok_or_else(|| Error::invalid("Concat lost its input dim"))?;
                self.ops
                    .iter()
                    .zip(self.blocks(i))
                    .map(|(op, (start, n))| op.apply(&x.slice(axis, start..start + n)?))
                    .collect::<Result<Vec<_>>>()?
            }
            None => self.ops.iter().map(|op| op.apply(x)).collect::<Result<Vec<_>>>()?,
        };
        match &self.odim {
            Some(o) => {
                let axis =
                    self.odims.position(o).ok_or_else(|| Error::invalid("Concat lost its output dim"))?;
                compute::concat(&outs, axis)
            }
            None => compute::sum(&outs),
        }
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(Concat {
            ops: self.ops.iter().map(|o| o.adjoint()).collect(),
            idim: self.odim.clone(),
            odim: self.idim.clone(),
            idims: self.odims.clone(),
            odims: self.idims.clone(),
        })
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split(self, dim, &range)?;
        if self.idim.as_deref() == Some(dim) || self.odim.as_deref() == Some(dim) {
            return self.split_concat_dim(dim, range);
        }
        let roles: Vec<DimRole> = self.ops.iter().map(|o| dim_role(o.as_ref(), dim)).collect();
        let known = roles.iter().find(|r| **r != DimRole::Unknown).copied().unwrap_or(DimRole::Unknown);
        let consistent =
            roles.iter().all(|r| *r == known || (known == DimRole::Internal && *r == DimRole::Unknown));
        if !consistent {
            return Err(Error::invalid(format!(
                "Concat: dim {dim:?} does not play the same role in every operator ({roles:?})"
            )));
        }
        let pieces = self
            .ops
            .iter()
            .zip(&roles)
            .map(|(o, r)| match r {
                DimRole::Unknown | DimRole::Internal => split_internal(o, dim, &range),
                _ => o.split(dim, range.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Concat::new(pieces, self.idim.as_deref(), self.odim.as_deref())?))
    }
    fn place_on(&self, spec: &DeviceSpec) -> Result<LinopRef<T>> {
        let ops = self.ops.iter().map(|o| o.place_on(spec)).collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Concat { ops, ..self.clone() }))
    }
}
