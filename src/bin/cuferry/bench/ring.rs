//! The ring section: sustained throughput of a [`SlotRing`] for slot sizes, depths and fill
//! threads, from pinned sources (the data is already in the slots) and pageable sources,
//! against, in the same run:
//! - one large pinned copy (the link's ceiling; on the host backend: a host-stream copy);
//! - a direct copy from pageable memory (what a user does without the ring);
//! - a parallel host memcpy with as many threads as the largest fill, into a buffer as large as
//!   the reference copy and into one of the ring's size (depth x slot, which may stay in the
//!   host's caches as the ring's slots do): the faster is the fill's ceiling, with the link;
//! - for pinned sources, the same ring at depth 2 (the seed's fixed depth) as the baseline.
//!
//! Pageable sources are copied in three ways:
//! - slot by slot with [`ProducerSlot::fill_from`](cuferry::ring::ProducerSlot::fill_from);
//! - the same with the largest executor polling before it sleeps (slots of 1-16 MiB);
//! - pipelined, [`SlotRing::produce`] filling up to `depth` slots at once; on CUDA, for slots
//!   of 1-16 MiB, also with [`HostWait::Block`], so that threads waiting for an upload leave
//!   their cores to the fill threads (the default mode spins).
//!
//! A pageable pass reads source windows no earlier pass read (the source is at least 1 GiB on
//! a GPU machine), so the fill reads memory, not cache. A producer that fails or panics closes
//! the ring, and so does a consumer that fails: an error ends the section instead of hanging it.

use std::time::{Duration, Instant};

use cuferry::ring::{PackExecutor, RingOptions, SlotFill, SlotLayout, SlotMeta, SlotRing};
use cuferry::{copy, Device, DeviceBuffer, HostWait, PinnedBuffer, Result, Stream};
use indicatif::{ProgressBar, ProgressStyle};

use super::measure::{gbps, median_secs};
use super::report::Row;

const KIB: usize = 1 << 10;
/// Fewest slots a timed pass streams.
const MIN_ITEMS: usize = 16;
/// How long idle fill threads poll in the rows that measure polling (the ring's own waiters
/// poll this long).
const FILL_SPIN: Duration = Duration::from_micros(50);
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

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

/// Where a producer's data comes from.
#[derive(Clone, Copy)]
enum Fill<'a> {
    /// Already in the slots (a pinned source).
    Pinned,
    /// Copied from successive windows of a pageable source, one slot at a time.
    SlotBySlot(&'a PackExecutor, &'a [u8]),
    /// The same windows, copied by [`SlotRing::produce`] up to `depth` slots at once.
    Pipelined(&'a PackExecutor, &'a [u8]),
}

/// The `i`-th window of `slot` bytes of `source` (wrapping around).
fn window(source: &[u8], slot: usize, i: usize) -> &[u8] {
    let windows = (source.len() / slot).max(1);
    let off = (i % windows) * slot;
    &source[off..off + slot]
}

/// Streams `items` slots of `slot` bytes through a fresh ring, [`PASSES`] times after an
/// untimed round; returns the median seconds of a pass. Every pass reads windows of the source
/// that the pass before did not (wrapping around only once the source is used up).
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
    run_items(&ring, &consumer, depth, || produce(&ring, slot, 0, depth, fill))?;
    drain()?;
    let mut times = Vec::with_capacity(PASSES);
    for pass in 0..PASSES {
        let first = depth + pass * items;
        let start = Instant::now();
        run_items(&ring, &consumer, items, || produce(&ring, slot, first, items, fill))?;
        drain()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Produces `items` slots into `ring`, filled from windows `first..first + items` of `fill`'s
/// source.
fn produce(ring: &SlotRing, slot: usize, first: usize, items: usize, fill: Fill) -> Result<()> {
    if let Fill::Pipelined(pool, source) = fill {
        let fills = (0..items).map(|i| SlotFill::bytes(i as u64, window(source, slot, first + i)));
        return ring.produce(pool, ring.depth(), fills).map(drop);
    }
    for i in 0..items {
        let mut s = ring.acquire()?;
        if let Fill::SlotBySlot(pool, source) = fill {
            s.fill_from(pool, 0, window(source, slot, first + i))?;
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

/// A direct copy from pageable memory to the device, GB/s.
fn pageable_copy(device: Device, bytes: usize) -> Result<f64> {
    let stream = Stream::new(device)?;
    let src = vec![1u8; bytes];
    let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes)?;
    let secs = median_secs(5, || dst.copy_from_slice(&stream, &src))?;
    Ok(gbps(bytes, secs))
}

/// A parallel host memcpy pageable -> pinned with `threads` threads, GB/s.
fn parallel_memcpy(device: Device, bytes: usize, threads: usize) -> Result<f64> {
    let pool = PackExecutor::new(threads)?;
    let src = vec![1u8; bytes];
    let mut dst = PinnedBuffer::<u8>::zeroed(device, bytes)?;
    let dst = dst.as_mut_slice()?;
    let secs = median_secs(5, || pool.copy(&src, dst))?;
    Ok(gbps(bytes, secs))
}

/// A parallel host memcpy shaped like a ring's fill: `items` windows of `slot` bytes of
/// `source`, copied into a pinned buffer of `depth` slots (the ring's working set, small
/// enough to stay in the host's caches where [`parallel_memcpy`]'s destination does not),
/// up to `depth` windows per call, GB/s. The pageable rows' ceiling is the faster of the two:
/// a fill reaching more than either memcpy would show the ceiling measured something else.
fn ring_shaped_memcpy(
    device: Device,
    pool: &PackExecutor,
    source: &[u8],
    slot: usize,
    depth: usize,
    items: usize,
) -> Result<f64> {
    let per_call = depth.min(source.len() / slot).max(1);
    let chunk = per_call * slot;
    let groups = depth / per_call;
    let calls = items.div_ceil(per_call);
    let mut ring = PinnedBuffer::<u8>::zeroed(device, groups * chunk)?;
    let ring = ring.as_mut_slice()?;
    let mut next = 0;
    let secs = median_secs(PASSES, || {
        for _ in 0..calls {
            let group = next % groups;
            pool.copy(window(source, chunk, next), &mut ring[group * chunk..(group + 1) * chunk])?;
            next += 1;
        }
        Ok(())
    })?;
    Ok(gbps(calls * chunk, secs))
}

/// The pageable rows' ceiling, named: the link, or the faster host memcpy (`large` into a
/// buffer as big as the reference copy, `shaped` into the ring's working set) when that is
/// slower than the link.
fn fill_ceiling(link: f64, link_name: &str, large: f64, shaped: f64, threads: usize) -> (String, f64) {
    let (memcpy, shape) = if shaped > large { (shaped, ", into depth x slot") } else { (large, "") };
    if memcpy < link {
        (format!("{threads}-thread memcpy{shape}"), memcpy)
    } else {
        (link_name.to_string(), link)
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

/// Runs the sweep, adding its rows to `rows` as they are measured.
pub fn run(device: Device, quick: bool, rows: &mut Vec<Row>) -> Result<()> {
    let sw = sweep(device, quick);
    let max_threads = sw.threads.iter().copied().max().unwrap_or(1);
    let spun = sw.sizes.iter().filter(|&&s| hand_off_bound(s)).count();
    let blocked = if device.is_host() { 0 } else { spun };
    let configs = sw.sizes.len() * sw.depths.len() * (2 + 2 * sw.threads.len())
        + (spun + blocked) * sw.depths.len()
        + 3;
    let bar = ProgressBar::new(configs as u64).with_message("ring");
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style);
    }
    let link_name = if device.is_host() { "host copy" } else { "pinned copy" };
    let link = pinned_copy(device, sw.reference)?;
    bar.inc(1);
    let direct = pageable_copy(device, sw.reference)?;
    bar.inc(1);
    let memcpy = parallel_memcpy(device, sw.reference, max_threads)?;
    bar.inc(1);
    // The pageable source: four of the largest slots, and on a GPU machine at least 1 GiB (the
    // H100 machine's host reports a 300 MiB L3), so that a pass reads from memory, not cache.
    let largest = sw.sizes.iter().copied().max().unwrap_or(0);
    let floor = if device.is_host() { 0 } else { GIB };
    let source = vec![7u8; sw.reference.max(4 * largest).max(floor)];
    let ceiling_pool = PackExecutor::new(max_threads)?;
    for &slot in &sw.sizes {
        // The seed's ring (depth 2) for this slot size, measured with the first depth when the
        // sweep has depth 2 (it always does), else on its own.
        let mut seed_depth: Option<f64> = None;
        for &depth in &sw.depths {
            // At least 16 slots a pass: a pass starts with one fill and ends with one upload
            // that nothing overlaps, (items + 1) / items of the steady state.
            let items = (sw.total / slot).max(2 * depth + 2).max(MIN_ITEMS);
            let rate = gbps(items * slot, stream(device, slot, depth, items, Fill::Pinned)?);
            bar.inc(1);
            let shaped = ring_shaped_memcpy(device, &ceiling_pool, &source, slot, depth, items)?;
            bar.inc(1);
            let fill_ceiling = fill_ceiling(link, link_name, memcpy, shaped, max_threads);
            let seed = match seed_depth {
                Some(seed) => seed,
                None if depth == SEED_DEPTH => rate,
                None => {
                    let items = (sw.total / slot).max(2 * SEED_DEPTH + 2).max(MIN_ITEMS);
                    gbps(items * slot, stream(device, slot, SEED_DEPTH, items, Fill::Pinned)?)
                }
            };
            seed_depth = Some(seed);
            rows.push(Row {
                section: "ring",
                case: "pinned source".into(),
                bytes: slot,
                params: format!("depth {depth}"),
                value: rate,
                unit: "GB/s",
                ceiling: Some((link_name.into(), link)),
                baseline: Some((format!("depth-{SEED_DEPTH} ring (the seed's)"), seed)),
            });
            // The executor as built by default, then (largest thread count, slots of 1-16 MiB
            // where hand-offs weigh most) with workers that poll before they sleep; then the
            // pipelined fill for every thread count, and on CUDA (largest thread count, the same
            // slots) pipelined with waiting threads blocked.
            let spinning = hand_off_bound(slot).then_some((max_threads, FILL_SPIN, false, false));
            let blocking = (hand_off_bound(slot) && !device.is_host()).then_some((
                max_threads,
                Duration::ZERO,
                true,
                true,
            ));
            let fills = sw
                .threads
                .iter()
                .map(|&t| (t, Duration::ZERO, false, false))
                .chain(spinning)
                .chain(sw.threads.iter().map(|&t| (t, Duration::ZERO, true, false)))
                .chain(blocking);
            for (threads, spin, pipelined, block) in fills {
                let pool = PackExecutor::with_spin(threads, spin)?;
                let fill = if pipelined {
                    Fill::Pipelined(&pool, &source)
                } else {
                    Fill::SlotBySlot(&pool, &source)
                };
                let secs = if block {
                    with_host_wait(device, HostWait::Block, || stream(device, slot, depth, items, fill))?
                } else {
                    stream(device, slot, depth, items, fill)?
                };
                bar.inc(1);
                let how = match (pipelined, spin.is_zero(), block) {
                    (true, _, true) => ", pipelined, host wait block".to_string(),
                    (true, _, false) => ", pipelined".to_string(),
                    (false, false, _) => format!(", polling {} us", spin.as_micros()),
                    (false, true, _) => String::new(),
                };
                rows.push(Row {
                    section: "ring",
                    case: "pageable source".into(),
                    bytes: slot,
                    params: format!("depth {depth}, {threads} fill threads{how}"),
                    value: gbps(items * slot, secs),
                    unit: "GB/s",
                    ceiling: Some(fill_ceiling.clone()),
                    baseline: Some(("direct pageable copy".into(), direct)),
                });
            }
        }
    }
    bar.finish_and_clear();
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
            produce(ring, 4096, 0, 3, Fill::Pinned)?;
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
        let result = run_with(|ring| produce(ring, 4096, 0, 8, Fill::Pinned));
        result.expect("run_items returned").expect("all 8 slots streamed");
    }

    #[test]
    fn the_fill_ceiling_is_the_faster_memcpy_or_the_link() {
        assert_eq!(
            fill_ceiling(50.0, "pinned copy", 30.0, 40.0, 16),
            ("16-thread memcpy, into depth x slot".into(), 40.0)
        );
        assert_eq!(fill_ceiling(50.0, "pinned copy", 30.0, 20.0, 16), ("16-thread memcpy".into(), 30.0));
        assert_eq!(fill_ceiling(50.0, "pinned copy", 30.0, 60.0, 8), ("pinned copy".into(), 50.0));
    }

    #[test]
    fn the_shaped_memcpy_copies_every_window_once_per_call() {
        // A source of 10 slots, depth 4: calls of 4 windows each; a source smaller than the
        // ring (2 slots, depth 4) copies 2 windows per call. Both must run without a slice
        // out of range and report a positive rate.
        let pool = PackExecutor::new(2).expect("executor");
        let source = vec![3u8; 10 * 4096];
        assert!(ring_shaped_memcpy(Device::Host, &pool, &source, 4096, 4, 16).expect("rate") > 0.0);
        assert!(
            ring_shaped_memcpy(Device::Host, &pool, &source[..2 * 4096], 4096, 4, 5).expect("rate") > 0.0
        );
        assert!(ring_shaped_memcpy(Device::Host, &pool, &source[..4096], 4096, 3, 5).expect("rate") > 0.0);
    }
}
