//! Managed (unified) memory on CUDA 13 managed memory pools: stream-ordered allocation,
//! prefetch, discard and advice, one buffer at a time or in bulk.
//!
//! The seed compiled a `cudaMallocManaged` allocator at run time and looped over a module's
//! tensors one prefetch or advise call at a time. Here:
//! - [`ManagedPool`] allocates from a managed memory pool (`cudaMallocFromPoolAsync`, 1.3-2.4 us
//!   per 1 MiB alloc+free against 18-29 us for `cudaMallocManaged`+`cudaFree`, 11-13.5x, in
//!   the H100 runs of 2026-11-22 and 23),
//!   falling back to `cudaMallocManaged` only where the driver refuses managed pools.
//! - [`ManagedBuffer`] frees in stream order after all its uses and orders its uses like every
//!   cuferry buffer.
//! - [`prefetch_all`], [`advise_all`], [`discard_all`] and [`discard_and_prefetch_all`] make one
//!   batched call for a set of buffers (a prefetch of 8 ranges or more is instead spread over
//!   helper streams, which migrate in parallel: see `bulk`'s rules) and count an allocation
//!   shared by several views once.
//! - Capabilities are probed: without `concurrentManagedAccess`, prefetch, advice and host
//!   access (`as_slice`, where a CPU touch faults while any kernel runs) return
//!   [`Error::Unsupported`](crate::Error::Unsupported) naming it; never a silent no-op.
//! - The host backend's pool hands out host memory; prefetch to the host and advice are no-ops
//!   there that still validate their ranges. A discard there overwrites the bytes with
//!   [`DISCARDED_BYTE`] (CUDA leaves them indeterminate), so reading before writing fails in
//!   host tests too.
//! - Discards need `concurrentManagedAccess` on every device of the machine (CUDA's rule). On
//!   CUDA they discard only the whole CPU pages inside a range, so a small buffer sharing a
//!   page with its neighbours is never discarded with them (see `bulk`'s rules).

mod buffer;
mod bulk;
mod location;
mod pool;

pub use buffer::ManagedBuffer;
pub(crate) use bulk::{advice_refused, device_lacking_concurrent_access};
pub use bulk::{
    advise_all, discard_all, discard_and_prefetch_all, prefetch_all, prefetch_each, ManagedRange,
    DISCARDED_BYTE,
};
pub use location::{Advice, Location};
pub use pool::{ManagedCapabilities, ManagedPool, ManagedPoolOptions, PoolKind, PoolStats};
