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
//!   meet the caller's; dropping the object frees the duplicate, so drop it before MPI is
//!   finalised (before rsmpi's `Universe`).
//! - Calls that involve other ranks are collective over the ranks concerned, and never hang
//!   on a failure that a rank can report: a failing rank tells the others, which return
//!   [`Error::PeerFailed`](crate::Error::PeerFailed); the halo exchange's point-to-point waits
//!   also have a deadline ([`Error::Timeout`](crate::Error::Timeout)). The distributed
//!   operator's scatter uses blocking sends and receives, posted only after every rank agreed
//!   that its part can go ahead.
//! - MPI is called from the thread that calls these objects only. With MPI initialised as
//!   `THREAD_SINGLE` or `FUNNELED`, that must be the thread that initialised MPI; calling
//!   from another thread needs `THREAD_SERIALIZED` (one thread at a time) or more.
//!
//! # Examples
//!
//! A periodic ring: each rank sends its east column to the next rank, which unpacks it into
//! its west halo column (run with `mpirun -np 4`).
//!
//! ```no_run
//! use cuferry::distributed::{ExchangeOptions, HaloCommunicator, HaloLink};
//! use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
//! use cuferry::{Device, DeviceBuffer, Stream};
//! use mpi::traits::*;
//!
//! let universe = mpi::initialize().expect("MPI starts");
//! let world = universe.world();
//! let (me, size) = (world.rank(), world.size());
//! // A 4 x 6 array stored (y, x); column 4 travels east into the next rank's column 0.
//! let spec = HaloSpec::contiguous(ElementType::F64, &[4, 6], HorizontalDims::xy(1, 0))?;
//! let east = HaloExchange::new(&spec, &[0..4, 4..5], 0, &[0..4, 0..1])?;
//! let packer = || HaloPacker::new(Device::Host, std::slice::from_ref(&east), None);
//! let sends = vec![HaloLink::new((me + 1) % size, 0, 0, packer()?)];
//! let recvs = vec![HaloLink::new((me + size - 1) % size, 0, 0, packer()?)];
//! let mut comm = HaloCommunicator::new(&world, sends, recvs, ExchangeOptions::default())?;
//! let stream = Stream::new(Device::Host)?;
//! let a = DeviceBuffer::from_slice(&stream, &[f64::from(me); 24])?;
//! let timing = comm.exchange(&[&a], None)?;
//! println!("pack {:?}, transfer {:?}, unpack {:?}", timing.pack, timing.transfer, timing.unpack);
//! # Ok::<(), cuferry::Error>(())
//! ```
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
