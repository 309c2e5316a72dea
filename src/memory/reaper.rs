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
//! - When the reaper thread cannot be started, the drop waits and frees as an unmarked one.
//!   Allocations still pending when the process exits are not freed (the system reclaims
//!   them).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::allocation::TrackedAllocation;
use crate::error::record_drop_error;
use crate::monitor::Monitor;

/// The first and the longest sleep between two polls of pending allocations.
const BACKOFF: (Duration, Duration) = (Duration::from_micros(20), Duration::from_millis(1));

/// The reaper: its queue, and the count of allocations handed over and not yet freed.
struct Reaper {
    queue: Mutex<Sender<TrackedAllocation>>,
    pending: Monitor<usize>,
}

/// The reaper, started on first use; `None` when its thread could not be started.
fn reaper() -> Option<&'static Reaper> {
    static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();
    REAPER
        .get_or_init(|| {
            let (queue, inbox) = channel::<TrackedAllocation>();
            std::thread::Builder::new()
                .name("cuferry-reaper".into())
                .spawn(move || serve(&inbox))
                .ok()
                .map(|_| Reaper { queue: Mutex::new(queue), pending: Monitor::default() })
        })
        .as_ref()
}

/// Hands `alloc` to the reaper; gives it back when there is no reaper.
pub(crate) fn defer(alloc: TrackedAllocation) -> Result<(), TrackedAllocation> {
    let Some(r) = reaper() else { return Err(alloc) };
    r.pending.update(|n| *n += 1);
    let sent = r.queue.lock().unwrap_or_else(|e| e.into_inner()).send(alloc);
    sent.map_err(|back| {
        finished(r, 1);
        back.0
    })
}

/// Blocks until every allocation handed to the reaper so far has been freed (or leaked).
pub(crate) fn drain() {
    if let Some(r) = reaper() {
        drop(r.pending.wait_while(r.pending.lock(), |n| *n > 0));
    }
}

/// The number of allocations waiting for their work before being freed.
pub(crate) fn pending() -> usize {
    reaper().map_or(0, |r| *r.pending.lock())
}

/// Counts `n` allocations freed (or leaked) and wakes [`drain`].
fn finished(r: &Reaper, n: usize) {
    r.pending.update(|pending| *pending = pending.saturating_sub(n));
}

/// The reaper thread: frees allocations as their trackers become idle.
fn serve(inbox: &Receiver<TrackedAllocation>) {
    let mut waiting: Vec<TrackedAllocation> = Vec::new();
    let mut backoff = BACKOFF.0;
    loop {
        let mut done = 0;
        let mut k = 0;
        while k < waiting.len() {
            match waiting[k].tracker.is_idle() {
                Ok(false) => k += 1,
                // Unmarked: its drop finds the work finished and frees at once.
                Ok(true) => {
                    drop(waiting.swap_remove(k));
                    done += 1;
                }
                // The work's fate is unknown: leaked, never freed.
                Err(err) => {
                    record_drop_error(err);
                    std::mem::forget(waiting.swap_remove(k));
                    done += 1;
                }
            }
        }
        if done > 0 {
            if let Some(r) = reaper() {
                finished(r, done);
            }
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

    use super::{drain, pending};
    use crate::copy::copy;
    use crate::device::Device;
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
