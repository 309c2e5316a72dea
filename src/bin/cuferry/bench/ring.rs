//! The ring section: sustained throughput of a [`SlotRing`] for slot sizes, depths and copy
//! threads, from pinned sources (the data is already in the slots) and pageable sources,
//! against, in the same run:
//! - one large pinned copy (the link's ceiling). On the host backend the "link" is a
//!   host-stream copy, which a ring's depth x slot beats by staying in the host's caches, so
//!   there the pinned rows' ceiling is the faster of it and the same copy cut as the ring's
//!   uploads are (slot by slot, through depth x slot buffers);
//! - a direct copy from pageable memory (what a user does without the ring);
//! - parallel host memcpys: into a buffer as large as the reference copy, once per number of
//!   copying threads the rows have (and for the largest executor); and shaped like the ring's
//!   fill, into one of the ring's size (depth x slot, which may stay in the host's caches as
//!   the ring's slots do), per slot size and depth: once on the largest executor for as long
//!   as a row's pass, and a quarter as long for each copying-thread count of its rows. The
//!   pageable rows' ceiling is the fastest of these memcpys, whatever its thread count, or the
//!   pinned rows' ceiling (the link) when that is slower; each pageable row also has a ratio to
//!   the fastest memcpy that copied on as many threads as it does ("vs same threads");
//! - for pinned sources, the same ring at depth 2 (the seed's fixed depth) as the baseline.
//!
//! Pageable sources are copied in three ways:
//! - slot by slot with [`ProducerSlot::fill_from`](cuferry::ring::ProducerSlot::fill_from);
//! - the same with the largest executor polling before it sleeps (slots of 1-16 MiB);
//! - pipelined, [`SlotRing::produce`] filling up to `depth` slots at once; on CUDA, for slots
//!   of 1-16 MiB, also with [`HostWait::Block`], so that threads waiting for an upload leave
//!   their cores to the fill threads (the default mode spins).
//!
//! Each pageable row names the threads that copy, counted by the executor's own rules
//! ([`PackExecutor::copy_threads`] for a slot-by-slot fill, [`PackExecutor::queued_copy_threads`]
//! with `depth` slots filling for a pipelined one): a slot-by-slot copy under 512 KiB runs on
//! the producer alone and one of 1 MiB on at most 4 threads, whatever the executor's size;
//! a pipelined fill copies on the executor's workers only (the producer publishes) unless it
//! has none. "(executor of N)" follows when the executor has more threads than copy. An
//! executor size whose fill would copy on the same threads as a smaller one's, the same
//! measurement under another label, is not run; the polling and blocked rows always run
//! (their waits differ).
//!
//! Every fill and ring-shaped memcpy takes its source windows from one cursor that runs on
//! across passes and rows and starts over only when the rest of the source cannot hold the
//! next window: no byte is read again before the whole source (but for a tail shorter than a
//! window) was read after it. On a GPU machine the
//! source is at least 1 GiB (over the H100 host's 300 MiB L3), so the fill reads memory, not
//! cache; on the host backend it is 64 or 256 MiB (`--quick` or not) and may partly stay in
//! cache. A producer that fails or panics closes the ring, and so does a consumer that fails:
//! an error ends the section instead of hanging it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cuferry::ring::{PackExecutor, RingOptions, SlotFill, SlotLayout, SlotMeta, SlotRing};
use cuferry::{copy, copy_range, Device, DeviceBuffer, HostWait, PinnedBuffer, Result, Stream};

use super::measure::{gbps, median_secs};
use super::output::Rows;
use super::report::Row;

const KIB: usize = 1 << 10;
/// Fewest slots a timed pass streams.
const MIN_ITEMS: usize = 16;
/// How long idle fill threads poll in the rows that measure polling (the ring's own waiters
/// poll this long).
const FILL_SPIN: Duration = Duration::from_micros(50);
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// A same-threads ring-shaped memcpy's pass is this fraction of a row's (one is measured per
/// copying-thread count of each slot size and depth, so they are kept short).
const SAME_THREADS_SHARE: usize = 4;

struct Sweep {
    sizes: Vec<usize>,
    depths: Vec<usize>,
    threads: Vec<usize>,
    /// Bytes streamed per measurement (at least a few rounds of the ring).
    total: usize,
    /// Bytes of the ceiling and baseline copies.
    reference: usize,
}

fn sweep(device: Device, quick: bool) -> Sweep {
    // Device slots of the host backend are host memory too: keep its largest sizes modest.
    let max_slot = if device.is_host() { 64 * MIB } else { 256 * MIB };
    let sizes: Vec<usize> = if quick {
        vec![64 * KIB, MIB, 4 * MIB, 16 * MIB]
    } else {
        vec![64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
    };
    Sweep {
        sizes: sizes.into_iter().filter(|&s| s <= max_slot).collect(),
        depths: if quick { vec![2, 4] } else { vec![2, 4, 8] },
        threads: if quick { vec![1, 4] } else { vec![1, 4, 8, 16] },
        total: if quick { 128 * MIB } else { 512 * MIB },
        reference: if quick { 64 * MIB } else { 256 * MIB },
    }
}

/// The seed's fixed ring depth: the pinned rows' baseline.
const SEED_DEPTH: usize = 2;

/// Timed passes per configuration; the median is reported (ring figures move by up to 0.2x
/// between single passes on a VM).
const PASSES: usize = 3;

/// The pageable source's windows, handed out in order by one cursor that every fill and
/// ring-shaped memcpy of the section shares: a window that does not fit in what is left of the
/// source starts over at its beginning, so no byte is read again before the rest of the source
/// (but for that tail) was.
struct Windows<'a> {
    source: &'a [u8],
    /// Where the next window starts.
    next: AtomicUsize,
}

impl<'a> Windows<'a> {
    fn new(source: &'a [u8]) -> Self {
        Windows { source, next: AtomicUsize::new(0) }
    }

    /// Bytes in the source.
    fn len(&self) -> usize {
        self.source.len()
    }

    /// The next `len` bytes of the source (all of it when `len` is larger).
    fn take(&self, len: usize) -> &'a [u8] {
        let len = len.min(self.source.len());
        let mut start = 0;
        // One thread takes windows at a time (the section's, or a producer it joins); the
        // atomic only lets the producer's thread share the cursor. The update always succeeds.
        let _ = self.next.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
            start = if at + len <= self.source.len() { at } else { 0 };
            Some(start + len)
        });
        &self.source[start..start + len]
    }
}

/// Where a producer's data comes from.
#[derive(Clone, Copy)]
enum Fill<'a> {
    /// Already in the slots (a pinned source).
    Pinned,
    /// Copied from the next windows of a pageable source, one slot at a time.
    SlotBySlot(&'a PackExecutor, &'a Windows<'a>),
    /// The same, copied by [`SlotRing::produce`] up to `depth` slots at once.
    Pipelined(&'a PackExecutor, &'a Windows<'a>),
}

/// Streams `items` slots of `slot` bytes through a fresh ring, [`PASSES`] times after an
/// untimed round; returns the median seconds of a pass. A pageable fill reads the source's next
/// windows (see [`Windows`]).
fn stream(device: Device, slot: usize, depth: usize, items: usize, fill: Fill) -> Result<f64> {
    let ring = SlotRing::new(device, RingOptions::new(depth, slot))?;
    let consumer = Stream::new(device)?;
    let drain = || -> Result<()> {
        ring.synchronize()?;
        consumer.synchronize()
    };
    // One round untimed (first touches of the slots), drained before the clock starts: the
    // round's uploads still queued would otherwise be timed as part of the first pass (they
    // took large slots to 0.65-0.81x of the link, exactly (items / (items + depth))).
    run_items(&ring, &consumer, depth, || produce(&ring, slot, depth, fill))?;
    drain()?;
    let mut times = Vec::with_capacity(PASSES);
    for _ in 0..PASSES {
        let start = Instant::now();
        run_items(&ring, &consumer, items, || produce(&ring, slot, items, fill))?;
        drain()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Produces `items` slots into `ring`, filled from the next windows of `fill`'s source.
fn produce(ring: &SlotRing, slot: usize, items: usize, fill: Fill) -> Result<()> {
    if let Fill::Pipelined(pool, windows) = fill {
        let fills = (0..items).map(|i| SlotFill::bytes(i as u64, windows.take(slot)));
        return ring.produce(pool, ring.depth(), fills).map(drop);
    }
    for i in 0..items {
        let mut s = ring.acquire()?;
        if let Fill::SlotBySlot(pool, windows) = fill {
            s.fill_from(pool, 0, windows.take(slot))?;
        }
        s.publish(SlotMeta { sequence: i as u64, bytes: slot, layout: SlotLayout::bytes(slot) })?;
    }
    Ok(())
}

/// Closes a ring when dropped unless disarmed: a producer that fails or panics closes the
/// ring, since a consumer waits in [`SlotRing::next`] without a time limit and only a close
/// ends that wait.
struct CloseUnlessDone<'a> {
    ring: &'a SlotRing,
    done: bool,
}

impl Drop for CloseUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.ring.close();
        }
    }
}

/// Runs `producer` on a thread of its own while this thread consumes `items` slots on
/// `consumer`. A failure on either side closes the ring, so the other side stops waiting, and
/// is returned (the producer's first).
fn run_items(
    ring: &SlotRing,
    consumer: &Stream,
    items: usize,
    producer: impl FnOnce() -> Result<()> + Send,
) -> Result<()> {
    std::thread::scope(|scope| {
        let producer = scope.spawn(move || -> Result<()> {
            let mut guard = CloseUnlessDone { ring, done: false };
            let produced = producer();
            guard.done = produced.is_ok();
            produced
        });
        let consumed = (0..items).try_for_each(|_| ring.next(consumer).map(drop));
        if consumed.is_err() {
            // Before the join: a producer blocked in `acquire` on a full ring waits for this.
            ring.close();
        }
        let produced = producer
            .join()
            .unwrap_or_else(|_| Err(cuferry::Error::Unsupported { what: "producer panicked".into() }));
        produced.and(consumed)
    })
}

/// One large pinned -> device copy (host backend: host-stream copy), GB/s.
fn pinned_copy(device: Device, bytes: usize) -> Result<f64> {
    let stream = Stream::new(device)?;
    let src = PinnedBuffer::<u8>::zeroed(device, bytes)?;
    let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes)?;
    let secs = median_secs(5, || {
        copy(&stream, &src, &mut dst)?;
        dst.synchronize()
    })?;
    Ok(gbps(bytes, secs))
}

/// The pinned -> device copy cut as a ring's uploads are: `items` copies of `slot` bytes, each
/// from one of `depth` slots of a pinned buffer into the same slot of a device buffer, queued on
/// one stream and waited for at the end, GB/s. On the host backend both buffers stay in the
/// host's caches as the ring's slots do, where [`pinned_copy`]'s do not.
fn ring_shaped_copy(device: Device, slot: usize, depth: usize, items: usize) -> Result<f64> {
    let stream = Stream::new(device)?;
    let src = PinnedBuffer::<u8>::zeroed(device, depth * slot)?;
    let mut dst = DeviceBuffer::<u8>::zeroed(&stream, depth * slot)?;
    let secs = median_secs(PASSES, || {
        for i in 0..items {
            let at = (i % depth) * slot;
            copy_range(&stream, &src, at, &mut dst, at, slot)?;
        }
        stream.synchronize()
    })?;
    Ok(gbps(items * slot, secs))
}

/// The pinned rows' ceiling, named: the link, or on the host backend the ring-shaped copy
/// (`shaped`) when that is faster.
fn link_ceiling(link: f64, link_name: &str, shaped: Option<f64>) -> (String, f64) {
    match shaped {
        Some(shaped) if shaped > link => (format!("{link_name}, depth x slot"), shaped),
        _ => (link_name.to_string(), link),
    }
}

/// A direct copy from pageable memory to the device, GB/s.
fn pageable_copy(device: Device, bytes: usize) -> Result<f64> {
    let stream = Stream::new(device)?;
    let src = vec![1u8; bytes];
    let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes)?;
    let secs = median_secs(5, || dst.copy_from_slice(&stream, &src))?;
    Ok(gbps(bytes, secs))
}

/// A measured host memcpy: how many threads copied, whether it was ring-shaped, and its rate.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Memcpy {
    threads: usize,
    /// Into the ring's working set ([`ring_shaped_memcpy`]), not a reference-sized buffer.
    shaped: bool,
    gbps: f64,
}

impl Memcpy {
    /// The name a ceiling column shows.
    fn name(&self) -> String {
        let shape = if self.shaped { ", into depth x slot" } else { "" };
        format!("{}-thread memcpy{shape}", self.threads)
    }

    /// The fastest of `memcpys` (`None` when there are none).
    fn fastest<'m>(memcpys: impl IntoIterator<Item = &'m Memcpy>) -> Option<Memcpy> {
        memcpys.into_iter().copied().max_by(|a, b| a.gbps.total_cmp(&b.gbps))
    }
}

/// Parallel host memcpys pageable -> pinned of `bytes`, one on an executor of each of
/// `threads` threads (one source and destination for all), in that order.
fn parallel_memcpys(
    device: Device,
    bytes: usize,
    threads: &[usize],
    mut done: impl FnMut(),
) -> Result<Vec<Memcpy>> {
    let src = vec![1u8; bytes];
    let mut dst = PinnedBuffer::<u8>::zeroed(device, bytes)?;
    let dst = dst.as_mut_slice()?;
    let mut memcpys = Vec::with_capacity(threads.len());
    for &threads in threads {
        let pool = PackExecutor::new(threads)?;
        let secs = median_secs(5, || pool.copy(&src, dst))?;
        let copies = PackExecutor::copy_threads(threads, bytes);
        memcpys.push(Memcpy { threads: copies, shaped: false, gbps: gbps(bytes, secs) });
        done();
    }
    Ok(memcpys)
}

/// A parallel host memcpy shaped like a ring's fill: `items` windows of `slot` bytes of the
/// source, copied into a pinned buffer of `depth` slots (the ring's working set, small enough
/// to stay in the host's caches where [`parallel_memcpys`]' destination does not), up to
/// `depth` windows per call on `pool`: cut by [`PackExecutor::copy`]'s rule, or into `pieces`
/// (as many copying threads as a row has).
fn ring_shaped_memcpy(
    device: Device,
    pool: &PackExecutor,
    windows: &Windows,
    (slot, depth, items): (usize, usize, usize),
    pieces: Option<usize>,
) -> Result<Memcpy> {
    let per_call = depth.min(windows.len() / slot).max(1);
    let chunk = per_call * slot;
    let groups = depth / per_call;
    let calls = items.div_ceil(per_call);
    let mut ring = PinnedBuffer::<u8>::zeroed(device, groups * chunk)?;
    let ring = ring.as_mut_slice()?;
    let mut next = 0;
    let secs = median_secs(PASSES, || {
        for _ in 0..calls {
            let group = next % groups;
            let (src, dst) = (windows.take(chunk), &mut ring[group * chunk..(group + 1) * chunk]);
            match pieces {
                Some(pieces) => pool.copy_in_pieces(src, dst, pieces)?,
                None => pool.copy(src, dst)?,
            }
            next += 1;
        }
        Ok(())
    })?;
    // `copy_in_pieces` cuts at most one piece per thread (and per 64 bytes: chunks are larger).
    let threads =
        pieces.map_or(PackExecutor::copy_threads(pool.threads(), chunk), |p| p.clamp(1, pool.threads()));
    Ok(Memcpy { threads, shaped: true, gbps: gbps(calls * chunk, secs) })
}

/// The pageable rows' ceiling, named: the fastest of `memcpys` when that is slower than the
/// link (`link`: the pinned rows' ceiling), else the link.
fn fill_ceiling(link: &(String, f64), memcpys: &[Memcpy]) -> (String, f64) {
    match Memcpy::fastest(memcpys) {
        Some(m) if m.gbps < link.1 => (m.name(), m.gbps),
        _ => link.clone(),
    }
}

/// Runs `f` with `device`'s host wait mode set to `wait`, then puts the old mode back (also when
/// `f` fails).
fn with_host_wait<T>(device: Device, wait: HostWait, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let old = device.host_wait()?;
    device.set_host_wait(wait)?;
    let result = f();
    device.set_host_wait(old)?;
    result
}

/// Slot sizes whose fills hand chunks off most often: the rows that also poll, and (on CUDA)
/// the ones that also block.
fn hand_off_bound(slot: usize) -> bool {
    (MIB..=16 * MIB).contains(&slot)
}

/// One pageable fill to measure.
#[derive(Clone, Copy, Debug, PartialEq)]
struct FillCase {
    /// The executor's threads.
    threads: usize,
    /// The threads that copy (see the module docs).
    copies: usize,
    /// How long idle executor threads poll.
    spin: Duration,
    pipelined: bool,
    /// On CUDA: host waits blocked.
    block: bool,
}

impl FillCase {
    fn new(threads: usize, spin: Duration, pipelined: bool, block: bool, slot: usize, depth: usize) -> Self {
        // `produce` is called with `ahead == depth`: up to `depth` slots fill at once.
        let copies = if pipelined {
            PackExecutor::queued_copy_threads(threads, slot, depth)
        } else {
            PackExecutor::copy_threads(threads, slot)
        };
        FillCase { threads, copies, spin, pipelined, block }
    }

    /// Whether `other` would measure the same thing: the same threads copying in the same way
    /// (a slot-by-slot fill's caller always copies; a pipelined one's producer copies only when
    /// the executor has no workers).
    fn same_work(&self, other: &FillCase) -> bool {
        let producer_copies = |c: &FillCase| !c.pipelined || c.threads == 1;
        (self.copies, self.spin, self.pipelined, self.block)
            == (other.copies, other.spin, other.pipelined, other.block)
            && producer_copies(self) == producer_copies(other)
    }

    /// The row's parameters at ring depth `depth`.
    fn params(&self, depth: usize) -> String {
        let noun = if self.copies == 1 { "copy thread" } else { "copy threads" };
        let executor = if self.threads == self.copies {
            String::new()
        } else {
            format!(" (executor of {})", self.threads)
        };
        let how = match (self.pipelined, self.spin.is_zero(), self.block) {
            (true, _, true) => ", pipelined, host wait block".to_string(),
            (true, _, false) => ", pipelined".to_string(),
            (false, false, _) => format!(", polling {} us", self.spin.as_micros()),
            (false, true, _) => String::new(),
        };
        format!("depth {depth}, {} {noun}{executor}{how}", self.copies)
    }
}

/// One slot size and depth of the sweep, with its pageable fills.
struct Config {
    slot: usize,
    depth: usize,
    /// Slots a timed pass streams.
    items: usize,
    fills: Vec<FillCase>,
}

impl Config {
    /// The fills, in the order they run: slot by slot for every executor size, then (slots of
    /// 1-16 MiB) the largest executor polling; then pipelined for every size, and on CUDA (the
    /// largest executor, the same slots) pipelined with waiting threads blocked. A fill that
    /// would repeat an earlier one's work ([`FillCase::same_work`]) is left out.
    fn new(sw: &Sweep, device: Device, slot: usize, depth: usize) -> Self {
        let max_threads = sw.threads.iter().copied().max().unwrap_or(1);
        let case =
            |threads, spin, pipelined, block| FillCase::new(threads, spin, pipelined, block, slot, depth);
        let spinning = hand_off_bound(slot).then(|| case(max_threads, FILL_SPIN, false, false));
        let blocking = (hand_off_bound(slot) && !device.is_host())
            .then(|| case(max_threads, Duration::ZERO, true, true));
        let all = sw
            .threads
            .iter()
            .map(|&t| case(t, Duration::ZERO, false, false))
            .chain(spinning)
            .chain(sw.threads.iter().map(|&t| case(t, Duration::ZERO, true, false)))
            .chain(blocking);
        let mut fills: Vec<FillCase> = Vec::new();
        for fill in all {
            if !fills.iter().any(|f| f.same_work(&fill)) {
                fills.push(fill);
            }
        }
        // At least 16 slots a pass: a pass starts with one fill and ends with one upload that
        // nothing overlaps, (items + 1) / items of the steady state.
        let items = (sw.total / slot).max(2 * depth + 2).max(MIN_ITEMS);
        Config { slot, depth, items, fills }
    }

    /// The copying-thread counts of the fills.
    fn copy_counts(&self) -> BTreeSet<usize> {
        self.fills.iter().map(|f| f.copies).collect()
    }
}

/// Runs the sweep, adding its rows to `rows` as they are measured.
pub fn run(device: Device, quick: bool, rows: &mut Rows) -> Result<()> {
    let sw = sweep(device, quick);
    let max_threads = sw.threads.iter().copied().max().unwrap_or(1);
    let plan: Vec<Config> = sw
        .sizes
        .iter()
        .flat_map(|&slot| sw.depths.iter().map(move |&depth| (slot, depth)))
        .map(|(slot, depth)| Config::new(&sw, device, slot, depth))
        .collect();
    // The progress bar's steps: the three references, the reference memcpy for each other
    // copying-thread count, and per slot size and depth: the pinned ring, the host's shaped
    // copy, the shaped memcpy at the largest executor and at each count, and the fills.
    let counts: BTreeSet<usize> = plan.iter().flat_map(Config::copy_counts).collect();
    let host_shaped = usize::from(device.is_host());
    let steps = 3
        + counts.iter().filter(|&&c| c != max_threads).count()
        + plan.iter().map(|c| 2 + host_shaped + c.copy_counts().len() + c.fills.len()).sum::<usize>();
    let bar = rows.progress(steps as u64, "ring");
    let link_name = if device.is_host() { "host copy" } else { "pinned copy" };
    let link = pinned_copy(device, sw.reference)?;
    bar.inc(1);
    let direct = pageable_copy(device, sw.reference)?;
    bar.inc(1);
    // The reference-sized memcpy for the largest executor and each copying-thread count.
    let threads: Vec<usize> =
        std::iter::once(max_threads).chain(counts.iter().copied().filter(|&c| c != max_threads)).collect();
    let large: BTreeMap<usize, Memcpy> = parallel_memcpys(device, sw.reference, &threads, || bar.inc(1))?
        .into_iter()
        .map(|m| (m.threads, m))
        .collect();
    let best = large.get(&max_threads).copied();
    // The pageable source: four of the largest slots, and on a GPU machine at least 1 GiB (the
    // H100 machine's host reports a 300 MiB L3), so that a pass reads from memory, not cache.
    let largest = sw.sizes.iter().copied().max().unwrap_or(0);
    let floor = if device.is_host() { 0 } else { GIB };
    let source = vec![7u8; sw.reference.max(4 * largest).max(floor)];
    let windows = Windows::new(&source);
    let ceiling_pool = PackExecutor::new(max_threads)?;
    // The seed's ring (depth 2) per slot size, measured with the first depth when the sweep
    // has depth 2 (it always does), else on its own.
    let mut seed_rates: BTreeMap<usize, f64> = BTreeMap::new();
    for config in &plan {
        let Config { slot, depth, items, .. } = *config;
        let rate = gbps(items * slot, stream(device, slot, depth, items, Fill::Pinned)?);
        bar.inc(1);
        let shaped_link = if device.is_host() {
            bar.inc(1);
            Some(ring_shaped_copy(device, slot, depth, items)?)
        } else {
            None
        };
        let pinned_ceiling = link_ceiling(link, link_name, shaped_link);
        let seed = match seed_rates.get(&slot) {
            Some(&seed) => seed,
            None if depth == SEED_DEPTH => rate,
            None => {
                let items = (sw.total / slot).max(2 * SEED_DEPTH + 2).max(MIN_ITEMS);
                gbps(items * slot, stream(device, slot, SEED_DEPTH, items, Fill::Pinned)?)
            }
        };
        seed_rates.insert(slot, seed);
        rows.push(Row {
            section: "ring",
            case: "pinned source".into(),
            bytes: slot,
            params: format!("depth {depth}"),
            value: rate,
            unit: "GB/s",
            ceiling: Some(pinned_ceiling.clone()),
            baseline: Some((format!("depth-{SEED_DEPTH} ring (the seed's)"), seed)),
            same_threads: None,
        });
        // The memcpys: the largest executor's shaped one (cut by `copy`'s rule), and for each
        // copying-thread count of the fills the reference-sized one (once per run) and a
        // shorter shaped one cut into that many pieces.
        let mut memcpys: Vec<Memcpy> = best.into_iter().collect();
        memcpys.push(ring_shaped_memcpy(device, &ceiling_pool, &windows, (slot, depth, items), None)?);
        bar.inc(1);
        for copies in config.copy_counts() {
            let pool = PackExecutor::new(copies)?;
            let short = (items / SAME_THREADS_SHARE).max(depth);
            let shaped = ring_shaped_memcpy(device, &pool, &windows, (slot, depth, short), Some(copies))?;
            bar.inc(1);
            memcpys.extend(large.get(&copies).into_iter().chain([&shaped]));
        }
        // Per copying-thread count, the fastest memcpy on that many threads (the largest
        // executor's shaped one counts for the threads it copied on).
        let same_threads = |copies: usize| Memcpy::fastest(memcpys.iter().filter(|m| m.threads == copies));
        let fill_ceiling = fill_ceiling(&pinned_ceiling, &memcpys);
        for fill in &config.fills {
            let pool = PackExecutor::with_spin(fill.threads, fill.spin)?;
            let source = if fill.pipelined {
                Fill::Pipelined(&pool, &windows)
            } else {
                Fill::SlotBySlot(&pool, &windows)
            };
            let secs = if fill.block {
                with_host_wait(device, HostWait::Block, || stream(device, slot, depth, items, source))?
            } else {
                stream(device, slot, depth, items, source)?
            };
            bar.inc(1);
            rows.push(Row {
                section: "ring",
                case: "pageable source".into(),
                bytes: slot,
                params: fill.params(depth),
                value: gbps(items * slot, secs),
                unit: "GB/s",
                ceiling: Some(fill_ceiling.clone()),
                baseline: Some(("direct pageable copy".into(), direct)),
                same_threads: same_threads(fill.copies).map(|m| (m.name(), m.gbps)),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use cuferry::{Device, Error, Stream};

    use super::*;

    /// Runs `run_items` with `producer` on a host ring of depth 2 on a thread of its own;
    /// returns its result, or `None` if it did not return within 10 s (a hang).
    fn run_with(producer: impl FnOnce(&SlotRing) -> Result<()> + Send + 'static) -> Option<Result<()>> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let ring = SlotRing::new(Device::Host, RingOptions::new(2, 4096)).expect("ring");
            let consumer = Stream::new(Device::Host).expect("stream");
            let _ = tx.send(run_items(&ring, &consumer, 8, || producer(&ring)));
        });
        rx.recv_timeout(Duration::from_secs(10)).ok()
    }

    #[test]
    fn a_failing_producer_ends_the_run_with_its_error() {
        let result = run_with(|_| Err(Error::Unsupported { what: "the producer failed".into() }));
        let err = result.expect("run_items returned").expect_err("the producer's error");
        assert!(err.to_string().contains("the producer failed"), "{err}");
    }

    #[test]
    fn a_producer_failing_after_some_slots_ends_the_run() {
        let result = run_with(|ring| {
            produce(ring, 4096, 3, Fill::Pinned)?;
            Err(Error::Unsupported { what: "failed after three slots".into() })
        });
        let err = result.expect("run_items returned").expect_err("the producer's error");
        assert!(err.to_string().contains("after three slots"), "{err}");
    }

    #[test]
    fn a_panicking_producer_ends_the_run() {
        let result = run_with(|_| panic!("producer panic (expected by the test)"));
        assert!(result.expect("run_items returned").is_err());
    }

    #[test]
    fn a_full_run_passes() {
        let result = run_with(|ring| produce(ring, 4096, 8, Fill::Pinned));
        result.expect("run_items returned").expect("all 8 slots streamed");
    }

    #[test]
    fn the_fill_ceiling_is_the_fastest_memcpy_or_the_link() {
        let m = |threads, shaped, gbps| Memcpy { threads, shaped, gbps };
        let link = ("pinned copy".to_string(), 50.0);
        let memcpys = [m(16, false, 30.0), m(1, true, 40.0), m(4, true, 35.0)];
        assert_eq!(fill_ceiling(&link, &memcpys), ("1-thread memcpy, into depth x slot".into(), 40.0));
        assert_eq!(fill_ceiling(&link, &memcpys[..1]), ("16-thread memcpy".into(), 30.0));
        assert_eq!(fill_ceiling(&link, &[m(8, true, 60.0)]), link.clone());
        assert_eq!(fill_ceiling(&link, &[]), link);
    }

    #[test]
    fn the_host_link_ceiling_is_the_faster_copy() {
        assert_eq!(link_ceiling(6.0, "host copy", Some(9.0)), ("host copy, depth x slot".into(), 9.0));
        assert_eq!(link_ceiling(6.0, "host copy", Some(5.0)), ("host copy".into(), 6.0));
        assert_eq!(link_ceiling(50.0, "pinned copy", None), ("pinned copy".into(), 50.0));
    }

    #[test]
    fn the_shaped_memcpy_copies_every_window_once_per_call() {
        // A source of 10 slots, depth 4: calls of 4 windows each; a source smaller than the
        // ring (2 slots, depth 4) copies 2 windows per call. All must run without a slice out
        // of range and report a positive rate and the threads that copied.
        let pool = PackExecutor::new(2).expect("executor");
        let source = vec![3u8; 10 * 4096];
        let rate = |source: &[u8], depth, items, pieces| {
            let windows = Windows::new(source);
            ring_shaped_memcpy(Device::Host, &pool, &windows, (4096, depth, items), pieces).expect("rate")
        };
        assert!(rate(&source, 4, 16, None).gbps > 0.0);
        assert!(rate(&source[..2 * 4096], 4, 5, None).gbps > 0.0);
        assert!(rate(&source[..4096], 3, 5, None).gbps > 0.0);
        // 16 KiB calls stay on the caller by `copy`'s rule; two pieces were asked for here.
        assert_eq!(rate(&source, 4, 16, None).threads, 1);
        assert_eq!(rate(&source, 4, 16, Some(2)).threads, 2);
    }

    #[test]
    fn the_window_cursor_runs_on_and_starts_over_only_at_the_end() {
        let source: Vec<u8> = (0..10u8).collect();
        let windows = Windows::new(&source);
        assert_eq!(windows.take(4), &[0, 1, 2, 3]);
        assert_eq!(windows.take(3), &[4, 5, 6]);
        // Three bytes are left: a window of 4 starts over.
        assert_eq!(windows.take(4), &[0, 1, 2, 3]);
        assert_eq!(windows.take(6), &[4, 5, 6, 7, 8, 9]);
        assert_eq!(windows.take(20), &source[..]);
    }

    #[test]
    fn fills_are_labelled_by_the_threads_that_copy_and_repeats_are_dropped() {
        let sw = sweep(Device::Host, false);
        let params = |slot, depth| -> Vec<String> {
            Config::new(&sw, Device::Host, slot, depth).fills.iter().map(|f| f.params(depth)).collect()
        };
        // 64 KiB slots: every slot-by-slot fill copies on the producer alone; a pipelined fill
        // has at most `depth` slots (one piece each) to copy.
        assert_eq!(
            params(64 * KIB, 2),
            [
                "depth 2, 1 copy thread",
                "depth 2, 1 copy thread, pipelined",
                "depth 2, 2 copy threads (executor of 4), pipelined"
            ]
        );
        // 1 MiB: `copy` cuts at most 4 pieces; the polling row keeps its executor.
        assert_eq!(
            params(MIB, 4),
            [
                "depth 4, 1 copy thread",
                "depth 4, 4 copy threads",
                "depth 4, 4 copy threads (executor of 16), polling 50 us",
                "depth 4, 1 copy thread, pipelined",
                "depth 4, 3 copy threads (executor of 4), pipelined",
                "depth 4, 7 copy threads (executor of 8), pipelined",
                "depth 4, 15 copy threads (executor of 16), pipelined",
            ]
        );
        // 16 MiB: every executor size copies on all its threads slot by slot.
        assert_eq!(
            params(16 * MIB, 2)[..4],
            [
                "depth 2, 1 copy thread",
                "depth 2, 4 copy threads",
                "depth 2, 8 copy threads",
                "depth 2, 16 copy threads"
            ]
        );
    }
}
