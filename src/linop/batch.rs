//! [`create_batched_linop`]: an operator split into tiles, spread over devices and put back
//! together, so that applying it equals applying the original (within rounding).
//!
//! Rules (the project's fixed split conventions):
//! - The specs are processed in order: the first one splits the operator
//!   ([`split_linop`](super::split_linop)); each tile is placed on a device when the spec has
//!   a device matrix, then the remaining specs are applied to the tile, recursively.
//! - Placement: a tile on device spec `dev` becomes `ToDevice(base -> dev)`, the tile (its
//!   parameters copied to `dev`, [`Linop::place_on`](super::Linop::place_on)), `ToDevice(dev -> base)`. Tiles on
//!   different specs are queued on their own compute streams, and transfers are pipelined
//!   (see [`transfer_stream`](super::transfer_stream)); tiles reading one input run at once,
//!   as reads of one buffer do (the [module rules](super)).
//! - The device matrix is indexed by the tile index, repeated (and truncated) along each axis
//!   when it is smaller than the tile grid; axes it lacks (it may have fewer than the grid)
//!   count as size 1. A device matrix with more axes than the spec has dims, or with an entry
//!   that places no tile, is an error: silently dropping devices would hide a mistake. For
//!   the outermost spec that means a matrix larger than the grid along an axis; a nested spec
//!   meets one grid per tile of the spec before it (ragged tiles and tiles lacking a dim have
//!   fewer tiles, and use only the matrix's leading entries), so its matrix is checked against
//!   all of them together: each entry must place a tile of some grid.
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

use std::collections::BTreeSet;
use std::sync::Arc;

use super::add::Add;
use super::array::{check_spec, numel};
use super::chain::Chain;
use super::concat::Concat;
use super::field::Field;
use super::op::{dim_role, DimRole, Linop, LinopRef};
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
    /// [`Error::InvalidArgument`] when the grid is empty, `specs.len()` is not the product
    /// of `shape` (or the product overflows), or a spec's streams are on another device than
    /// its `device`.
    pub fn new(shape: &[usize], specs: Vec<DeviceSpec>) -> Result<Self> {
        let n = numel(shape)?;
        if n == 0 {
            return Err(Error::invalid(format!(
                "a device matrix of shape {shape:?} is empty: it needs at least one entry along every axis"
            )));
        }
        if n != specs.len() {
            return Err(Error::invalid(format!(
                "a device matrix of shape {shape:?} holds {n} specs, but {} were given",
                specs.len()
            )));
        }
        specs.iter().try_for_each(check_spec)?;
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

/// Checks that a placement grid of `shape`, for a spec splitting along `dims`, places a tile
/// of one of the tile `grids` it is applied to (each with an axis per dim) with every entry,
/// and has no more axes than `dims`. Against one grid: no more entries along an axis than
/// there are tiles.
pub(crate) fn check_grid_fits(shape: &[usize], dims: &[String], grids: &[Vec<usize>]) -> Result<()> {
    if shape.len() > dims.len() {
        return Err(Error::invalid(format!(
            "a {}-d placement matrix for a {}-d tile grid (dims {dims:?})",
            shape.len(),
            dims.len()
        )));
    }
    let reaches = |index: &[usize]| grids.iter().any(|g| index.iter().zip(g).all(|(i, n)| i < n));
    let mut index = vec![0usize; shape.len()];
    loop {
        if !reaches(&index) {
            let mut largest = vec![0usize; dims.len()];
            for g in grids {
                largest.iter_mut().zip(g).for_each(|(l, &n)| *l = (*l).max(n));
            }
            let why = match index.iter().zip(&largest).position(|(i, n)| i >= n) {
                Some(a) => {
                    format!("along axis {a} (dim {:?}) there are at most {} tiles", dims[a], largest[a])
                }
                None => format!("no one tile grid reaches it (the grids are {grids:?})"),
            };
            return Err(Error::invalid(format!(
                "entry {index:?} of the placement matrix of shape {shape:?} places no tile: {why}"
            )));
        }
        // The next entry, last axis fastest.
        let mut axis = shape.len();
        loop {
            if axis == 0 {
                return Ok(());
            }
            axis -= 1;
            index[axis] += 1;
            if index[axis] < shape[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
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
/// [`Error::InvalidArgument`] for a device matrix that does not fit the grids it meets or has
/// no base device, or a base spec whose streams are on another device than its `device`;
/// errors of placing parameters.
pub fn create_batched_linop<T: Field>(op: LinopRef<T>, specs: &[BatchSpec]) -> Result<LinopRef<T>> {
    check_specs(op.as_ref(), specs)?;
    check_device_matrices(vec![Arc::clone(&op)], specs, true)?;
    build(op, specs, None, true)
}

/// Checks `specs` against the whole operator `op`: every batch size above 0, every dim known
/// to `op`, every base spec's streams on its device.
pub(crate) fn check_specs<T: Field>(op: &dyn Linop<T>, specs: &[BatchSpec]) -> Result<()> {
    for spec in specs {
        for (d, b) in &spec.batch_sizes {
            if *b == 0 {
                return Err(Error::invalid(format!("batch size 0 for dim {d:?}")));
            }
            if op.dim_size(d).is_none() {
                return Err(super::dims::unknown_dim(op.name(), d));
            }
        }
        if let Some(base) = &spec.base_device {
            check_spec(base)?;
        }
    }
    Ok(())
}

/// Whether `op` knows each dim of `spec` (at the outermost level every dim counts as known;
/// [`check_specs`] has checked them against the whole operator).
fn known_dims<T: Field>(op: &dyn Linop<T>, spec: &BatchSpec, outermost: bool) -> Vec<bool> {
    spec.batch_sizes.iter().map(|(d, _)| outermost || op.dim_size(d).is_some()).collect()
}

/// The shape of the tile grid `spec` cuts `op` into, with an axis per dim of `spec` (size 1
/// for a dim `op` lacks), as [`split_linop`] makes it.
fn grid_shape<T: Field>(op: &dyn Linop<T>, spec: &BatchSpec, outermost: bool) -> Vec<usize> {
    spec.batch_sizes
        .iter()
        .zip(known_dims(op, spec, outermost))
        .map(|((d, b), known)| match op.dim_size(d) {
            Some(n) if known && *b > 0 => n.div_ceil(*b).max(1),
            _ => 1,
        })
        .collect()
}

/// Checks the device matrix of every spec with [`check_grid_fits`] against all the tile grids
/// that spec makes: the first spec cuts each of `ops` (the whole operator when `outermost`,
/// else the tiles of an enclosing split), every later spec each tile of the one before.
/// Called once before anything is placed, so a nested matrix is judged by every tile it
/// serves, not tile by tile.
pub(crate) fn check_device_matrices<T: Field>(
    mut ops: Vec<LinopRef<T>>,
    specs: &[BatchSpec],
    outermost: bool,
) -> Result<()> {
    let Some(last) = specs.iter().rposition(|s| s.device_matrix.is_some()) else {
        return Ok(());
    };
    for (level, spec) in specs[..=last].iter().enumerate() {
        let outer = outermost && level == 0;
        let mut grids: BTreeSet<Vec<usize>> = BTreeSet::new();
        let mut tiles = Vec::new();
        for op in &ops {
            grids.insert(grid_shape(op.as_ref(), spec, outer));
            if level < last {
                let batches = known_batches(op.as_ref(), spec, outer);
                tiles.extend(split_linop(op.as_ref(), &batches)?.tiles.into_iter().map(|t| t.linop));
            }
        }
        if let Some(m) = &spec.device_matrix {
            let dims: Vec<String> = spec.batch_sizes.iter().map(|(d, _)| d.clone()).collect();
            check_grid_fits(m.shape(), &dims, &grids.into_iter().collect::<Vec<_>>())?;
        }
        ops = tiles;
    }
    Ok(())
}

/// The `(dim, batch size)` pairs of `spec` that `op` knows (see [`known_dims`]).
fn known_batches<T: Field>(op: &dyn Linop<T>, spec: &BatchSpec, outermost: bool) -> Vec<(String, usize)> {
    spec.batch_sizes
        .iter()
        .zip(known_dims(op, spec, outermost))
        .filter(|(_, k)| *k)
        .map(|(b, _)| b.clone())
        .collect()
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
    // whole tile; it keeps its axis so the device matrix stays aligned with the spec. The
    // matrices were checked against every grid beforehand (`check_device_matrices`).
    let known = known_dims(op.as_ref(), spec, outermost);
    let grid = split_linop(op.as_ref(), &known_batches(op.as_ref(), spec, outermost))?;
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
/// the remaining specs `rest` applied, `ToDevice(dev -> base)`. The caller has checked `rest`
/// ([`check_specs`] against the whole operator, [`check_device_matrices`] against all tiles).
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
