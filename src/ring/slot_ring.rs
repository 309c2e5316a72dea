//! `SlotRing`: producers fill host slots, the ring uploads them, consumers take device slots in
//! FIFO order.
//!
//! Rules:
//! - [`SlotRing::acquire`] hands a producer a host slot (whose last upload has finished) and
//!   reserves a device slot (free once its consumer released it). With all device slots in use,
//!   or the host slot's last upload still running (on CUDA it waits for the release of its
//!   device slot, and so for the consumer's queued work), it blocks, times out
//!   ([`Error::Timeout`]: [`SlotRing::acquire_timeout`]'s deadline bounds both waits) or, for
//!   [`SlotRing::try_acquire`], returns [`Error::WouldBlock`]: that is the ring's
//!   backpressure. Free host slots are taken in the order they came back, so a producer may
//!   wait for the oldest one's upload while a later-returned one (abandoned, or given back by
//!   a failed submit) is already idle; the copy stream would upload behind that upload anyway.
//! - A ring's consumer calls ([`SlotRing::next`], [`ConsumerSlot::host_bytes`]) and
//!   producer waits must not run inside a job ([`Stream::host_fn`]) of a consumer's stream:
//!   the upload they wait for may wait, through the copy stream, for a consumed point queued
//!   behind that job, which then never runs (the same-stream refusal of `host_fn` does not
//!   see through the copy stream).
//! - [`ProducerSlot::publish`] queues the upload and puts the slot in the FIFO; the host slot
//!   goes back at once (it is rewritten only after its upload finished), the device slot when
//!   the consumer releases it. A producer slot dropped unpublished returns both slots: a torn
//!   slot is never handed out.
//! - [`SlotRing::next`] hands consumers published slots in publish order, with the consumer's
//!   stream already ordered after the upload (a CUDA stream consuming a host-backend ring is
//!   ordered by a host wait for the upload, as [`Stream::wait_event`] does across backends,
//!   which the deadlines of `try_next` and `next_timeout` do not bound). Dropping the
//!   [`ConsumerSlot`] (or [`ConsumerSlot::release`]) records the consumed point on that
//!   stream; the next upload into the slot waits for it on the device.
//! - A consumer whose stream cannot be ordered after the upload gets that error and the slot
//!   goes back to the head of the FIFO, in its publish place: the next `next` (this consumer's
//!   or a waiting one's, which is woken) receives it; nothing published is dropped. The slot
//!   stays first whatever the cause, so an error that is the slot's own (a custom backend
//!   refusing its index) comes back to every consumer. Only a panicking custom backend loses
//!   the slot's data (the device slot goes back to the ring).
//! - A failed upload submission returns the error to its producer and both slots to the ring,
//!   which stays usable. [`SlotRing::fail`] closes the ring with an error; [`SlotRing::close`]
//!   closes it cleanly. After closing, producers get [`Error::Closed`]; consumers first drain
//!   every slot already published, then get [`Error::Closed`] (carrying the failure, if any).
//!   A slot in another consumer's hands that may still come back counts as not drained: the
//!   others wait for it (`try_next`: [`Error::WouldBlock`]).
//!   A producer waiting for its host slot's last upload gets [`Error::Closed`] too: at the
//!   next poll with a timeout, or, blocked in [`SlotRing::acquire`], once that upload has
//!   finished (it runs once the consumers' queued work has); a close never hands it a slot.
//! - Slots, guards and the ring share one allocation: memory lives until the last guard is
//!   dropped, and is freed only after queued uploads finish.
//! - The counters count a slot as published before any consumer can receive it.
//! - A ring has at most [`MAX_RING_DEPTH`] slots, and `depth * slot_bytes` must fit a `usize`:
//!   larger requests are refused before anything is allocated.
//!
//! # Examples
//!
//! ```
//! use cuferry::ring::{RingOptions, SlotLayout, SlotMeta, SlotRing};
//! use cuferry::{Device, Stream};
//!
//! let ring = SlotRing::new(Device::Host, RingOptions::new(2, 4096))?;
//! let consumer = Stream::new(Device::Host)?;
//! let mut slot = ring.acquire()?;
//! slot.bytes_mut()[..4].copy_from_slice(&[1, 2, 3, 4]);
//! slot.publish(SlotMeta::new(7, SlotLayout::bytes(4)))?;
//! let got = ring.next(&consumer)?;
//! assert_eq!(got.meta().sequence, 7);
//! assert_eq!(got.host_bytes()?, &[1, 2, 3, 4]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{select, unbounded, Receiver, Sender};

use super::backend::{build_transfer_backend, check_slot_count, StreamTransferBackend, TransferBackend};
use super::executor::PackExecutor;
use super::layout::{ArrayLayout, HasDType, SlotMeta};
use crate::device::Device;
use crate::error::{record_drop_error, Error, Result};
use crate::memory::{DeviceBuffer, MemoryKind};
use crate::stream::Stream;

/// The most slots a ring has. Depths past a handful buy no bandwidth (two slots overlap the
/// fill with the upload; the benchmarks sweep 2 to 8); the cap turns a garbage depth into an
/// error instead of an allocation loop that exhausts memory.
pub const MAX_RING_DEPTH: usize = 4096;

/// How a ring is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingOptions {
    /// Number of host slots and of device slots (>= 1).
    pub depth: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Time every upload on the device (timing events).
    pub timing: bool,
}

impl RingOptions {
    /// `depth` slots of `slot_bytes` bytes, without timing.
    pub fn new(depth: usize, slot_bytes: usize) -> Self {
        RingOptions { depth, slot_bytes, timing: false }
    }
}

/// A snapshot of the ring's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Device slots reserved, published or held by consumers now.
    pub occupancy: usize,
    /// The most device slots ever in use at once.
    pub high_water: usize,
    /// Acquires that found no free device or host slot in the ring's queues and had to wait
    /// (for [`SlotRing::try_acquire`]: would have had to). Waiting for a free host slot's last
    /// upload to finish is not counted.
    pub producer_waits: u64,
    /// Slots published.
    pub published: u64,
    /// Bytes uploaded.
    pub bytes: u64,
}

/// Per-upload timing, for tracing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UploadTiming {
    /// Host time the submission took.
    pub submit: Duration,
    /// Device time of the copy, when the ring times uploads and the copy has finished.
    pub device_ms: Option<f32>,
}

/// A published slot waiting for a consumer.
struct Published {
    device: usize,
    meta: SlotMeta,
    submit: Duration,
}

/// The published slots no consumer holds, keyed by publish order: a slot handed back (its
/// consumer's stream could not be ordered) goes back to its place, ahead of later ones.
#[derive(Default)]
struct ReadyQueue {
    next_order: u64,
    slots: BTreeMap<u64, Published>,
    /// Slots taken by consumers that are still ordering their streams (and may hand them
    /// back): a closed ring is drained only when this is 0 and `slots` is empty.
    in_hand: usize,
}

struct Shared {
    backend: Box<dyn TransferBackend>,
    free_host: (Sender<usize>, Receiver<usize>),
    free_device: (Sender<usize>, Receiver<usize>),
    /// The slots ready for consumers; every slot put in it sends one token on `ready`.
    ready_slots: Mutex<ReadyQueue>,
    /// One token per slot in `ready_slots`: receiving one entitles a consumer to take the
    /// oldest slot (tokens and slots only ever move together, so one is always there).
    ready: (Sender<()>, Receiver<()>),
    /// Dropped on close: every select on `closed_rx` wakes up.
    close_tx: Mutex<Option<Sender<()>>>,
    closed_rx: Receiver<()>,
    /// The error the ring was failed with.
    failure: Mutex<Option<Error>>,
    device_slots: usize,
    occupancy: AtomicUsize,
    high_water: AtomicUsize,
    producer_waits: AtomicU64,
    published: AtomicU64,
    bytes: AtomicU64,
}

impl Shared {
    fn is_closed(&self) -> bool {
        self.close_tx.lock().map(|g| g.is_none()).unwrap_or(true)
    }

    /// [`Error::Closed`] once the ring is closed.
    fn ensure_open(&self) -> Result<()> {
        if self.is_closed() {
            return Err(self.closed_error());
        }
        Ok(())
    }

    fn closed_error(&self) -> Error {
        let reason = self.failure.lock().ok().and_then(|f| f.clone()).map(Box::new);
        Error::Closed { reason }
    }

    fn return_host(&self, host: usize) {
        // The receiver lives in `self`, so the send cannot fail.
        let _ = self.free_host.0.send(host);
    }

    fn return_device(&self, device: usize) {
        self.occupancy.fetch_sub(1, Ordering::AcqRel);
        let _ = self.free_device.0.send(device);
    }

    fn ready_slots(&self) -> std::sync::MutexGuard<'_, ReadyQueue> {
        // The queue is a plain map, consistent between statements: a panic elsewhere while
        // the lock was held leaves nothing half done.
        self.ready_slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts `published` last in the FIFO and sends its token (the caller holds the close
    /// lock, so it lands before a close or not at all).
    fn queue_published(&self, published: Published) {
        let mut queue = self.ready_slots();
        let order = queue.next_order;
        queue.next_order += 1;
        queue.slots.insert(order, published);
        drop(queue);
        // The receiver lives in `self`, so the send cannot fail.
        let _ = self.ready.0.send(());
    }

    /// Puts a slot a consumer could not take back in its publish place (no longer in hand)
    /// and wakes a waiting consumer with its token.
    fn hand_back(&self, order: u64, published: Published) {
        let mut queue = self.ready_slots();
        queue.slots.insert(order, published);
        queue.in_hand -= 1;
        drop(queue);
        let _ = self.ready.0.send(());
    }

    /// The oldest ready slot, for a consumer that received a token; it is in hand until
    /// [`InHand`] is dropped or the slot handed back.
    fn take_oldest(&self) -> Option<(u64, Published)> {
        let mut queue = self.ready_slots();
        let oldest = queue.slots.pop_first();
        queue.in_hand += usize::from(oldest.is_some());
        oldest
    }

    /// Whether a closed ring has nothing left for consumers: no slot queued and none in a
    /// consumer's hands that could come back.
    fn drained(&self) -> bool {
        let queue = self.ready_slots();
        queue.slots.is_empty() && queue.in_hand == 0
    }

    /// Takes an index from `queue`, honouring close and the deadline. The first miss of one
    /// acquire (while `counted` is false) counts one producer wait.
    fn take(
        &self,
        queue: &Receiver<usize>,
        deadline: Option<Instant>,
        what: &'static str,
        counted: &mut bool,
    ) -> Result<usize> {
        if let Ok(i) = queue.try_recv() {
            return Ok(i);
        }
        self.ensure_open()?;
        if !std::mem::replace(counted, true) {
            self.producer_waits.fetch_add(1, Ordering::Relaxed);
        }
        let Some(deadline) = deadline else {
            return Err(Error::WouldBlock { what });
        };
        let started = Instant::now();
        if let Some(i) = poll_briefly(queue, deadline, || self.is_closed()) {
            return Ok(i);
        }
        let timeout = deadline.saturating_duration_since(Instant::now());
        select! {
            recv(queue) -> msg => msg.map_err(|_| self.closed_error()),
            recv(self.closed_rx) -> _ => Err(self.closed_error()),
            default(timeout) => Err(Error::Timeout { what, waited: started.elapsed() }),
        }
    }
}

/// The first and the longest sleep between two checks of a host slot's upload while an acquire
/// with a deadline waits for it (the backend's wait has no deadline). The cap keeps the
/// producer at most 100 us late (a 4 MiB upload takes about 80 us on PCIe 5), at 10 000
/// checks a second while it waits; [`SlotRing::acquire`] blocks in the backend instead.
const UPLOAD_POLL: (Duration, Duration) = (Duration::from_micros(5), Duration::from_micros(100));

/// How long a blocking waiter polls its queue before it sleeps. Handing a slot to a sleeping
/// thread costs a futex wake-up, tens of microseconds in a VM: more than a 64 KiB slot's whole
/// upload (1.2 us at 55 GB/s), so small slots ran at 6% of the link on an H100 machine.
const POLL_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// Polls `queue` for up to [`POLL_BEFORE_SLEEP`], and not past `deadline`; `None` when
/// nothing came or `closed()`.
fn poll_briefly<T>(queue: &Receiver<T>, deadline: Instant, closed: impl Fn() -> bool) -> Option<T> {
    let until = deadline.min(Instant::now() + POLL_BEFORE_SLEEP);
    loop {
        if let Ok(v) = queue.try_recv() {
            return Some(v);
        }
        if closed() || Instant::now() >= until {
            return None;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// A ring of pinned host slots and device slots. See the [module docs](crate::ring).
#[derive(Clone)]
pub struct SlotRing {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SlotRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotRing")
            .field("device", &self.shared.backend.device())
            .field("stats", &self.stats())
            .finish()
    }
}

/// How long "blocking forever" waits in one go (re-armed until something happens).
const FOREVER: Duration = Duration::from_secs(3600 * 24 * 365);

/// Gives a device slot back to the free queue when dropped, on every path (errors and panics
/// of a custom backend included), first waiting on the host for `wait_for` when it is set
/// (the consumer's stream, when no consumed point was recorded). From a job of that stream
/// the wait would wait for itself: the slot then goes back in a job queued on the stream,
/// behind everything the consumer queued (leaked if that cannot be queued). `defuse` keeps
/// the slot.
struct DeviceSlotReturn<'a> {
    shared: &'a Arc<Shared>,
    device: usize,
    wait_for: Option<&'a Stream>,
    armed: bool,
}

impl DeviceSlotReturn<'_> {
    fn defuse(mut self) {
        self.armed = false;
    }
}

impl Drop for DeviceSlotReturn<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(stream) = self.wait_for {
            if stream.refuse_blocking_call_from_own_job("returning a ring slot").is_err() {
                let (shared, device) = (Arc::clone(self.shared), self.device);
                // A slot that cannot be returned in stream order stays out of the ring (its
                // occupancy with it) rather than race the consumer's queued work.
                let _ = stream.host_fn(move || shared.return_device(device));
                return;
            }
            // Only a host wait keeps the next upload from racing the consumer's work. Errors
            // stay on the stream for its owner.
            let _ = stream.wait_idle();
        }
        self.shared.return_device(self.device);
    }
}

/// Takes a slot out of the consumers' hands (see [`ReadyQueue::in_hand`]) when dropped, on
/// every path; `defuse` leaves that to [`Shared::hand_back`].
struct InHand<'a> {
    shared: &'a Shared,
    armed: bool,
}

impl InHand<'_> {
    fn defuse(mut self) {
        self.armed = false;
    }
}

impl Drop for InHand<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.ready_slots().in_hand -= 1;
        }
    }
}

impl SlotRing {
    /// A ring on `device` with freshly allocated slots (pinned host slots on CUDA).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a depth or slot size of 0, a depth over
    /// [`MAX_RING_DEPTH`], or slots whose total size overflows; allocation failures.
    pub fn new(device: Device, options: RingOptions) -> Result<Self> {
        if options.slot_bytes == 0 {
            return Err(Error::invalid("ring slots must hold at least one byte"));
        }
        // Every option is checked before the device is touched (a stream, a context).
        if options.depth == 0 {
            return Err(Error::invalid("ring depth must be at least 1"));
        }
        check_slot_count(options.depth)?;
        if options.depth.checked_mul(options.slot_bytes).is_none() {
            return Err(Error::invalid(format!(
                "{} slots of {} bytes overflow the address space",
                options.depth, options.slot_bytes
            )));
        }
        let mut backend = if options.timing {
            Box::new(StreamTransferBackend::new(device, true)?)
        } else {
            build_transfer_backend(device, options.depth)?
        };
        backend.allocate_host_slots(options.depth, options.slot_bytes)?;
        backend.allocate_device_slots(options.depth, options.slot_bytes)?;
        Self::with_backend(backend)
    }

    /// A ring over a backend whose slots are already allocated or registered (caller memory,
    /// or a custom backend).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the backend has no host or no device slot, or more
    /// than [`MAX_RING_DEPTH`] of either.
    pub fn with_backend(backend: Box<dyn TransferBackend>) -> Result<Self> {
        let (hosts, devices) = (backend.host_slot_count(), backend.device_slot_count());
        if hosts == 0 || devices == 0 {
            return Err(Error::invalid(format!(
                "a ring needs host and device slots ({hosts} host, {devices} device given)"
            )));
        }
        if hosts.max(devices) > MAX_RING_DEPTH {
            return Err(Error::invalid(format!(
                "{hosts} host and {devices} device slots exceed the most a ring has ({MAX_RING_DEPTH})"
            )));
        }
        let free_host = unbounded();
        let free_device = unbounded();
        for i in 0..hosts {
            let _ = free_host.0.send(i);
        }
        for i in 0..devices {
            let _ = free_device.0.send(i);
        }
        let (close_tx, closed_rx) = unbounded();
        Ok(SlotRing {
            shared: Arc::new(Shared {
                backend,
                free_host,
                free_device,
                ready_slots: Mutex::new(ReadyQueue::default()),
                ready: unbounded(),
                close_tx: Mutex::new(Some(close_tx)),
                closed_rx,
                failure: Mutex::new(None),
                device_slots: devices,
                occupancy: AtomicUsize::new(0),
                high_water: AtomicUsize::new(0),
                producer_waits: AtomicU64::new(0),
                published: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
            }),
        })
    }

    /// The backend (capabilities, device).
    pub fn backend(&self) -> &dyn TransferBackend {
        self.shared.backend.as_ref()
    }

    /// Bytes one slot holds.
    pub fn slot_bytes(&self) -> usize {
        self.shared.backend.slot_bytes()
    }

    /// Number of device slots.
    pub fn depth(&self) -> usize {
        self.shared.device_slots
    }

    /// The counters now.
    pub fn stats(&self) -> RingStats {
        let s = &self.shared;
        let occupancy = s.occupancy.load(Ordering::Acquire);
        RingStats {
            occupancy,
            // Raised just after occupancy (two counters): never shown below it.
            high_water: s.high_water.load(Ordering::Acquire).max(occupancy),
            producer_waits: s.producer_waits.load(Ordering::Relaxed),
            published: s.published.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
        }
    }

    /// A free slot for a producer, blocking until one is free.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] once the ring is closed; CUDA errors waiting for the host slot.
    pub fn acquire(&self) -> Result<ProducerSlot> {
        self.acquire_counted(&mut false)
    }

    /// [`SlotRing::acquire`] as part of a larger acquire that counts one producer wait at
    /// most (`counted`: whether it was counted already).
    pub(super) fn acquire_counted(&self, counted: &mut bool) -> Result<ProducerSlot> {
        loop {
            match self.reserve_until(Some(Instant::now() + FOREVER), counted) {
                Err(Error::Timeout { .. }) => continue,
                Err(e) => return Err(e),
                Ok(slot) => return slot.wait(),
            }
        }
    }

    /// Like [`SlotRing::acquire`], giving up after `timeout` with [`Error::Timeout`] (a
    /// timeout too long to represent waits forever). The timeout bounds the wait for a free
    /// slot and the wait for its host slot's last upload together; a slot whose upload has
    /// not finished by then goes back to the ring.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], [`Error::Closed`], CUDA errors.
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<ProducerSlot> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => self.acquire_until(Some(deadline), &mut false),
            None => self.acquire(),
        }
    }

    /// Like [`SlotRing::acquire`] without waiting: [`Error::WouldBlock`] when no slot is free,
    /// or when the free host slot's last upload is still running (the slot goes back).
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`], [`Error::Closed`], CUDA errors.
    pub fn try_acquire(&self) -> Result<ProducerSlot> {
        self.acquire_until(None, &mut false)
    }

    /// A slot whose host slot's last upload has finished, by `deadline` (`None`: now, without
    /// waiting), or [`Error::Timeout`] / [`Error::WouldBlock`].
    pub(super) fn acquire_until(
        &self,
        deadline: Option<Instant>,
        counted: &mut bool,
    ) -> Result<ProducerSlot> {
        let started = Instant::now();
        self.reserve_until(deadline, counted)?.wait_until(deadline, started)
    }

    /// Like [`SlotRing::try_acquire`], without waiting for the host slot's last upload: the
    /// pipelined fill publishes its finished fills meanwhile instead of blocking on it.
    ///
    /// # Errors
    ///
    /// As [`SlotRing::try_acquire`], without the wait's.
    pub(super) fn try_reserve(&self, counted: &mut bool) -> Result<UnwaitedSlot> {
        self.reserve_until(None, counted)
    }

    /// Takes a free device slot and a free host slot (the host slot's upload may still run).
    /// Finding either queue empty counts one producer wait, unless `counted` already.
    fn reserve_until(&self, deadline: Option<Instant>, counted: &mut bool) -> Result<UnwaitedSlot> {
        let s = &self.shared;
        s.ensure_open()?;
        let device = s.take(&s.free_device.1, deadline, "no free device slot", counted)?;
        let occupied = s.occupancy.fetch_add(1, Ordering::AcqRel) + 1;
        s.high_water.fetch_max(occupied, Ordering::AcqRel);
        let host = match s.take(&s.free_host.1, deadline, "no free host slot", counted) {
            Ok(h) => h,
            Err(e) => {
                s.return_device(device);
                return Err(e);
            }
        };
        Ok(UnwaitedSlot(ProducerSlot { shared: Arc::clone(&self.shared), host, device, done: false }))
    }

    /// The next published slot, in publish order, blocking until one is published. `stream`
    /// (the consumer's) is ordered after the slot's upload.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] once the ring is closed and drained; CUDA errors ordering the stream
    /// (the slot then stays first in the FIFO).
    pub fn next(&self, stream: &Stream) -> Result<ConsumerSlot> {
        let ready = loop {
            match self.wait_ready(Some(Instant::now() + FOREVER)) {
                Err(Error::Timeout { .. }) => continue,
                other => break other?,
            }
        };
        self.hand_out(ready, stream)
    }

    /// Like [`SlotRing::next`], giving up after `timeout` with [`Error::Timeout`] (a timeout
    /// too long to represent waits forever).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], [`Error::Closed`], CUDA errors.
    pub fn next_timeout(&self, stream: &Stream, timeout: Duration) -> Result<ConsumerSlot> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => self.hand_out(self.wait_ready(Some(deadline))?, stream),
            None => self.next(stream),
        }
    }

    /// Like [`SlotRing::next`] without waiting: [`Error::WouldBlock`] when nothing is ready.
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`], [`Error::Closed`], CUDA errors.
    pub fn try_next(&self, stream: &Stream) -> Result<ConsumerSlot> {
        self.hand_out(self.wait_ready(None)?, stream)
    }

    /// Takes the oldest ready slot, waiting for one until `deadline` (`None`: not at all).
    fn wait_ready(&self, deadline: Option<Instant>) -> Result<(u64, Published)> {
        let s = &self.shared;
        let tokens = &s.ready.1;
        let started = Instant::now();
        let timeout = |what| Error::Timeout { what, waited: started.elapsed() };
        // The pause between two looks at a closed ring with a slot in another consumer's
        // hands, doubled up to the producers' longest poll.
        let mut pause = UPLOAD_POLL.0;
        loop {
            let received = match tokens.try_recv() {
                Ok(()) => true,
                // Publishes queue under the close lock: once it is closed, every slot that
                // landed is in the queue or in a consumer's hands. One in hand may still come
                // back (its consumer's stream could not be ordered), so only with none left
                // is the ring drained; until then this polls.
                Err(_) if s.is_closed() => {
                    if s.drained() {
                        return Err(s.closed_error());
                    }
                    const WHAT: &str = "a slot another consumer may hand back";
                    let Some(deadline) = deadline else { return Err(Error::WouldBlock { what: WHAT }) };
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(timeout(WHAT));
                    }
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(UPLOAD_POLL.1);
                    false
                }
                Err(_) => {
                    let Some(deadline) = deadline else {
                        return Err(Error::WouldBlock { what: "no published slot" });
                    };
                    match poll_briefly(tokens, deadline, || s.is_closed()) {
                        Some(()) => true,
                        None => {
                            let left = deadline.saturating_duration_since(Instant::now());
                            select! {
                                recv(tokens) -> msg => msg.is_ok(),
                                // Looked at again above, as closed.
                                recv(s.closed_rx) -> _ => false,
                                default(left) => return Err(timeout("no published slot")),
                            }
                        }
                    }
                }
            };
            // A token always has its slot (they are queued together and taken together); a
            // miss would only mean another look.
            if received {
                if let Some(ready) = s.take_oldest() {
                    return Ok(ready);
                }
            }
        }
    }

    /// Orders `stream` after the upload of the slot taken by [`SlotRing::wait_ready`] and
    /// hands it to the consumer; on an error the slot goes back to its place in the FIFO.
    fn hand_out(&self, (order, published): (u64, Published), stream: &Stream) -> Result<ConsumerSlot> {
        let s = &self.shared;
        // On every path but the hand-back the slot leaves the consumers' hands; a panicking
        // custom backend unwinds through both guards: the device slot goes back to the ring
        // and the slot's data is dropped, the ring keeps its depth.
        let in_hand = InHand { shared: s, armed: true };
        let give_back = DeviceSlotReturn { shared: s, device: published.device, wait_for: None, armed: true };
        let ordered = s.backend.wait_stream_for_ready(published.device, stream);
        give_back.defuse();
        if let Err(e) = ordered {
            in_hand.defuse();
            s.hand_back(order, published);
            return Err(e);
        }
        drop(in_hand);
        Ok(ConsumerSlot {
            shared: Arc::clone(&self.shared),
            device: published.device,
            meta: published.meta,
            submit: published.submit,
            stream: stream.clone(),
            released: false,
        })
    }

    /// Closes the ring: producers get [`Error::Closed`], consumers drain what was published
    /// and then get [`Error::Closed`]. Idempotent.
    pub fn close(&self) {
        if let Ok(mut tx) = self.shared.close_tx.lock() {
            tx.take();
        }
    }

    /// Closes the ring because of `error`; consumers see it in [`Error::Closed`] once they
    /// have drained the slots already published. The first failure is kept.
    pub fn fail(&self, error: Error) {
        if let Ok(mut f) = self.shared.failure.lock() {
            f.get_or_insert(error);
        }
        self.close();
    }

    /// Whether the ring was closed.
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// Waits for every queued upload (the backend's `close`); the ring stays as it is.
    ///
    /// # Errors
    ///
    /// CUDA errors of the wait.
    pub fn synchronize(&self) -> Result<()> {
        self.shared.backend.close()
    }
}

/// A host slot being filled by a producer, with a device slot reserved for it.
pub struct ProducerSlot {
    shared: Arc<Shared>,
    host: usize,
    device: usize,
    /// Published or returned.
    done: bool,
}

impl std::fmt::Debug for ProducerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerSlot").field("host", &self.host).field("device", &self.device).finish()
    }
}

impl ProducerSlot {
    /// The slot's bytes, to fill directly (fastest: no staging copy).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: this guard is the only holder of host slot `host` (the free queue handed it
        // out once) and `acquire` waited for its last upload; the borrow of `self` keeps the
        // slice from outliving the guard.
        unsafe { self.shared.backend.host_slot_mut(self.host) }.unwrap_or(&mut [])
    }

    /// Copies `data` into the slot at byte `offset`, in parallel on `executor` (pageable
    /// sources reach host-memcpy speed only with several threads).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the bytes do not fit.
    pub fn fill_from(&mut self, executor: &PackExecutor, offset: usize, data: &[u8]) -> Result<()> {
        let slot = self.bytes_mut();
        let end = offset.checked_add(data.len()).filter(|&e| e <= slot.len()).ok_or_else(|| {
            Error::invalid(format!(
                "{} bytes at offset {offset} overflow a slot of {}",
                data.len(),
                slot.len()
            ))
        })?;
        executor.copy(data, &mut slot[offset..end])
    }

    /// Writes `data` as the array described by `array` (type and length checked), on
    /// `executor` as [`ProducerSlot::fill_from`] does (`PackExecutor::new(1)` copies on the
    /// calling thread, for small arrays).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `T` or the length does not match, or it does not fit.
    pub fn write_array<T: HasDType>(
        &mut self,
        executor: &PackExecutor,
        array: &ArrayLayout,
        data: &[T],
    ) -> Result<()> {
        array.check_data(data)?;
        self.fill_from(executor, array.offset, bytemuck::cast_slice(data))
    }

    /// Queues the upload and puts the slot in the FIFO.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for metadata that does not fit the slot; [`Error::Closed`]
    /// when the ring was closed; the backend's submission error (the slots go back to the
    /// ring, which stays usable).
    pub fn publish(mut self, meta: SlotMeta) -> Result<()> {
        let s = Arc::clone(&self.shared);
        meta.validate(s.backend.slot_bytes())?;
        s.ensure_open()?;
        // SAFETY: this guard holds both slots exclusively: the host slot until its upload is
        // waited on by the next `acquire`, the device slot until a consumer releases it.
        let submit = unsafe { s.backend.submit_upload(self.host, self.device, meta.bytes) }?;
        let bytes = meta.bytes as u64;
        // Checked and queued under the close lock: a publish lands before a close (and
        // consumers drain it) or fails with `Closed`, never after a consumer found the ring
        // closed and empty (that slot would never be released). A slot refused here goes back
        // on drop like an abandoned one; its upload is queued ahead of any later one.
        // The counters move before the send: a consumer that received the item and reads
        // the stats sees it counted.
        let queued = {
            let open = s.close_tx.lock().unwrap_or_else(|e| e.into_inner());
            open.is_some() && {
                s.published.fetch_add(1, Ordering::Relaxed);
                s.bytes.fetch_add(bytes, Ordering::Relaxed);
                s.queue_published(Published { device: self.device, meta, submit });
                true
            }
        };
        if !queued {
            return Err(s.closed_error());
        }
        self.done = true;
        s.return_host(self.host);
        Ok(())
    }
}

/// A producer slot taken from the free queues whose host slot's last upload may still be
/// running: nothing reaches its bytes before [`UnwaitedSlot::wait`]. Dropping it returns both
/// slots.
pub(super) struct UnwaitedSlot(ProducerSlot);

impl UnwaitedSlot {
    /// True when the host slot's last upload has finished; does not block.
    pub(super) fn upload_done(&self) -> Result<bool> {
        self.0.shared.backend.host_slot_idle(self.0.host)
    }

    /// Waits for the host slot's last upload and hands the slot to the producer. On an error,
    /// or when the ring was closed before or during the wait ([`Error::Closed`]), both slots go
    /// back to the ring.
    pub(super) fn wait(self) -> Result<ProducerSlot> {
        self.0.shared.ensure_open()?;
        self.0.shared.backend.wait_host_slot(self.0.host)?;
        self.0.shared.ensure_open()?;
        Ok(self.0)
    }

    /// Like [`UnwaitedSlot::wait`], polling until `deadline` (`None`: only once): when the
    /// upload has not finished by then, both slots go back to the ring and the error is
    /// [`Error::Timeout`] (counted from `started`) or [`Error::WouldBlock`].
    pub(super) fn wait_until(self, deadline: Option<Instant>, started: Instant) -> Result<ProducerSlot> {
        const WHAT: &str = "the free host slot's last upload is still running";
        let mut pause = UPLOAD_POLL.0;
        loop {
            self.0.shared.ensure_open()?;
            if self.upload_done()? {
                return self.wait();
            }
            let Some(deadline) = deadline else { return Err(Error::WouldBlock { what: WHAT }) };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: WHAT, waited: started.elapsed() });
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(UPLOAD_POLL.1);
        }
    }
}

impl Drop for ProducerSlot {
    fn drop(&mut self) {
        if !self.done {
            self.shared.return_host(self.host);
            self.shared.return_device(self.device);
        }
    }
}

/// A device slot handed to a consumer; dropping it releases the slot.
pub struct ConsumerSlot {
    shared: Arc<Shared>,
    device: usize,
    meta: SlotMeta,
    submit: Duration,
    stream: Stream,
    released: bool,
}

impl std::fmt::Debug for ConsumerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerSlot").field("device", &self.device).field("meta", &self.meta).finish()
    }
}

impl ConsumerSlot {
    /// What the producer published.
    pub fn meta(&self) -> &SlotMeta {
        &self.meta
    }

    /// The slot's device memory (work queued on it through cuferry is ordered automatically).
    ///
    /// # Errors
    ///
    /// Only from a custom backend that rejects its own slot index.
    pub fn buffer(&self) -> Result<&DeviceBuffer<u8>> {
        self.shared.backend.device_slot(self.device)
    }

    /// A typed device pointer and element count for array `index`, for kernels queued on the
    /// consumer's stream.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no such array or its type is not `T`.
    pub fn array_ptr<T: HasDType>(&self, index: usize) -> Result<(*const T, usize)> {
        let array = self.array::<T>(index)?;
        Ok((self.buffer()?.as_ptr().wrapping_add(array.offset).cast::<T>(), array.len()))
    }

    fn array<T: HasDType>(&self, index: usize) -> Result<&ArrayLayout> {
        let array =
            self.meta.layout.arrays().get(index).ok_or_else(|| {
                Error::invalid(format!("array {index} of {}", self.meta.layout.arrays().len()))
            })?;
        if array.dtype != T::DTYPE {
            return Err(Error::invalid(format!("array {index} holds {:?}, not {:?}", array.dtype, T::DTYPE)));
        }
        Ok(array)
    }

    /// The uploaded bytes, read on the host after the upload finished. Only where device slots
    /// are host memory (the host backend).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] on CUDA (copy the slot out instead); CUDA errors of the wait.
    pub fn host_bytes(&self) -> Result<&[u8]> {
        let buffer = self.buffer()?;
        if !MemoryKind::Device(buffer.device()).host_accessible() {
            return Err(Error::unsupported(
                "host_bytes on CUDA device slots; copy them out with cuferry::copy",
            ));
        }
        // `publish` checked the length against the backend's `slot_bytes`, which a custom
        // backend (safe code) may overstate: the slice is checked against the memory itself.
        if self.meta.bytes > buffer.len() {
            return Err(Error::invalid(format!(
                "the slot's published length ({} bytes) exceeds its device slot ({} bytes)",
                self.meta.bytes,
                buffer.len()
            )));
        }
        self.shared.backend.synchronize_ready(self.device)?;
        if self.meta.bytes == 0 {
            return Ok(&[]);
        }
        // SAFETY: host-backend device memory is host memory of `buffer.len()` bytes, at least
        // `meta.bytes` (checked above); the upload into it finished (synchronize_ready) and no
        // upload can be queued into it until this guard releases it.
        Ok(unsafe { std::slice::from_raw_parts(buffer.as_ptr(), self.meta.bytes) })
    }

    /// Array `index` as `&[T]`, on the host backend (see [`ConsumerSlot::host_bytes`]).
    ///
    /// # Errors
    ///
    /// As [`ConsumerSlot::host_bytes`], and a type or index mismatch.
    pub fn host_array<T: HasDType>(&self, index: usize) -> Result<&[T]> {
        let array = self.array::<T>(index)?.clone();
        let all = self.host_bytes()?;
        if array.bytes() == 0 {
            // An empty slot's bytes have a dangling address, which a cast to `T` refuses.
            return Ok(&[]);
        }
        let bytes = &all[array.offset..array.offset + array.bytes()];
        bytemuck::try_cast_slice(bytes).map_err(|e| Error::invalid(format!("array {index}: {e}")))
    }

    /// Submission time and, with timing on, the device time of this slot's upload.
    ///
    /// # Errors
    ///
    /// CUDA errors of the timing query.
    pub fn timing(&self) -> Result<UploadTiming> {
        Ok(UploadTiming {
            submit: self.submit,
            device_ms: self.shared.backend.upload_device_ms(self.device)?,
        })
    }

    /// Releases the slot now: the consumed point is recorded on the consumer's stream (work
    /// queued there before this call keeps the slot from being overwritten).
    ///
    /// # Errors
    ///
    /// CUDA errors of the record; the slot is returned to the ring either way (after a host
    /// wait for the consumer's stream when the record failed).
    pub fn release(mut self) -> Result<()> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) {
            return Ok(());
        }
        // The slot goes back on every path; until the consumed point is known to be recorded
        // (an error, or a panicking custom backend), after a host wait for the stream.
        let mut give_back = DeviceSlotReturn {
            shared: &self.shared,
            device: self.device,
            wait_for: Some(&self.stream),
            armed: true,
        };
        let recorded = self.shared.backend.release(self.device, &self.stream);
        if recorded.is_ok() {
            give_back.wait_for = None;
        }
        recorded
    }
}

impl Drop for ConsumerSlot {
    fn drop(&mut self) {
        if let Err(e) = self.release_inner() {
            record_drop_error(e);
        }
    }
}
