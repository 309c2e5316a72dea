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
//! - [`SlotRing::produce_timeout`] bounds each wait on the consumers (for a free slot, or a
//!   free host slot's last upload, with no fill of its own pending: counted from when the
//!   last one was published, not while it copied and published them) and reports the length
//!   of that prefix on every path ([`Produced`]); copies are never cut short.

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
    /// How long a wait for a free slot (or its last upload) may last.
    wait: SlotWait,
}

/// How long [`Line`] waits for a free slot, or for a free host slot's last upload, with no
/// fill of its own pending (each wait on its own; copies are never cut short).
#[derive(Clone, Copy, Debug)]
enum SlotWait {
    /// Until the slot is free.
    Forever,
    /// Not at all: [`Error::WouldBlock`].
    Never,
    /// Up to this long: [`Error::Timeout`].
    Within(Duration),
}

impl SlotWait {
    /// The deadline of a wait starting now (`None`: do not wait), or `Forever`'s marker.
    fn deadline(self) -> Option<Option<Instant>> {
        self.deadline_from(Instant::now())
    }

    /// The deadline of a wait that started at `start`, as [`SlotWait::deadline`].
    fn deadline_from(self, start: Instant) -> Option<Option<Instant>> {
        match self {
            SlotWait::Forever => None,
            SlotWait::Never => Some(None),
            // A timeout too long to represent waits forever (as `acquire_timeout`).
            SlotWait::Within(t) => start.checked_add(t).map(Some),
        }
    }
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
                Err(Error::WouldBlock { .. }) => {
                    return match self.wait.deadline() {
                        None => self.ring.acquire_counted(&mut counted),
                        Some(deadline) => self.ring.acquire_until(deadline, &mut counted),
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for the last upload from `slot`'s host slot, publishing fills as they finish
    /// meanwhile (blocking on the upload while a finished fill waits leaves the link idle
    /// after it). With no workers it copies queued chunks too. After [`POLL_BEFORE_BLOCK`]
    /// with nothing to do it blocks on the oldest fill, or on the upload when no fill is
    /// pending (as long as [`Line::wait`] allows, counted from the moment none was: the time
    /// spent copying and publishing this call's own fills is not a wait on the consumers).
    fn await_upload(&mut self, slot: UnwaitedSlot) -> Result<ProducerSlot> {
        let mut idle_since = Instant::now();
        // When the last of this call's fills was published (or the call, with none pending).
        let mut alone_since = None;
        loop {
            if self.pending.is_empty() {
                alone_since.get_or_insert_with(Instant::now);
            }
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
                let started = alone_since.unwrap_or_else(Instant::now);
                return match self.wait.deadline_from(started) {
                    None => slot.wait(),
                    Some(deadline) => slot.wait_until(deadline, started),
                };
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
        self.produce_waiting(executor, ahead, items, SlotWait::Forever).into_result()
    }

    /// Like [`SlotRing::produce`], but a wait for a free slot gives up after `timeout` with
    /// [`Error::Timeout`], and the call says how many of its items it published on every
    /// path ([`Produced`]).
    ///
    /// The timeout bounds each wait on the consumers, on its own: for a free slot, and for a
    /// free host slot's last upload, when none of this call's fills is pending (with fills
    /// pending it publishes them instead of waiting). Copies are never cut short. A
    /// [`Duration::ZERO`] timeout fails with [`Error::Timeout`] at the first slot that is not
    /// free at once; a timeout too long to represent waits forever.
    ///
    /// Use it when the consumer may stall (a stopped learner, a crashed peer) and the producer
    /// must notice, or to know where to resume after any error on a ring that other
    /// producers share (their slots are in [`SlotRing::stats`], not in this count): the
    /// items published are always the first [`Produced::published`] of `items`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use cuferry::ring::{PackExecutor, RingOptions, SlotFill, SlotRing};
    /// use cuferry::{Device, Error};
    ///
    /// let ring = SlotRing::new(Device::Host, RingOptions::new(2, 64))?;
    /// let pool = PackExecutor::new(1)?;
    /// let data = [[1u8; 64], [2; 64], [3; 64]];
    /// let items = data.iter().enumerate().map(|(i, d)| SlotFill::bytes(i as u64, d));
    /// // No consumer runs: two items fill the ring, the third times out.
    /// let done = ring.produce_timeout(&pool, 2, items, Duration::from_millis(10));
    /// assert_eq!(done.published, 2);
    /// assert!(matches!(done.result, Err(Error::Timeout { .. })));
    /// # Ok::<(), cuferry::Error>(())
    /// ```
    pub fn produce_timeout<'a, I>(
        &self,
        executor: &PackExecutor,
        ahead: usize,
        items: I,
        timeout: Duration,
    ) -> Produced
    where
        I: IntoIterator<Item = SlotFill<'a>>,
    {
        self.produce_waiting(executor, ahead, items, SlotWait::Within(timeout))
    }

    /// [`SlotRing::produce_timeout`] that does not wait for the consumers at all: a slot that
    /// is not free at once ends the call with [`Error::WouldBlock`] (the C ABI's timeout of 0).
    pub(crate) fn produce_without_waiting<'a, I>(
        &self,
        executor: &PackExecutor,
        ahead: usize,
        items: I,
    ) -> Produced
    where
        I: IntoIterator<Item = SlotFill<'a>>,
    {
        self.produce_waiting(executor, ahead, items, SlotWait::Never)
    }

    fn produce_waiting<'a, I>(
        &self,
        executor: &PackExecutor,
        ahead: usize,
        items: I,
        wait: SlotWait,
    ) -> Produced
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
            wait,
        };
        let pushed = items.into_iter().try_for_each(|item| line.push(item));
        let flushed = line.flush();
        Produced { published: line.published, result: pushed.and(flushed) }
    }
}

/// What a [`SlotRing::produce_timeout`] call did.
#[derive(Debug)]
#[must_use = "the result says whether every item was published"]
pub struct Produced {
    /// Items this call published: always the first `published` of its items, whatever
    /// `result` is (resume from there).
    pub published: u64,
    /// `Ok` when every item was published; otherwise the error that ended the call.
    pub result: Result<()>,
}

impl Produced {
    /// The count when every item was published, else the error (as [`SlotRing::produce`]).
    ///
    /// # Errors
    ///
    /// The call's error.
    pub fn into_result(self) -> Result<u64> {
        self.result.map(|()| self.published)
    }
}
