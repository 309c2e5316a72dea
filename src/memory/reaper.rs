//! Deferred frees: allocations dropped while queued work still uses them, released later by
//! one background thread once that work has finished, so the dropping thread does not wait.
//! "Released" means freed, or, for an allocation made through the
//! [allocation cache](super::cache) (all of linop's), given back to that cache.
//!
//! Rules:
//! - Only allocations marked for it are deferred (linop's arrays and their transfer staging,
//!   whose intermediates are dropped inside `apply`), and any allocation dropped inside a host
//!   stream's job with work pending (waiting there could be for work queued behind that job,
//!   which would never run); every other buffer's drop waits for its queued work and frees,
//!   as the [memory module](crate::memory) says.
//! - A marked allocation whose work has already finished is released at once by the dropping
//!   thread; otherwise it is handed to the reaper thread, started on first use.
//! - The reaper releases each allocation as soon as its tracker is idle, in whatever order
//!   they become idle: one held back by a long queue does not hold back the others. Between
//!   polls it sleeps with a growing backoff (20 us to 1 ms), woken early by each allocation
//!   handed over (one poll serves every wake-up sent before it).
//! - Before querying a CUDA allocation's events the reaper thread, and an allocating thread
//!   reclaiming a block, make the allocation's device current: a thread with no current
//!   device would create a context on device 0, which a process using only other GPUs never
//!   asked for (cuferry leaves its device current, as everywhere).
//! - When a tracker cannot be queried (the queued work's fate is unknown) the memory is
//!   leaked (never cached) and the error kept for [`take_drop_error`](crate::take_drop_error),
//!   as a waiting drop does; the tracker's streams and events are released.
//! - [`drain_where`] blocks until every allocation of the places it names handed over before
//!   the call has been released, reclaimed or leaked (each carries a ticket and its place);
//!   ones handed over later, by other threads, and ones of other places do not hold it up.
//!   Allocators call it after an out-of-memory failure with the places whose memory they
//!   draw on, release that part of the cache, and try once more, so memory waiting for its
//!   work is not mistaken for memory in use (and a device's failure does not wait for another
//!   device's queued work).
//! - The host runs ahead of its queued work by a bounded amount: while [`MAX_PENDING`]
//!   allocations, or [`MAX_PENDING_BYTES`] bytes (as allocated: a cached allocation counts its
//!   size class), wait for their work, a marked drop that would exceed either waits for its
//!   own work and releases, as an unmarked one frees (a loop of `apply` without a read-back
//!   paces itself on that work instead of growing without bound). The first pending
//!   allocation is always taken, whatever its size. A drop inside a host stream's job is
//!   always taken: waiting there could be for work queued behind that job.
//! - The cache's evictions are freed by the reaper thread too ([`free_later`]): idle, they are
//!   freed at its next poll, off the thread that dropped the allocation that evicted them.
//! - When the reaper thread cannot be started, the drop waits and releases as an unmarked one.
//!   Allocations still pending when the process exits are not freed (the system reclaims
//!   them).
//! - An allocation through the cache that finds nothing cached first [`reclaim`]s a pending
//!   allocation of its place and size class whose work has finished since its drop, so reuse
//!   does not wait for the reaper's next poll (which a long queue of work backs off to 1 ms:
//!   an `apply` right after a read-back would otherwise allocate anew while its predecessor's
//!   memory sits idle in the reaper). It asks at most [`RECLAIM_QUERIES`] trackers, and then
//!   the cache once more: the reaper thread polls, and gives idle allocations to the cache,
//!   under the list's lock (it frees outside it), so under that lock an idle allocation is
//!   always in one of the two.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use super::allocation::TrackedAllocation;
use super::cache::{self, Cache, Leaving, Place, Then};
use crate::error::record_drop_error;
use crate::monitor::Monitor;

/// The first and the longest sleep between two polls of pending allocations.
const BACKOFF: (Duration, Duration) = (Duration::from_micros(20), Duration::from_millis(1));

/// The most allocations waiting for their work at once (about as far ahead as a CUDA stream's
/// launch queue lets the host run).
pub(crate) const MAX_PENDING: usize = 1024;

/// The most bytes waiting for their work at once (a first allocation larger than this is taken
/// all the same, and then no other until it is freed).
pub(crate) const MAX_PENDING_BYTES: usize = 4 << 30;

/// The most trackers one [`reclaim`] queries (each query asks the allocation's events, a
/// driver call apiece on CUDA), so that a miss stays cheap however many allocations wait.
pub(crate) const RECLAIM_QUERIES: usize = 4;

/// Caps on the allocations a reaper holds.
#[derive(Debug, Clone, Copy)]
struct Caps {
    count: usize,
    bytes: usize,
}

/// Whether a drop is held to the caps (a drop inside a host stream's job is not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Capped {
    /// Refused past the caps.
    Yes,
    /// Taken whatever the caps.
    No,
}

/// Allocations handed to a reaper and not yet freed: their tickets (with their places; `None`,
/// an empty allocation, counts as of every place) and bytes.
#[derive(Debug, Default)]
struct Pending {
    outstanding: BTreeMap<u64, Option<Place>>,
    bytes: usize,
    next_ticket: u64,
}

impl Pending {
    /// Whether one more allocation of `bytes` fits under `caps`.
    fn admits(&self, bytes: usize, caps: Caps) -> bool {
        self.outstanding.is_empty()
            || (self.outstanding.len() < caps.count && self.bytes.saturating_add(bytes) <= caps.bytes)
    }
}

/// A deferred allocation and its ticket.
type Ticketed = (u64, TrackedAllocation);

/// The allocations waiting for their work, shared by the reaper thread (which polls them) and
/// [`reclaim`] (which takes an idle one for reuse).
#[derive(Debug, Default)]
struct Waiting(Mutex<Vec<Ticketed>>);

impl Waiting {
    fn lock(&self) -> MutexGuard<'_, Vec<Ticketed>> {
        // A poisoned lock only means a panic elsewhere; the list is always consistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A reaper: its waiting list, the channel that wakes its thread, its caps, and what was
/// handed over and not yet freed.
struct Reaper {
    waiting: Arc<Waiting>,
    wake: Mutex<Sender<()>>,
    caps: Caps,
    pending: Arc<Monitor<Pending>>,
}

/// The process's reaper, started on first use; `None` when its thread could not be started.
fn global() -> Option<&'static Reaper> {
    static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();
    REAPER.get_or_init(|| Reaper::start(Caps { count: MAX_PENDING, bytes: MAX_PENDING_BYTES })).as_ref()
}

/// Hands `alloc` to the reaper; gives it back when there is no reaper or, `capped`, the caps
/// are reached (the caller then waits for its work and frees it).
pub(crate) fn defer(alloc: TrackedAllocation, capped: Capped) -> Result<(), TrackedAllocation> {
    match global() {
        Some(r) => r.defer(alloc, capped),
        None => Err(alloc),
    }
}

/// Hands idle allocations to the reaper thread to be freed there (the cache's evictions):
/// `cudaFree` and `cudaFreeHost` may wait for the whole device, which a dropping thread should
/// not. Without a reaper they are freed here.
pub(crate) fn free_later(allocs: Vec<TrackedAllocation>) {
    match global() {
        Some(r) => r.free_later(allocs),
        None => drop(allocs),
    }
}

/// Blocks until every allocation handed to the reaper before the call has been freed (or
/// leaked).
#[cfg(test)]
pub(crate) fn drain() {
    drain_where(|_| true);
}

/// Blocks until every allocation of a place `covers` accepts, handed to the reaper before the
/// call, has been released, reclaimed or leaked.
pub(crate) fn drain_where(covers: impl Fn(Place) -> bool) {
    if let Some(r) = global() {
        r.drain_where(covers);
    }
}

/// The number of allocations of places `covers` accepts waiting for their work before being
/// released.
#[cfg(test)]
pub(crate) fn pending_where(covers: impl Fn(Place) -> bool) -> usize {
    global().map_or(0, |r| r.pending.lock().outstanding.values().filter(|p| p.map_or(true, &covers)).count())
}

/// A cached allocation of `place` and size class `class` that is idle: one the reaper holds
/// whose work has finished since (see the module rules; then the flag is true), or else one
/// `cache` holds; `None` when there is neither. The caller reuses it as the cache's own.
pub(crate) fn reclaim(cache: &Cache, place: Place, class: usize) -> Option<(TrackedAllocation, bool)> {
    match global() {
        Some(r) => r.reclaim(cache, place, class),
        None => cache.take(place, class).map(|alloc| (alloc, false)),
    }
}

impl Reaper {
    /// Starts a reaper thread; `None` when it cannot be started.
    fn start(caps: Caps) -> Option<Reaper> {
        let (reaper, wakes) = Reaper::paused(caps);
        reaper.resume(wakes).then_some(reaper)
    }

    /// A reaper whose thread is not started yet: allocations handed to it wait (and can be
    /// reclaimed) until [`Reaper::resume`] is called with the returned receiver.
    fn paused(caps: Caps) -> (Reaper, Receiver<()>) {
        let (wake, wakes) = channel::<()>();
        let reaper =
            Reaper { waiting: Arc::default(), wake: Mutex::new(wake), caps, pending: Arc::default() };
        (reaper, wakes)
    }

    /// Starts the thread of a paused reaper; false when it cannot be started.
    fn resume(&self, wakes: Receiver<()>) -> bool {
        let (waiting, pending) = (Arc::clone(&self.waiting), Arc::clone(&self.pending));
        std::thread::Builder::new()
            .name("cuferry-reaper".into())
            .spawn(move || serve(&wakes, &waiting, &pending))
            .is_ok()
    }

    /// See [`defer`].
    fn defer(&self, alloc: TrackedAllocation, capped: Capped) -> Result<(), TrackedAllocation> {
        let (bytes, place) = (alloc.capacity(), alloc.place());
        let ticket = self.pending.update(|p| {
            if capped == Capped::Yes && !p.admits(bytes, self.caps) {
                return None;
            }
            let ticket = p.next_ticket;
            p.next_ticket += 1;
            p.outstanding.insert(ticket, place);
            p.bytes += bytes;
            Some(ticket)
        });
        let Some(ticket) = ticket else { return Err(alloc) };
        self.waiting.lock().push((ticket, alloc));
        if self.wake.lock().unwrap_or_else(|e| e.into_inner()).send(()).is_ok() {
            return Ok(());
        }
        // The thread is gone: take the allocation back, unless a reclaim already took it.
        let mut waiting = self.waiting.lock();
        let Some(k) = waiting.iter().position(|(t, _)| *t == ticket) else { return Ok(()) };
        let (_, back) = waiting.swap_remove(k);
        drop(waiting);
        finished(&self.pending, &[ticket], bytes);
        Err(back)
    }

    /// See [`free_later`]: taken whatever the caps (the thread that gave them back would
    /// otherwise free them itself).
    fn free_later(&self, allocs: Vec<TrackedAllocation>) {
        for alloc in allocs {
            if let Err(back) = self.defer(alloc, Capped::No) {
                drop(back);
            }
        }
    }

    /// See [`reclaim`].
    fn reclaim(&self, cache: &Cache, place: Place, class: usize) -> Option<(TrackedAllocation, bool)> {
        let mut waiting = self.waiting.lock();
        let mut queries = 0;
        let idle = waiting.iter().position(|(_, alloc)| {
            if queries == RECLAIM_QUERIES
                || !alloc.is_recycled()
                || alloc.capacity() != class
                || alloc.place() != Some(place)
            {
                return false;
            }
            if queries == 0 {
                // As the reaper thread does (module rules): the calling thread may have no
                // current device, and the query would create a context on device 0.
                if let Place::CudaDevice(ordinal) | Place::CudaPinned(ordinal) = place {
                    let _ = crate::cuda::device::make_current(ordinal);
                }
            }
            queries += 1;
            matches!(alloc.tracker.is_idle(), Ok(true))
        });
        let Some(k) = idle else {
            // The thread may have given the allocation to the cache since the caller looked.
            return cache.take(place, class).map(|alloc| (alloc, false));
        };
        let (ticket, mut alloc) = waiting.swap_remove(k);
        drop(waiting);
        finished(&self.pending, &[ticket], alloc.capacity());
        alloc.forget_uses();
        Some((alloc, true))
    }

    /// Blocks until every allocation handed over before the call has been released.
    #[cfg(test)]
    fn drain(&self) {
        self.drain_where(|_| true);
    }

    /// See [`drain_where`].
    fn drain_where(&self, covers: impl Fn(Place) -> bool) {
        self.wait_for_tickets_before(self.next_ticket(), covers);
    }

    /// The ticket the next allocation handed over will get.
    fn next_ticket(&self) -> u64 {
        self.pending.lock().next_ticket
    }

    /// Blocks until every allocation of a place `covers` accepts whose ticket is below `end`
    /// has been released, reclaimed or leaked.
    fn wait_for_tickets_before(&self, end: u64, covers: impl Fn(Place) -> bool) {
        let waited = self.pending.wait_while(self.pending.lock(), |p| {
            p.outstanding.range(..end).any(|(_, place)| place.map_or(true, &covers))
        });
        drop(waited);
    }
}

/// Counts the allocations of `tickets` (`bytes` in all) freed or leaked, and wakes [`drain`].
fn finished(pending: &Monitor<Pending>, tickets: &[u64], bytes: usize) {
    pending.update(|p| {
        for t in tickets {
            p.outstanding.remove(t);
        }
        p.bytes = p.bytes.saturating_sub(bytes);
    });
}

/// One poll of the waiting list, under its lock: idle cached allocations go to the process's
/// cache (what that evicts goes to `evicted`); the other idle ones, those the cache refused
/// and those whose tracker failed come back to be freed or leaked outside the lock. Returns
/// their tickets and bytes.
/// Before querying a CUDA allocation's events it makes that allocation's device current
/// (`current`: the device this thread last made current), so the reaper never creates a
/// context on a device the process does not use.
fn poll(
    waiting: &Waiting,
    to_free: &mut Vec<TrackedAllocation>,
    evicted: &mut Leaving<'_>,
    to_leak: &mut Vec<TrackedAllocation>,
    current: &mut Option<u32>,
) -> (Vec<u64>, usize) {
    let mut done = Vec::new();
    let mut bytes = 0;
    let mut list = waiting.lock();
    let mut k = 0;
    while k < list.len() {
        if let Some(ordinal) = list[k].1.cuda_ordinal() {
            if *current != Some(ordinal) && crate::cuda::device::make_current(ordinal).is_ok() {
                *current = Some(ordinal);
            }
        }
        let idle = list[k].1.tracker.is_idle();
        if matches!(idle, Ok(false)) {
            k += 1;
            continue;
        }
        let (ticket, alloc) = list.swap_remove(k);
        bytes += alloc.capacity();
        done.push(ticket);
        match idle {
            Ok(_) if alloc.is_recycled() => {
                if let Err(back) = cache::global().give_collecting(alloc, evicted) {
                    to_free.push(back.uncached());
                }
            }
            // Unmarked: its drop finds the work finished and frees at once.
            Ok(_) => to_free.push(alloc),
            // The work's fate is unknown: the memory is leaked, never freed.
            Err(err) => {
                record_drop_error(err);
                to_leak.push(alloc);
            }
        }
    }
    (done, bytes)
}

/// The reaper thread: releases allocations as their trackers become idle, counting them off
/// `pending`; returns when the wake channel's sender is gone and nothing waits.
fn serve(wakes: &Receiver<()>, waiting: &Waiting, pending: &Monitor<Pending>) {
    let mut backoff = BACKOFF.0;
    let (mut to_free, mut to_leak, mut current) = (Vec::new(), Vec::new(), None);
    loop {
        let mut evicted = Leaving::new(cache::global(), Then::Free);
        let (done, bytes) = poll(waiting, &mut to_free, &mut evicted, &mut to_leak, &mut current);
        to_free.clear();
        drop(evicted);
        to_leak.drain(..).for_each(TrackedAllocation::leak_memory);
        if !done.is_empty() {
            finished(pending, &done, bytes);
            backoff = BACKOFF.0;
        }
        // Checked after the poll: an allocation handed over since then also sent a wake-up.
        let idle = waiting.lock().is_empty();
        let next = if idle {
            wakes.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            wakes.recv_timeout(backoff)
        };
        match next {
            Ok(()) => {
                // One poll serves every wake-up sent meanwhile.
                wakes.try_iter().for_each(drop);
                backoff = BACKOFF.0;
            }
            Err(RecvTimeoutError::Timeout) => backoff = (backoff * 2).min(BACKOFF.1),
            Err(RecvTimeoutError::Disconnected) if idle => return,
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(backoff),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{drain, pending_where, Capped, Caps, Reaper, RECLAIM_QUERIES};
    use crate::copy::copy;
    use crate::device::Device;
    use crate::memory::allocation::TrackedAllocation;
    use crate::memory::cache::{self, size_class, Cache, Place};
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
        assert!(pending_where(|_| true) >= 1, "the buffer was freed while its copy was queued");
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
        let by_count = Reaper::start(Caps { count: 2, bytes: usize::MAX }).unwrap();
        for _ in 0..2 {
            assert!(by_count.defer(gated_allocation(&stream, 64), Capped::Yes).is_ok());
        }
        let refused = by_count.defer(gated_allocation(&stream, 64), Capped::Yes).expect_err("a third taken");
        let uncapped = by_count.defer(gated_allocation(&stream, 64), Capped::No);
        assert!(uncapped.is_ok(), "an uncapped drop was refused");
        let held = |r: &Reaper| {
            let p = r.pending.lock();
            (p.outstanding.len(), p.bytes)
        };
        assert_eq!(held(&by_count), (3, 192));
        let by_bytes = Reaper::start(Caps { count: 100, bytes: 100 }).unwrap();
        assert!(by_bytes.defer(gated_allocation(&stream, 4096), Capped::Yes).is_ok(), "the first is refused");
        let refused_bytes =
            by_bytes.defer(gated_allocation(&stream, 1), Capped::Yes).expect_err("over the byte cap");
        assert!(!gate.passed(), "a defer waited for the gated work");
        let opener = gate.open_after(Duration::from_millis(20));
        by_count.drain();
        by_bytes.drain();
        assert!(gate.passed(), "drain returned before the work ran");
        assert_eq!(held(&by_count), (0, 0));
        assert_eq!(held(&by_bytes), (0, 0));
        drop((refused, refused_bytes));
        opener.join().unwrap();
    }

    /// `drain` waits for the allocations handed over before it, not for later ones: a thread
    /// that keeps deferring frees cannot hold it up (it used to wait for the count to reach 0).
    #[test]
    fn drain_waits_only_for_allocations_handed_over_before_it() {
        let reaper = Reaper::start(Caps { count: 100, bytes: usize::MAX }).unwrap();
        let (early, late) = (Stream::new(Device::Host).unwrap(), Stream::new(Device::Host).unwrap());
        let (early_gate, late_gate) = (Gate::hold(&early), Gate::hold(&late));
        assert!(reaper.defer(gated_allocation(&early, 64), Capped::Yes).is_ok());
        let end = reaper.next_ticket();
        // Handed over after the drain began.
        assert!(reaper.defer(gated_allocation(&late, 64), Capped::Yes).is_ok());
        let opener = early_gate.open_after(Duration::from_millis(20));
        reaper.wait_for_tickets_before(end, |_| true);
        assert!(early_gate.passed(), "drain returned before the earlier allocation's work");
        assert!(!late_gate.passed(), "drain waited for an allocation handed over after it began");
        opener.join().unwrap();
        drop(late_gate);
        reaper.drain();
    }

    /// `drain_where` waits only for the places it names: a pending allocation of another place
    /// does not hold it up although nothing will release it (the reaper's thread has not
    /// started); one of a named place does, until its work has run and the reaper released it.
    #[test]
    fn drain_where_waits_only_for_the_places_it_names() {
        let (reaper, wakes) = Reaper::paused(Caps { count: 100, bytes: usize::MAX });
        let reaper = std::sync::Arc::new(reaper);
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        assert!(reaper.defer(gated_allocation(&stream, 64), Capped::Yes).is_ok());
        let drain_in_thread = |place: Place| {
            let (reaper, (done, finished)) = (std::sync::Arc::clone(&reaper), std::sync::mpsc::channel());
            // Detached: a drain that never returns fails the test instead of hanging it.
            std::thread::spawn(move || {
                reaper.drain_where(|p| p == place);
                let _ = done.send(());
            });
            finished
        };
        let other = drain_in_thread(Place::CudaDevice(0));
        assert!(
            other.recv_timeout(Duration::from_secs(5)).is_ok(),
            "a drain of another place waited for a pending host allocation"
        );
        let host = drain_in_thread(Place::Host);
        assert!(
            host.recv_timeout(Duration::from_millis(50)).is_err(),
            "a drain of the host returned while a host allocation was pending"
        );
        gate.open_after(Duration::ZERO).join().unwrap();
        assert!(reaper.resume(wakes));
        assert!(host.recv_timeout(Duration::from_secs(5)).is_ok(), "the drain did not return after the free");
        assert!(reaper.pending.lock().outstanding.is_empty());
    }

    /// Idle allocations handed over to be freed (the cache's evictions) are taken past the
    /// caps and wait for the reaper's thread, not freed by the caller: with the thread paused
    /// they stay pending, and once it runs they are freed.
    #[test]
    fn evictions_are_freed_by_the_reaper_thread() {
        let (reaper, wakes) = Reaper::paused(Caps { count: 1, bytes: 1 });
        let allocs: Vec<_> = (0..3).map(|_| TrackedAllocation::host_zeroed(4096).unwrap()).collect();
        reaper.free_later(allocs);
        assert_eq!(reaper.pending.lock().outstanding.len(), 3, "an eviction was freed by the caller");
        assert!(reaper.resume(wakes));
        reaper.drain();
        assert!(reaper.waiting.lock().is_empty() && reaper.pending.lock().outstanding.is_empty());
    }

    /// A pending cached allocation is reclaimed by a miss of its place and size class once
    /// its work has finished, before any poll (this reaper's thread has not started), and is
    /// counted off; a busy one, another class or another place is not.
    #[test]
    fn an_idle_pending_allocation_is_reclaimed_before_any_poll() {
        let cache = Cache::new(cache::Caps { count: 8, bytes: 1 << 20 });
        let (reaper, wakes) = Reaper::paused(Caps { count: 100, bytes: usize::MAX });
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        let (alloc, _) = TrackedAllocation::cached_in(&cache, Place::Host, 10_000).unwrap();
        UseTracker::use_on(&stream, &[(&alloc.tracker, Access::Write)], || Ok(())).unwrap();
        let (ptr, class) = (alloc.ptr(), alloc.capacity());
        assert!(reaper.defer(alloc, Capped::Yes).is_ok());
        assert!(reaper.reclaim(&cache, Place::Host, class).is_none(), "reclaimed while its work was queued");
        gate.open_after(Duration::ZERO).join().unwrap();
        stream.synchronize().unwrap();
        assert!(reaper.reclaim(&cache, Place::Host, size_class(class + 1)).is_none(), "another class");
        assert!(reaper.reclaim(&cache, Place::CudaDevice(0), class).is_none(), "another place");
        let handles = stream.handle_count();
        let (again, pending) =
            reaper.reclaim(&cache, Place::Host, class).expect("an idle allocation was not reclaimed");
        assert_eq!((again.ptr(), pending), (ptr, true));
        assert!(
            reaper.pending.lock().outstanding.is_empty(),
            "a reclaimed allocation still counts as pending"
        );
        assert!(stream.handle_count() < handles, "the reclaimed tracker still holds its stream");
        drop(again.uncached());
        assert!(reaper.resume(wakes));
    }

    /// A reclaim asks at most `RECLAIM_QUERIES` trackers, then looks in the cache (where the
    /// reaper thread puts the allocations it finds idle).
    #[test]
    fn a_reclaim_queries_a_few_trackers_then_the_cache() {
        let cache = Cache::new(cache::Caps { count: 8, bytes: 1 << 20 });
        let (reaper, wakes) = Reaper::paused(Caps { count: 100, bytes: usize::MAX });
        let stream = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&stream);
        for _ in 0..RECLAIM_QUERIES {
            let (busy, _) = TrackedAllocation::cached_in(&cache, Place::Host, 64).unwrap();
            UseTracker::use_on(&stream, &[(&busy.tracker, Access::Write)], || Ok(())).unwrap();
            assert!(reaper.defer(busy, Capped::Yes).is_ok());
        }
        let (idle, _) = TrackedAllocation::cached_in(&cache, Place::Host, 64).unwrap();
        let class = idle.capacity();
        assert!(reaper.defer(idle, Capped::Yes).is_ok());
        assert!(reaper.reclaim(&cache, Place::Host, class).is_none(), "more trackers were queried");
        let (cached, _) = TrackedAllocation::cached_in(&cache, Place::Host, 64).unwrap();
        let ptr = cached.ptr();
        assert!(cache.give(cached).is_ok());
        let (from_cache, pending) =
            reaper.reclaim(&cache, Place::Host, class).expect("the cache was not asked");
        assert_eq!((from_cache.ptr(), pending), (ptr, false));
        drop(from_cache.uncached());
        gate.open_after(Duration::ZERO).join().unwrap();
        assert!(reaper.resume(wakes));
        reaper.drain();
        assert!(reaper.waiting.lock().is_empty());
    }

    /// An allocation whose tracker cannot be queried is leaked, but its tracker's streams are
    /// released: the stream's worker thread ends once every handle to it is gone.
    #[test]
    fn a_leaked_allocation_releases_its_streams() {
        let stream = Stream::new(Device::Host).unwrap();
        let alloc = gated_allocation(&stream, 64);
        stream.synchronize().unwrap();
        assert!(stream.handle_count() > 1, "the tracker holds no handle to its stream");
        crate::memory::leaked_on_purpose::keep(alloc.ptr());
        alloc.leak_memory();
        assert_eq!(stream.handle_count(), 1, "the leaked allocation kept its stream alive");
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
