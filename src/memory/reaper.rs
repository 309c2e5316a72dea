//! Deferred frees: allocations dropped while queued work still uses them, freed later by one
//! background thread once that work has finished, so the dropping thread never waits.
//!
//! Rules:
//! - Only allocations marked for it are deferred (linop's arrays and their transfer staging,
//!   whose intermediates are dropped inside `apply`); every other buffer's drop waits for its
//!   queued work and frees, as the [memory module](crate::memory) says.
//! - A marked allocation whose work has already finished is freed at once by the dropping
//!   thread; otherwise it is handed to the reaper thread, started on first use.
//! - The reaper frees each allocation as soon as its tracker is idle, in whatever order they
//!   become idle: one held back by a long queue does not hold back the others. Between polls
//!   it sleeps with a growing backoff (20 us to 1 ms), woken early by each new allocation.
//! - When a tracker cannot be queried (the queued work's fate is unknown) the allocation is
//!   leaked and the error kept for [`take_drop_error`](crate::take_drop_error), as a waiting
//!   drop does.
//! - [`drain`] blocks until every deferred allocation has been freed or leaked. Allocators
//!   call it after an out-of-memory failure and try once more, so memory waiting for its work
//!   is not mistaken for memory in use.
//! - The host runs ahead of its queued work by a bounded amount: while [`MAX_PENDING`]
//!   allocations, or [`MAX_PENDING_BYTES`] bytes, wait for their work, a marked drop that would
//!   exceed either waits for its own work and frees, as an unmarked one (a loop of `apply`
//!   without a read-back paces itself on that work instead of growing without bound). The
//!   first pending allocation is always taken, whatever its size.
//! - When the reaper thread cannot be started, the drop waits and frees as an unmarked one.
//!   Allocations still pending when the process exits are not freed (the system reclaims
//!   them).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::allocation::TrackedAllocation;
use crate::error::record_drop_error;
use crate::monitor::Monitor;

/// The first and the longest sleep between two polls of pending allocations.
const BACKOFF: (Duration, Duration) = (Duration::from_micros(20), Duration::from_millis(1));

/// The most allocations waiting for their work at once (about as far ahead as a CUDA stream's
/// launch queue lets the host run).
pub(crate) const MAX_PENDING: usize = 1024;

/// The most bytes waiting for their work at once (beyond the first pending allocation).
pub(crate) const MAX_PENDING_BYTES: usize = 4 << 30;

/// Allocations handed to a reaper and not yet freed, or the caps on them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Pending {
    count: usize,
    bytes: usize,
}

impl Pending {
    /// Whether one more allocation of `bytes` fits under `caps`.
    fn admits(self, bytes: usize, caps: Pending) -> bool {
        self.count == 0 || (self.count < caps.count && self.bytes.saturating_add(bytes) <= caps.bytes)
    }
}

/// A reaper: its queue, its caps, and what was handed over and not yet freed.
struct Reaper {
    queue: Mutex<Sender<TrackedAllocation>>,
    caps: Pending,
    pending: Arc<Monitor<Pending>>,
}

/// The process's reaper, started on first use; `None` when its thread could not be started.
fn global() -> Option<&'static Reaper> {
    static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();
    REAPER.get_or_init(|| Reaper::start(Pending { count: MAX_PENDING, bytes: MAX_PENDING_BYTES })).as_ref()
}

/// Hands `alloc` to the reaper; gives it back when there is no reaper or the caps are
/// reached (the caller then waits for its work and frees it).
pub(crate) fn defer(alloc: TrackedAllocation) -> Result<(), TrackedAllocation> {
    match global() {
        Some(r) => r.defer(alloc),
        None => Err(alloc),
    }
}

/// Blocks until every allocation handed to the reaper so far has been freed (or leaked).
pub(crate) fn drain() {
    if let Some(r) = global() {
        r.drain();
    }
}

/// The number of allocations waiting for their work before being freed.
pub(crate) fn pending() -> usize {
    global().map_or(0, |r| r.pending.lock().count)
}

impl Reaper {
    /// Starts a reaper thread; `None` when it cannot be started.
    fn start(caps: Pending) -> Option<Reaper> {
        let (queue, inbox) = channel::<TrackedAllocation>();
        let pending = Arc::new(Monitor::default());
        let counts = Arc::clone(&pending);
        std::thread::Builder::new()
            .name("cuferry-reaper".into())
            .spawn(move || serve(&inbox, &counts))
            .ok()
            .map(|_| Reaper { queue: Mutex::new(queue), caps, pending })
    }

    /// See [`defer`].
    fn defer(&self, alloc: TrackedAllocation) -> Result<(), TrackedAllocation> {
        let bytes = alloc.bytes();
        let admitted = self.pending.update(|p| {
            let fits = p.admits(bytes, self.caps);
            if fits {
                *p = Pending { count: p.count + 1, bytes: p.bytes + bytes };
            }
            fits
        });
        if !admitted {
            return Err(alloc);
        }
        let sent = self.queue.lock().unwrap_or_else(|e| e.into_inner()).send(alloc);
        sent.map_err(|back| {
            finished(&self.pending, Pending { count: 1, bytes });
            back.0
        })
    }

    /// See [`drain`].
    fn drain(&self) {
        drop(self.pending.wait_while(self.pending.lock(), |p| p.count > 0));
    }
}

/// Counts `done` as freed (or leaked) and wakes [`drain`].
fn finished(pending: &Monitor<Pending>, done: Pending) {
    pending.update(|p| {
        *p = Pending { count: p.count.saturating_sub(done.count), bytes: p.bytes.saturating_sub(done.bytes) }
    });
}

/// The reaper thread: frees allocations as their trackers become idle, counting them off
/// `pending`; returns when the queue's sender is gone and nothing waits.
fn serve(inbox: &Receiver<TrackedAllocation>, pending: &Monitor<Pending>) {
    let mut waiting: Vec<TrackedAllocation> = Vec::new();
    let mut backoff = BACKOFF.0;
    loop {
        let mut done = Pending::default();
        let mut k = 0;
        while k < waiting.len() {
            match waiting[k].tracker.is_idle() {
                Ok(false) => k += 1,
                // Unmarked: its drop finds the work finished and frees at once.
                Ok(true) => {
                    let alloc = waiting.swap_remove(k);
                    done = Pending { count: done.count + 1, bytes: done.bytes + alloc.bytes() };
                    drop(alloc);
                }
                // The work's fate is unknown: leaked, never freed.
                Err(err) => {
                    record_drop_error(err);
                    let alloc = waiting.swap_remove(k);
                    done = Pending { count: done.count + 1, bytes: done.bytes + alloc.bytes() };
                    std::mem::forget(alloc);
                }
            }
        }
        if done.count > 0 {
            finished(pending, done);
            backoff = BACKOFF.0;
        }
        let next = if waiting.is_empty() {
            inbox.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            inbox.recv_timeout(backoff)
        };
        match next {
            Ok(alloc) => {
                waiting.push(alloc);
                backoff = BACKOFF.0;
            }
            Err(RecvTimeoutError::Timeout) => backoff = (backoff * 2).min(BACKOFF.1),
            Err(RecvTimeoutError::Disconnected) if waiting.is_empty() => return,
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(backoff),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{drain, pending, Pending, Reaper};
    use crate::copy::copy;
    use crate::device::Device;
    use crate::memory::allocation::TrackedAllocation;
    use crate::memory::tracker::{Access, UseTracker};
    use crate::memory::DeviceBuffer;
    use crate::stream::test_gate::Gate;
    use crate::stream::Stream;

    /// Dropping a marked buffer whose copy waits behind a gate returns at once (the gate is
    /// still closed), and the memory is freed only after the copy: `drain` returns after it.
    #[test]
    fn a_marked_drop_never_waits_and_the_free_follows_the_work() {
        let fresh = Stream::new(Device::Host).unwrap();
        let data: Vec<u32> = (0..4096).collect();
        let src = DeviceBuffer::from_slice(&fresh, &data).unwrap().with_deferred_free();
        let mut dst = DeviceBuffer::<u32>::zeroed(&fresh, data.len()).unwrap();
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        copy(&stream, &src, &mut dst).unwrap();
        drop(src);
        assert!(!gate.passed(), "the drop waited for the gated copy");
        assert!(pending() >= 1, "the buffer was freed while its copy was queued");
        let opener = gate.open_after(Duration::from_millis(20));
        drain();
        assert!(gate.passed(), "drain returned before the copy's work ran");
        opener.join().unwrap();
        assert_eq!(dst.to_vec(&stream).unwrap(), data);
    }

    /// A host allocation with a use queued on `stream` (held there by a gate).
    fn gated_allocation(stream: &Stream, bytes: usize) -> TrackedAllocation {
        let alloc = TrackedAllocation::host_zeroed(bytes).unwrap();
        UseTracker::use_on(stream, &[(&alloc.tracker, Access::Write)], || Ok(())).unwrap();
        alloc
    }

    /// A reaper takes allocations up to its count cap and its byte cap, then hands them back
    /// (their drop then waits); the first is taken whatever its size; all are freed after
    /// their work.
    #[test]
    fn past_its_caps_a_reaper_hands_allocations_back() {
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        let by_count = Reaper::start(Pending { count: 2, bytes: usize::MAX }).unwrap();
        for _ in 0..2 {
            assert!(by_count.defer(gated_allocation(&stream, 64)).is_ok());
        }
        let refused = by_count.defer(gated_allocation(&stream, 64)).expect_err("a third taken");
        assert_eq!(*by_count.pending.lock(), Pending { count: 2, bytes: 128 });
        let by_bytes = Reaper::start(Pending { count: 100, bytes: 100 }).unwrap();
        assert!(by_bytes.defer(gated_allocation(&stream, 4096)).is_ok(), "the first is refused");
        let refused_bytes = by_bytes.defer(gated_allocation(&stream, 1)).expect_err("over the byte cap");
        assert!(!gate.passed(), "a defer waited for the gated work");
        let opener = gate.open_after(Duration::from_millis(20));
        by_count.drain();
        by_bytes.drain();
        assert!(gate.passed(), "drain returned before the work ran");
        assert_eq!(*by_count.pending.lock(), Pending::default());
        assert_eq!(*by_bytes.pending.lock(), Pending::default());
        drop((refused, refused_bytes));
        opener.join().unwrap();
    }

    /// An unmarked buffer keeps the waiting drop; a marked one with no pending work is freed
    /// by the dropping thread (nothing handed over).
    #[test]
    fn unmarked_drops_wait_and_idle_marked_ones_free_at_once() {
        let src = DeviceBuffer::from_slice(&Stream::new(Device::Host).unwrap(), &[1u8; 64]).unwrap();
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        let mut dst = DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap();
        copy(&stream, &src, &mut dst).unwrap();
        let opener = gate.open_after(Duration::from_millis(20));
        drop(src);
        assert!(gate.passed(), "an unmarked drop returned before its copy ran");
        opener.join().unwrap();
        let idle = DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap().with_deferred_free();
        stream.synchronize().unwrap();
        // Freed here or by the reaper: either way nothing stays pending for it.
        drop(idle);
        drain();
    }
}
