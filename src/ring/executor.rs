//! The pack executor: a small pool of threads that copies pageable memory into slots in
//! parallel (one thread copies 7.5-12 GB/s; 16 reach 38.6 GB/s on the GPU machine).
//!
//! Rules:
//! - [`PackExecutor::copy`] returns only when every chunk has been copied, so the borrowed
//!   slices outlive the work; the calling thread copies one chunk itself.
//! - Chunks are at least [`MIN_CHUNK`] bytes, so small copies stay on the calling thread.
//! - A worker that cannot be reached (its thread is gone) has its chunk done by the caller;
//!   nothing is skipped.
//! - Dropping the executor stops and joins its threads.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use crate::error::{Error, Result};

/// The smallest piece handed to a worker thread.
pub const MIN_CHUNK: usize = 256 << 10;

/// Counts outstanding chunks of one copy.
struct Latch {
    remaining: Mutex<usize>,
    done: Condvar,
}

impl Latch {
    fn count_down(&self) {
        let mut r = self.remaining.lock().unwrap_or_else(|e| e.into_inner());
        *r -= 1;
        if *r == 0 {
            self.done.notify_all();
        }
    }

    fn wait(&self) {
        let mut r = self.remaining.lock().unwrap_or_else(|e| e.into_inner());
        while *r > 0 {
            r = self.done.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// One chunk for a worker.
struct Chunk {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    latch: Arc<Latch>,
}

// SAFETY: the pointers name disjoint ranges of slices that `PackExecutor::copy` keeps borrowed
// until the latch says every chunk is done, so sending them to a worker is sound.
unsafe impl Send for Chunk {}

impl Chunk {
    fn run(self) {
        // SAFETY: see the `Send` impl: both ranges are live, `len` long, and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(self.src, self.dst, self.len) };
        self.latch.count_down();
    }
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
    workers: Vec<Sender<Chunk>>,
    handles: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for PackExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackExecutor").field("threads", &self.threads()).finish()
    }
}

impl PackExecutor {
    /// An executor that copies with `threads` threads (the caller plus `threads - 1` workers).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for 0 threads; failing to start a thread.
    pub fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(Error::invalid("a pack executor needs at least one thread"));
        }
        let mut workers = Vec::with_capacity(threads - 1);
        let mut handles = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let (tx, rx) = unbounded::<Chunk>();
            let handle = std::thread::Builder::new()
                .name(format!("cuferry-pack-{i}"))
                .spawn(move || rx.into_iter().for_each(Chunk::run))
                .map_err(|e| Error::unsupported(format!("cannot start a pack thread: {e}")))?;
            workers.push(tx);
            handles.push(handle);
        }
        Ok(PackExecutor { workers, handles })
    }

    /// Threads a copy may use, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Copies `src` into `dst` in parallel chunks; returns when all are copied.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the lengths differ.
    pub fn copy(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::invalid(format!(
                "pack copy length mismatch: {} source bytes, {} destination bytes",
                src.len(),
                dst.len()
            )));
        }
        let len = src.len();
        let pieces = self.threads().min(len.div_ceil(MIN_CHUNK)).max(1);
        if pieces == 1 {
            dst.copy_from_slice(src);
            return Ok(());
        }
        let chunk = len.div_ceil(pieces).next_multiple_of(64);
        let starts: Vec<usize> = (1..pieces).map(|p| p * chunk).filter(|&s| s < len).collect();
        let latch = Arc::new(Latch { remaining: Mutex::new(starts.len()), done: Condvar::new() });
        let (src_ptr, dst_ptr) = (src.as_ptr(), dst.as_mut_ptr());
        for (worker, &start) in self.workers.iter().zip(&starts) {
            let piece = Chunk {
                src: src_ptr.wrapping_add(start),
                dst: dst_ptr.wrapping_add(start),
                len: chunk.min(len - start),
                latch: Arc::clone(&latch),
            };
            if let Err(returned) = worker.send(piece) {
                returned.into_inner().run();
            }
        }
        // The caller's own chunk goes through the same pointers (no new borrow of `dst`).
        Chunk {
            src: src_ptr,
            dst: dst_ptr,
            len: chunk.min(len),
            latch: Arc::new(Latch { remaining: Mutex::new(1), done: Condvar::new() }),
        }
        .run();
        latch.wait();
        Ok(())
    }
}

impl Drop for PackExecutor {
    fn drop(&mut self) {
        self.workers.clear();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}
