//! The pack executor: a small pool of threads that copies pageable memory into slots in
//! parallel (one thread copies 7.5-12 GB/s; 16 reach 38.6 GB/s on the GPU machine).
//!
//! Rules:
//! - Chunks go to one first-in, first-out `WorkQueue` (crate::work_queue) that every worker
//!   takes from: a batch of chunks wakes the sleeping workers it needs with one call (that
//!   module has the numbers).
//! - [`PackExecutor::copy`]'s caller runs queued chunks itself while it waits, so a copy never
//!   waits on a sleeping worker for a chunk nobody has started. The pipelined fill's producer
//!   does so only when the executor has no workers (it has slots to publish).
//! - [`PackExecutor::copy`] returns only when every chunk has been copied, so the borrowed
//!   slices outlive the work; the calling thread copies one chunk itself. It splits into at
//!   most `len / MIN_CHUNK` chunks of equal size but for 64-byte boundaries (each at most one
//!   cache line short of [`MIN_CHUNK`]), so copies under twice [`MIN_CHUNK`] stay on the
//!   calling thread.
//! - Copies queued without waiting (the ring's pipelined fill, [`SlotRing::produce`]) are
//!   crate-internal: whoever queues them keeps the memory alive until their latch is done.
//! - [`PackExecutor::copy_threads`] and [`PackExecutor::queued_copy_threads`] count the threads
//!   a copy uses by these rules (the functions that cut the copies call them or share their
//!   piece count), for callers that report how many threads copied.
//! - Dropping the executor stops and joins its threads after the queued chunks.
//! - An executor has 1 to [`MAX_PACK_THREADS`] threads; other counts are refused.
//! - With a spin time ([`PackExecutor::with_spin`]), idle workers poll for the next chunk and
//!   the caller polls for the last one for that long before they sleep. Waking a sleeping
//!   thread costs tens of microseconds in a VM, as much as copying a 256 KiB chunk; a ring
//!   filling slot after slot hands chunks out faster than that. Spinning burns the CPU it
//!   waits on, so it pays only with a core per thread. [`PackExecutor::new`] does not spin.
//!
//! [`SlotRing::produce`]: super::SlotRing::produce

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::work_queue::WorkQueue;

/// The most threads a [`PackExecutor`] starts. A copy stops scaling well before a thread per
/// core (16 threads reach the host's copy bandwidth on the GPU machine); the cap turns a
/// garbage count into an error instead of thousands of threads or an aborted allocation.
pub const MAX_PACK_THREADS: usize = 1024;

/// The smallest piece [`PackExecutor::copy`] hands to a worker thread (copies shorter than
/// twice this are not split).
pub const MIN_CHUNK: usize = 256 << 10;

/// The smallest piece of a queued copy. Queued chunks wait in line while workers are busy,
/// so they are not paid for with a wake-up each and can be smaller.
pub(super) const MIN_QUEUED_CHUNK: usize = 64 << 10;

/// Counts outstanding chunks of one copy. `remaining` is read without the lock while
/// spinning; it is only decremented under the lock, so a waiter that checked it under the
/// lock cannot miss the notification.
pub(super) struct Latch {
    remaining: AtomicUsize,
    lock: Mutex<()>,
    done: Condvar,
}

impl Latch {
    fn new(count: usize) -> Self {
        Latch { remaining: AtomicUsize::new(count), lock: Mutex::new(()), done: Condvar::new() }
    }

    /// Whether every chunk is copied (the copies' writes are visible to the caller then).
    pub(super) fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    fn count_down(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_all();
        }
    }

    /// Waits until every chunk is done, polling for up to `spin` first.
    fn wait(&self, spin: Duration) {
        if !spin.is_zero() {
            let start = Instant::now();
            while !self.is_done() && start.elapsed() < spin {
                std::hint::spin_loop();
            }
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.is_done() {
            guard = self.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A worker's loop: chunks until the queue closes and drains, polling for up to `spin` after
/// each one before it sleeps (not once the queue is closed: a drop joins the workers).
fn work(queue: &WorkQueue<Chunk>, spin: Duration) {
    loop {
        let start = Instant::now();
        let mut polled = None;
        while polled.is_none() && start.elapsed() < spin && !queue.is_closed() {
            polled = queue.try_pop();
            std::hint::spin_loop();
        }
        match polled.or_else(|| queue.pop()) {
            Some(chunk) => chunk.run(),
            None => return,
        }
    }
}

/// One range to copy: `len` bytes from `src` to `dst`.
#[derive(Clone, Copy)]
pub(super) struct RawCopy {
    pub(super) src: *const u8,
    pub(super) dst: *mut u8,
    pub(super) len: usize,
}

/// One chunk for a worker.
struct Chunk {
    range: RawCopy,
    latch: Arc<Latch>,
}

// SAFETY: the pointers name disjoint ranges that whoever queued the chunk keeps live and
// unaliased until the latch says every chunk is done (`PackExecutor::copy` by blocking, the
// pipelined fill by the contract of `PackExecutor::queue`), so sending them to a worker is
// sound.
unsafe impl Send for Chunk {}

impl Chunk {
    fn run(self) {
        // SAFETY: see the `Send` impl: both ranges are live, `len` long, and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(self.range.src, self.range.dst, self.range.len) };
        self.latch.count_down();
    }
}

/// Splits `range` into at most `pieces` chunks as equal as 64-byte boundaries allow: chunk
/// `i` starts at `i * len / pieces` rounded down to a multiple of 64, so every chunk is within
/// 64 bytes of `len / pieces` (rounding every chunk up instead left the last one up to
/// 64 bytes per chunk short: 65 bytes of a 1024-way split).
fn split(range: RawCopy, pieces: usize) -> impl Iterator<Item = RawCopy> {
    let (len, pieces) = (range.len, pieces.max(1));
    let start = move |i: usize| -> usize {
        if i >= pieces {
            return len;
        }
        // The product can pass usize on 32-bit targets, never u128.
        ((i as u128 * len as u128 / pieces as u128) as usize) & !63
    };
    (0..pieces).filter_map(move |i| {
        let (from, to) = (start(i), start(i + 1));
        (to > from).then(|| RawCopy {
            src: range.src.wrapping_add(from),
            dst: range.dst.wrapping_add(from),
            len: to - from,
        })
    })
}

/// How many pieces a copy of `len` bytes is split into: one per thread at most, none shorter
/// than `min` (but for the 64-byte rounding of [`split`]), at least one.
fn pieces(len: usize, threads: usize, min: usize) -> usize {
    threads.min(len / min).max(1)
}

/// How many pieces a queued copy of `len` bytes is cut into on an executor of `threads`
/// threads ([`PackExecutor::queue_split`], and [`PackExecutor::queued_copy_threads`] counting
/// them).
fn queued_pieces(len: usize, threads: usize) -> usize {
    pieces(len, threads, MIN_QUEUED_CHUNK)
}

/// A pool of copy threads. See the [module docs](crate::ring).
///
/// # Examples
///
/// ```
/// use cuferry::ring::PackExecutor;
/// let pool = PackExecutor::new(4)?;
/// let src = vec![3u8; 3 << 20];
/// let mut dst = vec![0u8; 3 << 20];
/// pool.copy(&src, &mut dst)?;
/// assert_eq!(src, dst);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub struct PackExecutor {
    chunks: Arc<WorkQueue<Chunk>>,
    handles: Vec<JoinHandle<()>>,
    spin: Duration,
}

impl std::fmt::Debug for PackExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackExecutor").field("threads", &self.threads()).field("spin", &self.spin).finish()
    }
}

impl PackExecutor {
    /// An executor that copies with `threads` threads (the caller plus `threads - 1` workers).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for 0 threads or more than [`MAX_PACK_THREADS`]; failing to
    /// start a thread.
    pub fn new(threads: usize) -> Result<Self> {
        Self::with_spin(threads, Duration::ZERO)
    }

    /// Like [`PackExecutor::new`], with idle workers (and the caller waiting for them) polling
    /// for up to `spin` before they sleep (see the module rules).
    ///
    /// # Errors
    ///
    /// As [`PackExecutor::new`].
    pub fn with_spin(threads: usize, spin: Duration) -> Result<Self> {
        if threads == 0 {
            return Err(Error::invalid("a pack executor needs at least one thread"));
        }
        if threads > MAX_PACK_THREADS {
            return Err(Error::invalid(format!(
                "{threads} pack threads exceed the most an executor starts ({MAX_PACK_THREADS})"
            )));
        }
        let mut pool = PackExecutor {
            chunks: Arc::new(WorkQueue::new()),
            handles: Vec::with_capacity(threads - 1),
            spin,
        };
        for i in 1..threads {
            let chunks = Arc::clone(&pool.chunks);
            let handle = std::thread::Builder::new()
                .name(format!("cuferry-pack-{i}"))
                .spawn(move || work(&chunks, spin))
                .map_err(|e| Error::thread_refused("a pack thread", e))?;
            pool.handles.push(handle);
        }
        Ok(pool)
    }

    /// How long idle threads poll before they sleep (zero: they sleep at once).
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// Threads a copy may use, the caller's included.
    pub fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Copies `src` into `dst` in parallel chunks; returns when all are copied.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the lengths differ.
    pub fn copy(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.copy_in_pieces(src, dst, Self::copy_threads(self.threads(), src.len()))
    }

    /// How many threads copy a `len`-byte [`PackExecutor::copy`] on an executor of `threads`
    /// threads, the caller's included: one per piece, and no piece is shorter than
    /// [`MIN_CHUNK`] (but for the 64-byte rounding), so copies under twice [`MIN_CHUNK`] run
    /// on the caller alone whatever `threads` is.
    ///
    /// ```
    /// use cuferry::ring::PackExecutor;
    /// assert_eq!(PackExecutor::copy_threads(16, 256 << 10), 1);
    /// assert_eq!(PackExecutor::copy_threads(16, 1 << 20), 4);
    /// assert_eq!(PackExecutor::copy_threads(16, 64 << 20), 16);
    /// ```
    pub fn copy_threads(threads: usize, len: usize) -> usize {
        pieces(len, threads, MIN_CHUNK)
    }

    /// The most threads copying at once on an executor of `threads` threads while `ranges`
    /// ranges of `len` bytes each are queued and their queuer only waits for them, as
    /// [`SlotRing::produce`] does with up to `ahead` slots filling: each range is cut into
    /// pieces of at least 64 KiB (one per thread at most, as the queued copies are cut), and
    /// a queuer that waits without helping leaves them to the workers (`threads - 1`); with no
    /// workers, it copies them alone.
    ///
    /// ```
    /// use cuferry::ring::PackExecutor;
    /// // Two 64 KiB slots filling at once: one piece each, two of the 15 workers copy.
    /// assert_eq!(PackExecutor::queued_copy_threads(16, 64 << 10, 2), 2);
    /// // An executor of 4: its 3 workers copy, the producer publishes.
    /// assert_eq!(PackExecutor::queued_copy_threads(4, 4 << 20, 2), 3);
    /// assert_eq!(PackExecutor::queued_copy_threads(1, 4 << 20, 2), 1);
    /// ```
    ///
    /// [`SlotRing::produce`]: super::SlotRing::produce
    pub fn queued_copy_threads(threads: usize, len: usize, ranges: usize) -> usize {
        let workers = threads.saturating_sub(1);
        if workers == 0 {
            return 1;
        }
        workers.min(queued_pieces(len, threads).saturating_mul(ranges.max(1)))
    }

    /// Copies `src` into `dst` split into at most `pieces` chunks (clamped to `1..=threads()`;
    /// cut at 64-byte boundaries, so none is shorter than 64 bytes but the last, whatever the
    /// executor's minimum chunk), one per thread; returns when all are copied (the caller
    /// takes chunks no worker has started, so `pieces` bounds the threads used).
    /// [`PackExecutor::copy`] chooses the split itself; this one is for a copy that must use
    /// a given number of threads, such as a ceiling for other work split that way (the halo
    /// bench's memcpy against [`HaloPacker::host_job_threads`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the lengths differ.
    ///
    /// [`HaloPacker::host_job_threads`]: crate::halo::HaloPacker::host_job_threads
    pub fn copy_in_pieces(&self, src: &[u8], dst: &mut [u8], pieces: usize) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::invalid(format!(
                "pack copy length mismatch: {} source bytes, {} destination bytes",
                src.len(),
                dst.len()
            )));
        }
        let len = src.len();
        let pieces = pieces.clamp(1, self.threads()).min(len.div_ceil(64).max(1));
        if pieces == 1 {
            dst.copy_from_slice(src);
            return Ok(());
        }
        let whole = RawCopy { src: src.as_ptr(), dst: dst.as_mut_ptr(), len };
        let mut chunks = split(whole, pieces);
        let Some(own) = chunks.next() else { return Ok(()) };
        // SAFETY: the ranges are disjoint pieces of `src` and `dst`, borrowed (shared and
        // exclusive) for this call, which returns only after the latch is done.
        let latch = unsafe { self.queue(chunks) };
        // The caller's own chunk goes through the same pointers (no new borrow of `dst`).
        Chunk { range: own, latch: Arc::new(Latch::new(1)) }.run();
        self.wait(&latch, true);
        Ok(())
    }

    /// Queues `ranges` for the workers and returns the latch that counts them down. With no
    /// workers the chunks wait for [`PackExecutor::wait`] to run them.
    ///
    /// # Safety
    ///
    /// Every range must be valid to read at `src` and to write at `dst` for `len` bytes,
    /// disjoint from every other queued range, and not otherwise accessed until the returned
    /// latch [is done](Latch::is_done).
    pub(super) unsafe fn queue(&self, ranges: impl Iterator<Item = RawCopy>) -> Arc<Latch> {
        let ranges: Vec<RawCopy> = ranges.collect();
        let latch = Arc::new(Latch::new(ranges.len()));
        let chunks: Vec<Chunk> =
            ranges.into_iter().map(|range| Chunk { range, latch: Arc::clone(&latch) }).collect();
        // With no workers the chunks wait for `wait` to run them; once the executor is
        // closing (it cannot be while `&self` is borrowed, but were it to) they run here.
        if let Err(returned) = self.chunks.push(chunks) {
            returned.into_iter().for_each(Chunk::run);
        }
        latch
    }

    /// Splits each of `ranges` into chunks of at least [`MIN_QUEUED_CHUNK`] bytes, one per
    /// thread at most, and queues them all under one latch (see [`PackExecutor::queue`]).
    ///
    /// # Safety
    ///
    /// As [`PackExecutor::queue`], for every range.
    pub(super) unsafe fn queue_split(&self, ranges: &[RawCopy]) -> Arc<Latch> {
        let threads = self.threads();
        // SAFETY: forwarded; the chunks are disjoint pieces of the caller's ranges.
        unsafe { self.queue(ranges.iter().flat_map(|&r| split(r, queued_pieces(r.len, threads)))) }
    }

    /// Copies one queued chunk on this thread; false when none was queued.
    pub(super) fn run_one(&self) -> bool {
        match self.chunks.try_pop() {
            Some(chunk) => {
                chunk.run();
                true
            }
            None => false,
        }
    }

    /// Waits until `latch` is done, first copying queued chunks on this thread when `help`
    /// (always with no workers, or the chunks would never run). A chunk of another copy run
    /// here delays this one by that chunk only; the queue is first in, first out, so this
    /// copy's own chunks are never behind an unbounded line.
    pub(super) fn wait(&self, latch: &Latch, help: bool) {
        if help || self.handles.is_empty() {
            while !latch.is_done() && self.run_one() {}
        }
        latch.wait(self.spin);
    }
}

impl Drop for PackExecutor {
    fn drop(&mut self) {
        // Workers drain the queue, then stop.
        self.chunks.close();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
        // With no workers, chunks nobody waited for are copied now (none are left when every
        // queued copy was waited for, as the crate does).
        while let Some(chunk) = self.chunks.try_pop() {
            chunk.run();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// A copy split into a given number of pieces, however short (more pieces than threads,
    /// none, more than 64-byte lines), copies every byte; lengths that differ are refused.
    #[test]
    fn copies_in_given_pieces_move_every_byte() {
        let pool = PackExecutor::new(4).unwrap();
        for len in [0, 1, 63, 64, 65, 1000, 300_000, (1 << 20) + 7] {
            for pieces in [0, 1, 2, 5, 13, 100] {
                let src = pattern(len, pieces as u8);
                let mut dst = vec![0u8; len];
                pool.copy_in_pieces(&src, &mut dst, pieces).unwrap();
                assert!(dst == src, "{len} bytes in {pieces} pieces");
            }
        }
        let mut short = vec![0u8; 9];
        assert!(matches!(pool.copy_in_pieces(&[1u8; 10], &mut short, 2), Err(Error::InvalidArgument { .. })));
    }

    /// Chunks are never much shorter than the minimum: copies under twice it stay whole, and
    /// in longer ones only the last chunk may be short, by the 64-byte rounding alone.
    #[test]
    fn chunks_keep_the_minimum_size() {
        for min in [MIN_CHUNK, MIN_QUEUED_CHUNK] {
            for len in
                [1, min - 1, min, min + 1, 2 * min - 1, 2 * min, 3 * min + 5, 16 * min + 4097, 100 * min]
            {
                for threads in [1, 2, 3, 4, 16] {
                    let n = pieces(len, threads, min);
                    let range = RawCopy { src: std::ptr::null(), dst: std::ptr::null_mut(), len };
                    let lens: Vec<usize> = split(range, n).map(|c| c.len).collect();
                    assert_eq!(lens.iter().sum::<usize>(), len, "{len} bytes, {threads} threads");
                    assert!(lens.len() <= threads, "{len} bytes: more chunks than {threads} threads");
                    if len < 2 * min {
                        assert_eq!(lens.len(), 1, "{len} bytes were split ({min} minimum)");
                    }
                    // Every chunk within 64 bytes of an equal share, so at least `min` less
                    // one cache line.
                    let share = len / n;
                    assert!(
                        lens.iter().all(|&c| c + 64 > share && c < share + 64),
                        "{len} bytes, {threads} threads: {lens:?}"
                    );
                    assert!(
                        lens.iter().all(|&c| c + 64 > min.min(len)),
                        "{len} bytes, {threads} threads: {lens:?}"
                    );
                }
            }
        }
        // Many threads: the old rounding left the last of 1024 chunks 65 bytes long.
        let len = 1024 * MIN_QUEUED_CHUNK + 1;
        let range = RawCopy { src: std::ptr::null(), dst: std::ptr::null_mut(), len };
        let lens: Vec<usize> = split(range, 1024).map(|c| c.len).collect();
        assert_eq!((lens.len(), lens.iter().sum::<usize>()), (1024, len));
        assert!(lens.iter().all(|&c| c + 64 > MIN_QUEUED_CHUNK), "{:?}", &lens[1000..]);
    }

    /// The thread counts reported are the piece counts the copies are cut into.
    #[test]
    fn copy_thread_counts_follow_the_split() {
        for threads in [1, 2, 4, 16] {
            for len in [1, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 64 << 20] {
                let range = RawCopy { src: std::ptr::null(), dst: std::ptr::null_mut(), len };
                let cut = split(range, pieces(len, threads, MIN_CHUNK)).count();
                assert_eq!(PackExecutor::copy_threads(threads, len), cut, "{len} bytes, {threads} threads");
                let queued = split(range, queued_pieces(len, threads)).count();
                let expect = if threads == 1 { 1 } else { (threads - 1).min(3 * queued) };
                assert_eq!(PackExecutor::queued_copy_threads(threads, len, 3), expect, "{len} bytes");
            }
        }
    }

    #[test]
    fn many_callers_share_the_workers_and_every_byte_arrives() {
        // More workers than callers and more callers than cores: wake-ups are passed on and
        // sleepers that find the queue empty go back to sleep without losing a chunk.
        let pool = PackExecutor::new(9).unwrap();
        std::thread::scope(|scope| {
            for caller in 0..6u8 {
                let pool = &pool;
                scope.spawn(move || {
                    for round in 0..20usize {
                        let len = (round * 97 + usize::from(caller) * 13) % (3 << 20) + 1;
                        let src = pattern(len, caller ^ round as u8);
                        let mut dst = vec![0u8; len];
                        pool.copy(&src, &mut dst).unwrap();
                        assert!(src == dst, "caller {caller} round {round}: bytes differ");
                    }
                });
            }
        });
    }

    #[test]
    fn queued_chunks_run_on_the_waiter_without_workers_and_with_help_off() {
        let pool = PackExecutor::new(1).unwrap();
        let src = pattern(1 << 20, 5);
        let mut dst = vec![0u8; 1 << 20];
        let range = RawCopy { src: src.as_ptr(), dst: dst.as_mut_ptr(), len: src.len() };
        // SAFETY: both vectors outlive the wait below and are not touched until it returns.
        let latch = unsafe { pool.queue_split(&[range]) };
        assert!(!latch.is_done(), "no worker may have run the chunks yet");
        // `help: false` still runs them here: nobody else would.
        pool.wait(&latch, false);
        assert!(latch.is_done());
        assert!(src == dst);
    }

    #[test]
    fn queued_chunks_are_copied_by_workers_when_the_waiter_does_not_help() {
        let pool = PackExecutor::new(4).unwrap();
        for round in 0..50u8 {
            let src = pattern(1 << 20, round);
            let mut dst = vec![0u8; 1 << 20];
            let range = RawCopy { src: src.as_ptr(), dst: dst.as_mut_ptr(), len: src.len() };
            // SAFETY: as above.
            let latch = unsafe { pool.queue_split(&[range]) };
            pool.wait(&latch, false);
            assert!(src == dst, "round {round}: bytes differ");
        }
    }

    #[test]
    fn dropping_an_executor_runs_chunks_nobody_waited_for() {
        let src = pattern(300 << 10, 9);
        let mut dst = vec![0u8; 300 << 10];
        let latch;
        {
            let pool = PackExecutor::new(1).unwrap();
            let range = RawCopy { src: src.as_ptr(), dst: dst.as_mut_ptr(), len: src.len() };
            // SAFETY: both vectors outlive the executor, whose drop runs the chunks.
            latch = unsafe { pool.queue_split(&[range]) };
        }
        assert!(latch.is_done());
        assert!(src == dst);
    }
}
