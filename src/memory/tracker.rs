//! Use tracking: the ordering and lifetime protocol every buffer follows.
//!
//! Rules:
//! - Every operation declares how it uses each buffer: [`Access::Read`] or [`Access::Write`].
//!   Each buffer remembers the last write and the reads queued since it, at most one read per
//!   stream (a later read on a stream replaces the earlier one: stream order covers it), each
//!   as an event recorded right after the operation; the buffers of one operation share that
//!   event (one record per operation).
//! - Reads share a buffer: a read waits only for the last write (when queued on another
//!   stream), so reads on different streams run at once. A write waits for the last write and
//!   for every read since it (those on other streams). Uses of one buffer therefore keep the
//!   order they were queued in wherever one of them writes, whichever streams they were
//!   queued on.
//! - After the operation a read adds (or replaces) its stream's read entry and keeps the write;
//!   a write becomes the last write and clears the reads. A read that adds an entry first
//!   drops the read entries whose use has finished (those it can query without making another
//!   device current), so a buffer only ever read does not keep every stream that read it.
//! - A buffer named twice by one operation (read and written, or even read twice) counts as
//!   written: callers name a buffer they only read once.
//! - Before host code touches the memory, and before the memory is freed, the host waits for
//!   the last write and every read since it. Freeing therefore never races queued work; a free
//!   queued in stream order first makes its stream wait for every remembered use.
//! - The trackers' locks are held from the waits through the record, so two threads queueing
//!   on one buffer cannot interleave between an operation and its record. The one blocking
//!   wait there could be is not made under them: a CUDA stream waits for host-stream work
//!   by blocking the caller, and a host job ahead of that work may be queueing on the same
//!   buffers, so such work is waited for with the locks released, and the uses looked at
//!   again.
//! - An operation whose queueing failed is recorded too (it may have queued part of its work
//!   before failing); when even the record fails, the host waits for the stream instead,
//!   with the trackers still locked. cuferry's own jobs touch memory and events only, never
//!   a tracker, so that wait ends; a user's host function on that stream queueing work on the
//!   same buffers would deadlock it (record failures are rare: a dead host worker, a CUDA
//!   error).
//! - An operation locks its buffers' trackers in address order, whatever order the caller
//!   lists them in: two threads queueing on the same buffers cannot deadlock.
//! - Memory allocated in stream order (managed pools) names its allocation stream, which
//!   counts as the first write: the first use on another stream waits for that stream first.
//! - An event is recorded again (not made anew) only when every reference to it is one this
//!   operation replaces: for a read, its stream's read entries; for a write, all entries.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Result;
use crate::event::{Event, EventBackend};
use crate::stream::{Stream, StreamBackend};

/// How an operation uses a buffer (see the module rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only reads the memory: runs at once with other reads, after the last write.
    Read,
    /// Writes the memory (or may: prefetch, memset, anything unsure): runs after every
    /// earlier use.
    Write,
}

/// The unfinished host-stream uses among those a use on `stream` must follow, when `stream` is
/// a CUDA stream (which can wait for them only by blocking the host); none otherwise.
fn host_work_a_cuda_stream_awaits(
    stream: &Stream,
    locked: &[(Access, MutexGuard<'_, Uses>)],
) -> Result<Vec<Arc<Event>>> {
    let mut pending: Vec<Arc<Event>> = Vec::new();
    if !matches!(stream.backend(), StreamBackend::Cuda(_)) {
        return Ok(pending);
    }
    for (access, uses) in locked {
        for earlier in uses.awaited_by(*access) {
            let host = matches!(earlier.event.backend(), EventBackend::Host(_));
            if host && !pending.iter().any(|e| Arc::ptr_eq(e, &earlier.event)) && !earlier.event.query()? {
                pending.push(Arc::clone(&earlier.event));
            }
        }
    }
    Ok(pending)
}

/// One queued use of a buffer.
#[derive(Debug)]
struct Use {
    /// Recorded on `stream` right after the operation; shared by every buffer the operation
    /// used (one record per operation, not one per buffer).
    event: Arc<Event>,
    /// The stream the operation was queued on.
    stream: Stream,
}

/// The uses of one buffer that later ones may have to wait for.
#[derive(Debug, Default)]
struct Uses {
    /// The last write (for stream-ordered memory not written yet: possibly its allocation
    /// point on the origin stream). Every use before it finished before it did.
    write: Option<Use>,
    /// The reads queued since `write`, at most one per stream (the latest).
    reads: Vec<Use>,
}

impl Uses {
    /// The entries a use of `access` on `stream` replaces once recorded.
    fn replaced_by<'a>(&'a self, access: Access, stream: &'a Stream) -> impl Iterator<Item = &'a Use> + 'a {
        let write = match access {
            Access::Write => self.write.as_ref(),
            Access::Read => None,
        };
        let reads =
            self.reads.iter().filter(move |r| access == Access::Write || r.stream.id() == stream.id());
        write.into_iter().chain(reads)
    }

    /// The entries a use of `access` must be ordered after (on any stream).
    fn awaited_by(&self, access: Access) -> impl Iterator<Item = &Use> + '_ {
        let reads = match access {
            Access::Write => &self.reads[..],
            Access::Read => &[],
        };
        self.write.iter().chain(reads)
    }

    /// Every remembered entry: after all of them, every queued use has finished.
    fn all(&self) -> impl Iterator<Item = &Use> + '_ {
        self.awaited_by(Access::Write)
    }

    /// Records `used` as the latest use of `access`.
    fn record(&mut self, access: Access, used: Use) {
        match access {
            Access::Write => {
                self.write = Some(used);
                self.reads.clear();
            }
            Access::Read => match self.reads.iter_mut().find(|r| r.stream.id() == used.stream.id()) {
                Some(read) => *read = used,
                None => {
                    self.forget_finished_reads(&used.stream);
                    self.reads.push(used);
                }
            },
        }
    }

    /// Drops the read entries whose use has finished, before a read on a new stream is added:
    /// otherwise a buffer only ever read (weights, a shared input) would keep every stream
    /// that ever read it alive (a host stream's worker thread, a CUDA stream), and a write
    /// would wait on all of them. A finished entry orders nothing any more. Only events that
    /// `stream`'s use may query are asked: host events, and CUDA events of `stream`'s device
    /// when it is a CUDA stream (whose record this use makes anyway); querying another
    /// device's event on a thread with no current device would create a context on device 0.
    /// Entries whose query fails stay (the failure shows at the next wait).
    fn forget_finished_reads(&mut self, stream: &Stream) {
        let cuda_device = matches!(stream.backend(), StreamBackend::Cuda(_)).then(|| stream.device());
        self.reads.retain(|r| {
            let queryable = match r.event.backend() {
                EventBackend::Host(_) => true,
                EventBackend::Cuda(_) => cuda_device == Some(r.event.device()),
            };
            !(queryable && matches!(r.event.query(), Ok(true)))
        });
    }
}

/// Orders and tracks the asynchronous uses of one buffer.
#[derive(Debug, Default)]
pub(crate) struct UseTracker {
    uses: Mutex<Uses>,
    /// For stream-ordered allocations: the stream the memory was allocated on. The first use
    /// on another stream waits for that stream's work so far (the allocation included).
    origin: Option<Stream>,
}

impl UseTracker {
    /// A tracker for memory allocated in stream order on `origin`.
    pub(crate) fn with_origin(origin: Stream) -> Self {
        UseTracker { uses: Mutex::default(), origin: Some(origin) }
    }

    /// How many uses are remembered (for tests).
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.lock().all().count()
    }

    /// The allocation stream of stream-ordered memory.
    pub(crate) fn origin(&self) -> Option<&Stream> {
        self.origin.as_ref()
    }

    fn lock(&self) -> MutexGuard<'_, Uses> {
        self.uses.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For a free queued in stream order: a stream after whose current end every queued use of
    /// the buffer has finished. It is the stream of a remembered use (else, for memory never
    /// used, the allocation stream), made to wait here for the other remembered uses' events.
    /// `None` when some remembered use (or the allocation) is on a stream `accept` refuses:
    /// the caller then waits on the host instead.
    ///
    /// The caller must hold the buffer exclusively (no use queued concurrently), as `Drop` does.
    pub(crate) fn join_uses_on(&self, accept: impl Fn(&Stream) -> bool) -> Result<Option<Stream>> {
        let uses = self.lock();
        let Some(first) = uses.all().next() else {
            return Ok(self.origin.clone().filter(|s| accept(s)));
        };
        if !uses.all().all(|u| accept(&u.stream)) {
            return Ok(None);
        }
        let joined = first.stream.clone();
        let mut waited: Vec<&Arc<Event>> = Vec::new();
        for u in uses.all() {
            if u.stream.id() != joined.id() && !waited.iter().any(|e| Arc::ptr_eq(e, &u.event)) {
                joined.wait_event(&u.event)?;
                waited.push(&u.event);
            }
        }
        Ok(Some(joined))
    }

    /// Queues an operation on `stream` that uses every buffer in `uses` as its [`Access`]
    /// says: orders it after the earlier uses it must follow, runs `enqueue` (which queues the
    /// operation), and records the use.
    ///
    /// A tracker listed twice (read and written, or even read twice) counts once, as written:
    /// callers list a buffer they only read once.
    pub(crate) fn use_on(
        stream: &Stream,
        uses: &[(&UseTracker, Access)],
        enqueue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        // Locked in one global order (by address): two operations naming the same buffers in
        // different orders, on two threads, would otherwise deadlock. Nothing below depends on
        // the caller's order. Duplicates merge (a write wins), so no lock is taken twice.
        let mut listed: Vec<(&UseTracker, Access)> = uses.to_vec();
        listed.sort_unstable_by_key(|(t, _)| std::ptr::from_ref::<UseTracker>(t) as usize);
        let mut merged: Vec<(&UseTracker, Access)> = Vec::with_capacity(listed.len());
        for (tracker, access) in listed {
            match merged.last_mut() {
                // Named twice (a copy within one buffer, ...): conservatively a write.
                Some((last, a)) if std::ptr::eq(*last, tracker) => *a = Access::Write,
                _ => merged.push((tracker, access)),
            }
        }
        let mut locked = loop {
            let mut locked: Vec<(Access, MutexGuard<'_, Uses>)> =
                merged.iter().map(|(t, access)| (*access, t.lock())).collect();
            // Stream-ordered memory not written yet: its allocation counts as the first write,
            // made an entry (an event on the allocation stream) the first time another stream
            // uses it.
            for ((tracker, _), (_, uses)) in merged.iter().zip(locked.iter_mut()) {
                match &tracker.origin {
                    Some(origin) if uses.write.is_none() && origin.id() != stream.id() => {
                        let allocated = Arc::new(Event::new(origin.device())?);
                        allocated.record(origin)?;
                        uses.write = Some(Use { event: allocated, stream: origin.clone() });
                    }
                    _ => {}
                }
            }
            // A CUDA stream waits for host-stream work by blocking this thread: block with the
            // locks released (a host job ahead of that work may be queueing on these very
            // buffers), then look again, since uses may have been added meanwhile.
            let host_work = host_work_a_cuda_stream_awaits(stream, &locked)?;
            if host_work.is_empty() {
                break locked;
            }
            drop(locked);
            for event in host_work {
                event.synchronize()?;
            }
        };
        let mut waited: Vec<&Arc<Event>> = Vec::new();
        for (access, uses) in &locked {
            for earlier in uses.awaited_by(*access) {
                // Buffers used together earlier share one event: wait for it once.
                if earlier.stream.id() != stream.id()
                    && !waited.iter().any(|e| Arc::ptr_eq(e, &earlier.event))
                {
                    stream.wait_event(&earlier.event)?;
                    waited.push(&earlier.event);
                }
            }
        }
        drop(waited);
        // A failed `enqueue` may have queued part of its work (several launches, the first
        // ones accepted): the use is recorded all the same, so nothing is freed under it.
        let enqueued = enqueue();
        let recorded = reusable_event(&locked, stream)
            .map_or_else(|| Event::new(stream.device()).map(Arc::new), Ok)
            .and_then(|event| event.record(stream).map(|()| event));
        match recorded {
            Ok(event) => {
                for (access, uses) in &mut locked {
                    uses.record(*access, Use { event: Arc::clone(&event), stream: stream.clone() });
                }
                enqueued
            }
            Err(err) => {
                // The operation may be queued but is untracked: wait for it here so nothing is
                // freed under it, then report the first failure.
                let _ = stream.wait_idle();
                enqueued.and(Err(err))
            }
        }
    }

    /// Blocks until every operation queued on the buffer so far has finished: the last write
    /// and every read since it (for stream-ordered memory never used yet: until its allocation
    /// stream reached the allocation).
    pub(crate) fn wait_idle(&self) -> Result<()> {
        self.pending_events()?.iter().try_for_each(|event| event.synchronize())
    }

    /// True when no queued operation on the buffer is still pending; does not block.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        for event in self.pending_events()? {
            if !event.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The events the host waits for: every remembered use's, or, for stream-ordered memory
    /// not used yet, one recorded now on the allocation stream, which becomes the buffer's
    /// first write (the host must not touch the memory before the stream reached the
    /// allocation). A read entry on the allocation stream also covers the allocation.
    fn pending_events(&self) -> Result<Vec<Arc<Event>>> {
        let mut uses = self.lock();
        let mut events: Vec<Arc<Event>> = Vec::new();
        for u in uses.all() {
            if !events.iter().any(|e| Arc::ptr_eq(e, &u.event)) {
                events.push(Arc::clone(&u.event));
            }
        }
        if !events.is_empty() {
            return Ok(events);
        }
        let Some(origin) = &self.origin else { return Ok(events) };
        let event = Arc::new(Event::new(origin.device())?);
        event.record(origin)?;
        uses.write = Some(Use { event: Arc::clone(&event), stream: origin.clone() });
        Ok(vec![event])
    }
}

/// An event of these buffers that may be recorded again for this use: one of `stream`'s
/// device every reference to which is an entry this use replaces (re-recording moves it
/// later, which only the entries being replaced here may see; each of them is ordered before
/// this use, by a wait or by `stream`'s order).
fn reusable_event(locked: &[(Access, MutexGuard<'_, Uses>)], stream: &Stream) -> Option<Arc<Event>> {
    let replaced = || locked.iter().flat_map(|(access, uses)| uses.replaced_by(*access, stream));
    replaced().find_map(|candidate| {
        let holders = replaced().filter(|u| Arc::ptr_eq(&u.event, &candidate.event)).count();
        (candidate.event.device() == stream.device() && Arc::strong_count(&candidate.event) == holders)
            .then(|| Arc::clone(&candidate.event))
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::thread;
    use std::time::Duration;

    use super::{Access, UseTracker};
    use crate::device::Device;
    use crate::error::Result;
    use crate::stream::test_gate::Gate;
    use crate::stream::Stream;

    /// How long a gate holds its stream at most (a failing test then unwinds).
    const GATE: Duration = Duration::from_secs(10);
    /// How long a test waits for something that must happen (well below `GATE`).
    const MUST: Duration = Duration::from_secs(5);
    /// How long a test watches for something that must not happen yet.
    const MUST_NOT: Duration = Duration::from_millis(150);

    fn host_stream() -> Stream {
        Stream::new(Device::Host).unwrap()
    }

    /// Queues on `stream`, as a use of `uses`, a job that waits for the returned sender (or
    /// `GATE`), then sets the returned flag.
    fn gated_use(stream: &Stream, uses: &[(&UseTracker, Access)]) -> (mpsc::Sender<()>, Arc<AtomicBool>) {
        let (release, gate) = mpsc::channel::<()>();
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        UseTracker::use_on(stream, uses, || {
            stream.host_fn(move || {
                let _ = gate.recv_timeout(GATE);
                flag.store(true, Ordering::SeqCst);
            })
        })
        .unwrap();
        (release, done)
    }

    /// Queues on `stream`, as a use of `uses`, a job that notes whether each of `flags` was set
    /// when it ran.
    fn noting_use(
        stream: &Stream,
        uses: &[(&UseTracker, Access)],
        flags: &[&Arc<AtomicBool>],
    ) -> Arc<std::sync::Mutex<Vec<bool>>> {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (out, flags): (_, Vec<_>) = (Arc::clone(&seen), flags.iter().map(|f| Arc::clone(f)).collect());
        UseTracker::use_on(stream, uses, || {
            stream.host_fn(move || {
                *out.lock().unwrap() = flags.iter().map(|f| f.load(Ordering::SeqCst)).collect();
            })
        })
        .unwrap();
        seen
    }

    /// Runs `wait` on a thread; the receiver hears when it returned (a wait that never returns
    /// does not hang the test).
    fn in_thread(wait: impl FnOnce() -> Result<()> + Send + 'static) -> mpsc::Receiver<()> {
        let (done, finished) = mpsc::channel();
        thread::spawn(move || {
            wait().unwrap();
            let _ = done.send(());
        });
        finished
    }

    /// Two operations on buffers `a` and `b`, listed in opposite orders, on two threads,
    /// while a third use holds `b`: locked in list order, one held `a` waiting for `b` and
    /// the other got `b` and waited for `a`, for good.
    #[test]
    fn trackers_listed_in_opposite_orders_never_deadlock() {
        let (a, b) = (Arc::new(UseTracker::default()), Arc::new(UseTracker::default()));
        for round in 0..10 {
            let (done, finished) = mpsc::channel::<()>();
            let holder = {
                let b = Arc::clone(&b);
                thread::spawn(move || {
                    let stream = Stream::new(Device::Host).unwrap();
                    UseTracker::use_on(&stream, &[(&b, Access::Write)], || {
                        thread::sleep(Duration::from_millis(30));
                        Ok(())
                    })
                    .unwrap();
                })
            };
            let users: Vec<_> = [false, true]
                .into_iter()
                .map(|reversed| {
                    let (a, b, done) = (Arc::clone(&a), Arc::clone(&b), done.clone());
                    thread::spawn(move || {
                        thread::sleep(Duration::from_millis(10));
                        let stream = Stream::new(Device::Host).unwrap();
                        let (a, b) = ((&*a, Access::Read), (&*b, Access::Write));
                        let list = if reversed { [b, a] } else { [a, b] };
                        UseTracker::use_on(&stream, &list, || Ok(())).unwrap();
                        done.send(()).unwrap();
                    })
                })
                .collect();
            for _ in 0..2 {
                assert!(
                    finished.recv_timeout(Duration::from_secs(10)).is_ok(),
                    "round {round}: two uses of the same buffers deadlocked"
                );
            }
            holder.join().unwrap();
            users.into_iter().for_each(|u| u.join().unwrap());
        }
    }

    /// An operation that queues work and then fails (the seed baseline's launches, the first
    /// ones accepted) is still recorded: waiting for the buffer waits for the queued part,
    /// and the failure is returned.
    #[test]
    fn a_failed_operation_still_tracks_what_it_queued() {
        let stream = Stream::new(Device::Host).unwrap();
        let tracker = UseTracker::default();
        let ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ran);
        let result = UseTracker::use_on(&stream, &[(&tracker, Access::Write)], || {
            stream.host_fn(move || {
                thread::sleep(Duration::from_millis(100));
                flag.store(true, Ordering::SeqCst);
            })?;
            Err(crate::error::Error::invalid("the second launch was refused"))
        });
        assert!(
            matches!(result, Err(crate::error::Error::InvalidArgument { .. })),
            "the failure is returned: {result:?}"
        );
        tracker.wait_idle().unwrap();
        assert!(ran.load(Ordering::SeqCst), "wait_idle returned before the queued part ran");
    }

    /// Stream-ordered memory never used yet: the host waits for the allocation stream's work
    /// queued before it (a reused block may still be read there), not for nothing.
    #[test]
    fn host_access_to_unused_stream_ordered_memory_waits_for_its_stream() {
        let origin = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&origin);
        let tracker = UseTracker::with_origin(origin.clone());
        assert!(!tracker.is_idle().unwrap(), "the allocation stream is still busy");
        let releaser = gate.open_after(Duration::from_millis(20));
        tracker.wait_idle().unwrap();
        releaser.join().unwrap();
        assert!(gate.passed(), "wait_idle returned before the allocation stream's work");
        assert!(tracker.is_idle().unwrap());
        // A plain tracker has nothing to wait for.
        let plain = UseTracker::default();
        assert!(plain.is_idle().unwrap());
        plain.wait_idle().unwrap();
    }

    /// Two reads of one buffer on two streams run at once: the second completes while the
    /// first is still held (the old rule ordered every use after the last one, reads
    /// included, and the second waited for the first).
    #[test]
    fn reads_on_two_streams_run_at_once() {
        let (a, b) = (host_stream(), host_stream());
        let tracker = Arc::new(UseTracker::default());
        let (release, first_done) = gated_use(&a, &[(&tracker, Access::Read)]);
        let seen = noting_use(&b, &[(&tracker, Access::Read)], &[&first_done]);
        let b2 = b.clone();
        let second = in_thread(move || b2.synchronize());
        assert!(second.recv_timeout(MUST).is_ok(), "the second read waited for the first");
        assert_eq!(*seen.lock().unwrap(), vec![false], "the reads did not overlap");
        assert!(!tracker.is_idle().unwrap(), "the first read is still pending");
        release.send(()).unwrap();
        tracker.wait_idle().unwrap();
        assert!(first_done.load(Ordering::SeqCst));
    }

    /// A write after reads on two streams waits for both, whichever finishes last.
    #[test]
    fn a_write_after_reads_on_two_streams_waits_for_both() {
        let (a, b, c) = (host_stream(), host_stream(), host_stream());
        let tracker = UseTracker::default();
        let (release_a, a_done) = gated_use(&a, &[(&tracker, Access::Read)]);
        let (release_b, b_done) = gated_use(&b, &[(&tracker, Access::Read)]);
        let seen = noting_use(&c, &[(&tracker, Access::Write)], &[&a_done, &b_done]);
        let c2 = c.clone();
        let write = in_thread(move || c2.synchronize());
        // The later read released first: a write ordered after it alone would run now.
        release_b.send(()).unwrap();
        assert!(write.recv_timeout(MUST_NOT).is_err(), "the write ran while a read was held");
        release_a.send(()).unwrap();
        assert!(write.recv_timeout(MUST).is_ok(), "the write never ran");
        assert_eq!(*seen.lock().unwrap(), vec![true, true], "the write ran before a read finished");
    }

    /// A read waits for the last write (on another stream), and a write for the last write.
    #[test]
    fn a_read_after_a_write_waits_for_it() {
        let (a, b) = (host_stream(), host_stream());
        let tracker = UseTracker::default();
        let (release, written) = gated_use(&a, &[(&tracker, Access::Write)]);
        let seen = noting_use(&b, &[(&tracker, Access::Read)], &[&written]);
        let b2 = b.clone();
        let read = in_thread(move || b2.synchronize());
        assert!(read.recv_timeout(MUST_NOT).is_err(), "the read ran while the write was held");
        release.send(()).unwrap();
        assert!(read.recv_timeout(MUST).is_ok(), "the read never ran");
        assert_eq!(*seen.lock().unwrap(), vec![true], "the read ran before the write finished");
        // A write after that read and the write: after both.
        let (release, read_done) = gated_use(&b, &[(&tracker, Access::Read)]);
        let seen = noting_use(&a, &[(&tracker, Access::Write)], &[&read_done]);
        release.send(()).unwrap();
        a.synchronize().unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![true]);
    }

    /// `wait_idle` and `is_idle` cover every reader, not only the last one.
    #[test]
    fn wait_idle_waits_for_all_readers() {
        let (a, b) = (host_stream(), host_stream());
        let tracker = Arc::new(UseTracker::default());
        let (release_a, a_done) = gated_use(&a, &[(&tracker, Access::Read)]);
        let (release_b, b_done) = gated_use(&b, &[(&tracker, Access::Read)]);
        let t = Arc::clone(&tracker);
        let idle = in_thread(move || t.wait_idle());
        release_b.send(()).unwrap();
        b.synchronize().unwrap();
        assert!(!tracker.is_idle().unwrap(), "is_idle ignored the first reader");
        assert!(idle.recv_timeout(MUST_NOT).is_err(), "wait_idle returned with a reader pending");
        release_a.send(()).unwrap();
        assert!(idle.recv_timeout(MUST).is_ok(), "wait_idle never returned");
        assert!(a_done.load(Ordering::SeqCst) && b_done.load(Ordering::SeqCst));
        assert!(tracker.is_idle().unwrap());
    }

    /// Reads on one stream keep one entry (the latest); a write replaces them all; an
    /// operation naming a buffer twice writes it. (Both streams are held, so no read finishes
    /// and none is forgotten.)
    #[test]
    fn same_stream_reads_collapse_to_one_entry() {
        let (a, b) = (host_stream(), host_stream());
        let held = (Gate::hold(&a), Gate::hold(&b));
        let tracker = UseTracker::default();
        let reads = |t: &UseTracker| t.lock().reads.iter().map(|r| r.stream.id()).collect::<Vec<_>>();
        for stream in [&a, &a, &b, &a, &b, &a] {
            UseTracker::use_on(stream, &[(&tracker, Access::Read)], || Ok(())).unwrap();
        }
        assert_eq!(reads(&tracker), vec![a.id(), b.id()]);
        assert!(tracker.lock().write.is_none());
        UseTracker::use_on(&b, &[(&tracker, Access::Write)], || Ok(())).unwrap();
        assert!(reads(&tracker).is_empty());
        assert_eq!(tracker.lock().write.as_ref().map(|w| w.stream.id()), Some(b.id()));
        UseTracker::use_on(&a, &[(&tracker, Access::Read)], || Ok(())).unwrap();
        UseTracker::use_on(&b, &[(&tracker, Access::Read), (&tracker, Access::Read)], || Ok(())).unwrap();
        assert!(reads(&tracker).is_empty(), "a buffer named twice counts as written");
        assert_eq!(tracker.lock().write.as_ref().map(|w| w.stream.id()), Some(b.id()));
        drop(held);
        tracker.wait_idle().unwrap();
    }

    /// The event-reuse optimisation never moves an event that an entry this use keeps still
    /// names: another buffer's read entry, or the same buffer's write.
    #[test]
    fn event_reuse_never_moves_an_event_another_buffer_still_names() {
        let (a, b) = (host_stream(), host_stream());
        // Another buffer: `t1` and `t2` read together on `a` share one event; a held read of
        // `t1` alone on `a` must not move it, or waiting for `t2` waits for the hold.
        let (t1, t2) = (UseTracker::default(), Arc::new(UseTracker::default()));
        UseTracker::use_on(&a, &[(&t1, Access::Read), (&*t2, Access::Read)], || Ok(())).unwrap();
        let (release, _) = gated_use(&a, &[(&t1, Access::Read)]);
        let t = Arc::clone(&t2);
        let idle = in_thread(move || t.wait_idle());
        assert!(idle.recv_timeout(MUST).is_ok(), "t2's event was moved behind t1's later read");
        release.send(()).unwrap();
        t1.wait_idle().unwrap();
        // The same buffer's write: a held read on the write's stream must not move the write's
        // event, or a read on another stream waits for the hold.
        let tracker = UseTracker::default();
        UseTracker::use_on(&a, &[(&tracker, Access::Write)], || Ok(())).unwrap();
        let (release, held) = gated_use(&a, &[(&tracker, Access::Read)]);
        let seen = noting_use(&b, &[(&tracker, Access::Read)], &[&held]);
        let b2 = b.clone();
        let read = in_thread(move || b2.synchronize());
        assert!(read.recv_timeout(MUST).is_ok(), "the write's event was moved behind a read");
        assert_eq!(*seen.lock().unwrap(), vec![false]);
        release.send(()).unwrap();
        tracker.wait_idle().unwrap();
        // Reuse still happens where it is sound: repeated reads on one stream keep one event.
        UseTracker::use_on(&a, &[(&tracker, Access::Read)], || Ok(())).unwrap();
        let first =
            tracker.lock().reads.iter().find(|r| r.stream.id() == a.id()).map(|r| Arc::clone(&r.event));
        let first = first.unwrap();
        UseTracker::use_on(&a, &[(&tracker, Access::Read)], || Ok(())).unwrap();
        let again = tracker.lock().reads.iter().any(|r| Arc::ptr_eq(&r.event, &first));
        assert!(!again, "an event still named by `first` (a clone held here) was reused");
        drop(first);
        let first =
            tracker.lock().reads.iter().find(|r| r.stream.id() == a.id()).map(|r| Arc::as_ptr(&r.event));
        UseTracker::use_on(&a, &[(&tracker, Access::Read)], || Ok(())).unwrap();
        let now =
            tracker.lock().reads.iter().find(|r| r.stream.id() == a.id()).map(|r| Arc::as_ptr(&r.event));
        assert_eq!(now, first, "a read's own entry was not reused");
        tracker.wait_idle().unwrap();
    }

    /// Stream-ordered memory first read on its allocation stream, then read on another: the
    /// second read still waits for the allocation stream's earlier work.
    #[test]
    fn a_read_away_from_the_allocation_stream_waits_for_it() {
        let (origin, b) = (host_stream(), host_stream());
        let (release, gate) = mpsc::channel::<()>();
        let allocated = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&allocated);
        origin
            .host_fn(move || {
                let _ = gate.recv_timeout(GATE);
                flag.store(true, Ordering::SeqCst);
            })
            .unwrap();
        let tracker = UseTracker::with_origin(origin.clone());
        UseTracker::use_on(&origin, &[(&tracker, Access::Read)], || Ok(())).unwrap();
        let seen = noting_use(&b, &[(&tracker, Access::Read)], &[&allocated]);
        release.send(()).unwrap();
        b.synchronize().unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![true], "the read ran before the allocation");
        tracker.wait_idle().unwrap();
    }

    /// A stream-ordered free joins every reader's stream: the stream picked waits for the
    /// others; a refused stream makes the caller wait on the host.
    #[test]
    fn joining_the_uses_orders_one_stream_after_every_reader() {
        let (a, b) = (host_stream(), host_stream());
        let tracker = UseTracker::default();
        assert!(tracker.join_uses_on(|_| true).unwrap().is_none(), "nothing to join");
        let (release_a, a_done) = gated_use(&a, &[(&tracker, Access::Read)]);
        let (release_b, b_done) = gated_use(&b, &[(&tracker, Access::Read)]);
        assert!(tracker.join_uses_on(|s| s.id() == a.id()).unwrap().is_none(), "b was refused");
        let joined = tracker.join_uses_on(|_| true).unwrap().unwrap();
        let seen = noting_use(&joined, &[], &[&a_done, &b_done]);
        release_a.send(()).unwrap();
        release_b.send(()).unwrap();
        joined.synchronize().unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![true, true], "the joined stream ran ahead of a reader");
        let origin = host_stream();
        let fresh = UseTracker::with_origin(origin.clone());
        assert_eq!(fresh.join_uses_on(|_| true).unwrap().map(|s| s.id()), Some(origin.id()));
    }

    /// A buffer only ever read, by many short-lived streams: finished reads are forgotten when
    /// a new stream reads, so the tracker keeps neither their entries nor their streams (each
    /// host stream a worker thread); unfinished ones stay, and a write still waits for them.
    #[test]
    fn finished_reads_of_other_streams_are_forgotten() {
        let tracker = UseTracker::default();
        let held = host_stream();
        let (release, held_done) = gated_use(&held, &[(&tracker, Access::Read)]);
        let mut dropped = Vec::new();
        for _ in 0..50 {
            let reader = host_stream();
            UseTracker::use_on(&reader, &[(&tracker, Access::Read)], || Ok(())).unwrap();
            reader.synchronize().unwrap();
            dropped.push(reader.errors());
        }
        assert_eq!(tracker.remembered(), 2, "the gated read and the last one");
        let kept = dropped.iter().rev().skip(1).filter(|s| !s.is_spent()).count();
        assert_eq!(kept, 0, "finished readers' streams kept alive");
        let writer = host_stream();
        let seen = noting_use(&writer, &[(&tracker, Access::Write)], &[&held_done]);
        release.send(()).unwrap();
        writer.synchronize().unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![true], "the write ran before an unfinished read");
    }
}
