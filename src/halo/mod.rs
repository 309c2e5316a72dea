//! Halo pack/unpack: the regions of many arrays into ONE contiguous buffer, and back.
//!
//! A [`HaloSpec`] describes an array's layout (shape, strides in elements, element type, which
//! dims are the horizontal x and y). A [`HaloExchange`] names a region to pack, the clockwise
//! quarter turns that bring it into the receiver's frame, and the region to unpack into. A
//! [`HaloPacker`] built from a list of exchanges packs one array per exchange into its pack
//! buffer and unpacks its unpack buffer into one array per exchange, asynchronously, on the
//! host backend or on CUDA.
//!
//! Rules (the project's fixed conventions: the tests' scalar references follow them):
//! - Rotation: a clockwise quarter turn maps element (i, j) of the result to element
//!   (nx-1-j, i) of the source ((i, j) index x and y; numpy's `rot90(a, k=-1, axes=(x, y))`);
//!   k turns are k applications. Arrays with one horizontal dim flip as numpy's lone axis: a
//!   quarter turn flips an x-only array along x (k=1) or a y-only array along y (k=3), a half
//!   turn flips every horizontal dim present.
//! - Vector quantities (x and y component arrays) turn both arrays, then the components:
//!   k=1: (u, v) -> (v, -u); k=2: (-u, -v); k=3: (-v, u). This needs a signed element type
//!   (f32, f64, i32); u8 and raw elements are rejected for vectors.
//! - Pack order: quantities in the order given, for each the x component then (vectors) the y
//!   component, each region in row-major (C) order of the turned region. Unpack reads the same
//!   order and writes each region in row-major order WITHOUT turning: the rotation (and the
//!   vector signs) are applied once, by the sender's pack.
//! - Everything is checked before work is queued; bad input is [`Error::InvalidArgument`],
//!   never a panic (a CUDA launch error may leave a descriptor table's upload queued). Queued work is tracked like a copy (see [`crate::memory`]), so dropping
//!   arrays or the packer while it is pending is safe.
//! - On CUDA each `pack` or `unpack` is ONE kernel launch reading a descriptor table (from
//!   device memory, or with [`DescriptorPlacement::LaunchParameters`] from the launch's
//!   parameters, up to [`MAX_INLINE_DESCRIPTORS`] regions per direction); on the
//!   host it is ONE job running loop nests planned when the packer is built (64-byte block
//!   copies of contiguous rows, length-specialised short rows, tiled transposes for turns,
//!   strided loops otherwise; AVX2 when the CPU has it), on several threads above 512 KiB, and
//!   on the calling thread when it is at most 1 MiB and the stream is idle. Buffers come from
//!   a pool keyed by (device, bytes) and go back to it when the packer is dropped; a new
//!   packer's buffers start zeroed, pooled or not (an unpack before any receive writes zeros,
//!   never an earlier packer's bytes).
//! - On CUDA, narrow runs (x-faces: a few elements per row at a pitch of kilobytes) cost a
//!   whole L2 fetch from DRAM each. The packer leaves the device's fetch granularity alone;
//!   [`Device::set_l2_fetch_granularity`] is the process-wide knob (`cuferry bench --section
//!   halo` times packs at 32 bytes next to the default).
//!
//! [`Error::InvalidArgument`]: crate::Error::InvalidArgument
//! [`Device::set_l2_fetch_granularity`]: crate::Device::set_l2_fetch_granularity
//!
//! # Examples
//!
//! A vector quantity turned once: the x slot receives the y component, the y slot the negated
//! x component.
//!
//! ```
//! use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
//! use cuferry::{Device, DeviceBuffer};
//!
//! let spec = HaloSpec::contiguous(ElementType::F32, &[2, 2], HorizontalDims::xy(0, 1))?;
//! let ex = HaloExchange::new(&spec, &[0..1, 0..1], 1, &[1..2, 1..2])?;
//! let mut packer = HaloPacker::new(Device::Host, &[ex.clone()], Some(&[ex]))?;
//! let stream = packer.stream().clone();
//! let u = DeviceBuffer::from_slice(&stream, &[1.0f32, 0.0, 0.0, 0.0])?;
//! let v = DeviceBuffer::from_slice(&stream, &[2.0f32, 0.0, 0.0, 0.0])?;
//! packer.pack(&[&u], Some(&[&v]))?;
//! let bytes = packer.pack_buffer()?.to_vec(&stream)?;
//! let packed: Vec<f32> = bytes.chunks(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
//! assert_eq!(packed, [2.0, -1.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

pub mod baseline;
mod cpu;
mod gpu;
mod packer;
mod plan;
pub(crate) mod pool;
#[cfg(test)]
mod reference;
mod spec;
mod threads;

pub use gpu::{DescriptorPlacement, MAX_INLINE_DESCRIPTORS};
pub use packer::HaloPacker;
pub use plan::{Component, PackedSlot};
pub use pool::{clear_buffer_pool, pooled_buffers, MAX_PER_KEY};
pub use spec::{ElementType, HaloExchange, HaloSpec, HorizontalDims, MAX_DIMS};
