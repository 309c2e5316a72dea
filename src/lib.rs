//! cuferry moves data on and between NVIDIA GPUs: RAII streams and events, device, pinned and
//! registered host memory, and asynchronous copies in every direction (host to device, device
//! to host, within a device, between devices). On top: the pinned slot ring ([`ring`]),
//! managed memory ([`managed`]), halo pack/unpack ([`halo`]), named linear operators split over
//! devices ([`linop`]), the C ABI ([`ffi`]), and with the `mpi` feature, halo exchange and
//! distributed operators across processes (`distributed`).
//!
//! Every capability works on two backends behind one API:
//! - [`Device::Cuda`]: cuferry's CUDA library (csrc/, compiled by nvcc at build time);
//! - [`Device::Host`]: ordinary memory and streams served by worker threads, with the same
//!   ordering rules, so the asynchronous protocols run and are tested without a GPU.
//!
//! Rules that hold everywhere:
//! - Every fallible call returns [`Result`]; a missing driver or device is a typed [`Error`],
//!   never a panic. A build without nvcc still compiles and runs the host backend; CUDA calls
//!   then report [`Error::Unsupported`].
//! - Work on a [`Stream`] runs in order; [`Event`]s order streams against each other.
//! - Buffers remember their queued uses: operations on one buffer run in the order queued, host
//!   access waits for them, and dropping a buffer waits before freeing. `Drop` never panics.
//!
//! # Examples
//!
//! A round trip through "device" memory on whatever is available:
//!
//! ```
//! use cuferry::{copy, Device, DeviceBuffer, PinnedBuffer, Stream};
//!
//! let device = if cuferry::Device::cuda_count() > 0 { Device::Cuda(0) } else { Device::Host };
//! let stream = Stream::new(device)?;
//! let src = PinnedBuffer::from_slice(device, &[1.0f32, 2.0, 3.0])?;
//! let mut dev = DeviceBuffer::<f32>::zeroed(&stream, 3)?;
//! let mut back = PinnedBuffer::<f32>::zeroed(device, 3)?;
//! copy(&stream, &src, &mut dev)?;
//! copy(&stream, &dev, &mut back)?;
//! assert_eq!(back.as_slice()?, &[1.0, 2.0, 3.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

pub mod copy;
mod cuda;
pub mod device;
#[cfg(feature = "mpi")]
pub mod distributed;
mod error;
pub mod event;
pub mod ffi;
pub mod halo;
pub mod kernels;
pub mod linop;
pub mod managed;
pub mod memory;
mod monitor;
pub mod ring;
pub mod stream;
/// cbindgen:ignore
#[doc(hidden)]
pub mod sys;
mod topology;
mod work_queue;

pub use copy::{copy, copy_range, copy_ranges, CopyBatch, CopyDirection, CopyRange};
pub use device::{
    can_access_peer, cuda_build_note, cuda_built, cuda_driver_version, cuda_runtime_version,
    enable_peer_access, CudaVersion, Device, DeviceProperties, DeviceSpec, HostWait, MemoryInfo,
    MAX_L2_FETCH_GRANULARITY,
};
pub use error::{take_drop_error, Error, Result};
pub use event::Event;
pub use memory::{
    DeviceBuffer, Element, ForeignBuffer, HostRegistration, Memory, MemoryKind, PinnedBuffer, PinnedOptions,
    WriteShared, MAX_ELEMENT_ALIGN,
};
/// The complex numbers of linop's complex fields (`Complex<f32>`, `Complex<f64>`), re-exported
/// so that a user needs no dependency of a matching version: `cuferry::num_complex::Complex64`.
pub use num_complex;
pub use stream::Stream;
pub use topology::{topology, DeviceLinks, Topology};

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
