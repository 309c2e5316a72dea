//! [`create_batched_linop`]: an operator split into tiles, spread over devices and put back
//! together, so that applying it equals applying the original (within rounding).
//!
//! Rules (shared/ARCHITECTURE.md, "Split"):
//! - The specs are processed in order: the first one splits the operator
//!   ([`split_linop`](super::split_linop)); each tile is placed on a device when the spec has
//!   a device matrix, then the remaining specs are applied to the tile, recursively.
//! - Placement: a tile on device spec `dev` becomes `ToDevice(base -> dev)`, the tile (its
//!   parameters copied to `dev`, [`Linop::place_on`](super::Linop::place_on)), `ToDevice(dev -> base)`. Tiles on
//!   different specs run concurrently on their own compute streams, and transfers are
//!   pipelined (see [`transfer_stream`](super::transfer_stream)).
//! - The device matrix is indexed by the tile index, repeated (and truncated) along each axis
//!   when it is smaller than the tile grid; axes it lacks (it may have fewer than the grid)
//!   count as size 1. A device matrix larger than the grid along an axis, or with more axes,
//!   is an error: silently dropping devices would hide a mistake.
//! - Every dim of every spec must be known to the operator and have a batch size above 0.
//!   Inside a tile (nested specs), a dim the tile no longer has (an internal dim of a part
//!   the tile does not contain) is one whole tile.
//! - Base: where the data lives. `base_device` of a spec, else the placement of the enclosing
//!   tile, else (outermost spec) none: a device matrix then needs an explicit base.
//! - Reassembly along a batched dim `d`, one grid axis at a time (last axis first): `d` in the
//!   input and output dims -> block diagonal `Concat` over both; only in the output ->
//!   `Concat` over the output (each tile sees the whole input); only in the input -> `Concat`
//!   over the input (outputs summed); in neither (internal) -> `Add`.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{create_batched_linop, Array, BatchSpec, DeviceMatrix, Diagonal, Dims, Linop, LinopRef};
//! use cuferry::{Device, DeviceSpec};
//! use std::sync::Arc;
//!
//! let base = DeviceSpec::new(Device::Host)?;
//! let w = Array::from_slice(&base, &[5], &[1.0f64, 2.0, 3.0, 4.0, 5.0])?;
//! let op: LinopRef<f64> = Arc::new(Diagonal::new(w, &["x"], Dims::new(&[("x", 5)])?)?);
//! let devices = DeviceMatrix::from_devices(&[2], &[Device::Host, Device::Host])?; // two host "devices"
//! let spec = BatchSpec::new(&[("x", 2)]).devices(devices).base(base.clone());
//! let batched = create_batched_linop(op, &[spec])?;
//! let x = Array::from_slice(&base, &[5], &[1.0; 5])?;
//! assert_eq!(batched.apply(&x)?.to_vec()?, vec![1.0, 2.0, 3.0, 4.0, 5.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::sync::Arc;

use super::add::Add;
use super::chain::Chain;
use super::concat::Concat;
use super::field::Field;
use super::op::{dim_role, DimRole, LinopRef};
use super::split::split_linop;
use super::to_device::ToDevice;
use crate::device::{Device, DeviceSpec};
use crate::error::{Error, Result};

/// An n-d grid of device specs (row-major).
#[derive(Clone, Debug)]
pub struct DeviceMatrix {
    shape: Vec<usize>,
    specs: Vec<DeviceSpec>,
}

impl DeviceMatrix {
    /// A grid of `shape` holding `specs` in row-major order.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the grid is empty or `specs.len()` is not the product
    /// of `shape`.
    pub fn new(shape: &[usize], specs: Vec<DeviceSpec>) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n == 0 || n != specs.len() {
            return Err(Error::invalid(format!(
                "a device matrix of shape {shape:?} needs {n} > 0 specs, got {}",
                specs.len()
            )));
        }
        Ok(DeviceMatrix { shape: shape.to_vec(), specs })
    }

    /// A 1-d grid of `specs`.
    ///
    /// # Errors
    ///
    /// As [`DeviceMatrix::new`].
    pub fn from_specs(specs: Vec<DeviceSpec>) -> Result<Self> {
        Self::new(&[specs.len()], specs)
    }

    /// A grid with a new [`DeviceSpec`] (own compute stream) for every entry of `devices`,
    /// so repeating [`Device::Host`] gives several host "devices".
    ///
    /// # Errors
    ///
    /// As [`DeviceMatrix::new`] and [`DeviceSpec::new`].
    pub fn from_devices(shape: &[usize], devices: &[Device]) -> Result<Self> {
        let specs = devices.iter().map(|&d| DeviceSpec::new(d)).collect::<Result<Vec<_>>>()?;
        Self::new(shape, specs)
    }

    /// The grid's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The specs in row-major order.
    pub fn specs(&self) -> &[DeviceSpec] {
        &self.specs
    }

    /// The spec for the tile at `index`, repeating the matrix along each axis.
    fn for_tile(&self, index: &[usize]) -> &DeviceSpec {
        &self.specs[grid_entry(&self.shape, index)]
    }
}

/// The row-major entry of a grid of `shape` for the tile at `index`, repeating the grid along
/// each axis (axes the grid lacks count as size 1).
pub(crate) fn grid_entry(shape: &[usize], index: &[usize]) -> usize {
    shape.iter().enumerate().fold(0, |acc, (a, &n)| acc * n + index.get(a).map_or(0, |i| i % n))
}

/// Checks that a placement grid of `shape` fits a tile grid of `grid` (split along `dims`):
/// no more axes, and no more entries along an axis than there are tiles.
pub(crate) fn check_grid_fits(shape: &[usize], dims: &[String], grid: &[usize]) -> Result<()> {
    if shape.len() > grid.len() {
        return Err(Error::invalid(format!(
            "a {}-d placement matrix for a {}-d tile grid (dims {dims:?})",
            shape.len(),
            grid.len()
        )));
    }
    for (a, (&m, &g)) in shape.iter().zip(grid).enumerate() {
        if m > g {
            return Err(Error::invalid(format!(
                "the placement matrix has {m} entries along axis {a} (dim {:?}) but there are only {g} tiles",
                dims[a]
            )));
        }
    }
    Ok(())
}

/// How to split an operator and where to put the tiles. See the [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct BatchSpec {
    /// `(dim, batch size)` pairs; the tile grid's axes follow this order.
    pub batch_sizes: Vec<(String, usize)>,
    /// Where the tiles run; `None` leaves them where the data is.
    pub device_matrix: Option<DeviceMatrix>,
    /// Where the data lives; `None` inherits it (see the [module docs](crate::linop)).
    pub base_device: Option<DeviceSpec>,
}

impl BatchSpec {
    /// A spec that splits by `batch_sizes`, without placement.
    pub fn new<S: AsRef<str>>(batch_sizes: &[(S, usize)]) -> Self {
        BatchSpec {
            batch_sizes: batch_sizes.iter().map(|(d, b)| (d.as_ref().to_owned(), *b)).collect(),
            device_matrix: None,
            base_device: None,
        }
    }

    /// The spec with tiles placed on `matrix`.
    pub fn devices(mut self, matrix: DeviceMatrix) -> Self {
        self.device_matrix = Some(matrix);
        self
    }

    /// The spec with data living on `base`.
    pub fn base(mut self, base: DeviceSpec) -> Self {
        self.base_device = Some(base);
        self
    }
}

/// Splits `op` by `specs` and spreads the tiles over devices. See the [module docs](crate::linop).
///
/// # Errors
///
/// Errors of [`split_linop`] (bad batch sizes, unknown dims, inexpressible splits);
/// [`Error::InvalidArgument`] for a device matrix that does not fit the grid or has no base
/// device; errors of placing parameters.
pub fn create_batched_linop<T: Field>(op: LinopRef<T>, specs: &[BatchSpec]) -> Result<LinopRef<T>> {
    for spec in specs {
        for (d, b) in &spec.batch_sizes {
            if *b == 0 {
                return Err(Error::invalid(format!("batch size 0 for dim {d:?}")));
            }
            if op.dim_size(d).is_none() {
                return Err(super::dims::unknown_dim(op.name(), d));
            }
        }
    }
    build(op, specs, None, true)
}

fn build<T: Field>(
    op: LinopRef<T>,
    specs: &[BatchSpec],
    inherited: Option<&DeviceSpec>,
    outermost: bool,
) -> Result<LinopRef<T>> {
    let Some((spec, rest)) = specs.split_first() else {
        return Ok(op);
    };
    let base = spec.base_device.as_ref().or(inherited);
    // Inside a tile, a dim the tile no longer has (an internal dim of a part it lacks) is one
    // whole tile; it keeps its axis so the device matrix stays aligned with the spec.
    let known: Vec<bool> =
        spec.batch_sizes.iter().map(|(d, _)| outermost || op.dim_size(d).is_some()).collect();
    let batches: Vec<(String, usize)> =
        spec.batch_sizes.iter().zip(&known).filter(|(_, k)| **k).map(|(b, _)| b.clone()).collect();
    let grid = split_linop(op.as_ref(), &batches)?;
    let mut full_shape = Vec::with_capacity(known.len());
    let mut axes = grid.shape.iter();
    for k in &known {
        full_shape.push(if *k { axes.next().copied().unwrap_or(1) } else { 1 });
    }
    let spec_dims: Vec<String> = spec.batch_sizes.iter().map(|(d, _)| d.clone()).collect();
    if let Some(m) = &spec.device_matrix {
        check_grid_fits(m.shape(), &spec_dims, &full_shape)?;
    }
    let mut items: Vec<LinopRef<T>> = Vec::with_capacity(grid.tiles.len());
    for tile in grid.tiles {
        let item = match &spec.device_matrix {
            Some(m) => {
                let base = base
                    .ok_or_else(|| Error::invalid("a BatchSpec with a device matrix needs a base device"))?;
                let mut index = tile.index.iter();
                let full_index: Vec<usize> =
                    known.iter().map(|k| if *k { index.next().copied().unwrap_or(0) } else { 0 }).collect();
                place_tile(&tile.linop, rest, base, m.for_tile(&full_index))?
            }
            None => build(tile.linop, rest, base, false)?,
        };
        items.push(item);
    }
    for (axis, dim) in grid.dims.iter().enumerate().rev() {
        let role = dim_role(op.as_ref(), dim);
        items = items
            .chunks(grid.shape[axis])
            .map(|group| combine(group, dim, role))
            .collect::<Result<Vec<_>>>()?;
    }
    items.pop().ok_or_else(|| Error::invalid("a tile grid without tiles"))
}

/// A tile placed on `dev`: `ToDevice(base -> dev)`, the tile with its parameters on `dev` and
/// the remaining specs `rest` applied, `ToDevice(dev -> base)`.
pub(crate) fn place_tile<T: Field>(
    tile: &LinopRef<T>,
    rest: &[BatchSpec],
    base: &DeviceSpec,
    dev: &DeviceSpec,
) -> Result<LinopRef<T>> {
    let inner = build(tile.place_on(dev)?, rest, Some(dev), false)?;
    let to = ToDevice::new(base.clone(), dev.clone(), inner.idims().clone());
    let back = ToDevice::new(dev.clone(), base.clone(), inner.odims().clone());
    Ok(Arc::new(Chain::new(vec![Arc::new(to), inner, Arc::new(back)])?))
}

/// Puts the tiles of one grid row along `dim` back together.
fn combine<T: Field>(group: &[LinopRef<T>], dim: &str, role: DimRole) -> Result<LinopRef<T>> {
    if let [one] = group {
        return Ok(Arc::clone(one));
    }
    let ops = group.to_vec();
    Ok(match role {
        DimRole::Both => Arc::new(Concat::new(ops, Some(dim), Some(dim))?),
        DimRole::Output => Arc::new(Concat::new(ops, None, Some(dim))?),
        DimRole::Input => Arc::new(Concat::new(ops, Some(dim), None)?),
        DimRole::Internal => Arc::new(Add::new(ops)?),
        DimRole::Unknown => {
            return Err(Error::invalid(format!("cannot reassemble along unknown dim {dim:?}")))
        }
    })
}
