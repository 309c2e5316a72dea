//! Batched copies: many ranges between buffers queued as one operation, as a paged KV cache,
//! a gather of replay items or a set of weights needs. On CUDA the batch is one
//! `cudaMemcpyBatchAsync` call instead of one `cudaMemcpyAsync` per range.
//!
//! Rules:
//! - A [`CopyBatch`] collects pairs (a source, a destination, and ranges between them) with
//!   [`CopyBatch::add`], then [`CopyBatch::submit`] queues them on the batch's stream and
//!   returns at once. [`copy_ranges`] does both for one pair.
//! - Each pair obeys [`copy_range`](super::copy_range)'s rules: its direction must be one the
//!   stream can copy, and every range must lie inside both buffers. `add` checks both before
//!   it keeps anything, so a refused pair leaves the batch as it was.
//! - The copies of a batch run in no set order among themselves (CUDA's rule for a batch):
//!   `submit` refuses a batch in which a destination byte is written twice, or a byte one
//!   copy writes is read by another (`Error::InvalidArgument`), before anything is queued.
//!   Many copies may read the same source bytes.
//! - The batch is one use of each of its buffers, ordered as a copy is: after the earlier
//!   writes to its sources and every earlier use of its destinations, and before the later
//!   ones. The borrows end at `submit`; the buffers' trackers keep their memory alive until
//!   the batch has run.
//! - On CUDA, copies between two devices (peer copies) are queued one by one with
//!   `cudaMemcpyPeerAsync` inside that same use; every other copy of the batch goes into one
//!   `cudaMemcpyBatchAsync`, sources read in stream order.
//! - On the host backend the batch is one job that copies the ranges in the order they were
//!   added (a batch of at most 256 KiB on an idle stream runs on the calling thread).
//! - Ranges of zero elements are skipped; a batch without bytes queues nothing.

use std::fmt;
use std::os::raw::c_void;

use super::{check_range, direction, CopyDirection, HostCopy, HOST_INLINE_COPY_BYTES};
use crate::error::{Error, Result};
use crate::memory::sealed::RawParts;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{Element, Memory, MemoryKind};
use crate::stream::host::Job;
use crate::stream::{Stream, StreamBackend};

/// One copy of a batch, in elements: `len` elements from `src[src_offset..]` to
/// `dst[dst_offset..]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CopyRange {
    /// First element read from the source.
    pub src_offset: usize,
    /// First element written in the destination.
    pub dst_offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl CopyRange {
    /// `len` elements from `src_offset` to `dst_offset`.
    pub const fn new(src_offset: usize, dst_offset: usize, len: usize) -> Self {
        Self { src_offset, dst_offset, len }
    }
}

/// A source and a destination of a batch, with the direction of their copies.
struct Pair<'a> {
    src: RawParts<'a>,
    dst: RawParts<'a>,
    src_kind: MemoryKind,
    dst_kind: MemoryKind,
    direction: CopyDirection,
}

/// One range of a pair, in absolute addresses and bytes (never 0 bytes).
#[derive(Clone, Copy)]
struct ByteCopy {
    pair: usize,
    src: *mut u8,
    dst: *mut u8,
    bytes: usize,
}

/// Copies between several buffers, queued together on one stream. See the
/// [module docs](self) for the rules.
///
/// # Examples
///
/// Gathering scattered pages of a host pool into a contiguous device buffer:
///
/// ```
/// use cuferry::{CopyBatch, CopyRange, Device, DeviceBuffer, PinnedBuffer, Stream};
/// let stream = Stream::new(Device::Host)?;
/// let pool = PinnedBuffer::from_slice(Device::Host, &(0..64u32).collect::<Vec<_>>())?;
/// let mut pages = DeviceBuffer::<u32>::zeroed(&stream, 24)?;
/// let mut batch = CopyBatch::new(&stream);
/// batch.add(&pool, &mut pages, &[CopyRange::new(40, 0, 8), CopyRange::new(8, 8, 8), CopyRange::new(0, 16, 8)])?;
/// batch.submit()?;
/// let got = pages.to_vec(&stream)?;
/// assert_eq!(&got[..9], &[40, 41, 42, 43, 44, 45, 46, 47, 8]);
/// assert_eq!(got[16], 0);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub struct CopyBatch<'a> {
    stream: &'a Stream,
    pairs: Vec<Pair<'a>>,
    copies: Vec<ByteCopy>,
}

impl fmt::Debug for CopyBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyBatch")
            .field("device", &self.stream.device())
            .field("pairs", &self.pairs.len())
            .field("copies", &self.copies.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl<'a> CopyBatch<'a> {
    /// An empty batch for `stream`.
    pub fn new(stream: &'a Stream) -> Self {
        Self { stream, pairs: Vec::new(), copies: Vec::new() }
    }

    /// Adds copies of `ranges` from `src` to `dst`. `dst` stays borrowed until the batch is
    /// submitted or dropped; `src` may be added again, as the source of other pairs.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a range lies outside either buffer, the stream cannot
    /// reach one of them, or `dst` is a read-only [`ForeignBuffer`](crate::ForeignBuffer);
    /// [`Error::Unsupported`] on a host stream for managed memory of a device without
    /// `concurrentManagedAccess`. The batch is then unchanged.
    pub fn add<T, S, D>(&mut self, src: &'a S, dst: &'a mut D, ranges: &[CopyRange]) -> Result<()>
    where
        T: Element,
        S: Memory<T> + ?Sized,
        D: Memory<T> + ?Sized,
    {
        let dst: &'a D = dst;
        // SAFETY: `dst` was borrowed mutably for `'a`, which outlives the batch, so no one else
        // writes it while the batch is queued.
        unsafe { self.add_tracked(src, dst, ranges) }
    }

    /// [`CopyBatch::add`] with a destination borrowed shared, for callers whose protocol
    /// orders every write to it through its tracker (the C ABI's buffer handles).
    ///
    /// # Safety
    ///
    /// 1. While the batch is queued or running, nothing writes `dst`'s memory except
    ///    operations ordered by its tracker (cuferry copies and kernels; no host write through
    ///    a pointer).
    pub(crate) unsafe fn add_tracked<T, S, D>(
        &mut self,
        src: &'a S,
        dst: &'a D,
        ranges: &[CopyRange],
    ) -> Result<()>
    where
        T: Element,
        S: Memory<T> + ?Sized,
        D: Memory<T> + ?Sized,
    {
        dst.check_writable()?;
        let direction = direction(self.stream.device(), src.kind(), dst.kind())?;
        let size = std::mem::size_of::<T>();
        for (k, r) in ranges.iter().enumerate() {
            // Names are formatted only for a range that does not fit: a batch may hold
            // thousands of ranges, and formatting each cost more than their copies.
            check_range(|| format!("copy {k}'s source"), r.src_offset, r.len, src.len(), size)?;
            check_range(|| format!("copy {k}'s destination"), r.dst_offset, r.len, dst.len(), size)?;
        }
        let (s, d) = (src.raw_parts(), dst.raw_parts());
        self.copies.try_reserve(ranges.len()).map_err(|e| {
            Error::out_of_memory(format!("no memory to list {} more copies: {e}", ranges.len()))
        })?;
        let pair = self.pairs.len();
        for r in ranges.iter().filter(|r| r.len > 0) {
            debug_assert!(
                (r.src_offset + r.len) * size <= s.bytes && (r.dst_offset + r.len) * size <= d.bytes
            );
            self.copies.push(ByteCopy {
                pair,
                src: s.ptr.wrapping_add(r.src_offset * size),
                dst: d.ptr.wrapping_add(r.dst_offset * size),
                bytes: r.len * size,
            });
        }
        self.pairs.push(Pair { src: s, dst: d, src_kind: src.kind(), dst_kind: dst.kind(), direction });
        Ok(())
    }

    /// The number of copies of at least one element added so far.
    pub fn len(&self) -> usize {
        self.copies.len()
    }

    /// Whether the batch has nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }

    /// The bytes the batch copies.
    pub fn bytes(&self) -> usize {
        self.copies.iter().map(|c| c.bytes).sum()
    }

    /// Queues the batch on its stream and returns at once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when two copies write the same byte, or one copy reads a
    /// byte another writes (nothing is queued then); errors of the stream or of CUDA's copy
    /// calls (the batch's use of its buffers is recorded all the same, so none is freed under
    /// a copy that was queued).
    pub fn submit(self) -> Result<()> {
        self.submit_as(Queueing::Batched)
    }

    /// Queues the batch with its copies as `how` says, under the same checks and one use.
    fn submit_as(self, how: Queueing) -> Result<()> {
        if self.copies.is_empty() {
            return Ok(());
        }
        check_independent(&self.copies)?;
        let mut uses: Vec<(&UseTracker, Access)> = self
            .pairs
            .iter()
            .flat_map(|p| [(p.src.tracker, Access::Read), (p.dst.tracker, Access::Write)])
            .collect();
        // Each buffer once, as a write if any pair writes it: `use_on` takes a buffer listed
        // twice as written, and a source shared by several pairs is only read (it must not
        // wait for, or hold up, other streams' reads of it).
        uses.sort_unstable_by_key(|&(t, a)| {
            (std::ptr::from_ref::<UseTracker>(t) as usize, a == Access::Read)
        });
        uses.dedup_by(|later, kept| std::ptr::eq(later.0, kept.0));
        UseTracker::use_on(self.stream, &uses, || match how {
            Queueing::Batched => self.enqueue(),
            Queueing::OneByOne => self.enqueue_one_by_one(),
        })
    }

    /// Queues each copy on its own, as [`copy_range`](super::copy_range) would (one
    /// `cudaMemcpyAsync` or host job each), inside the caller's one use.
    fn enqueue_one_by_one(&self) -> Result<()> {
        self.copies.iter().try_for_each(|c| self.enqueue_alone(c))
    }

    /// Queues one copy of the batch as [`copy_range`](super::copy_range) would.
    fn enqueue_alone(&self, c: &ByteCopy) -> Result<()> {
        let pair = &self.pairs[c.pair];
        super::enqueue(self.stream, pair.direction, (pair.src_kind, c.src), (pair.dst_kind, c.dst), c.bytes)
    }

    /// Queues the copies on the stream's backend (the uses are being recorded by the caller).
    fn enqueue(&self) -> Result<()> {
        match self.stream.backend() {
            StreamBackend::Host(q) => {
                let copies: Vec<HostCopy> =
                    self.copies.iter().map(|c| HostCopy { src: c.src, dst: c.dst, bytes: c.bytes }).collect();
                let small = self.bytes() <= HOST_INLINE_COPY_BYTES;
                let job: Job = Box::new(move || {
                    for copy in copies {
                        copy.run();
                    }
                    Ok(())
                });
                if small {
                    q.submit_or_run(job)
                } else {
                    q.submit(job)
                }
            }
            StreamBackend::Cuda(s) => {
                let s = s.queue_handle();
                let mut dsts: Vec<*mut c_void> = Vec::with_capacity(self.copies.len());
                let mut srcs: Vec<*const c_void> = Vec::with_capacity(self.copies.len());
                let mut sizes: Vec<usize> = Vec::with_capacity(self.copies.len());
                for c in &self.copies {
                    if self.pairs[c.pair].direction == CopyDirection::Peer {
                        // Peer copies one by one (`cudaMemcpyPeerAsync`), as `copy_range`
                        // queues them, inside this batch's use.
                        self.enqueue_alone(c)?;
                    } else {
                        dsts.push(c.dst.cast());
                        srcs.push(c.src.cast_const().cast());
                        sizes.push(c.bytes);
                    }
                }
                if dsts.is_empty() {
                    return Ok(());
                }
                // SAFETY: every range is in bounds of a live buffer whose tracker records this
                // batch (neither freed nor touched by the host before it runs), and
                // `check_independent` found no destination overlapping another copy's range.
                unsafe { crate::cuda::memory::memcpy_batch_async(&dsts, &srcs, &sizes, s) }
            }
        }
    }
}

/// How a submitted batch queues its copies.
#[derive(Clone, Copy)]
enum Queueing {
    /// One `cudaMemcpyBatchAsync` (peer copies aside); one job on the host backend.
    Batched,
    /// One `cudaMemcpyAsync` (or host job) per copy: the loop a batch replaces.
    OneByOne,
}

/// Checks that no byte a copy writes is written or read by another copy of the batch (nor
/// read by the same copy: a copy's ranges must be disjoint, as for `copy_range`).
fn check_independent(copies: &[ByteCopy]) -> Result<()> {
    let span = |c: &ByteCopy, p: *mut u8| (p as usize, p as usize + c.bytes);
    let mut writes: Vec<(usize, usize, usize)> =
        copies.iter().enumerate().map(|(k, c)| (span(c, c.dst).0, span(c, c.dst).1, k)).collect();
    writes.sort_unstable();
    for w in writes.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::invalid(format!(
                "copies {} and {} of the batch write the same bytes (at {:#x}); a batch runs its copies in no set order",
                w[0].2.min(w[1].2),
                w[0].2.max(w[1].2),
                w[1].0
            )));
        }
    }
    for (k, c) in copies.iter().enumerate() {
        let (start, end) = span(c, c.src);
        // The first write ending past `start`; writes are disjoint and sorted, so it is the
        // only one that can begin before `end`.
        let first = writes.partition_point(|w| w.1 <= start);
        if let Some(&(w_start, _, writer)) = writes.get(first) {
            if w_start < end {
                return Err(Error::invalid(format!(
                    "copy {k} of the batch reads bytes copy {writer} writes (at {:#x}); a batch runs its copies in no set order",
                    w_start.max(start)
                )));
            }
        }
    }
    Ok(())
}

/// Copies each of `ranges` from `src` to `dst` on `stream`, as one batch ([`CopyBatch`]).
///
/// # Errors
///
/// As [`CopyBatch::add`] and [`CopyBatch::submit`].
pub fn copy_ranges<T, S, D>(
    stream: &Stream,
    src: &S,
    dst: &mut D,
    ranges: &[CopyRange],
) -> Result<CopyDirection>
where
    T: Element,
    S: Memory<T> + ?Sized,
    D: Memory<T> + ?Sized,
{
    let direction = direction(stream.device(), src.kind(), dst.kind())?;
    let mut batch = CopyBatch::new(stream);
    batch.add(src, dst, ranges)?;
    batch.submit()?;
    Ok(direction)
}

/// [`copy_ranges`] with one `cudaMemcpyAsync` per range (one host job each on the host
/// backend) instead of one batched call: the loop a batch replaces, with the same checks and
/// cuferry's ordering paid once for all the ranges, as the batch pays it. It is the baseline
/// that `cuferry bench` measures the batch against; use [`copy_ranges`] otherwise.
///
/// # Errors
///
/// As [`copy_ranges`].
pub fn copy_ranges_one_by_one<T, S, D>(
    stream: &Stream,
    src: &S,
    dst: &mut D,
    ranges: &[CopyRange],
) -> Result<()>
where
    T: Element,
    S: Memory<T> + ?Sized,
    D: Memory<T> + ?Sized,
{
    let mut batch = CopyBatch::new(stream);
    batch.add(src, dst, ranges)?;
    batch.submit_as(Queueing::OneByOne)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(pair: usize, src: usize, dst: usize, bytes: usize) -> ByteCopy {
        ByteCopy { pair, src: src as *mut u8, dst: dst as *mut u8, bytes }
    }

    /// Independence is pairwise over every copy: each kind of conflict is found wherever it
    /// sits in the list, and touching ranges are not a conflict.
    #[test]
    fn conflicts_are_found_between_any_two_copies() {
        let fine = [copy(0, 0, 1000, 10), copy(0, 0, 1010, 10), copy(1, 5, 990, 10), copy(1, 2000, 3000, 1)];
        check_independent(&fine).unwrap();
        let mut writes_twice = fine.to_vec();
        writes_twice.push(copy(2, 4000, 1019, 1));
        let mut reads_a_write = fine.to_vec();
        reads_a_write.insert(0, copy(2, 1005, 5000, 2));
        let mut reads_its_own_write = fine.to_vec();
        reads_its_own_write.push(copy(2, 6000, 6004, 8));
        let mut write_inside_a_read = fine.to_vec();
        write_inside_a_read.push(copy(2, 7000, 3, 1));
        for bad in [writes_twice, reads_a_write, reads_its_own_write, write_inside_a_read] {
            let err = check_independent(&bad).expect_err("a dependent batch passed");
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        }
    }

    /// The sweep against a plain all-pairs comparison, on random small batches.
    #[test]
    fn sweep_matches_all_pairs() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n) as usize
        };
        let overlap = |a: (usize, usize), b: (usize, usize)| a.0 < b.0 + b.1 && b.0 < a.0 + a.1;
        for _ in 0..20_000 {
            let n = 1 + next(5);
            let copies: Vec<ByteCopy> = (0..n).map(|k| copy(k, next(64), next(64), 1 + next(8))).collect();
            let mut dependent = false;
            for (i, a) in copies.iter().enumerate() {
                for (j, b) in copies.iter().enumerate() {
                    let (aw, bw, br) =
                        ((a.dst as usize, a.bytes), (b.dst as usize, b.bytes), (b.src as usize, b.bytes));
                    dependent |= (i != j && overlap(aw, bw)) || overlap(aw, br);
                }
            }
            assert_eq!(
                check_independent(&copies).is_err(),
                dependent,
                "{:?}",
                copies.iter().map(|c| (c.src as usize, c.dst as usize, c.bytes)).collect::<Vec<_>>()
            );
        }
    }
}
