//! The ring part of the C ABI: a [`SlotRing`] with its [`PackExecutor`], producer slots and
//! consumer items as opaque handles, for C programs and Python (ctypes) that stream batches to
//! a device.
//!
//! Rules:
//! - Ring calls are thread-safe: one thread may produce while others consume. A slot or item
//!   handle is used by one thread at a time.
//! - Timeouts are in microseconds: negative waits forever, 0 never waits
//!   (`CUFERRY_STATUS_WOULD_BLOCK`), positive gives `CUFERRY_STATUS_TIMEOUT` after that long.
//! - `cuferry_ring_publish` and `cuferry_ring_abandon` consume the slot handle whatever they
//!   return (a slot not published goes back to the ring unpublished); `cuferry_ring_release`
//!   consumes the item handle.
//! - A slot's host pointer is valid until its handle is consumed. An item's device pointer is
//!   valid until it is released; work queued on the item's stream (the stream passed to
//!   `cuferry_ring_next`) runs after the upload, and work queued there before the release
//!   finishes before the slot's next upload. Queue CUDA work on it through
//!   `cuferry_stream_cuda_handle` (in PyTorch: `torch.cuda.ExternalStream`); work on another
//!   stream is ordered by neither rule, so synchronize that stream before the release. On the
//!   host backend the item's memory is host memory, ready to read after
//!   `cuferry_stream_synchronize` on that stream.
//! - Items are plain bytes (`SlotLayout::bytes`); typed layouts are for the Rust API.
//! - Destroying the ring closes it; slot and item handles still held stay valid (they share the
//!   ring's memory) until consumed.

use std::ffi::c_void;
use std::time::Duration;

use super::{device_of, guard, handle, slice_of, write_out, CuferryStatus, CuferryStream};
use crate::error::{Error, Result};
use crate::ring::{
    ConsumerSlot, PackExecutor, ProducerSlot, RingOptions, SlotFill, SlotLayout, SlotMeta, SlotRing,
    MAX_PACK_THREADS,
};

/// A slot ring and the pack executor of its pipelined fill (opaque).
pub struct CuferryRing {
    ring: SlotRing,
    executor: PackExecutor,
}

/// A host slot held by a producer (opaque).
pub struct CuferryRingSlot {
    slot: ProducerSlot,
}

/// A published slot handed to a consumer (opaque).
pub struct CuferryRingItem {
    item: ConsumerSlot,
}

/// A ring's counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CuferryRingStats {
    /// Device slots reserved or published and not yet released.
    pub occupancy: usize,
    /// The most device slots in use at once.
    pub high_water: usize,
    /// Times a producer found no free slot.
    pub producer_waits: u64,
    /// Slots published.
    pub published: u64,
    /// Bytes published.
    pub bytes: u64,
}

/// Runs a wait with the C timeout convention (see the module rules).
fn with_timeout<T>(
    timeout_us: i64,
    forever: impl FnOnce() -> Result<T>,
    never: impl FnOnce() -> Result<T>,
    bounded: impl FnOnce(Duration) -> Result<T>,
) -> Result<T> {
    match timeout_us {
        t if t < 0 => forever(),
        0 => never(),
        t => bounded(Duration::from_micros(t.unsigned_abs())),
    }
}

/// Takes back a handle made by `Box::into_raw`, rejecting NULL.
///
/// # Safety
///
/// 1. `ptr` is NULL or a live handle of this type made by this library, not used again.
unsafe fn take_handle<T>(ptr: *mut T, what: &str) -> Result<Box<T>> {
    if ptr.is_null() {
        return Err(Error::invalid(format!("{what} is NULL")));
    }
    // SAFETY: precondition 1: the pointer came from `Box::into_raw` and is given up here.
    Ok(unsafe { Box::from_raw(ptr) })
}

/// Creates a ring of `depth` slots of `slot_bytes` bytes on `device` in `*out`, with
/// `fill_threads` threads for `cuferry_ring_produce`. `depth` is 1 to 4096, `slot_bytes` at
/// least 1, `fill_threads` 1 to 1024, and `depth * slot_bytes` fits a `size_t`; other values give
/// `CUFERRY_STATUS_INVALID_ARGUMENT` before anything is allocated.
///
/// # Safety
///
/// `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_create(
    device: i32,
    depth: usize,
    slot_bytes: usize,
    fill_threads: usize,
    out: *mut *mut CuferryRing,
) -> CuferryStatus {
    guard(|| {
        if out.is_null() {
            return Err(Error::invalid("out is NULL"));
        }
        // Every count is checked before a thread starts or a slot is allocated: the thread
        // count here, the ring's own sizes in `SlotRing::new`, which runs before the threads.
        if !(1..=MAX_PACK_THREADS).contains(&fill_threads) {
            return Err(Error::invalid(format!("{fill_threads} fill threads: use 1 to {MAX_PACK_THREADS}")));
        }
        let ring = SlotRing::new(device_of(device)?, RingOptions::new(depth, slot_bytes))?;
        let executor = PackExecutor::new(fill_threads)?;
        let raw = Box::into_raw(Box::new(CuferryRing { ring, executor }));
        // SAFETY: `out` is non-NULL and, by the contract, valid for writing a pointer.
        unsafe { write_out(out, raw) }
    })
}

/// Closes and destroys a ring (NULL is a no-op). Slot and item handles still held stay valid
/// until consumed.
///
/// # Safety
///
/// `ring` is NULL or a live ring with no call on it in progress, not used again.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_destroy(ring: *mut CuferryRing) -> CuferryStatus {
    guard(|| {
        if ring.is_null() {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let ring = unsafe { take_handle(ring, "ring") }?;
        ring.ring.close();
        drop(ring);
        Ok(())
    })
}

/// Closes a ring: producers then get `CUFERRY_STATUS_CLOSED`; consumers drain what was
/// published, then get it too.
///
/// # Safety
///
/// `ring` is NULL or a live ring.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_close(ring: *const CuferryRing) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { handle(ring, "ring") }?.ring.close();
        Ok(())
    })
}

/// Takes a free host slot in `*slot` and its address in `*host` (`slot_bytes` writable bytes),
/// waiting up to `timeout_us` microseconds for one: negative waits forever, 0 returns
/// `CUFERRY_STATUS_WOULD_BLOCK` at once, positive returns `CUFERRY_STATUS_TIMEOUT` after that
/// long. Any thread may call it; the slot handle is then used by one thread at a time.
///
/// # Safety
///
/// `ring` is NULL or a live ring; `slot` and `host` are NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_acquire(
    ring: *const CuferryRing,
    timeout_us: i64,
    slot: *mut *mut CuferryRingSlot,
    host: *mut *mut c_void,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let ring = &unsafe { handle(ring, "ring") }?.ring;
        if slot.is_null() || host.is_null() {
            return Err(Error::invalid("an out-parameter is NULL"));
        }
        let mut taken =
            with_timeout(timeout_us, || ring.acquire(), || ring.try_acquire(), |t| ring.acquire_timeout(t))?;
        let bytes = taken.bytes_mut();
        if bytes.len() < ring.slot_bytes() {
            return Err(Error::invalid(format!(
                "a host slot of {} bytes, not {}",
                bytes.len(),
                ring.slot_bytes()
            )));
        }
        let address = bytes.as_mut_ptr().cast::<c_void>();
        let raw = Box::into_raw(Box::new(CuferryRingSlot { slot: taken }));
        // SAFETY: both are non-NULL and, by the contract, valid for writing a pointer.
        unsafe {
            host.write(address);
            slot.write(raw);
        }
        Ok(())
    })
}

/// Publishes the first `bytes` bytes of a slot as item `sequence`: queues its upload and puts
/// it in the FIFO. Consumes the handle (on failure the slot goes back unpublished).
///
/// # Safety
///
/// `slot` is NULL or a live slot handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_publish(
    slot: *mut CuferryRingSlot,
    sequence: u64,
    bytes: usize,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let slot = unsafe { take_handle(slot, "slot") }?;
        slot.slot.publish(SlotMeta::new(sequence, SlotLayout::bytes(bytes)))
    })
}

/// Gives a slot back unpublished. Consumes the handle; NULL is a no-op (as `free(NULL)`).
///
/// # Safety
///
/// `slot` is NULL or a live slot handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_abandon(slot: *mut CuferryRingSlot) -> CuferryStatus {
    guard(|| {
        if !slot.is_null() {
            // SAFETY: the caller's contract.
            drop(unsafe { take_handle(slot, "slot") }?);
        }
        Ok(())
    })
}

/// Copies `n` items from pageable memory into slots and publishes them in order, filling up
/// to `ahead` slots at once on the ring's fill threads (`SlotRing::produce`). Item `i` is
/// `lengths[i]` bytes at `sources[i]`, published as sequence `sequences[i]`. Returns when every
/// copy is done: on success all `n` are published; on failure the items published are a
/// prefix and no slot is published half-filled (`cuferry_ring_produce_timeout` says how long
/// that prefix is).
///
/// # Safety
///
/// `ring` is NULL or a live ring; `sequences`, `sources` and `lengths` hold `n` elements;
/// each `sources[i]` is readable for `lengths[i]` bytes (NULL allowed when 0) and not written
/// during the call.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_produce(
    ring: *const CuferryRing,
    sequences: *const u64,
    sources: *const *const c_void,
    lengths: *const usize,
    n: usize,
    ahead: usize,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            produce_items(ring, (sequences, sources, lengths), n, |ring, items| {
                ring.ring.produce(&ring.executor, ahead, items)
            })
        }
        .map(drop)
    })
}

/// `cuferry_ring_produce` with a bound on each wait for the consumers, and the count of items
/// it published in `*published` (when not NULL) on every path, errors included: the items
/// published are always `0 .. *published`, so a producer can resume from there, even on a ring
/// other producers share (`cuferry_ring_stats` counts theirs too).
///
/// `timeout_us` bounds each wait for a free slot (or a free host slot's last upload) with no
/// fill of this call pending: negative waits forever, 0 fails with
/// `CUFERRY_STATUS_WOULD_BLOCK` at the first slot not free at once, positive with
/// `CUFERRY_STATUS_TIMEOUT` after that many microseconds. Copies are never cut short.
///
/// # Safety
///
/// As `cuferry_ring_produce`; `published` is NULL or valid for writing.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_produce_timeout(
    ring: *const CuferryRing,
    sequences: *const u64,
    sources: *const *const c_void,
    lengths: *const usize,
    n: usize,
    ahead: usize,
    timeout_us: i64,
    published: *mut u64,
) -> CuferryStatus {
    let report = |count: u64| {
        if !published.is_null() {
            // SAFETY: non-NULL and valid for writing by the contract.
            unsafe { published.write(count) };
        }
    };
    // Written first: a call refused before producing (or panicking) published nothing.
    report(0);
    guard(|| {
        // SAFETY: the caller's contract.
        let done = unsafe {
            produce_items(ring, (sequences, sources, lengths), n, |ring, items| {
                let (ring, executor) = (&ring.ring, &ring.executor);
                let done = match timeout_us {
                    t if t < 0 => ring.produce_timeout(executor, ahead, items, Duration::MAX),
                    0 => ring.produce_without_waiting(executor, ahead, items),
                    t => {
                        ring.produce_timeout(executor, ahead, items, Duration::from_micros(t.unsigned_abs()))
                    }
                };
                Ok(done)
            })
        }?;
        report(done.published);
        done.result
    })
}

/// The item arrays of a produce call: sequence ids, sources, lengths.
type ItemArrays = (*const u64, *const *const c_void, *const usize);

/// Checks the arguments of a produce call and hands `produce` the ring and its items, made
/// lazily (an `n` of millions needs no list of items).
///
/// # Safety
///
/// As `cuferry_ring_produce`.
unsafe fn produce_items<T>(
    ring: *const CuferryRing,
    (sequences, sources, lengths): ItemArrays,
    n: usize,
    produce: impl FnOnce(&CuferryRing, &mut dyn Iterator<Item = SlotFill<'_>>) -> Result<T>,
) -> Result<T> {
    // SAFETY: the caller's contract.
    let ring = unsafe { handle(ring, "ring") }?;
    // SAFETY: each holds `n` elements by the contract.
    let (sequences, sources, lengths) = unsafe {
        (
            slice_of(sequences, n, "sequences")?,
            slice_of(sources, n, "sources")?,
            slice_of(lengths, n, "lengths")?,
        )
    };
    // Checked first, then handed over lazily.
    if let Some(i) = (0..n).find(|&i| sources[i].is_null() && lengths[i] > 0) {
        return Err(Error::invalid(format!("source {i} is NULL")));
    }
    let slot_bytes = ring.ring.slot_bytes();
    if let Some(i) = (0..n).find(|&i| lengths[i] > slot_bytes) {
        return Err(Error::invalid(format!(
            "item {i} of {} bytes does not fit a slot of {slot_bytes} bytes",
            lengths[i]
        )));
    }
    let mut items = (0..n).map(|i| {
        // SAFETY: `sources[i]` is readable for `lengths[i]` bytes (non-NULL when the length
        // is not 0, checked above) and unchanged during the call, which outlives every copy
        // `produce` queues (it waits for all of them). It cannot fail: NULL and lengths
        // no slot holds were refused above.
        let data = unsafe { slice_of(sources[i].cast::<u8>(), lengths[i], "a source") }.unwrap_or_default();
        SlotFill::bytes(sequences[i], data)
    });
    produce(ring, &mut items)
}

/// The next published item in `*item`, in publish order, waiting up to `timeout_us`
/// microseconds for one (negative: forever; 0: `CUFERRY_STATUS_WOULD_BLOCK` at once; positive:
/// `CUFERRY_STATUS_TIMEOUT` after that long); `stream` (the consumer's) is ordered after its
/// upload, and its release is recorded on it. Any thread may call it; the item handle is then
/// used by one thread at a time. When `stream` cannot be ordered after the upload, the error is
/// returned and the item stays first in line for the next call (nothing published is lost).
///
/// # Safety
///
/// `ring` and `stream` are NULL or live handles; `item` is NULL or valid for writing a
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_next(
    ring: *const CuferryRing,
    stream: *const CuferryStream,
    timeout_us: i64,
    item: *mut *mut CuferryRingItem,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let (ring, stream) = unsafe { (&handle(ring, "ring")?.ring, &handle(stream, "stream")?.stream) };
        if item.is_null() {
            return Err(Error::invalid("item is NULL"));
        }
        let taken = with_timeout(
            timeout_us,
            || ring.next(stream),
            || ring.try_next(stream),
            |t| ring.next_timeout(stream, t),
        )?;
        let raw = Box::into_raw(Box::new(CuferryRingItem { item: taken }));
        // SAFETY: non-NULL and, by the contract, valid for writing a pointer.
        unsafe { write_out(item, raw) }
    })
}

/// An item's device address, sequence id and byte count (any out-parameter may be NULL to
/// skip it).
///
/// # Safety
///
/// `item` is NULL or a live item handle; each out-parameter is NULL or valid for writing.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_item_info(
    item: *const CuferryRingItem,
    device: *mut *mut c_void,
    sequence: *mut u64,
    bytes: *mut usize,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let item = &unsafe { handle(item, "item") }?.item;
        let address = item.buffer()?.as_ptr().cast::<c_void>().cast_mut();
        // SAFETY: each is NULL (skipped) or valid for writing, by the contract.
        unsafe {
            if !device.is_null() {
                device.write(address);
            }
            if !sequence.is_null() {
                sequence.write(item.meta().sequence);
            }
            if !bytes.is_null() {
                bytes.write(item.meta().bytes);
            }
        }
        Ok(())
    })
}

/// Releases an item on the stream it was taken with: the slot's next upload waits for the
/// work queued there so far. Consumes the handle; NULL is a no-op (as `free(NULL)`).
///
/// # Safety
///
/// `item` is NULL or a live item handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_release(item: *mut CuferryRingItem) -> CuferryStatus {
    guard(|| {
        if item.is_null() {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let item = unsafe { take_handle(item, "item") }?;
        item.item.release()
    })
}

/// The ring's counters in `*out`.
///
/// # Safety
///
/// `ring` is NULL or a live ring; `out` is NULL or valid for writing a `CuferryRingStats`.
#[no_mangle]
pub unsafe extern "C" fn cuferry_ring_stats(
    ring: *const CuferryRing,
    out: *mut CuferryRingStats,
) -> CuferryStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { handle(ring, "ring") }?.ring.stats();
        let stats = CuferryRingStats {
            occupancy: s.occupancy,
            high_water: s.high_water,
            producer_waits: s.producer_waits,
            published: s.published,
            bytes: s.bytes,
        };
        // SAFETY: the caller's contract.
        unsafe { write_out(out, stats) }
    })
}
