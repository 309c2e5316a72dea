//! Pipelined production from pageable memory: [`SlotRing::produce`] fills several slots at once
//! on a [`PackExecutor`] and publishes them in order.
//!
//! [`ProducerSlot::fill_from`](super::ProducerSlot::fill_from) copies one slot at a time: its
//! threads wake for every slot and idle while it uploads, so slots of a few MiB fill far below
//! the threads' memcpy rate. Here each slot's chunks are queued behind the previous slots', and
//! the workers go from one slot to the next without waiting.
//!
//! Rules:
//! - Items are published in the order the iterator yields them. Up to `ahead` (1..=depth) slots
//!   are being filled at once. The executor's workers copy; the producing thread publishes
//!   (and copies only when the executor has no workers): a chunk it took could hold a
//!   finished fill back from the link for the chunk's whole copy.
//! - The call returns only after every queued chunk is copied, on every path (errors and panics
//!   included), so the borrowed sources outlive the copies. A slot goes back to the ring (or is
//!   published) only after its chunks are done.
//! - It never blocks holding a filled, unpublished slot: when the ring is full it finishes and
//!   publishes its oldest fill first, and blocks in [`SlotRing::acquire`] only with no fill of
//!   its own pending. (A consumer waiting for that slot would otherwise wait forever.)
//! - While the iterator makes the next item, up to `ahead - 1` earlier items may still be
//!   filling (fills already finished are published before it runs). An iterator that waits
//!   for the consumer to take the items it yielded (lock-step, on-policy feedback) needs
//!   `ahead == 1`: then each item is published before the iterator is asked for the next.
//! - It never waits for a free slot's last upload while a finished fill is unpublished: it
//!   publishes fills as they finish until the upload is done, so the link is not left idle
//!   behind this thread.
//! - Pieces are checked before a slot is taken: inside the item's uploaded bytes and not
//!   overlapping one another.
//! - On an error the items published are a prefix of the iterator's: an invalid item or a
//!   failed acquire ends the call after the fills already started are published; a failed
//!   publish returns the later slots unpublished. A torn slot is never published.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::executor::{Latch, PackExecutor, RawCopy};
use super::layout::{HasDType, SlotLayout, SlotMeta};
use super::slot_ring::{ProducerSlot, SlotRing, UnwaitedSlot};
use crate::error::{Error, Result};

/// How long the producer polls for a finished upload or fill, with no chunk left to copy,
/// before it blocks.
const POLL_BEFORE_BLOCK: Duration = Duration::from_micros(50);

/// One item for [`SlotRing::produce`]: its metadata and the pieces of pageable memory to copy
/// into the slot.
///
/// # Examples
///
/// ```
/// use cuferry::ring::{PackExecutor, RingOptions, SlotFill, SlotLayout, SlotMeta, SlotRing};
/// use cuferry::{Device, Stream};
///
/// let ring = SlotRing::new(Device::Host, RingOptions::new(4, 1 << 20))?;
/// let pool = PackExecutor::new(2)?;
/// let batches: Vec<Vec<f32>> = (0..3).map(|i| vec![i as f32; 1000]).collect();
/// let items = batches.iter().enumerate().map(|(i, batch)| {
///     let layout = SlotLayout::new().with::<f32>(&[batch.len()])?;
///     SlotFill::new(SlotMeta::new(i as u64, layout)).array(0, batch)
/// });
/// let items: Vec<SlotFill> = items.collect::<cuferry::Result<_>>()?;
/// // Three items fit a ring of depth 4 without a consumer running alongside.
/// assert_eq!(ring.produce(&pool, 2, items)?, 3);
/// let consumer = Stream::new(Device::Host)?;
/// for i in 0..3u64 {
///     let slot = ring.next(&consumer)?;
///     assert_eq!(slot.meta().sequence, i);
///     assert_eq!(slot.host_array::<f32>(0)?[999], i as f32);
/// }
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone)]
pub struct SlotFill<'a> {
    meta: SlotMeta,
    pieces: Vec<(usize, &'a [u8])>,
}

impl std::fmt::Debug for SlotFill<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Offsets and lengths, not the bytes (pieces are often megabytes).
        let pieces: Vec<(usize, usize)> = self.pieces.iter().map(|&(o, d)| (o, d.len())).collect();
        f.debug_struct("SlotFill").field("meta", &self.meta).field("pieces", &pieces).finish()
    }
}

impl<'a> SlotFill<'a> {
    /// An item to publish with `meta`, with nothing to copy yet.
    pub fn new(meta: SlotMeta) -> Self {
        SlotFill { meta, pieces: Vec::new() }
    }

    /// `data` as a plain byte item ([`SlotLayout::bytes`]) with sequence id `sequence`.
    pub fn bytes(sequence: u64, data: &'a [u8]) -> Self {
        SlotFill::new(SlotMeta::new(sequence, SlotLayout::bytes(data.len()))).piece(0, data)
    }

    /// Adds `data`, to be copied to byte `offset` of the slot (checked by
    /// [`SlotRing::produce`]).
    #[must_use]
    pub fn piece(mut self, offset: usize, data: &'a [u8]) -> Self {
        self.pieces.push((offset, data));
        self
    }

    /// Adds `data` as array `index` of the item's layout.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the layout has no such array or `T` or the length does
    /// not match it.
    pub fn array<T: HasDType>(self, index: usize, data: &'a [T]) -> Result<Self> {
        let array = self.meta.layout.arrays().get(index).ok_or_else(|| {
            Error::invalid(format!(
                "the layout has {} arrays, not {}",
                self.meta.layout.arrays().len(),
                index + 1
            ))
        })?;
        array.check_data(data)?;
        let offset = array.offset;
        Ok(self.piece(offset, bytemuck::cast_slice(data)))
    }

    /// The metadata the slot is published with.
    pub fn meta(&self) -> &SlotMeta {
        &self.meta
    }

    /// Checks the metadata against the slot size and the pieces against the uploaded bytes
    /// and one another.
    fn validate(&self, slot_bytes: usize) -> Result<()> {
        self.meta.validate(slot_bytes)?;
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(self.pieces.len());
        for &(offset, data) in &self.pieces {
            let end = offset.checked_add(data.len()).filter(|&e| e <= self.meta.bytes).ok_or_else(|| {
                Error::invalid(format!(
                    "item {}: {} bytes at offset {offset} reach past the {} bytes uploaded",
                    self.meta.sequence,
                    data.len(),
                    self.meta.bytes
                ))
            })?;
            // An empty piece overlaps nothing, wherever it sits.
            if end > offset {
                spans.push((offset, end));
            }
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(Error::invalid(format!(
                "item {}: pieces at bytes {}..{} and {}..{} overlap",
                self.meta.sequence, w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
        Ok(())
    }
}

/// A slot whose copies are queued. Dropping it waits for them before the slot goes back.
struct PendingFill<'e> {
    executor: &'e PackExecutor,
    latch: Arc<Latch>,
    slot: Option<ProducerSlot>,
    meta: Option<SlotMeta>,
}

impl PendingFill<'_> {
    /// Waits for the copies and publishes the slot.
    fn publish(mut self) -> Result<()> {
        // The producing thread publishes; with workers it leaves the copies to them, or a
        // chunk it took could hold back a finished fill's upload (see `Line::await_upload`).
        self.executor.wait(&self.latch, false);
        match (self.slot.take(), self.meta.take()) {
            (Some(slot), Some(meta)) => slot.publish(meta),
            _ => Ok(()),
        }
    }
}

impl Drop for PendingFill<'_> {
    fn drop(&mut self) {
        // The chunks write into the slot and read the caller's memory: both must outlive them.
        self.executor.wait(&self.latch, false);
    }
}

/// The fills of one [`SlotRing::produce`] call, oldest first.
struct Line<'r, 'e> {
    ring: &'r SlotRing,
    executor: &'e PackExecutor,
    ahead: usize,
    pending: VecDeque<PendingFill<'e>>,
    published: u64,
    /// A publish failed: nothing after it may be published.
    broken: bool,
}

impl<'e> Line<'_, 'e> {
    /// Publishes the oldest fill once its copies are done.
    fn publish_front(&mut self) -> Result<()> {
        let Some(front) = self.pending.pop_front() else { return Ok(()) };
        match front.publish() {
            Ok(()) => {
                self.published += 1;
                Ok(())
            }
            Err(e) => {
                self.broken = true;
                self.pending.clear();
                Err(e)
            }
        }
    }

    /// Whether the oldest fill's copies are all done.
    fn front_done(&self) -> bool {
        self.pending.front().is_some_and(|f| f.latch.is_done())
    }

    /// A slot for the next item, publishing older fills while the ring is full (one producer
    /// wait counted however many tries that takes).
    fn acquire(&mut self) -> Result<ProducerSlot> {
        let mut counted = false;
        loop {
            match self.ring.try_reserve(&mut counted) {
                Ok(slot) => return self.await_upload(slot),
                Err(Error::WouldBlock { .. }) if !self.pending.is_empty() => self.publish_front()?,
                Err(Error::WouldBlock { .. }) => return self.ring.acquire_counted(&mut counted),
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for the last upload from `slot`'s host slot, publishing fills as they finish
    /// meanwhile (blocking on the upload while a finished fill waits leaves the link idle
    /// after it). With no workers it copies queued chunks too. After [`POLL_BEFORE_BLOCK`]
    /// with nothing to do it blocks on the oldest fill, or on the upload when no fill is
    /// pending.
    fn await_upload(&mut self, slot: UnwaitedSlot) -> Result<ProducerSlot> {
        let mut idle_since = Instant::now();
        loop {
            if slot.upload_done()? {
                return slot.wait();
            }
            if self.front_done() {
                self.publish_front()?;
                idle_since = Instant::now();
            } else if self.executor.threads() == 1 && self.executor.run_one() {
                idle_since = Instant::now();
            } else if idle_since.elapsed() < POLL_BEFORE_BLOCK {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else if self.pending.is_empty() {
                return slot.wait();
            } else {
                self.publish_front()?;
                idle_since = Instant::now();
            }
        }
    }

    /// Validates `item`, takes a slot for it and queues its copies.
    fn push(&mut self, item: SlotFill<'_>) -> Result<()> {
        let slot_bytes = self.ring.slot_bytes();
        item.validate(slot_bytes)?;
        while self.pending.len() >= self.ahead || self.front_done() {
            self.publish_front()?;
        }
        let mut slot = self.acquire()?;
        let bytes = slot.bytes_mut();
        if bytes.len() < item.meta.bytes {
            return Err(Error::invalid(format!(
                "a host slot of {} bytes cannot take {} (the ring has {slot_bytes}-byte slots)",
                bytes.len(),
                item.meta.bytes
            )));
        }
        let base = bytes.as_mut_ptr();
        let ranges: Vec<RawCopy> = item
            .pieces
            .iter()
            .map(|&(offset, data)| RawCopy {
                src: data.as_ptr(),
                dst: base.wrapping_add(offset),
                len: data.len(),
            })
            .collect();
        // SAFETY: each destination lies inside the host slot (validated against the uploaded
        // bytes, which fit the slice) and the pieces do not overlap; `slot` is the only holder
        // of that host slot and is kept, untouched, in the `PendingFill` until the latch is
        // done. The sources are borrowed for a lifetime chosen by `produce`'s caller, so they
        // outlive that call, which waits for every latch before returning (`PendingFill`'s
        // drop runs on every path, unwinding included).
        let latch = unsafe { self.executor.queue_split(&ranges) };
        self.pending.push_back(PendingFill {
            executor: self.executor,
            latch,
            slot: Some(slot),
            meta: Some(item.meta),
        });
        // Before the iterator runs again: fills already finished go out now (not one item
        // late), and at most `ahead - 1` stay pending (with `ahead == 1` this item's fill is
        // waited for and published), so an iterator that waits for the consumer to take an
        // item `ahead` places back does not wait forever.
        while self.front_done() || self.pending.len() >= self.ahead {
            self.publish_front()?;
        }
        Ok(())
    }

    /// Publishes every pending fill in order, unless a publish already failed.
    fn flush(&mut self) -> Result<()> {
        while !self.broken && !self.pending.is_empty() {
            self.publish_front()?;
        }
        Ok(())
    }
}

impl SlotRing {
    /// Fills and publishes `items` in order, copying up to `ahead` of them (clamped to
    /// 1..=depth) at once on `executor`; returns how many were published.
    ///
    /// Use it to stream batches from pageable memory: with slots of a few MiB it keeps every
    /// executor thread busy where [`ProducerSlot::fill_from`](super::ProducerSlot::fill_from)
    /// wakes them slot by slot. The calling thread publishes; it copies only when the
    /// executor has no worker threads (`PackExecutor::new(1)`).
    ///
    /// - Pieces are checked before a slot is taken: inside the item's uploaded bytes, not
    ///   overlapping.
    /// - It returns only after every copy it queued is done, errors and panics included.
    /// - When the ring is full it publishes its oldest finished fill before waiting, so a
    ///   consumer never waits on a slot this call holds.
    /// - While `items` makes its next item, up to `ahead - 1` earlier ones may still be
    ///   filling, unpublished; with `ahead == 1` each item is published before the next is
    ///   asked for (for iterators that wait on the consumer).
    /// - The items published are always a prefix of `items`; no slot is published torn.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an item whose metadata or pieces do not fit;
    /// [`Error::Closed`] once the ring is closed; the backend's submission errors. Items
    /// before the failing one are published (except after a failed publish).
    pub fn produce<'a, I>(&self, executor: &PackExecutor, ahead: usize, items: I) -> Result<u64>
    where
        I: IntoIterator<Item = SlotFill<'a>>,
    {
        let mut line = Line {
            ring: self,
            executor,
            ahead: ahead.clamp(1, self.depth()),
            pending: VecDeque::new(),
            published: 0,
            broken: false,
        };
        let pushed = items.into_iter().try_for_each(|item| line.push(item));
        let flushed = line.flush();
        pushed.and(flushed).map(|()| line.published)
    }
}
