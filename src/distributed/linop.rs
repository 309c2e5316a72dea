//! [`create_distributed_linop`]: a batched linear operator whose tiles run on several
//! processes, each on a device of its own.
//!
//! Rules:
//! - SPMD: every rank of the communicator builds the same operator and calls
//!   [`create_distributed_linop`] with the same spec; every rank then calls
//!   [`DistributedLinop::apply`] (or `apply_all`) together. The operator is split exactly as
//!   [`split_linop`] splits it; a rank keeps only the tiles its
//!   [`RankMatrix`] entries name (repeated along each axis like a
//!   [`DeviceMatrix`](crate::linop::DeviceMatrix)), placed on the entry's device and split
//!   further by the spec's `local` specs, exactly as
//!   [`create_batched_linop`](crate::linop::create_batched_linop) places tiles.
//! - Data: the input lives on the base rank (host memory there). Each rank with tiles gets the
//!   smallest box of the input its tiles read, sent point to point from the base rank, or the
//!   whole input by broadcast when every such rank reads all of it; each rank applies its tiles
//!   to their input slices, and the results meet on the base rank. Dims split in the output (batch or output dims: `Concat` in a single process)
//!   become a gather to the base rank; dims split only in the input or inside the operator
//!   (`Add`) become a sum: `MPI_Reduce` (`MPI_Allreduce` for `apply_all`) when no output dim
//!   is split, else each rank's partial blocks are gathered and summed on the base rank.
//!   Complex values travel as pairs of reals, so sums are exact complex sums.
//! - Errors never hang the others: the ranks agree (`MPI_Allreduce`) on whether every rank's
//!   checks and input succeeded before the input moves, and on whether its tiles succeeded
//!   before the results meet; a failing rank returns its error and the others
//!   [`Error::PeerFailed`] naming it. They also agree that they passed the same operator dims
//!   and element type, batch sizes, rank matrix and base rank (else every rank returns
//!   [`Error::InvalidArgument`]); `local` specs may differ between ranks. A rank that dies
//!   outright is MPI's business (mpirun ends the job).
//! - MPI messages carry at most `i32::MAX` scalars: the broadcast and the sum go in chunks.
//!   The gather counts bytes in `int`s, so an operator whose gathered partial blocks exceed
//!   `i32::MAX` bytes is an [`Error::InvalidArgument`] from [`create_distributed_linop`] on
//!   every rank alike (split the output finer): the ranks decide it from the spec alone.
//! - `local` specs follow [`create_batched_linop`](crate::linop::create_batched_linop)'s
//!   rules: every dim must be known to the operator, and their device matrices are checked
//!   against the grids of all the tiles they split (on every rank, not only the tiles it
//!   holds).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use ::mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use ::mpi::datatype::{Equivalence, PartitionMut};
use ::mpi::point_to_point::{Destination, Source};
use ::mpi::topology::{Communicator, SimpleCommunicator};

use super::raw::{agree, PrivateComm};
use crate::device::{Device, DeviceSpec};
use crate::error::{Error, Result};
use crate::linop::{
    check_device_matrices, check_grid_fits, check_specs, dim_role, grid_entry, numel, place_tile,
    split_linop, Array, BatchSpec, DimRole, Dims, Field, LinopRef, Tile,
};

/// Where a tile runs: a rank of the communicator and a device of that rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankDevice {
    /// The rank.
    pub rank: i32,
    /// The device on that rank.
    pub device: Device,
}

impl RankDevice {
    /// `device` on `rank`.
    pub fn new(rank: i32, device: Device) -> Self {
        RankDevice { rank, device }
    }
}

/// An n-d grid of (rank, device) entries, row-major, placing tiles like a
/// [`DeviceMatrix`](crate::linop::DeviceMatrix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankMatrix {
    shape: Vec<usize>,
    entries: Vec<RankDevice>,
}

impl RankMatrix {
    /// A grid of `shape` holding `entries` in row-major order.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the grid is empty or `entries.len()` is not the product
    /// of `shape` (or the product overflows).
    pub fn new(shape: &[usize], entries: Vec<RankDevice>) -> Result<Self> {
        let n = numel(shape)?;
        if n == 0 || n != entries.len() {
            return Err(Error::invalid(format!(
                "a rank matrix of shape {shape:?} needs {n} > 0 entries, got {}",
                entries.len()
            )));
        }
        Ok(RankMatrix { shape: shape.to_vec(), entries })
    }

    /// A 1-d grid with one entry per rank `0..ranks`, all on `device`.
    ///
    /// # Errors
    ///
    /// As [`RankMatrix::new`].
    pub fn one_per_rank(ranks: i32, device: Device) -> Result<Self> {
        let entries: Vec<RankDevice> = (0..ranks).map(|r| RankDevice::new(r, device)).collect();
        Self::new(&[entries.len()], entries)
    }

    /// The grid's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The entries in row-major order.
    pub fn entries(&self) -> &[RankDevice] {
        &self.entries
    }
}

/// How to split an operator over ranks. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct DistributedBatchSpec {
    /// `(dim, batch size)` pairs; the tile grid's axes follow this order.
    pub batch_sizes: Vec<(String, usize)>,
    /// Where the tiles run.
    pub ranks: RankMatrix,
    /// The rank holding the input and receiving the result.
    pub base_rank: i32,
    /// Specs applied to each tile on its rank (a further split over that rank's devices).
    pub local: Vec<BatchSpec>,
}

impl DistributedBatchSpec {
    /// A spec splitting by `batch_sizes` over `ranks`, with base rank 0 and no local specs.
    pub fn new<S: AsRef<str>>(batch_sizes: &[(S, usize)], ranks: RankMatrix) -> Self {
        DistributedBatchSpec {
            batch_sizes: batch_sizes.iter().map(|(d, b)| (d.as_ref().to_owned(), *b)).collect(),
            ranks,
            base_rank: 0,
            local: Vec::new(),
        }
    }

    /// The spec with the data on `rank`.
    pub fn base_rank(mut self, rank: i32) -> Self {
        self.base_rank = rank;
        self
    }

    /// The spec with `local` specs applied to each tile on its rank.
    pub fn local(mut self, local: Vec<BatchSpec>) -> Self {
        self.local = local;
        self
    }
}

/// A tile this rank computes.
#[derive(Debug)]
struct LocalTile<T: Field> {
    op: LinopRef<T>,
    islices: Vec<Range<usize>>,
    /// The tile's output block (index into `DistributedLinop::blocks`).
    block: usize,
}

/// How results meet on the base rank.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Assembly {
    /// Every tile writes the whole output: sum with `MPI_Reduce`.
    Reduce,
    /// Tiles write blocks: gather each rank's partial blocks, sum them on the base rank.
    Gather(GatherPlan),
}

/// The byte counts of a gather of every rank's partial blocks to the base rank, fixed when the
/// operator is made (the same on every rank).
#[derive(Clone, Debug, PartialEq, Eq)]
struct GatherPlan {
    /// Bytes each rank sends.
    counts: Vec<i32>,
    /// Where each rank's bytes start in the gathered buffer.
    displs: Vec<i32>,
    /// Elements gathered in all.
    total: usize,
}

/// The most bytes one gather may collect: MPI counts and displacements are `int`s.
const GATHER_LIMIT: usize = i32::MAX as usize;

/// The gather of the partial `blocks` each rank holds (`rank_blocks`), for elements of
/// `elem` bytes, or an error when it would collect more than `limit` bytes. A function of
/// the spec alone, so every rank decides alike.
fn gather_plan(
    blocks: &[Vec<Range<usize>>],
    rank_blocks: &[Vec<usize>],
    elem: usize,
    limit: usize,
) -> Result<GatherPlan> {
    let too_big = || {
        Error::invalid(format!(
            "gathering the partial output blocks takes more than {limit} bytes, MPI's int count \
             limit: split the output dims finer"
        ))
    };
    let block_len =
        |b: usize| -> Option<usize> { blocks[b].iter().try_fold(1usize, |acc, r| acc.checked_mul(r.len())) };
    let mut counts = Vec::with_capacity(rank_blocks.len());
    let mut displs = Vec::with_capacity(rank_blocks.len());
    let mut total = 0usize;
    for held in rank_blocks {
        let n = held.iter().try_fold(0usize, |acc, &b| acc.checked_add(block_len(b)?)).ok_or_else(too_big)?;
        let start = total.checked_mul(elem).ok_or_else(too_big)?;
        total = total.checked_add(n).ok_or_else(too_big)?;
        let end = total.checked_mul(elem).ok_or_else(too_big)?;
        if end > limit {
            return Err(too_big());
        }
        let as_int = |bytes: usize| i32::try_from(bytes).map_err(|_| too_big());
        counts.push(as_int(end - start)?);
        displs.push(as_int(start)?);
    }
    Ok(GatherPlan { counts, displs, total })
}

/// A linear operator whose tiles run on several ranks. See the [module docs](self).
#[derive(Debug)]
pub struct DistributedLinop<T: Field> {
    op: LinopRef<T>,
    spec: DistributedBatchSpec,
    comm: PrivateComm,
    /// Host memory of this rank: the input copy and the results live here.
    host: DeviceSpec,
    idims: Dims,
    odims: Dims,
    tiles: Vec<LocalTile<T>>,
    /// The output region of every block, in block order.
    blocks: Vec<Vec<Range<usize>>>,
    /// For every rank, the blocks it holds partial sums of (sorted).
    rank_blocks: Vec<Vec<usize>>,
    /// For every rank, the box of the input its tiles read (`None`: it has no tiles).
    rank_inputs: Vec<Option<Vec<Range<usize>>>>,
    /// Whether ranks get only their input boxes (point-to-point) rather than the whole input
    /// (broadcast): when some rank with tiles reads less than the whole input.
    scatter: bool,
    assembly: Assembly,
}

/// Splits `op` by `spec` over the ranks of `comm` (collective: every rank calls it with the
/// same operator and spec). See the [module docs](self).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a rank outside the communicator, a rank matrix that does
/// not fit the tile grid, an unknown dim or a batch size of 0 (in the spec or its `local`
/// specs), a `local` device matrix with an entry no tile uses, partial output blocks too
/// large for one gather (more than `i32::MAX` bytes), or ranks that passed operators of
/// different dims or specs of different batch sizes, rank matrices or base ranks; the errors
/// of splitting and placing the tiles. A rank whose own checks or placing fail returns its
/// error, and the others [`Error::PeerFailed`] naming it.
pub fn create_distributed_linop<T: Field>(
    op: LinopRef<T>,
    spec: &DistributedBatchSpec,
    comm: &impl Communicator,
) -> Result<DistributedLinop<T>> {
    // Collective, and it cannot fail on bad input: first, so that every rank reaches the
    // agreements below whatever its own checks decide (a rank's `local` specs are its own, so
    // their checks may fail on it alone).
    let comm = PrivateComm::duplicate(comm);
    // The shared arguments before any rank's own checks: a mismatch that also fails one
    // rank's checks (a batch size of 0, a base rank out of range there) is still reported as
    // the mismatch, on every rank alike.
    agree_on_spec(&comm, spec_fingerprint(&op, spec))?;
    let planned = plan(&op, spec, comm.size(), comm.rank());
    agree(&comm, planned.as_ref().err(), "checking the operator and spec failed")?;
    let plan = planned?;
    let placed = place_local(plan.mine, &spec.local);
    agree(&comm, placed.as_ref().err(), "placing its tiles failed")?;
    let (host, tiles) = placed?;
    Ok(DistributedLinop {
        idims: op.idims().clone(),
        odims: op.odims().clone(),
        op,
        spec: spec.clone(),
        comm,
        host,
        tiles,
        blocks: plan.blocks,
        rank_blocks: plan.rank_blocks,
        rank_inputs: plan.rank_inputs,
        scatter: plan.scatter,
        assembly: plan.assembly,
    })
}

/// What [`plan`] decides: who computes which tiles, and how inputs and results move.
struct Plan<T: Field> {
    /// This rank's tiles: (rank-matrix entry, device, tile, output block).
    mine: Vec<(usize, Device, Tile<T>, usize)>,
    blocks: Vec<Vec<Range<usize>>>,
    rank_blocks: Vec<Vec<usize>>,
    rank_inputs: Vec<Option<Vec<Range<usize>>>>,
    scatter: bool,
    assembly: Assembly,
}

/// Checks `spec` against `op` and a communicator of `size` ranks, splits `op`, and plans the
/// data movement for rank `me`. No MPI call: a function of its arguments alone.
fn plan<T: Field>(op: &LinopRef<T>, spec: &DistributedBatchSpec, size: i32, me: i32) -> Result<Plan<T>> {
    if !(0..size).contains(&spec.base_rank) {
        return Err(Error::invalid(format!("base rank {} of a communicator of {size}", spec.base_rank)));
    }
    if let Some(bad) = spec.ranks.entries.iter().find(|e| !(0..size).contains(&e.rank)) {
        return Err(Error::invalid(format!(
            "the rank matrix names rank {} of a communicator of {size}",
            bad.rank
        )));
    }
    let grid = split_linop(op.as_ref(), &spec.batch_sizes)?;
    check_grid_fits(&spec.ranks.shape, &grid.dims, std::slice::from_ref(&grid.shape))?;
    check_specs(op.as_ref(), &spec.local)?;
    check_device_matrices(grid.tiles.iter().map(|t| Arc::clone(&t.linop)).collect(), &spec.local, false)?;
    let output_split =
        grid.dims.iter().any(|d| matches!(dim_role(op.as_ref(), d), DimRole::Both | DimRole::Output));
    let mut blocks: Vec<Vec<Range<usize>>> = Vec::new();
    let mut rank_blocks: Vec<Vec<usize>> = vec![Vec::new(); usize::try_from(size).unwrap_or(0)];
    let mut mine = Vec::new();
    let mut rank_inputs: Vec<Option<Vec<Range<usize>>>> = vec![None; rank_blocks.len()];
    for tile in grid.tiles {
        let block = match blocks.iter().position(|b| *b == tile.oslices) {
            Some(b) => b,
            None => {
                blocks.push(tile.oslices.clone());
                blocks.len() - 1
            }
        };
        let entry = grid_entry(&spec.ranks.shape, &tile.index);
        let placement = spec.ranks.entries[entry];
        let r = usize::try_from(placement.rank).unwrap_or(0);
        if !rank_blocks[r].contains(&block) {
            rank_blocks[r].push(block);
        }
        rank_inputs[r] = Some(match rank_inputs[r].take() {
            None => tile.islices.clone(),
            Some(b) => {
                b.iter().zip(&tile.islices).map(|(a, t)| a.start.min(t.start)..a.end.max(t.end)).collect()
            }
        });
        if placement.rank == me {
            mine.push((entry, placement.device, tile, block));
        }
    }
    for held in &mut rank_blocks {
        held.sort_unstable();
    }
    let whole: Vec<Range<usize>> = op.idims().sizes().iter().map(|&n| 0..n).collect();
    let scatter = rank_inputs.iter().flatten().any(|b| *b != whole);
    let assembly = if output_split {
        Assembly::Gather(gather_plan(&blocks, &rank_blocks, std::mem::size_of::<T>(), GATHER_LIMIT)?)
    } else {
        Assembly::Reduce
    };
    Ok(Plan { mine, blocks, rank_blocks, rank_inputs, scatter, assembly })
}

/// A 64-bit FNV-1a hash of what every rank's plan of the data movement depends on: the
/// operator's dims, the batch sizes, the rank matrix's shape and ranks, the base rank and the
/// element type (by name: `f64` and `Complex<f32>` have one size but are not one type). Not
/// the devices, nor the `local` specs: those are each rank's own business.
fn spec_fingerprint<T: Field>(op: &LinopRef<T>, spec: &DistributedBatchSpec) -> u64 {
    let ranks: Vec<i32> = spec.ranks.entries.iter().map(|e| e.rank).collect();
    let text = format!(
        "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}",
        op.idims(),
        op.odims(),
        spec.batch_sizes,
        spec.ranks.shape,
        ranks,
        spec.base_rank,
        T::NAME
    );
    text.bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Agrees over `comm` (collective) that every rank's [`spec_fingerprint`] is the same: ranks
/// planning different messages would mismatch counts (an MPI error that aborts the job) or
/// wait for messages never sent. Every rank decides alike, from the least and greatest print.
fn agree_on_spec(comm: &SimpleCommunicator, print: u64) -> Result<()> {
    // min(!x) is !max(x): one reduction gives both ends.
    let mine = [print, !print];
    let mut least = [0u64; 2];
    comm.all_reduce_into(&mine[..], &mut least[..], SystemOperation::min());
    if least[0] != !least[1] {
        return Err(Error::invalid(
            "the ranks passed operators of different dims or element types, or specs of different \
             batch sizes, rank matrices or base ranks (every rank must pass the same)",
        ));
    }
    Ok(())
}

/// This rank's host spec and its tiles placed on their devices (one spec per rank-matrix
/// entry, so tiles of different entries run concurrently).
fn place_local<T: Field>(
    mine: Vec<(usize, Device, Tile<T>, usize)>,
    local: &[BatchSpec],
) -> Result<(DeviceSpec, Vec<LocalTile<T>>)> {
    let host = DeviceSpec::new(Device::Host)?;
    let mut entry_specs: BTreeMap<usize, DeviceSpec> = BTreeMap::new();
    let mut tiles = Vec::with_capacity(mine.len());
    for (entry, device, tile, block) in mine {
        let dev = match entry_specs.get(&entry) {
            Some(d) => d.clone(),
            None => {
                let d = DeviceSpec::new(device)?;
                entry_specs.insert(entry, d.clone());
                d
            }
        };
        let op = place_tile(&tile.linop, local, &host, &dev)?;
        tiles.push(LocalTile { op, islices: tile.islices, block });
    }
    Ok((host, tiles))
}

impl<T: Field> DistributedLinop<T> {
    /// The input dims.
    pub fn idims(&self) -> &Dims {
        &self.idims
    }

    /// The output dims.
    pub fn odims(&self) -> &Dims {
        &self.odims
    }

    /// The base rank.
    pub fn base_rank(&self) -> i32 {
        self.spec.base_rank
    }

    /// Number of tiles this rank computes.
    pub fn local_tiles(&self) -> usize {
        self.tiles.len()
    }

    /// Whether results are summed with `MPI_Reduce` (no output dim is split) rather than
    /// gathered.
    pub fn reduces(&self) -> bool {
        self.assembly == Assembly::Reduce
    }

    /// Whether each rank receives only the box of the input its tiles read (point-to-point
    /// from the base rank) rather than the whole input (a broadcast).
    pub fn scatters_input(&self) -> bool {
        self.scatter
    }

    /// The adjoint, distributed by the same spec (collective).
    ///
    /// # Errors
    ///
    /// As [`create_distributed_linop`].
    pub fn adjoint(&self) -> Result<DistributedLinop<T>> {
        create_distributed_linop(self.op.adjoint(), &self.spec, &self.comm.0)
    }

    /// `A x` (collective): `x` is read on the base rank (other ranks pass `None`, or anything:
    /// it is ignored there); the result comes back on the base rank (`None` elsewhere).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on the base rank when `x` is missing or not shaped like the
    /// input dims; the errors of the tiles on the rank they happen; [`Error::PeerFailed`] on
    /// the other ranks when one failed.
    pub fn apply(&self, x: Option<&Array<T>>) -> Result<Option<Array<T>>> {
        self.run(x, false)
    }

    /// `A x` with the result on every rank (collective); otherwise as
    /// [`DistributedLinop::apply`].
    ///
    /// # Errors
    ///
    /// As [`DistributedLinop::apply`].
    pub fn apply_all(&self, x: Option<&Array<T>>) -> Result<Array<T>> {
        self.run(x, true)?.ok_or_else(|| Error::invalid("apply_all lost its result"))
    }

    fn run(&self, x: Option<&Array<T>>, everywhere: bool) -> Result<Option<Array<T>>> {
        if scalar_bytes::<T>() == 8 {
            self.run_as::<f64>(x, everywhere)
        } else {
            self.run_as::<f32>(x, everywhere)
        }
    }

    /// The whole protocol with `S` (f32 or f64) as the wire scalar of `T`.
    fn run_as<S: Equivalence + bytemuck::Pod>(
        &self,
        x: Option<&Array<T>>,
        everywhere: bool,
    ) -> Result<Option<Array<T>>> {
        let me = self.comm.rank();
        let base = self.spec.base_rank;
        let root = self.comm.process_at_rank(base);
        // 1. The base rank's input, checked, agreed on, then broadcast, or each rank's box
        //    of it sent to that rank.
        //    Only the base rank holds the whole input before the broadcast, and only when
        //    broadcasting do the others make room for all of it.
        let mut input = Vec::new();
        let local: Result<()> =
            if me == base { read_input(x, &self.idims).map(|v| input = v) } else { Ok(()) };
        agree(&self.comm, local.as_ref().err(), "its input was rejected")?;
        let (input, input_box) = if self.scatter {
            self.scatter_input::<S>(input)?
        } else {
            if me != base {
                input = vec![T::zero(); self.idims.numel()];
            }
            broadcast(&root, as_scalars_mut::<T, S>(&mut input)?);
            (input, self.idims.sizes().iter().map(|&n| 0..n).collect())
        };
        // 2. This rank's tiles, summed per output block.
        let partial = self.compute(&input, &input_box);
        agree(&self.comm, partial.as_ref().err(), "one of its tiles failed")?;
        let partial = partial?;
        // 3. The results meet.
        let out_len = self.odims.numel();
        let result = match &self.assembly {
            Assembly::Reduce => {
                let mine =
                    partial.into_iter().next().map(|(_, v)| v).unwrap_or_else(|| vec![T::zero(); out_len]);
                let mut out = if everywhere || me == base { Some(vec![T::zero(); out_len]) } else { None };
                sum_to(
                    &self.comm,
                    &root,
                    everywhere,
                    as_scalars::<T, S>(&mine)?,
                    out.as_deref_mut().map(as_scalars_mut::<T, S>).transpose()?,
                );
                out
            }
            Assembly::Gather(plan) => {
                let mut out = self.gather(&root, plan, partial);
                if everywhere {
                    let buf = out.get_or_insert_with(|| vec![T::zero(); out_len]);
                    broadcast(&root, as_scalars_mut::<T, S>(buf)?);
                }
                out
            }
        };
        result.map(|v| Array::from_slice(&self.host, self.odims.sizes(), &v)).transpose()
    }

    /// Applies every local tile to its slice of `input`; sums per block, in block order.
    fn compute(&self, input: &[T], input_box: &[Range<usize>]) -> Result<Vec<(usize, Vec<T>)>> {
        if self.tiles.is_empty() {
            return Ok(Vec::new());
        }
        let shape: Vec<usize> = input_box.iter().map(|r| r.len()).collect();
        let x = Array::from_slice(&self.host, &shape, input)?;
        let mut outs = Vec::with_capacity(self.tiles.len());
        for t in &self.tiles {
            let mut xt = x.clone();
            for (axis, (r, b)) in t.islices.iter().zip(input_box).enumerate() {
                xt = xt.slice(axis, r.start - b.start..r.end - b.start)?;
            }
            // Queued on the tiles' streams: tiles on different devices run concurrently.
            outs.push((t.block, t.op.apply(&xt)?));
        }
        let mut sums: BTreeMap<usize, Vec<T>> = BTreeMap::new();
        for (block, y) in outs {
            let y = y.to_vec()?;
            match sums.get_mut(&block) {
                Some(acc) => acc.iter_mut().zip(y).for_each(|(a, b)| *a += b),
                None => {
                    sums.insert(block, y);
                }
            }
        }
        Ok(sums.into_iter().collect())
    }

    /// Sends every rank with tiles its box of the input (the base rank's `input`; empty
    /// elsewhere); returns this rank's box and its contents.
    fn scatter_input<S: Equivalence + bytemuck::Pod>(
        &self,
        input: Vec<T>,
    ) -> Result<(Vec<T>, Vec<Range<usize>>)> {
        let me = self.comm.rank();
        let base = self.spec.base_rank;
        let box_len = |b: &[Range<usize>]| -> usize { b.iter().map(|r| r.len()).product() };
        let mine = self.rank_inputs.get(usize::try_from(me).unwrap_or(0)).cloned().flatten();
        if me == base {
            for (r, b) in self.rank_inputs.iter().enumerate() {
                let (Some(b), Ok(rank)) = (b, i32::try_from(r)) else { continue };
                if rank == base {
                    continue;
                }
                let part = take_block(&input, self.idims.sizes(), b);
                let dest = self.comm.process_at_rank(rank);
                for chunk in as_scalars::<T, S>(&part)?.chunks(CHUNK) {
                    dest.send(chunk);
                }
            }
            return Ok(match mine {
                Some(b) => (take_block(&input, self.idims.sizes(), &b), b),
                None => (Vec::new(), Vec::new()),
            });
        }
        let Some(b) = mine else { return Ok((Vec::new(), Vec::new())) };
        let mut part = vec![T::zero(); box_len(&b)];
        let root = self.comm.process_at_rank(base);
        for chunk in as_scalars_mut::<T, S>(&mut part)?.chunks_mut(CHUNK) {
            root.receive_into(chunk);
        }
        Ok((part, b))
    }

    /// Gathers every rank's partial blocks on the base rank (by `plan`, made with the
    /// operator, so every rank takes part) and sums them into the output.
    fn gather<R: Root>(&self, root: &R, plan: &GatherPlan, partial: Vec<(usize, Vec<T>)>) -> Option<Vec<T>> {
        let send: Vec<T> = partial.into_iter().flat_map(|(_, v)| v).collect();
        if self.comm.rank() != self.spec.base_rank {
            root.gather_varcount_into(as_bytes(&send));
            return None;
        }
        let block_len = |b: usize| -> usize { self.blocks[b].iter().map(|r| r.len()).product() };
        let mut recv = vec![T::zero(); plan.total];
        {
            let mut partition =
                PartitionMut::new(as_bytes_mut(&mut recv), plan.counts.clone(), plan.displs.clone());
            root.gather_varcount_into_root(as_bytes(&send), &mut partition);
        }
        let mut out = vec![T::zero(); self.odims.numel()];
        let mut at = 0;
        for held in &self.rank_blocks {
            for &b in held {
                let n = block_len(b);
                add_block(&mut out, self.odims.sizes(), &self.blocks[b], &recv[at..at + n]);
                at += n;
            }
        }
        Some(out)
    }
}

/// The base rank's input as a row-major vector, checked against `idims`.
fn read_input<T: Field>(x: Option<&Array<T>>, idims: &Dims) -> Result<Vec<T>> {
    let x = x.ok_or_else(|| Error::invalid("the base rank must pass the input"))?;
    if x.shape() != idims.sizes() {
        return Err(Error::invalid(format!(
            "the distributed operator expects an input of dims {idims}, got shape {:?}",
            x.shape()
        )));
    }
    x.to_vec()
}

/// Calls `row(start, k)` for every row of `region` (its last axis) inside a row-major array of
/// `shape`: `start` is the row's offset in the array, `k` its index among the region's rows.
/// Returns the row length (0 when the region is empty); a 0-d array is one row of length 1.
fn for_each_row(shape: &[usize], region: &[Range<usize>], mut row: impl FnMut(usize, usize)) -> usize {
    let ndim = shape.len();
    if ndim == 0 {
        row(0, 0);
        return 1;
    }
    let len = region[ndim - 1].len();
    let rows: usize = region[..ndim - 1].iter().map(|r| r.len()).product();
    if len == 0 || rows == 0 {
        return 0;
    }
    let mut strides = vec![1usize; ndim];
    for a in (0..ndim - 1).rev() {
        strides[a] = strides[a + 1] * shape[a + 1];
    }
    let mut index: Vec<usize> = region.iter().map(|r| r.start).collect();
    for k in 0..rows {
        row(index.iter().zip(&strides).map(|(i, s)| i * s).sum(), k);
        // Next row: advance the outer axes (the last axis is covered by the row).
        for a in (0..ndim - 1).rev() {
            index[a] += 1;
            if index[a] < region[a].end {
                break;
            }
            index[a] = region[a].start;
        }
    }
    len
}

/// Adds `block` (row-major, shaped by `region`) into `out` (row-major, shaped by `shape`).
fn add_block<T: Field>(out: &mut [T], shape: &[usize], region: &[Range<usize>], block: &[T]) {
    let len = region.last().map_or(1, |r| r.len());
    for_each_row(shape, region, |start, k| {
        out[start..start + len].iter_mut().zip(&block[k * len..(k + 1) * len]).for_each(|(o, b)| *o += *b);
    });
}

/// The elements of `region` of `data` (row-major, shaped by `shape`), row-major.
fn take_block<T: Field>(data: &[T], shape: &[usize], region: &[Range<usize>]) -> Vec<T> {
    let len = region.last().map_or(1, |r| r.len());
    let mut out = Vec::with_capacity(region.iter().map(|r| r.len()).product());
    for_each_row(shape, region, |start, _| out.extend_from_slice(&data[start..start + len]));
    out
}

/// Bytes of one real scalar of `T` (a complex value is two).
fn scalar_bytes<T: Field>() -> usize {
    std::mem::size_of::<T>() / if T::IS_COMPLEX { 2 } else { 1 }
}

fn as_scalars<T: Field, S: bytemuck::Pod>(v: &[T]) -> Result<&[S]> {
    bytemuck::try_cast_slice(v).map_err(|e| Error::invalid(format!("{} as MPI scalars: {e}", T::NAME)))
}

fn as_scalars_mut<T: Field, S: bytemuck::Pod>(v: &mut [T]) -> Result<&mut [S]> {
    bytemuck::try_cast_slice_mut(v).map_err(|e| Error::invalid(format!("{} as MPI scalars: {e}", T::NAME)))
}

fn as_bytes<T: Field>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn as_bytes_mut<T: Field>(v: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

/// Scalars per MPI call: well inside `int` counts.
const CHUNK: usize = 1 << 28;

/// `MPI_Bcast` from `root`, in chunks.
fn broadcast<R: Root, S: Equivalence>(root: &R, data: &mut [S]) {
    for chunk in data.chunks_mut(CHUNK) {
        root.broadcast_into(chunk);
    }
}

/// Sums `mine` over the ranks into `out`: on the root (`MPI_Reduce`), or on every rank
/// (`MPI_Allreduce`) when `everywhere`. `out` is `Some` exactly where the sum lands.
fn sum_to<R: Root, S: Equivalence>(
    comm: &SimpleCommunicator,
    root: &R,
    everywhere: bool,
    mine: &[S],
    mut out: Option<&mut [S]>,
) {
    for (i, chunk) in mine.chunks(CHUNK).enumerate() {
        let range = i * CHUNK..i * CHUNK + chunk.len();
        match (&mut out, everywhere) {
            (Some(out), true) => comm.all_reduce_into(chunk, &mut out[range], SystemOperation::sum()),
            (Some(out), false) => root.reduce_into_root(chunk, &mut out[range], SystemOperation::sum()),
            (None, _) => root.reduce_into(chunk, SystemOperation::sum()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{add_block, gather_plan, take_block, GatherPlan, GATHER_LIMIT};
    use std::ops::Range;

    /// The gather's size limit is decided from the spec alone (so on every rank alike, before
    /// any collective call), counted in bytes over all ranks; here with a lowered limit.
    #[test]
    fn gather_plan_counts_bytes_and_rejects_gathers_past_the_limit() {
        let blocks: Vec<Vec<Range<usize>>> = vec![vec![0..2, 0..3], vec![2..4, 0..3]];
        let rank_blocks = vec![vec![0], vec![0, 1], vec![]];
        let want = GatherPlan { counts: vec![48, 96, 0], displs: vec![0, 48, 144], total: 18 };
        assert_eq!(gather_plan(&blocks, &rank_blocks, 8, 144).unwrap(), want);
        assert_eq!(gather_plan(&blocks, &rank_blocks, 8, GATHER_LIMIT).unwrap(), want);
        let r = gather_plan(&blocks, &rank_blocks, 8, 143);
        assert!(
            matches!(&r, Err(crate::Error::InvalidArgument { what }) if what.contains("split the output")),
            "{r:?}"
        );
        // Sizes past usize are an error too, not a wrapped count.
        let huge: Vec<Vec<Range<usize>>> = vec![vec![0..usize::MAX, 0..2]];
        assert!(gather_plan(&huge, &[vec![0]], 1, GATHER_LIMIT).is_err());
    }

    /// `add_block` against a plain loop over every element of the output.
    #[test]
    fn add_block_and_take_block_touch_exactly_the_region() {
        let shape = [3usize, 4, 5];
        let region: [Range<usize>; 3] = [1..3, 0..4, 2..4];
        let block: Vec<f64> = (0..2 * 4 * 2).map(|v| f64::from(v) + 0.5).collect();
        let mut out = vec![1.0f64; 60];
        add_block(&mut out, &shape, &region, &block);
        let mut k = 0;
        for i in 0..3 {
            for j in 0..4 {
                for l in 0..5 {
                    let inside = region[0].contains(&i) && region[1].contains(&j) && region[2].contains(&l);
                    let want = if inside {
                        let b = ((i - 1) * 4 + j) * 2 + (l - 2);
                        1.0 + block[b]
                    } else {
                        1.0
                    };
                    assert_eq!(out[k], want, "element ({i}, {j}, {l})");
                    k += 1;
                }
            }
        }
        // take_block reads the same elements back, in the block's order.
        let data: Vec<f64> = (0..60).map(f64::from).collect();
        let taken = take_block(&data, &shape, &region);
        let mut want = Vec::new();
        for i in region[0].clone() {
            for j in region[1].clone() {
                for l in region[2].clone() {
                    want.push(data[(i * 4 + j) * 5 + l]);
                }
            }
        }
        assert_eq!(taken, want);
        // A 0-d output and an empty region.
        let mut scalar = vec![2.0f64];
        add_block(&mut scalar, &[], &[], &[3.0]);
        assert_eq!(scalar, [5.0]);
        let mut untouched = vec![1.0f64; 6];
        add_block(&mut untouched, &[2, 3], &[0..2, 1..1], &[]);
        assert_eq!(untouched, [1.0; 6]);
    }
}
