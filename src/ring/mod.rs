//! The slot ring: streaming host data to a device through pinned slots at link speed.
//!
//! A [`SlotRing`] has `depth` host slots and `depth` device slots over a [`TransferBackend`]
//! (one copy stream; [`build_transfer_backend`] picks it for a device). Producers fill host
//! slots (directly, or from pageable memory in parallel with a [`PackExecutor`]; many slots at
//! once with [`SlotRing::produce`]) and publish them; the ring uploads each on the copy
//! stream; consumers take device slots in FIFO order and release them on their stream.
//!
//! Rules (the seed left these to luck; here each is enforced):
//! - A host slot is rewritten only after its upload finished (the producer's `acquire` waits).
//! - A device slot is overwritten only after its consumer released it: the upload is queued
//!   behind the consumed point recorded on the consumer's stream.
//! - Slots are handed to consumers in publish order; an unpublished slot is never handed out.
//! - Depth is any N >= 1; a full ring blocks, times out or reports `WouldBlock`.
//!
//! See [`slot_ring`](self::SlotRing) for the full protocol and an example.

mod backend;
mod caller_slots;
mod executor;
mod layout;
mod produce;
mod slot_ring;

pub use backend::{
    build_transfer_backend, DeviceFamily, StreamTransferBackend, TransferBackend, TransferCapabilities,
};
pub use executor::{PackExecutor, MAX_PACK_THREADS, MIN_CHUNK};
pub use layout::{ArrayLayout, DType, HasDType, SlotLayout, SlotMeta, SLOT_ALIGN};
pub use produce::{Produced, SlotFill};
pub use slot_ring::{
    ConsumerSlot, ProducerSlot, RingOptions, RingStats, SlotRing, UploadTiming, MAX_RING_DEPTH,
};
