//! Beyond one process (feature `mpi`): halo exchange and distributed batched linear operators
//! over the system's MPI, through rsmpi.
//!
//! - [`HaloCommunicator`]: [`HaloPacker`](crate::halo::HaloPacker)s per message, packed,
//!   sent and received without blocking, unpacked; sends overlap the packing of later
//!   messages. CUDA buffers go to MPI directly when it is CUDA-aware, else through pinned
//!   staging ([`Staging`]).
//! - [`create_distributed_linop`]: a [`BatchSpec`](crate::linop::BatchSpec)-like split whose
//!   tiles run on (rank, device) pairs ([`RankMatrix`]); reductions become `MPI_Reduce` /
//!   `MPI_Allreduce`, concatenations a gather to the base rank.
//!
//! Rules:
//! - cuferry does not initialise MPI: the caller does (`mpi::initialize()`), and passes a
//!   communicator. Each object works on a private duplicate of it, so its messages never
//!   meet the caller's.
//! - Calls that involve other ranks are collective over the ranks concerned, and never hang
//!   on a failure that a rank can report: a failing rank tells the others, which return
//!   [`Error::PeerFailed`](crate::Error::PeerFailed); point-to-point waits also have a
//!   deadline ([`Error::Timeout`](crate::Error::Timeout)).
//! - MPI is called from the thread that calls these objects only (MPI's `THREAD_SINGLE` or
//!   `FUNNELED` suffices).
//!
//! Tests run under `mpirun` (tests/mpi_halo.rs, tests/mpi_linop.rs); the benchmark is
//! `scripts/bench-mpi.sh`.

pub mod halo;
pub mod linop;
mod raw;

pub use halo::{
    cuda_aware_mpi, ExchangeOptions, ExchangeTiming, HaloCommunicator, HaloLink, Staging, TileArrays, MAX_TAG,
};
pub use linop::{create_distributed_linop, DistributedBatchSpec, DistributedLinop, RankDevice, RankMatrix};
