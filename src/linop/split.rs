//! [`split_linop`]: an operator cut into an n-d grid of tiles.
//!
//! Rules:
//! - Each `(dim, b)` pair cuts `dim` (size `n`) into `[0,b), [b,2b), ...`, the last tile
//!   ragged; a dim of size 0 is one empty tile. Dims not listed are one whole tile.
//! - The grid's axes follow the order of the pairs; tiles are listed in row-major order.
//! - Each tile is the operator split along every listed dim ([`Linop::split`]), with the
//!   ranges of its input and output (whole axes for dims not split or not present).
//! - A batch size of 0, a repeated dim or a dim the operator does not know is an error, and
//!   so is a grid whose tile count overflows `usize` (checked before anything is built).
//! - Splitting along one dim may leave a tile without another, internal, dim (a block of a
//!   `Concat` that lacks it); such a tile is whole in the first tile along that dim and
//!   [`Zero`](super::Zero) in the others, so the tiles still sum to the operator. It may also
//!   leave a tile whose internal dim is smaller than the operator's (a `Concat` whose blocks
//!   know it with different sizes): its range is clipped to the tile's size, and a range past
//!   it is `Zero`. The order of the pairs therefore never decides whether a grid is accepted.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{split_linop, Dims, Identity, LinopRef};
//! use std::sync::Arc;
//!
//! let op: LinopRef<f64> = Arc::new(Identity::new(Dims::new(&[("x", 5), ("y", 2)])?));
//! let grid = split_linop(op.as_ref(), &[("x", 2)])?;
//! assert_eq!(grid.shape, vec![3]);
//! let ranges: Vec<_> = grid.tiles.iter().map(|t| t.islices[0].clone()).collect();
//! assert_eq!(ranges, vec![0..2, 2..4, 4..5]);
//! assert_eq!(grid.tiles[2].islices[1], 0..2);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::ops::Range;

use super::array::numel;
use super::dims::{unknown_dim, Dims};
use super::field::Field;
use super::identity::split_internal;
use super::op::{Linop, LinopRef};
use crate::error::{Error, Result};

/// One tile of a [`SplitGrid`].
#[derive(Clone, Debug)]
pub struct Tile<T: Field> {
    /// The tile's position in the grid.
    pub index: Vec<usize>,
    /// The operator restricted to the tile.
    pub linop: LinopRef<T>,
    /// The range of each input axis the tile reads.
    pub islices: Vec<Range<usize>>,
    /// The range of each output axis the tile writes (or adds to).
    pub oslices: Vec<Range<usize>>,
}

/// An operator cut into tiles. See the [module docs](crate::linop).
#[derive(Clone, Debug)]
pub struct SplitGrid<T: Field> {
    /// The split dims, one per grid axis.
    pub dims: Vec<String>,
    /// Number of tiles along each grid axis.
    pub shape: Vec<usize>,
    /// The tiles in row-major order of their index.
    pub tiles: Vec<Tile<T>>,
}

impl<T: Field> SplitGrid<T> {
    /// The tile at `index`.
    pub fn tile(&self, index: &[usize]) -> Option<&Tile<T>> {
        if index.len() != self.shape.len() || index.iter().zip(&self.shape).any(|(i, n)| i >= n) {
            return None;
        }
        let flat = index.iter().zip(&self.shape).fold(0, |acc, (i, n)| acc * n + i);
        self.tiles.get(flat)
    }
}

/// The tiles of a dim of `size` with batch size `batch`: `[0,b), [b,2b), ...`, ragged last;
/// one empty tile for a dim of size 0.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a batch size of 0 (with a size above 0: no tiles could
/// cover the dim).
pub fn tile_ranges(size: usize, batch: usize) -> Result<Vec<Range<usize>>> {
    if size == 0 {
        return Ok(std::iter::once(0..0).collect());
    }
    if batch == 0 {
        return Err(Error::invalid(format!("a batch size of 0 for a dim of size {size}")));
    }
    Ok((0..size).step_by(batch).map(|s| s..s.saturating_add(batch).min(size)).collect())
}

/// Cuts `op` into tiles. See the [module docs](crate::linop).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a batch size of 0, a dim listed twice or unknown to `op`, or
/// a grid whose tile list would pass `isize::MAX` bytes; [`Error::OutOfMemory`] when that
/// list cannot be allocated; errors of [`Linop::split`] (splits the operator's structure
/// cannot express exactly).
pub fn split_linop<T: Field, S: AsRef<str>>(
    op: &dyn Linop<T>,
    batch_sizes: &[(S, usize)],
) -> Result<SplitGrid<T>> {
    let mut dims: Vec<String> = Vec::new();
    let mut cuts: Vec<(usize, usize)> = Vec::new();
    for (d, b) in batch_sizes {
        let d = d.as_ref();
        if *b == 0 {
            return Err(Error::invalid(format!("batch size 0 for dim {d:?}")));
        }
        if dims.iter().any(|x| x == d) {
            return Err(Error::invalid(format!("dim {d:?} is batched twice")));
        }
        let size = op.dim_size(d).ok_or_else(|| unknown_dim(op.name(), d))?;
        dims.push(d.to_owned());
        cuts.push((size, *b));
    }
    // The tile count is checked, and the tile list allocated, before any range list is made:
    // each of those is no longer than the tile list.
    let shape: Vec<usize> = cuts.iter().map(|&(size, b)| size.div_ceil(b).max(1)).collect();
    let count = numel(&shape)?;
    let mut tiles: Vec<Tile<T>> = Vec::new();
    if count > isize::MAX as usize / std::mem::size_of::<Tile<T>>().max(1) {
        return Err(Error::invalid(format!(
            "a tile grid of shape {shape:?} ({count} tiles) is larger than any list can be"
        )));
    }
    tiles.try_reserve_exact(count).map_err(|e| {
        Error::out_of_memory(format!("a tile list for a grid of shape {shape:?} ({count} tiles): {e}"))
    })?;
    let ranges: Vec<Vec<Range<usize>>> =
        cuts.iter().map(|&(size, b)| tile_ranges(size, b)).collect::<Result<_>>()?;
    let mut index = vec![0usize; shape.len()];
    for _ in 0..count {
        let mut linop = op.clone_ref();
        for (axis, d) in dims.iter().enumerate() {
            // An input or output dim keeps its size through the splits along other dims; an
            // internal dim may shrink (the tile kept only the parts where it is smaller) or
            // vanish, so its range is clipped to the tile's size, as a sum's part does.
            linop = split_internal(&linop, d, &ranges[axis][index[axis]])?;
        }
        let slices = |side: &Dims| -> Vec<Range<usize>> {
            side.names()
                .iter()
                .zip(side.sizes())
                .map(|(n, &s)| match dims.iter().position(|d| d == n) {
                    Some(axis) => ranges[axis][index[axis]].clone(),
                    None => 0..s,
                })
                .collect()
        };
        tiles.push(Tile {
            index: index.clone(),
            islices: slices(op.idims()),
            oslices: slices(op.odims()),
            linop,
        });
        for axis in (0..shape.len()).rev() {
            index[axis] += 1;
            if index[axis] < shape[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
    Ok(SplitGrid { dims, shape, tiles })
}
