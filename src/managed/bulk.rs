//! Bulk prefetch, discard and advice over many managed ranges: ONE batched CUDA call for the
//! set (the seed looped over a module's parameters one call each).
//!
//! Rules:
//! - Ranges of one allocation are merged (overlaps and neighbours), so an allocation shared by
//!   several views is counted, and moved, once. Each call returns the bytes it touched. A
//!   [`prefetch_each`] that sends the same CPU page to two locations is refused: CUDA rounds
//!   every prefetch out to whole CPU pages and does not order the operations of one batch, so
//!   where the page ended up would be undefined. Small allocations of a pool may share a page,
//!   so two of them can meet this rule too.
//! - Prefetches are grouped by location into one `cudaMemPrefetchBatchAsync`; a set that merges
//!   into a single range uses `cudaMemPrefetchAsync`. Sets of 8 ranges or more (not discards)
//!   are instead spread over 4 helper streams of the device, one `cudaMemPrefetchAsync` each,
//!   after the caller's stream and before its next work (events both ways): the driver migrates
//!   the streams' ranges in parallel, 2.7x faster than one batched call on an H100. CUDA's
//!   batched calls need `concurrentManagedAccess` on every device of the machine; where one
//!   lacks it, a prefetch of 2 to 7 ranges is a loop of `cudaMemPrefetchAsync` on the
//!   caller's stream instead, and a discard is [`Error::Unsupported`].
//! - On CUDA a discard takes only the whole CPU pages inside each merged range. CUDA does not
//!   say how it treats part of a page, and its driver migrates whole pages: a discard of part
//!   of one could take the page's other bytes, another allocation's, with it. The bytes of a
//!   partial page keep their contents (one valid "indeterminate" outcome), and
//!   [`discard_and_prefetch_all`] prefetches them. The host backend poisons exactly the bytes
//!   asked for.
//! - Advice is checked as CUDA checks it, on the host backend too: accessed-by advice names a
//!   device or the host (not a NUMA node), and no location names a negative NUMA node.
//! - Queued operations are ordered with every range's buffer (use tracking), so a prefetch runs
//!   after earlier writes and before later reads, whatever stream those were on.
//! - All ranges of a call come from CUDA pools, or all from host pools; mixing is an error.
//!   The capability rules of [`ManagedBuffer`](super::ManagedBuffer) apply.
//! - Advice on memory of a CUDA managed memory pool that the driver refuses
//!   (`cudaErrorNotSupported`; every allocation of such pools on the H100's driver 580.159)
//!   is [`Error::Unsupported`] saying so; `cudaMallocManaged` memory
//!   ([`ManagedPoolOptions::use_malloc_managed`](super::ManagedPoolOptions)) takes advice.

use std::collections::{BTreeMap, HashMap};
use std::os::raw::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use super::location::{Advice, Location};
use super::pool::{PoolInner, PoolKind, NOT_SUPPORTED};
use crate::cuda::managed::{self as raw, Batch};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::memory::tracker::{Access, UseTracker};
use crate::stream::Stream;

/// A byte range of one managed allocation, for the bulk functions. Made by
/// [`ManagedBuffer::range`](super::ManagedBuffer::range) or
/// [`ManagedBuffer::subrange`](super::ManagedBuffer::subrange).
#[derive(Clone, Copy, Debug)]
pub struct ManagedRange<'a> {
    id: u64,
    base: *mut u8,
    start: usize,
    end: usize,
    pool: &'a PoolInner,
    tracker: &'a UseTracker,
}

impl<'a> ManagedRange<'a> {
    pub(crate) fn new(
        id: u64,
        base: *mut u8,
        start: usize,
        end: usize,
        pool: &'a PoolInner,
        tracker: &'a UseTracker,
    ) -> Self {
        ManagedRange { id, base, start, end, pool, tracker }
    }

    /// Bytes in the range.
    pub fn bytes(&self) -> usize {
        self.end - self.start
    }
}

/// Whether the ranges live in CUDA pools (true) or host pools (false), after the checks.
fn backend_of(ranges: &[ManagedRange<'_>], what: &str, location: Option<Location>) -> Result<bool> {
    if let Some(l) = location {
        l.check(what)?;
    }
    let cuda = ranges.iter().any(|r| r.pool.kind != PoolKind::Host);
    if cuda && ranges.iter().any(|r| r.pool.kind == PoolKind::Host) {
        return Err(Error::invalid(format!("{what}: host-pool and CUDA-pool ranges in one call")));
    }
    if !cuda {
        if let Some(Location::Device(i)) = location {
            return Err(Error::unsupported(format!("{what}: host-pool memory cannot move to cuda:{i}")));
        }
        return Ok(false);
    }
    if let Some(r) = ranges.iter().find(|r| !r.pool.caps.concurrent_managed_access) {
        return Err(Error::unsupported(format!(
            "{what} needs concurrentManagedAccess, which {} lacks",
            r.pool.device
        )));
    }
    Ok(true)
}

/// Discards need `concurrentManagedAccess` on every CUDA device of the machine, not only the
/// pools' (CUDA's rule for `cudaMemDiscardBatchAsync` and the combined call): checked here so
/// a mixed machine gets [`Error::Unsupported`] naming the device, not a raw CUDA error.
fn check_every_device_for_discard(what: &str) -> Result<()> {
    match device_lacking_concurrent_access()? {
        Some(i) => Err(Error::unsupported(format!(
            "{what} needs concurrentManagedAccess on every device of the machine, which cuda:{i} lacks"
        ))),
        None => Ok(()),
    }
}

/// The first CUDA device of the machine without `concurrentManagedAccess`, if any: CUDA
/// refuses every batched prefetch or discard on such a machine, whatever devices the memory
/// and the stream belong to.
pub(crate) fn device_lacking_concurrent_access() -> Result<Option<u32>> {
    first_device_lacking(Device::try_cuda_count()?, crate::cuda::device::concurrent_managed_access)
}

/// [`device_lacking_concurrent_access`] with the device count and capability lookup given
/// (tests).
fn first_device_lacking(count: u32, concurrent: impl Fn(u32) -> Result<bool>) -> Result<Option<u32>> {
    for i in 0..count {
        if !concurrent(i)? {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

/// How a set of merged prefetch ranges is queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PrefetchPlan {
    /// One `cudaMemPrefetchAsync`.
    Single,
    /// One batched call (`cudaMemPrefetchBatchAsync`, or the discard-and-prefetch one).
    Batch,
    /// One `cudaMemPrefetchAsync` per range, spread over the helper streams.
    FanOut,
    /// One `cudaMemPrefetchAsync` per range on the caller's stream (no batch allowed).
    Loop,
}

impl PrefetchPlan {
    /// The plan for a prefetch of `ranges` merged ranges; `batch_allowed`: every device of
    /// the machine has `concurrentManagedAccess`. (Discards always take one batched call.)
    fn choose(ranges: usize, batch_allowed: bool) -> PrefetchPlan {
        match ranges {
            1 => PrefetchPlan::Single,
            n if n >= FAN_OUT_MIN_RANGES => PrefetchPlan::FanOut,
            _ if batch_allowed => PrefetchPlan::Batch,
            _ => PrefetchPlan::Loop,
        }
    }
}

/// The first address that two groups of spans (one group per location, each span
/// `(address, bytes)`) both reach once every span is rounded out to whole pages of `page`
/// bytes (a power of two), if any.
fn first_shared_page(groups: &[Vec<(usize, usize)>], page: usize) -> Option<usize> {
    let mut all = Vec::new();
    for spans in groups {
        // Rounded, then merged within the group: the group's pages as disjoint intervals.
        let mut rounded: Vec<(usize, usize)> = spans
            .iter()
            .map(|&(p, n)| (p & !(page - 1), (p + n).div_ceil(page).saturating_mul(page)))
            .collect();
        rounded.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::new();
        for (s, e) in rounded {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        all.extend(merged);
    }
    // Each group's intervals are disjoint, so any overlap is between two groups, and an
    // interval overlapping a later one overlaps its successor in start order too.
    all.sort_unstable();
    all.windows(2).find(|w| w[1].0 < w[0].1).map(|w| w[1].0)
}

/// A byte span: start address and length.
type Span = (*mut u8, usize);

/// Splits each span into the whole pages of `page` bytes (a power of two) inside it and the
/// pieces of partial pages at its ends: `(whole, partial)`, both in span order. A span inside
/// one page, or across the boundary of two without covering either, is all partial.
fn split_at_pages(spans: &[Span], page: usize) -> (Vec<Span>, Vec<Span>) {
    let (mut whole, mut partial) = (Vec::new(), Vec::new());
    for &(p, n) in spans {
        let address = p as usize;
        let head = (address.next_multiple_of(page) - address).min(n);
        let tail = (address + n) % page;
        if head + tail >= n {
            // No whole page inside (head + tail == n also when the span ends on the page
            // boundary that `head` reaches: then tail is 0 and head == n).
            if n > 0 {
                partial.push((p, n));
            }
            continue;
        }
        if head > 0 {
            partial.push((p, head));
        }
        whole.push((p.wrapping_add(head), n - head - tail));
        if tail > 0 {
            partial.push((p.wrapping_add(n - tail), tail));
        }
    }
    (whole, partial)
}

/// The host backend's discard: overwrites the merged spans with [`DISCARDED_BYTE`] in a job
/// queued on `stream`, ordered like CUDA's discard (a write). CUDA leaves discarded contents
/// indeterminate (often zero, or the old bytes); the host backend makes them recognisably
/// wrong instead, so code that reads before it writes fails its host tests.
fn poison_host_spans(ranges: &[ManagedRange<'_>], spans: &[(*mut u8, usize)], stream: &Stream) -> Result<()> {
    // Addresses as integers: the job runs on the stream's worker (raw pointers are not Send).
    let spans: Vec<(usize, usize)> = spans.iter().map(|&(p, n)| (p as usize, n)).collect();
    UseTracker::use_on(stream, &trackers(ranges), || {
        stream.host_fn_short(move || {
            for (address, bytes) in spans {
                // SAFETY: each span lies inside a live host-pool allocation whose tracker
                // records this job as a write, so the allocation outlives it and no other
                // queued use overlaps it; the caller of the (unsafe) discard promised that no
                // host reference to these bytes is alive.
                unsafe { std::ptr::write_bytes(address as *mut u8, DISCARDED_BYTE, bytes) };
            }
        })
    })
}

/// What the host backend writes over discarded bytes: 0xff, a NaN in every float type.
pub const DISCARDED_BYTE: u8 = 0xff;

/// The byte spans requested of one allocation: (id, base address, [(start, end)]).
type AllocationSpans = (u64, *mut u8, Vec<(usize, usize)>);

/// Merged (address, bytes) per allocation, in first-seen order, and the total bytes.
fn merge<'r>(ranges: impl Iterator<Item = &'r ManagedRange<'r>>) -> (Vec<(*mut u8, usize)>, usize) {
    let mut by_alloc: Vec<AllocationSpans> = Vec::new();
    for r in ranges {
        match by_alloc.iter_mut().find(|(id, _, _)| *id == r.id) {
            Some((_, _, spans)) => spans.push((r.start, r.end)),
            None => by_alloc.push((r.id, r.base, vec![(r.start, r.end)])),
        }
    }
    let mut out = Vec::new();
    let mut total = 0;
    for (_, base, mut spans) in by_alloc {
        spans.sort_unstable();
        let mut current: Option<(usize, usize)> = None;
        for (s, e) in spans {
            current = match current {
                Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
                Some((cs, ce)) => {
                    out.push((base.wrapping_add(cs), ce - cs));
                    total += ce - cs;
                    Some((s, e))
                }
                None => Some((s, e)),
            };
        }
        if let Some((cs, ce)) = current {
            out.push((base.wrapping_add(cs), ce - cs));
            total += ce - cs;
        }
    }
    (out, total)
}

/// One tracker per allocation, each declared written: prefetch and discard move (or drop)
/// pages, which nothing may read or write meanwhile, so they are ordered after every earlier
/// use and every later use after them (the conservative rule).
fn trackers<'a>(ranges: &[ManagedRange<'a>]) -> Vec<(&'a UseTracker, Access)> {
    let mut seen: Vec<(u64, &'a UseTracker)> = Vec::new();
    for r in ranges {
        if !seen.iter().any(|(id, _)| *id == r.id) {
            seen.push((r.id, r.tracker));
        }
    }
    seen.into_iter().map(|(_, t)| (t, Access::Write)).collect()
}

/// Prefetches every range to its own location in one batched call (8 ranges or more: over
/// helper streams, as the module rules say); returns the bytes. The same bytes sent to two
/// locations are refused.
///
/// # Errors
///
/// See the [module rules](crate::managed); CUDA errors of the batch.
pub fn prefetch_each(items: &[(ManagedRange<'_>, Location)], stream: &Stream) -> Result<usize> {
    prefetch_grouped(items, stream, false)
}

/// Prefetches every range to `location` in one batched call (8 ranges or more: over helper
/// streams, as the module rules say); returns the bytes.
///
/// # Examples
///
/// ```
/// use cuferry::managed::{prefetch_all, Location, ManagedPool, ManagedPoolOptions};
/// use cuferry::{Device, Stream};
///
/// let pool = ManagedPool::new(Device::Host, ManagedPoolOptions::default())?;
/// let stream = Stream::new(Device::Host)?;
/// let a = pool.alloc::<u8>(4096, &stream)?;
/// let b = pool.alloc::<u8>(100, &stream)?;
/// // A view of `a` inside a whole `a` is counted once.
/// let bytes = prefetch_all(&[a.range(), a.subrange(0..10)?, b.range()], Location::Host, &stream)?;
/// assert_eq!(bytes, 4196);
/// # Ok::<(), cuferry::Error>(())
/// ```
///
/// # Errors
///
/// See the [module rules](crate::managed); CUDA errors of the batch.
pub fn prefetch_all(ranges: &[ManagedRange<'_>], location: Location, stream: &Stream) -> Result<usize> {
    let items: Vec<(ManagedRange<'_>, Location)> = ranges.iter().map(|r| (*r, location)).collect();
    prefetch_grouped(&items, stream, false)
}

/// Discards every range and prefetches it to `location` in one batched call (never spread
/// over helper streams). On CUDA the partial CPU pages at the ends of the ranges are
/// prefetched without a discard, by a second call after the first (see the module rules).
///
/// On the host backend the bytes become [`DISCARDED_BYTE`] (see [`discard_all`]).
///
/// # Examples
///
/// ```
/// use cuferry::managed::{discard_and_prefetch_all, Location, ManagedPool, ManagedPoolOptions};
/// use cuferry::{Device, Stream};
///
/// let pool = ManagedPool::new(Device::Host, ManagedPoolOptions::default())?;
/// let stream = Stream::new(Device::Host)?;
/// let mut a = pool.alloc::<u32>(256, &stream)?;
/// // SAFETY: `a` is written below before it is read, and no slice of it is alive.
/// let bytes = unsafe { discard_and_prefetch_all(&[a.range()], Location::Host, &stream)? };
/// assert_eq!(bytes, 1024);
/// a.as_mut_slice()?.fill(7);
/// assert!(a.as_slice()?.iter().all(|&v| v == 7));
/// # Ok::<(), cuferry::Error>(())
/// ```
///
/// # Safety
///
/// 1. The contents are indeterminate afterwards: write them before reading.
/// 2. No slice of the ranges' buffers from `as_slice` is alive: the discard changes the bytes
///    under it.
///
/// # Errors
///
/// As [`prefetch_all`]; on CUDA, [`Error::Unsupported`] unless every device of the machine
/// has `concurrentManagedAccess` (CUDA's rule for discards).
pub unsafe fn discard_and_prefetch_all(
    ranges: &[ManagedRange<'_>],
    location: Location,
    stream: &Stream,
) -> Result<usize> {
    let items: Vec<(ManagedRange<'_>, Location)> = ranges.iter().map(|r| (*r, location)).collect();
    prefetch_grouped(&items, stream, true)
}

fn prefetch_grouped(items: &[(ManagedRange<'_>, Location)], stream: &Stream, discard: bool) -> Result<usize> {
    let what = if discard { "discard-and-prefetch" } else { "prefetch" };
    let ranges: Vec<ManagedRange<'_>> = items.iter().map(|(r, _)| *r).collect();
    let mut groups: BTreeMap<Location, Vec<&ManagedRange<'_>>> = BTreeMap::new();
    for (r, l) in items {
        groups.entry(*l).or_default().push(r);
    }
    // All ranges together first: two groups each of one backend may still mix the two.
    let cuda = backend_of(&ranges, what, None)?;
    for (location, group) in &groups {
        let rs: Vec<ManagedRange<'_>> = group.iter().map(|r| **r).collect();
        backend_of(&rs, what, Some(*location))?;
    }
    let mut batch = Batch { ptrs: Vec::new(), sizes: Vec::new(), locations: Vec::new(), starts: Vec::new() };
    let mut total = 0;
    let mut spans = Vec::new(); // each group's merged (address, bytes), to check for shared pages
    for (location, group) in &groups {
        let (merged, bytes) = merge(group.iter().copied());
        spans.push(merged.iter().map(|&(p, n)| (p as usize, n)).collect::<Vec<_>>());
        batch.starts.push(batch.ptrs.len());
        batch.locations.push(location.raw()?);
        for (p, n) in merged {
            batch.ptrs.push(p.cast::<c_void>());
            batch.sizes.push(n);
        }
        total += bytes;
    }
    let page = crate::memory::cpu_page_size();
    if let Some(address) = first_shared_page(&spans, page) {
        return Err(Error::invalid(format!(
            "{what}: the page at {address:#x} is sent to two locations in one call (CUDA moves \
             whole pages of {page} bytes and leaves the order of one batch undefined)"
        )));
    }
    if batch.ptrs.is_empty() {
        return Ok(total);
    }
    if !cuda {
        if discard {
            let spans: Vec<(*mut u8, usize)> =
                batch.ptrs.iter().zip(&batch.sizes).map(|(&p, &n)| (p.cast::<u8>(), n)).collect();
            poison_host_spans(&ranges, &spans, stream)?;
        }
        return Ok(total);
    }
    if discard {
        check_every_device_for_discard(what)?;
        let raw_stream = stream.cuda_raw()?;
        // Whole pages are discarded and prefetched in one call; the partial pages at the ends
        // of ranges (shared, maybe, with other allocations) are only prefetched, after it.
        let (mut whole, mut partial) = split_batch_at_pages(&batch, page);
        UseTracker::use_on(stream, &trackers(&ranges), || {
            // SAFETY: as below. The two calls touch different pages.
            unsafe {
                if !whole.ptrs.is_empty() {
                    enqueue_prefetch(&mut whole, PrefetchPlan::Batch, true, raw_stream)?;
                }
                let plan = if partial.ptrs.len() == 1 { PrefetchPlan::Single } else { PrefetchPlan::Batch };
                if partial.ptrs.is_empty() {
                    return Ok(());
                }
                enqueue_prefetch(&mut partial, plan, false, raw_stream)
            }
        })?;
        return Ok(total);
    }
    let raw_stream = stream.cuda_raw()?;
    let batch_allowed = device_lacking_concurrent_access()?.is_none();
    let plan = PrefetchPlan::choose(batch.ptrs.len(), batch_allowed);
    UseTracker::use_on(stream, &trackers(&ranges), || {
        if plan == PrefetchPlan::FanOut {
            // SAFETY: as below; the caller's stream waits for every helper stream's part.
            return unsafe { fan_out_prefetch(&batch, stream) };
        }
        // SAFETY: every range is inside a live allocation whose tracker records this batch,
        // so it is not freed before the stream has run it.
        unsafe { enqueue_prefetch(&mut batch, plan, false, raw_stream) }
    })?;
    Ok(total)
}

/// [`split_at_pages`] over every location group of `batch`: `(whole, partial)` batches, each
/// keeping the groups that still have ranges (CUDA wants every group non-empty).
fn split_batch_at_pages(batch: &Batch, page: usize) -> (Batch, Batch) {
    let empty = || Batch { ptrs: Vec::new(), sizes: Vec::new(), locations: Vec::new(), starts: Vec::new() };
    let (mut whole, mut partial) = (empty(), empty());
    for g in 0..batch.starts.len() {
        let end = batch.starts.get(g + 1).copied().unwrap_or(batch.ptrs.len());
        let spans: Vec<(*mut u8, usize)> =
            (batch.starts[g]..end).map(|k| (batch.ptrs[k].cast::<u8>(), batch.sizes[k])).collect();
        let (w, p) = split_at_pages(&spans, page);
        for (out, spans) in [(&mut whole, w), (&mut partial, p)] {
            if spans.is_empty() {
                continue;
            }
            out.starts.push(out.ptrs.len());
            out.locations.push(batch.locations[g]);
            for (p, n) in spans {
                out.ptrs.push(p.cast::<c_void>());
                out.sizes.push(n);
            }
        }
    }
    (whole, partial)
}

/// Sets of at least this many ranges are prefetched over [`HELPER_STREAMS`] streams.
const FAN_OUT_MIN_RANGES: usize = 8;

/// Helper streams per device for fanned-out prefetches. On an H100 (driver 580.159),
/// 1024 x 1 MiB to the device took 94 ms as a loop of `cudaMemPrefetchAsync` on one stream,
/// 78 ms as one `cudaMemPrefetchBatchAsync` (also 70-83 ms split over 2-8 streams), and
/// 28-29 ms as a loop spread over 4 or 8 streams: the driver migrates the ranges of different
/// streams in parallel.
const HELPER_STREAMS: usize = 4;

/// The helper streams of `stream`'s device (made on first use, kept for the process).
fn helper_streams(stream: &Stream) -> Result<Arc<Vec<Stream>>> {
    static HELPERS: OnceLock<Mutex<HashMap<Device, Arc<Vec<Stream>>>>> = OnceLock::new();
    let device = stream.device();
    let mut helpers = HELPERS.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = helpers.get(&device) {
        return Ok(Arc::clone(h));
    }
    let made = Arc::new((0..HELPER_STREAMS).map(|_| Stream::new(device)).collect::<Result<Vec<_>>>()?);
    helpers.insert(device, Arc::clone(&made));
    Ok(made)
}

/// Queues `batch`'s prefetches round-robin on the helper streams, each after the work queued
/// so far on `stream`, and makes `stream` wait for all of them.
///
/// # Safety
///
/// 1. Every range is managed memory that stays allocated until `stream` has run past this call.
unsafe fn fan_out_prefetch(batch: &Batch, stream: &Stream) -> Result<()> {
    let helpers = helper_streams(stream)?;
    let device = stream.device();
    let start = Event::new(device)?;
    start.record(stream)?;
    let mut raw_helpers = Vec::with_capacity(helpers.len());
    for h in helpers.iter() {
        h.wait_event(&start)?;
        raw_helpers.push(h.cuda_raw()?);
    }
    let result = ranges_with_location(batch).try_for_each(|(k, g)| {
        // SAFETY: precondition 1; `stream` waits below for the helper stream's work.
        unsafe {
            raw::prefetch_async(
                batch.ptrs[k],
                batch.sizes[k],
                batch.locations[g],
                raw_helpers[k % raw_helpers.len()],
            )
        }
    });
    // Whatever was queued, `stream` is ordered after it, so the memory outlives it.
    let ordered = helpers.iter().try_for_each(|h| {
        let done = Event::new(device)?;
        done.record(h)?;
        stream.wait_event(&done)
    });
    if ordered.is_err() || result.is_err() {
        // Part of the set may be queued on a helper stream that `stream` could not be made to
        // wait for (the tracker records the failed use on `stream` only): wait for it here so
        // nothing is freed under it.
        for h in helpers.iter() {
            let _ = h.wait_idle();
        }
    }
    result.and(ordered)
}

/// Every range of `batch` in order, as (range index, index of its location).
fn ranges_with_location(batch: &Batch) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..batch.starts.len()).flat_map(move |g| {
        let end = batch.starts.get(g + 1).copied().unwrap_or(batch.ptrs.len());
        (batch.starts[g]..end).map(move |k| (k, g))
    })
}

/// Queues `batch` on `stream` as `plan` says (not [`PrefetchPlan::FanOut`]): the batched call,
/// or one `cudaMemPrefetchAsync` per range, in order, stopping at the first error.
///
/// # Safety
///
/// 1. Every range is managed memory that stays allocated until the stream has run the call.
unsafe fn enqueue_prefetch(
    batch: &mut Batch,
    plan: PrefetchPlan,
    discard: bool,
    stream: crate::cuda::stream::RawStream,
) -> Result<()> {
    if plan == PrefetchPlan::Batch {
        // SAFETY: precondition 1.
        return unsafe { raw::prefetch_batch_async(batch, discard, stream) };
    }
    ranges_with_location(batch).try_for_each(|(k, g)| {
        // SAFETY: precondition 1.
        unsafe { raw::prefetch_async(batch.ptrs[k], batch.sizes[k], batch.locations[g], stream) }
    })
}

/// Discards every range in one batched call; returns the bytes of the ranges.
///
/// On the host backend the discarded bytes become [`DISCARDED_BYTE`] (by a job queued on
/// `stream`), so a read before a write shows in tests; on CUDA they are indeterminate. On CUDA
/// the call discards the whole CPU pages inside each range and leaves the partial pages at
/// its ends as they are (see the module rules); a range inside one page queues nothing.
///
/// # Safety
///
/// 1. The contents are indeterminate afterwards: write them before reading.
/// 2. No slice of the ranges' buffers from `as_slice` is alive: the discard changes the bytes
///    under it.
///
/// # Errors
///
/// See the [module rules](crate::managed); on CUDA, [`Error::Unsupported`] unless every
/// device of the machine has `concurrentManagedAccess` (CUDA's rule for discards); CUDA
/// errors of the batch.
pub unsafe fn discard_all(ranges: &[ManagedRange<'_>], stream: &Stream) -> Result<usize> {
    let cuda = backend_of(ranges, "discard", None)?;
    let (merged, total) = merge(ranges.iter());
    if merged.is_empty() {
        return Ok(total);
    }
    if !cuda {
        poison_host_spans(ranges, &merged, stream)?;
        return Ok(total);
    }
    check_every_device_for_discard("discard")?;
    // Only whole pages: see the module rules.
    let (whole, _) = split_at_pages(&merged, crate::memory::cpu_page_size());
    if whole.is_empty() {
        return Ok(total);
    }
    let mut batch = Batch {
        ptrs: whole.iter().map(|(p, _)| p.cast::<c_void>()).collect(),
        sizes: whole.iter().map(|(_, n)| *n).collect(),
        locations: Vec::new(),
        starts: Vec::new(),
    };
    let raw_stream = stream.cuda_raw()?;
    UseTracker::use_on(stream, &trackers(ranges), || {
        // SAFETY: as in `prefetch_grouped`.
        unsafe { raw::discard_batch_async(&mut batch, raw_stream) }
    })?;
    Ok(total)
}

/// Gives `advice` for every range in one call; returns the bytes advised.
///
/// CUDA has no batched advice: the call loops over the merged ranges and stops at the first
/// refusal, so on an error the ranges before it keep the advice (advice is a hint, and giving
/// it again, or its `Unset` form, is harmless).
///
/// # Errors
///
/// See the [module rules](crate::managed); CUDA errors of `cudaMemAdvise`.
pub fn advise_all(ranges: &[ManagedRange<'_>], advice: Advice) -> Result<usize> {
    advice.check()?;
    let cuda = backend_of(ranges, "advise", advice.location())?;
    let (merged, total) = merge(ranges.iter());
    if !cuda || merged.is_empty() {
        return Ok(total);
    }
    let (value, location) = advice.raw()?;
    // A thread that chose no device (advice takes no stream): the memory's device, so that the
    // runtime creates no context on device 0 (every range is CUDA memory here).
    if let Some(Device::Cuda(i)) = ranges.first().map(|r| r.pool.device) {
        let _ = crate::cuda::device::ensure_context(i);
    }
    let mut batch = Batch {
        ptrs: merged.iter().map(|(p, _)| p.cast::<c_void>()).collect(),
        sizes: merged.iter().map(|(_, n)| *n).collect(),
        locations: Vec::new(),
        starts: Vec::new(),
    };
    // SAFETY: every range is inside a live allocation (the borrows in `ranges`).
    unsafe { raw::advise_ranges(&mut batch, value, location) }
        .map_err(|e| advice_refused(e, ranges.iter().any(|r| r.pool.kind == PoolKind::ManagedPool)))?;
    Ok(total)
}

/// Turns the driver's refusal of advice on managed-pool memory into [`Error::Unsupported`];
/// other errors pass through.
pub(crate) fn advice_refused(err: Error, managed_pool_memory: bool) -> Error {
    match err {
        Error::Cuda { code: NOT_SUPPORTED, .. } if managed_pool_memory => Error::unsupported(
            "cudaMemAdvise on memory of a CUDA managed memory pool: this driver refuses advice on \
             such allocations (cudaErrorNotSupported); allocate from a pool made with \
             ManagedPoolOptions { use_malloc_managed: true } for memory that takes advice",
        ),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA refuses a batched call unless every device has `concurrentManagedAccess`,
    /// whichever device the memory is on: the check names the first device lacking it.
    #[test]
    fn batches_need_the_capability_on_every_device() {
        let lacking_two = |i: u32| Ok(i != 2);
        assert_eq!(first_device_lacking(4, lacking_two).unwrap(), Some(2));
        assert_eq!(first_device_lacking(2, lacking_two).unwrap(), None);
        assert_eq!(first_device_lacking(0, |_| Ok(false)).unwrap(), None);
    }

    /// Without batches, 2 to 7 ranges loop on the caller's stream; a single range and fanned
    /// out sets never need one; discards are always one batch (refused before otherwise).
    #[test]
    fn prefetch_plans() {
        use PrefetchPlan::*;
        for allowed in [true, false] {
            assert_eq!(PrefetchPlan::choose(1, allowed), Single);
            assert_eq!(PrefetchPlan::choose(FAN_OUT_MIN_RANGES, allowed), FanOut);
        }
        assert_eq!(PrefetchPlan::choose(2, true), Batch);
        assert_eq!(PrefetchPlan::choose(FAN_OUT_MIN_RANGES - 1, true), Batch);
        assert_eq!(PrefetchPlan::choose(2, false), Loop);
        assert_eq!(PrefetchPlan::choose(FAN_OUT_MIN_RANGES - 1, false), Loop);
    }

    /// CUDA-side discards take the whole pages inside each span; the partial pages at its
    /// ends, and spans with no whole page, are left (and prefetched by discard-and-prefetch).
    #[test]
    fn spans_split_into_whole_and_partial_pages() {
        let page = 4096;
        let at = |a: usize| std::ptr::null_mut::<u8>().wrapping_add(a);
        let addr = |v: Vec<(*mut u8, usize)>| v.into_iter().map(|(p, n)| (p as usize, n)).collect::<Vec<_>>();
        let split = |spans: &[(usize, usize)]| {
            let spans: Vec<(*mut u8, usize)> = spans.iter().map(|&(a, n)| (at(a), n)).collect();
            let (w, p) = split_at_pages(&spans, page);
            (addr(w), addr(p))
        };
        // Exactly one page; two pages with a head and a tail; inside one page.
        assert_eq!(split(&[(8192, 4096)]), (vec![(8192, 4096)], vec![]));
        assert_eq!(split(&[(8000, 8192 + 400)]), (vec![(8192, 8192)], vec![(8000, 192), (16384, 208)]));
        assert_eq!(split(&[(8200, 100)]), (vec![], vec![(8200, 100)]));
        // Ending on a boundary without covering a page; across a boundary without covering
        // either page; starting on a boundary with a tail; empty.
        assert_eq!(split(&[(8000, 192)]), (vec![], vec![(8000, 192)]));
        assert_eq!(split(&[(8000, 4096)]), (vec![], vec![(8000, 4096)]));
        assert_eq!(split(&[(8192, 5000)]), (vec![(8192, 4096)], vec![(12288, 904)]));
        assert_eq!(split(&[(8192, 0)]), (vec![], vec![]));
        // Against a byte-by-byte model over random spans: every byte is in exactly one piece,
        // whole pieces are whole pages, and partial pieces hold no whole page.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as usize
        };
        for _ in 0..2000 {
            let (a, n) = (next(5 * page), next(4 * page));
            let (whole, partial) = split(&[(a, n)]);
            for &(p, len) in &whole {
                assert!(p % page == 0 && len % page == 0 && len > 0, "{a} {n}: {whole:?}");
            }
            for &(p, len) in &partial {
                assert!(len > 0 && p.next_multiple_of(page) + page > p + len, "{a} {n}: {partial:?}");
            }
            let mut bytes: Vec<usize> =
                whole.iter().chain(&partial).flat_map(|&(p, len)| p..p + len).collect();
            bytes.sort_unstable();
            assert_eq!(bytes, (a..a + n).collect::<Vec<_>>(), "{a} {n}");
        }
    }

    /// Location groups keep their locations, and groups left without ranges are dropped.
    #[test]
    fn batches_split_by_group() {
        let page = 4096;
        let at = |a: usize| std::ptr::null_mut::<c_void>().wrapping_byte_add(a);
        let location = |id| crate::sys::cuferry_location { type_: 1, id };
        let batch = Batch {
            ptrs: vec![at(100), at(8192), at(20000)],
            sizes: vec![50, 4096, 10],
            locations: vec![location(0), location(1)],
            starts: vec![0, 2],
        };
        let (whole, partial) = split_batch_at_pages(&batch, page);
        assert_eq!((whole.ptrs, whole.sizes, whole.starts), (vec![at(8192)], vec![4096], vec![0]));
        assert_eq!(whole.locations.iter().map(|l| l.id).collect::<Vec<_>>(), vec![0]);
        assert_eq!(
            (partial.ptrs, partial.sizes, partial.starts),
            (vec![at(100), at(20000)], vec![50, 10], vec![0, 1])
        );
        assert_eq!(partial.locations.iter().map(|l| l.id).collect::<Vec<_>>(), vec![0, 1]);
    }

    /// Ranges are visited in order, each with the location group it starts in or follows.
    #[test]
    fn ranges_are_paired_with_their_locations() {
        let batch = Batch {
            ptrs: vec![std::ptr::null_mut(); 5],
            sizes: vec![1; 5],
            locations: Vec::new(),
            starts: vec![0, 2],
        };
        let got: Vec<(usize, usize)> = ranges_with_location(&batch).collect();
        assert_eq!(got, vec![(0, 0), (1, 0), (2, 1), (3, 1), (4, 1)]);
        let none = Batch { ptrs: Vec::new(), sizes: Vec::new(), locations: Vec::new(), starts: Vec::new() };
        assert_eq!(ranges_with_location(&none).count(), 0);
    }

    /// Spans of two groups conflict when they reach one page, not only when they share bytes;
    /// spans of one group may share pages.
    #[test]
    fn shared_pages_between_groups() {
        let page = 4096;
        // Two halves of one page to two locations.
        assert_eq!(first_shared_page(&[vec![(8192, 100)], vec![(8292, 100)]], page), Some(8192));
        // The end of one page and the start of the next: no page in common.
        assert_eq!(first_shared_page(&[vec![(8192, 4096)], vec![(12288, 10)]], page), None);
        // One byte over the boundary reaches the next page.
        assert_eq!(first_shared_page(&[vec![(8192, 4097)], vec![(12290, 10)]], page), Some(12288));
        // Within a group, shared pages are fine, and a long span of one group covering both
        // ends of another group's span is found through its neighbours.
        assert_eq!(first_shared_page(&[vec![(0, 10), (20, 10), (4096, 10)]], page), None);
        let covering = [vec![(0, 10), (100, 40_000)], vec![(20_000, 8)]];
        assert_eq!(first_shared_page(&covering, page), Some(16384));
        assert_eq!(first_shared_page(&[vec![(0, 1)], vec![(1 << 20, 1)], vec![(4095, 2)]], page), Some(0));
    }
}
