//! Named linear operators, split into tiles and spread over devices.
//!
//! An operator ([`Linop`]) maps arrays with named dimensions ([`Dims`]) to arrays with named
//! dimensions: [`Identity`], [`Scalar`], [`Zero`], [`Diagonal`], [`Dense`], and the combinators
//! [`Chain`], [`Add`], [`Concat`], plus [`ToDevice`], which moves data between devices.
//! [`split_linop`] cuts an operator into tiles; [`create_batched_linop`] places the tiles on
//! devices and puts them back together so that the result equals the original operator.
//!
//! Rules:
//! - Data is an [`Array`]: a view of a [`DeviceBuffer`](crate::DeviceBuffer) on a
//!   [`DeviceSpec`](crate::DeviceSpec). Element types are [`Field`]s: `f32`, `f64`,
//!   `Complex<f32>`, `Complex<f64>` (of [`crate::num_complex`], re-exported).
//! - Where work runs: an operator computes on the device of its input array, queued on the
//!   compute stream of the array's spec, and returns an array on the same spec. Only
//!   [`ToDevice`] changes the spec; a batched operator's tiles therefore compute on the
//!   compute streams of the device matrix's specs.
//! - `apply` of a plain operator queues work and returns; reading a result back
//!   ([`Array::to_vec`]) waits. Buffers order their uses across streams with events.
//! - Composite operators (`Chain`, `Add`, `Concat`, batched operators) return as soon as
//!   their work is queued: the intermediates they drop inside `apply` are handed to a
//!   background thread, which gives their memory to the allocation cache (for the next
//!   `apply`'s arrays; see [`crate::memory::release_cached_memory`]) once the work reading
//!   them has finished (see [`Array`]). The host
//!   runs at most 1024 such frees (or 4 GiB) ahead of the work; past that, `apply` waits for
//!   the work of the intermediate it drops, so a loop without read-backs paces itself.
//! - Reads share a buffer (see [`crate::memory`]): tiles that read one input, or one weight,
//!   on different specs run at once; a write still waits for every earlier read.
//! - Errors of queued work are kept by the stream they happened on, and an array's
//!   `to_vec`/`synchronize` report a pending error of its compute stream and of every stream
//!   upstream of it (a tile's job on another device included; see [`Array`]). An error is
//!   reported once, to the first reader of any array downstream of its stream: two results
//!   that share a stream (two operators on one device matrix) may each take the other's.
//!   Operators written outside cuferry mark their outputs with [`Array::computed_from`].
//! - Adjoints are conjugate transposes: every operator passes the dot test
//!   `|<Ax, y> - <x, A^H y>| <= 1e-5 |<Ax, y>|` in f64 on random data.
//! - Arithmetic on CUDA arrays runs as CUDA kernels (csrc/linop.cu; run on an H100 on
//!   2026-11-23, later changes compiled with nvcc, not run on a GPU); a build without nvcc returns
//!   [`Error::Unsupported`](crate::Error::Unsupported) ([`NO_CUDA_KERNELS`]) for it. The
//!   kernel dispatch lives in one private module (`compute`).
//!
//! # Examples
//!
//! A dense operator split into three tiles over two host "devices":
//!
//! ```
//! use cuferry::linop::{create_batched_linop, Array, BatchSpec, Dense, DeviceMatrix, Dims, Linop, LinopRef};
//! use cuferry::{Device, DeviceSpec};
//! use std::sync::Arc;
//!
//! let base = DeviceSpec::new(Device::Host)?;
//! let w: Vec<f64> = (0..12).map(f64::from).collect();
//! let w = Array::from_slice(&base, &[4, 3], &w)?;
//! let a: LinopRef<f64> =
//!     Arc::new(Dense::new(w, &["o", "i"], Dims::new(&[("i", 3)])?, Dims::new(&[("o", 4)])?)?);
//! let devices = DeviceMatrix::from_devices(&[2], &[Device::Host; 2])?;
//! let batched = create_batched_linop(Arc::clone(&a), &[BatchSpec::new(&[("o", 3)]).devices(devices).base(base.clone())])?;
//! let x = Array::from_slice(&base, &[3], &[1.0, 0.0, -1.0])?;
//! assert_eq!(batched.apply(&x)?.to_vec()?, a.apply(&x)?.to_vec()?);
//! # Ok::<(), cuferry::Error>(())
//! ```

mod add;
mod array;
mod batch;
mod chain;
mod compute;
mod concat;
mod dense;
mod diagonal;
mod dims;
mod field;
mod identity;
mod layout;
mod op;
mod split;
mod to_device;
mod transfer;
mod weight;

pub use add::Add;
#[cfg(feature = "mpi")]
pub(crate) use array::numel;
pub use array::Array;
#[cfg(feature = "mpi")]
pub(crate) use batch::{check_device_matrices, check_grid_fits, check_specs, grid_entry, place_tile};
pub use batch::{create_batched_linop, BatchSpec, DeviceMatrix};
pub use chain::Chain;
pub use compute::NO_CUDA_KERNELS;
pub use concat::Concat;
pub use dense::Dense;
pub use diagonal::Diagonal;
pub use dims::Dims;
pub use field::Field;
pub use identity::{Identity, Scalar, Zero};
pub use op::{dim_role, DimRole, Linop, LinopClone, LinopRef};
pub use split::{split_linop, tile_ranges, SplitGrid, Tile};
pub use to_device::ToDevice;
pub use transfer::transfer_stream;
